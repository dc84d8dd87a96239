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

One gate per process, shared by its workers (thread-safe); rates are per chunk from the
workers' `ChunkMetrics`. Chunks that compiled are not measured.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from typing import Any, Mapping, Sequence

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


class _Rate:
  """Per-row throughput over the last `window` chunks: (tokens per row per step) x (steps
  per second), with tokens per row per step 1 for plain chunks and the tokens per
  verification of speculative ones."""

  def __init__(self, window: int):
    self.chunks: collections.deque = collections.deque(maxlen=window)

  def add(self, wall: float, steps: int, accepted: int, verifications: int):
    self.chunks.append((wall, steps, accepted, verifications))

  def __len__(self) -> int:
    return len(self.chunks)

  @property
  def accept_len(self) -> float:
    ver = sum(c[3] for c in self.chunks)
    return (sum(c[2] for c in self.chunks) + ver) / ver if ver else 1.0

  @property
  def value(self) -> float:
    wall = sum(c[0] for c in self.chunks)
    return self.accept_len * sum(c[1] for c in self.chunks) / wall if wall > 0 else 0.0


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


class SpecGate:
  """See the module docstring. The first worker that starts a rollout gives the engine
  buckets with speculative arms (and those arms) and probes.

  The whole interface an engine uses (engine.py sequences it; compile_plan.py asks the two
  questions about compiling), each call under the gate's lock:
    begin_rollout(worker, choosable)  once per generate call (the prober's calls are the clock)
    drafter_wanted()                  whether hidden states are captured / the drafter trained
    arms(worker, bucket)              the arms to compile there now
    allows(worker, bucket)            whether a chunk may speculate there now
    probe_arm(bucket, default)        the arm a chunk runs (the probed one on probation)
    record(bucket, arm, ...)          one measured chunk (arm None: plain); may decide
  Everything else (summary, state_dict) is for the metrics and the checkpoint."""

  def __init__(self, cfg: GateConfig | None = None, verdicts: VerdictCache | None = None):
    self.cfg = cfg or GateConfig()
    self.verdicts = verdicts  # hardware verdicts of earlier runs (None: measure every run)
    self._lock = threading.Lock()
    self.buckets: list[int] = []
    self.arms_at: dict[int, list[str]] = {}  # bucket -> arms choosable there
    self.status: dict[int, str] = {}
    self.reason: dict[int, str] = {}  # declined bucket -> HARDWARE | ACCEPTANCE
    self.prober: int | None = None
    self._plain: dict[int, _Rate] = {}
    self._spec: dict[tuple[int, str], _Rate] = {}
    self.rollouts = 0  # generate calls of the prober (the gate's clock)
    self._declined_at: dict[int, int] = {}
    self._since: dict[int, int] = {}  # probing bucket -> rollout its probation began
    self._seen: dict[int, int] = {}  # bucket -> last rollout a chunk ran there
    self._wide: set[int] = set()  # probing buckets whose every drafting arm is probed
    self.hardware_ok = False  # a probe showed drafts can pay here (some arm's ceiling)
    self._warm: set[tuple[int, str | None]] = set()  # (bucket, arm) whose first chunk ran
    self.decisions: list[dict[str, Any]] = []  # every verdict and move, for the metrics

  # ------------------------------------------------------------------------- worker interface
  def begin_rollout(self, worker_id: int, choosable: Mapping[int, Sequence[str]]) -> None:
    """A worker's generate call starts (`choosable`: its engine buckets with speculative arms
    -> those arms). The first caller becomes the prober; the prober's calls are the gate's
    clock: re-probes fall due and probation follows traffic."""
    with self._lock:
      if self.prober is None:
        self.prober = worker_id
      if worker_id == self.prober:
        self.rollouts += 1
      if not self.arms_at and choosable:
        self.arms_at = {int(b): list(a) for b, a in choosable.items()}
        if not self.buckets:  # (a resume restores buckets and verdicts)
          self.buckets = sorted(self.arms_at)
          self.status = {b: CLOSED for b in self.buckets}
          self._apply_cached()
          if self.status[self.buckets[0]] == CLOSED:
            self._start_probe(self.buckets[0])
          return
      if worker_id != self.prober or not self.status:
        return
      if not any(s == PROBING for s in self.status.values()):
        self._reprobe_due()
      elif self.cfg.follow_traffic:
        self._follow_traffic()

  def drafter_wanted(self) -> bool:
    """Whether spot training should run: once a probe has shown drafts can pay on this
    hardware, and not while every bucket is declined for hardware (no chunk will decode with
    the drafter, and training it cannot change that; on shared hardware, e.g. a CPU's cores,
    an "idle" worker's training slows the stragglers)."""
    with self._lock:
      return self.hardware_ok and any(s != DECLINED or self.reason.get(b) != HARDWARE
                                      for b, s in self.status.items())

  def arms(self, worker_id: int, bucket: int) -> list[str]:
    """The arms this worker compiles at this bucket now: all choosable ones where it pays, the
    probed ones on the prober where it is on probation once half of plain decoding's
    measurement there is in (so not in a run's first rollouts, while everything else compiles
    too, and not at a bucket that sees no traffic), else none."""
    with self._lock:
      s = self.status.get(bucket)
      if s == PAYS:
        return list(self.arms_at.get(bucket, ()))
      half = (self.cfg.min_chunks + 1) // 2
      if s == PROBING and worker_id == self.prober and any(  # (or a larger one's, whose
          len(self._plain.get(q, ())) >= half for q in self.buckets  # batch compacts to it)
          if q >= bucket and self.status[q] == PROBING):
        return self._probe_arms(bucket)
      return []

  def allows(self, worker_id: int, bucket: int) -> bool:
    """Whether this worker may speculate at this bucket now. The prober speculates at a
    bucket on probation once plain decoding there is measured (`min_chunks` chunks): until
    then it decodes plainly there itself (a lone worker has no one else to measure it)."""
    with self._lock:
      s = self.status.get(bucket)
      if s == PAYS:
        return True
      return (s == PROBING and worker_id == self.prober
              and len(self._plain.get(bucket, ())) >= self.cfg.min_chunks)

  def probe_arm(self, bucket: int, default: str) -> str:
    """The arm a chunk at `bucket` runs: while the bucket is probed, the probed arm measured
    least so far; else `default` (the bandit's)."""
    with self._lock:
      probed = self._probe_arms(bucket) if self.status.get(bucket) == PROBING else []
      if not probed:
        return default
      return min(probed, key=lambda a: len(self._spec.get((bucket, a), ()))
                 + ((bucket, a) in self._warm))

  def record(self, bucket: int, arm: str | None, wall: float, steps: int, accepted: int = 0,
             verifications: int = 0) -> None:
    """One measured chunk: arm None = plain decoding; steps (target forwards), accepted and
    verifications as in `ChunkMetrics`."""
    with self._lock:
      if bucket not in self.status or steps < 1 or wall <= 0:
        return
      self._seen[bucket] = self.rollouts
      if (bucket, arm) not in self._warm:
        self._warm.add((bucket, arm))
        return
      key = bucket if arm is None else (bucket, arm)
      rates = self._plain if arm is None else self._spec
      rates.setdefault(key, _Rate(self.cfg.window)).add(wall, steps, accepted, verifications)
      if self.status[bucket] == PROBING:
        self._decide(bucket)

  # ------------------------------------------------------------------------------ decisions
  def _apply_cached(self) -> None:
    """Declines for hardware, as of now, the smallest bucket an earlier run declined so on
    this machine with these shapes, and every larger one (as that run's verdict did)."""
    if self.verdicts is None:
      return
    cached = {b: d for b, d in self.verdicts.load().items() if b in self.status}
    if not cached:
      return
    b0 = min(cached)
    self.decisions.append({**cached[b0], "bucket": b0, "verdict": DECLINED,
                           "reason": HARDWARE, "cached": True, "rollout": self.rollouts})
    self._decline_from(b0, HARDWARE)

  def _save_verdicts(self) -> None:
    if self.verdicts is None:
      return
    declined = {d["bucket"]: {k: v for k, v in d.items() if k in ("best_arm", "ratio",
                                                                  "ceiling", "accept_len")}
                for d in self.decisions if d.get("reason") == HARDWARE}
    self.verdicts.update({b: d for b, d in declined.items()
                          if self.status.get(b) == DECLINED and self.reason.get(b) == HARDWARE})

  def _probe_arms(self, b: int) -> list[str]:
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if b in self._wide or not drafting:
      return drafting
    return [self.cfg.lead if self.cfg.lead in drafting else drafting[0]]

  def _start_probe(self, b: int) -> None:
    self.status[b] = PROBING
    self.reason.pop(b, None)
    self._since[b] = self.rollouts
    self._wide.discard(b)
    for key in [k for k in self._spec if k[0] == b]:
      del self._spec[key]

  def _reprobe_due(self) -> None:
    declined = [b for b in self.buckets if self.status[b] == DECLINED]
    if not declined:
      return
    b = declined[0]  # the smallest: larger ones follow if it pays
    every = (self.cfg.hardware_reprobe_every if self.reason.get(b) == HARDWARE
             else self.cfg.reprobe_every)
    if every and self.rollouts - self._declined_at.get(b, 0) >= every:
      self._start_probe(b)

  def _follow_traffic(self) -> None:
    probing = [b for b in self.buckets if self.status[b] == PROBING]
    quiet_since = max(max(self._since[b], self._seen.get(b, -1) + 1) for b in probing)
    if self.rollouts - quiet_since < self.cfg.follow_traffic:
      return
    busy = [q for q in self.buckets if q > probing[-1] and self.status[q] == CLOSED
            and self._seen.get(q, -1) >= quiet_since]
    if busy:
      for b in self.buckets:
        if probing[-1] < b <= busy[0] and self.status[b] == CLOSED:
          self._start_probe(b)
      self.decisions.append({"bucket": busy[0], "verdict": "widened", "from": probing,
                             "rollout": self.rollouts})

  def _decide(self, b: int) -> None:
    n = self.cfg.min_chunks
    plain = self._plain.get(b)
    probed = self._probe_arms(b)
    rates = {a: self._spec.get((b, a)) for a in probed}
    if (plain is None or len(plain) < n or plain.value <= 0 or not probed
        or any(r is None or len(r) < n for r in rates.values())):
      return
    ratio = {a: r.value / plain.value for a, r in rates.items()}
    # with every draft accepted an arm delivers depth + 1 tokens per verification
    ceiling = {a: ratio[a] * (_depth(a) + 1) / rates[a].accept_len for a in probed}
    best = max(ratio, key=ratio.get)
    bar = 1.0 + self.cfg.margin
    pays = ratio[best] >= bar
    self.hardware_ok = self.hardware_ok or max(ceiling.values()) >= bar
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if not pays and b not in self._wide and len(drafting) > 1 and max(ceiling.values()) >= bar:
      self._wide.add(b)  # the drafts' acceptance, not the hardware, falls short: try them all
      return
    reason = None if pays else (HARDWARE if max(ceiling.values()) < bar else ACCEPTANCE)
    self.decisions.append({"bucket": b, "verdict": PAYS if pays else DECLINED,
                           "reason": reason, "best_arm": best, "ratio": round(ratio[best], 3),
                           "ceiling": round(max(ceiling.values()), 3),
                           "accept_len": round(rates[best].accept_len, 3),
                           "plain_chunks": len(plain), "rollout": self.rollouts})
    i = self.buckets.index(b)
    if pays:
      for bb in self.buckets[:i + 1]:  # a smaller batch pays the more
        self.status[bb] = PAYS
        self.reason.pop(bb, None)
      nxt = next((bb for bb in self.buckets[i + 1:] if self.status[bb] != PAYS), None)
      if nxt is not None and self.status[nxt] != PROBING:
        self._start_probe(nxt)  # closed, or declined before (a re-probe that paid)
      self._save_verdicts()  # (a re-probe that paid: its old verdict goes)
      return
    self._decline_from(b, reason)
    self._save_verdicts()

  def _decline_from(self, b: int, reason: str) -> None:
    """Declines `b` and every larger bucket not already declined (a larger batch is more
    compute-bound: drafts pay less there), as of this rollout."""
    for bb in self.buckets[self.buckets.index(b):]:
      if self.status[bb] != DECLINED or bb == b:
        self.status[bb] = DECLINED
        self.reason[bb] = reason
        self._declined_at[bb] = self.rollouts

  # -------------------------------------------------------------------------- introspection
  def summary(self) -> dict[str, Any]:
    """Status per bucket, why declined ones were, and the measured per-row rates (tokens/s
    per live row)."""
    with self._lock:
      return {"status": {str(b): s for b, s in self.status.items()},
              "reason": {str(b): r for b, r in self.reason.items()},
              "plain_rate": {str(b): round(r.value, 1) for b, r in self._plain.items()},
              "spec_rate": {f"{b}:{a}": round(r.value, 1) for (b, a), r in self._spec.items()},
              "decisions": list(self.decisions)}

  def state_dict(self) -> dict[str, Any]:
    with self._lock:
      return {"buckets": list(self.buckets),
              "status": {str(b): s for b, s in self.status.items()},
              "reason": {str(b): r for b, r in self.reason.items()},
              "rollouts": self.rollouts, "hardware_ok": self.hardware_ok,
              "declined_at": {str(b): r for b, r in self._declined_at.items()},
              "decisions": list(self.decisions)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Verdicts survive a resume (rates are re-measured: the machine may differ). A bucket
    that was being probed is probed again from scratch."""
    with self._lock:
      self.buckets = [int(b) for b in state.get("buckets", [])]
      self.status = {int(b): s for b, s in state.get("status", {}).items()}
      self.reason = {int(b): r for b, r in state.get("reason", {}).items()}
      self.rollouts = int(state.get("rollouts", 0))
      self.hardware_ok = bool(state.get("hardware_ok", False))
      self._declined_at = {int(b): int(r) for b, r in state.get("declined_at", {}).items()}
      self._since = {b: self.rollouts for b, s in self.status.items() if s == PROBING}
      self.decisions = list(state.get("decisions", []))
