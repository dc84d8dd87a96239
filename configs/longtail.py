"""The long-tail workload: the embedded task with the response-length shape of reasoning RL.

The same arithmetic chains as configs/default.py, their number of steps drawn with a heavier
tail (tlt_jax/data/arith.py LONGTAIL): at this config's 512-token cap the reference traces
have p50 ~30 tokens, p90 ~150, p99 past the cap, 1-3% truncated, the shape published
reasoning runs show (P75 755-1.1k tokens at a 16k cap, the longest 25-32x the median, the last
10% of requests taking up to half the rollout), so a rollout's last rows decode alone for
hundreds of steps: the long tail TLT is for. Its own shipped policy and drafter
(tlt_jax/assets/longtail, scripts/make_default_assets.py --task longtail and
scripts/train_drafter.py). On this CPU, RL improves its held-out accuracy in minutes:

  python -m tlt_jax.train --config configs/longtail.py
  python -m tlt_jax.train --config configs/longtail.py --config.tlt.enabled=False   # baseline

On a GPU the same run on the widened 1.13B target (scripts/make_bench_model.py --source
longtail: the same function, so the same acceptance) is where speculation pays:
--config.model.path=<bench>/model --config.tlt.drafter.init=<bench>/drafter
--config.model.dtype=bfloat16.
"""

import os

from tlt_jax.config import asset_path, load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
  c.workdir = "workdirs/longtail"
  c.model.path = asset_path("longtail", "model")
  c.data.train_path = asset_path("longtail", "data", "train.jsonl")
  c.data.test_path = asset_path("longtail", "data", "test.jsonl")
  c.data.max_prompt_len = 256  # up to 120 terms: ~250 prompt tokens
  c.rollout.prompt_bucket = 64  # prompts vary 8-250 tokens: a few prefill shapes
  c.rollout.max_new_tokens = 512
  c.grpo.num_prompts = 16  # 16 x 8 responses a step: minutes per run on a 2-core CPU
  c.grpo.micro_batch_tokens = 4096
  c.train.steps = 20
  c.train.eval_every = 5
  c.eval.num_prompts = 200
  c.tlt.drafter.init = asset_path("longtail", "drafter")
  c.tlt.drafter.row_len = 512
  c.tlt.drafter.window = 256
  c.tlt.drafter.context = 256
  c.tlt.drafter.acceptance_response_len = 128  # read after the prompt's 256 tokens
  return c
