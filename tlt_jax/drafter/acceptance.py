"""How well a drafter drafts for a policy, read off finished sequences without decoding again.

One target forward over prompt + response gives every hidden state f_t; `chain_drafts`
(loss.py) drafts a greedy chain of `depth` tokens from EVERY position at once, as the engine's
drafter would after verifying up to there, and `accept_lengths` counts the leading drafts that
equal the sequence's own continuation. The engine does not verify from every position: it
starts at the first response token (the pending token x_P, drafting from f_{P-1}), commits the
a accepted drafts and the next token, and verifies again from there. `walk` follows that
sequence of starts, so for a response the target decoded greedily the tokens per verification
here are the ones greedy speculative decoding with a chain of `depth` gets, exactly
(tests/test_acceptance.py checks it against the engine).

For a sampled response the same walk counts the drafts that equal the sampled continuation: the
staleness signal the RL metrics carry every step (`drafter_acceptance`), from the policy's own
rollouts, whether or not speculation ran. At T=1 it is the rate at which greedy drafts match
the sampled tokens, not the engine's acceptance of drafts sampled from the drafter (min(1, p/q)
per draft: the two differ by how p and q differ), so read it as a signal comparable from step
to step and between drafters, and the greedy figure as the engine's own.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter.loss import accept_lengths, chain_drafts
from tlt_jax.models import ModelConfig, Params, forward


def walk(accepted: np.ndarray, prompt_len: int, end: int) -> tuple[int, int]:
  """(tokens, verifications) of the engine's verifications over one sequence that ends at
  `end` (its length) and whose response starts at `prompt_len`. The first verification
  starts at t = prompt_len - 1 (the pending token x_P, drafting from f_{P-1}); each commits
  the pending token and accepted[t] drafts and emits the next pending token, from which the
  next verification starts, unless that token is the sequence's last (a stop token or the
  budget's last: no verification is needed) or the row ended inside the drafts. accepted:
  drafts accepted per start (`accept_lengths`)."""
  t, tokens, verifications = prompt_len - 1, 0, 0
  while True:
    step = int(accepted[t]) + 1
    tokens += step
    verifications += 1
    t += step
    if t + 1 >= end - 1:
      return tokens, verifications


@functools.partial(jax.jit, static_argnames=("cfg", "depth"))
def _accepted(target_params: Params, dparams: Params, tokens: jax.Array, lengths: jax.Array,
              starts: jax.Array, *, cfg: ModelConfig, depth: int) -> jax.Array:
  """[S, T] padded sequences -> [S, T - 1] drafts accepted per start."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden = forward(target_params, tokens, positions, cfg=cfg, return_logits=False).hidden
  drafts, _ = chain_drafts(dparams, target_params, tokens, hidden, positions, cfg=cfg,
                           depth=depth)
  return accept_lengths(drafts, tokens, starts, lengths)


def measure(target_params: Params, dparams: Params, sequences: Sequence[tuple[Any, Any]], *,
            cfg: ModelConfig, depth: int = 4, length: int | None = None,
            ends: Sequence[int] | None = None) -> dict[str, Any]:
  """Tokens per verification of a greedy chain of `depth` drafts over `sequences` ((prompt
  ids, response ids) pairs; responses of at least one token), each walked as the engine
  verifies (module docstring): the tokens a verification commits, so drafts past a
  sequence's end are not counted. length: the padded sequence length (static: one
  executable; default: the longest, rounded up to 64); a longer sequence is cut to it and
  walked to there (the chains' attention is quadratic in it). ends: where each walk stops (a
  prompt + response length; default the sequence's own): with sequences that continue past
  it, the drafts accepted past the end count as the engine counts them (its acceptance is
  the verifier's, whatever a stop token cuts from the emission). Returns tokens_per_verify
  (all tokens over all verifications), its standard error over sequences (ratio
  estimator), per-sequence (tokens, verifications), and the mean accepted drafts over every
  response position."""
  seqs = [(np.asarray(p, np.int32), np.asarray(r, np.int32)) for p, r in sequences]
  ends = [len(p) + len(r) for p, r in seqs] if ends is None else list(ends)
  if length is not None:
    seqs = [(p, r[:max(length - len(p), 0)]) for p, r in seqs]
    ends = [min(e, length) for e in ends]
  keep = [i for i, (p, r) in enumerate(seqs) if len(p) and len(r)]
  seqs, ends = [seqs[i] for i in keep], [ends[i] for i in keep]
  if not seqs:
    return {"tokens_per_verify": None, "stderr": None, "sequences": 0, "per_sequence": [],
            "accepted_per_position": None}
  longest = max(len(p) + len(r) for p, r in seqs)
  t = length or -(-longest // 64) * 64
  tok = np.zeros((len(seqs), t), np.int32)
  lens = np.zeros((len(seqs),), np.int32)
  starts = np.zeros((len(seqs), t - 1), bool)
  for i, (p, r) in enumerate(seqs):
    n = len(p) + len(r)
    tok[i, :n] = np.concatenate([p, r])
    lens[i] = n
    starts[i, len(p) - 1:n - 1] = True  # chains from f_{P-1} on: each drafts response tokens
  acc = np.asarray(jax.device_get(_accepted(target_params, dparams, jnp.asarray(tok),
                                            jnp.asarray(lens), jnp.asarray(starts), cfg=cfg,
                                            depth=depth)))
  per = [walk(acc[i], len(p), end) for i, ((p, _), end) in enumerate(zip(seqs, ends))]
  tokens = np.asarray([x for x, _ in per], np.float64)
  ver = np.asarray([v for _, v in per], np.float64)
  tpv = tokens.sum() / ver.sum()
  stderr = None
  if len(per) > 1:  # the ratio estimator's standard error over sequences
    resid = tokens - tpv * ver
    stderr = float(np.sqrt((resid ** 2).sum() / (len(per) - 1) / len(per)) / ver.mean())
  return {"tokens_per_verify": float(tpv), "stderr": stderr, "sequences": len(per),
          "per_sequence": per, "accepted_per_position": float(acc[starts].mean())}
