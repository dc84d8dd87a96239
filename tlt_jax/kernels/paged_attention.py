"""Attention over a paged KV cache that reads only each row's live pages: one executable for
every length a row reaches (the engine's attention windows, rollout/windows.py, compile one
executable per window instead, and each reads its whole window).

A forward over T new tokens of row b attends to (a) the row's committed slots [0, lengths[b])
and (b) the chunk's own T tokens as its chunk mask allows (causal, or a draft tree's mask).
(a) is the Pallas kernel here: a program per (row, kv head, query block, split of the row's
pages) walks the row's page table in blocks of pages, gathers each block's keys and values
from the page pools (a table's ids, `[P, page, K, H]` pools as the cache holds them) and keeps
an online softmax (running max, sum and weighted values, float32); the loop's trip count is
the row's live pages (`ceil(lengths / page)`, read on the device), so a step reads what the
rows hold, whatever the cache's capacity. (b) is a [T*G, T] attention in XLA over the
chunk's keys and values as computed (the same values the cache holds: written in the pool's
dtype and read back in the compute dtype). The two are merged by their softmax statistics.

The committed prefix is split across programs (`splits`) so that a few long rows still fill
the device (flash decoding); a split past a row's live pages does nothing. Off a GPU (a)
runs as the same loop in XLA (`prefix_attention_xla`: one loop over the batch, to the
longest row's live pages), which XLA:CPU runs without a host round trip; the kernel itself
runs there in Pallas interpret mode only when asked (tests).

Numerics as `models.attention.attend` (the XLA path it replaces): scores and softmax in
float32, probabilities cast to the values' dtype before their matmul; the merge divides by
the softmax sum at the end (attend normalises before that cast), so results agree to the
dtype's rounding, not bit for bit (tests/test_paged_attention.py: against a float64 numpy
reference and the windowed XLA path).

Backend: Pallas Triton (`jax.experimental.pallas.triton`) on GPUs (Triton needs power-of-two
blocks: head_dim a power of two >= 16, page_size a power of two; the XLA form has neither
limit); in Pallas interpret mode elsewhere when asked (tests on a CPU). A call sees one
device's kv heads: on a tensor-parallel replica the model runs it per device
(`models.attention.paged_cache_attention`). JAX >=
0.11 deprecates the Triton backend; the learner's packed attention (flash_attention.py) uses
it too.
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

from tlt_jax.kernels import error_line

_MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf in the running max
_KEYS_PER_BLOCK = 128  # keys a loop iteration reads per program (whole pages)
_PROGRAMS = 512  # splits are added until rows x kv heads x query blocks x splits reach this
_MAX_QUERY_BLOCK = 64


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def geometry(batch: int, kv_heads: int, rows: int, table_pages: int, page: int,
             splits: int | None = None) -> tuple[int, int, int, int]:
  """(query block, query blocks, pages per loop iteration, splits) for `rows` query rows
  (T x heads per kv head) per (row, kv head) and a page table of `table_pages` columns."""
  bq = min(_MAX_QUERY_BLOCK, max(16, _pow2(rows)))
  nq = -(-rows // bq)
  ppb = max(1, _KEYS_PER_BLOCK // page)
  blocks = -(-table_pages // ppb)
  if splits is None:
    splits = 1
    while splits * 2 <= blocks and batch * kv_heads * nq * splits * 2 <= _PROGRAMS:
      splits *= 2
  return bq, nq, ppb, max(1, min(int(splits), blocks))


def _softmax_step(m, l, s, seen):
  """One block of an online softmax: the running max `m` and sum `l` of each query row, the
  block's scores `s` [..., keys] of which `seen` count -> (the block's weights, the new max,
  the factor earlier sums and values are rescaled by, the new sum)."""
  s = jnp.where(seen, s, _MASK)
  m_new = jnp.maximum(m, s.max(axis=-1))
  corr = jnp.exp(m - m_new)
  p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
  return p, m_new, corr, corr * l + p.sum(axis=-1)


def _kernel(len_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, page: int,
            ppb: int, pps: int, scale: float, precision):
  """One (row, kv head, query block, split): the online softmax over the split's live pages.
  q_ref [bq, H]; k_ref, v_ref [P, page, H] (this kv head of every page); table_ref [pps]
  (the split's page ids, clipped); outputs o [bq, H] (unnormalised), m, l [bq]."""
  split = pl.program_id(3)
  length = len_ref[0]
  first = split * pps  # the split's first page, in the row's table
  last = jnp.minimum(pl.cdiv(length, page), first + pps)
  trips = pl.cdiv(jnp.maximum(last - first, 0), ppb)
  q = q_ref[...]
  bq, h = q.shape
  bk = ppb * page

  def body(i, carry):
    o, m, l = carry
    ids = table_ref[pl.ds(i * ppb, ppb)]
    k = k_ref[ids].reshape(bk, h).astype(q.dtype)
    v = v_ref[ids].reshape(bk, h).astype(q.dtype)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * scale
    slot = (first + i * ppb) * page + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    p, m_new, corr, l = _softmax_step(m, l, s, slot < length)
    # slots past the length in the last page hold stale values: zeroed, not just unweighted
    v = jnp.where(slot.reshape(bk, 1) < length, v, jnp.zeros_like(v))
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
    return corr[:, None] * o + pv, m_new, l

  init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), _MASK, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(0, trips, body, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def prefix_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                     lengths: jax.Array, *, splits: int | None = None,
                     interpret: bool | None = None):
  """The committed prefix's share: q [B, K, R, H] (R query rows per kv head), pools
  [P, page, K, H], table [B, C] page ids (NO_PAGE past a row's pages), lengths [B] ->
  (o [S, B, K, R, H] unnormalised, m, l [S, B, K, R]) float32, S splits of the table."""
  from jax.experimental.pallas import triton as pltriton
  b, kh, r, h = q.shape
  n_pages, page = k_pool.shape[0], k_pool.shape[1]
  bq, nq, ppb, s = geometry(b, kh, r, table.shape[1], page, splits)
  pps = -(-table.shape[1] // (s * ppb)) * ppb  # pages per split, whole loop blocks
  table = jnp.clip(table, 0, n_pages - 1).astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, s * pps - table.shape[1])))
  q = jnp.pad(q, ((0, 0), (0, 0), (0, nq * bq - r), (0, 0)))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if not interpret and kernel_limits(h, page):
    raise ValueError(f"paged attention on a GPU needs a head_dim that is a power of two >= 16 "
                     f"and a page_size that is a power of two (Triton blocks), got head_dim "
                     f"{h}, page_size {page}: set rollout.attention='windows' for this model")
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, page=page, ppb=ppb, pps=pps, scale=1.0 / math.sqrt(h),
                             precision=precision)
  pool_spec = pl.BlockSpec((n_pages, page, None, h), lambda i, j, c, t: (0, 0, j, 0))
  stat_spec = pl.BlockSpec((None, None, None, bq), lambda i, j, c, t: (t, i, j, c))
  shape = (s, b, kh, nq * bq)
  with warnings.catch_warnings():  # the Triton backend's deprecation (module docstring)
    warnings.simplefilter("ignore", DeprecationWarning)
    o, m, l = pl.pallas_call(
        kernel, grid=(b, kh, nq, s),
        in_specs=[pl.BlockSpec((1,), lambda i, j, c, t: (i,)),
                  pl.BlockSpec((None, pps), lambda i, j, c, t: (i, t)),
                  pl.BlockSpec((None, None, bq, h), lambda i, j, c, t: (i, j, c, 0)),
                  pool_spec, pool_spec],
        out_specs=[pl.BlockSpec((None, None, None, bq, h), lambda i, j, c, t: (t, i, j, c, 0)),
                   stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct(shape + (h,), jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="paged_prefix_attention",
    )(lengths.astype(jnp.int32), table, q, k_pool, v_pool)
  return o[..., :r, :], m[..., :r], l[..., :r]


def prefix_attention_xla(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                         lengths: jax.Array):
  """`prefix_attention`'s result (one split) in XLA, for backends without the kernel: one
  loop over blocks of `_KEYS_PER_BLOCK` slots of every row's pages, its trip count the
  longest row's live blocks (read on the device), the same online softmax. The CPU's form:
  XLA:CPU runs a dynamic loop without a host round trip, and its [B, K, R, block] scores
  stay in cache where a window's do not (docs/engine.md's block loop)."""
  b, kh, r, h = q.shape
  n_pages, page = k_pool.shape[0], k_pool.shape[1]
  ppb = max(1, _KEYS_PER_BLOCK // page)
  bk = ppb * page
  table = jnp.clip(table, 0, n_pages - 1).astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))
  lengths = lengths.astype(jnp.int32)
  trips = (jnp.max(lengths, initial=0) + bk - 1) // bk
  scale = 1.0 / math.sqrt(h)

  def body(i, carry):
    o, m, l = carry
    ids = lax.dynamic_slice_in_dim(table, i * ppb, ppb, axis=1)  # [B, ppb]
    k = jnp.take(k_pool, ids, axis=0).reshape(b, bk, kh, h).astype(q.dtype)
    v = jnp.take(v_pool, ids, axis=0).reshape(b, bk, kh, h).astype(q.dtype)
    seen = i * bk + jnp.arange(bk)[None, :] < lengths[:, None]  # [B, bk]
    s = jnp.einsum("BKRH,BSKH->BKRS", q, k, preferred_element_type=jnp.float32) * scale
    p, m_new, corr, l = _softmax_step(m, l, s, seen[:, None, None])
    v = jnp.where(seen[:, :, None, None], v, jnp.zeros_like(v))
    pv = jnp.einsum("BKRS,BSKH->BKRH", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return corr[..., None] * o + pv, m_new, l

  init = (jnp.zeros((b, kh, r, h), jnp.float32), jnp.full((b, kh, r), _MASK, jnp.float32),
          jnp.zeros((b, kh, r), jnp.float32))
  o, m, l = lax.fori_loop(0, trips, body, init)
  return o[None], m[None], l[None]


def default_impl() -> str:
  """The prefix's implementation where none is asked for: the Pallas kernel on a GPU, the XLA
  block loop elsewhere (the kernel interpreted is for tests)."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                    lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    chunk_mask: jax.Array | None = None, *, impl: str | None = None,
                    splits: int | None = None, interpret: bool | None = None) -> jax.Array:
  """q [B, T, N, H] of T new tokens at slots lengths .. lengths + T - 1; pools [P, page, K, H]
  and table [B, C] the cache's (module docstring); k_new, v_new [B, T, K, H] the chunk's keys
  and values as the cache holds them; chunk_mask [B|1, T, T] bool (None: causal) ->
  [B, T, N, H] in q's dtype: what `attend` gives over the window of the committed prefix and
  the chunk. impl: "pallas" (the kernel; `interpret` as `prefix_attention`) or "xla"
  (`prefix_attention_xla`); None: `default_impl()`."""
  b, t, n, h = q.shape
  kh = k_new.shape[2]
  g = n // kh
  # query rows per kv head, row r = t * G + g (heads of a kv head are consecutive)
  qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  impl = impl or default_impl()
  if impl == "xla":
    o, m, l = prefix_attention_xla(qr, k_pool, v_pool, table, lengths)
  elif impl == "pallas":
    o, m, l = prefix_attention(qr, k_pool, v_pool, table, lengths, splits=splits,
                               interpret=interpret)
  else:
    raise ValueError(f"paged_attention impl={impl!r}: use 'pallas' or 'xla'")
  # the chunk's own tokens, in XLA: scores [B, K, T*G, T]
  sc = jnp.einsum("BKRH,BSKH->BKRS", qr, k_new.astype(q.dtype),
                  preferred_element_type=jnp.float32) / math.sqrt(h)
  mask = jnp.tril(jnp.ones((1, t, t), jnp.bool_)) if chunk_mask is None else chunk_mask
  mask = jnp.repeat(jnp.broadcast_to(mask, (b, t, t)), g, axis=1)[:, None]  # [B, 1, T*G, T]
  p_c, m_c, _, l_c = _softmax_step(jnp.full(sc.shape[:-1], _MASK), 0.0, sc, mask)
  top = jnp.maximum(m.max(axis=0), m_c)
  w, w_c = jnp.exp(m - top), jnp.exp(m_c - top)  # [S, B, K, R], [B, K, R]
  num = (o * w[..., None]).sum(axis=0) + jnp.einsum(
      "BKRS,BSKH->BKRH", (p_c * w_c[..., None]).astype(q.dtype), v_new.astype(q.dtype),
      preferred_element_type=jnp.float32)
  den = (l * w).sum(axis=0) + l_c * w_c
  out = num / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)[..., None]
  return out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def query_blocks(groups: int) -> dict[int, int]:
  """Every query block the kernel can run with (`geometry`: its code differs by that alone
  among a replica's chunks), each with the most chunk tokens T that give it: T tokens are
  T * groups query rows a kv head, and past 64 rows the 64-row block repeats."""
  out: dict[int, int] = {}
  for t in range(1, -(-_MAX_QUERY_BLOCK // groups) + 1):
    out[min(_MAX_QUERY_BLOCK, max(16, _pow2(t * groups)))] = t
  return out


@functools.cache
def kernel_check(kv_heads: int, groups: int, head_dim: int, page: int, dtype: str,
                 table_pages: int) -> str | None:
  """None if the kernel compiles on this backend and agrees with the XLA form (within 2% of
  the output's scale) at every query block (`query_blocks`), else why not (one line). Two
  rows on scattered pages of a table as wide as the replica's (`table_pages`), one nearly
  full. A JAX or Triton release that miscompiles the kernel is caught here, at start-up, not
  by a rollout of wrong tokens. Numpy inputs, the executables' own calls: nothing is staged
  into a trace that asked. Off a GPU the kernel is interpreted (tests)."""
  rng = np.random.default_rng(0)
  cap = table_pages * page
  n_pages = 2 * table_pages + 2
  table = rng.permutation(n_pages)[:2 * table_pages].reshape(2, table_pages).astype(np.int32)
  lengths = np.array([min(37, cap), max(1, cap - 5)], np.int32)
  dt = jnp.dtype(dtype)
  pool = lambda: rng.normal(size=(n_pages, page, kv_heads, head_dim)).astype(dt)
  k_pool, v_pool = pool(), pool()
  for t in sorted(query_blocks(groups).values()):
    q = rng.normal(size=(2, t, kv_heads * groups, head_dim)).astype(dt)
    k_new, v_new = (rng.normal(size=(2, t, kv_heads, head_dim)).astype(dt) for _ in "kv")
    args = (q, k_pool, v_pool, table, lengths, k_new, v_new)
    run = lambda impl: np.asarray(jax.jit(functools.partial(paged_attention, impl=impl))
                                  .lower(*args).compile()(*args), np.float32)
    try:
      got = run("pallas")
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here
      return f"does not compile here at {t} chunk tokens ({error_line(e)})"
    want = run("xla")
    err = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-6))
    if not err <= 0.02:  # (NaN fails too)
      return f"disagrees with the XLA form at {t} chunk tokens (relative error {err:.1e})"
  return None


def kernel_limits(head_dim: int, page: int) -> str | None:
  """Why the kernel cannot serve a replica of this geometry on a GPU whatever it compiles to
  (None: it can): Triton's power-of-two blocks. The simulator prices a GPU replica's
  attention by these (plan/sim_engine.py)."""
  if head_dim < 16 or head_dim & (head_dim - 1) or page & (page - 1):
    return (f"Triton blocks need a head_dim that is a power of two >= 16 and a power-of-two "
            f"page_size, not {head_dim} and {page}")
  return None


def gpu_verdict(kv_heads: int, groups: int, head_dim: int, page: int, dtype: str,
                table_pages: int, tensor: int = 1) -> str | None:
  """None if the kernel serves a replica of this geometry on this GPU, else why not: its
  limits (`kernel_limits`), then `kernel_check` on the kv heads one device runs (a replica
  splits them over its `tensor` devices where they divide, as its cache's sharding does)."""
  local = kv_heads // tensor if tensor > 1 and kv_heads % tensor == 0 else kv_heads
  return (kernel_limits(head_dim, page)
          or kernel_check(local, groups, head_dim, page, dtype, table_pages))
