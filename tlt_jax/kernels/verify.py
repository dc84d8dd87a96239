"""Lossless speculative verification: a chain rule and a (target-only) tree rule.

Each rule comes as a pure-jnp reference (`*_reference`, vectorised over the batch) and Pallas
kernels (one program per batch row, the vocabulary walked in tiles) on two backends: Mosaic GPU
(`*_mosaic`) and Triton (`*_triton`). The public entry points `verify_chain` / `verify_tree`
pick the reference or the kernel of `kernel_backend()`. All of them take the same arrays and
compute the same float expressions in the same order (the small helpers below, and the kernel
bodies, are shared), so their integer outputs agree exactly; the tests check this.

Conventions
-----------
* Distributions are log-probs (`-inf` = outside the support), as produced by
  `tlt_jax.rollout.sampling.processed_logprobs` (temperature / top-k / top-p already applied).
* Randomness is pre-drawn (`draw_verify_randomness` / `draw_tree_randomness`): one uniform per
  draft position / tree node for the accept test, and standard-Gumbel noise of shape [..., V]
  per position / node. Sampling from a (possibly unnormalised) distribution r is the Gumbel-max /
  exponential race `argmax(log r + noise)`, so no normalisation (and no division) is needed and
  the kernel needs only running (max, argmax) reductions over vocabulary tiles.
* Ties in every argmax resolve to the lowest token id (same as `jnp.argmax`).

Chain rule (Leviathan et al. / Chen et al. speculative sampling)
---------------------------------------------------------------
Draft token d_i (i < K) is accepted iff `u_i < min(1, p_i(d_i) / q_i(d_i))`, evaluated as
`u_i < exp(min(log p - log q, 0))` with p(d)=0 -> ratio 0 (always reject; no NaN from
-inf - -inf) and q(d)=0 < p(d) -> ratio 1 (accept). At the first rejection j the next token is
drawn from norm(max(p_j - q_j, 0)) (log-space: `lp + log(1 - exp(lq - lp))` where lp > lq, else
-inf); after K acceptances the bonus token is drawn from p_K. `draft_logp=None` means one-hot
drafts: accept prob p_i(d_i), residual = p_i without d_i. If the residual has no mass (p == q
exactly, e.g. both zero at a rejected out-of-support draft) the token is drawn from p_j instead;
either way only tokens with p_j > 0 can be emitted.

Tree rule (target-only, deterministic drafts; SGLang's tree speculative sampling)
-------------------------------------------------------------------------------
At node c (start: root, node 0) keep r = p_c; for each child ch (in the given order, -1 entries
skipped) accept it iff `u_ch * max(1 - removed, r(tok)) < r(tok)`, i.e. with prob
r(tok) / sum(r) where sum(r) = 1 - removed (p_c is normalised; `removed` = mass of siblings
already rejected, accumulated in sibling order; the max() clamps float round-off so the ratio
never exceeds 1). A rejected token's mass is zeroed, so a duplicate sibling has r(tok) = 0 and is
rejected. Accepting moves to ch (r = p_ch). When no child is accepted (or c is a leaf, or c is at
depth `max_depth`) the next token is drawn from norm(r) with noise[c] (falling back to p_c if
r has no mass). Lossless: P(accept child k) * ... telescopes to p_c(tok_k), and the residual
covers the rest of p_c, for any draft tree chosen independently of the verification randomness.

Greedy variants ignore `uniforms` / `noise` / `draft_logp` (pass None): chain -> longest prefix
with d_i == argmax p_i, next = argmax at the first mismatch (or p_K); tree -> move to the first
child whose token is argmax p_c, next = argmax p_c at the node where none matches.

Backends (`kernel_backend`, the one place that picks)
----------------------------------------------------
* Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`) on NVIDIA GPUs of compute capability >= 9.0
  (Hopper, Blackwell), and off-GPU in Mosaic GPU's CPU interpret mode (`InterpretGPUParams`:
  it simulates GMEM and the warpgroup), which is what CPU tests and `use_kernel=True` on a CPU
  run. Exception: sampling chain verification WITH draft log-probs uses the jnp reference on
  Mosaic GPU (`_MOSAIC_NO_Q`): its residual needs log1p / expm1, which jax 0.12's Mosaic GPU
  lowering does not have, and a rewrite in exp / log would change the reference's (= the
  default CPU run's) sampled tokens.
* Triton (`jax.experimental.pallas.triton`) only on pre-Hopper GPUs (and GPUs without a CUDA
  compute capability). JAX >= 0.11 deprecates this backend (a DeprecationWarning when a kernel
  is lowered for a GPU); it stays as their fallback while JAX ships it and is never lowered on
  Hopper or off-GPU, so those paths are warning-free. Nothing outside this module imports it.
`use_kernel=False` is the jnp reference everywhere (the CPU default of the engine).
scripts/bench_verify.py times both kernels against the reference (XLA-fused) per shape: where
XLA is as fast on a GPU, the kernel should go.

Kernel design (shared)
----------------------
grid = (B,): one program per batch row. The chain greedy kernel walks positions in a
`while_loop` (an argmax row per position until the first mismatch); the sampling chain does the
K accept tests as scalar loads (`ref[i, tok]`) in a `fori_loop` and reads one or two vocab rows
(the race); the tree walk is a `while_loop` over depth whose children are a static unrolled loop
over C (scalar loads only). Only the tile loops differ per backend (`row_argmax` / `row_race`):

Triton (see `_DEFAULT_BLOCK_V`): each row's operand is one full block (BlockSpec with the batch
dim squeezed), so only *power-of-two* loads/stores are ever issued: scalar loads and [block_v]
tiles in a `fori_loop` over ceil(V / block_v) tiles. The last tile is a masked load (`other` =
-inf for log-probs, 0 for noise) so V needs no padding copy. No scratch memory (unsupported by
the Triton backend): all state lives in loop carries; the tree path is a [Dp] vector carry.
Lowered with `pallas.triton.CompilerParams` explicitly (jax's default GPU backend is Mosaic GPU).

Mosaic GPU: one warpgroup (128 lanes) per program; operands stay in GMEM (a [K+1, V] row block
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

Lowering for a GPU on a machine without one needs an abstract GPU device on JAX >= 0.11 (see
tests/test_verify_kernel.py::test_kernels_lower_to_triton / test_kernels_lower_to_mosaic_gpu);
jax 0.12 lowers Mosaic GPU kernels to their custom call without any CUDA plugin (its bindings
are only needed to compile the module to a cubin, on the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

NEG_INF = float("-inf")
_LN2 = 0.6931471805599453

# Vocabulary tile. 1024 f32 = 4 KiB per operand per tile: with num_warps=4 (Triton) or one
# warpgroup (Mosaic GPU, 128 lanes) that is 8 elements per thread per operand, small enough to
# keep 3 operands + 2 running argmaxes in registers.
_DEFAULT_BLOCK_V = 1024
_NUM_WARPS = 4
_LANES = 128  # CUDA lanes of one Mosaic GPU (Pallas) thread = one warpgroup


# ----------------------------------------------------------------------------------------------
# Randomness
# ----------------------------------------------------------------------------------------------


def draw_verify_randomness(key: jax.Array, batch: int, num_draft: int, vocab: int
                           ) -> tuple[jax.Array, jax.Array]:
  """Chain randomness: (uniforms [B, K] in [0, 1), noise [B, K+1, V] standard Gumbel)."""
  ku, kg = jax.random.split(key)
  uniforms = jax.random.uniform(ku, (batch, num_draft), jnp.float32)
  noise = jax.random.gumbel(kg, (batch, num_draft + 1, vocab), jnp.float32)
  return uniforms, noise


def draw_tree_randomness(key: jax.Array, batch: int, num_nodes: int, vocab: int
                         ) -> tuple[jax.Array, jax.Array]:
  """Tree randomness: (uniforms [B, T] in [0, 1), noise [B, T, V] standard Gumbel).
  uniforms[:, n] is the accept coin of node n (unused for the root); noise[:, n] samples at n."""
  ku, kg = jax.random.split(key)
  uniforms = jax.random.uniform(ku, (batch, num_nodes), jnp.float32)
  noise = jax.random.gumbel(kg, (batch, num_nodes, vocab), jnp.float32)
  return uniforms, noise


# ----------------------------------------------------------------------------------------------
# Shared float math (used verbatim by the reference and the kernel -> bit-identical decisions)
# ----------------------------------------------------------------------------------------------


def _accept_ratio(lp_d, lq_d):
  """min(1, p/q) from log-probs; 0 when p = 0 (also when q = 0), 1 when q = 0 < p."""
  return jnp.where(lp_d == NEG_INF, 0.0, jnp.exp(jnp.minimum(lp_d - lq_d, 0.0)))


def _residual_logp(lp, lq):
  """log max(p - q, 0) (unnormalised), -inf where p <= q. log1mexp split for accuracy."""
  d = jnp.minimum(lq - lp, 0.0)  # <= 0 where it is used (lp > lq); NaN-free otherwise
  d = jnp.where(lp > lq, d, -1.0)
  log1mexp = jnp.where(d > -_LN2, jnp.log(-jnp.expm1(d)), jnp.log1p(-jnp.exp(d)))
  return jnp.where(lp > lq, lp + log1mexp, NEG_INF)


def _tree_accept(u, p_tok, removed):
  """Accept iff u < p_tok / sum(r) with sum(r) = 1 - removed (clamped so the ratio <= 1)."""
  return u * jnp.maximum(1.0 - removed, p_tok) < p_tok


def _pick(best_r, idx_r, idx_p):
  """Residual sample if the residual had any mass, else the sample from p."""
  return jnp.where(best_r > NEG_INF, idx_r, idx_p)


def _gumbel_pick(logr, lp, g):
  """[B, V] reference version of the race: argmax(logr + g), falling back to argmax(lp + g)."""
  sr = logr + g
  sp = lp + g
  return _pick(jnp.max(sr, axis=-1), jnp.argmax(sr, axis=-1).astype(jnp.int32),
               jnp.argmax(sp, axis=-1).astype(jnp.int32))

# ----------------------------------------------------------------------------------------------
# Backend choice (the one place that decides)
# ----------------------------------------------------------------------------------------------

# Why the chain rule with draft log-probs stays on the reference on Mosaic GPU: its residual
# needs log1mexp (`_residual_logp`: log1p / expm1) bit-for-bit like the reference, and jax
# 0.12's Mosaic GPU lowering has no rule for lax.log1p_p / lax.expm1_p (a rewrite in exp / log
# would change the reference's, i.e. the default run's, sampled tokens).
_MOSAIC_NO_Q = ("Mosaic GPU (jax 0.12) lowers no log1p/expm1, which the draft-q residual needs "
                "bit-for-bit: chain verification with draft_logp uses the jnp reference there")


def kernel_backend() -> str:
  """Which Pallas backend the verification kernels use on the default device.

  "mosaic_gpu": NVIDIA GPUs of compute capability >= 9.0 (Hopper, Blackwell), and every
  non-GPU device (the Mosaic GPU kernels in Mosaic GPU's CPU interpret mode).
  "triton": older GPUs (and GPUs without a CUDA compute capability): the Pallas Triton backend,
  deprecated since JAX 0.11, kept only as their fallback while JAX ships it.
  """
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return "mosaic_gpu"
  cc = getattr(dev, "compute_capability", None)
  try:
    hopper = tuple(int(x) for x in str(cc).split(".")[:2]) >= (9, 0)
  except ValueError:
    hopper = False
  return "mosaic_gpu" if hopper else "triton"


def _auto_interpret(interpret):
  if interpret is None:
    return jax.default_backend() != "gpu"
  return bool(interpret)



# ----------------------------------------------------------------------------------------------
# Chain: reference
# ----------------------------------------------------------------------------------------------


def _check_chain(target_logp, draft_tokens, draft_logp, uniforms, noise, greedy):
  B, K1, V = target_logp.shape
  K = K1 - 1
  if K < 1:
    raise ValueError("verify_chain needs at least one draft token (target_logp [B, K+1, V])")
  if draft_tokens.shape != (B, K):
    raise ValueError(f"draft_tokens {draft_tokens.shape} != {(B, K)}")
  if not greedy:
    if uniforms is None or noise is None:
      raise ValueError("sampling verification needs uniforms and noise")
    if uniforms.shape != (B, K) or noise.shape != (B, K1, V):
      raise ValueError(f"uniforms {uniforms.shape} / noise {noise.shape} do not match "
                       f"{(B, K)} / {(B, K1, V)}")
    if draft_logp is not None and draft_logp.shape != (B, K, V):
      raise ValueError(f"draft_logp {draft_logp.shape} != {(B, K, V)}")
  return B, K, V


@functools.partial(jax.jit, static_argnames=("greedy",))
def verify_chain_reference(target_logp, draft_tokens, draft_logp, uniforms, noise, *,
                           greedy: bool):
  """Pure-jnp chain verification. Returns (num_accepted [B] int32, next_token [B] int32)."""
  B, K, V = _check_chain(target_logp, draft_tokens, draft_logp, uniforms, noise, greedy)
  tlp = target_logp.astype(jnp.float32)
  d = draft_tokens.astype(jnp.int32)
  rows = jnp.arange(B)
  if greedy:
    am = jnp.argmax(tlp, axis=-1).astype(jnp.int32)  # [B, K+1]
    match = (d == am[:, :K]).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return n, am[rows, n]
  lp_d = jnp.take_along_axis(tlp[:, :K], d[..., None], axis=-1)[..., 0]
  if draft_logp is None:
    lq_d = jnp.zeros_like(lp_d)
  else:
    lq_d = jnp.take_along_axis(draft_logp.astype(jnp.float32), d[..., None], axis=-1)[..., 0]
  acc = (uniforms.astype(jnp.float32) < _accept_ratio(lp_d, lq_d)).astype(jnp.int32)
  n = jnp.sum(jnp.cumprod(acc, axis=1), axis=1).astype(jnp.int32)
  has_d = (n < K)[:, None]
  jq = jnp.minimum(n, K - 1)
  lp_n = tlp[rows, n]
  g = noise.astype(jnp.float32)[rows, n]
  if draft_logp is None:
    d_n = d[rows, jq]
    logr = jnp.where((jnp.arange(V)[None, :] == d_n[:, None]) & has_d, NEG_INF, lp_n)
  else:
    lq_n = jnp.where(has_d, draft_logp.astype(jnp.float32)[rows, jq], NEG_INF)
    logr = _residual_logp(lp_n, lq_n)
  return n, _gumbel_pick(logr, lp_n, g)


# ----------------------------------------------------------------------------------------------
# Kernel building blocks: Triton (pre-Hopper fallback)
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
# Kernel building blocks: Mosaic GPU (Hopper and newer; CPU interpret mode)
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
  """Gumbel race at `row` (as `_row_race`; residual_fn gets t=None: its tiles are not t-indexed)."""
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


def verify_chain(target_logp: jax.Array, draft_tokens: jax.Array, draft_logp: jax.Array | None,
                 uniforms: jax.Array | None, noise: jax.Array | None, *, greedy: bool,
                 use_kernel: bool = True, interpret: bool | None = None,
                 block_v: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Chain speculative verification.

  target_logp [B, K+1, V]: processed target log-probs at each draft position (+ bonus position).
  draft_tokens [B, K] int32; draft_logp [B, K, V] draft log-probs or None (one-hot drafts).
  uniforms [B, K], noise [B, K+1, V] (`draw_verify_randomness`); unused (may be None) if greedy.
  Returns (num_accepted [B] int32 in [0, K], next_token [B] int32).
  use_kernel: the Pallas kernel of `kernel_backend()` (interpret=None -> interpret mode unless
  the backend is GPU) or the jnp reference.
  """
  if use_kernel:
    interpret = _auto_interpret(interpret)
    if kernel_backend() == "triton":
      return verify_chain_triton(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                 greedy=greedy, interpret=interpret, block_v=block_v)
    if greedy or draft_logp is None:
      return verify_chain_mosaic(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                 greedy=greedy, interpret=interpret, block_v=block_v)
  return verify_chain_reference(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                greedy=greedy)


# ----------------------------------------------------------------------------------------------
# Tree: reference
# ----------------------------------------------------------------------------------------------


def _check_tree(target_logp, tree_tokens, children, uniforms, noise, greedy, max_depth):
  B, T, V = target_logp.shape
  if tree_tokens.shape != (B, T):
    raise ValueError(f"tree_tokens {tree_tokens.shape} != {(B, T)}")
  if children.ndim != 3 or children.shape[:2] != (B, T):
    raise ValueError(f"children {children.shape} must be [B={B}, T={T}, C]")
  if max_depth < 0:
    raise ValueError(f"max_depth={max_depth} must be >= 0")
  if not greedy:
    if uniforms is None or noise is None:
      raise ValueError("sampling verification needs uniforms and noise")
    if uniforms.shape != (B, T) or noise.shape != (B, T, V):
      raise ValueError(f"uniforms {uniforms.shape} / noise {noise.shape} do not match "
                       f"{(B, T)} / {(B, T, V)}")
  return B, T, V, children.shape[2]


@functools.partial(jax.jit, static_argnames=("greedy", "max_depth"))
def verify_tree_reference(target_logp, tree_tokens, children, uniforms, noise, *,
                          greedy: bool, max_depth: int):
  """Pure-jnp tree verification.

  Returns (accepted_path [B, D+1] int32: 0 then accepted node ids, -1 padded;
           num_accepted [B] int32; next_token [B] int32).
  """
  B, T, V, C = _check_tree(target_logp, tree_tokens, children, uniforms, noise, greedy,
                           max_depth)
  D = max_depth
  tlp = target_logp.astype(jnp.float32)
  toks = tree_tokens.astype(jnp.int32)
  kids = children.astype(jnp.int32)
  rows = jnp.arange(B)

  def child_info(node):
    ch = kids[rows, node]  # [B, C]
    chc = jnp.maximum(ch, 0)
    return ch >= 0, chc, jnp.take_along_axis(toks, chc, axis=1)

  am = jnp.argmax(tlp, axis=-1).astype(jnp.int32) if greedy else None  # [B, T]
  node = jnp.zeros((B,), jnp.int32)
  done = jnp.zeros((B,), bool)
  path = [jnp.zeros((B,), jnp.int32)]
  for _ in range(D):
    valid, chc, tok = child_info(node)
    if greedy:
      match = valid & (tok == am[rows, node][:, None])
      found = jnp.any(match, axis=1)
      target = chc[rows, jnp.argmax(match, axis=1)]
    else:
      lp_tok = jnp.take_along_axis(tlp[rows, node], tok, axis=1)  # [B, C]
      u = jnp.take_along_axis(uniforms.astype(jnp.float32), chc, axis=1)
      found = jnp.zeros((B,), bool)
      target = node
      removed = jnp.zeros((B,), jnp.float32)
      for k in range(C):
        dup = jnp.zeros((B,), bool)
        for j in range(k):
          dup = dup | (valid[:, j] & (tok[:, j] == tok[:, k]))
        p_tok = jnp.where(dup, 0.0, jnp.exp(lp_tok[:, k]))
        live = valid[:, k] & ~found
        acc = live & _tree_accept(u[:, k], p_tok, removed)
        rej = live & ~acc
        removed = jnp.where(rej, removed + p_tok, removed)
        target = jnp.where(acc, chc[:, k], target)
        found = found | acc
    move = ~done & found
    node = jnp.where(move, target, node)
    path.append(jnp.where(move, target, -1))
    done = done | ~found
  path = jnp.stack(path, axis=1)
  n = jnp.sum((path[:, 1:] >= 0).astype(jnp.int32), axis=1)
  if greedy:
    nxt = am[rows, node]
  else:
    valid, _, tok = child_info(node)
    removing = (n < D)[:, None, None]
    mask = jnp.any(removing & valid[:, :, None]
                   & (tok[:, :, None] == jnp.arange(V)[None, None, :]), axis=1)
    lp_c = tlp[rows, node]
    nxt = _gumbel_pick(jnp.where(mask, NEG_INF, lp_c), lp_c,
                       noise.astype(jnp.float32)[rows, node])
  return path, n, nxt



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


def verify_tree(target_logp: jax.Array, tree_tokens: jax.Array, children: jax.Array,
                uniforms: jax.Array | None, noise: jax.Array | None, *, greedy: bool,
                max_depth: int, use_kernel: bool = True, interpret: bool | None = None,
                block_v: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Tree speculative verification (target-only rule, deterministic drafts).

  target_logp [B, T, V]: processed target log-probs at each node (distribution of the token
  after node n; node 0 = root = last committed token). tree_tokens [B, T] int32 (root entry
  unused). children [B, T, C] int32, -1 = none, siblings in draft-score order. max_depth D
  (static) bounds the accepted path; nodes deeper than D are never visited.
  uniforms [B, T], noise [B, T, V] (`draw_tree_randomness`); unused (may be None) if greedy.
  Returns (accepted_path [B, D+1] int32, num_accepted [B] int32, next_token [B] int32).
  """
  if use_kernel:
    kernel = verify_tree_triton if kernel_backend() == "triton" else verify_tree_mosaic
    return kernel(target_logp, tree_tokens, children, uniforms, noise, greedy=greedy,
                  max_depth=max_depth, interpret=_auto_interpret(interpret), block_v=block_v)
  return verify_tree_reference(target_logp, tree_tokens, children, uniforms, noise,
                               greedy=greedy, max_depth=max_depth)
