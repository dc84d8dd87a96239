"""Whether a compile pays for itself: the economics the speculation gate (gate.py) consults
before anything speculative is compiled.

Everything adaptive in rollout costs before it earns. A (batch bucket, arm) executable is a
compile (4-6 s of a host core for the default model's speculative chunk here, tens of seconds
for a 7B chunk on a GPU host), once per attention window; a probe runs chunks at an arm that
may be slower than plain decoding. What it can earn is bounded: at best an arm speeds up the
time the run spends at its bucket, and the run ends. So a speculative executable is compiled
only when its best case repays it:

    best saving = T_b x R x payback x gain  >=  its compile seconds

- T_b: seconds per rollout (per worker) the run has spent decoding at batch bucket b, from its
  own chunks (every worker's measured chunks at b over every worker's generate calls);
- R: rollouts left in the run (the horizon, `train.steps`, or train.steps x grpo.max_rollouts
  with grpo.filter_groups, minus the rollouts so far). Horizon 0 means open-ended (an engine
  outside a training run): every compile repays;
- payback: the share of R within which the best case must repay the compile (0.5: a compile
  only the run's second half could repay is not made; this also absorbs the estimates' noise);
- gain: the share of T_b the best case saves (gate.py: 1 - 1/ceiling against plain decoding,
  the ceiling being what the arm would reach with every draft accepted);
- compile seconds: this ledger's measurement in units of the plain decode chunk's compile at
  the same bucket (a speculative chunk holds that chunk's forward and more: measured here,
  4_1_5 3.3x, 3_1_4 2.7x, hist_4 2.2x, hyb_4 4.0x, "off" 1.3x), so one measurement prices
  every bucket; the `compile_factor` prior stands in until a speculative compile is measured.

Measured on this CPU in a cold default run: the 40 rollouts spent ~5 ms each at bucket 1 (a
few 16-step chunks of the long tail), so the best case of any arm there, ~0.1 s over the whole
run, never repays a compile of ~6 s; on a GPU a 7B tail spends minutes per rollout at small
batch, and every probe repays.

`Ledger` is what the run has measured, a frozen record updated by pure transitions (a chunk's
time, a rollout, a compile); `repays` is the rule. Compile costs are remembered across runs
with the gate's hardware verdicts (verdicts.VerdictCache): a second run loads its executables from
JAX's persistent cache in milliseconds, which would otherwise price a compile it has never
paid as nearly free.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Mapping

from tlt_jax.rollout.policies.strategy import Strategy

# A bucket's one-off speculative compiles (the drafter's tracking of a call's prompts and
# plain chunks, switch-off), in plain decode chunk compiles at the bucket, until measured.
OPEN_PRIOR = 1.5
PLAIN, SPEC, OPEN = "plain", "spec", "open"  # the kinds of compile a ledger prices
# an engine executable's name (executables.py, compile_plan.py) -> its kind (None: not priced)
KIND = {"decode": PLAIN, "spec": SPEC, "switch_off": OPEN, "track_prompt": OPEN, "track": OPEN}


@dataclasses.dataclass(frozen=True)
class Ledger:
  """What the run has measured that the payoff rule needs. Host-side, no JAX; every
  transition returns a new ledger."""
  calls: int = 0  # generate calls of every worker (the time base of T_b)
  busy: Mapping[int, float] = dataclasses.field(default_factory=dict)  # bucket -> seconds
  plain: Mapping[int, float] = dataclasses.field(default_factory=dict)  # bucket -> compile s
  spec: Mapping[tuple[int, str], float] = dataclasses.field(default_factory=dict)  # (b, arm)
  opening: Mapping[int, float] = dataclasses.field(default_factory=dict)  # bucket -> compile s
  # what compiled in this run (costs may be remembered from another): (bucket, arm), and
  # (bucket, None) for a bucket's one-off speculative compiles
  made: frozenset = frozenset()

  # ---------------------------------------------------------------------------- transitions
  def called(self) -> Ledger:
    return dataclasses.replace(self, calls=self.calls + 1)

  def decoded(self, bucket: int, seconds: float) -> Ledger:
    """A measured chunk's time at `bucket`."""
    return dataclasses.replace(self, busy={**self.busy,
                                           bucket: self.busy.get(bucket, 0.0) + seconds})

  def compiled(self, kind: str, bucket: int, arm: Strategy | None, seconds: float) -> Ledger:
    """A compile at `bucket`: a plain decode chunk (kind PLAIN: the largest seen, a bucket's
    windows cost about the same), an arm's speculative chunk (SPEC: the largest of its
    windows), or the bucket's one-off speculative compiles (OPEN: summed)."""
    if kind == PLAIN:
      return dataclasses.replace(self, plain={**self.plain,
                                              bucket: max(seconds, self.plain.get(bucket, 0))})
    if kind == SPEC:
      key = (bucket, arm)
      return dataclasses.replace(self, spec={**self.spec,
                                             key: max(seconds, self.spec.get(key, 0.0))},
                                 made=self.made | {key})
    if kind == OPEN:
      return dataclasses.replace(self, opening={**self.opening,
                                                bucket: self.opening.get(bucket, 0.0) + seconds},
                                 made=self.made | {(bucket, None)})
    raise ValueError(f"unknown compile kind {kind!r}; use {PLAIN}, {SPEC} or {OPEN}")

  def remembered(self, costs: Mapping[str, Any]) -> Ledger:
    """Compile costs an earlier run measured on this machine (`costs()`'s form), taken where
    they exceed this run's (a cold compile's time, not a persistent-cache hit's)."""
    s = self
    try:
      for b, sec in costs.get("plain", {}).items():
        s = s.compiled(PLAIN, int(b), None, float(sec))
      for key, sec in costs.get("spec", {}).items():
        b, arm = key.split(":", 1)
        s = s.compiled(SPEC, int(b), arm, float(sec))
      opening = {int(b): max(float(sec), s.opening.get(int(b), 0.0))
                 for b, sec in costs.get("open", {}).items()}
    except (AttributeError, TypeError, ValueError):
      return self  # a damaged entry: measured again
    return dataclasses.replace(s, opening={**s.opening, **opening}, made=self.made)

  # ------------------------------------------------------------------------------ questions
  def per_rollout(self, bucket: int) -> float:
    """T_b: seconds per rollout (per worker) decoding at `bucket` so far."""
    return self.busy.get(bucket, 0.0) / self.calls if self.calls else 0.0

  def plain_compile(self, bucket: int) -> float | None:
    """A plain decode chunk's compile at `bucket` (the nearest bucket's where none ran there:
    compile time grows slowly with the batch); None before any compile is measured."""
    if bucket in self.plain:
      return self.plain[bucket]
    if not self.plain:
      return None
    return self.plain[min(self.plain, key=lambda b: (abs(b - bucket), b))]

  def _factors(self, arm: Strategy | None) -> list[float]:
    return [s / self.plain[b] for (b, a), s in self.spec.items()
            if (arm is None or a == arm) and self.plain.get(b)]

  def opened(self, bucket: int) -> bool:
    """Whether anything speculative compiled at `bucket` in this run (its one-off compiles
    are made)."""
    return any(b == bucket for b, _ in self.made)

  def arm_cost(self, bucket: int, arm: Strategy, prior: float) -> float | None:
    """Estimated seconds to compile `arm`'s speculative chunk (one attention window) at
    `bucket` on a worker that has not: its measurement there, else the plain chunk's compile
    there x the arm's measured factor (at other buckets), else every arm's mean factor, else
    `prior`. None while no compile is measured at all."""
    if (bucket, arm) in self.spec:
      return self.spec[(bucket, arm)]
    base = self.plain_compile(bucket)
    if base is None:
      return None
    factor = self._factors(arm) or self._factors(None)
    return base * (statistics.fmean(factor) if factor else prior)

  def open_cost(self, bucket: int) -> float | None:
    """Estimated seconds of a bucket's one-off speculative compiles on a worker that has not
    made them (measured there, else the plain chunk's compile x the measured mean factor, else
    OPEN_PRIOR)."""
    if bucket in self.opening:
      return self.opening[bucket]
    base = self.plain_compile(bucket)
    if base is None:
      return None
    factors = [s / self.plain[b] for b, s in self.opening.items() if self.plain.get(b)]
    return base * (statistics.fmean(factors) if factors else OPEN_PRIOR)

  def costs(self) -> dict[str, Any]:
    """The compile costs, JSON-ready (what `remembered` reads)."""
    return {"plain": {str(b): round(s, 4) for b, s in self.plain.items()},
            "spec": {f"{b}:{a}": round(s, 4) for (b, a), s in self.spec.items()},
            "open": {str(b): round(s, 4) for b, s in self.opening.items()}}

  def state_dict(self) -> dict[str, Any]:
    return {"calls": self.calls, "busy": {str(b): s for b, s in self.busy.items()},
            **self.costs()}

  @classmethod
  def restore(cls, state: Mapping[str, Any]) -> Ledger:
    led = cls(calls=int(state.get("calls", 0)),
              busy={int(b): float(s) for b, s in state.get("busy", {}).items()})
    return led.remembered(state)


def rollouts_left(horizon: int, rollouts: int) -> float:
  """R: the rollouts a run of `horizon` rollouts has left after `rollouts` (horizon 0:
  open-ended, infinite)."""
  return float("inf") if horizon <= 0 else float(max(horizon - rollouts, 0))


def best_saving(per_rollout: float, left: float, payback: float, gain: float) -> float:
  """Seconds the best case saves within `payback` of the `left` rollouts, of `per_rollout`
  seconds decoded per rollout where it runs."""
  if gain <= 0 or left <= 0:
    return 0.0
  return per_rollout * left * payback * gain


def repays(per_rollout: float, *, horizon: int, rollouts: int, payback: float, gain: float,
           cost: float | None) -> bool:
  """The rule (module docstring) for compiles priced at `cost` seconds that would speed up
  `per_rollout` seconds of each rollout by the share `gain` at best. Open-ended runs (horizon
  0) compile whatever could gain; a compile that cannot be priced yet (nothing compiled at
  all) is not made; what costs nothing (compiled already) is run whenever it could gain."""
  if gain <= 0:
    return False
  if horizon <= 0 or cost == 0:
    return True
  if cost is None:
    return False
  return best_saving(per_rollout, rollouts_left(horizon, rollouts), payback, gain) >= cost


def repays_saving(saving_per_rollout: float, *, horizon: int, rollouts: int, payback: float,
                  cost: float | None) -> bool:
  """The rule for a saving known per rollout (an attention window narrower than the one a
  chunk runs at: the compile plan estimates what it saves)."""
  if saving_per_rollout <= 0:
    return False
  if horizon <= 0:
    return True
  if cost is None:
    return False
  return saving_per_rollout * rollouts_left(horizon, rollouts) * payback >= cost
