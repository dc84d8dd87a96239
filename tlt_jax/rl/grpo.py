"""GRPO's loss: a clipped importance-ratio loss over packed micro-batches (the advantages it
takes: advantages.py; the learner that steps it over the mesh: learner.py).

The learner never trusts rollout log-probs: the rollout may have decoded speculatively, in a
different precision, on another mesh, or with top-k/top-p applied. `learner.logprobs`
recomputes the old (and reference) log-probs with the same function the loss differentiates,
so the importance ratio is exactly 1 on the first mini-batch and speculative decoding cannot
bias training (docs/training.md: one RL step).

Batch layout: packed rows. A micro-batch is [b, T] tokens holding several responses (each
with its prompt) end to end, `segment_ids` numbering them within a row (0 on the padding
after the last), `positions` restarting at 0 in each, `loss_mask` 1 on response tokens (the
stop token included), `loss_weight` each response token's weight in the mini-batch's loss,
and the advantages per token. Attention never crosses a segment
(models/attention.py: a fused kernel on a GPU). Log-probs are aligned to tokens:
logp[:, t] = log p(tokens[:, t] | the tokens of its segment before it), 0 at a segment's
first token. The logits are divided by the rollout temperature first (as VeRL does), so the
ratio is between the two sampling distributions the update actually changes.

Loss aggregation is over the whole mini-batch: the sum over every response token of every
micro-batch of its term x its weight (`grpo.loss_agg`: token-mean by default, the mini-batch's
response-token count dividing every term; the per-response means of the original GRPO and
Dr. GRPO's constant length are the others, batching.token_weights), so the result equals one
unpacked, unpadded pass (tested against a float64 numpy reference, and the gradient against
each response run alone). The metrics are token means whatever the aggregation.
Micro-batches come in length buckets (T = pad_multiple x 2^k) and rows are filled first-fit,
longest first, so the device computes little padding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.errors import ConfigError
from tlt_jax.models import ModelConfig, Params, compute_logits, forward
from tlt_jax.rl.batching import LOSS_AGG
from tlt_jax.rl.kl import KL_LOSS_TYPES, kl_penalty
from tlt_jax.rl.mismatch import ROLLOUT_IS, correction
from tlt_jax.rl.policy_loss import LOSS_MODES, policy_gradient


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  eps_low: float = 0.2  # ratio clipped to [1 - eps_low, 1 + eps_high] ("clip-higher")
  eps_high: float = 0.28
  # the ratio: "vanilla" (PPO's, per token) or "gspo" (per response: rl/policy_loss.py)
  loss_mode: str = "vanilla"
  # > 1: dual-clip PPO (VeRL's clip_ratio_c; 3.0 there): a negative advantage's term is at
  # most -A x clip_ratio_c, however far the ratio runs; 0: off
  clip_ratio_c: float = 0.0
  kl_coef: float = 0.0  # > 0: a KL term to the frozen reference policy
  kl_loss_type: str = "low_var_kl"  # its estimator (rl/kl.py: k3, VeRL's names)
  entropy_coef: float = 0.0  # > 0: an entropy bonus (each token's term less coef x entropy)
  # the rollout's sampling distribution corrected for (rl/mismatch.py): "" off, "token",
  # "sequence" or "geometric" truncated importance weights, at most rollout_is_cap (VeRL's
  # threshold 2.0)
  rollout_is: str = ""
  rollout_is_cap: float = 2.0
  # passes over the step's mini-batches (VeRL's ppo_epochs, TRL's num_iterations): each pass
  # one optimizer step per mini-batch, the old log-probs the rollout policy's throughout
  ppo_epochs: int = 1
  temperature: float = 1.0  # the rollout temperature; logits / T before log-softmax
  adv_eps: float = 1e-6
  norm_adv_by_std: bool = True  # False: Dr. GRPO's advantages (r - mean)
  # how the mini-batch's token terms are aggregated: batching.token_weights (Dr. GRPO:
  # "seq-mean-token-sum-norm" with norm_adv_by_std False)
  loss_agg: str = "token-mean"
  # seq-mean-token-sum-norm's constant length (the config's 0: rollout.max_new_tokens)
  loss_norm_len: int = 0
  logit_chunk: int = 1024  # tokens per LM-head chunk (bounds [rows, chunk, V] logits memory)

  def __post_init__(self):
    if not 0 <= self.eps_low < 1:
      raise ConfigError("must be in [0, 1)", "eps_low", self.eps_low)
    if self.eps_high < 0:
      raise ConfigError("must be >= 0", "eps_high", self.eps_high)
    if self.loss_mode not in LOSS_MODES:
      raise ConfigError(f"use one of {', '.join(LOSS_MODES)} (PPO's token ratio, or GSPO's "
                        "per response)", "loss_mode", self.loss_mode)
    if self.clip_ratio_c != 0 and self.clip_ratio_c <= 1:
      raise ConfigError("must be > 1 (dual-clip's bound on the ratio of a negative advantage's "
                        "term, e.g. 3.0) or 0 (off)", "clip_ratio_c", self.clip_ratio_c)
    if self.kl_coef < 0:
      raise ConfigError("must be >= 0 (0 = no KL term)", "kl_coef", self.kl_coef)
    if self.kl_loss_type not in KL_LOSS_TYPES:
      raise ConfigError(f"use one of {', '.join(KL_LOSS_TYPES)} (low_var_kl: k3, kl: k1, mse: "
                        "k2)", "kl_loss_type", self.kl_loss_type)
    if self.rollout_is not in ROLLOUT_IS:
      raise ConfigError("use '' (off), 'token', 'sequence' or 'geometric' (truncated importance "
                        "weights of the learner's over the rollout's distribution)",
                        "rollout_is", self.rollout_is)
    if not 1 <= self.rollout_is_cap < math.inf:
      raise ConfigError("must be a finite number >= 1 (the importance weights' cap, e.g. 2.0)",
                        "rollout_is_cap", self.rollout_is_cap)
    if self.ppo_epochs < 1:
      raise ConfigError("must be >= 1 (passes over the step's mini-batches; 1: each once)",
                        "ppo_epochs", self.ppo_epochs)
    if self.entropy_coef < 0:
      raise ConfigError("must be >= 0 (0 = no entropy bonus; a negative one would push the "
                        "policy to collapse)", "entropy_coef", self.entropy_coef)
    if self.temperature <= 0:
      raise ConfigError("GRPO samples its groups, the learner needs a temperature > 0 "
                        "(e.g. 1.0)", "temperature", self.temperature)
    if self.adv_eps <= 0:
      raise ConfigError("must be > 0", "adv_eps", self.adv_eps)
    if self.loss_agg not in LOSS_AGG:
      raise ConfigError(f"must be one of {', '.join(LOSS_AGG)}", "loss_agg", self.loss_agg)
    if self.loss_norm_len < 0:
      raise ConfigError("must be >= 0 (a length; the config's 0 is rollout.max_new_tokens)",
                        "loss_norm_len", self.loss_norm_len)
    if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_norm_len < 1:
      raise ConfigError("must be >= 1 with loss_agg='seq-mean-token-sum-norm' (the length each "
                        "response's token sum is divided by, e.g. the generation budget)",
                        "loss_norm_len", self.loss_norm_len)
    if self.logit_chunk < 1:
      raise ConfigError("must be >= 1 (tokens per LM-head chunk, e.g. 1024)", "logit_chunk",
                        self.logit_chunk)


# ---------------------------------------------------------------------------- per-token math
def _lm_head_logprobs(params: Params, hidden: jax.Array, targets: jax.Array, *,
                      cfg: ModelConfig, temperature: float, chunk: int
                      ) -> tuple[jax.Array, jax.Array]:
  """hidden [B, T, D] (after the final norm), targets [B, T] -> (log p(target), entropy), both
  [B, T].

  The LM head runs over chunks of `chunk` positions under `jax.checkpoint`, so neither the
  forward nor the backward pass ever holds [B, T, V] float32 logits (152k-vocab models at 8k
  tokens would need GBs per row)."""
  b, t, d = hidden.shape
  c = min(chunk, t)
  pad = -t % c
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (t + pad) // c
  h = hidden.reshape(b, n, c, d).swapaxes(0, 1)  # [n, B, c, D]
  y = targets.reshape(b, n, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    hc, yc = args
    logits = compute_logits(params, hc, cfg) / temperature  # [B, c, V] float32
    logz = jax.nn.logsumexp(logits, axis=-1)
    lp = jnp.take_along_axis(logits, yc[..., None], axis=-1)[..., 0] - logz
    probs = jax.nn.softmax(logits, axis=-1)
    ent = logz - jnp.sum(probs * logits, axis=-1)
    return lp, ent

  lp, ent = jax.lax.map(one, (h, y))
  lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return lp, ent


def token_logprobs(params: Params, tokens: jax.Array, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, *, cfg: ModelConfig,
                   temperature: float, chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
  """tokens [B, T] -> (logp [B, T], entropy [B, T]) aligned to tokens: at t, of the
  distribution that predicts tokens[:, t]. Packed rows (segment_ids, positions: the module
  docstring) get 0 at each segment's first token and on padding; without segment_ids a row is
  one sequence from position 0 (right padding is harmless under the causal mask) and only
  position 0 gets 0."""
  b, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  out = forward(params, tokens, positions, cfg=cfg, return_logits=False,
                segment_ids=segment_ids)
  lp, ent = _lm_head_logprobs(params, out.hidden[:, :-1], tokens[:, 1:], cfg=cfg,
                              temperature=temperature, chunk=chunk)
  if segment_ids is not None:  # a segment's first token is predicted by the one before
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    lp, ent = jnp.where(same, lp, 0.0), jnp.where(same, ent, 0.0)
  zero = jnp.zeros((b, 1), jnp.float32)
  lp = jnp.concatenate([zero, lp], axis=1)
  ent = jnp.concatenate([zero, ent], axis=1)
  return lp, ent


class Batch(NamedTuple):
  """One micro-batch on device, as the loss reads it (the module docstring's layout)."""

  tokens: jax.Array  # [b, T] int32 packed segments (prompt + response each), then padding
  positions: jax.Array  # [b, T] int32 each segment's own, from 0
  segment_ids: jax.Array  # [b, T] int32 1, 2, ... per row; 0 on padding
  loss_mask: jax.Array  # [b, T] 1 on response tokens
  loss_weight: jax.Array  # [b, T] each response token's weight in the mini-batch's loss
  advantages: jax.Array  # [b, T] each token's response's advantage
  old_logp: jax.Array  # [b, T] recomputed by the learner (never the rollout's)
  ref_logp: jax.Array | None = None  # [b, T] the frozen reference (kl_coef > 0)
  # () bool: the step's first mini-batch, whose params are still the old ones: the old
  # log-probs are the loss's own (stop-gradient), old_logp unread and not computed
  on_policy: jax.Array | None = None
  # [b, T] the rollout's log-probs of the response tokens, 0 elsewhere (None: not recorded;
  # the mismatch metrics and grpo.rollout_is need them: rl/mismatch.py)
  rollout_logp: jax.Array | None = None


def grpo_loss(params: Params, mb: Batch, *, cfg: ModelConfig, gcfg: GRPOConfig,
              num_tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped-ratio loss of one micro-batch (the ratio PPO's or GSPO's, grpo.loss_mode:
  rl/policy_loss.py; plus kl_coef x the KL term to the reference, less entropy_coef x the
  entropy): each response token's term x its `loss_weight`
  (weights over the whole mini-batch, so summing micro-batch losses gives the mini-batch's
  aggregate). ref_logp is read only when kl_coef > 0. With the rollout's log-probs, the
  distance of the rollout's distribution from the old policy's is measured and, with
  rollout_is, the policy-gradient term weighted by it (rl/mismatch.py). Metrics are sums over
  the micro-batch's response tokens divided by the mini-batch's count `num_tokens` (they add
  up to token means).
  """
  logp, ent = token_logprobs(params, mb.tokens, mb.positions, mb.segment_ids, cfg=cfg,
                             temperature=gcfg.temperature, chunk=gcfg.logit_chunk)
  mask = mb.loss_mask.astype(jnp.float32)
  adv = mb.advantages
  old = mb.old_logp
  if mb.on_policy is not None:  # a flag, not a second program: one executable per shape
    old = jnp.where(mb.on_policy, jax.lax.stop_gradient(logp), old)
  pg, sums = policy_gradient(logp, old, adv, mask, mb.segment_ids, mode=gcfg.loss_mode,
                             eps_low=gcfg.eps_low, eps_high=gcfg.eps_high,
                             clip_c=gcfg.clip_ratio_c)
  denom = jnp.maximum(num_tokens.astype(jnp.float32), 1.0)
  metrics = {k: v / denom for k, v in sums.items()}
  metrics["entropy"] = jnp.sum(ent * mask) / denom
  # k1 estimate of KL(old || new) on the sampled tokens: how far this update has moved
  metrics["approx_kl_old"] = jnp.sum((old - logp) * mask) / denom
  if mb.rollout_logp is not None:
    weights, sums = correction(old, mb.rollout_logp, mask, mb.segment_ids,
                               level=gcfg.rollout_is, cap=gcfg.rollout_is_cap)
    metrics.update({k: v / denom for k, v in sums.items()})
    if weights is not None:
      pg = pg * weights
  elif gcfg.rollout_is:
    raise ValueError("grpo.rollout_is needs the rollout's log-probs (Batch.rollout_logp)")
  metrics["pg_loss"] = jnp.sum(pg * mask) / denom
  per_token = pg
  if gcfg.kl_coef > 0:
    kl = kl_penalty(logp, mb.ref_logp, gcfg.kl_loss_type)
    per_token = per_token + gcfg.kl_coef * kl
    metrics["kl_ref"] = jnp.sum(kl * mask) / denom
  if gcfg.entropy_coef > 0:  # (the entropy differentiates through the chunked LM head)
    per_token = per_token - gcfg.entropy_coef * ent
  loss = jnp.sum(per_token * mb.loss_weight)
  metrics["loss"] = loss
  return loss, metrics
