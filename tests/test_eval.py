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
  # the prompts as two test files, 10 and 14 rows (two benchmarks: each one's accuracy apart)
  files = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
  for f, part in zip(files, (rows[:10], rows[10:])):
    f.write_text("".join(json.dumps(r) + "\n" for r in part))
  p = _run(["tlt_jax.eval", "--config", "configs/default.py",
            f"--config.data.test_path={files[0]},{files[1]}",
            f"--config.workdir={tmp_path}", f"--config.reward.name={tmp_path}/talky_reward.py:fn",
            "--config.reward.timeout=2"])
  assert p.returncode == 0, p.stderr
  metrics = json.load(open(tmp_path / "eval.json"))
  assert metrics["reward_failures"] == {"errors": 0, "timeouts": 1, "crashes": 0}
  scores[hang] = 0.0  # the call that hung
  assert metrics["num_prompts"] == n
  assert metrics["accuracy"] == pytest.approx(float(np.mean(scores)))
  assert 0.0 < metrics["accuracy"] < 1.0
  assert metrics["prompts_by_source"] == {"first": 10, "second": 14}
  assert list(metrics["accuracy_by_source"]) == ["first", "second"]
  assert metrics["accuracy_by_source"] == pytest.approx(
      {"first": float(np.mean(scores[:10])), "second": float(np.mean(scores[10:]))})
  assert f"  second: accuracy {np.mean(scores[10:]):.3f} on 14 prompts" in p.stdout
  # every response in eval_responses.jsonl: transformers' text, the verifier's score, its row
  recs = [json.loads(line) for line in open(tmp_path / "eval_responses.jsonl")]
  assert [(r["source"], r["prompt_index"]) for r in recs] == [
      ("first", i) for i in range(10)] + [("second", i) for i in range(10, n)]
  assert [r["response"] for r in recs] == texts
  assert [r["reward"] for r in recs] == scores
  assert [(r["prompt"], r["answer"]) for r in recs] == [(r["prompt"], r["answer"]) for r in rows]
  assert {r["finish_reason"] for r in recs} == {"stop"}
  assert f"every response in {tmp_path}/eval_responses.jsonl" in p.stdout


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
  """The unbiased pass@k against its definition: over every k-subset of n samples with c
  correct, the share that holds at least one correct sample."""
  import itertools

  from tlt_jax.eval import pass_at_k
  for n in (1, 2, 5, 8):
    for c in range(n + 1):
      for k in range(1, n + 1):
        subsets = list(itertools.combinations([i < c for i in range(n)], k))
        want = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


class _Chars:
  """A tokenizer of characters (the fake engine's responses are text)."""

  def encode(self, text):
    return [ord(ch) for ch in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(i) for i in ids)


class _Scripted:
  """An engine whose responses are given: answers[request_id][sample_index], returned in
  reverse order (a real engine returns them as they finish)."""

  def __init__(self, answers):
    self.answers = answers

  def generate(self, requests, sampling, *, seed, hooks, policies, speculate):
    from tlt_jax.rollout.records import Result
    out = []
    for r in reversed(requests):
      text = f"#### {self.answers[r.request_id][r.sample_index]}"
      res = Result(r.request_id, r.sample_index, np.asarray(r.prompt_ids),
                   np.array([ord(ch) for ch in text]), np.zeros(len(text), np.float32), None,
                   "stop")
      hooks.on_result(res)
      out.append(res)
    return out


def test_sampling_of_reads_the_eval_configs_n_temperature_and_top_p():
  """sampling_of: config.eval's n, temperature and top_p, each as set (greedy by default)."""
  import ml_collections

  from tlt_jax.eval import sampling_of
  cfg = ml_collections.ConfigDict({"eval": {"n": 4, "temperature": 0.7, "top_p": 0.9}})
  n, sp = sampling_of(cfg)
  assert (n, sp.temperature, sp.top_p) == (4, 0.7, 0.9)
  n, sp = sampling_of(ml_collections.ConfigDict({"eval": {}}))
  assert (n, sp.temperature, sp.top_p) == (1, 0.0, 1.0)


def test_sampled_evaluation_scores_every_sample_of_every_prompt():
  """evaluate with n=4 samples a prompt (scripted responses, the arith verifier in the reward
  pool): accuracy the mean over all 12 responses, pass@k per prompt from its own correct
  count (counted here), whatever order the responses finish in; n > 1 greedy refused."""
  from tlt_jax.data.prompts import PromptRow
  from tlt_jax.eval import evaluate, pass_at_k
  from tlt_jax.rl.reward_pool import RewardPool
  from tlt_jax.rollout.sampling import SamplingParams
  rows = [PromptRow(i, f"q{i}", str(a)) for i, a in enumerate((7, 11, 3))]
  answers = [[7, 7, 1, 7], [0, 0, 0, 11], [5, 5, 5, 5]]  # 3, 1 and 0 of 4 right
  with RewardPool("arith", num_workers=1) as pool:
    m = evaluate(_Scripted(answers), _Chars(), rows, pool, progress=False, n=4,
                 sampling=SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="greedy responses to a prompt are one"):
      evaluate(_Scripted(answers), _Chars(), rows, pool, progress=False, n=4)
  assert m["num_prompts"] == 3 and m["samples"] == 4
  assert m["accuracy"] == pytest.approx(4 / 12)
  correct = [sum(a == int(r.answer) for a in got) for r, got in zip(rows, answers)]
  assert correct == [3, 1, 0]
  assert m["pass_at"] == {str(k): pytest.approx(np.mean([pass_at_k(4, c, k) for c in correct]))
                          for k in (1, 2, 4)}
  assert m["pass_at"]["4"] == pytest.approx(2 / 3) and m["pass_at"]["1"] == m["accuracy"]


def test_each_source_is_scored_apart():
  """Rows of two sources and one without (scripted responses, the arith verifier): by_source
  holds each one's avg@n, prompts and pass@k from its own prompts' correct counts (counted
  here), in the rows' order, "unknown" for the row without; one source alone: no breakdown."""
  from tlt_jax.data.prompts import PromptRow
  from tlt_jax.eval import evaluate, pass_at_k
  from tlt_jax.rl.reward_pool import RewardPool
  from tlt_jax.rollout.sampling import SamplingParams
  rows = [PromptRow(0, "q0", "7", source="aime"), PromptRow(1, "q1", "11", source="math"),
          PromptRow(2, "q2", "3", source="aime"), PromptRow(3, "q3", "5")]
  answers = [[7, 7, 1, 7], [0, 0, 0, 11], [3, 5, 5, 5], [5, 5, 5, 5]]  # 3, 1, 1, 4 of 4
  with RewardPool("arith", num_workers=1) as pool:
    m = evaluate(_Scripted(answers), _Chars(), rows, pool, progress=False, n=4,
                 sampling=SamplingParams(temperature=1.0))
    one = evaluate(_Scripted(answers[:3:2]), _Chars(), rows[:3:2], pool, progress=False, n=4,
                   sampling=SamplingParams(temperature=1.0))
  assert m["accuracy"] == pytest.approx(9 / 16)
  want = {"aime": [3, 1], "math": [1], "unknown": [4]}
  assert list(m["accuracy_by_source"]) == list(want)
  assert m["prompts_by_source"] == {name: len(c) for name, c in want.items()}
  assert m["accuracy_by_source"] == pytest.approx(
      {name: sum(c) / (4 * len(c)) for name, c in want.items()})
  for name, correct in want.items():
    assert m["pass_at_by_source"][name] == pytest.approx(
        {str(k): np.mean([pass_at_k(4, c, k) for c in correct]) for k in (1, 2, 4)})
  assert one["accuracy"] == pytest.approx(4 / 8)
  assert not {"accuracy_by_source", "prompts_by_source", "pass_at_by_source"} & set(one)


def test_evaluation_keeps_each_sources_first_prompts_responses():
  """keep=1: the responses of each source's first prompt (aime's q0, math's q1, the unknown
  source's q3), every sample, with the scripted text and the verifier's score; keep=0: none."""
  from tlt_jax.data.prompts import PromptRow
  from tlt_jax.eval import evaluate
  from tlt_jax.rl.reward_pool import RewardPool
  from tlt_jax.rollout.sampling import SamplingParams
  rows = [PromptRow(0, "q0", "7", source="aime"), PromptRow(1, "q1", "11", source="math"),
          PromptRow(2, "q2", "3", source="aime"), PromptRow(3, "q3", "5")]
  answers = [[7, 1], [11, 0], [3, 3], [5, 4]]
  with RewardPool("arith", num_workers=1) as pool:
    m = evaluate(_Scripted(answers), _Chars(), rows, pool, progress=False, n=2,
                 sampling=SamplingParams(temperature=1.0), keep=1)
    none = evaluate(_Scripted(answers), _Chars(), rows, pool, progress=False, n=2,
                    sampling=SamplingParams(temperature=1.0))
  got = [(r["prompt_index"], r["sample"], r["source"], r["prompt"], r["response"], r["reward"])
         for r in m["responses"]]
  assert got == [(0, 0, "aime", "q0", "#### 7", 1.0), (0, 1, "aime", "q0", "#### 1", 0.0),
                 (1, 0, "math", "q1", "#### 11", 1.0), (1, 1, "math", "q1", "#### 0", 0.0),
                 (3, 0, None, "q3", "#### 5", 1.0), (3, 1, None, "q3", "#### 4", 0.0)]
  assert "responses" not in none


def test_held_out_leaves_out_the_prompts_a_rollout_cannot_take():
  """held_out keeps the rows of 1..max_prompt_len tokens in order and counts the rest (longer,
  or encoding to no token, as training's stream); none left is one DataError naming the key."""
  from tlt_jax.data.prompts import DataError, PromptRow
  from tlt_jax.eval import held_out
  rows = [PromptRow(i, p, "1") for i, p in enumerate(["abcd", "abcdef", "", "ab", "abcde"])]
  kept, left_out = held_out(rows, _Chars(), max_prompt_len=5)
  assert [r.prompt for r in kept] == ["abcd", "ab", "abcde"] and left_out == 2
  with pytest.raises(DataError, match=r"none of its 2 prompts fits \(1 longer than "
                                      r"config.data.max_prompt_len=3 tokens, 1 of no token\)"):
    held_out(rows[1:3], _Chars(), max_prompt_len=3)


def test_pass_at_k_counts_only_full_rewards_as_correct(tmp_path):
  """A reward with partial credit (0.5 for a wrong answer): avg@n counts it, pass@k does not
  (a response is correct where its reward is >= 1). By hand: prompt 0 scores (1, 0.5), prompt
  1 (0.5, 0.5): accuracy 0.625, pass@1 (0.5 + 0) / 2, pass@2 (1 + 0) / 2."""
  from tlt_jax.data.prompts import PromptRow
  from tlt_jax.eval import evaluate
  from tlt_jax.rl.reward_pool import RewardPool
  from tlt_jax.rollout.sampling import SamplingParams
  f = tmp_path / "partial.py"
  f.write_text("def fn(response, answer):\n  return 1.0 if answer in response else 0.5\n")
  rows = [PromptRow(i, f"q{i}", str(a)) for i, a in enumerate((7, 11))]
  with RewardPool(f"{f}:fn", num_workers=1) as pool:
    m = evaluate(_Scripted([[7, 0], [0, 0]]), _Chars(), rows, pool, progress=False, n=2,
                 sampling=SamplingParams(temperature=1.0))
  assert m["accuracy"] == pytest.approx(0.625)
  assert m["pass_at"] == pytest.approx({"1": 0.25, "2": 0.5})


def test_sampled_eval_command(tmp_path):
  """python -m tlt_jax.eval with eval.n=4 at temperature 1 on the shipped model: 4 responses to
  each of 16 prompts, avg@4 and pass@k (binary rewards: pass@1 is the accuracy; with the
  accuracy strictly between 0 and 1 and samples that differ, pass@4 above it)."""
  p = _run(["tlt_jax.eval", "--config", "configs/default.py", "--config.eval.num_prompts=16",
            f"--config.workdir={tmp_path}", "--config.eval.n=4", "--config.eval.temperature=1.0"])
  assert p.returncode == 0, p.stderr
  m = json.load(open(tmp_path / "eval.json"))
  assert m["num_prompts"] == 16 and m["samples"] == 4 and m["temperature"] == 1.0
  assert set(m["pass_at"]) == {"1", "2", "4"}
  assert m["pass_at"]["1"] == pytest.approx(m["accuracy"]) and 0 < m["accuracy"] < 1
  assert m["pass_at"]["4"] > m["pass_at"]["2"] > m["pass_at"]["1"]
  assert "avg@4, temperature 1" in p.stdout and "pass@4" in p.stdout
  bad = _run(["tlt_jax.eval", "--config", "configs/default.py", "--config.eval.n=4",
              f"--config.workdir={tmp_path}"])
  assert bad.returncode == 2 and "config.eval.n=4: greedy responses" in bad.stderr
  assert "Traceback" not in bad.stderr
