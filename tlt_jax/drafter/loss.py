"""Drafter training objective (EAGLE's) with the optional multi-step unroll, and the offline
acceptance estimate used to evaluate drafters.

Batch convention (one packed row holds whole sequences = prompt + response):
  tokens      [B, T] int32    x_t
  hidden      [B, T, D]       f_t, the target's last hidden state after x_t, after the final norm
                              (anything, e.g. 0, where unknown: the last token of a sequence)
  positions   [B, T] int32    restart at 0 for each packed sequence
  loss_mask   [B, T]          1 where f_t PRODUCED a response token, i.e. t in [P-1, T_seq-2]
                              for a sequence with P prompt tokens: the usual SFT next-token
                              mask
  segment_ids [B, T] int32    optional; 1, 2, ... per packed sequence, 0 = padding
                              (default: each row is one sequence)

Step t of the drafter takes the pair (x_{t+1}, f_t) at position positions[t], outputs g_t and
is scored against f_{t+1} and p_{t+1} = softmax(target head(f_{t+1})) (the target's
distribution of x_{t+2}). It counts when loss_mask[t+1] = 1 and x_{t+1} is in the same
sequence, i.e. when the target distribution it imitates is one that sampled a response token.

    loss = sum_k decay^(k-1) * [ w_v * SmoothL1(g_t^k, f_{t+1}) + w_p * CE(p_{t+1}, q_t^k) ]

each term a token-mean over its step's valid positions (SmoothL1 averaged over D, as EAGLE).
Step 1 is the plain EAGLE loss. Step k > 1 ("training-time test", EAGLE-3) feeds the drafter's
OWN step-(k-1) outputs as hidden inputs, shifted by one position (g^{k-1}_{t-1} stands in for
f_t), while tokens stay the real ones; a position counts at step k when the k-1 steps feeding
it counted too (a chain that started at a valid position). Gradients flow through the unroll.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.drafter.model import drafter_forward
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params, compute_logits


@dataclasses.dataclass(frozen=True)
class LossConfig:
  w_v: float = 1.0  # feature regression (SmoothL1) weight
  w_p: float = 0.1  # soft cross-entropy against the target's distribution
  unroll_steps: int = 1  # 1 = plain EAGLE; n > 1: EAGLE-3 style unroll over own outputs
  step_decay: float = 0.8  # weight of step k is step_decay ** (k - 1)
  smooth_l1_beta: float = 1.0  # torch.nn.SmoothL1Loss default
  # tokens per LM-head chunk: target and draft logits are [chunk, V] at a time, never
  # [rows, row_len, V] (at a 152k vocabulary 8 x 2048 tokens of them would be ~60 GB)
  logit_chunk: int = 1024

  def __post_init__(self):
    if self.unroll_steps < 1:
      raise ValueError(f"LossConfig.unroll_steps={self.unroll_steps} must be >= 1")
    if self.logit_chunk < 1:
      raise ValueError(f"LossConfig.logit_chunk={self.logit_chunk} must be >= 1")
    if self.smooth_l1_beta <= 0:
      raise ValueError(f"LossConfig.smooth_l1_beta={self.smooth_l1_beta} must be > 0")
    if self.w_v < 0 or self.w_p < 0 or self.step_decay < 0:
      raise ValueError("LossConfig weights (w_v, w_p, step_decay) must be >= 0")


def smooth_l1(x: jax.Array, beta: float = 1.0) -> jax.Array:
  ax = jnp.abs(x)
  return jnp.where(ax < beta, 0.5 * x * x / beta, ax - 0.5 * beta)


def loss_terms(g: jax.Array, draft_logits: jax.Array, f_next: jax.Array,
               target_logits: jax.Array, mask: jax.Array, *, w_v: float = 1.0,
               w_p: float = 0.1, beta: float = 1.0) -> dict[str, jax.Array]:
  """One step's loss. g, f_next [B, T, D]; logits [B, T, V]; mask [B, T] (bool or 0/1)."""
  ptok, hit = _token_terms(draft_logits, target_logits)
  return _reduce(g, f_next, ptok, hit, mask, w_v=w_v, w_p=w_p, beta=beta)


def _token_terms(draft_logits: jax.Array, target_logits: jax.Array):
  """Per token: soft cross-entropy -sum p log q, and whether the top-1 tokens agree."""
  p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
  ptok = -(p * logq).sum(-1)
  hit = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
  return ptok, hit


def chunked_token_terms(target_params: Params, g: jax.Array, f_next: jax.Array, *,
                        cfg: ModelConfig, chunk: int) -> tuple[jax.Array, jax.Array]:
  """`_token_terms` of the draft (g) and target (f_next) logits, [B, T] each, computed
  `chunk` tokens at a time under jax.checkpoint: the [.., V] logits of one chunk are live at
  a time, in the backward pass too."""
  b, t, d = g.shape
  n = -(-(b * t) // chunk)
  pad = n * chunk - b * t
  flat = lambda x: jnp.pad(x.reshape(b * t, d), ((0, pad), (0, 0))).reshape(n, chunk, d)

  @jax.checkpoint
  def one(args):
    gc, fc = args
    tl = jax.lax.stop_gradient(compute_logits(target_params, fc, cfg))
    return _token_terms(compute_logits(target_params, gc, cfg), tl)

  ptok, hit = jax.lax.map(one, (flat(g), flat(jax.lax.stop_gradient(f_next))))
  unflat = lambda x: x.reshape(n * chunk)[:b * t].reshape(b, t)
  return unflat(ptok), unflat(hit)


def _reduce(g, f_next, ptok, hit, mask, *, w_v: float, w_p: float, beta: float):
  m = mask.astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)
  vtok = smooth_l1(g.astype(jnp.float32) - f_next.astype(jnp.float32), beta).mean(-1)
  vloss = (vtok * m).sum() / n
  ploss = (ptok * m).sum() / n
  return {"loss": w_v * vloss + w_p * ploss, "vloss": vloss, "ploss": ploss,
          "acc": (hit * m).sum() / n, "tokens": m.sum()}


def _shift_right(x: jax.Array, fill) -> jax.Array:
  """x[:, t] <- x[:, t-1] along axis 1; position 0 gets `fill` (same trailing shape)."""
  return jnp.concatenate([jnp.broadcast_to(fill, x[:, :1].shape).astype(x.dtype), x[:, :-1]],
                         axis=1)


def prepare_pairs(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Sequence batch -> drafter pairs (length T-1): see the module docstring."""
  tokens, hidden = batch["tokens"], batch["hidden"]
  seg = batch.get("segment_ids")
  if seg is None:
    seg = jnp.ones(tokens.shape, jnp.int32)
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
  return {
      "tokens": tokens[:, 1:],  # x_{t+1}
      "hidden": hidden[:, :-1],  # f_t
      "f_next": hidden[:, 1:],  # f_{t+1}
      "positions": batch["positions"][:, :-1],
      "segment_ids": seg[:, :-1],
      "valid": same & (batch["loss_mask"][:, 1:] > 0),
      # step k > 1 may only reuse g_{t-1} from the same sequence
      "has_prev": _shift_right(same, False) & (seg[:, :-1] != 0),
  }


def drafter_loss(dparams: Params, target_params: Params, batch: dict[str, jax.Array], *,
                 cfg: ModelConfig, loss_cfg: LossConfig = LossConfig()
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """-> (scalar loss, metrics). Differentiate w.r.t. dparams only (target params are
  stop-gradiented here anyway). metrics: loss, vloss, ploss (decay-weighted sums over steps,
  so loss = w_v * vloss + w_p * ploss), acc (step 1 top-1 vs the target argmax), tokens, and
  per step k = 1..n: acc_k, vloss_k, ploss_k, tokens_k."""
  target_params = jax.lax.stop_gradient(target_params)
  pr = prepare_pairs(batch)
  f_next = jax.lax.stop_gradient(pr["f_next"])
  real_hidden = pr["hidden"]
  hid, valid = real_hidden, pr["valid"]
  total = jnp.float32(0.0)
  metrics: dict[str, Any] = {"vloss": jnp.float32(0.0), "ploss": jnp.float32(0.0)}
  for k in range(1, loss_cfg.unroll_steps + 1):
    g, _, _ = drafter_forward(dparams, target_params, pr["tokens"], hid, pr["positions"],
                              cfg=cfg, segment_ids=pr["segment_ids"], return_logits=False)
    ptok, hit = chunked_token_terms(target_params, g, f_next, cfg=cfg,
                                    chunk=loss_cfg.logit_chunk)
    t = _reduce(g, f_next, ptok, hit, valid, w_v=loss_cfg.w_v, w_p=loss_cfg.w_p,
                beta=loss_cfg.smooth_l1_beta)
    w = loss_cfg.step_decay ** (k - 1)
    total = total + w * t["loss"]
    metrics["vloss"] = metrics["vloss"] + w * t["vloss"]
    metrics["ploss"] = metrics["ploss"] + w * t["ploss"]
    for name in ("acc", "vloss", "ploss", "tokens"):
      metrics[f"{name}_{k}"] = t[name]
    if k < loss_cfg.unroll_steps:
      hid = jnp.where(pr["has_prev"][..., None], _shift_right(g, 0.0).astype(real_hidden.dtype),
                      real_hidden)
      valid = pr["valid"] & _shift_right(valid, False)
  metrics["loss"] = total
  metrics["acc"] = metrics["acc_1"]
  metrics["tokens"] = metrics["tokens_1"]
  return total, metrics


# ----------------------------------------------------------------------- acceptance estimate
def chain_window_mask(n: int, j: int) -> jax.Array:
  """[1, n, j*n] visibility of chain step j's n queries (one per start t) over the drafter
  cache of `chain_drafts`: the real pairs <= t (slots 0..n-1, causal), then the chain's own
  steps 2..j (block i at slots (i-1)n..in-1: its t only; block j is the step itself)."""
  tril = jnp.tril(jnp.ones((n, n), jnp.bool_))
  eye = jnp.eye(n, dtype=jnp.bool_)
  return jnp.concatenate([tril] + [eye] * (j - 1), axis=1)[None]


def chain_drafts(dparams: Params, target_params: Params, tokens: jax.Array, hidden: jax.Array,
                 positions: jax.Array, *, cfg: ModelConfig, depth: int, teacher: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """Greedy draft chains of `depth` from EVERY position of unpacked rows, in one pass per step.

  tokens/positions [B, T], hidden [B, T, D] (real f). Chain t starts from the real pair
  (x_{t+1}, f_t) (draft step 1), then feeds its own (drafted token, g) back, as drafting does:
  step j's pair sits at position positions[t] + j - 1 and attends to the real pairs <= t and
  its own earlier steps (the KV cache a drafter would hold after verifying up to x_{t+1}).
  The real pairs' k/v go to a drafter cache once; step j runs only its n new queries, over
  the j*n slots filled so far (`chain_window_mask`): n * j*n scores, not (j*n)^2.
  teacher: step j > 1 is fed the sequence's own token x_{t+j} instead of the chain's draft
  (with the chain's g): the drafter's distribution of x_{t+j+1} on the path where every
  earlier draft equalled the sequence, which is all a verifier that accepts drafts along the
  sequence ever sees (identical to the free chain wherever its drafts matched).
  Returns (drafts [depth, B, T-1] int32: step j's greedy token, a guess of x_{t+j+1};
  logits [depth, B, T-1, V]).
  """
  from tlt_jax.drafter.model import drafter_cache
  tok, hid, pos = tokens[:, 1:], hidden[:, :-1], positions[:, :-1]
  b, n = tok.shape
  cache = drafter_cache(cfg, b, n * depth)
  g, _, cache = drafter_forward(dparams, target_params, tok, hid, pos, cfg=cfg, cache=cache,
                                kv_len=n, return_logits=False)
  cache = cache.replace(lengths=cache.lengths + n)
  logits = compute_logits(target_params, g, cfg)
  drafts, all_logits = [jnp.argmax(logits, -1).astype(jnp.int32)], [logits]
  for j in range(2, depth + 1):
    fed = (jnp.pad(tok[:, j - 1:], ((0, 0), (0, j - 1))) if teacher else drafts[-1])
    g, _, cache = drafter_forward(dparams, target_params, fed, g.astype(hid.dtype),
                                  pos + (j - 1), cfg=cfg, cache=cache, kv_len=j * n,
                                  window_mask=chain_window_mask(n, j), return_logits=False)
    cache = cache.replace(lengths=cache.lengths + n)
    logits = compute_logits(target_params, g, cfg)
    drafts.append(jnp.argmax(logits, -1).astype(jnp.int32))
    all_logits.append(logits)
  return jnp.stack(drafts), jnp.stack(all_logits)


def accept_lengths(drafts: jax.Array, tokens: jax.Array, starts: jax.Array,
                   lengths: jax.Array) -> jax.Array:
  """Greedy-verification acceptance per chain start: the number of consecutive drafts that
  equal the real continuation (drafts[j-1][b, t] vs tokens[b, t+j+1], counted while
  t+j+1 < lengths[b]). drafts [depth, B, T-1]; starts [B, T-1] bool -> [B, T-1] int32
  (0 where not a start). Exact for sequences the target generated greedily."""
  depth, b, n = drafts.shape
  idx = jnp.arange(n)[None, :]
  run = jnp.ones((b, n), jnp.bool_)
  total = jnp.zeros((b, n), jnp.int32)
  padded = jnp.concatenate([tokens, jnp.zeros((b, depth + 2), tokens.dtype)], axis=1)
  for j in range(1, depth + 1):
    want = padded[:, j + 1:j + 1 + n]
    inside = idx + j + 1 < lengths[:, None]
    run = run & inside & (drafts[j - 1] == want)
    total = total + run.astype(jnp.int32)
  return jnp.where(starts, total, 0)
