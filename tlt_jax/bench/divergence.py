"""Why a greedy speculative arm's outputs differ from plain decoding's: numerics or a bug.

Greedy speculative decoding is lossless in exact arithmetic, but in bfloat16 plain decoding
(a T=1 forward per token) and verification (a T=K+1 forward) round differently, so a near-tied
argmax can flip and the continuations part from there. For each differing row `explain` finds
the first differing response token and recomputes the target's logits there in float32 (a
float32 copy of the params, one full-sequence forward of prompt + the common prefix, no KV
cache; matmuls at full float32 precision, not TF32) and in the engine's dtype (the same
forward, the engine's precision): the float32 margin between the two tokens set against how
far the engine's rounding moves a margin. A margin within it is a near-tie (numerics); one
well outside it means the arm decoded a token float32 does not rank near the top: a bug
signal. scripts/bench_regime.py (tlt_jax/bench/regime.py) reports it
beside each greedy `outputs = plain` cell.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import ModelConfig, compute_logits, sequence_hidden

PAD_TO = 64  # sequence lengths padded to a multiple of this (fewer compiles; causal: harmless)
ROWS = 8  # sequences per forward


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
  """Index of the first token where a and b differ; the shorter's length when one is a strict
  prefix of the other; None when they are equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if int(x) != int(y):
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def last_logits(params, cfg: ModelConfig, seqs: Sequence[Sequence[int]]) -> np.ndarray:
  """float32 logits [len(seqs), V] that predict the token after each sequence (no cache,
  causal; sequences padded at the end to a multiple of PAD_TO, in forwards of ROWS rows)."""
  hidden = sequence_hidden(params, seqs, cfg=cfg, batch=ROWS, multiple=PAD_TO)
  last = jnp.stack([h[-1] for h in hidden])
  return np.asarray(compute_logits(params, last, cfg), np.float32)


def float32_copy(params, cfg: ModelConfig):
  """The same weights (already rounded to the engine's dtype) and config in float32."""
  up = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(up, params), cfg.replace(dtype="float32", param_dtype="float32")


def margins(params, cfg: ModelConfig, cases: Sequence[tuple[Sequence[int], int, int]]
            ) -> list[dict]:
  """cases: (context: prompt + the common prefix, plain's token, SD's token). Per case:
  margin_f32 (float32 logit of plain's token minus SD's), top2_gap_f32 (float32's top-1 logit
  minus its top-2), f32_token (float32's argmax), dev (max |engine-dtype logit - float32 logit|
  over the vocab, the same forward in cfg's dtype), ulp (max |logit| x the dtype's unit
  roundoff: a logit's own rounding), rounding = 2 x max(dev, ulp) (how far rounding can move
  the difference of two logits, each off by up to that much) and near_tie = |margin_f32| <=
  rounding."""
  if not cases:
    return []
  p32, c32 = float32_copy(params, cfg)
  seqs = [list(map(int, c)) for c, _, _ in cases]
  with jax.default_matmul_precision("highest"):  # no TF32 for the reference (GPU default)
    f32 = last_logits(p32, c32, seqs)
  low = last_logits(params, cfg, seqs) if cfg.compute_dtype != jnp.float32 else f32
  unit = float(jnp.finfo(cfg.compute_dtype).eps) / 2
  res = []
  for (_, a, b), lf, ll in zip(cases, f32, low):
    top = np.sort(lf)[::-1]
    dev = float(np.max(np.abs(ll - lf)))
    ulp = float(np.max(np.abs(lf))) * unit
    rounding = 2 * max(dev, ulp)
    margin = float(lf[a] - lf[b])
    res.append({"margin_f32": margin, "top2_gap_f32": float(top[0] - top[1]) if len(top) > 1
                else float("inf"), "f32_token": int(np.argmax(lf)), "dev": dev, "ulp": ulp,
                "rounding": rounding, "near_tie": abs(margin) <= rounding})
  return res


def explain(params, cfg: ModelConfig, prompts: dict, base: dict, out: dict) -> list[dict]:
  """Per row (a key of base/out: (request_id, sample_index), responses as token lists; prompts:
  the same keys to prompt ids) whose response differs from plain's: row, sample, position (the
  first differing response token), plain_token, sd_token (None where that response ended)
  and, where both have a token, `margins`' fields at that point. Rows with identical prompt
  + prefix share one forward."""
  rows, uniq, index = [], [], {}
  for key in sorted(set(base) | set(out)):
    a, b = base.get(key, []), out.get(key, [])
    pos = first_divergence(a, b)
    if pos is None:
      continue
    rid, sample = key if isinstance(key, tuple) else (key, 0)
    ta = int(a[pos]) if pos < len(a) else None
    tb = int(b[pos]) if pos < len(b) else None
    row = {"row": rid, "sample": sample, "position": pos, "plain_token": ta, "sd_token": tb}
    if ta is not None and tb is not None:
      case = (tuple(int(x) for x in prompts[key]) + tuple(int(x) for x in a[:pos]), ta, tb)
      row["_case"] = index.setdefault(case, len(uniq))
      if row["_case"] == len(uniq):
        uniq.append(case)
    rows.append(row)
  found = margins(params, cfg, uniq)
  for row in rows:
    i = row.pop("_case", None)
    row.update(found[i] if i is not None else {"near_tie": None})
  return rows


def _fmt(x: float) -> str:
  return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3f}"


def describe(rows: list[dict], total: int, dtype: str = "bfloat16", show: int = 2) -> str:
  """The `outputs = plain` cell of a greedy arm whose outputs differ: `explain`'s rows, the
  first `show` of them spelled out, e.g. "False (1 of 4 rows; row 2 from token 37: float32
  margin 0.0041 vs bfloat16 rounding 0.062: near-tie)"."""
  def one(r):
    name = f"row {r['row']}" + (f".{r['sample']}" if r["sample"] else "")
    head = f"{name} from token {r['position']}"
    if r.get("margin_f32") is None:
      return f"{head}: {'plain' if r['plain_token'] is None else 'SD'} ended there"
    verdict = "near-tie" if r["near_tie"] else "NOT a near-tie: bug signal"
    return (f"{head}: float32 margin {_fmt(r['margin_f32'])} vs {dtype} rounding "
            f"{_fmt(r['rounding'])}: {verdict}")
  ties = sum(bool(r.get("near_tie")) for r in rows)
  more = f"; +{len(rows) - show} more" if len(rows) > show else ""
  return (f"False ({len(rows)} of {total} rows, {ties} near-ties; "
          + "; ".join(one(r) for r in rows[:show]) + more + ")")
