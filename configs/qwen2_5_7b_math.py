"""GRPO on Qwen2.5-7B for verifiable math, in the spirit of the TLT recipes (VeRL GSM8K/DAPO
style): n=8, temperature 1.0, lr 1e-6, low-variance KL 0.001, long responses, speculative
rollout in the long tail with an online-trained drafter.

Nothing is downloaded: give local paths on the command line, e.g. on one 8-GPU host

  python -m tlt_jax.train --config configs/qwen2_5_7b_math.py --workdir /runs/q7b \\
      --config.model.path=/ckpt/Qwen2.5-7B-Instruct \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl \\
      --config.data.prompt_key=prompt --config.data.answer_key=answer \\
      --config.tlt.drafter.init=/ckpt/q7b_drafter   # from scripts/train_drafter.py; or init:0

Mesh: the learner is FSDP over every device; each GPU is one rollout replica
(rollout.num_workers x rollout.tensor_parallel = devices). On several hosts see
scripts/slurm/train_2x8.sbatch; `scripts/plan_memory.py --config configs/qwen2_5_7b_math.py`
prints the per-GPU memory plan (rollout.max_batch=0: sized from it).

On one GPU the whole model's learner does not fit (float32 weights and Adam moments: 85 GiB);
LoRA adapters over the frozen bf16 model do (docs/training.md, LoRA; LoRA usually wants a
learning rate ~10x the whole model's):

  python -m tlt_jax.train --config configs/qwen2_5_7b_math.py ... \
      --config.rollout.num_workers=1 --config.model.lora.rank=64 \
      --config.grpo.micro_batch_tokens=9216 --config.optim.lr=1e-5
"""

import os

import ml_collections

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
  c.workdir = "workdirs/qwen2_5_7b_math"
  c.model.path = "/path/to/Qwen2.5-7B-Instruct"  # --config.model.path=...
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"  # master weights and Adam moments in f32, compute in bf16
  c.model.remat = True
  # keep the projections' outputs (no matmul recomputed: the update ~3 forwards, not 4): the
  # update phase plans at 42.5 of 67.1 GiB per H100 (scripts/plan_memory.py); the 32B and 70B
  # recipes, at 17k tokens per device, need "full"
  c.model.remat_policy = "dots"
  c.model.architecture = "qwen2.5-7b"  # the plan's shape where model.path is not local
  c.cpu_devices = 0
  c.mesh.devices = 0  # the learner spans every GPU

  c.data.train_path = "/path/to/train.parquet"  # --config.data.train_path=...
  c.data.test_path = "/path/to/test.jsonl"
  c.data.max_prompt_len = 1024
  c.data.chat_template = True
  c.data.system_prompt = ("Please reason step by step, and put your final answer within "
                          "\\boxed{}.")

  c.reward.name = "math"
  c.reward.num_workers = 16
  c.reward.timeout = 20.0

  c.rollout.max_batch = 0  # sized from the memory the rollout phase leaves (tlt_jax/memory.py)
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  # rows are admitted by the KV pages they hold (most responses are far shorter than 8k):
  # max_batch = 0 is sized for rows of 2k tokens on average; longer ones make the youngest wait
  c.rollout.mean_live_tokens = 2048
  c.rollout.chunk_size = 32
  c.rollout.prompt_bucket = 256
  c.rollout.max_new_tokens = 8192
  c.rollout.temperature = 1.0
  c.rollout.num_workers = 8
  c.rollout.tensor_parallel = 1

  c.grpo.num_prompts = 128
  c.grpo.n = 8
  c.grpo.kl_coef = 0.001
  c.grpo.clip_ratio_c = 3.0  # dual-clip at VeRL's default bound
  c.grpo.micro_batch = 8
  c.grpo.micro_batch_tokens = 65536  # ~8k tokens per GPU per micro-batch
  c.grpo.minibatches = 4
  c.grpo.pad_multiple = 512

  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.b2 = 0.999

  c.train.steps = 500
  c.train.eval_every = 25
  c.train.checkpoint_every = 10
  c.train.keep_checkpoints = 3

  c.eval.speculate = True
  c.eval.num_prompts = 0
  c.eval.batch_size = 128

  c.tlt.drafter.init = "init:0"  # --config.tlt.drafter.init=DIR for a warm-started one
  c.tlt.drafter.lr = 1e-4
  c.tlt.drafter.warmup_steps = 50
  c.tlt.drafter.rows = 8
  c.tlt.drafter.row_len = 2048
  c.tlt.drafter.window = 512
  c.tlt.drafter.context = 1024  # the prompt and earlier response a window drafts with
  c.tlt.drafter.acceptance_response_len = 1024  # the response's start, per metric sample
  c.tlt.drafter.windows_per_response = 2
  c.tlt.drafter.buffer_tokens = 1 << 18  # ~1.9 GB of bf16 hidden states (d = 3584)
  c.tlt.drafter.serial_steps = 16
  c.tlt.spec.strategy = "6_1_7"
  # No cap on the live batch speculation runs at (the paper's recipe speculates under 32
  # rows): at 7B on an H100 a step of 64-216 rows is still bound by bytes, so drafts
  # pay in the bulk too, and the gate measures where they do (docs/scale.md). Patience 1: a
  # batch speculates from its first chunk where the gate allows.
  c.tlt.spec.bs_threshold = 0
  c.tlt.spec.patience = 1
  c.tlt.spec.max_steps = 8

  c.memory.device = "h100"  # plan and check for 80 GB GPUs ("" = whatever this machine has)
  c.memory.num_devices = 8
  assert isinstance(c, ml_collections.ConfigDict)
  return c
