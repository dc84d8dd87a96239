"""GRPO on Qwen3-8B for verifiable math: the Qwen2.5-7B recipe (configs/qwen2_5_7b_math.py:
n=8, temperature 1.0, lr 1e-6, low-variance KL 0.001, 8k-token responses, speculative rollout
in the long tail with an online-trained drafter) on the base most reasoning-RL runs start from
now. Qwen3 differs where it matters to the plan: 36 layers of width 4096 with 8 KV heads of 128
(a token's KV is 144 KiB in bf16, 2.6x Qwen2.5-7B's), so max_batch = 0 sizes fewer rows into
the same memory; the drafter is one Qwen3 layer (q/k norms included), exported for SGLang's
Qwen3ForCausalLMEagle.

Nothing is downloaded: give local paths on the command line, e.g. on one 8-GPU host

  python -m tlt_jax.train --config configs/qwen3_8b_math.py --workdir /runs/q3_8b \\
      --config.model.path=/ckpt/Qwen3-8B \\
      --config.data.train_path=/data/dapo_math_17k.parquet \\
      --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl

`scripts/plan_memory.py --config configs/qwen3_8b_math.py` prints the per-GPU memory plan
(without the checkpoint: model.architecture names the shipped Qwen3-8B shape).
"""

import os

import ml_collections

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/qwen3_8b_math"
  c.model.path = "/path/to/Qwen3-8B"  # --config.model.path=...
  c.model.architecture = "qwen3-8b"  # the plan's shape where model.path is not local
  c.tlt.drafter.buffer_tokens = 1 << 18  # ~2.1 GB of bf16 hidden states (d = 4096)
  assert isinstance(c, ml_collections.ConfigDict)
  return c
