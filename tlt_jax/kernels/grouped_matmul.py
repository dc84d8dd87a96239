"""A grouped matmul for mixture-of-experts layers: rows grouped by expert, each group times its
own expert's weights, forward and backward, in Pallas (Triton on GPUs; interpret mode
elsewhere, for tests). `jax.lax.ragged_dot` computes the same, but XLA lowers it densely on a
CPU and, as of JAX 0.12, to zero-padded operands on a GPU unless its cuDNN fusion applies (E
times the FLOPs, and an [E, rows, K] operand: tens of GB a layer at a learner's micro-batch).

The rows are laid out first (`layout`, plain XLA): the (token, expert) pairs sorted by expert
and each expert's group padded to whole tiles of `bm` rows, so every tile belongs to one
expert (`Layout.tile_group`) and the padding is at most `bm - 1` rows an expert (`tile_rows`:
16-row tiles for a rollout step's few pairs, 64 for a learner's many). Then:
- `gmm(x [T bm, K], w [G, K, N])`: a program per (tile, column block) multiplies its tile by
  its expert's weights, the contraction in `bk` blocks, float32 accumulation: each program
  reads its expert's [K, bn] block in place, every row computes only its own expert's
  product, and a tile past the used ones reads nothing (its trip count is 0): a decode step
  of one token reads its k experts, a step's tokens the experts they route to;
- its backward: the rows' gradient is `gmm` of the output's gradient by the transposed
  weights; each expert's weight gradient `tgmm` (a program per (expert, row block, column
  block) sums its tiles' x^T dy over a loop whose trip count is the expert's tile count, read
  on the device: an expert no row chose costs nothing).

Off a GPU everything runs in Pallas interpret mode (slow; tests). The models use it through
models/moe.py after a start-up check (`kernel_check`): a JAX or Triton release that does not
compile it, or miscompiles it, leaves `ragged_dot` in its place with the reason. Triton
blocks are powers of two: K and N must be multiples of 16 (`kernel_limits`).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

BM = 64  # rows a tile: an expert's group is padded to whole tiles


class Layout(NamedTuple):
  """Where the (token, expert) pairs go in the tiled rows (`layout`)."""
  dest: jax.Array  # [M] int32: each pair's row in the tiled layout (a pair not live: rows)
  tile_group: jax.Array  # [T] int32: each tile's expert (tiles past the used ones: -1)
  first_tile: jax.Array  # [G] int32: each expert's first tile
  tiles: jax.Array  # [G] int32: each expert's tile count
  rows: int  # T x bm, static


def tile_rows(pairs: int, groups: int) -> int:
  """The tile for `pairs` rows over `groups` experts: 64 rows where an expert gets that many
  on average (a learner's micro-batch), else 16 (Triton's smallest dot: a rollout step's
  pairs, mostly one or a few an expert)."""
  return BM if pairs >= BM * groups else 16


def num_tiles(pairs: int, groups: int, bm: int = BM) -> int:
  """The tiles `pairs` rows of `groups` experts can need at most (static)."""
  return -(-pairs // bm) + groups


def layout(experts: jax.Array, groups: int, bm: int = BM, live: jax.Array | None = None
           ) -> Layout:
  """experts [M] int32 (each pair's expert, in pair order) -> the tiled layout: the pairs in
  expert order (stable), each expert's group from a tile boundary. live [M] bool (None: all):
  a pair not live (an empty batch row's, a padding token's) is in no tile (its `dest` is
  `rows`, past the layout: writes there drop, reads fill), so an expert only such pairs chose
  gets no tile and is not read."""
  m = experts.shape[0]
  t = num_tiles(m, groups, bm)
  key = experts if live is None else jnp.where(live, experts, groups)  # (dead pairs: last)
  sizes = jnp.bincount(key, length=groups + 1)[:groups].astype(jnp.int32)
  tiles = -(-sizes // bm)
  ends = jnp.cumsum(tiles)
  first_tile = ends - tiles
  group_start = jnp.cumsum(sizes) - sizes  # each expert's first pair in sorted order
  order = jnp.argsort(key, stable=True)
  ranked = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
  e = jnp.minimum(key, groups - 1)
  dest = jnp.where(key < groups, first_tile[e] * bm + ranked - group_start[e], t * bm)
  tile_group = jnp.searchsorted(ends, jnp.arange(t, dtype=jnp.int32), side="right")
  tile_group = jnp.where(tile_group < groups, tile_group, -1)
  return Layout(dest.astype(jnp.int32), tile_group.astype(jnp.int32),
                first_tile.astype(jnp.int32), tiles.astype(jnp.int32), t * bm)


def _block(dim: int, most: int) -> int:
  """The largest power of two <= most dividing dim (at least 1)."""
  b = 1
  while b * 2 <= most and dim % (b * 2) == 0:
    b *= 2
  return b


def kernel_limits(k: int, n: int) -> str | None:
  """Why the kernel cannot run a [*, K] x [G, K, N] product on a GPU (None: it can): Triton's
  power-of-two blocks of at least 16."""
  if k % 16 or n % 16:
    return f"Triton blocks need K and N multiples of 16, not {k} and {n}"
  return None


def _gmm_kernel(tg_ref, x_ref, w_ref, o_ref, *, bk: int, steps: int, precision):
  """One (tile, column block): x_ref [bm, K], w_ref [G, K, bn], o_ref [bm, bn]; a tile past
  the used ones (expert -1) runs no step and writes zeros."""
  g = tg_ref[0]
  bm, bn = o_ref.shape
  e = jnp.maximum(g, 0)

  def body(i, acc):
    xs = x_ref[:, pl.ds(i * bk, bk)]
    ws = w_ref[e, pl.ds(i * bk, bk), :]
    return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32, precision=precision)

  acc = lax.fori_loop(0, jnp.where(g >= 0, steps, 0), body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _tgmm_kernel(first_ref, tiles_ref, x_ref, dy_ref, o_ref, *, bm: int, precision):
  """One (expert, row block of K, column block of N): x_ref [T bm, bk], dy_ref [T bm, bn],
  o_ref [bk, bn] = sum over the expert's tiles of x^T dy."""
  first, n = first_ref[0], tiles_ref[0]
  bk, bn = o_ref.shape

  def body(i, acc):
    rows = pl.ds((first + i) * bm, bm)
    return acc + jnp.dot(x_ref[rows, :].T, dy_ref[rows, :], preferred_element_type=jnp.float32,
                         precision=precision)

  acc = lax.fori_loop(0, n, body, jnp.zeros((bk, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _interpret(interpret: bool | None) -> bool:
  return jax.default_backend() != "gpu" if interpret is None else interpret


def _params():
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _gmm(x, w, tile_group, bm: int, interpret: bool):
  rows, k = x.shape
  g, _, n = w.shape
  bk, bn = _block(k, 64), _block(n, 128)
  kernel = functools.partial(_gmm_kernel, bk=bk, steps=k // bk, precision=_precision(x.dtype))
  with warnings.catch_warnings():  # the Triton backend's deprecation (paged_attention.py)
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        kernel, grid=(rows // bm, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda t, j: (t,)),
                  pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
                  pl.BlockSpec((g, k, bn), lambda t, j: (0, 0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=_params(), interpret=interpret, name="grouped_matmul",
    )(tile_group, x, w)


def _tgmm(x, dy, first_tile, tiles, bm: int, interpret: bool):
  rows, k = x.shape
  n = dy.shape[1]
  g = first_tile.shape[0]
  bk, bn = _block(k, 64), _block(n, 64)
  kernel = functools.partial(_tgmm_kernel, bm=bm, precision=_precision(x.dtype))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        kernel, grid=(g, k // bk, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda e, a, b: (e,)),
                  pl.BlockSpec((1,), lambda e, a, b: (e,)),
                  pl.BlockSpec((rows, bk), lambda e, a, b: (0, a)),
                  pl.BlockSpec((rows, bn), lambda e, a, b: (0, b))],
        out_specs=pl.BlockSpec((None, bk, bn), lambda e, a, b: (e, a, b)),
        out_shape=jax.ShapeDtypeStruct((g, k, n), jnp.float32),
        compiler_params=_params(), interpret=interpret, name="grouped_matmul_wgrad",
    )(first_tile, tiles, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def gmm(x: jax.Array, w: jax.Array, tile_group: jax.Array, first_tile: jax.Array,
        tiles: jax.Array, bm: int = BM, interpret: bool | None = None) -> jax.Array:
  """x [T bm, K] (rows in `layout`'s tiles), w [G, K, N] -> [T bm, N]: each tile times its
  expert's weights (`tile_group`); differentiable in x and w (`first_tile`, `tiles`: the
  weight gradient's loop)."""
  return _gmm(x, w, tile_group, bm, _interpret(interpret))


def _gmm_fwd(x, w, tile_group, first_tile, tiles, bm, interpret):
  return _gmm(x, w, tile_group, bm, _interpret(interpret)), (x, w, tile_group, first_tile, tiles)


def _gmm_bwd(bm, interpret, res, dy):
  x, w, tile_group, first_tile, tiles = res
  it = _interpret(interpret)
  dx = _gmm(dy, jnp.swapaxes(w, 1, 2), tile_group, bm, it)
  dw = _tgmm(x, dy, first_tile, tiles, bm, it).astype(w.dtype)
  return dx, dw, None, None, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.cache
def kernel_check(k: int, n: int, groups: int, dtype: str) -> str | None:
  """None if the kernel's forward and backward compile on this backend and agree with
  `ragged_dot` (within 2% of the scale: bf16 rounding is ~0.5%), else why not (one line).
  Rows routed unevenly over the experts, one expert chosen by none. Numpy inputs and the
  executables' own calls: nothing is staged into a trace that asked."""
  from tlt_jax.kernels import error_line
  rng = np.random.default_rng(0)
  m = 3 * BM + 5
  experts = rng.integers(0, max(groups - 1, 1), m).astype(np.int32)
  dt = jnp.dtype(dtype)
  x = rng.normal(size=(m, k)).astype(dt)
  w = (rng.normal(size=(groups, k, n)) / np.sqrt(k)).astype(dt)
  dy = rng.normal(size=(m, n)).astype(dt)

  def via_kernel(x, w, e, dy, bm):
    lay = layout(e, groups, bm)

    def f(x, w):
      xs = jnp.zeros((lay.rows, k), x.dtype).at[lay.dest].set(x)
      return gmm(xs, w, lay.tile_group, lay.first_tile, lay.tiles, bm)[lay.dest]
    y, pull = jax.vjp(f, x, w)
    return (y,) + pull(dy)

  def via_xla(x, w, e, dy):
    order = jnp.argsort(e, stable=True)
    sizes = jnp.bincount(e, length=groups).astype(jnp.int32)

    def f(x, w):
      y = lax.ragged_dot(x[order].astype(jnp.float32), w.astype(jnp.float32), sizes)
      return jnp.zeros_like(y).at[order].set(y)
    y, pull = jax.vjp(f, x, w)
    return (y,) + pull(dy.astype(jnp.float32))
  args = (x, w, experts, dy)
  want = jax.jit(via_xla).lower(*args).compile()(*args)
  for bm in (16, BM):  # both tiles a run uses (`tile_rows`)
    try:
      run = jax.jit(functools.partial(via_kernel, bm=bm)).lower(*args).compile()
      got = run(*args)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here
      return f"does not compile here ({error_line(e)})"
    err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                    / (np.max(np.abs(np.asarray(b, np.float32))) + 1e-6))
              for a, b in zip(got, want))
    if not err < 0.02:  # (NaN fails too)
      return (f"disagrees with ragged_dot here at {bm}-row tiles (max relative difference "
              f"{err:.2g})")
  return None
