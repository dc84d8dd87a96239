"""Verification kernels on the Pallas Triton backend: the pre-Hopper fallback (see
`kernel_backend`); nothing outside this module imports `jax.experimental.pallas.triton`.

Tiling (tile: `bodies._DEFAULT_BLOCK_V`): each row's operand is one full block (BlockSpec with
the batch dim squeezed), so only *power-of-two* loads/stores are ever issued: scalar loads and
[block_v] tiles in a `fori_loop` over ceil(V / block_v) tiles. The last tile is a masked load
(`other` = -inf for log-probs, 0 for noise) so V needs no padding copy. No scratch memory
(unsupported by the Triton backend): all state lives in loop carries; the tree path is a [Dp]
vector carry. Lowered with `pallas.triton.CompilerParams` explicitly (jax's default GPU backend
is Mosaic GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tlt_jax.kernels.verify.bodies import (_DEFAULT_BLOCK_V, _chain_greedy_kernel,
                                           _chain_sample_kernel, _tree_kernel)
from tlt_jax.kernels.verify.reference import NEG_INF, _check_chain, _check_tree, _pick

_NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Tile loops (the bodies' row_argmax / row_race) and launch settings
# ----------------------------------------------------------------------------------------------


def _block_v(vocab: int, block_v: int | None) -> int:
  bv = _DEFAULT_BLOCK_V if block_v is None else int(block_v)
  if bv <= 0 or bv & (bv - 1):
    raise ValueError(f"block_v={bv} must be a positive power of two")
  return min(bv, pl.next_power_of_2(vocab))


def _load_tile(ref, row, t, bv: int, vocab: int, other: float):
  """Tile t of row `row` of a [rows, V] block ref -> f32 [bv]; lanes >= V read `other`."""
  start = pl.multiple_of(t * bv, bv)
  view = ref.at[row, pl.ds(start, bv)]
  if vocab % bv == 0:
    x = view[...]
  else:
    mask = start + lax.broadcasted_iota(jnp.int32, (bv,), 0) < vocab
    x = pltriton.load(view, mask=mask, other=other)
  return x.astype(jnp.float32)


def _argmax_update(best_val, best_idx, x, base):
  """Fold a tile into a running (max, argmax); strict > keeps the lowest index on ties."""
  m = jnp.max(x)
  i = jnp.argmax(x).astype(jnp.int32) + base
  upd = m > best_val
  return jnp.where(upd, m, best_val), jnp.where(upd, i, best_idx)


def _row_argmax(ref, row, bv, vocab):
  """argmax over V of ref[row] (tiled)."""
  n_tiles = pl.cdiv(vocab, bv)

  def body(t, carry):
    x = _load_tile(ref, row, t, bv, vocab, NEG_INF)
    return _argmax_update(*carry, x, t * bv)

  _, idx = lax.fori_loop(0, n_tiles, body, (jnp.float32(NEG_INF), jnp.int32(0)))
  return idx


def _row_race(tlp_ref, g_ref, row, residual_fn, bv, vocab):
  """Gumbel race at `row`: residual_fn(offs, lp, t) -> log r for the tile; returns the token."""
  n_tiles = pl.cdiv(vocab, bv)

  def body(t, carry):
    rv, ri, pv, pi = carry
    lp = _load_tile(tlp_ref, row, t, bv, vocab, NEG_INF)
    g = _load_tile(g_ref, row, t, bv, vocab, 0.0)
    offs = t * bv + lax.broadcasted_iota(jnp.int32, (bv,), 0)
    logr = residual_fn(offs, lp, t)
    rv, ri = _argmax_update(rv, ri, logr + g, t * bv)
    pv, pi = _argmax_update(pv, pi, lp + g, t * bv)
    return rv, ri, pv, pi

  init = (jnp.float32(NEG_INF), jnp.int32(0), jnp.float32(NEG_INF), jnp.int32(0))
  rv, ri, _, pi = lax.fori_loop(0, n_tiles, body, init)
  return _pick(rv, ri, pi)


def _compiler_params():
  return pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1)


def _check_offsets(interpret: bool, *arrays):
  """The Triton lowering computes element offsets in int32: keep each operand < 2**31 elements
  (e.g. noise [B, K+1, V] with V=152k allows B*(K+1) < 14k); split the batch otherwise."""
  if interpret:
    return
  for a in arrays:
    if a is not None and a.size >= 2**31:
      raise ValueError(f"operand of shape {a.shape} has >= 2**31 elements; the Triton kernel "
                       "uses int32 offsets: verify the batch in chunks")


def _triton_ops(vocab: int, block_v: int | None):
  bv = _block_v(vocab, block_v)
  return dict(row_argmax=functools.partial(_row_argmax, bv=bv, vocab=vocab),
              row_race=functools.partial(_row_race, bv=bv, vocab=vocab)), bv


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("greedy", "interpret", "block_v"))
def verify_chain_triton(target_logp, draft_tokens, draft_logp, uniforms, noise, *,
                        greedy: bool, interpret: bool = False, block_v: int | None = None):
  """Chain verification on the Pallas Triton backend (same contract as
  `verify_chain_reference`; pre-Hopper fallback, see `kernel_backend`)."""
  B, K, V = _check_chain(target_logp, draft_tokens, draft_logp, uniforms, noise, greedy)
  _check_offsets(interpret, target_logp, draft_logp, noise)
  ops, bv = _triton_ops(V, block_v)
  row3 = lambda s: pl.BlockSpec((None, s, V), lambda b: (b, 0, 0))
  row2 = lambda s: pl.BlockSpec((None, s), lambda b: (b, 0))
  scalar_out = pl.BlockSpec((1,), lambda b: (b,))
  d = draft_tokens.astype(jnp.int32)
  if greedy:
    kernel = functools.partial(_chain_greedy_kernel, K=K, row_argmax=ops["row_argmax"])
    args, in_specs = (target_logp, d), [row3(K + 1), row2(K)]
  else:
    has_q = draft_logp is not None
    kernel = functools.partial(
        _chain_sample_kernel, K=K, has_q=has_q, row_race=ops["row_race"],
        q_tile=lambda ref, row, t: _load_tile(ref, row, t, bv, V, NEG_INF))
    args = (target_logp, d) + ((draft_logp,) if has_q else ()) + (
        uniforms.astype(jnp.float32), noise)
    in_specs = [row3(K + 1), row2(K)] + ([row3(K)] if has_q else []) + [row2(K), row3(K + 1)]
  n, nxt = pl.pallas_call(
      kernel,
      grid=(B,),
      in_specs=in_specs,
      out_specs=[scalar_out, scalar_out],
      out_shape=[jax.ShapeDtypeStruct((B,), jnp.int32)] * 2,
      interpret=interpret,
      compiler_params=_compiler_params(),
      name="verify_chain_greedy" if greedy else "verify_chain_sample",
  )(*args)
  return n, nxt


@functools.partial(jax.jit, static_argnames=("greedy", "max_depth", "interpret", "block_v"))
def verify_tree_triton(target_logp, tree_tokens, children, uniforms, noise, *, greedy: bool,
                       max_depth: int, interpret: bool = False, block_v: int | None = None):
  """Tree verification on the Pallas Triton backend (same contract as
  `verify_tree_reference`; pre-Hopper fallback, see `kernel_backend`)."""
  B, T, V, C = _check_tree(target_logp, tree_tokens, children, uniforms, noise, greedy,
                           max_depth)
  _check_offsets(interpret, target_logp, noise)
  D = max_depth
  Dp = pl.next_power_of_2(D + 1)
  ops, _ = _triton_ops(V, block_v)
  row3 = pl.BlockSpec((None, T, V), lambda b: (b, 0, 0))
  row2 = pl.BlockSpec((None, T), lambda b: (b, 0))
  kids = pl.BlockSpec((None, T, C), lambda b: (b, 0, 0))
  scalar_out = pl.BlockSpec((1,), lambda b: (b,))
  args = (target_logp, tree_tokens.astype(jnp.int32), children.astype(jnp.int32))
  in_specs = [row3, row2, kids]
  if not greedy:
    args += (uniforms.astype(jnp.float32), noise)
    in_specs += [row2, row3]
  kernel = functools.partial(_tree_kernel, C=C, D=D, greedy=greedy, path_len=Dp, **ops)
  path, n, nxt = pl.pallas_call(
      kernel,
      grid=(B,),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, Dp), lambda b: (b, 0)), scalar_out, scalar_out],
      out_shape=[jax.ShapeDtypeStruct((B, Dp), jnp.int32),
                 jax.ShapeDtypeStruct((B,), jnp.int32),
                 jax.ShapeDtypeStruct((B,), jnp.int32)],
      interpret=interpret,
      compiler_params=_compiler_params(),
      name="verify_tree_greedy" if greedy else "verify_tree_sample",
  )(*args)
  return path[:, :D + 1], n, nxt
