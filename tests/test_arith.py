"""The default task (tlt_jax.data.arith) and its committed assets (tlt_jax/assets/default)."""

import json
import os
import re

import numpy as np
import pytest

from tlt_jax.config import asset_path
from tlt_jax.data import arith

ASSETS = asset_path("default")
MODEL_DIR = os.path.join(ASSETS, "model")
REGEN = "regenerate with `python scripts/make_default_assets.py`"


def _require(path):
  if not os.path.exists(path):
    pytest.fail(f"missing committed asset {path}; {REGEN}")
  return path


@pytest.fixture(scope="module")
def tok():
  from tokenizers import Tokenizer
  return Tokenizer.from_file(_require(os.path.join(MODEL_DIR, "tokenizer.json")))


# ------------------------------------------------------------------------------ generation
def test_deterministic_by_seed():
  a, b = arith.generate_dataset(200, seed=7), arith.generate_dataset(200, seed=7)
  assert a == b
  assert a != arith.generate_dataset(200, seed=8)
  p1 = arith.make_problem(np.random.default_rng(3))
  p2 = arith.make_problem(np.random.default_rng(3))
  assert p1 == p2 and set(p1) == {"prompt", "answer", "num_terms", "response"}


def test_reference_traces_are_correct():
  for p in arith.generate_dataset(3000, seed=11):
    expr = arith.expression_of(p["prompt"])
    assert re.fullmatch(r"\d([+-]\d)+", expr), expr
    assert p["prompt"] == f"Q: {expr}\nA:"
    assert arith.K_MIN <= p["num_terms"] <= arith.K_MAX
    assert len(re.findall(r"\d", expr)) == p["num_terms"]
    assert int(p["answer"]) == eval(expr)  # noqa: S307 - digits and +/- only (checked above)
    # every step "a op d = c" is right, uses the prompt's terms in order and chains values
    body, final = p["response"].split(" #### ")
    assert final == p["answer"]
    steps = body.split()
    terms = re.findall(r"[+-]\d", expr)
    assert len(steps) == len(terms) == p["num_terms"] - 1
    value = int(expr[0])
    for step, term in zip(steps, terms):
      a, op, d, c = re.fullmatch(r"(-?\d+)([+-])(\d)=(-?\d+)", step).groups()
      assert int(a) == value and op + d == term
      assert int(c) == (int(a) + int(d) if op == "+" else int(a) - int(d))
      value = int(c)
    assert value == int(p["answer"])
    assert arith.check_trace(p["prompt"], p["response"])
    assert arith.score(p["response"], p["answer"]) == 1.0


def test_forced_num_terms_and_negative_values():
  rng = np.random.default_rng(0)
  probs = [arith.make_problem(rng, num_terms=arith.K_MAX) for _ in range(50)]
  assert all(p["num_terms"] == arith.K_MAX for p in probs)
  assert any(int(p["answer"]) < 0 for p in arith.generate_dataset(500, seed=1))
  with pytest.raises(ValueError):
    arith.make_problem(rng, num_terms=1)


def test_check_trace_rejects_wrong_traces():
  p = {"prompt": "Q: 7+3-5\nA:", "response": " 7+3=10 10-5=5 #### 5"}
  assert arith.check_trace(p["prompt"], p["response"])
  assert not arith.check_trace(p["prompt"], " 7+3=11 11-5=6 #### 6")  # wrong step
  assert not arith.check_trace(p["prompt"], " 7+3=10 10+5=15 #### 15")  # wrong operand
  assert not arith.check_trace(p["prompt"], " 7+3=10 10-5=5 #### 4")  # wrong final
  assert not arith.check_trace(p["prompt"], " 7+3=10 #### 10")  # skipped step
  assert not arith.check_trace(p["prompt"], " 7+3=10 10-5=5")  # no answer
  # every step restates the running value: a step that starts from another value (here 11,
  # not 10) is wrong even when its own arithmetic and the final answer agree with it
  assert not arith.check_trace(p["prompt"], " 7+3=10 11-5=6 #### 6")


# ------------------------------------------------------------------------ answer + reward
@pytest.mark.parametrize("text, want", [
    (" 7+3=10 #### 10", "10"),
    (" 3-8=-5 #### -5", "-5"),
    ("#### -0", "0"),
    ("####  007", "7"),
    (" #### 13<|endoftext|>", "13"),
    (" #### 13 14 15 junk", "13"),
    (" #### 13abc", "13"),
    ("#### 1 #### 2", "2"),  # the LAST marker counts
    ("#### 1 ####", None),  # final marker without a number
    ("#### x", None),
    ("#### - 5", None),
    (" 7+3=10 10", None),  # no marker
    ("", None),
    ("### 10", None),
])
def test_extract_answer(text, want):
  assert arith.extract_answer(text) == want


def test_score():
  assert arith.score(" 7+3=10 #### 10", "10") == 1.0
  assert arith.score(" 7+3=10 #### 10", 10) == 1.0
  assert arith.score(" #### -5<|endoftext|><|pad|>", "-5") == 1.0
  assert arith.score(" #### 5", "-5") == 0.0
  assert arith.score(" #### 010", "10") == 1.0  # compared as integers
  assert arith.score(" 7+3=10 10", "10") == 0.0  # no marker: no credit
  assert arith.score("", "0") == 0.0
  assert arith.score(None, "0") == 0.0
  assert arith.score("#### 3", "not a number") == 0.0


# ------------------------------------------------------------------------- length tail
def test_heavy_tailed_lengths(tok):
  probs = arith.generate_dataset(5000, seed=5)
  lens = np.array([len(tok.encode(p["response"]).ids) + 1 for p in probs])  # + EOS
  p50, p99 = np.percentile(lens, 50), np.percentile(lens, 99)
  assert 15 <= p50 <= 40, p50
  assert p99 > 4 * p50, (p50, p99)
  assert lens.max() <= 256  # fits the default generation budget
  ks = np.array([p["num_terms"] for p in probs])
  counts = np.bincount(ks, minlength=arith.K_MAX + 1)
  assert counts[arith.K_MIN] > counts[10] > counts[20] > 0  # decaying, long tail present
  assert counts[arith.K_MAX] < 0.01 * len(probs)  # truncation by rejection: no spike at K_MAX


# ------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip(tok):
  vocab = tok.get_vocab()
  assert vocab[arith.PAD_TOKEN] == 0 and vocab[arith.EOS_TOKEN] == 1
  assert len(vocab) <= 64
  for p in arith.generate_dataset(2000, seed=9):
    text = p["prompt"] + p["response"]
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    # prompt and response tokenize independently (RL concatenates prompt ids + sampled ids)
    assert tok.encode(p["prompt"]).ids + tok.encode(p["response"]).ids == enc.ids
    # digits are always single tokens
    assert all(len(t) == 1 for t in enc.tokens if any(c.isdigit() for c in t))
  eos = tok.encode(arith.EOS_TOKEN).ids
  assert eos == [1]


def test_transformers_loads_tokenizer_and_model(tok):
  pytest.importorskip("transformers")
  from transformers import AutoConfig, AutoTokenizer

  hf = AutoTokenizer.from_pretrained(MODEL_DIR)
  assert hf.eos_token == arith.EOS_TOKEN and hf.eos_token_id == 1 and hf.pad_token_id == 0
  for p in arith.generate_dataset(300, seed=10):
    text = p["prompt"] + p["response"]
    ids = hf(text)["input_ids"]
    assert ids == tok.encode(text).ids
    assert hf.decode(ids) == text
  cfg = AutoConfig.from_pretrained(MODEL_DIR)
  assert cfg.model_type == "qwen2" and cfg.vocab_size >= len(tok.get_vocab())
  with open(_require(os.path.join(MODEL_DIR, "generation_config.json"))) as f:
    gen = json.load(f)
  assert gen["eos_token_id"] == 1 and gen["pad_token_id"] == 0


# ------------------------------------------------------------------------- committed data
@pytest.mark.parametrize("task", ["default", "longtail"])
def test_committed_data_matches_generator(task):
  """The committed splits are exactly what the generator produces from the recorded seeds
  and the task's lengths."""
  root = asset_path(task)
  with open(_require(os.path.join(root, "manifest.json"))) as f:
    manifest = json.load(f)
  seeds = manifest["seeds"]
  for split, fields in (("train", ("prompt", "answer", "num_terms", "response")),
                        ("test", ("prompt", "answer", "num_terms"))):
    rows = arith.load_jsonl(os.path.join(root, "data", f"{split}.jsonl"))
    assert len(rows) == manifest["data"][f"n_{split}"]
    want = arith.generate_dataset(len(rows), seeds[split], arith.TASKS[task])
    assert rows == [{k: w[k] for k in fields} for w in want], f"{split}.jsonl is stale; {REGEN}"
  size = sum(os.path.getsize(os.path.join(root, "data", f)) for f in os.listdir(
      os.path.join(root, "data")))
  assert size < 3e6


def test_longtail_reference_lengths_have_the_shape_of_reasoning_rl():
  """The long-tail variant's reference traces, tokenized by its shipped tokenizer (EOS
  included), at the 512-token cap of configs/longtail.py: p50 ~30 tokens, p90 ~150, p99 past
  the cap, 1-3% truncated; the default's tail stays inside its cap."""
  from tokenizers import Tokenizer
  lengths = {}
  for task in ("default", "longtail"):
    root = asset_path(task)
    tk = Tokenizer.from_file(_require(os.path.join(root, "model", "tokenizer.json")))
    rows = arith.load_jsonl(os.path.join(root, "data", "train.jsonl"))
    lengths[task] = np.array([len(tk.encode(r["response"]).ids) + 1 for r in rows])
  lt = lengths["longtail"]
  p50, p90, p99 = np.percentile(lt, [50, 90, 99])
  assert 24 <= p50 <= 40 and 120 <= p90 <= 190 and p99 > 480, (p50, p90, p99)
  assert 0.01 <= (lt > 512).mean() <= 0.03 and p99 / p50 >= 8
  assert lengths["default"].max() < 288 and np.percentile(lengths["default"], 99) < 200


def test_committed_model_loads_and_prefers_reference_traces():
  import jax
  import jax.numpy as jnp
  from tokenizers import Tokenizer

  from tlt_jax.models import forward
  from tlt_jax.models.hf_io import load_hf_model

  cfg, params = load_hf_model(MODEL_DIR)
  tok = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
  p = arith.make_problem(np.random.default_rng(0), num_terms=4)
  prompt = tok.encode(p["prompt"]).ids
  good = prompt + tok.encode(p["response"]).ids + [1]
  bad = prompt + tok.encode(p["response"].replace("####", "#### 1")).ids + [1]

  def nll(ids):
    ids = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    logp = jax.nn.log_softmax(forward(params, ids, pos, cfg=cfg).logits[0, :-1], axis=-1)
    tgt = ids[0, 1:]
    return float(-jnp.take_along_axis(logp, tgt[:, None], axis=-1)[len(prompt) - 1:].sum())

  assert np.isfinite(nll(good)) and nll(good) < nll(bad)
