"""GRPO on Qwen2.5-32B for verifiable math: the 7B recipe (configs/qwen2_5_7b_math.py) scaled
to 4 hosts x 8 GPUs, with 4-way tensor-parallel rollout replicas. Paths on the command line:

  python -m tlt_jax.train --config configs/qwen2_5_32b_math.py --workdir /runs/q32b \\
      --config.model.path=/ckpt/Qwen2.5-32B-Instruct \\
      --config.data.train_path=/data/dapo_math_17k.parquet --config.data.test_path=/data/aime24.jsonl
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/qwen2_5_32b_math"
  c.model.path = "/path/to/Qwen2.5-32B-Instruct"  # --config.model.path=...
  c.rollout.num_workers = 8  # 32 GPUs / tensor_parallel 4
  c.rollout.tensor_parallel = 4
  c.rollout.max_new_tokens = 16384
  c.grpo.micro_batch = 32  # one row per device of the 32-device fsdp axis
  c.grpo.micro_batch_tokens = 131072
  c.grpo.num_prompts = 128
  c.grpo.minibatches = 4
  c.optim.lr = 1e-6
  c.tlt.spec.bs_threshold = 32
  return c
