"""GRPO on Qwen3-30B-A3B (a mixture of experts: 30.5B parameters, 3.3B a token) for verifiable
math: the Qwen2.5-7B recipe (configs/qwen2_5_7b_math.py: n=8, temperature 1.0, low-variance
KL 0.001, 8k-token responses, speculative rollout with an online-trained drafter) on 2 nodes x
8 GPUs (80 GB): FSDP training over all 16 GPUs (the experts split whole over them) and four
4-way tensor-parallel rollout replicas (61 GB of bf16 weights each: 15 GB a GPU, which leaves
room for 256 rows of 8k tokens; at 2-way the plan holds 88 rows a replica and rows are
preempted for pages, docs/scale.md). The drafter is one dense
Qwen3 layer of the model's width (intermediate_size 6144), as the serving engines' drafters of
Qwen3-MoE are. What speculation costs differs from a dense target's: a verification of K+1
tokens reads the experts all of them route to (~35 of 128 for 5 tokens of one row, where a
decode step reads 8), so drafts pay less per accepted token (docs/scale.md, "Mixture-of-experts
targets").

  srun --nodes=2 --ntasks-per-node=8 --gpus-per-task=1 \\
    python -m tlt_jax.train --config configs/qwen3_30b_a3b_math.py --workdir /runs/q3_30b \\
      --config.model.path=/ckpt/Qwen3-30B-A3B \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl

`scripts/plan_memory.py --config configs/qwen3_30b_a3b_math.py` prints the per-GPU plan
(model.architecture names the shipped shape where model.path is not local).
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/qwen3_30b_a3b_math"
  c.model.path = "/path/to/Qwen3-30B-A3B"  # --config.model.path=...
  c.model.architecture = "qwen3-30b-a3b"
  c.model.remat_policy = "full"
  c.rollout.num_workers = 4  # 16 GPUs / tensor_parallel 4
  c.rollout.tensor_parallel = 4
  c.rollout.max_batch = 0  # sized from memory
  c.tlt.drafter.buffer_tokens = 1 << 19  # ~2.1 GB of bf16 hidden states (d = 2048)
  c.grpo.micro_batch = 16  # a multiple of the 16-device FSDP mesh
  c.memory.device = "h100"
  c.memory.num_devices = 16
  return c
