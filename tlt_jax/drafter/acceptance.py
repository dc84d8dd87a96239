"""How well a drafter drafts for a policy, read off finished sequences without decoding again.

One target forward over prompt + response gives every hidden state f_t and the target's
distribution p at every position; `chain_drafts` (loss.py) runs a chain of `depth` drafter
steps from EVERY position at once, as the engine's drafter would after verifying up to there,
along the sequence's own tokens (`teacher`: the only path a verifier that accepts drafts along
the sequence ever sees). From them, per chain start t, `survival` gives S_k(t): the
probability that a verification starting at t accepts at least k drafts, GIVEN the tokens the
sequence went on to emit:

  greedy (temperature 0): S_k = 1 while the drafter's argmax equals the next k tokens, else 0;
  sampled: S_k = prod_{j<=k} min(1, q_j(y_j) / p_j(y_j)), y the sequence's tokens, p and q the
  target's and drafter's processed distributions (temperature, top-k, top-p: what the engine
  samples and verifies with). This is exact: speculative sampling emits y_j with an accepted
  draft with probability min(q_j, p_j)(y_j) and emits y_j at all with probability p_j(y_j)
  (lossless), so P(accepted | emitted y) is their ratio, and given the emitted sequence each
  verification's acceptance is independent of the others'.

The engine does not verify from every position: it starts at the first response token (the
pending token x_P, drafting from f_{P-1}), commits the a accepted drafts and the next token,
and verifies again from there. `walk` takes the expectation of that walk over the acceptance
counts S gives (a backward recursion over the starts), so over a policy's own samples the
tokens per verification here are the engine's figure in expectation, with none of the
noise of drawing drafts and acceptances (and paired: two drafters are read off the same
sequences); greedy, the walk is the engine's exactly (tests/test_acceptance.py checks both
against the engine).

This is the staleness signal the RL metrics carry every step (`drafter_acceptance`), on the
policy's own rollouts at their sampling settings, whether or not speculation ran.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter.loss import accept_lengths, chain_drafts
from tlt_jax.models import ModelConfig, Params, forward
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs

GREEDY = SamplingParams(temperature=0.0)


def walk(survival: np.ndarray, prompt_len: int, end: int) -> tuple[float, float]:
  """Expected (tokens, verifications) of the engine's verifications over one sequence that
  ends at `end` (its length) and whose response starts at `prompt_len`. The first
  verification starts at t = prompt_len - 1 (the pending token x_P, drafting from f_{P-1});
  one that accepts a drafts commits the pending token and the a drafts and emits the next
  pending token, from which the next verification starts (at t + a + 1), unless that token is
  the sequence's last (a stop token or the budget's last: no verification is needed) or the
  row ended inside the drafts. survival [T - 1, depth]: S_k(t), the probability that a
  verification at t accepts at least k drafts (0/1 greedy: the walk itself)."""
  depth = survival.shape[1]
  t0 = prompt_len - 1
  first = max(end - 3, t0)  # the last start with a next token to verify (t0 always runs)
  s = np.concatenate([np.ones((first + 1, 1)), survival[:first + 1], np.zeros((first + 1, 1))],
                     axis=1)
  pa = (s[:, :-1] - s[:, 1:]).tolist()  # P(exactly a drafts accepted), a = 0..depth
  ver = [0.0] * (end + depth + 2)
  tok = [0.0] * (end + depth + 2)
  last = end - 3  # a verification that lands at t + a + 1 goes on only up to here
  for t in range(first, t0 - 1, -1):
    v, k = 1.0, 0.0
    for a, p in enumerate(pa[t]):
      if p:
        nxt = t + a + 1
        go = nxt <= last
        v += p * (ver[nxt] if go else 0.0)
        k += p * (a + 1 + (tok[nxt] if go else 0.0))
    ver[t], tok[t] = v, k
  return float(tok[t0]), float(ver[t0])


@functools.partial(jax.jit, static_argnames=("cfg", "depth", "sampling"))
def survival(target_params: Params, dparams: Params, tokens: jax.Array, lengths: jax.Array,
             starts: jax.Array, *, cfg: ModelConfig, depth: int,
             sampling: SamplingParams = GREEDY) -> jax.Array:
  """[S, T] padded sequences (lengths [S]; starts [S, T - 1] bool: chain starts counted) ->
  [S, T - 1, depth] S_k(t) (module docstring), 0 where not a start; a draft of a token at or
  past a sequence's length is never accepted."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  out = forward(target_params, tokens, positions, cfg=cfg, return_logits=not sampling.greedy)
  drafts, dlogits = chain_drafts(dparams, target_params, tokens, out.hidden, positions,
                                 cfg=cfg, depth=depth, teacher=True)
  if sampling.greedy:  # the leading drafts equal to the sequence's tokens, all or nothing
    acc = accept_lengths(drafts, tokens, starts, lengths)
    return (acc[..., None] >= jnp.arange(1, depth + 1)).astype(jnp.float32)
  b, n = tokens.shape[0], tokens.shape[1] - 1
  pad = lambda x: jnp.pad(x, ((0, 0), (0, depth + 2)))
  nxt = pad(tokens)  # nxt[:, t + j + 1] = y_j of the chain from t
  # log p of each sequence token under the target's processed distribution before it
  tlp = processed_logprobs(out.logits, sampling)[:, :-1]
  lp = pad(jnp.take_along_axis(tlp, tokens[:, 1:, None], axis=-1)[..., 0])
  idx = jnp.arange(n)[None, :]
  run = jnp.ones((b, n), jnp.float32)
  out_s = []
  for j in range(1, depth + 1):
    want = nxt[:, j + 1:j + 1 + n]
    lq = jnp.take_along_axis(processed_logprobs(dlogits[j - 1], sampling), want[..., None],
                             axis=-1)[..., 0]
    a = jnp.exp(jnp.minimum(lq - lp[:, j:j + n], 0.0))
    run = run * jnp.where(idx + j + 1 < lengths[:, None], a, 0.0)
    out_s.append(run)
  return jnp.where(starts[..., None], jnp.stack(out_s, -1), 0.0)


def measure(target_params: Params, dparams: Params, sequences: Sequence[tuple[Any, Any]], *,
            cfg: ModelConfig, depth: int = 4, sampling: SamplingParams = GREEDY,
            length: int | None = None, ends: Sequence[int] | None = None,
            executable: Callable | None = None) -> dict[str, Any]:
  """Tokens per verification of a chain of `depth` drafts over `sequences` ((prompt ids,
  response ids) pairs; responses of at least one token), each walked as the engine verifies
  (module docstring), drafts sampled and verified with `sampling` (default greedy; the
  sequences should be the policy's own samples at those settings): the tokens a verification
  commits, so drafts past a sequence's end are not counted. length: the padded sequence
  length (static: one executable; default: the longest, rounded up to 64); a longer sequence
  is cut to it and walked to there (the chains' attention is quadratic in it). ends: where
  each walk stops (a prompt + response length; default the sequence's own): with sequences
  that continue past it, the drafts accepted past the end count as the engine counts them
  (its acceptance is the verifier's, whatever a stop token cuts from the emission). Returns
  tokens_per_verify (all tokens over all verifications, expected), its standard error over
  sequences (ratio estimator), per-sequence expected (tokens, verifications) (`difference`
  pairs two drafters' on the same sequences), and the mean expected accepted drafts over
  every response position. executable: `survival` compiled ahead of time (`compile_survival`)
  for these settings and [S, length] sequences; used when the shapes match, else `survival`
  is called (and compiled on first use)."""
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
  args = (target_params, dparams, jnp.asarray(tok), jnp.asarray(lens), jnp.asarray(starts))
  if executable is not None and executable.args_info[0][2].shape == tok.shape:
    surv = executable(*args)
  else:
    surv = survival(*args, cfg=cfg, depth=depth, sampling=sampling)
  surv = np.asarray(jax.device_get(surv), np.float64)
  per = [walk(surv[i], len(p), end) for i, ((p, _), end) in enumerate(zip(seqs, ends))]
  tokens = np.asarray([x for x, _ in per], np.float64)
  ver = np.asarray([v for _, v in per], np.float64)
  tpv = tokens.sum() / ver.sum()
  stderr = None
  if len(per) > 1:  # the ratio estimator's standard error over sequences
    resid = tokens - tpv * ver
    stderr = float(np.sqrt((resid ** 2).sum() / (len(per) - 1) / len(per)) / ver.mean())
  return {"tokens_per_verify": float(tpv), "stderr": stderr, "sequences": len(per),
          "per_sequence": per, "accepted_per_position": float(surv.sum(-1)[starts].mean())}


def compile_survival(target_params: Params, dparams: Params, num: int, length: int, *,
                     cfg: ModelConfig, depth: int, sampling: SamplingParams = GREEDY):
  """`survival` compiled ahead of time for `num` sequences of `length` tokens (params: arrays
  or ShapeDtypeStructs with their shardings): `measure`'s executable, compiled where it costs
  the caller nothing (a background thread) before the first measurement needs it."""
  abstract = lambda t: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), t)
  return survival.lower(abstract(target_params), abstract(dparams),
                        jax.ShapeDtypeStruct((num, length), jnp.int32),
                        jax.ShapeDtypeStruct((num,), jnp.int32),
                        jax.ShapeDtypeStruct((num, length - 1), jnp.bool_),
                        cfg=cfg, depth=depth, sampling=sampling).compile()


def difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float | None]:
  """(tokens per verification of `a` minus `b`, its standard error) for two `measure`s of
  different drafters over the SAME sequences: paired, so the sequences' own spread (easy
  and hard prompts) cancels and what is left is how the drafters differ."""
  ta, va = (np.asarray(x, np.float64) for x in zip(*a["per_sequence"]))
  tb, vb = (np.asarray(x, np.float64) for x in zip(*b["per_sequence"]))
  if ta.shape != tb.shape:
    raise ValueError(f"difference: {len(ta)} vs {len(tb)} sequences; measure both drafters "
                     "on the same sequences")
  ra, rb = ta.sum() / va.sum(), tb.sum() / vb.sum()
  if len(ta) < 2:
    return float(ra - rb), None
  resid = (ta - ra * va) / va.mean() - (tb - rb * vb) / vb.mean()  # the two ratios' linearized
  return float(ra - rb), float(np.sqrt((resid ** 2).sum() / (len(ta) - 1) / len(ta)))
