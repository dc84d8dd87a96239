"""GRPO on Qwen2.5-32B for verifiable math: the 7B recipe (configs/qwen2_5_7b_math.py) on
4 nodes x 8 GPUs (80 GB): rematerialised FSDP training over all 32 GPUs (f32 master weights +
AdamW: ~12 GB per GPU) and eight 4-way tensor-parallel rollout replicas, each inside one node.
`scripts/plan_memory.py --config configs/qwen2_5_32b_math.py` prints the per-GPU plan.

  srun --nodes=4 --ntasks-per-node=8 --gpus-per-task=1 \\
    python -m tlt_jax.train --config configs/qwen2_5_32b_math.py --workdir /runs/q32b \\
      --config.model.path=/ckpt/Qwen2.5-32B-Instruct \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl

(docs/scale.md "Multi-host"; scripts/slurm/ has an sbatch example.)
"""

import os

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/qwen2_5_32b_math"
  c.model.path = "/path/to/Qwen2.5-32B-Instruct"  # --config.model.path=...
  c.model.architecture = "qwen2.5-32b"
  c.model.remat_policy = "full"  # 17k tokens per device: "dots" would not fit (plan_memory)
  c.rollout.num_workers = 8  # 32 GPUs / tensor_parallel 4
  c.rollout.tensor_parallel = 4
  c.rollout.max_batch = 0  # sized from memory
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  c.rollout.max_new_tokens = 16384
  # 16k responses run longer on average than the 7B's 8k: rows sized for 4k tokens each
  c.rollout.mean_live_tokens = 4096
  c.grpo.micro_batch = 32  # a multiple of the 32-device FSDP mesh
  c.grpo.micro_batch_tokens = 65536
  c.grpo.minibatches = 4
  c.optim.lr = 1e-6
  c.memory.device = "h100"
  c.memory.num_devices = 32
  return c
