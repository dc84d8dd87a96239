"""tlt_jax.eval's accuracy equals an independent greedy decode with transformers scored by the
task's verifier."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args):
  env = user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


# The task's verifier as a user's reward file that misbehaves: it prints to stdout on every call
# and hangs once, on the response HANG (responses are scored as they finish, in no set order).
REWARD = """
import os, time
from tlt_jax.data import arith

def fn(response, answer):
    print("a reward that talks")
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hung_once")
    if response == HANG and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)
    return arith.score(response, answer)
"""


def test_eval_accuracy_matches_transformers_greedy(tmp_path):
  """tlt_jax.eval on 24 test prompts vs transformers greedy generate + arith.score, the
  reward a user's file that hangs once and prints: the hung call times out and scores 0 (its
  worker replaced), the rest score as the verifier does."""
  import torch
  import transformers

  from tlt_jax.data import arith
  n = 24
  mdir = os.path.join(ROOT, "tlt_jax", "assets", "default", "model")
  tok = transformers.AutoTokenizer.from_pretrained(mdir)
  model = transformers.AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
  rows = [json.loads(l) for l in open(os.path.join(ROOT, "tlt_jax", "assets", "default", "data",
                                                   "test.jsonl"))][:n]
  texts, scores = [], []
  for row in rows:
    ids = torch.tensor([tok.encode(row["prompt"])])
    with torch.no_grad():
      out = model.generate(ids, max_new_tokens=288, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    scores.append(arith.score(texts[-1], row["answer"]))
  # the reward hangs on a response no other prompt's equals, and one it would score 1
  hang = next(i for i, t in enumerate(texts) if texts.count(t) == 1 and scores[i] == 1.0)
  (tmp_path / "talky_reward.py").write_text(f"HANG = {texts[hang]!r}\n" + REWARD)
  p = _run(["tlt_jax.eval", "--config", "configs/default.py", f"--config.eval.num_prompts={n}",
            f"--config.workdir={tmp_path}", f"--config.reward.name={tmp_path}/talky_reward.py:fn",
            "--config.reward.timeout=2"])
  assert p.returncode == 0, p.stderr
  metrics = json.load(open(tmp_path / "eval.json"))
  assert metrics["reward_failures"] == {"errors": 0, "timeouts": 1, "crashes": 0}
  scores[hang] = 0.0  # the call that hung
  assert metrics["num_prompts"] == n
  assert metrics["accuracy"] == pytest.approx(float(np.mean(scores)))
  assert 0.0 < metrics["accuracy"] < 1.0
