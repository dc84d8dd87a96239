"""Packed attention, forward + backward of one layer, per implementation (gpu_check's learner
stage, scripts/gpu_learner.py): our segment-skipping flash attention
(kernels/flash_attention.py), JAX's Pallas `mha` that it replaced (causal over whole rows;
deprecated in JAX for tokamax, timed here while JAX still ships it) and XLA's masked
reference. Rows are packed with long-tailed responses (lognormal lengths) laid end to end, as
the learner packs them; each implementation's outputs are compared with XLA's on the tokens
that count, and the blocks our kernel visits are counted against a causal kernel's.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.kernels import flash_attention
from tlt_jax.models.attention import attend, segment_causal_mask

IMPLS = ("flash", "mha", "xla")


def packed_segments(rows: int, t: int, median: float, seed: int = 0) -> np.ndarray:
  """[rows, t] int32 segment ids: lognormal lengths (sigma 1, at least 16 tokens) laid end to
  end, ids 1, 2, ... per row, a row's tail that no next length fits left as padding (0)."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, t), np.int32)
  for r in range(rows):
    pos, sid = 0, 1
    while True:
      n = int(max(16, min(t, rng.lognormal(math.log(median), 1.0))))
      if pos + n > t:
        break
      seg[r, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  return seg


def bench_segments(rows: int, t: int, median: float | None = None) -> np.ndarray:
  """`bench`'s segment ids: responses of median t / 8 unless given."""
  return packed_segments(rows, t, median or t / 8)


def _mha(q, k, v, seg, interpret):
  """JAX's Pallas kernel, as models/attention.py called it before ours: kv heads repeated,
  causal, 128-wide forward blocks and 64-wide backward ones."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  t = q.shape[1]
  b = flash_attention.pow2_divisor(t, 128)
  c = min(b, 64)
  sizes = jax_attention.BlockSizes(block_q=b, block_k=b, block_q_dkv=c, block_kv_dkv=c,
                                   block_q_dq=c, block_kv_dq=c)
  return jax_attention.mha(q, k, v, seg, sm_scale=1.0 / math.sqrt(q.shape[3]), causal=True,
                           block_sizes=sizes, interpret=interpret)


def _attention(impl: str, interpret: bool):
  if impl == "flash":
    return lambda q, k, v, s: flash_attention.packed_flash_attention(q, k, v, s,
                                                                    interpret=interpret)
  if impl == "mha":
    return lambda q, k, v, s: _mha(q, k, v, s, interpret)
  if impl == "xla":
    return lambda q, k, v, s: attend(q, k, v, segment_causal_mask(s))
  raise ValueError(f"packed attention impl {impl!r}: one of {IMPLS}")


def bench(rows: int = 4, t: int = 4096, heads: int = 28, kv_heads: int = 4, head_dim: int = 128,
          dtype: str = "bfloat16", median: float | None = None, iters: int = 5,
          impls=IMPLS, interpret: bool | None = None) -> dict:
  """Each implementation's forward + backward (the gradient of a weighted sum of the outputs
  in q, k and v), jitted: its compile seconds, the median of `iters` timed calls, and the max
  |difference| of its outputs from XLA's over the tokens that count. An implementation that
  raises is reported with its error. Defaults: Qwen2.5-7B's heads, rows of 4096 tokens,
  responses of median t / 8."""
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  seg = bench_segments(rows, t, median)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (rows, t, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (rows, t, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (rows, t, kv_heads, head_dim), dtype)
  w = jax.random.normal(keys[3], q.shape, dtype)
  s = jnp.asarray(seg)
  valid = np.asarray(seg > 0)
  visited, causal = flash_attention.visited_blocks(seg, heads // kv_heads)
  out = {"rows": rows, "t": t, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
         "dtype": dtype, "segments": int(sum(len(set(r[r > 0])) for r in seg)),
         "padding": float(1 - valid.mean()), "visited_blocks": visited,
         "causal_blocks": causal, "results": []}
  first = None
  for impl in impls:
    attn = _attention(impl, interpret)

    def step(q, k, v, s):
      o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, s), q, k, v)
      return o, vjp(w)

    r = {"impl": impl}
    try:
      t0 = time.perf_counter()
      fn = jax.jit(step).lower(q, k, v, s).compile()
      r["compile_s"] = time.perf_counter() - t0
      o, grads = fn(q, k, v, s)
      jax.block_until_ready(grads)
      times = []
      for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, s))
        times.append(time.perf_counter() - t0)
      r["ms"] = 1e3 * statistics.median(times)
      o = np.asarray(o, np.float32)[valid]
      if first is None:
        first = o
      r["max_abs_vs_first"] = float(np.max(np.abs(o - first)))
    except ImportError as e:  # JAX's own Pallas ops left jax in 0.12.1 (mha among them)
      r["error"] = f"not in jax {jax.__version__} ({e})"
    except Exception as e:  # noqa: BLE001 - a kernel that does not build here is a finding
      r["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    out["results"].append(r)
  return out


def table(res: dict) -> str:
  """Markdown: one row per implementation, its time and speed against each other's."""
  done = {r["impl"]: r for r in res["results"] if "ms" in r}
  head = (f"Packed attention, forward + backward of one layer: {res['rows']} rows of "
          f"{res['t']} tokens, {res['segments']} responses, {res['padding']:.0%} padding; "
          f"{res['heads']} heads over {res['kv_heads']} kv heads of {res['head_dim']}, "
          f"{res['dtype']}. Our kernel visits {res['visited_blocks']} of the "
          f"{res['causal_blocks']} blocks a causal kernel visits "
          f"({res['visited_blocks'] / res['causal_blocks']:.0%}).")
  first = res["results"][0]["impl"] if res["results"] else "-"
  lines = [head, "", "| attention | ms | compile s | x of xla's speed | x of mha's speed | "
           f"max abs vs {first} |", "|---|---:|---:|---:|---:|---:|"]
  for r in res["results"]:
    if "error" in r:
      lines.append(f"| {r['impl']} | fails: {r['error'][:200]} ||||| ")
      continue
    ratio = lambda other: (f"{done[other]['ms'] / r['ms']:.2f}" if other in done else "-")
    lines.append(f"| {r['impl']} | {r['ms']:.2f} | {r['compile_s']:.1f} | {ratio('xla')} | "
                 f"{ratio('mha')} | {r['max_abs_vs_first']:.1e} |")
  return "\n".join(lines)
