"""The policy-gradient term of each response token: the importance ratio (per token, or per
response: GSPO), PPO's clip and the dual clip. Device-side, over packed rows (grpo.py's batch
layout: segments numbered per row, 0 on padding).

`grpo.loss_mode` (VeRL's `policy_loss.loss_mode`):
- "vanilla": PPO's token ratio r_t = pi(y_t) / pi_old(y_t), clipped to [1 - eps_low,
  1 + eps_high], each token's term max(-A r_t, -A clip(r_t)).
- "gspo" (Zheng et al. 2025, Group Sequence Policy Optimization): one ratio per response,
  s = (prod_t pi(y_t) / pi_old(y_t))^(1/|y|), the geometric mean of its token ratios, clipped
  as a whole (the paper's ranges are narrow: eps 3e-4 / 4e-4); in its token form, as VeRL
  writes it, each token's ratio is sg(s) x pi(y_t) / sg(pi(y_t)): the value s, the gradient
  s x grad log pi(y_t), so the response's mean over its tokens (`loss_agg`
  seq-mean-token-mean, GSPO's) differentiates as the sequence objective does. The log-ratio
  is capped at 10 as VeRL caps it.
The dual clip (grpo.clip_ratio_c) applies to either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_MODES = ("vanilla", "gspo")


def segment_sums(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """[b, T] values, packed segments numbered per row (0: padding) -> each token's segment's
  sum over the row, [b, T] (0 on padding)."""
  t = x.shape[1]

  def row(v, seg):  # (row by row: the rows stay split over the learner's batch devices)
    return jax.ops.segment_sum(v, seg, num_segments=t + 1)[seg]
  return jnp.where(segment_ids > 0, jax.vmap(row)(x, segment_ids), 0.0)


def segment_means(x: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Each token's segment's mean of x over its masked (response) tokens, [b, T]."""
  return segment_sums(x * mask, segment_ids) / jnp.maximum(segment_sums(mask, segment_ids), 1.0)


def policy_gradient(logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array,
                    segment_ids: jax.Array, *, mode: str, eps_low: float, eps_high: float,
                    clip_c: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """-> (each token's policy-gradient term [b, T], sums over the response tokens: clip_frac
  (the ratio clipped), clip_frac_lower (bounded by the dual clip, where clip_c > 0))."""
  log_ratio = logp - old
  if mode == "gspo":
    seq = jax.lax.stop_gradient(segment_means(log_ratio, mask, segment_ids))
    log_ratio = jnp.minimum(seq + logp - jax.lax.stop_gradient(logp), 10.0)
  elif mode != "vanilla":
    raise ValueError(f"loss_mode={mode!r}: use one of {', '.join(LOSS_MODES)}")
  ratio = jnp.exp(log_ratio)
  pg_unclipped = -adv * ratio
  pg_clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(pg_unclipped, pg_clipped)
  sums = {"clip_frac": jnp.sum((pg_clipped > pg_unclipped) * mask)}
  if clip_c > 0:  # dual-clip: a negative advantage's term at most -A x c
    lower = (adv < 0) & (pg > -adv * clip_c)
    pg = jnp.where(lower, -adv * clip_c, pg)
    sums["clip_frac_lower"] = jnp.sum(lower * mask)  # (VeRL's pg_clipfrac_lower)
  return pg, sums
