"""GRPO on Qwen2.5-32B for verifiable math: the 7B recipe (configs/qwen2_5_7b_math.py) on one
8-GPU host, with 4-way tensor-parallel rollout replicas and rematerialised FSDP training
(f32 master weights + Adam moments: ~384 GB over 8 x 80 GB). Paths on the command line:

  python -m tlt_jax.train --config configs/qwen2_5_32b_math.py --workdir /runs/q32b \\
      --config.model.path=/ckpt/Qwen2.5-32B-Instruct \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl

The loop is single-process today: multi-host (jax.distributed + per-host data feeding) is
not wired yet.
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/qwen2_5_32b_math"
  c.model.path = "/path/to/Qwen2.5-32B-Instruct"  # --config.model.path=...
  c.rollout.num_workers = 2  # 8 GPUs / tensor_parallel 4
  c.rollout.tensor_parallel = 4
  c.rollout.max_batch = 256
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  c.rollout.max_new_tokens = 16384
  c.grpo.micro_batch_tokens = 65536
  c.grpo.minibatches = 4
  c.optim.lr = 1e-6
  c.tlt.spec.bs_threshold = 32
  return c
