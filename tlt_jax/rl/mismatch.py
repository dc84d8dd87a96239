"""How far the rollout's sampling distribution is from the learner's, and its correction.

The learner never trusts the rollout's log-probs for its ratio (grpo.py recomputes them), but
the responses were still drawn from the rollout's distribution: in bf16 on a GPU the engine's
decode (one token a step, or a speculative verification over K+1 at once, paged attention)
rounds differently from the learner's packed forward, and top-k / top-p sample from a
truncated distribution the learner's softmax does not have. The policy gradient then runs on
samples of a slightly different policy (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"). The engine records each emitted token's
log-prob under the distribution it sampled from (the target's, speculative or not:
rollout/sampling.py's `processed_logprobs`), so the gap is measured every step, and with
`grpo.rollout_is` corrected by truncated importance sampling (VeRL's rollout correction:
`rollout_is_level` token / sequence / geometric, `rollout_is_mode` truncate,
`rollout_is_threshold`):

  token:     each token's term x min(pi_old(y_t) / pi_rollout(y_t), cap)
  sequence:  each response's terms x min(prod_t pi_old(y_t) / pi_rollout(y_t), cap)
  geometric: each response's terms x min((prod_t pi_old(y_t) / pi_rollout(y_t))^(1/|y|), cap)
             (the per-token mean ratio: a long response's weight does not run off as the
             sequence's product does)

the weights constant (no gradient), applied to the clipped policy-gradient term only (VeRL's
place: the KL and entropy terms are the learner's own). On this CPU in float32 the two
distributions agree to ~1e-6 and the weights are 1; the metrics say when they are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.rl.policy_loss import segment_means, segment_sums

ROLLOUT_IS = ("", "token", "sequence", "geometric")


def correction(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array,
               segment_ids: jax.Array, *, level: str, cap: float
               ) -> tuple[jax.Array | None, dict[str, jax.Array]]:
  """-> (the importance weights [b, T], constant; None where level is ""), each metric's sum
  over the response tokens (`mask`), for the loss to divide by the mini-batch's token count:
  - rollout_kl: log pi_rollout - log pi_old, the k1 value of KL(rollout || old) on the
    rollout's own samples (unbiased; ~0 where they agree, positive under top-p / top-k);
  - rollout_k3: r - 1 - log r with r = pi_old / pi_rollout, the k3 value of the same KL
    (never negative, lower variance);
  - rollout_prob_diff: |pi_old - pi_rollout| of the sampled token (VeRL's
    rollout_probs_diff_mean);
  with a correction, rollout_is_weight (the weights' mean) and rollout_is_clip_frac (the
  share of tokens whose weight the cap cut)."""
  old = jax.lax.stop_gradient(old_logp)
  d = jnp.where(mask > 0, old - rollout_logp, 0.0)  # log r
  metrics = {"rollout_kl": jnp.sum(-d * mask),
             "rollout_k3": jnp.sum((jnp.expm1(d) - d) * mask),
             "rollout_prob_diff": jnp.sum(jnp.abs(jnp.exp(old) - jnp.exp(rollout_logp)) * mask)}
  if not level:
    return None, metrics
  if level == "sequence":
    log_w = segment_sums(d, segment_ids)
  elif level == "geometric":
    log_w = segment_means(d, mask, segment_ids)
  else:
    log_w = d
  log_cap = jnp.log(jnp.float32(cap))
  weights = jnp.exp(jnp.minimum(log_w, log_cap))  # (in log space: a long response's sum
  metrics["rollout_is_weight"] = jnp.sum(weights * mask)  # overflows no exp)
  metrics["rollout_is_clip_frac"] = jnp.sum((log_w > log_cap) * mask)
  return weights, metrics
