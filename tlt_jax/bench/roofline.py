"""How close a decode step runs to the memory limit: bytes a step moves / step time, against
the device's copy bandwidth measured in the same process.

At small batch a decode step is bound by reads, not arithmetic: each step streams every weight
once (a [B, D] x [D, F] matmul does B multiply-adds per weight read) plus the KV window it
attends over. So the fastest a step can be is (weights + KV read) / bandwidth, and the figure
of merit is that bound / the measured step: the fraction of copy bandwidth the step reaches.
Shared by scripts/gpu_decode.py (copy bandwidth, KV bytes) and tlt_jax/bench/regime.py (per
workload).

  copy bandwidth  a jitted in-place `x + 1` over 1 GiB: bytes read + written / median time. The
                  reference every fraction is taken against, measured in the same invocation
                  because this machine's bandwidth drifts between runs.
  step            one plain decode step as the engine runs it (`spec_costs.measure_costs`'s
                  plain step: `decode_chunk` in one compiled loop), with the attention window
                  the engine would pick for rows of that length (`kv_bucket` of the longest row
                  + the loop's reach, as `CompilePlan.window` does).
  weight bytes    every parameter a step reads: all of them, except an untied embedding table
                  (a step gathers B of its rows; tied, it is the LM head and read whole).
  KV bytes        batch x kv_len x (2 x layers x kv_heads x head_dim x itemsize): the window
                  is read for every row, live or masked.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from tlt_jax.bench.spec_costs import measure_costs
from tlt_jax.rollout.scheduler import kv_bucket


def copy_bandwidth(nbytes: int = 1 << 30, dtype=jnp.float32, repeats: int = 20) -> float:
  """Bytes per second of a jitted elementwise pass (read + write) over `nbytes`, in place (the
  input donated). In place because a fresh 1 GiB output costs its first touch on a CPU: page
  faults made the undonated pass 4.5-5x slower (5.3 vs 24 and 7.9 vs 42 GB/s in two runs on
  this 2-core Xeon), a figure of the allocator, not of memory. float32 by default: on a CPU
  a bfloat16 add converts through float32 and runs at half the float32 rate (2.4 GB/s
  undonated); on a GPU both dtypes reach the same bandwidth."""
  f = jax.jit(lambda x: x + 1, donate_argnums=0)
  x = f(jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype))
  x.block_until_ready()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    x = f(x)
    x.block_until_ready()
    ts.append(time.perf_counter() - t)
  return 2 * x.nbytes / statistics.median(ts)


def weight_bytes(params, cfg) -> int:
  """Bytes of parameters one decode step reads (module docstring)."""
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total if cfg.tie_word_embeddings else total - params["embed"].nbytes


def kv_bytes_per_token(cfg, dtype) -> int:
  """KV cache bytes of one token in every layer: keys + values."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim_ * jnp.dtype(dtype).itemsize


def decode_roofline(params, cfg, batch: int, sp, bandwidth: float, *, prompt_len: int,
                    cache_len: int, prompt_bucket: int = 16, iters: int = 32) -> dict:
  """The plain decode step at `batch` rows of `prompt_len` tokens decoding `iters` steps (in a
  cache of `cache_len` slots, attending over the engine's window) against `bandwidth` (bytes/s,
  `copy_bandwidth`): step_s, kv_len, weight_bytes, kv_bytes (read per step), bytes_per_s
  achieved and fraction (of `bandwidth`)."""
  kv_len = kv_bucket(prompt_len + iters, prompt_bucket, cache_len)
  step = measure_costs(params, None, cfg, batch, [], sp, iters=iters, prompt_len=prompt_len,
                       cache_len=cache_len, kv_len=kv_len)["plain step"]
  wb = weight_bytes(params, cfg)
  kvb = batch * kv_len * kv_bytes_per_token(cfg, cfg.compute_dtype)  # init_cache's dtype
  return {"batch": batch, "prompt_len": prompt_len, "kv_len": kv_len, "step_s": step,
          "weight_bytes": wb, "kv_bytes": kvb, "bytes_per_s": (wb + kvb) / step,
          "fraction": (wb + kvb) / step / bandwidth}


TABLE_HEAD = ("| workload | batch | kv_len | step ms | weights MB | KV read MB | GB/s | "
              "% of copy bw |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def table_row(name: str, r: dict) -> str:
  """One markdown row of `decode_roofline`'s result (header: TABLE_HEAD)."""
  return (f"| {name} | {r['batch']} | {r['kv_len']} | {r['step_s'] * 1e3:.2f} | "
          f"{r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes'] / 1e6:.1f} | "
          f"{r['bytes_per_s'] / 1e9:.1f} | {r['fraction']:.0%} |")


def roofline_section(params, cfg, workloads, cache_len: int) -> dict:
  """Copy bandwidth measured now, then one `decode_roofline` row per workload (name, batch,
  sampling params, prompt length), printed as a markdown table; the benchmarks' section on how
  close decoding runs to the memory limit. Returns {copy_bandwidth, workloads: name -> row}."""
  bw = copy_bandwidth()
  print(f"\n### roofline: plain decode step vs copy bandwidth ({bw / 1e9:.1f} GB/s, in-place "
        f"x + 1 over 1 GiB, read + write)\n\n{TABLE_HEAD}", flush=True)
  rows = {}
  for name, batch, sp, prompt_len in workloads:
    rows[name] = decode_roofline(params, cfg, batch, sp, bw, prompt_len=prompt_len,
                                 cache_len=cache_len)
    print(table_row(name, rows[name]), flush=True)
  return {"copy_bandwidth": bw, "workloads": rows}
