"""Held-out evaluation: accuracy of a model on a prompt split under its reward, greedy or
sampled (avg@n and pass@k, as reasoning-RL papers report AIME's).

  python -m tlt_jax.eval --config configs/default.py [--config.eval.num_prompts=100]
  python -m tlt_jax.eval --config configs/default.py --config.eval.n=16 \
      --config.eval.temperature=1.0

Prints accuracy (overall, per source where the rows have several: each file of a
comma-separated data.test_path, or data.source_key's field; by `num_terms` when rows carry it;
with eval.n samples a prompt, the mean over every sample: avg@n, and the unbiased pass@k),
response-length quantiles and decode throughput; writes them to <workdir>/eval.json, and
every response (its prompt, answer, reward) to <workdir>/eval_responses.jsonl.
`evaluate` is reused by the RL loop for its periodic held-out evaluation; `held_out` leaves
out the prompts a rollout cannot take, as training's stream does.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from tlt_jax.data.dataset import encode_prompt, encode_rows
from tlt_jax.data.prompts import DataError, PromptRow
from tlt_jax.metrics import append_jsonl, numbers
from tlt_jax.rl.reward_pool import RewardPool
from tlt_jax.rl.rewards import extra_means
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import EngineHooks, Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.wandb_log import WandbRun


# accuracy_by_source's name for rows without a source among rows with one (verl's default
# data_source)
UNKNOWN_SOURCE = "unknown"


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
  a = np.asarray(lengths, np.float64)
  if a.size == 0:
    return {}
  return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
          "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
          "max": float(a.max())}


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al.,
  2021): 1 - C(n - c, k) / C(n, k), as a product (no large binomials)."""
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at(scores: np.ndarray) -> dict[str, float]:
  """pass@k for k = 1, 2, 4, ... and n, averaged over prompts, from their rewards [prompts, n]
  (a response is correct where its reward is >= 1)."""
  n = scores.shape[1]
  correct = (scores >= 1.0).sum(axis=1)
  ks = sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})
  return {str(k): float(np.mean([pass_at_k(n, int(c), k) for c in correct])) for k in ks}


def held_out(rows: Sequence[PromptRow], tokenizer, *, max_prompt_len: int,
             chat_template: bool = False, system_prompt: str = ""
             ) -> tuple[list[PromptRow], int]:
  """The held-out rows a rollout can take and how many were left out, as training's stream
  leaves them (`encode_rows`: longer than max_prompt_len tokens, or encoding to no token);
  none left is a DataError naming the fix."""
  prompts, long, empty = encode_rows(rows, tokenizer, max_prompt_len=max_prompt_len,
                                     chat_template=chat_template, system_prompt=system_prompt)
  if not prompts:
    raise DataError(f"config.data.test_path: none of its {len(rows)} prompts fits ({long} "
                    f"longer than config.data.max_prompt_len={max_prompt_len} tokens, "
                    f"{len(empty)} of no token); raise max_prompt_len or check "
                    "data.prompt_key")
  return [p.row for p in prompts], long + len(empty)


def accuracy_text(first: dict[str, Any], last: dict[str, Any] | None = None) -> str:
  """An eval record's accuracy for a line of text, each source's after it: "0.472" or
  "0.472 (aime24 0.100, math500 0.620)"; with `last`, from `first` to it ("0.472 -> 0.568
  (aime24 0.100 -> 0.133, ...)")."""
  def pair(a, b):
    return f"{a:.3f}" if b is None else f"{a:.3f} -> {b:.3f}"
  text = pair(first["accuracy"], last and last["accuracy"])
  sources = [(name, a, last and last.get("accuracy_by_source", {}).get(name))
             for name, a in first.get("accuracy_by_source", {}).items()]
  if sources:
    text += " (" + ", ".join(f"{name} {pair(a, b)}" for name, a, b in sources) + ")"
  return text


def sampling_of(cfg) -> tuple[int, SamplingParams]:
  """config.eval's samples per prompt and their sampling (temperature 0: greedy)."""
  e = cfg.eval
  return int(e.get("n", 1)), SamplingParams(temperature=float(e.get("temperature", 0.0)),
                                            top_p=float(e.get("top_p", 1.0)))


def response_record(index: int, row: PromptRow, res, text: str, reward: float,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """One response as rollouts.jsonl and eval_responses.jsonl write it: its prompt's index
  (among the step's prompts, or the held-out rows), the row's source, prompt (as the data
  gives it: text or chat messages) and answer, the response's text (special tokens left
  out), reward, length and why it ended; `reward_extra`, a verl-style reward's other entries,
  where it returned some."""
  rec = {"prompt_index": int(index), "sample": int(res.sample_index), "source": row.source,
         "prompt": row.prompt, "answer": row.answer, "response": text,
         "reward": float(reward), "tokens": int(res.num_tokens),
         "finish_reason": res.finish_reason}
  if extra:
    rec["reward_extra"] = extra
  return rec


def evaluate(engine: Engine, tokenizer, rows: Sequence[PromptRow], pool: RewardPool, *,
             seed: int = 0, progress: bool = True, chat_template: bool = False,
             system_prompt: str = "", policies=None, speculate: bool = True, n: int = 1,
             sampling: SamplingParams = SamplingParams(temperature=0.0),
             keep: int | None = 0) -> dict[str, Any]:
  """Decodes `n` responses to every row (prompts encoded as training encodes them; greedy
  where `sampling` is, and then n is 1) and scores them; returns a metrics dict: `accuracy`
  the mean reward over every response (avg@n), with n > 1 `pass_at` the unbiased pass@k
  (k = 1, 2, 4, ... and n; a response is correct where its reward is >= 1) averaged over the
  prompts; where the rows come from more than one source (several test files, or
  data.source_key's field), each one's apart: `accuracy_by_source`, `prompts_by_source` and
  with n > 1 `pass_at_by_source` (rows without a source as "unknown"). Each response goes
  to the reward `pool` as it finishes, scored in its worker processes while the rest decode
  (as training's are). `policies`: the bandit and gate cells for these chunks
  (policies/cells.py's PolicyCells; the RL loop passes evaluation's own bandit and a gate it
  does not measure, so evaluation never moves the training policies;
  None: a fresh bandit). `keep`: `responses`, the records (`response_record`) of each
  source's first `keep` prompts' responses (None: every prompt's; 0: none)."""
  if n > 1 and sampling.greedy:
    raise ValueError(f"evaluate: {n} greedy responses to a prompt are one; sample (a "
                     "temperature > 0) or take n=1")
  requests = [Request(ids, request_id=i, sample_index=j)
              for i, r in enumerate(rows)
              for ids in [encode_prompt(tokenizer, r.prompt, chat_template=chat_template,
                                        system_prompt=system_prompt)]
              for j in range(n)]
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(requests), desc="eval", unit="response", file=sys.stderr)
  call = object()  # this call's keys in the pool, whoever else uses it

  def score(res) -> None:
    row = rows[res.request_id]
    pool.submit((call, res.request_id, res.sample_index),
                tokenizer.decode(res.response_ids, skip_special_tokens=True),
                row.answer, row.source, row.extra_info)
    if bar:
      bar.update(1)

  t0 = time.perf_counter()
  results = engine.generate(requests, sampling, seed=seed, hooks=EngineHooks(on_result=score),
                            policies=policies, speculate=speculate)
  wall = time.perf_counter() - t0
  if bar:
    bar.close()
  results.sort(key=lambda r: (r.request_id, r.sample_index))
  extras: dict = {}
  rewards = pool.gather([(call, r.request_id, r.sample_index) for r in results], extras)
  scores, lengths, kept = [], [], []
  by_terms: dict[int, list[float]] = collections.defaultdict(list)
  rank = _rank_in_source(rows)
  for res in results:
    row = rows[res.request_id]
    key = (call, res.request_id, res.sample_index)
    s = rewards[key]
    scores.append(s)
    lengths.append(res.num_tokens)
    if keep is None or rank[res.request_id] < keep:
      kept.append(response_record(res.request_id, row, res, tokenizer.decode(
          res.response_ids, skip_special_tokens=True), s, extras.get(key)))
    if "num_terms" in row.extra:
      by_terms[int(row.extra["num_terms"])].append(s)
  tokens = int(sum(lengths))
  out = {
      "accuracy": float(np.mean(scores)),
      "num_prompts": len(rows),
      "samples": n,
      "temperature": sampling.temperature,
      "response_length": length_stats(lengths),
      "tokens": tokens,
      "wall_seconds": wall,
      "tokens_per_second": tokens / wall if wall > 0 else 0.0,
      "truncated": sum(r.finish_reason == "length" for r in results),
  }
  if extras:  # (a verl-style reward's numbers, each averaged over the responses with it)
    out["reward_extra"] = extra_means(extras.values())
  if keep != 0:
    out["responses"] = kept
  per_prompt = np.asarray(scores, np.float64).reshape(len(rows), n)  # (results sorted)
  if n > 1:
    out["pass_at"] = pass_at(per_prompt)
  sources = [UNKNOWN_SOURCE if r.source is None else r.source for r in rows]
  if len(set(sources)) > 1:  # (in the rows' order: the test files' as listed)
    parts = {name: per_prompt[[s == name for s in sources]] for name in dict.fromkeys(sources)}
    out["accuracy_by_source"] = {name: float(a.mean()) for name, a in parts.items()}
    out["prompts_by_source"] = {name: len(a) for name, a in parts.items()}
    if n > 1:
      out["pass_at_by_source"] = {name: pass_at(a) for name, a in parts.items()}
  if by_terms:
    groups = {"2-4 terms": (2, 4), "5-9 terms": (5, 9), "10+ terms": (10, 10**9)}
    out["accuracy_by_terms"] = {
        name: float(np.mean([s for k, v in by_terms.items() if lo <= k <= hi for s in v]))
        for name, (lo, hi) in groups.items()
        if any(lo <= k <= hi for k in by_terms)}
  return out


def _rank_in_source(rows: Sequence[PromptRow]) -> list[int]:
  """Each row's index among its source's rows."""
  seen: collections.Counter = collections.Counter()
  out = []
  for r in rows:
    out.append(seen[r.source])
    seen[r.source] += 1
  return out


def main(argv):
  del argv
  from tlt_jax import runtime
  from tlt_jax.config import run_spec
  cfg = _CONFIG.value
  spec = runtime.prepare(run_spec(cfg), training=False)
  # (before the model loads: a wandb login problem costs nothing)
  board = WandbRun.start(spec.wandb, cfg.workdir, cfg.to_dict(), job_type="eval")
  code = 1
  try:
    _evaluate_and_report(cfg, spec, board)
    code = 0
  except KeyboardInterrupt:
    code = 130
    raise
  finally:
    if board is not None:
      board.close(code)


def _evaluate_and_report(cfg, spec, board) -> None:
  """main's work: evaluate, write eval.json and eval_responses.jsonl (and to `board`, a
  WandbRun or None, the numbers under training's names, `eval/...`, and the responses as its
  table), print the summary."""
  from tlt_jax import runtime
  rows = runtime.load_test_rows(cfg)
  model_cfg, params, tokenizer, stop = runtime.load_model(cfg, rows=rows)
  engine = Engine(params, model_cfg, spec.engine_config(
      stop, max_batch=cfg.eval.batch_size, speculative=False))
  d = cfg.data
  rows, left_out = held_out(rows, tokenizer, max_prompt_len=d.max_prompt_len,
                            chat_template=d.chat_template, system_prompt=d.system_prompt)
  with runtime.reward_pool(cfg) as pool:  # as in training: a hang costs one reward
    n, sampling = sampling_of(cfg)
    metrics = evaluate(engine, tokenizer, rows, pool, seed=cfg.seed,
                       chat_template=d.chat_template, system_prompt=d.system_prompt, n=n,
                       sampling=sampling, keep=None)
  responses = os.path.join(cfg.workdir, "eval_responses.jsonl")
  if os.path.exists(responses):
    os.remove(responses)  # (an earlier evaluation's, as eval.json is replaced)
  kept = metrics.pop("responses")
  append_jsonl(responses, kept)
  metrics["left_out"] = left_out
  metrics["reward_failures"] = {"errors": pool.stats.errors, "timeouts": pool.stats.timeouts,
                                "crashes": pool.stats.crashes}
  metrics["compile"] = engine.compile_stats()
  metrics["model"] = cfg.model.path
  with open(os.path.join(cfg.workdir, "eval.json"), "w") as f:
    json.dump(metrics, f, indent=2)
  if board is not None:
    board.log(0, numbers({"eval": metrics}), [("eval_responses", kept)])
  lens = metrics["response_length"]
  how = ("greedy" if n == 1 and sampling.greedy else
         f"avg@{n}, temperature {sampling.temperature:g}, top_p {sampling.top_p:g}")
  out = (f"; {left_out} left out: longer than data.max_prompt_len={d.max_prompt_len} tokens "
         "or of no token" if left_out else "")
  print(f"accuracy {metrics['accuracy']:.3f} on {metrics['num_prompts']} prompts "
        f"({how}; truncated {metrics['truncated']}{out})")
  if "pass_at" in metrics:
    print("  " + ", ".join(f"pass@{k} {v:.3f}" for k, v in metrics["pass_at"].items()))
  for name, acc in metrics.get("accuracy_by_source", {}).items():
    passes = "".join(f", pass@{k} {v:.3f}"
                     for k, v in metrics.get("pass_at_by_source", {}).get(name, {}).items())
    print(f"  {name}: accuracy {acc:.3f} on {metrics['prompts_by_source'][name]} "
          f"prompts{passes}")
  for name, acc in metrics.get("accuracy_by_terms", {}).items():
    print(f"  {name:>10}: {acc:.3f}")
  print(f"response length mean {lens['mean']:.1f} p50 {lens['p50']:.0f} p90 {lens['p90']:.0f} "
        f"max {lens['max']:.0f}; {metrics['tokens_per_second']:.0f} tokens/s "
        f"({metrics['compile']['executables']} executables, "
        f"{metrics['compile']['compile_seconds']:.1f}s compile)")
  print(f"wrote {os.path.join(cfg.workdir, 'eval.json')}, every response in {responses}")


if __name__ == "__main__":
  from absl import app
  from ml_collections import config_flags

  from tlt_jax.config import flags_parser
  _CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
  from tlt_jax.runtime import exit_on_user_error
  app.run(exit_on_user_error(main), flags_parser=flags_parser)
