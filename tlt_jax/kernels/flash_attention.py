"""Flash attention over packed rows that visits only the blocks a segment reaches: the
learner's and the drafter trainer's packed attention on a GPU (models/attention.py).

A packed row lays several sequences end to end (segment ids 1, 2, ...; 0 = padding) and each
token attends to the earlier tokens of its own segment. A causal kernel over the whole row
visits every block on or below the diagonal, T^2 / 2 scores for a row of T tokens, where the
segments need sum(l_i^2) / 2: a 16k-token row of eight 2k responses computes 8x the scores it
uses. Here every program loops over a range of blocks read from the segment ids:
- a query block over key blocks [kv_lo, kv_hi): from the block of the earliest first token of
  its rows' segments to the causal bound (the forward and dQ);
- a key block over query blocks [q_lo, q_hi): from the causal bound to the block after the
  latest last token of its keys' segments (dK and dV).
The ranges are computed in XLA from the ids (`block_ranges`: per-id first and last positions,
ids clipped to [0, T], a clip that can only merge ids and so only widen ranges), so they never
rely on segments being contiguous; inside a range the mask (same id, causal) is applied per
score, so the result is exact for any ids. Padding is a segment like any other: its tokens
attend to the padding before them (finite outputs that nothing reads).

Grouped-query attention without repeating K and V: the G query heads of a kv head are one
matrix of R = T * G rows (row r is token r // G, head r % G), as in paged_attention.py, so a
program reads each key block once for its G heads, and the dK/dV program sums the G heads'
contributions itself.

Numerics as FlashAttention-2: scores and the online softmax in float32, in base 2 (the scale
folds in log2(e)); probabilities cast to the values' dtype for their matmul; the forward keeps
each row's log-sum-exp for the backward, which recomputes the probabilities (no [T, T] in
memory in either pass). dQ and dK/dV are two kernels; delta = rowsum(dO * O) is computed in
XLA. Tests: tests/test_attention.py, against a float64 numpy reference and XLA's masked
attention, values and gradients; the visited blocks against a brute-force count.

Backend: Pallas Triton on GPUs (power-of-two blocks: a head_dim that is not a power of two
>= 16 is zero-padded, rows are a multiple of 16 tokens); Pallas interpret mode elsewhere when
asked (tests on a CPU). JAX >= 0.11 deprecates the Triton backend (paged_attention.py uses it
too). This kernel replaced JAX's own Pallas `mha` (jax.experimental.pallas.ops.gpu.attention,
deprecated for tokamax), which visits every block below the diagonal.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

_MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf in the running max
_LOG2E = math.log2(math.e)
# block caps (rows of R for queries, tokens for keys): FlashAttention-2's Triton shapes for
# head_dim 128 (forward 128 x 64; the backward's five [block, H] tiles per step fit at 64 x 64)
FWD_BLOCKS = (128, 64)
BWD_BLOCKS = (64, 64)


def pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n (1 if n is odd)."""
  b = cap
  while b > 1 and n % b:
    b //= 2
  return b


def geometry(t: int, g: int, blocks: tuple[int, int]) -> tuple[int, int]:
  """(query block in rows of R = t * g, key block in tokens) for rows of t tokens."""
  return pow2_divisor(t * g, blocks[0]), pow2_divisor(t, blocks[1])


def block_ranges(segment_ids: jax.Array, g: int, bq: int, bk: int):
  """segment_ids [B, T] -> (kv_lo, kv_hi [B, R / bq], q_lo, q_hi [B, T / bk]) int32, in
  blocks: the key blocks each query block visits and the query blocks each key block visits
  (module docstring). Every block holding a score that counts is inside its range."""
  b, t = segment_ids.shape
  r = t * g
  ids = jnp.clip(segment_ids.astype(jnp.int32), 0, t)
  pos = jnp.arange(t, dtype=jnp.int32)
  first = jax.vmap(lambda s: jax.ops.segment_min(pos, s, num_segments=t + 1))(ids)
  last = jax.vmap(lambda s: jax.ops.segment_max(pos, s, num_segments=t + 1))(ids)
  tok_first = jnp.take_along_axis(first, ids, axis=1)  # [B, T]: where each token's id begins
  tok_last = jnp.take_along_axis(last, ids, axis=1)
  row_tok = np.arange(r) // g  # static: the token of each query row
  kv_lo = tok_first[:, row_tok].reshape(b, r // bq, bq).min(axis=-1) // bk
  kv_hi = jnp.broadcast_to(jnp.asarray(row_tok.reshape(r // bq, bq)[:, -1] // bk + 1,
                                       jnp.int32), kv_lo.shape)
  k_last = tok_last.reshape(b, t // bk, bk).max(axis=-1)
  q_lo = jnp.broadcast_to(jnp.asarray(np.arange(t // bk) * bk * g // bq, jnp.int32),
                          k_last.shape)
  q_hi = ((k_last + 1) * g + bq - 1) // bq
  return kv_lo, kv_hi, q_lo, q_hi


def visited_blocks(segment_ids: jax.Array, g: int = 1, blocks: tuple[int, int] = FWD_BLOCKS
                   ) -> tuple[int, int]:
  """(blocks the forward visits, blocks a causal kernel over whole rows visits) for these
  packed rows: what skipping between segments saves (gpu_check's learner stage prints it)."""
  b, t = segment_ids.shape
  bq, bk = geometry(t, g, blocks)
  kv_lo, kv_hi, _, _ = block_ranges(jnp.asarray(segment_ids), g, bq, bk)
  row_tok_last = ((np.arange(t * g // bq) + 1) * bq - 1) // g  # each query block's last token
  causal = b * int(np.sum(row_tok_last // bk + 1))
  return int(jnp.sum(kv_hi - kv_lo)), causal


def _seen(pos_q, seg_q, pos_k, seg_k):
  """[bq, bk] bool: query rows (token pos_q, id seg_q) that attend keys (pos_k, seg_k)."""
  return (seg_q[:, None] == seg_k[None, :]) & (pos_q[:, None] >= pos_k[None, :])


def _fwd_kernel(lo_ref, hi_ref, pos_ref, segq_ref, segk_ref, q_ref, k_ref, v_ref, o_ref,
                lse_ref, *, bk: int, scale: float, precision):
  """One (row, kv head, query block): q [bq, H]; k, v [T, H]; out o [bq, H], lse [bq] (base
  2). Loops over key blocks [lo, hi)."""
  q = q_ref[...]
  pos_q, seg_q = pos_ref[...], segq_ref[...]
  bq, h = q.shape

  def body(j, carry):
    o, m, l = carry
    ks = pl.ds(j * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * scale
    pos_k = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    s = jnp.where(_seen(pos_q, seg_q, pos_k, segk_ref[ks]), s, _MASK)
    m_new = jnp.maximum(m, s.max(axis=-1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
    return corr[:, None] * o + pv, m_new, corr * l + p.sum(axis=-1)

  init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), _MASK, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  # every row sees its own token (the diagonal is in range), so l > 0 and masked scores that
  # led a row's running max are rescaled to 0 by the first block it attends to
  o, m, l = lax.fori_loop(lo_ref[0], hi_ref[0], body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _probs(q, k, lse, seen, scale, precision):
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * scale
  return jnp.where(seen, jnp.exp2(s - lse[:, None]), 0.0)


def _dkv_kernel(lo_ref, hi_ref, pos_ref, segq_ref, segk_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, bq: int, scale: float, sm_scale: float,
                precision):
  """One (row, kv head, key block): k, v [bk, H]; q, dO [R, H], lse, delta [R]; loops over
  query blocks [lo, hi), the G heads' rows together."""
  k, v = k_ref[...], v_ref[...]
  seg_k = segk_ref[...]
  bk, h = k.shape
  pos_k = pl.program_id(2) * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)

  def body(i, carry):
    dk, dv = carry
    rs = pl.ds(i * bq, bq)
    q, do = q_ref[rs, :], do_ref[rs, :]
    p = _probs(q, k, lse_ref[rs], _seen(pos_ref[rs], segq_ref[rs], pos_k, seg_k), scale,
               precision)
    dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=jnp.float32,
                      precision=precision)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32, precision=precision)
    ds = p * (dp - delta_ref[rs][:, None])
    dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32,
                      precision=precision)
    return dk, dv

  init = (jnp.zeros((bk, h), jnp.float32), jnp.zeros((bk, h), jnp.float32))
  dk, dv = lax.fori_loop(lo_ref[0], hi_ref[0], body, init)
  dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(lo_ref, hi_ref, pos_ref, segq_ref, segk_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, bk: int, scale: float, sm_scale: float,
               precision):
  """One (row, kv head, query block): q, dO [bq, H], lse, delta [bq]; k, v [T, H]; loops over
  key blocks [lo, hi)."""
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  pos_q, seg_q = pos_ref[...], segq_ref[...]
  bq, h = q.shape

  def body(j, dq):
    ks = pl.ds(j * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    pos_k = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    p = _probs(q, k, lse, _seen(pos_q, seg_q, pos_k, segk_ref[ks]), scale, precision)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32, precision=precision)
    ds = p * (dp - delta[:, None])
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32,
                        precision=precision)

  dq = lax.fori_loop(lo_ref[0], hi_ref[0], body, jnp.zeros((bq, h), jnp.float32))
  dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, name, interpret, warps):
  from jax.experimental.pallas import triton as pltriton
  with warnings.catch_warnings():  # the Triton backend's deprecation (module docstring)
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=2),
        interpret=interpret, name=name)


def _specs(g_rows: int, t: int, h: int, qb: int | None, kb: int | None):
  """BlockSpecs over the grid (row, kv head, block) of: the block ranges, the rows' tokens,
  the rows' ids, the keys' ids, q-like [B, K, R, H] and k-like [B, K, T, H] arrays, and
  row statistics [B, K, R]; qb / kb: the query / key block, None for the whole row."""
  qr, kr = qb or g_rows, kb or t
  qi = (lambda b, n, c: c) if qb else (lambda b, n, c: 0)
  ki = (lambda b, n, c: c) if kb else (lambda b, n, c: 0)
  return dict(
      bound=pl.BlockSpec((None, 1), lambda b, n, c: (b, c)),
      pos=pl.BlockSpec((qr,), lambda b, n, c: (qi(b, n, c),)),
      segq=pl.BlockSpec((None, qr), lambda b, n, c: (b, qi(b, n, c))),
      segk=pl.BlockSpec((None, kr), lambda b, n, c: (b, ki(b, n, c))),
      q=pl.BlockSpec((None, None, qr, h), lambda b, n, c: (b, n, qi(b, n, c), 0)),
      k=pl.BlockSpec((None, None, kr, h), lambda b, n, c: (b, n, ki(b, n, c), 0)),
      stat=pl.BlockSpec((None, None, qr), lambda b, n, c: (b, n, qi(b, n, c))))


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _forward(q, k, v, seg, g, sm_scale, interpret):
  """q [B, K, R, H], k/v [B, K, T, H], seg [B, T] -> (o [B, K, R, H], lse [B, K, R])."""
  b, kh, r, h = q.shape
  t = k.shape[2]
  bq, bk = geometry(t, g, FWD_BLOCKS)
  kv_lo, kv_hi, _, _ = block_ranges(seg, g, bq, bk)
  sp = _specs(r, t, h, bq, None)
  kernel = functools.partial(_fwd_kernel, bk=bk, scale=_LOG2E * sm_scale,
                             precision=_precision(q.dtype))
  return _call(kernel, (b, kh, r // bq),
               [sp["bound"], sp["bound"], sp["pos"], sp["segq"], sp["segk"], sp["q"], sp["k"],
                sp["k"]],
               [sp["q"], sp["stat"]],
               [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, kh, r), jnp.float32)],
               "packed_flash_attention_fwd", interpret, 8 if h >= 128 and bq >= 128 else 4,
               )(kv_lo, kv_hi, jnp.arange(r, dtype=jnp.int32) // g, jnp.repeat(seg, g, axis=1),
                 seg, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, g, sm_scale, interpret):
  return _forward(q, k, v, seg, g, sm_scale, interpret)[0]


def _flash_fwd(q, k, v, seg, g, sm_scale, interpret):
  o, lse = _forward(q, k, v, seg, g, sm_scale, interpret)
  return o, (q, k, v, seg, o, lse)


def _flash_bwd(g, sm_scale, interpret, res, do):
  q, k, v, seg, o, lse = res
  b, kh, r, h = q.shape
  t = k.shape[2]
  bq, bk = geometry(t, g, BWD_BLOCKS)
  kv_lo, kv_hi, q_lo, q_hi = block_ranges(seg, g, bq, bk)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  do = do.astype(q.dtype)
  common = dict(scale=_LOG2E * sm_scale, sm_scale=sm_scale,
                precision=_precision(q.dtype))
  pos, segq = jnp.arange(r, dtype=jnp.int32) // g, jnp.repeat(seg, g, axis=1)
  warps = 4 if bq * bk < 128 * 128 else 8
  sp = _specs(r, t, h, None, bk)  # a program per key block, every query row in reach
  dk, dv = _call(functools.partial(_dkv_kernel, bq=bq, **common), (b, kh, t // bk),
                 [sp["bound"], sp["bound"], sp["pos"], sp["segq"], sp["segk"], sp["q"],
                  sp["k"], sp["k"], sp["q"], sp["stat"], sp["stat"]],
                 [sp["k"], sp["k"]],
                 [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                 "packed_flash_attention_dkv", interpret, warps,
                 )(q_lo, q_hi, pos, segq, seg, q, k, v, do, lse, delta)
  sp = _specs(r, t, h, bq, None)  # a program per query block, every key in reach
  dq = _call(functools.partial(_dq_kernel, bk=bk, **common), (b, kh, r // bq),
             [sp["bound"], sp["bound"], sp["pos"], sp["segq"], sp["segk"], sp["q"], sp["k"],
              sp["k"], sp["q"], sp["stat"], sp["stat"]],
             sp["q"], jax.ShapeDtypeStruct(q.shape, q.dtype),
             "packed_flash_attention_dq", interpret, warps,
             )(kv_lo, kv_hi, pos, segq, seg, q, k, v, do, lse, delta)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def packed_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                           *, interpret: bool = False) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H], segment_ids [B, T] (0 = padding) -> [B, T, N, H]: each
  token attends to the earlier tokens of its own segment (padding's outputs unspecified,
  finite). T a multiple of 16; differentiable in q, k, v."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  if t % 16:
    raise ValueError(f"packed flash attention needs rows of a multiple of 16 tokens, got {t}")
  hp = max(16, 1 << (h - 1).bit_length())
  if hp != h:  # Triton's power-of-two tiles: zero features change no score and no output
    q, k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, hp - h),)) for x in (q, k, v))
  qr = q.reshape(b, t, kh, g, hp).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, hp)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  out = _flash(qr, kt, vt, segment_ids.astype(jnp.int32), g, 1.0 / math.sqrt(h), interpret)
  out = out.reshape(b, kh, t, g, hp).transpose(0, 2, 1, 3, 4).reshape(b, t, n, hp)
  return out[..., :h]
