"""A mixture of experts' MLP on the device (gpu_check's `experts` stage): one layer of
Qwen3-30B-A3B's experts (by default: D 2048, 128 experts of width 768, 8 a token, bf16), the
ways models/moe.py computes it, timed.

Cells, in order, each only if started within the budget:
- `check`: `moe.grouped_impl`, the start-up check a run makes (the Pallas grouped matmul
  compiled, forward and backward, against ragged_dot): which the learner and prefill use;
- `learner`: forward + backward of the experts over a learner micro-batch's tokens
  (--tokens), through the kernel and through ragged_dot: ms, and TFLOP/s over the k experts'
  FLOPs a token (what the simulator prices; ragged_dot's zero-padded lowering does E / k
  times them and may run out of memory: reported so);
- `decode`: a rollout step's experts at each of --decode tokens, through the kernel and
  XLA's way there (gathered / every expert / ragged_dot): ms, and the bytes of the distinct
  experts its tokens route to (`moe.experts_read`) over that time against a same-process
  copy's bandwidth: the figures that say whether the kernel should serve every step size.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.bench.rollout import timed
from tlt_jax.bench.roofline import copy_bandwidth
from tlt_jax.models import moe
from tlt_jax.models.config import ModelConfig


def config(d: int, f: int, e: int, k: int, dtype: str, experts: str = "auto") -> ModelConfig:
  """A one-layer Qwen3-MoE config of these expert dims (attention: any valid shape)."""
  return ModelConfig(arch="qwen3_moe", vocab_size=256, hidden_size=d, intermediate_size=k * f,
                     num_layers=1, num_heads=max(d // 128, 1), num_kv_heads=1,
                     head_dim=128 if d >= 128 else d, qk_norm=True, num_experts=e,
                     experts_per_token=k, moe_intermediate_size=f, norm_topk_prob=True,
                     dtype=dtype, param_dtype=dtype, experts=experts)


def layer(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random router and experts of one layer (as models/moe.py reads them)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
  dt = cfg.compute_dtype
  normal = lambda key, shape, fan: (jax.random.normal(key, shape, jnp.float32)  # noqa: E731
                                    / np.sqrt(fan)).astype(dt)
  return {"router": normal(keys[0], (d, e), d), "expert_gate": normal(keys[1], (e, d, f), d),
          "expert_up": normal(keys[2], (e, d, f), d),
          "expert_down": normal(keys[3], (e, f, d), f)}


def _time(fn: Callable, *args, iters: int) -> float:
  """Best seconds of `iters` calls after one (the compile's): bench/rollout.py's `timed`."""
  jax.block_until_ready(fn(*args))
  return timed(lambda: jax.block_until_ready(fn(*args)), iters)[1]


def _way(impl: str, n: int, cfg: ModelConfig):
  """The experts' function a forward over n tokens runs: the kernel, or XLA's way there."""
  return moe._grouped_kernel if impl == "kernel" else moe.path(n, cfg)


def _experts_fwd_bwd(cfg: ModelConfig, impl: str, n: int):
  """loss(x, lp) = sum of the experts' outputs x a fixed cotangent; its gradient in x and
  the experts (the learner's backward)."""
  way = _way(impl, n, cfg)

  def loss(x, lp, dy):
    w, e = moe.route(x, lp["router"], cfg, cfg.compute_dtype)
    y = way(x, w, e, lp, cfg.compute_dtype)
    return jnp.sum((y * dy).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def cells(d: int, f: int, e: int, k: int, dtype: str, tokens: int, decode: list[int],
          iters: int, budget_s: float) -> Iterator[dict]:
  """Each cell's record as it finishes (the module docstring); a cell past the budget, or one
  that raises, says so and the rest still run."""
  t0 = time.perf_counter()
  over = lambda: budget_s and time.perf_counter() - t0 > budget_s  # noqa: E731
  cfg = config(d, f, e, k, dtype)
  t = time.perf_counter()
  impl, why = moe.grouped_impl(cfg)
  yield {"cell": "check", "impl": impl, "why": why, "s": round(time.perf_counter() - t, 2)}
  lp = layer(cfg)
  x = jax.random.normal(jax.random.key(1), (tokens, d), jnp.float32).astype(cfg.compute_dtype)
  dy = jax.random.normal(jax.random.key(2), (tokens, d), jnp.float32).astype(cfg.compute_dtype)
  flops = 3 * 2.0 * 3 * tokens * k * d * f  # 3 matmuls a pass, forward + backward's two
  for name in ("kernel", "xla"):
    if over():
      yield {"cell": f"learner {name}", "skipped": "out of the budget"}
      continue
    try:
      s = _time(_experts_fwd_bwd(cfg, name, tokens), x, lp, dy, iters=iters)
      yield {"cell": f"learner {name}", "tokens": tokens, "ms": round(1e3 * s, 3),
             "tflops": round(flops / s / 1e12, 1)}
    except Exception as err:  # noqa: BLE001 - reported, the next cell runs
      yield {"cell": f"learner {name}", "failed": str(err).splitlines()[0][:200]}
  if over():
    yield {"cell": "decode", "skipped": "out of the budget"}
    return
  bw = copy_bandwidth(min(1 << 30, 64 * e * d * f))
  nb = jnp.dtype(cfg.compute_dtype).itemsize
  for n in decode:
    for name in ("kernel", "xla"):
      if over():
        yield {"cell": f"decode {n} {name}", "skipped": "out of the budget"}
        continue
      way = _way(name, n, cfg)
      xs = x[:n] if n <= tokens else jnp.resize(x, (n, d))

      def step(x, lp, way=way):
        w, e = moe.route(x, lp["router"], cfg, cfg.compute_dtype)
        return way(x, w, e, lp, cfg.compute_dtype)
      try:
        s = _time(jax.jit(step), xs, lp, iters=iters)
      except Exception as err:  # noqa: BLE001 - reported, the next cell runs
        yield {"cell": f"decode {n} {name}", "failed": str(err).splitlines()[0][:200]}
        continue
      read = moe.experts_read(cfg, n) * 3 * d * f * nb
      yield {"cell": f"decode {n} {name}", "way": way.__name__.strip("_"),
             "ms": round(1e3 * s, 4), "experts_read": round(moe.experts_read(cfg, n), 1),
             "pct_copy_bw": round(100 * read / s / bw, 1)}


def table(records: list[dict]) -> list[str]:
  """The cells as markdown lines."""
  out = ["| cell | result |", "|---|---|"]
  for r in records:
    rest = ", ".join(f"{k} {v}" for k, v in r.items() if k != "cell")
    out.append(f"| {r['cell']} | {rest} |")
  return out
