"""Whether speculation pays on this hardware, measured before it is paid for.

Speculative decoding wins only where a forward over k tokens costs about one token's
(decoding bound by streaming the weights: a 7B+ model on a GPU, DESIGN.md 8). Where a k-token
forward costs ~k single ones (a small model in a CPU's cache) it loses, and each (bucket, arm)
executable it needs is a compile the run pays. The bandit (mab.py) picks the best arm among
compiled ones; this gate decides which batch buckets are worth compiling arms for at all:

- It opens the smallest speculative bucket first (where drafts pay most) on one worker, the
  prober: only that worker compiles and runs its arms (each drafting arm in turn, whatever
  the bandit would pick: a probe is a measurement), while every worker's plain chunks measure
  plain decoding at the same bucket. The first chunk of each (bucket, arm) is a warm-up and
  not counted (a fresh executable's first run was 10-50x slower on CPU).
- Once that bucket has `min_chunks` plain and speculative chunks, it compares per-row
  throughput (tokens / (wall x live rows)): if the best drafting arm beats plain decoding by
  `margin`, the bucket "pays": every worker compiles it and the next bucket up is probed. Else
  it is "declined", and so is every larger bucket (a larger batch is more compute-bound; the
  drafts pay less there), and no worker compiles them.
- A declined bucket is probed again after `reprobe_every` rollouts (the prober's executables
  are compiled already, so it costs a few chunks): its acceptance may come to pay where it
  did not. While every bucket is declined, spot drafter training pauses (`drafter_wanted`).

One gate per process, shared by its workers (thread-safe); rates are per chunk from the
workers' `ChunkMetrics`. Chunks that compiled are not measured.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Sequence

PROBING, PAYS, DECLINED, CLOSED = "probing", "pays", "declined", "closed"


@dataclasses.dataclass(frozen=True)
class GateConfig:
  min_chunks: int = 4  # plain and speculative chunks at a bucket before it is decided
  margin: float = 0.05  # the best drafting arm must beat plain decoding by this share
  window: int = 64  # chunks kept per (bucket, mode) for the rates
  reprobe_every: int = 10  # rollouts after which a declined bucket is probed again (0: never)

  def __post_init__(self):
    if self.min_chunks < 1:
      raise ValueError(f"min_chunks={self.min_chunks}: must be >= 1")
    if self.margin < 0:
      raise ValueError(f"margin={self.margin}: must be >= 0")
    if self.window < self.min_chunks:
      raise ValueError(f"window={self.window}: must be >= min_chunks ({self.min_chunks})")
    if self.reprobe_every < 0:
      raise ValueError(f"reprobe_every={self.reprobe_every}: must be >= 0 (0: never)")


class _Rate:
  """Per-row throughput over the last `window` chunks: tokens / sum(wall x live)."""

  def __init__(self, window: int):
    self.chunks: collections.deque = collections.deque(maxlen=window)

  def add(self, tokens: int, wall: float, live: int) -> None:
    self.chunks.append((tokens, wall * live))

  def __len__(self) -> int:
    return len(self.chunks)

  @property
  def value(self) -> float:
    row_s = sum(c[1] for c in self.chunks)
    return sum(c[0] for c in self.chunks) / row_s if row_s > 0 else 0.0


class SpecGate:
  """See the module docstring. `buckets`: the engine buckets with speculative arms, given by
  the first worker that starts a rollout; that worker probes."""

  def __init__(self, cfg: GateConfig | None = None):
    self.cfg = cfg or GateConfig()
    self._lock = threading.Lock()
    self.buckets: list[int] = []
    self.status: dict[int, str] = {}
    self.prober: int | None = None
    self._plain: dict[int, _Rate] = {}
    self._spec: dict[tuple[int, str], _Rate] = {}
    self.rollouts = 0  # generate calls of the prober (the re-probe clock)
    self._declined_at: dict[int, int] = {}
    self._warm: set[tuple[int, str | None]] = set()  # (bucket, arm) whose first chunk ran
    self.decisions: list[dict[str, Any]] = []  # every verdict, for the metrics and the notes

  # ------------------------------------------------------------------------- worker interface
  def begin_rollout(self, worker_id: int, buckets: Sequence[int]) -> None:
    """A worker's generate call starts (`buckets`: its engine buckets with speculative arms).
    The first caller becomes the prober; the prober's calls are the re-probe clock: a
    declined bucket due a re-probe is reopened."""
    with self._lock:
      if not self.buckets and buckets:
        self.buckets = sorted(buckets)
        self.status = {b: CLOSED for b in self.buckets}
        self.status[self.buckets[0]] = PROBING
      if self.prober is None:
        self.prober = worker_id
      if worker_id != self.prober:
        return
      self.rollouts += 1
      every = self.cfg.reprobe_every
      declined = [b for b in self.buckets if self.status[b] == DECLINED]
      probing = any(s == PROBING for s in self.status.values())
      if (every and declined and not probing
          and self.rollouts - self._declined_at[declined[0]] >= every):
        b = declined[0]  # the smallest: larger ones follow if it pays
        self.status[b] = PROBING
        for key in [k for k in self._spec if k[0] == b]:
          del self._spec[key]

  def drafter_wanted(self) -> bool:
    """False while every bucket is declined: no chunk decodes with the drafter until a
    re-probe, so spot training pauses (on shared hardware, e.g. a CPU's cores, an "idle"
    worker's training slows the stragglers)."""
    with self._lock:
      return not self.status or any(s != DECLINED for s in self.status.values())

  def opened(self, worker_id: int) -> set[int]:
    """The buckets this worker may come to speculate at, so compile arms for."""
    with self._lock:
      return {b for b in self.buckets if self._allows(worker_id, b)}

  def allows(self, worker_id: int, bucket: int) -> bool:
    """Whether this worker may speculate at this bucket now. The prober speculates at a
    bucket on probation once plain decoding there is measured (`min_chunks` chunks): until
    then it decodes plainly there itself (a lone worker has no one else to measure it)."""
    with self._lock:
      if not self._allows(worker_id, bucket):
        return False
      return (self.status[bucket] == PAYS
              or len(self._plain.get(bucket, ())) >= self.cfg.min_chunks)

  def _allows(self, worker_id: int, bucket: int) -> bool:
    s = self.status.get(bucket)
    return s == PAYS or (s == PROBING and worker_id == self.prober)

  def probe_arm(self, bucket: int, arms, default: str) -> str:
    """The arm a chunk at `bucket` runs: while the bucket is probed, the drafting arm (of
    `arms`, those choosable there) measured least so far; else `default` (the bandit's)."""
    with self._lock:
      drafting = [a for a in arms if a != "off"]
      if self.status.get(bucket) != PROBING or not drafting:
        return default
      return min(drafting, key=lambda a: len(self._spec.get((bucket, a), ()))
                 + ((bucket, a) in self._warm))

  def record(self, bucket: int, arm: str | None, tokens: int, wall: float, live: int) -> None:
    """One measured chunk: arm None = plain decoding."""
    with self._lock:
      if bucket not in self.status or live < 1 or wall <= 0:
        return
      if (bucket, arm) not in self._warm:
        self._warm.add((bucket, arm))
        return
      if arm is None:
        self._plain.setdefault(bucket, _Rate(self.cfg.window)).add(tokens, wall, live)
      else:
        self._spec.setdefault((bucket, arm), _Rate(self.cfg.window)).add(tokens, wall, live)
      if self.status[bucket] == PROBING:
        self._decide(bucket)

  # ------------------------------------------------------------------------------ decisions
  def _decide(self, b: int) -> None:
    n = self.cfg.min_chunks
    plain = self._plain.get(b)
    spec = {arm: r for (bb, arm), r in self._spec.items() if bb == b}
    if plain is None or len(plain) < n or sum(len(r) for r in spec.values()) < n:
      return
    # drafting arms measured enough to judge ("off" drafts nothing: it is no evidence)
    drafting = {arm: r.value for arm, r in spec.items()
                if arm != "off" and len(r) >= max(1, n // 2)}
    best = max(drafting, key=drafting.get) if drafting else None
    ratio = drafting[best] / plain.value if best and plain.value > 0 else 0.0
    pays = ratio >= 1.0 + self.cfg.margin
    i = self.buckets.index(b)
    self.decisions.append({"bucket": b, "verdict": PAYS if pays else DECLINED,
                           "best_arm": best, "ratio": round(ratio, 3),
                           "plain_chunks": len(plain), "rollout": self.rollouts})
    if pays:
      self.status[b] = PAYS
      if i + 1 < len(self.buckets) and self.status[self.buckets[i + 1]] != PAYS:
        nxt = self.buckets[i + 1]  # closed, or declined before (a re-probe that paid)
        self.status[nxt] = PROBING
        for key in [k for k in self._spec if k[0] == nxt]:
          del self._spec[key]
    else:
      for bb in self.buckets[i:]:
        if self.status[bb] != DECLINED:
          self.status[bb] = DECLINED
          self._declined_at[bb] = self.rollouts
      self._declined_at[b] = self.rollouts

  # -------------------------------------------------------------------------- introspection
  def summary(self) -> dict[str, Any]:
    """Status per bucket and the measured per-row rates (tokens/s per live row)."""
    with self._lock:
      return {"status": {str(b): s for b, s in self.status.items()},
              "plain_rate": {str(b): round(r.value, 1) for b, r in self._plain.items()},
              "spec_rate": {f"{b}:{a}": round(r.value, 1) for (b, a), r in self._spec.items()},
              "decisions": list(self.decisions)}

  def state_dict(self) -> dict[str, Any]:
    with self._lock:
      return {"buckets": list(self.buckets), "status": {str(b): s for b, s in
                                                         self.status.items()},
              "rollouts": self.rollouts,
              "declined_at": {str(b): r for b, r in self._declined_at.items()},
              "decisions": list(self.decisions)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Verdicts survive a resume (rates are re-measured: the machine may differ). A bucket
    that was being probed is probed again from scratch."""
    with self._lock:
      self.buckets = [int(b) for b in state.get("buckets", [])]
      self.status = {int(b): s for b, s in state.get("status", {}).items()}
      self.rollouts = int(state.get("rollouts", 0))
      self._declined_at = {int(b): int(r) for b, r in state.get("declined_at", {}).items()}
      self.decisions = list(state.get("decisions", []))
