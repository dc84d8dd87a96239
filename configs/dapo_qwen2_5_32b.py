"""DAPO (Yu et al. 2025, arXiv:2503.14476) on Qwen2.5-32B: the paper's recipe on this
project's 32B cluster layout (configs/qwen2_5_32b_math.py: 4 nodes x 8 GPUs, FSDP training over
all 32, eight 4-way tensor-parallel rollout replicas), TLT on.

DAPO's four parts, as this project names them:
  clip-higher           grpo.eps_low 0.2, grpo.eps_high 0.28
  dynamic sampling      grpo.filter_groups with a gen batch of 3x the train batch
                        (grpo.gen_prompts 1536 for grpo.num_prompts 512), at most 10 rollouts
  token-level loss      grpo.loss_agg "token-mean"
  overlong shaping      reward.overlong_buffer 4096 (penalty 1.0) under a 20480-token budget
and its other settings: 16 responses a prompt, no KL term, lr 1e-6 with 10 warm-up steps,
weight decay 0.1, 16 optimizer steps a batch (mini-batches of 32 prompts), evaluation as
avg@32 (temperature 1.0, top_p 0.7).

  srun --nodes=4 --ntasks-per-node=8 --gpus-per-task=1 \\
    python -m tlt_jax.train --config configs/dapo_qwen2_5_32b.py --workdir /runs/dapo32b \\
      --config.model.path=/ckpt/Qwen2.5-32B \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl

What the cluster simulator predicts for it: `python -m tlt_jax.plan --config
configs/dapo_qwen2_5_32b.py --hardware h100` (docs/scale.md).
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_32b_math.py"))
  c.workdir = "workdirs/dapo_qwen2_5_32b"
  c.model.path = "/path/to/Qwen2.5-32B"  # --config.model.path=... (DAPO starts from the base)
  c.rollout.max_new_tokens = 20480  # 16384 expected + the 4096-token soft overlong buffer
  c.rollout.mean_live_tokens = 6144  # rows sized for longer responses than the 16k recipe's
  c.reward.overlong_buffer = 4096
  c.reward.overlong_penalty = 1.0
  c.grpo.num_prompts = 512
  c.grpo.n = 16
  c.grpo.filter_groups = True
  c.grpo.gen_prompts = 1536
  c.grpo.max_rollouts = 10
  c.grpo.kl_coef = 0.0
  c.grpo.clip_ratio_c = 10.0  # dual-clip as verl's DAPO recipe bounds it
  # (inherited as DAPO has them: temperature 1.0, eps 0.2 / 0.28, token-mean, 10 warm-up
  # steps, gradient clip 1.0)
  c.grpo.minibatches = 16  # mini-batches of 32 prompts x 16 responses
  c.optim.lr = 1e-6
  c.optim.weight_decay = 0.1
  c.eval.n = 32  # AIME as avg@32
  c.eval.temperature = 1.0
  c.eval.top_p = 0.7
  return c
