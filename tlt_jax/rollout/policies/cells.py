"""The cells the workers of one rollout share: the host policies' states (`Policies`: pure
values the train state carries, mab.py's `BanditState` and gate.py's `GateState`) held for
the duration of a rollout, behind a lock each, with the interface the engine calls per chunk.

A caller owns the cells of each call: `PolicyCells.of(policies)` before, the engines' chunks
swap new states in (`Selector.update`, `SpecGate.record` ...), `cells.states()` after. The
coordinator does this per rollout (tlt_jax/coordinator/), the cluster simulator per simulated
step (tlt_jax/plan/sim.py), a single-engine caller around its `generate`; between calls
nothing holds a policy but the values themselves. `SpecGate` also owns the gate's I/O (the
verdict cache, verdicts.py), which the pure state cannot do.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, NamedTuple, Sequence

from tlt_jax.rollout.policies import funding, placement
from tlt_jax.rollout.policies.gate import GateConfig, GateState
from tlt_jax.rollout.policies.mab import BanditConfig, BanditState, bandit_config
from tlt_jax.rollout.policies.probe import PAYS, PROBING, Chunk
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.rollout.policies.verdicts import VerdictCache


class Policies(NamedTuple):
  """The host policies' states a rollout reads and returns (the train state's)."""

  bandit: BanditState | None = None  # the bandit's (None: no speculation)
  gate: GateState | None = None  # the speculation gate's (None: no gate)


class Selector:
  """The bandit the workers of one rollout share: a `BanditState` behind a lock, with the
  engine's interface. `state` is the current value (a `BanditConfig`: its fresh state)."""

  def __init__(self, state: BanditState | BanditConfig):
    self.state = BanditState.fresh(state) if isinstance(state, BanditConfig) else state
    self.cfg = self.state.cfg
    self._lock = threading.Lock()

  @property
  def arms(self) -> list[Strategy]:
    return self.cfg.arms

  @property
  def buckets(self) -> dict[int, list[Strategy]]:
    return {lo: list(a) for lo, a in self.cfg.buckets}

  def bucket_of(self, batch_size: int) -> int:
    return self.cfg.bucket_of(batch_size)

  def arms_for(self, batch_size: int) -> list[Strategy]:
    return self.cfg.arms_for(batch_size)

  def choosable(self, lo: int, hi: int) -> list[Strategy]:
    return self.cfg.choosable(lo, hi)

  def select(self, batch_size: int, arms: Sequence[Strategy] | None = None) -> Strategy:
    return self.state.select(batch_size, arms)

  def learns(self, arm: Strategy, batch_size: int) -> bool:
    return self.state.learns(arm, batch_size)

  def update(self, arm: Strategy, batch_size: int, reward: float) -> None:
    with self._lock:
      self.state = self.state.update(arm, batch_size, reward)

  def values(self, batch_size: int) -> dict[str, float | None]:
    return self.state.values(batch_size)


class SpecGate:
  """The gate the workers of one rollout share (their threads): holds a `GateState` and
  swaps it for the next under a lock; the policy is all in GateState. The whole interface an
  engine uses (engine.py sequences it; compile_plan.py asks the questions about compiling):
    begin_rollout(worker, choosable)  once per generate call (the prober's calls are the clock)
    drafter_wanted()                  whether hidden states are captured / the drafter trained
    next_rollout()                    the gate as the next rollout will begin (a call ending
                                      asks what that one compiles as it starts)
    arms(worker, bucket)              the arms to compile there now
    allows(worker, bucket)            whether a chunk may speculate there now
    holds(worker, bucket, ready)      whether a batch there stays until its probe is judged
                                      (placement.py)
    defers(bucket, live)              whether a batch there waits for rows to finish before
                                      its probe runs
    probe_arm(bucket, default)        the arm a chunk runs (the probed one on probation)
    gives_way(bucket, arm)            whether a chunk decodes plainly instead (a probed arm
                                      measured losing while the others compile)
    leaves(bucket, to)                whether a speculating batch whose rows fit `to` (where
                                      nothing of it is compiled) switches off to compact
    record(bucket, arm, ...)          one measured chunk (arm None: plain); may decide
    compiled(kind, bucket, arm, s)    an executable's compile seconds (payoff.py's kinds)
    repays_window(bucket, arm, n, f)  whether a narrower attention window is worth compiling
    runs_wide(bucket, arm, extra)     whether an arm may run at a wider window than its rows'
    closes(bucket)                    whether it may close a bucket (switch-off compiled ahead)
    probes(bucket)                    whether the bucket is on probation (its probe's arm
                                      compiles before the arms under it)
  Questions read one state (a reference read: no lock; a state never changes). The holder
  owns the I/O the pure state cannot do: loading cached hardware verdicts and compile costs on
  the first rollout with buckets, and writing them after every verdict and new cost."""

  def __init__(self, state: GateState | GateConfig | None = None,
               verdicts: VerdictCache | None = None):
    """state: the gate's value (a `GateConfig`: its fresh state; None: the default's)."""
    self.state = state if isinstance(state, GateState) else GateState(state or GateConfig())
    self.verdicts = verdicts  # hardware verdicts of earlier runs (None: measure every run)
    self._lock = threading.Lock()

  def closes(self, bucket: int) -> bool:
    """Whether it may close `bucket` while a batch speculates there, so that switch-off is
    compiled ahead there: a gating gate's bucket on probation, closed or declined (a probe
    that declines, probation that moves on). Not an open gate, and not a bucket that pays
    with funded arms: a verdict of paying is final and a funded arm stays funded
    (funding.py), so the gate never closes it (a batch there whose arms read too wide a
    window, or whose rows are better off decoding plainly at a smaller bucket, `leaves`,
    still switches off, once switch-off is compiled: engine.py)."""
    s = self.state
    if not s.cfg.gating:
      return False
    r = s.at.get(bucket)
    return r is None or r.status != PAYS or not r.funded

  def probes(self, bucket: int) -> bool:
    r = self.state.at.get(bucket)
    return r is not None and r.status == PROBING

  def begin_rollout(self, worker_id: int, choosable: Mapping[int, Sequence[str]]) -> None:
    with self._lock:
      first = self.verdicts is not None and choosable and not self.state.arms_at
      cached = self.verdicts.load() if first and not self.state.buckets else None
      costs = self.verdicts.load_costs() if first else None
      self.state = self.state.begin_rollout(worker_id, choosable, cached, costs)

  def record(self, bucket: int, arm: Strategy | None, wall: float, steps: int, accepted: int = 0,
             verifications: int = 0, live: int = 0, read: float = 0.0,
             wide: bool = False) -> None:
    """steps (target forwards), accepted, verifications, live, read and wide as in
    `ChunkMetrics`."""
    with self._lock:
      old = self.state
      self.state = old.record(Chunk(bucket, arm, wall, steps, accepted, verifications, live,
                                    read, wide))
      if self.verdicts is not None and len(self.state.decisions) > len(old.decisions):
        self.verdicts.update(self.state.hardware_verdicts())  # (a re-probe that paid: gone)

  def compiled(self, kind: str, bucket: int, arm: Strategy | None, seconds: float) -> None:
    with self._lock:
      old = self.state.ledger.costs()
      self.state = self.state.compiled(kind, bucket, arm, seconds)
      costs = self.state.ledger.costs()
      if self.verdicts is not None and costs != old:
        self.verdicts.update(costs=costs)

  def drafter_wanted(self) -> bool:
    return self.state.drafter_wanted()

  def may_speculate(self) -> bool:
    return self.state.may_speculate()

  def next_rollout(self) -> SpecGate:
    """The gate as the next rollout's calls will find it, asked as a call ends: once the
    prober has begun that rollout (where probation moves and probes are funded:
    GateState.begin_rollout). A view to ask questions of (what that rollout compiles as it
    starts, compiled before it: engine.py); this gate is not changed."""
    s = self.state
    if s.cfg.gating and s.prober is not None:
      s = s.begin_rollout(s.prober, {})
    return SpecGate(s)

  def arms(self, worker_id: int, bucket: int) -> list[Strategy]:
    return self.state.arms(worker_id, bucket)

  def allows(self, worker_id: int, bucket: int) -> bool:
    return self.state.allows(worker_id, bucket)

  def holds(self, worker_id: int, bucket: int, ready=None) -> bool:
    return placement.holds(self.state, worker_id, bucket, ready)

  def defers(self, bucket: int, live: int) -> bool:
    return placement.defers(self.state, bucket, live)

  def probe_arm(self, bucket: int, default: Strategy, among=None) -> Strategy:
    return self.state.probe_arm(bucket, default, among)

  def gives_way(self, bucket: int, arm: Strategy | None) -> bool:
    return placement.gives_way(self.state, bucket, arm)

  def leaves(self, bucket: int, to: int) -> bool:
    return placement.leaves(self.state, bucket, to)

  def repays_window(self, bucket: int, arm: Strategy, chunks_per_rollout: float,
                    share: float) -> bool:
    return funding.repays_window(self.state, bucket, arm, chunks_per_rollout, share)

  def runs_wide(self, bucket: int, arm: Strategy, extra: float) -> bool:
    return funding.runs_wide(self.state, bucket, arm, extra)

  def summary(self) -> dict[str, Any]:
    return self.state.summary()


def make_selector(*args, **kwargs) -> Selector:
  """A `Selector` on the fresh state of `bandit_config(*args, **kwargs)`."""
  return Selector(bandit_config(*args, **kwargs))


@dataclasses.dataclass
class PolicyCells:
  """One call's cells (module docstring): the bandit's, the gate's (None: none) and whether
  the call's chunks measure the gate (`measure`: a training rollout; evaluation reads the gate,
  which arms are compiled and whether hidden states are wanted, and never moves it)."""

  selector: Any = None  # a Selector (or anything with its interface)
  gate: Any = None  # a SpecGate (likewise)
  measure: bool = True

  @classmethod
  def of(cls, policies: Policies, *, verdicts: VerdictCache | None = None,
         measure: bool = True) -> PolicyCells:
    return cls(None if policies.bandit is None else Selector(policies.bandit),
               None if policies.gate is None else SpecGate(policies.gate, verdicts), measure)

  def states(self) -> Policies:
    """The values the cells hold now."""
    return Policies(None if self.selector is None else self.selector.state,
                    None if self.gate is None else self.gate.state)
