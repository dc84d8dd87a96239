"""Verification kernels on Mosaic GPU: Hopper and newer, and every non-GPU device in Mosaic
GPU's CPU interpret mode (see `kernel_backend`).

Tiling: one warpgroup (128 lanes) per program; operands stay in GMEM (a [K+1, V] row block
is MBs, far beyond shared memory) and tiles are loaded from GMEM straight into registers
(`plgpu.load` with a WG_STRIDED layout, 16-byte vectors): each element is read once, so a
TMA/shared-memory pipeline would add a copy without reuse. Mosaic arrays span whole warpgroups
and its loads take no mask, so V is padded once outside the kernel to a multiple of 128 (-inf /
0; a no-op for real vocabularies: Qwen2.5's 151936 = 1187 * 128), the tile (`block_v`) is a
multiple of 128, and a last partial tile (V % block_v) is a static-size remainder tile. There is
no argmax primitive: full tiles fold elementwise into per-lane running (max, index) carries
(strict > keeps each lane's lowest index), reduced across lanes once per row as max, then min
index among the lanes attaining it (= jnp.argmax's lowest index on ties). The tree path is D+1
scalar carries written one by one (a [D+1] array is not a warpgroup layout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tlt_jax.kernels.verify.bodies import (_DEFAULT_BLOCK_V, _chain_greedy_kernel,
                                           _chain_sample_kernel, _tree_kernel)
from tlt_jax.kernels.verify.reference import NEG_INF, _check_chain, _check_tree, _pick

_LANES = 128  # CUDA lanes of one Mosaic GPU (Pallas) thread = one warpgroup

# The plgpu API these kernels are written against (jax >= 0.11): `plgpu.load(ref, layout=...)`
# and the CPU interpret mode (`InterpretGPUParams`). jax 0.10's `plgpu.load` takes an index
# and has no interpreter, so there `kernel_backend` picks the Triton kernels (Python 3.11's
# stack: JAX >= 0.11 needs Python >= 3.12).
AVAILABLE = hasattr(plgpu, "InterpretGPUParams")
UNAVAILABLE = (f"the Mosaic GPU verification kernels need jax >= 0.11's plgpu API "
               f"(jax {jax.__version__} here): the Triton kernels verify instead")

# Why the chain rule with draft log-probs stays on the reference on Mosaic GPU: its residual
# needs log1mexp (`reference._residual_logp`: log1p / expm1) bit-for-bit like the reference, and jax
# 0.12's Mosaic GPU lowering has no rule for lax.log1p_p / lax.expm1_p (a rewrite in exp / log
# would change the reference's, i.e. the default run's, sampled tokens).
_MOSAIC_NO_Q = ("Mosaic GPU (jax 0.12) lowers no log1p/expm1, which the draft-q residual needs "
                "bit-for-bit: chain verification with draft_logp uses the jnp reference there")


# ----------------------------------------------------------------------------------------------
# Tile loops (the bodies' row_argmax / row_race) and the launch
# ----------------------------------------------------------------------------------------------


def _mgpu_vocab(vocab: int, block_v: int | None) -> tuple[int, int]:
  """(Vp, bv): V rounded up to a multiple of 128 (the padded operands), and the tile."""
  bv = _DEFAULT_BLOCK_V if block_v is None else int(block_v)
  if bv <= 0 or bv % _LANES:
    raise ValueError(f"block_v={bv} must be a positive multiple of {_LANES} for Mosaic GPU")
  vp = pl.cdiv(vocab, _LANES) * _LANES
  return vp, min(bv, vp)


def _mgpu_pad(x, vp: int, fill: float):
  """Pad the vocab axis to vp with `fill` (-inf: no mass, never an argmax unless the whole row
  is -inf, where index 0 wins either way; 0 for noise). A no-op for real vocabularies, which
  are multiples of 128 (Qwen2.5: 151936 = 1187 * 128); only toy vocabularies pay a copy."""
  v = x.shape[-1]
  if v == vp:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, vp - v)], constant_values=fill)


def _mgpu_layout(size: int):
  """Strided over the warpgroup's 128 lanes, 16-byte vectors where the size allows."""
  vec = next(v for v in (4, 2, 1) if size % (_LANES * v) == 0)
  return plgpu.Layout.WG_STRIDED((size,), vec_size=vec)


def _mgpu_tile(ref, row, start, size: int):
  """ref[row, start:start+size] -> f32 [size], loaded from GMEM straight into registers."""
  return plgpu.load(ref.at[row, pl.ds(start, size)], layout=_mgpu_layout(size)
                    ).astype(jnp.float32)


def _mgpu_iota(start, size: int):
  return plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=_mgpu_layout(size)) + start


def _mgpu_lane_argmax(val, idx, vp: int):
  """(max, lowest index attaining it) of per-lane candidates (two cross-lane reductions)."""
  m = jnp.max(val)
  return m, jnp.min(jnp.where(val == m, idx, vp))


def _mgpu_argmaxes(load, n: int, vp: int, bv: int):
  """(max, argmax) of each of the n candidate rows `load(start, size)` returns, over [0, vp).

  Full tiles fold elementwise into per-lane running (max, argmax) pairs ([bv] loop carries;
  strict > on ascending tiles keeps each lane's lowest index), reduced across lanes once at the
  end; the remainder tile (vp % bv, a multiple of 128) is reduced on its own and folded in with
  strict >. Both give jnp.argmax's lowest index on ties (also for an all -inf row: index 0).
  """
  n_full, rem = divmod(vp, bv)
  best = None
  if n_full:
    iota = _mgpu_iota(0, bv)

    def body(t, carry):
      start = t * bv
      out = []
      for (val, idx), x in zip(carry, load(start, bv)):
        upd = x > val
        out.append((jnp.where(upd, x, val), jnp.where(upd, iota + start, idx)))
      return tuple(out)

    carry = lax.fori_loop(1, n_full, body, tuple((x, iota) for x in load(0, bv)))
    best = [_mgpu_lane_argmax(val, idx, vp) for val, idx in carry]
  if rem:
    iota = _mgpu_iota(n_full * bv, rem)
    tail = [_mgpu_lane_argmax(x, iota, vp) for x in load(n_full * bv, rem)]
    if best is None:
      best = tail
    else:
      best = [(jnp.where(tv > v, tv, v), jnp.where(tv > v, ti, i))
              for (v, i), (tv, ti) in zip(best, tail)]
  assert best is not None and len(best) == n
  return best


def _mgpu_row_argmax(ref, row, vp, bv):
  """argmax over the vocabulary of ref[row] (tiled)."""
  [(_, idx)] = _mgpu_argmaxes(lambda s, size: (_mgpu_tile(ref, row, s, size),), 1, vp, bv)
  return idx


def _mgpu_row_race(tlp_ref, g_ref, row, residual_fn, vp, bv):
  """Gumbel race at `row` (as triton's `_row_race`; residual_fn gets t=None: its tiles are
  not t-indexed)."""
  def load(start, size):
    lp = _mgpu_tile(tlp_ref, row, start, size)
    g = _mgpu_tile(g_ref, row, start, size)
    logr = residual_fn(_mgpu_iota(start, size), lp, None)
    return logr + g, lp + g

  (rv, ri), (_, pi) = _mgpu_argmaxes(load, 2, vp, bv)
  return _pick(rv, ri, pi)


def _mosaic_ops(vocab: int, block_v: int | None):
  vp, bv = _mgpu_vocab(vocab, block_v)
  return dict(row_argmax=functools.partial(_mgpu_row_argmax, vp=vp, bv=bv),
              row_race=functools.partial(_mgpu_row_race, vp=vp, bv=bv)), vp


def _mosaic_call(body, args, out_type, *, interpret: bool, name: str):
  """One Mosaic GPU program (one warpgroup) per batch row; every operand stays in GMEM (a
  [K+1, V] row block is MBs: far beyond shared memory) and the body sees the row's views
  (`ref.at[b]`; [B] outputs as [1] views), like the Triton kernels' squeezed blocks."""
  if not AVAILABLE:
    raise NotImplementedError(UNAVAILABLE)
  B = args[0].shape[0]

  def kernel(*refs):
    b = lax.axis_index("b")
    ins, outs = refs[:len(args)], refs[len(args):]
    body(*(r.at[b] for r in ins),
         *(o.at[b] if o.ndim > 1 else o.at[pl.ds(b, 1)] for o in outs))

  return plgpu.kernel(kernel, out_type=out_type, grid=(B,), grid_names=("b",),
                      interpret=plgpu.InterpretGPUParams() if interpret else None,
                      kernel_name=name)(*args)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("greedy", "interpret", "block_v"))
def verify_chain_mosaic(target_logp, draft_tokens, draft_logp, uniforms, noise, *,
                        greedy: bool, interpret: bool = False, block_v: int | None = None):
  """Chain verification on Mosaic GPU (same contract as `verify_chain_reference`), greedy and
  one-hot-draft sampling; draft_logp must be None when sampling (see `_MOSAIC_NO_Q`)."""
  B, K, V = _check_chain(target_logp, draft_tokens, draft_logp, uniforms, noise, greedy)
  if not greedy and draft_logp is not None:
    raise NotImplementedError(_MOSAIC_NO_Q)
  ops, vp = _mosaic_ops(V, block_v)
  tlp = _mgpu_pad(target_logp, vp, NEG_INF)
  d = draft_tokens.astype(jnp.int32)
  if greedy:
    body = functools.partial(_chain_greedy_kernel, K=K, row_argmax=ops["row_argmax"])
    args = (tlp, d)
  else:
    body = functools.partial(_chain_sample_kernel, K=K, has_q=False, row_race=ops["row_race"])
    args = (tlp, d, uniforms.astype(jnp.float32), _mgpu_pad(noise, vp, 0.0))
  n, nxt = _mosaic_call(body, args, [jax.ShapeDtypeStruct((B,), jnp.int32)] * 2,
                        interpret=interpret,
                        name="verify_chain_greedy" if greedy else "verify_chain_sample")
  return n, nxt


@functools.partial(jax.jit, static_argnames=("greedy", "max_depth", "interpret", "block_v"))
def verify_tree_mosaic(target_logp, tree_tokens, children, uniforms, noise, *, greedy: bool,
                       max_depth: int, interpret: bool = False, block_v: int | None = None):
  """Tree verification on Mosaic GPU (same contract as `verify_tree_reference`)."""
  B, T, V, C = _check_tree(target_logp, tree_tokens, children, uniforms, noise, greedy,
                           max_depth)
  D = max_depth
  ops, vp = _mosaic_ops(V, block_v)
  args = (_mgpu_pad(target_logp, vp, NEG_INF), tree_tokens.astype(jnp.int32),
          children.astype(jnp.int32))
  if not greedy:
    args += (uniforms.astype(jnp.float32), _mgpu_pad(noise, vp, 0.0))
  body = functools.partial(_tree_kernel, C=C, D=D, greedy=greedy, path_len=None, **ops)
  return tuple(_mosaic_call(
      body, args, [jax.ShapeDtypeStruct((B, D + 1), jnp.int32),
                   jax.ShapeDtypeStruct((B,), jnp.int32),
                   jax.ShapeDtypeStruct((B,), jnp.int32)],
      interpret=interpret, name="verify_tree_greedy" if greedy else "verify_tree_sample"))
