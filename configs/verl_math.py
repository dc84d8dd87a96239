"""The Qwen2.5-7B math recipe (configs/qwen2_5_7b_math.py) on verl's preprocessed data, read as
verl writes it: no conversion step. verl's examples/data_preprocess/gsm8k.py and
math_dataset.py write Parquet rows

  {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": ...}],
   "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
   "extra_info": {"split", "index", "answer", "question"}}

so the prompt is the chat (rendered with the model's chat template; the instruction is in the
user message, so no system prompt), the answer the dotted key reward_model.ground_truth, and
data_source the per-row source (accuracy per source in the metrics; the `data_source` a
verl-style reward function is given). With verl's files in ~/data/gsm8k, on one 8-GPU host:

  python -m tlt_jax.train --config configs/verl_math.py --workdir /runs/verl_gsm8k \\
      --config.model.path=/ckpt/Qwen2.5-7B-Instruct \\
      --config.data.train_path=$HOME/data/gsm8k/train.parquet \\
      --config.data.test_path=$HOME/data/gsm8k/test.parquet

The reward is math-verify, which reads both GSM8K's "#### 72" and MATH's \\boxed{} answers.
verl's own scorers plug in unchanged (called as verl calls them, in the reward worker
processes): --config.reward.name=verl.utils.reward_score:default_compute_score (verl
installed), or a verl custom_reward_function file: --config.reward.name=my_reward.py:compute_score
"""

import os

import ml_collections

from tlt_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "qwen2_5_7b_math.py"))
  c.workdir = "workdirs/verl_math"
  c.data.train_path = "/path/to/gsm8k/train.parquet"  # --config.data.train_path=...
  c.data.test_path = "/path/to/gsm8k/test.parquet"
  c.data.prompt_key = "prompt"
  c.data.answer_key = "reward_model.ground_truth"
  c.data.source_key = "data_source"
  c.data.chat_template = True
  c.data.system_prompt = ""
  c.reward.name = "math"
  assert isinstance(c, ml_collections.ConfigDict)
  return c
