"""GRPO on Llama-3.3-70B-Instruct for verifiable math, the paper's largest setting: 8 nodes x
8 GPUs (80 GB). Rematerialised FSDP training over all 64 GPUs (f32 master weights + AdamW:
~13 GB per GPU) and eight 8-way tensor-parallel rollout replicas, one per node (Llama-3.3-70B
has 8 KV heads: one per GPU of a replica). `scripts/plan_memory.py --config
configs/llama3_3_70b_math.py` prints the per-GPU plan.

  srun --nodes=8 --ntasks-per-node=8 --gpus-per-task=1 \\
    python -m tlt_jax.train --config configs/llama3_3_70b_math.py --workdir /runs/l70b \\
      --config.model.path=/ckpt/Llama-3.3-70B-Instruct \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/llama3_3_70b_math"
  c.model.path = "/path/to/Llama-3.3-70B-Instruct"  # --config.model.path=...
  c.model.architecture = "llama-3.3-70b"
  c.model.remat_policy = "full"  # 17k tokens per device: "dots" would not fit (plan_memory)
  c.rollout.num_workers = 8  # 64 GPUs / tensor_parallel 8
  c.rollout.tensor_parallel = 8
  c.rollout.max_batch = 0  # sized from memory
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  c.rollout.max_new_tokens = 16384
  # 16k responses run longer on average than the 7B's 8k: rows sized for 4k tokens each
  c.rollout.mean_live_tokens = 4096
  c.grpo.micro_batch = 64  # a multiple of the 64-device FSDP mesh
  c.grpo.micro_batch_tokens = 131072  # ~2k tokens per GPU per micro-batch row group
  c.grpo.minibatches = 4
  c.optim.lr = 5e-7
  c.tlt.drafter.rows = 4
  c.memory.device = "h100"
  c.memory.num_devices = 64
  return c
