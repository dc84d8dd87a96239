"""Kernel bodies shared by both Pallas backends (`triton`, `mosaic`): the kernel design.

grid = (B,): one program per batch row, and a body sees that row's refs only (Triton: the
row's blocks, batch dim squeezed; Mosaic GPU: `ref.at[b]` views; [B] outputs as [1]). The chain
greedy kernel walks positions in a `while_loop` (an argmax row per position until the first
mismatch); the sampling chain does the K accept tests as scalar loads (`ref[i, tok]`) in a
`fori_loop` and reads one or two vocab rows (the race); the tree walk is a `while_loop` over
depth whose children are a static unrolled loop over C (scalar loads only). Only the tile loops
differ per backend (`row_argmax` / `row_race`): each backend module passes its own in and says
how it tiles.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tlt_jax.kernels.verify.reference import NEG_INF, _accept_ratio, _residual_logp, _tree_accept

# Vocabulary tile. 1024 f32 = 4 KiB per operand per tile: with num_warps=4 (Triton) or one
# warpgroup (Mosaic GPU, 128 lanes) that is 8 elements per thread per operand, small enough to
# keep 3 operands + 2 running argmaxes in registers.
_DEFAULT_BLOCK_V = 1024


# ----------------------------------------------------------------------------------------------
# Chain: kernels (one body, two backends: row_argmax / row_race are the backend's tile loops)
# ----------------------------------------------------------------------------------------------


def _chain_greedy_kernel(tlp_ref, d_ref, n_ref, nxt_ref, *, K, row_argmax):
  def cond(carry):
    return carry[2] == 0

  def body(carry):
    i, _, _ = carry
    am = row_argmax(tlp_ref, i)
    cont = (i < K) & (d_ref[jnp.minimum(i, K - 1)] == am)
    return i + cont.astype(jnp.int32), am, 1 - cont.astype(jnp.int32)

  n, am, _ = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
  n_ref[0] = n
  nxt_ref[0] = am


def _chain_sample_kernel(*refs, K, has_q, row_race, q_tile=None):
  if has_q:
    tlp_ref, d_ref, q_ref, u_ref, g_ref, n_ref, nxt_ref = refs
  else:
    tlp_ref, d_ref, u_ref, g_ref, n_ref, nxt_ref = refs
    q_ref = None

  def accept_body(i, carry):
    n, alive = carry
    d = d_ref[i]
    lp_d = tlp_ref[i, d].astype(jnp.float32)
    lq_d = q_ref[i, d].astype(jnp.float32) if has_q else jnp.float32(0.0)
    acc = (u_ref[i] < _accept_ratio(lp_d, lq_d)).astype(jnp.int32)
    alive = alive * acc
    return n + alive, alive

  n, _ = lax.fori_loop(0, K, accept_body, (jnp.int32(0), jnp.int32(1)))
  has_d = n < K
  jq = jnp.minimum(n, K - 1)

  if has_q:
    def residual_fn(offs, lp, t):
      lq = q_tile(q_ref, jq, t)
      return _residual_logp(lp, jnp.where(has_d, lq, NEG_INF))
  else:
    d_n = d_ref[jq]

    def residual_fn(offs, lp, t):
      return jnp.where((offs == d_n) & has_d, NEG_INF, lp)

  n_ref[0] = n
  nxt_ref[0] = row_race(tlp_ref, g_ref, n, residual_fn)


# ----------------------------------------------------------------------------------------------
# Tree: kernels (shared node step; the backends differ only in how the path is carried)
# ----------------------------------------------------------------------------------------------


def _tree_children(ch_ref, tok_ref, c, C):
  """Static unroll over C: [(valid, child id clamped >= 0, child token)] by scalar loads."""
  out = []
  for k in range(C):
    ch = ch_ref[c, k]
    chc = jnp.maximum(ch, 0)
    out.append((ch >= 0, chc, tok_ref[chc]))
  return out


def _tree_choose(info, c, am, tlp_ref, u_ref, greedy):
  """The sibling loop at node c: (found, accepted child or c). Flags start as Python None
  (= False): the Triton lowering cannot negate a literal."""
  found = None
  target = c
  removed = jnp.float32(0.0)
  for k, (valid, chc, tok) in enumerate(info):
    live = valid if found is None else valid & jnp.logical_not(found)
    if greedy:
      acc = live & (tok == am)
    else:
      dup = None
      for j in range(k):
        hit = info[j][0] & (info[j][2] == tok)
        dup = hit if dup is None else dup | hit
      p_tok = jnp.exp(tlp_ref[c, tok].astype(jnp.float32))
      if dup is not None:
        p_tok = jnp.where(dup, 0.0, p_tok)
      acc = live & _tree_accept(u_ref[chc], p_tok, removed)
      removed = jnp.where(live & jnp.logical_not(acc), removed + p_tok, removed)
    target = jnp.where(acc, chc, target)
    found = acc if found is None else found | acc
  return found, target


def _tree_residual(info, removing):
  """Residual at the final node: its children's tokens removed (when the walk stopped there)."""
  def residual_fn(offs, lp, t):
    hit = (offs == info[0][2]) & info[0][0]
    for valid, _, tok in info[1:]:
      hit = hit | ((offs == tok) & valid)
    return jnp.where(hit & removing, NEG_INF, lp)
  return residual_fn


def _tree_kernel(*refs, C, D, greedy, row_argmax, row_race, path_len):
  """Tree walk. path_len = Dp (power of two, Triton): the path is a [Dp] vector carry stored
  at once; path_len = None (Mosaic GPU, whose arrays span >= 128 lanes): D+1 scalar carries
  stored one by one."""
  if greedy:
    tlp_ref, tok_ref, ch_ref, path_ref, n_ref, nxt_ref = refs
    u_ref = g_ref = None
  else:
    tlp_ref, tok_ref, ch_ref, u_ref, g_ref, path_ref, n_ref, nxt_ref = refs
  if path_len is not None:
    lane = lax.broadcasted_iota(jnp.int32, (path_len,), 0)
    path0 = jnp.where(lane == 0, 0, -1).astype(jnp.int32)
    record = lambda path, move, dep1, target: jnp.where(move & (lane == dep1), target, path)
  else:
    path0 = (jnp.int32(0),) + (jnp.int32(-1),) * D
    record = lambda path, move, dep1, target: tuple(
        jnp.where(move & (dep1 == j), target, p) for j, p in enumerate(path))

  def cond(carry):
    return carry[2] == 0

  def body(carry):
    c, dep, _, path, am = carry
    if greedy:
      am = row_argmax(tlp_ref, c)
    found, target = _tree_choose(_tree_children(ch_ref, tok_ref, c, C), c, am, tlp_ref, u_ref,
                                 greedy)
    move = found & (dep < D)
    dep1 = dep + move.astype(jnp.int32)
    path = record(path, move, dep1, target)
    return jnp.where(move, target, c), dep1, 1 - move.astype(jnp.int32), path, am

  init = (jnp.int32(0), jnp.int32(0), jnp.int32(0), path0, jnp.int32(0))
  c, dep, _, path, am = lax.while_loop(cond, body, init)
  if greedy:
    nxt = am
  else:
    residual_fn = _tree_residual(_tree_children(ch_ref, tok_ref, c, C), dep < D)
    nxt = row_race(tlp_ref, g_ref, c, residual_fn)
  if path_len is not None:
    path_ref[...] = path
  else:
    for j, p in enumerate(path):
      path_ref[j] = p
  n_ref[0] = dep
  nxt_ref[0] = nxt
