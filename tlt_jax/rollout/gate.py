"""Whether speculation pays on this hardware, measured before it is paid for.

Speculative decoding wins only where a forward over k tokens costs about one token's
(decoding bound by streaming the weights: a 7B+ model on a GPU, DESIGN.md 8). Where a k-token
forward costs ~k single ones (a small model in a CPU's cache) it loses, and each (bucket, arm)
executable it needs is a compile the run pays. The bandit (mab.py) picks the best arm among
compiled ones; this gate decides which batch buckets are worth compiling arms for at all:

- It opens the smallest speculative bucket first (where drafts pay most) on one worker, the
  prober: only that worker compiles and runs speculative chunks there (compiling once half of
  the plain measurement is in), while every worker's plain chunks measure plain decoding at
  the same bucket. The probe runs one arm, the lead
  (the config's strategy), whatever the bandit would pick: a probe is a measurement. The first
  chunk of each (bucket, arm) is a warm-up and not counted (a fresh executable's first run was
  10-50x slower on CPU).
- Once the bucket has `min_chunks` plain chunks and as many of each probed arm, it compares
  per-row throughput: tokens per row per step (1 for plain decoding, the measured tokens per
  verification for an arm) over the time per step (target forwards in the chunks' wall
  time). Rows that finish inside a chunk do not bias it (a speculative chunk runs its rows out
  far sooner, while the bucket's cost per step stays). The work queued before a chunk runs in
  its time (asynchronous dispatch): the switch-on forward that starts speculation is charged
  to the arm that speculates after it, as a run pays it. If the best arm
  beats plain decoding by `margin`, the bucket "pays": every worker compiles all its arms, the
  bandit chooses among them, and the next bucket up is probed.
- Else the gate asks why. The measured ratio is (tokens per verification) / (cost of a
  speculative step in plain steps); with every draft accepted an arm would deliver its depth + 1
  tokens, so its *ceiling* is ratio x (depth + 1) / (measured tokens per verification). A
  ceiling under 1 + margin means no drafter can make speculation pay on this hardware at this
  bucket: the bucket is declined for "hardware", without compiling the other arms. Otherwise
  the drafts' acceptance is what falls short: the other drafting arms are probed too (a shorter
  chain may pay where the lead does not); if none pays the bucket is declined for
  "acceptance". Either way every larger bucket is declined with it (a larger batch is more
  compute-bound; drafts pay less there).
- A bucket declined for acceptance is probed again every `reprobe_every` rollouts (the drafter
  keeps training meanwhile, and its executables are compiled, so a re-probe costs a few
  chunks); one declined for hardware every `hardware_reprobe_every` (the machine's costs do not
  improve with training). Spot drafter training starts only once a probe has shown that drafts
  can pay on this hardware (a verdict whose ceiling clears the bar: the hardware question does
  not depend on the drafter, so it is asked first) and pauses while every bucket is declined
  for hardware (`drafter_wanted`). A drafter that starts untrained is thus declined for
  acceptance, trains, and is re-probed, instead of being shut out for good; a machine where
  drafts cannot pay never trains (or compiles) the drafter.
- Probation follows traffic: when the buckets on probation see no chunk for `follow_traffic`
  prober rollouts while a larger closed bucket does (short responses end before the batch
  shrinks that far), probation widens up to that bucket (those between are probed too: the
  prober's batch compacts through them). A bucket that pays makes every smaller one pay (a
  smaller batch is the more memory-bound); one declined declines every larger one.

- Hardware verdicts outlive the run (`VerdictCache`): they depend on the machine and the
  shapes, not on the drafter or the policy, so like compiled executables they are kept on disk
  (beside the persistent compilation cache), keyed by everything the measurement depends on.
  A later run of the same config on the same kind of machine starts with those buckets
  declined and probes, compiles and trains nothing for them; it re-probes them every
  `hardware_reprobe_every` rollouts as a run that measured them itself would, and a re-probe
  that pays removes the verdict.

The policy is pure transitions over one frozen record, like the Scheduler: `GateState` (a
`Bucket` record per batch bucket, and the clock, the prober, the verdicts so far) goes to a new
state on each event (`begin_rollout`, `record` of a measured `Chunk`), and every question
(`arms`, `allows`, `probe_arm`, `drafter_wanted`) is a function of a state, so a test drives
a sequence of chunks and reads the verdicts. `SpecGate` is the one gate per process, shared by
its workers' threads: it swaps the state under a lock and does the verdict cache's I/O. Rates
are per chunk from the workers' `ChunkMetrics`; chunks that compiled are not measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from typing import Any, Mapping, NamedTuple, Sequence

from tlt_jax.errors import ConfigError
from tlt_jax.rollout.strategy import Strategy

PROBING, PAYS, DECLINED, CLOSED = "probing", "pays", "declined", "closed"
HARDWARE, ACCEPTANCE = "hardware", "acceptance"  # why a bucket was declined


@dataclasses.dataclass(frozen=True)
class GateConfig:
  min_chunks: int = 4  # plain chunks at a bucket, and chunks of each probed arm, to decide
  margin: float = 0.05  # the best drafting arm must beat plain decoding by this share
  window: int = 64  # chunks kept per (bucket, mode) for the rates
  reprobe_every: int = 10  # rollouts after which a bucket declined for acceptance is re-probed
  hardware_reprobe_every: int = 40  # ... one declined for hardware (0: never, for both)
  follow_traffic: int = 3  # rollouts without traffic after which probation moves up (0: never)
  lead: str = ""  # the arm a probe runs first ("": the first drafting arm choosable there)

  def __post_init__(self):
    if self.min_chunks < 1:
      raise ConfigError("must be >= 1", "min_chunks", self.min_chunks)
    if self.margin < 0:
      raise ConfigError("must be >= 0", "margin", self.margin)
    if self.window < self.min_chunks:
      raise ConfigError(f"must be >= min_chunks ({self.min_chunks})", "window", self.window)
    for k in ("reprobe_every", "hardware_reprobe_every", "follow_traffic"):
      if getattr(self, k) < 0:
        raise ConfigError("must be >= 0 (0: never)", k, getattr(self, k))
    if self.lead:
      try:
        Strategy.parse(self.lead)
      except ValueError as e:
        raise ConfigError(str(e), "lead", self.lead) from None


class Chunk(NamedTuple):
  """One measured chunk, the event the gate learns from (the fields of `ChunkMetrics`)."""
  bucket: int
  arm: str | None  # None: plain decoding
  wall: float  # seconds, the queued work included
  steps: int  # target forwards
  accepted: int = 0  # drafts accepted over the chunk's rows
  verifications: int = 0  # (row, step) verifications


def accept_len(chunks: Sequence[Chunk]) -> float:
  """Tokens per row per step: 1 for plain chunks, tokens per verification for speculative."""
  ver = sum(c.verifications for c in chunks)
  return (sum(c.accepted for c in chunks) + ver) / ver if ver else 1.0


def rate(chunks: Sequence[Chunk]) -> float:
  """Per-row throughput: (tokens per row per step) x (steps per second)."""
  wall = sum(c.wall for c in chunks)
  return accept_len(chunks) * sum(c.steps for c in chunks) / wall if wall > 0 else 0.0


def _depth(arm: str) -> int:
  return Strategy.parse(arm).steps


_log = logging.getLogger(__name__)


class VerdictCache:
  """Hardware verdicts kept across runs: one JSON file, one entry per `fingerprint` (a dict
  of everything a verdict depends on: device kind, JAX version, model and drafter shapes,
  dtype, cache length, chunk, sampling; the caller builds it), each entry bucket -> the
  decision that declined it for hardware. Only hardware verdicts are kept: whether the drafts
  are accepted depends on the drafter and the policy, which move during a run.

  Reads and writes never fail a run: an unreadable file is a cache miss (logged), a write
  goes to a temporary file renamed over the old one (processes that write at once leave one
  of their files whole)."""

  def __init__(self, path: str, fingerprint: Mapping[str, Any]):
    self.path = os.path.expanduser(path)
    self.fingerprint = dict(fingerprint)
    blob = json.dumps(self.fingerprint, sort_keys=True, default=str)
    self.key = hashlib.sha256(blob.encode()).hexdigest()[:24]

  def _read(self) -> dict[str, Any]:
    try:
      with open(self.path) as f:
        data = json.load(f)
      return data if isinstance(data, dict) else {}
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:
      _log.warning("speculation gate: ignoring the verdict cache %s (%s)", self.path, e)
      return {}

  def load(self) -> dict[int, dict[str, Any]]:
    """bucket -> the cached hardware decision, for this fingerprint."""
    entry = self._read().get(self.key, {})
    try:
      return {int(b): dict(d) for b, d in entry.get("declined", {}).items()}
    except (AttributeError, TypeError, ValueError):
      return {}

  def update(self, declined: Mapping[int, Mapping[str, Any]]) -> None:
    """Replaces this fingerprint's verdicts with `declined` (bucket -> decision)."""
    data = self._read()
    if declined:
      data[self.key] = {"fingerprint": self.fingerprint,
                        "declined": {str(b): dict(d) for b, d in declined.items()}}
    elif data.pop(self.key, None) is None:
      return
    try:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
      os.replace(tmp, self.path)
    except OSError as e:
      _log.warning("speculation gate: could not write the verdict cache %s (%s)", self.path, e)


@dataclasses.dataclass(frozen=True)
class Bucket:
  """What the gate knows about one batch bucket. Rates keep the last `window` counted chunks;
  `warm` the arms (None: plain) whose first, uncounted chunk ran here."""
  status: str = CLOSED
  reason: str | None = None  # DECLINED: HARDWARE | ACCEPTANCE
  declined_at: int | None = None  # rollout of the last decline (None: never declined)
  since: int = 0  # rollout its last probation began
  seen: int = -1  # last rollout a chunk ran here
  wide: bool = False  # on probation, every drafting arm is probed (not the lead alone)
  plain: tuple[Chunk, ...] = ()  # counted plain chunks
  spec: Mapping[str, tuple[Chunk, ...]] = dataclasses.field(default_factory=dict)  # by arm
  warm: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class GateState:
  """The gate's whole decision state; every transition returns a new one (the caller's stays
  as it was), and every question is a function of it. Host-side Python: no JAX.

  Transitions: `begin_rollout` (a worker's generate call: the prober's calls are the clock)
  and `record` (one measured chunk: may decide). Questions: `arms`, `allows`, `probe_arm`,
  `drafter_wanted`. `hardware_verdicts` is what the verdict cache keeps."""
  cfg: GateConfig
  buckets: tuple[int, ...] = ()
  at: Mapping[int, Bucket] = dataclasses.field(default_factory=dict)  # bucket -> its record
  arms_at: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # choosable
  prober: int | None = None  # the worker that probes (the first to start a rollout)
  rollouts: int = 0  # generate calls of the prober (the gate's clock)
  hardware_ok: bool = False  # a probe showed drafts can pay here (some arm's ceiling)
  decisions: tuple[dict[str, Any], ...] = ()  # every verdict and move, for the metrics

  @property
  def status(self) -> dict[int, str]:
    return {b: r.status for b, r in self.at.items()}

  @property
  def reason(self) -> dict[int, str]:
    return {b: r.reason for b, r in self.at.items() if r.reason is not None}

  # ---------------------------------------------------------------------------- transitions
  def begin_rollout(self, worker_id: int, choosable: Mapping[int, Sequence[str]],
                    cached: Mapping[int, Mapping[str, Any]] | None = None) -> GateState:
    """A worker's generate call starts (`choosable`: its engine buckets with speculative arms
    -> those arms). The first caller becomes the prober; on the first call with buckets,
    `cached` (bucket -> a hardware decision of an earlier run, `VerdictCache.load`) declines
    them as of now, and the smallest bucket left closed is probed."""
    s = self
    if s.prober is None:
      s = dataclasses.replace(s, prober=worker_id)
    if worker_id == s.prober:
      s = dataclasses.replace(s, rollouts=s.rollouts + 1)
    if not s.arms_at and choosable:
      s = dataclasses.replace(s, arms_at={int(b): tuple(a) for b, a in choosable.items()})
      if not s.buckets:  # (a resume restores buckets and verdicts)
        buckets = tuple(sorted(s.arms_at))
        s = dataclasses.replace(s, buckets=buckets, at={b: Bucket() for b in buckets})
        s = s._apply_cached(cached or {})
        return s._start_probe(buckets[0]) if s.at[buckets[0]].status == CLOSED else s
    if worker_id != s.prober or not s.buckets:
      return s
    if not any(r.status == PROBING for r in s.at.values()):
      return s._reprobe_due()
    return s._follow_traffic() if s.cfg.follow_traffic else s

  def record(self, c: Chunk) -> GateState:
    """One measured chunk. The first of each (bucket, arm) is a warm-up, not counted."""
    r = self.at.get(c.bucket)
    if r is None or c.steps < 1 or c.wall <= 0:
      return self
    r = dataclasses.replace(r, seen=self.rollouts)
    if c.arm not in r.warm:
      return self._put(c.bucket, dataclasses.replace(r, warm=r.warm | {c.arm}))
    w = self.cfg.window
    if c.arm is None:
      r = dataclasses.replace(r, plain=(r.plain + (c,))[-w:])
    else:
      r = dataclasses.replace(r, spec={**r.spec, c.arm: (r.spec.get(c.arm, ()) + (c,))[-w:]})
    s = self._put(c.bucket, r)
    return s._decide(c.bucket) if r.status == PROBING else s

  # ------------------------------------------------------------------------------ questions
  def drafter_wanted(self) -> bool:
    """Whether spot training should run: once a probe has shown drafts can pay on this
    hardware, and not while every bucket is declined for hardware (no chunk will decode with
    the drafter, and training it cannot change that; on shared hardware, e.g. a CPU's cores,
    an "idle" worker's training slows the stragglers)."""
    return self.hardware_ok and any(r.status != DECLINED or r.reason != HARDWARE
                                    for r in self.at.values())

  def arms(self, worker_id: int, bucket: int) -> list[str]:
    """The arms this worker compiles at this bucket now: all choosable ones where it pays, the
    probed ones on the prober where it is on probation once half of plain decoding's
    measurement there is in (so not in a run's first rollouts, while everything else compiles
    too, and not at a bucket that sees no traffic), else none."""
    r = self.at.get(bucket)
    if r is None:
      return []
    if r.status == PAYS:
      return list(self.arms_at.get(bucket, ()))
    half = (self.cfg.min_chunks + 1) // 2
    if r.status == PROBING and worker_id == self.prober and any(  # (or a larger one's, whose
        len(self.at[q].plain) >= half for q in self.buckets  # batch compacts to it)
        if q >= bucket and self.at[q].status == PROBING):
      return self._probe_arms(bucket)
    return []

  def allows(self, worker_id: int, bucket: int) -> bool:
    """Whether this worker may speculate at this bucket now. The prober speculates at a
    bucket on probation once plain decoding there is measured (`min_chunks` chunks): until
    then it decodes plainly there itself (a lone worker has no one else to measure it)."""
    r = self.at.get(bucket)
    if r is None:
      return False
    return r.status == PAYS or (r.status == PROBING and worker_id == self.prober
                                and len(r.plain) >= self.cfg.min_chunks)

  def probe_arm(self, bucket: int, default: str) -> str:
    """The arm a chunk at `bucket` runs: while the bucket is probed, the probed arm measured
    least so far; else `default` (the bandit's)."""
    r = self.at.get(bucket)
    probed = self._probe_arms(bucket) if r is not None and r.status == PROBING else []
    if not probed:
      return default
    return min(probed, key=lambda a: len(r.spec.get(a, ())) + (a in r.warm))

  def hardware_verdicts(self) -> dict[int, dict[str, Any]]:
    """Bucket -> the decision that declined it for hardware, for those declined so now."""
    last = {d["bucket"]: {k: v for k, v in d.items()
                          if k in ("best_arm", "ratio", "ceiling", "accept_len")}
            for d in self.decisions if d.get("reason") == HARDWARE}
    return {b: d for b, d in last.items()
            if b in self.at and self.at[b].status == DECLINED and self.at[b].reason == HARDWARE}

  # -------------------------------------------------------------------------------- helpers
  def _put(self, b: int, r: Bucket) -> GateState:
    return dataclasses.replace(self, at={**self.at, b: r})

  def _log(self, decision: dict[str, Any]) -> GateState:
    return dataclasses.replace(self, decisions=self.decisions + (decision,))

  def _probe_arms(self, b: int) -> list[str]:
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if self.at[b].wide or not drafting:
      return drafting
    return [self.cfg.lead if self.cfg.lead in drafting else drafting[0]]

  def _apply_cached(self, cached: Mapping[int, Mapping[str, Any]]) -> GateState:
    """Declines for hardware, as of now, the smallest bucket an earlier run declined so on
    this machine with these shapes, and every larger one (as that run's verdict did)."""
    cached = {b: d for b, d in cached.items() if b in self.at}
    if not cached:
      return self
    b0 = min(cached)
    return self._log({**cached[b0], "bucket": b0, "verdict": DECLINED, "reason": HARDWARE,
                      "cached": True, "rollout": self.rollouts})._decline_from(b0, HARDWARE)

  def _start_probe(self, b: int) -> GateState:
    return self._put(b, dataclasses.replace(self.at[b], status=PROBING, reason=None,
                                            since=self.rollouts, wide=False, spec={}))

  def _reprobe_due(self) -> GateState:
    declined = [b for b in self.buckets if self.at[b].status == DECLINED]
    if not declined:
      return self
    r = self.at[declined[0]]  # the smallest: larger ones follow if it pays
    every = (self.cfg.hardware_reprobe_every if r.reason == HARDWARE
             else self.cfg.reprobe_every)
    if every and self.rollouts - (r.declined_at or 0) >= every:
      return self._start_probe(declined[0])
    return self

  def _follow_traffic(self) -> GateState:
    probing = [b for b in self.buckets if self.at[b].status == PROBING]
    quiet_since = max(max(self.at[b].since, self.at[b].seen + 1) for b in probing)
    if self.rollouts - quiet_since < self.cfg.follow_traffic:
      return self
    busy = [q for q in self.buckets if q > probing[-1] and self.at[q].status == CLOSED
            and self.at[q].seen >= quiet_since]
    if not busy:
      return self
    s = self
    for b in self.buckets:
      if probing[-1] < b <= busy[0] and s.at[b].status == CLOSED:
        s = s._start_probe(b)
    return s._log({"bucket": busy[0], "verdict": "widened", "from": probing,
                   "rollout": self.rollouts})

  def _decide(self, b: int) -> GateState:
    n, r = self.cfg.min_chunks, self.at[b]
    probed = self._probe_arms(b)
    spec = {a: r.spec.get(a, ()) for a in probed}
    if len(r.plain) < n or not probed or any(len(c) < n for c in spec.values()):
      return self
    plain = rate(r.plain)
    if plain <= 0:
      return self
    ratio = {a: rate(c) / plain for a, c in spec.items()}
    # with every draft accepted an arm delivers depth + 1 tokens per verification
    ceiling = max(ratio[a] * (_depth(a) + 1) / accept_len(spec[a]) for a in probed)
    best = max(ratio, key=ratio.get)
    bar = 1.0 + self.cfg.margin
    pays = ratio[best] >= bar
    s = dataclasses.replace(self, hardware_ok=self.hardware_ok or ceiling >= bar)
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if not pays and not r.wide and len(drafting) > 1 and ceiling >= bar:
      # the drafts' acceptance, not the hardware, falls short: try them all
      return s._put(b, dataclasses.replace(r, wide=True))
    reason = None if pays else (HARDWARE if ceiling < bar else ACCEPTANCE)
    s = s._log({"bucket": b, "verdict": PAYS if pays else DECLINED, "reason": reason,
                "best_arm": best, "ratio": round(ratio[best], 3), "ceiling": round(ceiling, 3),
                "accept_len": round(accept_len(spec[best]), 3), "plain_chunks": len(r.plain),
                "rollout": self.rollouts})
    if not pays:
      return s._decline_from(b, reason)
    i = self.buckets.index(b)
    at = dict(s.at)
    for bb in self.buckets[:i + 1]:  # a smaller batch pays the more
      at[bb] = dataclasses.replace(at[bb], status=PAYS, reason=None)
    s = dataclasses.replace(s, at=at)
    nxt = next((bb for bb in self.buckets[i + 1:] if at[bb].status != PAYS), None)
    if nxt is not None and at[nxt].status != PROBING:
      s = s._start_probe(nxt)  # closed, or declined before (a re-probe that paid)
    return s

  def _decline_from(self, b: int, reason: str) -> GateState:
    """Declines `b` and every larger bucket not already declined (a larger batch is more
    compute-bound: drafts pay less there), as of this rollout."""
    at = dict(self.at)
    for bb in self.buckets[self.buckets.index(b):]:
      if at[bb].status != DECLINED or bb == b:
        at[bb] = dataclasses.replace(at[bb], status=DECLINED, reason=reason,
                                     declined_at=self.rollouts)
    return dataclasses.replace(self, at=at)

  # ------------------------------------------------------------------ metrics and checkpoint
  def summary(self) -> dict[str, Any]:
    """Status per bucket, why declined ones were, and the measured per-row rates (tokens/s
    per live row)."""
    return {"status": {str(b): s for b, s in self.status.items()},
            "reason": {str(b): s for b, s in self.reason.items()},
            "plain_rate": {str(b): round(rate(r.plain), 1) for b, r in self.at.items()
                           if r.plain},
            "spec_rate": {f"{b}:{a}": round(rate(c), 1) for b, r in self.at.items()
                          for a, c in r.spec.items() if c},
            "decisions": list(self.decisions)}

  def state_dict(self) -> dict[str, Any]:
    return {"buckets": list(self.buckets),
            "status": {str(b): s for b, s in self.status.items()},
            "reason": {str(b): s for b, s in self.reason.items()},
            "rollouts": self.rollouts, "hardware_ok": self.hardware_ok,
            "declined_at": {str(b): r.declined_at for b, r in self.at.items()
                            if r.declined_at is not None},
            "decisions": list(self.decisions)}

  @classmethod
  def restore(cls, cfg: GateConfig, state: Mapping[str, Any]) -> GateState:
    """Verdicts survive a resume (rates are re-measured: the machine may differ; the first
    caller after it probes). A bucket that was being probed is probed again from scratch."""
    rollouts = int(state.get("rollouts", 0))
    reason = {int(b): r for b, r in state.get("reason", {}).items()}
    declined_at = {int(b): int(r) for b, r in state.get("declined_at", {}).items()}
    status = {int(b): s for b, s in state.get("status", {}).items()}
    at = {b: Bucket(status=s, reason=reason.get(b), declined_at=declined_at.get(b),
                    since=rollouts if s == PROBING else 0) for b, s in status.items()}
    return cls(cfg, buckets=tuple(int(b) for b in state.get("buckets", [])), at=at,
               rollouts=rollouts, hardware_ok=bool(state.get("hardware_ok", False)),
               decisions=tuple(state.get("decisions", [])))


class SpecGate:
  """The one gate of a process, shared by its workers' threads: holds a `GateState` and
  swaps it for the next under a lock; the policy is all in GateState. The whole interface an
  engine uses (engine.py sequences it; compile_plan.py asks the two questions about
  compiling):
    begin_rollout(worker, choosable)  once per generate call (the prober's calls are the clock)
    drafter_wanted()                  whether hidden states are captured / the drafter trained
    arms(worker, bucket)              the arms to compile there now
    allows(worker, bucket)            whether a chunk may speculate there now
    probe_arm(bucket, default)        the arm a chunk runs (the probed one on probation)
    record(bucket, arm, ...)          one measured chunk (arm None: plain); may decide
  Questions read one state (a reference read: no lock; a state never changes). The holder
  owns the I/O the pure state cannot do: loading cached hardware verdicts on the first
  rollout with buckets, and writing them after every verdict."""

  def __init__(self, cfg: GateConfig | None = None, verdicts: VerdictCache | None = None):
    self.state = GateState(cfg or GateConfig())
    self.verdicts = verdicts  # hardware verdicts of earlier runs (None: measure every run)
    self._lock = threading.Lock()

  def begin_rollout(self, worker_id: int, choosable: Mapping[int, Sequence[str]]) -> None:
    with self._lock:
      cached = (self.verdicts.load() if self.verdicts is not None and choosable
                and not self.state.buckets else None)
      self.state = self.state.begin_rollout(worker_id, choosable, cached)

  def record(self, bucket: int, arm: str | None, wall: float, steps: int, accepted: int = 0,
             verifications: int = 0) -> None:
    """steps (target forwards), accepted and verifications as in `ChunkMetrics`."""
    with self._lock:
      old = self.state
      self.state = old.record(Chunk(bucket, arm, wall, steps, accepted, verifications))
      if self.verdicts is not None and len(self.state.decisions) > len(old.decisions):
        self.verdicts.update(self.state.hardware_verdicts())  # (a re-probe that paid: gone)

  def drafter_wanted(self) -> bool:
    return self.state.drafter_wanted()

  def arms(self, worker_id: int, bucket: int) -> list[str]:
    return self.state.arms(worker_id, bucket)

  def allows(self, worker_id: int, bucket: int) -> bool:
    return self.state.allows(worker_id, bucket)

  def probe_arm(self, bucket: int, default: str) -> str:
    return self.state.probe_arm(bucket, default)

  def summary(self) -> dict[str, Any]:
    return self.state.summary()

  def state_dict(self) -> dict[str, Any]:
    return self.state.state_dict()

  def load_state_dict(self, state: dict[str, Any]) -> None:
    with self._lock:
      self.state = GateState.restore(self.state.cfg, state)
