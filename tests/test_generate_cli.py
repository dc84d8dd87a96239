"""`python -m tlt_jax.generate` end to end, as a subprocess, on a tiny random checkpoint with a
WordLevel tokenizer: output format, greedy == transformers, determinism, and user errors
(exit status 2, one clear line, no traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from user_env import user_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the cat dog sat ran on a mat rug big small red blue green and then it was is not "
         "very happy sad fast slow one two three four five").split()
SPECIAL = ["<unk>", "<eos>"]
VOCAB = len(SPECIAL) + len(WORDS)  # 32
CONTEXT = 40  # max_position_embeddings: small, so a long prompt overflows it
MAX_NEW = 8
FIELDS = {"prompt_index", "sample_index", "response_ids", "text", "num_tokens", "finish_reason"}
TEXTS = ["the cat sat on the mat", "a big red dog ran", "one two three", "happy"]


def _env():
  env = user_env()
  env.pop("XLA_FLAGS", None)  # one CPU device: faster start-up than conftest's 8
  env["JAX_PLATFORMS"] = "cpu"
  env["TOKENIZERS_PARALLELISM"] = "false"
  env["HF_HUB_OFFLINE"] = "1"
  env["TRANSFORMERS_OFFLINE"] = "1"
  return env


def _start(*args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "tlt_jax.generate", *args], cwd=REPO,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
  out, err = proc.communicate(timeout=300)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _hf_greedy(model, ids, max_new, eos=None):
  t = torch.tensor([ids])
  with torch.no_grad():
    out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos,
                         pad_token_id=0, num_beams=1)
  return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A Llama checkpoint dir with tokenizer files and generation_config.json (eos chosen so
  that it fires for some prompts)."""
  d = str(tmp_path_factory.mktemp("cli_model"))
  tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(SPECIAL + WORDS)},
                                       unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                              unk_token="<unk>")
  fast.save_pretrained(d)
  # Llama, not Qwen2: for model_type qwen2, AutoTokenizer ignores tokenizer_config's class
  # and forces Qwen2Tokenizer (a byte-level BPE), which cannot read a WordLevel tokenizer.json.
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                 tie_word_embeddings=False)
  torch.manual_seed(5)
  model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager",
                                                     dtype=torch.float32)
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  model.eval()
  model.save_pretrained(d)
  tokenizer = transformers.AutoTokenizer.from_pretrained(d)
  ids = [tokenizer.encode(t) for t in TEXTS]
  assert all(ids) and all(0 < i < VOCAB for x in ids for i in x)
  free = [_hf_greedy(model, x, MAX_NEW) for x in ids]
  # eos: a token some greedy outputs produce after their first step and others never do
  counts = {t: sum(t in o for o in free) for o in free for t in o[1:]}
  eos = max(counts, key=lambda t: (min(counts[t], len(free) - counts[t]), -t))
  assert 0 < counts[eos] < len(free), free
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": eos}, f)
  return dict(dir=d, model=model, tokenizer=tokenizer, ids=ids, eos=eos)


def _write(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write(row if isinstance(row, str) else json.dumps(row))
      f.write("\n")
  return str(path)


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
  """Three CLI runs, started together: sampled (twice, same seed) and greedy."""
  tmp = tmp_path_factory.mktemp("cli_runs")
  # text prompts, one prompt as ids (== TEXTS[0]'s ids), and a blank line (skipped)
  rows = [{"prompt": TEXTS[0]}, {"prompt_ids": ckpt["ids"][0]}, "", {"prompt": TEXTS[1]},
          {"prompt": TEXTS[2]}, {"prompt": TEXTS[3]}]
  prompts = _write(tmp / "prompts.jsonl", rows)
  common = ["--model", ckpt["dir"], "--prompts", prompts, "--max_new_tokens", str(MAX_NEW),
            "--chunk_size", "3"]
  # the sampled runs decode all 15 rows in one batch without compaction (2 executables to
  # compile); the greedy run goes through refill and compaction at batch 4
  sampled = ["--num_samples", "3", "--temperature", "1.0", "--top_p", "0.95", "--seed", "11",
             "--batch_size", "16", "--nocompaction"]
  outs = {k: str(tmp / f"{k}.jsonl")
          for k in ("sampled_a", "sampled_b", "greedy", "spec", "spec_tree", "spec_hybrid")}
  procs = {
      "sampled_a": _start(*common, *sampled, "--output", outs["sampled_a"]),
      "sampled_b": _start(*common, *sampled, "--output", outs["sampled_b"]),
      "greedy": _start(*common, "--temperature", "0", "--batch_size", "4",
                       "--output", outs["greedy"]),
      # speculative chain decoding with a fresh (random) drafter: greedy output unchanged
      "spec": _start(*common, "--temperature", "0", "--batch_size", "4", "--drafter",
                     "init:0", "--spec", "2_1_3", "--output", outs["spec"]),
      # an EAGLE-2 tree (depth 3, branching 2, 6 nodes verified): greedy output unchanged too
      "spec_tree": _start(*common, "--temperature", "0", "--batch_size", "4", "--drafter",
                          "init:0", "--spec", "3_2_6", "--output", outs["spec_tree"]),
      # the hybrid by its source name: the history index's and the drafter's chains
      "spec_hybrid": _start(*common, "--temperature", "0", "--batch_size", "4", "--drafter",
                            "init:0", "--spec", "hybrid", "--output", outs["spec_hybrid"]),
  }
  done = {k: _finish(p) for k, p in procs.items()}
  for k, cp in done.items():
    assert cp.returncode == 0, f"{k}: rc={cp.returncode}\n{cp.stderr[-3000:]}"
  # prompt order in the output: line order of the non-blank lines
  prompt_ids = [ckpt["ids"][0], ckpt["ids"][0], ckpt["ids"][1], ckpt["ids"][2], ckpt["ids"][3]]
  return dict(procs=done, outs=outs, prompt_ids=prompt_ids)


def _check_rows(rows, ckpt, num_prompts, num_samples):
  eos = ckpt["eos"]
  assert len(rows) == num_prompts * num_samples
  assert [(r["prompt_index"], r["sample_index"]) for r in rows] == \
      [(i, s) for i in range(num_prompts) for s in range(num_samples)]
  for r in rows:
    assert set(r) == FIELDS, sorted(r)
    ids = r["response_ids"]
    assert isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < VOCAB for t in ids)
    assert r["num_tokens"] == len(ids) and 1 <= len(ids) <= MAX_NEW
    if ids[-1] == eos:
      assert r["finish_reason"] == "stop" and eos not in ids[:-1]
    else:
      assert r["finish_reason"] == "length" and len(ids) == MAX_NEW and eos not in ids
    assert r["text"] == ckpt["tokenizer"].decode(ids, skip_special_tokens=True)
    assert r["text"].split() == [(SPECIAL + WORDS)[t] for t in ids if t >= len(SPECIAL)]


def test_greedy_matches_transformers(runs, ckpt):
  rows = _read(runs["outs"]["greedy"])
  _check_rows(rows, ckpt, num_prompts=5, num_samples=1)
  for r, ids in zip(rows, runs["prompt_ids"]):
    assert r["response_ids"] == _hf_greedy(ckpt["model"], ids, MAX_NEW, eos=ckpt["eos"])
  # a text prompt and the same prompt given as ids give the same output
  assert rows[0]["response_ids"] == rows[1]["response_ids"]
  reasons = {r["finish_reason"] for r in rows}
  assert reasons == {"stop", "length"}, rows


def test_sampled_output_format_and_num_samples(runs, ckpt):
  rows = _read(runs["outs"]["sampled_a"])
  _check_rows(rows, ckpt, num_prompts=5, num_samples=3)
  by_prompt = {}
  for r in rows:
    by_prompt.setdefault(r["prompt_index"], []).append(tuple(r["response_ids"]))
  assert all(len(v) == 3 for v in by_prompt.values())
  # samples are not all copies of one another
  assert len({s for v in by_prompt.values() for s in v}) >= 8


def test_same_seed_same_file(runs):
  with open(runs["outs"]["sampled_a"], "rb") as a, open(runs["outs"]["sampled_b"], "rb") as b:
    assert a.read() == b.read()


def test_stderr_summary(runs):
  for cp in runs["procs"].values():
    assert "tokens/s" in cp.stderr and "batch profile:" in cp.stderr, cp.stderr[-2000:]
    assert "Traceback" not in cp.stderr
  # the profile shows the bucket over time, e.g. "t=0.0s:4(4 live) ... t=0.9s:1(1 live)"
  profile = runs["procs"]["greedy"].stderr.split("batch profile:")[1].splitlines()[0].strip()
  assert profile.startswith("t=") and ":4(4 live)" in profile, profile
  assert ":16(15 live)" in runs["procs"]["sampled_a"].stderr


# ------------------------------------------------------------------------------------ errors
@pytest.fixture(scope="module")
def errors(ckpt, tmp_path_factory):
  tmp = tmp_path_factory.mktemp("cli_errors")
  long_ids = [3] * (CONTEXT - MAX_NEW + 1)
  files = {
      "malformed": _write(tmp / "bad.jsonl", [{"prompt": "the cat"}, '{"prompt": "the cat"']),
      "empty": _write(tmp / "empty.jsonl", [{"prompt_ids": [3, 4]}, {"prompt": ""}]),  # text
      "too_long": _write(tmp / "long.jsonl", [{"prompt": "the cat"}, "",
                                              {"prompt_ids": long_ids}]),
      "good": _write(tmp / "good.jsonl", [{"prompt": "the cat"}]),
      "vocab": _write(tmp / "vocab.jsonl", [{"prompt_ids": [3, VOCAB]}]),
  }
  out = str(tmp / "out.jsonl")
  base = ["--max_new_tokens", str(MAX_NEW), "--output", out]
  cases = {
      "missing_prompts": ["--model", ckpt["dir"], "--prompts", str(tmp / "nope.jsonl")],
      "malformed": ["--model", ckpt["dir"], "--prompts", files["malformed"]],
      "empty": ["--model", ckpt["dir"], "--prompts", files["empty"]],
      "too_long": ["--model", ckpt["dir"], "--prompts", files["too_long"]],
      "missing_model": ["--model", str(tmp / "no_model"), "--prompts", files["good"]],
      "vocab": ["--model", ckpt["dir"], "--prompts", files["vocab"]],
      "not_an_arm": ["--model", ckpt["dir"], "--prompts", files["good"], "--drafter", "init:0",
                     "--spec", "chain"],
      "tree_too_big": ["--model", ckpt["dir"], "--prompts", files["good"], "--drafter",
                       "init:0", "--spec", "2_2_9"],
      # (these name their own --output: the later flag wins)
      "output_is_a_dir": ["--model", ckpt["dir"], "--prompts", files["good"], "--output",
                          str(tmp)],
      "output_under_a_file": ["--model", ckpt["dir"], "--prompts", files["good"], "--output",
                              os.path.join(files["good"], "out.jsonl")],
  }
  procs = {k: _start(*base, *v) for k, v in cases.items()}
  done = {k: _finish(p) for k, p in procs.items()}
  assert not os.path.exists(out)
  return done, files, tmp


@pytest.mark.parametrize("case,pattern", [
    ("missing_prompts", r"error: --prompts \S*nope\.jsonl: no such file"),
    ("malformed", r"error: \S*bad\.jsonl:2: not valid JSON"),
    ("empty", r"error: \S*empty\.jsonl:2: empty prompt"),
    ("too_long", rf"error: \S*long\.jsonl:3: prompt has {CONTEXT - MAX_NEW + 1} tokens; with "
                 rf"--max_new_tokens {MAX_NEW} that exceeds the model's context \({CONTEXT}\)"),
    ("missing_model", r"error: model directory '\S*no_model' does not exist"),
    # the engine's rule (engine.prompt_problem), named by the file's line
    ("vocab", rf"error: \S*vocab\.jsonl:1: token id {VOCAB} is outside the vocabulary "
              rf"\[0, {VOCAB}\)"),
    ("not_an_arm", r"error: --spec: strategy 'chain': use '<steps>_<topk>_<verify_tokens>' "
                   r"\(e\.g\. '4_1_5'\), 'hist_<steps>', 'hyb_<steps>', "
                   r"'histtree_<steps>_<topk>_<verify_tokens>' or 'off'; or a source: "
                   r"drafter, history, hybrid"),
    ("tree_too_big", r"error: --spec: strategy 2_2_9: a tree of depth 2 and branching 2 has 7 "
                     r"candidate nodes"),
    # said before the model loads, not after the generation it would lose
    ("output_is_a_dir", r"error: --output \S*cli_errors\d*: is a directory; pass a file path"),
    ("output_under_a_file", r"error: --output \S*good\.jsonl/out\.jsonl: its directory "
                            r"\S*good\.jsonl is a file"),
])
def test_user_errors(errors, case, pattern):
  cp = errors[0][case]
  assert cp.returncode == 2, f"rc={cp.returncode}\n{cp.stderr[-3000:]}"
  assert "Traceback" not in cp.stderr, cp.stderr[-3000:]
  assert re.search(pattern, cp.stderr), cp.stderr[-3000:]
  assert cp.stdout == ""


@pytest.mark.parametrize("run", ["spec", "spec_tree", "spec_hybrid"])
def test_speculative_flags_keep_greedy_output(runs, run):
  assert _read(runs["outs"][run]) == _read(runs["outs"]["greedy"])
  assert "mean acceptance length" in runs["procs"][run].stderr
