"""Whether speculation pays on this hardware, measured before it is paid for.

Speculative decoding wins only where a forward over k tokens costs about one token's (decoding bound
by streaming the weights: a 7B+ model on a GPU, docs/engine.md: where speculation can pay). Where a
k-token forward costs ~k single ones (a small model in a CPU's cache) it loses, and each (bucket,
arm) executable it needs is a compile the run pays. The bandit (mab.py) picks the best arm among
compiled ones; this gate decides which batch buckets are worth compiling arms for at all:

- It probes one bucket at a time (where: below) on one worker, the prober, which compiles
  (once half of the plain measurement is in) and runs speculative chunks there (once an
  eighth of the bucket's rows have finished: placement.defers) while every worker's plain
  chunks measure plain decoding. A probe runs the lead arm (the config's strategy),
  whatever the bandit would pick. The first chunk of each (bucket, arm) is a warm-up, not
  counted (a fresh executable's first run was 10-50x slower on CPU).
- Once the bucket has `min_chunks` plain chunks and as many of each probed arm, it compares
  per-row throughput: tokens per row per step (1 for plain decoding, the measured tokens per
  verification for an arm) over the time per step (rows that finish inside a chunk do not
  bias it). If the best arm beats plain decoding by `margin`, the bucket "pays": every
  worker compiles all its arms, the bandit chooses among them, and probation moves up.
  Chunks at a wider attention window than their rows need may show that an arm pays, not
  that none does (`probe.Chunk.wide`).
- Else the gate asks why. The measured ratio is (tokens per verification) / (cost of a
  speculative step in plain steps); with every draft accepted an arm would deliver its depth + 1
  tokens, so its *ceiling* is ratio x (depth + 1) / (measured tokens per verification). A
  ceiling under 1 + margin means no drafter can make speculation pay on this hardware at this
  bucket: the bucket is declined for "hardware", without compiling the other arms. Otherwise
  the drafts' acceptance is what falls short: the other drafting arms are probed too (a shorter
  chain may pay where the lead does not), the measured lead giving way to plain decoding
  while they compile (placement.gives_way); if none pays the bucket is declined for
  "acceptance". Either way every larger bucket is declined with it (a larger batch is more
  compute-bound; drafts pay less there).
- A bucket declined for acceptance is re-probed every `reprobe_every` rollouts (the drafter
  trains meanwhile), one declined for hardware every `hardware_reprobe_every`. The drafter
  trains once a probe's ceiling shows drafts can pay here, and pauses while every bucket is
  declined for hardware (`drafter_wanted`): a machine where they cannot never trains it.
- Probation goes where the time is (placement.py): to the closed bucket whose probe could
  earn the most, its seconds per rollout x best-case saving (1 - 1/ceiling) plus the same of
  every smaller bucket not paying (a bucket that pays opens them), the ceiling measured where
  a probe ran, else bounded by plain decoding's measured step times (probe.plain_bound: ~1 where a
  forward's cost grows with its tokens, as on a CPU, so nothing is probed there). The first
  probe is at the smallest bucket (nothing is measured yet); a stale probation moves. A
  bucket that pays makes every smaller one pay (a smaller batch is the more memory-bound)
  and the larger one worth the most is probed (`next_probe`; a declined one only once its
  re-probe is due); one declined declines every larger one. A speculating batch compacts
  only to buckets whose arms are funded and compiled (compile_plan.py), or switches off to
  compact where plain decoding at its rows' bucket beats it (`placement.leaves`).
- Hardware verdicts outlive the run (`VerdictCache`, on disk beside the persistent
  compilation cache, keyed by the machine and the shapes they depend on): a later run starts
  with those buckets declined, re-probes them every `hardware_reprobe_every` rollouts, and a
  re-probe that pays removes the verdict.
- Nothing is compiled that cannot repay its compile (payoff.py): probes, the arms a paying
  bucket compiles and each narrower attention window are "funded" only when their best case
  (the time at the bucket per rollout x the rollouts left x `payback` x the share an arm
  could save at best) repays their compiles as measured; asked again every prober rollout.
  A probation whose probe is not funded is "unfunded" (this CPU's default run, the whole
  run: nothing speculative compiles, no call is tracked, no drafter trains).

The policy is pure transitions over one frozen record, like the Scheduler: `GateState` (a
`Bucket` record per batch bucket, and the clock, the prober, the verdicts so far, the payoff
ledger) goes to a new state on each event (`begin_rollout`, `record` of a measured `Chunk`,
`compiled`), and every question (`arms`, `allows`, `probe_arm`, `drafter_wanted`,
`may_speculate`, funding.py's `repays_window`) is a function of a state: a test drives chunks
and reads the verdicts. What is measured (chunks, rates, ratios, ceilings) is probe.py's; what
is funded, funding.py's; where and when a probe runs, placement.py's. A rollout's workers
share the state in a `SpecGate` (cells.py). Chunks that compiled are not measured."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from tlt_jax.errors import ConfigError
from tlt_jax.rollout.policies import funding, payoff, placement
from tlt_jax.rollout.policies.probe import (ACCEPTANCE, CLOSED, DECLINED, HARDWARE, PAYS,
                                            PROBING, Bucket, Chunk, Step, accept_len, home,
                                            plain_step, rate, speedup, stepped)
from tlt_jax.rollout.policies.strategy import Strategy



@dataclasses.dataclass(frozen=True)
class GateConfig:
  min_chunks: int = 4  # plain chunks at a bucket, and chunks of each probed arm, to decide
  margin: float = 0.05  # the best drafting arm must beat plain decoding by this share
  window: int = 64  # chunks kept per (bucket, mode) for the rates
  reprobe_every: int = 10  # rollouts after which a bucket declined for acceptance is re-probed
  hardware_reprobe_every: int = 40  # ... one declined for hardware (0: never, for both)
  # rollouts without a chunk at the bucket on probation after which probation moves to where
  # the time is (0: only an unfunded probation moves)
  follow_traffic: int = 3
  lead: Strategy | str = ""  # the arm a probe runs first ("": the first drafting arm there)
  # What a compile must repay (payoff.py): the run's rollouts per worker (0: open-ended, every
  # compile repays), the share of the rollouts left within which the best case must repay it,
  # and a speculative arm's compile in plain decode chunk compiles until one is measured.
  horizon: int = 0
  payback: float = 0.5
  compile_factor: float = 3.0
  # False: no probing, speculation at every bucket with every arm from the first rollout (the
  # drafter wanted throughout); compiles are still priced: narrower attention windows only
  # where they repay (config tlt.spec.gate.enabled=False)
  gating: bool = True

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
    if self.horizon < 0:
      raise ConfigError("must be >= 0 (0: open-ended)", "horizon", self.horizon)
    if not 0 < self.payback <= 1:
      raise ConfigError("must be in (0, 1]", "payback", self.payback)
    if not self.compile_factor > 0:
      raise ConfigError("must be > 0", "compile_factor", self.compile_factor)
    if self.lead:
      try:
        object.__setattr__(self, "lead", Strategy(self.lead))
      except ValueError as e:
        raise ConfigError(str(e), "lead", self.lead) from None


@dataclasses.dataclass(frozen=True)
class GateState:
  """The gate's whole decision state; every transition returns a new one (the caller's stays
  as it was), and every question is a function of it. Host-side Python: no JAX.

  Transitions: `begin_rollout` (a worker's generate call: the prober's calls are the clock),
  `record` (one measured chunk: may decide) and `compiled` (an executable's compile time, for
  the payoff rule's prices). Questions: `arms`, `allows`, `probe_arm`, `drafter_wanted`,
  `may_speculate`.
  `hardware_verdicts` and `ledger.costs()` are what the verdict cache keeps."""
  cfg: GateConfig
  buckets: tuple[int, ...] = ()
  at: Mapping[int, Bucket] = dataclasses.field(default_factory=dict)  # bucket -> its record
  arms_at: Mapping[int, tuple[Strategy, ...]] = dataclasses.field(default_factory=dict)  # choosable
  prober: int | None = None  # the worker that probes (the first to start a rollout)
  rollouts: int = 0  # generate calls of the prober (the gate's clock)
  hardware_ok: bool = False  # a probe showed drafts can pay here (some arm's ceiling)
  # engine bucket -> the steps of its recent plain chunks (every bucket, the first chunk not
  # counted): the plain-decoding bound on what drafts can pay (probe.plain_bound)
  steps_at: Mapping[int, tuple[Step, ...]] = dataclasses.field(default_factory=dict)
  decisions: tuple[dict[str, Any], ...] = ()  # every verdict and move, for the metrics
  ledger: payoff.Ledger = payoff.Ledger()  # time per bucket and compile costs measured

  @property
  def status(self) -> dict[int, str]:
    return {b: r.status for b, r in self.at.items()}

  @property
  def reason(self) -> dict[int, str]:
    return {b: r.reason for b, r in self.at.items() if r.reason is not None}

  # ---------------------------------------------------------------------------- transitions
  def begin_rollout(self, worker_id: int, choosable: Mapping[int, Sequence[str]],
                    cached: Mapping[int, Mapping[str, Any]] | None = None,
                    costs: Mapping[str, Any] | None = None) -> GateState:
    """A worker's generate call starts (`choosable`: its engine buckets with speculative arms
    -> those arms). The first caller becomes the prober; on the first call with buckets,
    `cached` (bucket -> a hardware decision of an earlier run, `VerdictCache.load`) declines
    them as of now, `costs` (`VerdictCache.load_costs`) price compiles as that run measured
    them, and the smallest bucket left closed is probed. Then the payoff rule is asked again
    for every bucket (the clock moved)."""
    s = dataclasses.replace(self, ledger=self.ledger.called())
    if s.prober is None:
      s = dataclasses.replace(s, prober=worker_id)
    if worker_id == s.prober:
      s = dataclasses.replace(s, rollouts=s.rollouts + 1)
    if not s.arms_at and choosable:
      s = dataclasses.replace(s, arms_at={int(b): tuple(map(Strategy, a))  # (names too)
                                          for b, a in choosable.items()},
                              ledger=s.ledger.remembered(costs or {}))
      if not s.cfg.gating:  # open everywhere, every arm (a resume's statuses too)
        buckets = tuple(sorted(s.arms_at))
        return dataclasses.replace(s, buckets=buckets, hardware_ok=True, at={
            b: Bucket(status=PAYS, funded=frozenset(s.arms_at[b])) for b in buckets})
      if not s.buckets:  # (a resume restores buckets and verdicts)
        buckets = tuple(sorted(s.arms_at))
        s = dataclasses.replace(s, buckets=buckets, at={b: Bucket() for b in buckets})
        s = s._apply_cached(cached or {})
        if s.at[buckets[0]].status == CLOSED:
          s = s.start_probe(buckets[0])
      return s._fund()  # (a resumed probation too, before follow_time finds it unfunded)
    if not s.cfg.gating:
      return s
    if worker_id != s.prober or not s.buckets:
      return s._fund()
    if not any(r.status == PROBING for r in s.at.values()):
      s = s._reprobe_due()
    return placement.follow_time(s)._fund()

  def record(self, c: Chunk) -> GateState:
    """One measured chunk. The first of each (bucket, arm) is a warm-up, not counted."""
    if c.arm is not None:
      c = c._replace(arm=Strategy(c.arm))  # (a name from a test or a simulator: parsed here)
    if c.steps < 1 or c.wall <= 0:
      return self
    s = dataclasses.replace(self, steps_at=stepped(self.steps_at, c))  # plain: its bucket's steps
    r = s.at.get(c.bucket)
    if r is None:
      return s
    r = dataclasses.replace(r, seen=s.rollouts)
    if c.arm not in r.warm:
      return s.put(c.bucket, dataclasses.replace(r, warm=r.warm | {c.arm}))
    w = s.cfg.window
    if c.arm is None:
      r = dataclasses.replace(r, plain=(r.plain + (c,))[-w:])
    else:
      r = dataclasses.replace(r, spec={**r.spec, c.arm: (r.spec.get(c.arm, ()) + (c,))[-w:]})
    s = dataclasses.replace(s.put(c.bucket, r), ledger=s.ledger.decoded(home(s.buckets, c), c.wall))
    return s._decide(c.bucket)._fund() if r.status == PROBING else s

  def compiled(self, kind: str, bucket: int, arm: Strategy | None, seconds: float) -> GateState:
    """An executable compiled (payoff.Ledger.compiled's kinds)."""
    return dataclasses.replace(self, ledger=self.ledger.compiled(kind, bucket, arm, seconds))

  # ------------------------------------------------------------------------------ questions
  def drafter_wanted(self) -> bool:
    """Whether spot training should run: once a probe has shown drafts can pay on this
    hardware, and not while every bucket is declined for hardware (no chunk will decode with
    the drafter, and training it cannot change that; on shared hardware, e.g. a CPU's cores,
    an "idle" worker's training slows the stragglers). Without gating: always."""
    if not self.cfg.gating:
      return True
    return self.hardware_ok and any(r.status != DECLINED or r.reason != HARDWARE
                                    for r in self.at.values())

  def may_speculate(self) -> bool:
    """Whether a call starting now may speculate (so keeps the drafter's cache current,
    engine.py): a bucket pays with funded arms, or a probe is funded (on every worker: one
    that pays mid-call opens its bucket to all). Without gating: always."""
    if not self.cfg.gating:
      return True
    return any((r.status == PAYS and r.funded) or (r.status == PROBING and self.probe_arms(b))
               for b, r in self.at.items())

  def arms(self, worker_id: int, bucket: int) -> list[Strategy]:
    """The arms this worker compiles at this bucket now: the funded ones where it pays, the
    funded probed ones on the prober where it is on probation once half of plain decoding's
    measurement there is in (so not in a run's first rollouts, while everything else compiles
    too, and not at a bucket that sees no traffic), else none."""
    if not self.cfg.gating:
      return list(self.arms_at.get(bucket, ()))
    r = self.at.get(bucket)
    if r is None:
      return []
    if r.status == PAYS:
      return [a for a in self.arms_at.get(bucket, ()) if a in r.funded]
    half = (self.cfg.min_chunks + 1) // 2
    if r.status == PROBING and worker_id == self.prober and any(  # (or a larger one's, whose
        len(self.at[q].plain) >= half for q in self.buckets  # batch compacts to it)
        if q >= bucket and self.at[q].status == PROBING):
      return self.probe_arms(bucket)
    return placement.below_probe(self, worker_id, bucket)

  def allows(self, worker_id: int, bucket: int) -> bool:
    """Whether this worker may speculate at this bucket now: where it pays and some arm is
    funded; on the prober at a bucket on probation once plain decoding there is measured
    (`min_chunks` chunks: until then it decodes plainly there itself, a lone worker has no one
    else to measure it) and its probe is funded, and at the closed buckets under it
    (placement.below_probe)."""
    if not self.cfg.gating:  # (evaluation may come before any training rollout)
      return True
    r = self.at.get(bucket)
    if r is None:
      return False
    if r.status == PAYS:
      return bool(r.funded)
    if r.status == CLOSED:
      return bool(placement.below_probe(self, worker_id, bucket))
    return (r.status == PROBING and worker_id == self.prober
            and len(r.plain) >= self.cfg.min_chunks and bool(self.probe_arms(bucket)))

  def probe_arm(self, bucket: int, default: Strategy, among=None) -> Strategy:
    """The arm a chunk at `bucket` runs: while the bucket is probed, the funded probed arm
    (of those `among`, where given: the compiled ones) measured least so far; else
    `default` (the bandit's)."""
    r = self.at.get(bucket)
    probed = self.probe_arms(bucket) if r is not None and r.status == PROBING else []
    probed = [a for a in probed if among is None or a in among]
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
  def _fund(self) -> GateState:
    return funding.fund(self)

  def _fund_bucket(self, b: int) -> GateState:
    return funding.fund_bucket(self, b)

  def put(self, b: int, r: Bucket) -> GateState:
    return dataclasses.replace(self, at={**self.at, b: r})

  def logged(self, decision: dict[str, Any]) -> GateState:
    return dataclasses.replace(self, decisions=self.decisions + (decision,))

  def candidates(self, b: int) -> list[Strategy]:
    """The arms a probation at `b` measures: the lead, or with `wide` every drafting arm."""
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if self.at[b].wide or not drafting:
      return drafting
    return [self.cfg.lead if self.cfg.lead in drafting else drafting[0]]

  def probe_arms(self, b: int) -> list[Strategy]:
    """The probation's arms whose probe is funded."""
    return [a for a in self.candidates(b) if a in self.at[b].funded]

  def _apply_cached(self, cached: Mapping[int, Mapping[str, Any]]) -> GateState:
    """Declines for hardware, as of now, the smallest bucket an earlier run declined so on
    this machine with these shapes, and every larger one (as that run's verdict did)."""
    cached = {b: d for b, d in cached.items() if b in self.at}
    if not cached:
      return self
    b0 = min(cached)
    return self.logged({**cached[b0], "bucket": b0, "verdict": DECLINED, "reason": HARDWARE,
                      "cached": True, "rollout": self.rollouts})._decline_from(b0, HARDWARE)

  def start_probe(self, b: int) -> GateState:
    return self.put(b, dataclasses.replace(self.at[b], status=PROBING, reason=None,
                                            since=self.rollouts, wide=False, spec={},
                                            funded=frozenset()))

  def _reprobe_due(self) -> GateState:
    declined = [b for b in self.buckets if self.at[b].status == DECLINED]
    if not declined:
      return self
    # the smallest: larger ones follow if it pays
    return self.start_probe(declined[0]) if self.reprobe_due(declined[0]) else self

  def reprobe_due(self, b: int) -> bool:
    """Whether declined bucket `b` is due a re-probe (`reprobe_every` rollouts after its
    decline for acceptance, `hardware_reprobe_every` for hardware; 0: never)."""
    r = self.at[b]
    every = (self.cfg.hardware_reprobe_every if r.reason == HARDWARE
             else self.cfg.reprobe_every)
    return bool(every) and self.rollouts - (r.declined_at or 0) >= every

  def _decide(self, b: int) -> GateState:
    n, r = self.cfg.min_chunks, self.at[b]
    probed = self.probe_arms(b)
    spec = {a: r.spec.get(a, ()) for a in probed}
    if len(r.plain) < n or not probed or any(len(c) < n for c in spec.values()):
      return self
    if rate(r.plain) <= 0:
      return self
    bar, step = 1.0 + self.cfg.margin, plain_step(r.plain)
    ratio = {a: speedup(r.plain, c, step) for a, c in spec.items()}
    if max(ratio.values()) < bar:  # a chunk at a wider window than its rows need reads
      # more than plain decoding: it may show an arm pays, not that none does (`Chunk.wide`)
      spec = {a: tuple(x for x in c if not x.wide) for a, c in spec.items()}
      if any(len(c) < n for c in spec.values()):
        return self
      ratio = {a: speedup(r.plain, c, step) for a, c in spec.items()}
    # with every draft accepted an arm delivers depth + 1 tokens per verification
    ceiling = max(ratio[a] * (a.steps + 1) / accept_len(spec[a]) for a in probed)
    best = max(ratio, key=ratio.get)
    pays = ratio[best] >= bar
    s = dataclasses.replace(self, hardware_ok=self.hardware_ok or ceiling >= bar)
    drafting = [a for a in self.arms_at.get(b, ()) if a != "off"]
    if not pays and not r.wide and len(drafting) > 1 and ceiling >= bar:
      # the drafts' acceptance, not the hardware, falls short: try the others, those whose
      # best case repays their compile (none: declined for acceptance now)
      s = s.put(b, dataclasses.replace(r, wide=True))._fund_bucket(b)
      if set(s.probe_arms(b)) != set(probed):
        return s
      r = s.at[b]
    reason = None if pays else (HARDWARE if ceiling < bar else ACCEPTANCE)
    s = s.logged({"bucket": b, "verdict": PAYS if pays else DECLINED, "reason": reason,
                "best_arm": best, "ratio": round(ratio[best], 3), "ceiling": round(ceiling, 3),
                "accept_len": round(accept_len(spec[best]), 3), "plain_chunks": len(r.plain),
                "rollout": self.rollouts})
    if not pays:
      return s._decline_from(b, reason)
    i = self.buckets.index(b)
    at = dict(s.at)
    for bb in self.buckets[:i + 1]:  # a smaller batch pays the more
      at[bb] = dataclasses.replace(at[bb], status=PAYS, reason=None, funded=frozenset())
    s = dataclasses.replace(s, at=at)
    nxt = placement.next_probe(s, b)
    return s if nxt is None else s.start_probe(nxt)

  def _decline_from(self, b: int, reason: str) -> GateState:
    """Declines `b` and every larger bucket not already declined (a larger batch is more
    compute-bound: drafts pay less there), as of this rollout."""
    at = dict(self.at)
    for bb in self.buckets[self.buckets.index(b):]:
      if at[bb].status != DECLINED or bb == b:
        at[bb] = dataclasses.replace(at[bb], status=DECLINED, reason=reason,
                                     declined_at=self.rollouts, funded=frozenset())
    return dataclasses.replace(self, at=at)

  # ------------------------------------------------------------------ metrics and checkpoint
  def summary(self) -> dict[str, Any]:
    """Status per bucket (a bucket on probation whose probe is not funded: "unfunded"), why
    declined ones were, the measured per-row rates (tokens/s per live row), the funded arms,
    and the payoff rule's terms for each bucket's lead arm."""
    status = {}
    for b, r in self.at.items():
      unfunded = r.status == PROBING and not self.probe_arms(b)
      status[str(b)] = "unfunded" if unfunded else r.status
    payoffs = {}
    for b in self.buckets:
      lead = self.candidates(b)
      if lead and self.at[b].status in (PROBING, PAYS):
        p = funding.terms(self, b, lead[0])
        payoffs[str(b)] = {"arm": lead[0], **{k: (round(v, 4) if isinstance(v, float) else v)
                                               for k, v in p.items()}}
    return {"status": status,
            "reason": {str(b): s for b, s in self.reason.items()},
            "plain_rate": {str(b): round(rate(r.plain), 1) for b, r in self.at.items()
                           if r.plain},
            "spec_rate": {f"{b}:{a}": round(rate(c), 1) for b, r in self.at.items()
                          for a, c in r.spec.items() if c},
            "funded": {str(b): sorted(r.funded) for b, r in self.at.items() if r.funded},
            "payoff": payoffs,
            "decisions": list(self.decisions)}

  def state_dict(self) -> dict[str, Any]:
    return {"buckets": list(self.buckets),
            "status": {str(b): s for b, s in self.status.items()},
            "reason": {str(b): s for b, s in self.reason.items()},
            "rollouts": self.rollouts, "hardware_ok": self.hardware_ok,
            "declined_at": {str(b): r.declined_at for b, r in self.at.items()
                            if r.declined_at is not None},
            "decisions": list(self.decisions), "ledger": self.ledger.state_dict()}

  @classmethod
  def restore(cls, cfg: GateConfig, state: Mapping[str, Any]) -> GateState:
    """Verdicts and the ledger survive a resume (rates are re-measured: the machine may
    differ; the first caller after it probes; funding is asked again, with nothing compiled in
    the new process). A bucket that was being probed is probed again from scratch."""
    rollouts = int(state.get("rollouts", 0))
    reason = {int(b): r for b, r in state.get("reason", {}).items()}
    declined_at = {int(b): int(r) for b, r in state.get("declined_at", {}).items()}
    status = {int(b): s for b, s in state.get("status", {}).items()}
    at = {b: Bucket(status=s, reason=reason.get(b), declined_at=declined_at.get(b),
                    since=rollouts if s == PROBING else 0) for b, s in status.items()}
    return cls(cfg, buckets=tuple(int(b) for b in state.get("buckets", [])), at=at,
               rollouts=rollouts, hardware_ok=bool(state.get("hardware_ok", False)),
               decisions=tuple(state.get("decisions", [])),
               ledger=payoff.Ledger.restore(state.get("ledger", {})))
