"""The learner's batches: samples (a prompt, its response, the advantage) cut into
mini-batches (a random partition, one optimizer step each) and laid out as packed
micro-batches (grpo's module docstring has the layout; `micro_layout` is the layout from the
lengths alone, which the cluster simulator prices). Host-side numpy only: the learner
(rl/grpo.py) puts them on its mesh."""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple, Sequence

import numpy as np


@dataclasses.dataclass
class Sample:
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  advantage: float
  # [R] the rollout's log-prob of each response token (the engine's Result.logprobs; None: not
  # recorded, e.g. the simulator's and the benches' samples)
  rollout_logp: np.ndarray | None = None

  @property
  def length(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)


class MicroBatch(NamedTuple):
  """One micro-batch on the host, before the old-log-prob pass (`Batch`'s layout)."""

  tokens: np.ndarray  # [b, T] int32
  positions: np.ndarray  # [b, T] int32
  segment_ids: np.ndarray  # [b, T] int32
  loss_mask: np.ndarray  # [b, T] float32
  loss_weight: np.ndarray  # [b, T] float32 each response token's weight in the loss
  advantages: np.ndarray  # [b, T] float32
  index: np.ndarray  # [b, T] int64 each token's sample index, -1 on padding
  # [b, T] float32 the rollout's log-probs on response tokens, 0 elsewhere; None unless every
  # sample of the mini-batch carries them
  rollout_logp: np.ndarray | None = None


def micro_layout(lengths: Sequence[int], rows: int, pad_multiple: int, max_len: int,
                 max_tokens: int = 0, row_multiple: int = 1, max_rows: bool = False
                 ) -> list[tuple[list[list[int]], int, int]]:
  """The layout of `micro_batches` from the samples' lengths alone: per micro-batch, shortest
  first, (the sample indices of each of its rows, its row length T, its row count). The
  cluster simulator prices the learner on it (tlt_jax/plan/learner.py: what the device
  computes, the padding left included).

  Longest first: a micro-batch's T is the length bucket of the longest sample left (the
  smallest pad_multiple x 2^k that holds it, at most max_len rounded up to pad_multiple), its
  row count `rows`, or with max_tokens > 0 max(row_multiple, max_tokens // T rounded down to
  row_multiple); then every sample left, longest first, goes into the first of its rows with
  room (first-fit decreasing), and what fits nowhere waits for the next micro-batch.

  max_rows: of three layouts, the one that computes the fewest tokens (padding included;
  ties to the fewest shapes): the buckets, every micro-batch of max-length rows (max_len
  rounded up: one shape), and max-length rows while the samples left fill a micro-batch of
  them, the buckets after that. Where rows come in multiples of many devices, a last
  micro-batch of max-length rows can be mostly padding, and the buckets win. For attention
  that computes each segment's own blocks only (the fused kernel: kernels/flash_attention.py)
  a long row of many samples costs what short rows of them do; XLA's masked reference
  computes a row's whole T x T, for which the buckets alone are cheaper."""
  cap = -(-max_len // pad_multiple) * pad_multiple
  if lengths and max(lengths) > cap:
    raise ValueError(f"a sample of {max(lengths)} tokens is longer than max_len {max_len}")
  if not max_rows:
    return _layout(lengths, rows, pad_multiple, cap, max_tokens, row_multiple, "buckets")
  layouts = [_layout(lengths, rows, pad_multiple, cap, max_tokens, row_multiple, rule)
             for rule in ("max", "fill", "buckets")]
  return min(layouts, key=lambda lay: (sum(t * n for _, t, n in lay),
                                       len({(t, n) for _, t, n in lay})))


def _layout(lengths, rows, pad_multiple, cap, max_tokens, row_multiple, rule):
  """`micro_layout` under one rule for T: "buckets", "max" (cap) or "fill" (cap while the
  samples left hold a micro-batch of cap-long rows, then the buckets)."""
  left = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
  count = lambda t: (rows if max_tokens <= 0  # noqa: E731 - rows of a micro-batch of T = t
                     else max(row_multiple, (max_tokens // t) // row_multiple * row_multiple))
  out = []
  while left:
    t = pad_multiple
    while t < min(lengths[left[0]], cap):
      t *= 2
    t = min(t, cap)
    if rule == "max" or (rule == "fill" and sum(lengths[i] for i in left) >= count(cap) * cap):
      t = cap
    n = count(t)
    bins: list[list[int]] = [[] for _ in range(n)]
    free = [t] * n
    rest = []
    for i in left:
      r = next((r for r in range(n) if free[r] >= lengths[i]), -1)
      if r < 0:
        rest.append(i)
      else:
        bins[r].append(i)
        free[r] -= lengths[i]
    out.append((bins, t, n))
    left = rest
  return out[::-1]


ROW_LAYOUTS = ("auto", "max_len", "buckets")  # grpo.row_layout: micro_layout's max_rows or not


LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def token_weights(response_lens: Sequence[int], loss_agg: str = "token-mean",
                  norm_len: int = 0) -> np.ndarray:
  """[n] the weight of each response token of sample i in its mini-batch's loss (the n
  samples are the mini-batch): the loss is the sum over every response token of weight x its
  term (grpo.grpo_loss), so the weights say how the terms are aggregated (VeRL's
  `loss_agg_mode`):
    token-mean: every token of the mini-batch alike, 1 / its response tokens (DAPO; a long
      response weighs as its length);
    seq-mean-token-mean: each response's token mean, averaged over responses, 1 / (n x len_i)
      (the original GRPO: a long response's tokens weigh less each);
    seq-mean-token-sum: each response's token sum, averaged over responses, 1 / n;
    seq-mean-token-sum-norm: the sums divided by a constant length instead, 1 / (n x
      norm_len) (Dr. GRPO: no length bias either way; norm_len the generation budget)."""
  lens = np.asarray(response_lens, np.float64)
  n = max(len(lens), 1)
  if loss_agg == "token-mean":
    w = np.full(len(lens), 1.0 / max(lens.sum(), 1.0))
  elif loss_agg == "seq-mean-token-mean":
    w = 1.0 / (n * np.maximum(lens, 1.0))
  elif loss_agg == "seq-mean-token-sum":
    w = np.full(len(lens), 1.0 / n)
  elif loss_agg == "seq-mean-token-sum-norm":
    if norm_len < 1:
      raise ValueError("seq-mean-token-sum-norm needs norm_len >= 1 (the generation budget)")
    w = np.full(len(lens), 1.0 / (n * norm_len))
  else:
    raise ValueError(f"loss_agg {loss_agg!r} is not one of {LOSS_AGG}")
  return w


def micro_batches(samples: list[Sample], rows: int, pad_multiple: int, max_len: int,
                  max_tokens: int = 0, row_multiple: int = 1, loss_agg: str = "token-mean",
                  norm_len: int = 0, max_rows: bool = False) -> Iterator[MicroBatch]:
  """Packed micro-batches (`micro_layout`), shortest first, of one mini-batch: `samples`
  (each response token's loss weight is `token_weights` over them).

  rows: rows per micro-batch; or, with max_tokens > 0, a token budget per micro-batch of T
  tokens a row. Shapes depend only on T, so there is one compile per length bucket, and
  geometric buckets keep them few (32, 64, 128, 256, 384 for max_len 368: 5 compiles of the
  update; on the CPU each costs ~3 s, more than the padding they save).
  """
  weights = token_weights([len(s.response_ids) for s in samples], loss_agg, norm_len)
  recorded = bool(samples) and all(s.rollout_logp is not None for s in samples)
  out = []
  for bins, t, n in micro_layout([s.length for s in samples], rows, pad_multiple, max_len,
                                 max_tokens, row_multiple, max_rows):
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    segments = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    weight = np.zeros((n, t), np.float32)
    adv = np.zeros((n, t), np.float32)
    index = np.full((n, t), -1, np.int64)
    rollout_logp = np.zeros((n, t), np.float32) if recorded else None
    for r, idx in enumerate(bins):
      at = 0
      for seg, i in enumerate(idx, 1):
        smp = samples[i]
        p, k = len(smp.prompt_ids), len(smp.response_ids)
        span = slice(at, at + p + k)
        tokens[r, at:at + p] = smp.prompt_ids
        tokens[r, at + p:at + p + k] = smp.response_ids
        positions[r, span] = np.arange(p + k)
        segments[r, span] = seg
        mask[r, at + p:at + p + k] = 1.0
        weight[r, at + p:at + p + k] = weights[i]
        adv[r, span] = smp.advantage
        index[r, span] = i
        if recorded:
          rollout_logp[r, at + p:at + p + k] = smp.rollout_logp
        at += p + k
    out.append(MicroBatch(tokens, positions, segments, mask, weight, adv, index, rollout_logp))
  return iter(out)


def minibatches(samples: list[Sample], spec, num_minibatches: int = 1,
                seed: int = 0) -> list[list[MicroBatch]]:
  """Samples -> mini-batches (one optimizer step each) of micro-batches, laid out as
  `spec` (a learner.LearnerSpec) says.

  Mini-batches are a random partition of the samples, as in VeRL/PPO: were they cut from
  the length-sorted order instead, one step would see only short (mostly right) responses
  and the next only long (mostly wrong) ones, two full-size Adam steps in opposite
  directions. Within a mini-batch, micro-batches are packed (`micro_layout`), its loss
  aggregated as spec.gcfg.loss_agg says (`token_weights`)."""
  g = spec.gcfg
  return [list(micro_batches([samples[i] for i in part], spec.micro_batch, spec.pad_multiple,
                             spec.max_len, spec.micro_batch_tokens, spec.row_multiple,
                             g.loss_agg, g.loss_norm_len, spec.max_rows))
          for part in minibatch_parts(len(samples), num_minibatches, seed)]


def minibatch_parts(n: int, num_minibatches: int, seed: int) -> list[np.ndarray]:
  """`minibatches`' random partition of n samples (indices per mini-batch)."""
  order = np.random.default_rng([seed, 23]).permutation(n)
  return np.array_split(order, max(1, min(num_minibatches, n)))
