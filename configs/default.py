"""The embedded default: the shipped tiny Qwen2 model on the synthetic long-tail arithmetic task.

Runs on a laptop CPU with no downloads:
  python -m tlt_jax.eval --config configs/default.py
  python -m tlt_jax.eval --config configs/default.py --config.eval.num_prompts=50
"""

import ml_collections

from tlt_jax.config import asset_path


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "workdirs/default"

  c.model = ml_collections.ConfigDict()
  c.model.path = asset_path("default", "model")
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"

  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

  c.data = ml_collections.ConfigDict()
  c.data.train_path = asset_path("default", "data", "train.jsonl")
  c.data.test_path = asset_path("default", "data", "test.jsonl")
  c.data.prompt_key = "prompt"
  c.data.answer_key = "answer"
  c.data.on_bad_row = "skip"
  c.data.max_prompt_len = 80

  c.reward = ml_collections.ConfigDict()
  c.reward.name = "arith"

  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_batch = 64
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64)
  c.rollout.chunk_size = 16
  c.rollout.compaction = True
  c.rollout.max_new_tokens = 288
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0

  c.eval = ml_collections.ConfigDict()
  c.eval.num_prompts = 0  # 0 = the whole test split
  c.eval.batch_size = 64
  return c
