"""Attention windows against executables (scripts/bench_windows.py prints what this measures).

Decoding reads only the live tokens' window of the KV cache (`kv_len`, models/kv_cache.py),
and a window is a static shape: every (batch bucket, arm) executable exists once per window,
so speculation's executables multiply by the windows the tail visits. The choices, measured:

  grid x2      windows prompt_bucket x 2^k up to the cache (the engine's `length_grid`): a
               step reads at most 2x the live tokens; log2(cache / prompt_bucket) + 1 windows
  grid x4      prompt_bucket x 4^k: half as many windows, at most 4x the live tokens read
  whole cache  one window, the cache's capacity: reads follow the allocation, not the tokens
  block loop   one executable: the engine's paged attention (rollout.attention='paged') in its
               XLA form (kernels/paged_attention.py): a loop over blocks of 128 slots of the
               rows' pages with a dynamic trip count (online softmax), reading the live tokens
               rounded up to a block; the price is a loop per layer per forward (on a GPU,
               XLA's dynamic loops synchronise with the host at every iteration: there the
               Pallas kernel is its form)

`count` gives each scheme's speculative executables for a config by count (its choosable
(bucket, arm) pairs x its windows); `attention_step` times one decode step's attention, every
layer's pool gathered as the model does (`gather_window`, `attend`), for a row of `live`
tokens in a cache of `allocated` slots. What the engine does with them (compile a narrower
window only when what it saves repays its compile): rollout/compile_plan.py, gate.py.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.kernels.paged_attention import paged_attention
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import gather_window
from tlt_jax.models.attention import attend
from tlt_jax.rollout.scheduler import bucket_for, length_grid

SCHEMES = ("grid x2", "grid x4", "whole cache", "block loop")


def windows(scheme: str, base: int, cap: int) -> tuple[int, ...]:
  """The attention windows a scheme compiles executables for (the block loop: one, dynamic)."""
  if scheme == "grid x2":
    return length_grid(base, cap)
  if scheme == "grid x4":
    out, n = [], base
    while n < cap:
      out.append(n)
      n *= 4
    return tuple(out) + (cap,)
  if scheme in ("whole cache", "block loop"):
    return (cap,)
  raise ValueError(f"unknown scheme {scheme!r}; use one of {SCHEMES}")


def count(spec) -> dict[str, Any]:
  """A run spec's (config.run_spec) speculative (bucket, arm) pairs and, per scheme, the
  speculative chunk executables a tail that visits every window compiles (pairs x windows)."""
  from tlt_jax.rollout.plan_call import choosable_pairs
  ecfg = spec.engine
  pairs = choosable_pairs(ecfg, spec.bandit().cfg) if ecfg.spec is not None else {}
  n = sum(len(a) for a in pairs.values())
  out = {"pairs": n, "buckets": sorted(pairs), "cache_len": ecfg.cache_len}
  for s in SCHEMES:
    w = windows(s, ecfg.prompt_bucket, ecfg.cache_len)
    out[s] = {"windows": len(w), "executables": n * len(w)}
  return out


def attention_step(cfg: ModelConfig, *, batch: int, t: int, live: int, allocated: int,
                   scheme: str, base: int = 16, page: int = 16,
                   layers: int | None = None, iters: int = 50, repeats: int = 5) -> float:
  """Seconds of one decode forward's attention (`layers` of the model's layers, all by
  default; T = t query tokens per row: 1 plain, K + 1 a verification) for rows of `live`
  tokens in caches of `allocated` slots, under `scheme` (windows on `base`'s grid): the best
  of `repeats` means over `iters` calls, compiled first."""
  layers = layers or cfg.num_layers
  kvh, h, n = cfg.num_kv_heads, cfg.head_dim_, cfg.num_heads
  rows = -(-allocated // page)
  keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
  pools = [jax.random.normal(k, (batch * rows, page, kvh, h), jnp.float32) for k in keys[1:]]
  table = jnp.arange(batch * rows, dtype=jnp.int32).reshape(batch, rows)
  lengths = jnp.full((batch,), live, jnp.int32)
  q = jax.random.normal(keys[0], (batch, t, n, h), jnp.float32)
  k_new = jax.random.normal(keys[0], (batch, t, kvh, h), jnp.float32)  # the chunk's own
  w = (bucket_for(windows(scheme, base, rows * page), live + t)
       if scheme != "block loop" else None)

  def step(q, pools, table, lengths):
    out = q
    for i in range(layers):
      kp, vp = pools[2 * i], pools[2 * i + 1]
      if w is None:  # the engine's paged attention in its XLA form (the CPU's)
        o = paged_attention(out, kp, vp, table, lengths, k_new, k_new, impl="xla")
      else:
        k = gather_window(kp, table[:, :-(-w // page)], w)
        v = gather_window(vp, table[:, :-(-w // page)], w)
        slots = jnp.arange(w)[None, None, :]
        mask = slots <= lengths[:, None, None] + jnp.arange(t)[None, :, None]
        o = attend(out, k, v, mask)
      out = out + 0.01 * o  # each layer's query depends on the last (no dead code)
    return out

  fn = jax.jit(step)
  fn(q, pools, table, lengths).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(iters):
      fn(q, pools, table, lengths).block_until_ready()
    best = min(best, (time.perf_counter() - t0) / iters)
  return best

