"""What the speculation gate measures (gate.py): a measured `Chunk`, per-row rates, one batch
bucket's record (`Bucket`), and an arm's measured ratio to plain decoding with its hardware
ceiling. Pure host-side values and functions."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tlt_jax.rollout.policies.strategy import Strategy

PROBING, PAYS, DECLINED, CLOSED = "probing", "pays", "declined", "closed"
HARDWARE, ACCEPTANCE = "hardware", "acceptance"  # why a bucket was declined


class Chunk(NamedTuple):
  """One measured chunk, the event the gate learns from (the fields of `ChunkMetrics`)."""
  bucket: int
  arm: Strategy | None  # None: plain decoding
  wall: float  # seconds, the queued work included
  steps: int  # target forwards
  accepted: int = 0  # drafts accepted over the chunk's rows
  verifications: int = 0  # (row, step) verifications
  live: int = 0  # rows decoding (0: unknown, the bucket's)
  read: float = 0.0  # bytes a plain step of the chunk reads (weights, windows; 0: unknown)
  # ran at a wider attention window than its rows need (a compiled one while theirs compiles):
  # it reads more than plain decoding at the rows' windows, so it may show that an arm pays,
  # not that none does (the 32B recipe's 120-row probe read 3.9x plain's bytes, measured 0.89x)
  wide: bool = False


STEPS_KEPT = 16  # plain chunks kept per bucket for its step time (the median of them)


class Step(NamedTuple):
  """One plain decode step as a chunk measured it: its seconds, and the bytes it read (the
  weights and every row's attention window; 0: not known)."""
  seconds: float
  read: float = 0.0


def stepped(steps_at: Mapping[int, tuple[Step, ...]], c: Chunk) -> dict[int, tuple[Step, ...]]:
  """`steps_at` with a plain chunk's step kept for its bucket (the first chunk there is a
  warm-up: not kept; at most STEPS_KEPT, the latest); a speculative chunk changes nothing."""
  if c.arm is not None:
    return dict(steps_at)
  kept = steps_at.get(c.bucket)
  kept = () if kept is None else (kept + (Step(c.wall / c.steps, c.read),))[-STEPS_KEPT:]
  return {**steps_at, c.bucket: kept}


def home(buckets: Sequence[int], c: Chunk) -> int:
  """The bucket a chunk's time belongs to: the smallest of `buckets` that holds its live
  rows (a speculating batch may run at a larger one than it needs: the compile plan's
  floor), else the chunk's own."""
  if c.live <= 0:
    return c.bucket
  return min((q for q in buckets if q >= c.live), default=c.bucket)


def step_seconds(steps_at: Mapping[int, Sequence[Step]], bucket: int) -> float | None:
  """The median seconds of a plain step measured at `bucket` (None: none measured)."""
  kept = steps_at.get(bucket)
  return statistics.median(s.seconds for s in kept) if kept else None


def row_seconds(steps_at: Mapping[int, Sequence[Step]]) -> float | None:
  """What one more row adds to a plain step's time beyond the bytes it reads: the
  coefficient b of t = a0 + a1 x bytes + b x rows, fitted to the kept steps of every bucket
  (their windows differ, which tells bytes from rows) by least squares with every
  coefficient >= 0: the best fit over the subsets of the three terms, those with the rows
  term first (where bytes and rows explain the times equally well, the explanation under
  which drafts pay least). Where decoding streams the weights (a 7B model on a GPU) the
  bytes explain the time and b ~ 0; where a forward's cost grows with its tokens (a small
  model on a CPU) b carries it. None with fewer than two buckets measured."""
  pts = [(b, s.seconds, s.read) for b, v in sorted(steps_at.items()) for s in v]
  if len({b for b, _, _ in pts}) < 2:
    return None
  t = np.array([p[1] for p in pts])
  cols = {"rows": np.array([p[0] for p in pts], float), "fixed": np.ones(len(pts)),
          "bytes": np.array([p[2] for p in pts], float)}
  best = None
  for terms in itertools.chain.from_iterable(
      itertools.combinations(cols, k) for k in (1, 2, 3)):
    x = np.stack([cols[k] for k in terms], axis=1)
    if len(pts) < len(terms) or not x.any(axis=0).all():
      continue
    fit = _nonnegative_fit(x, t)
    if fit is not None and (best is None or fit[0] < best[0] * (1 - 1e-6) - 1e-24):
      best = (fit[0], dict(zip(terms, fit[1])))
  return None if best is None else float(best[1].get("rows", 0.0))


def _nonnegative_fit(x: np.ndarray, t: np.ndarray, w: np.ndarray | None = None):
  """Least squares t ~ x @ coef (weights w; none: 1), as (squared error, coef) where every
  coefficient is >= 0, else None. Each column scaled to [0, 1] first (bytes run to 1e10)."""
  w = np.ones_like(t) if w is None else w
  sw = np.sqrt(w)
  scale = np.abs(x).max(axis=0)
  coef, *_ = np.linalg.lstsq(x / scale * sw[:, None], t * sw, rcond=None)
  coef = coef / scale
  if (coef < 0).any():
    return None
  return float((w * (x @ coef - t) ** 2).sum()), coef


def plain_bound(steps_at: Mapping[int, Sequence[Step]], bucket: int, arm: Strategy) -> float | None:
  """The best case of `arm` at `bucket` that plain decoding's measured costs allow, as
  speed-up over it: a verification of `arm.verify_tokens` tokens per row reads what a plain
  step reads (the weights, the rows' windows) and computes for that many tokens per row, so
  it costs about t + b_row x rows x (verify_tokens - 1) (`row_seconds`) and delivers at most
  depth + 1 tokens: (depth + 1) x t / that. Near depth + 1 where decoding is bound by bytes;
  near 1 where a step's cost grows with its rows (a CPU), so no probe need compile to learn
  that drafts cannot pay. None until plain steps are measured at `bucket` and one more."""
  if not arm.steps:
    return 1.0
  t, per_row = step_seconds(steps_at, bucket), row_seconds(steps_at)
  if not t or per_row is None:
    return None
  return (arm.steps + 1) * t / (t + per_row * bucket * (arm.verify_tokens - 1))


def accept_len(chunks: Sequence[Chunk]) -> float:
  """Tokens per row per step: 1 for plain chunks, tokens per verification for speculative."""
  ver = sum(c.verifications for c in chunks)
  return (sum(c.accepted for c in chunks) + ver) / ver if ver else 1.0


def rate(chunks: Sequence[Chunk]) -> float:
  """Per-row throughput: (tokens per row per step) x (steps per second)."""
  wall = sum(c.wall for c in chunks)
  return accept_len(chunks) * sum(c.steps for c in chunks) / wall if wall > 0 else 0.0


def plain_step(plain: Sequence[Chunk]) -> Callable[[float], float]:
  """Plain decoding's seconds per step as a function of the bytes a step reads, from a bucket's
  plain chunks: t = a + b x bytes (a, b >= 0; least squares weighted by steps) where their
  reads spread over 5% or more, else their mean (a chunk whose read is not known: the mean
  too); no extrapolation: a read outside theirs takes their edge's time (a fit over the
  bulk's plain chunks, carried to a speculating tail's few rows, had a chain whose
  verifications accepted 0.11 drafts each win by 1.18x at the 32B recipe's 128 rows). Where
  decoding is bound by bytes, a step late in a rollout (every row's window long) takes
  twice one just after the prefill (the 7B recipe at 128 rows: 15 GB of weights, up to 25
  GB of windows more), so plain chunks measured at one point and an arm's at another
  compare the windows, not the arm."""
  steps = sum(c.steps for c in plain)
  mean = sum(c.wall for c in plain) / steps if steps else 0.0
  pts = [(c.read, c.wall / c.steps, c.steps) for c in plain if c.read > 0 and c.steps]
  reads = [x for x, _, _ in pts]
  if len(pts) < 2 or max(reads) < 1.05 * min(reads):
    return lambda read: mean
  x, t, w = (np.array(v, float) for v in zip(*pts))
  fits = [f for f in (_nonnegative_fit(np.stack([np.ones_like(x), x], axis=1), t, w),
                      _nonnegative_fit(x[:, None], t, w)) if f is not None]
  if not fits:  # (a + b x bytes; b x bytes alone)
    return lambda read: mean
  coef = min(fits, key=lambda f: f[0])[1]
  a0, b = (float(coef[0]), float(coef[1])) if len(coef) == 2 else (0.0, float(coef[0]))
  lo, hi = min(reads), max(reads)  # (no extrapolation: a read outside theirs, their edge's)
  return lambda read: a0 + b * min(max(read, lo), hi) if read > 0 else mean


def speedup(plain: Sequence[Chunk], spec: Sequence[Chunk],
            step: Callable[[float], float] | None = None) -> float:
  """An arm's speed-up over plain decoding from its chunks `spec` and the bucket's plain
  chunks: the seconds plain decoding would have taken for the tokens per row they delivered,
  each chunk's steps at plain's step time where that chunk read (`plain_step`), over theirs.
  (Their per-row rates divided, as before 2026-12-06, compared where in a rollout each was
  measured: the 7B recipe's prober at 128 rows measured `2_1_3`, whose drafts were never
  accepted, at 1.14x of plain decoding, its chunks just after a prefill and plain's later in
  the rollouts before; at the bytes its steps read, 0.97x.) `step`: `plain_step(plain)`,
  fitted once for several arms."""
  wall = sum(c.wall for c in spec)
  if wall <= 0 or not plain:
    return 0.0
  step = step or plain_step(plain)
  return accept_len(spec) * sum(c.steps * step(c.read) for c in spec) / wall


@dataclasses.dataclass(frozen=True)
class Bucket:
  """What the gate knows about one batch bucket. Rates keep the last `window` counted chunks;
  `warm` the arms (None: plain) whose first, uncounted chunk ran here; `funded` the arms whose
  compile the payoff rule has paid for in the bucket's current status (probed arms on
  probation, the arms to compile where it pays): once funded an arm stays so until the status
  changes (its compile is sunk)."""
  status: str = CLOSED
  reason: str | None = None  # DECLINED: HARDWARE | ACCEPTANCE
  declined_at: int | None = None  # rollout of the last decline (None: never declined)
  since: int = 0  # rollout its last probation began
  seen: int = -1  # last rollout a chunk ran here
  wide: bool = False  # on probation, every drafting arm is probed (not the lead alone)
  plain: tuple[Chunk, ...] = ()  # counted plain chunks
  spec: Mapping[str, tuple[Chunk, ...]] = dataclasses.field(default_factory=dict)  # by arm
  warm: frozenset = frozenset()
  funded: frozenset = frozenset()


def measured(r: Bucket) -> dict[str, tuple[float, float]]:
  """arm -> (ratio to plain decoding, hardware ceiling) of the arms measured in `r` (counted
  chunks in its window and a plain rate to compare with). With every draft accepted an arm
  delivers depth + 1 tokens per verification: its ceiling is ratio x (depth + 1) / the
  measured tokens per verification."""
  if not r.plain or rate(r.plain) <= 0:
    return {}
  out, step = {}, plain_step(r.plain)
  for a, chunks in r.spec.items():
    if chunks:
      ratio = speedup(r.plain, chunks, step)
      out[a] = (ratio, ratio * (a.steps + 1) / accept_len(chunks))
  return out
