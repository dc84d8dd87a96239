"""The verification rules as pure-jnp references (vectorised over the batch), the randomness
they consume, and the float math the kernels share with them (used verbatim by the references
and the kernel bodies, so their integer outputs agree exactly).

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
_LN2 = 0.6931471805599453


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
# Chain: reference (the input checks serve the kernels too)
# ----------------------------------------------------------------------------------------------


def _check_randomness(uniforms, noise, u_shape: tuple, noise_shape: tuple) -> None:
  """Sampling verification's uniforms (one per draft or node) and Gumbel noise (per position)."""
  if uniforms is None or noise is None:
    raise ValueError("sampling verification needs uniforms and noise")
  if uniforms.shape != u_shape or noise.shape != noise_shape:
    raise ValueError(f"uniforms {uniforms.shape} / noise {noise.shape} do not match "
                     f"{u_shape} / {noise_shape}")


def _check_chain(target_logp, draft_tokens, draft_logp, uniforms, noise, greedy):
  B, K1, V = target_logp.shape
  K = K1 - 1
  if K < 1:
    raise ValueError("verify_chain needs at least one draft token (target_logp [B, K+1, V])")
  if draft_tokens.shape != (B, K):
    raise ValueError(f"draft_tokens {draft_tokens.shape} != {(B, K)}")
  if not greedy:
    _check_randomness(uniforms, noise, (B, K), (B, K1, V))
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
# Tree: reference (the input checks serve the kernels too)
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
    _check_randomness(uniforms, noise, (B, T), (B, T, V))
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
