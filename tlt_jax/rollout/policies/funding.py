"""What the speculation gate funds: the payoff rule (payoff.py) asked of a gate's state.

Nothing speculative is compiled unless its best case repays it: a probe's arm, the other arms
probed when acceptance falls short, the arms a paying bucket compiles on every worker, and each
narrower attention window. Each function here reads a `GateState` (gate.py) and returns a
value or the next state; the gate asks `fund` again on every prober rollout and decision."""

from __future__ import annotations

import dataclasses

from tlt_jax.rollout.policies import payoff
from tlt_jax.rollout.policies.probe import (PAYS, PROBING, accept_len, measured, plain_bound,
                                            step_seconds)
from tlt_jax.rollout.policies.strategy import Strategy


def fund(s):
  """Asks the payoff rule again for every bucket on probation or paying, smallest first."""
  for b in s.buckets:
    s = fund_bucket(s, b)
  return s


def ceiling(s, b: int, arm: Strategy) -> float:
  """The best case of `arm` at `b`, as speed-up over plain decoding: its measured ceiling
  there; else the least of depth + 1 (each verification as cheap as a plain step, every
  draft accepted), the bound plain decoding's measured step times put on it
  (probe.plain_bound: no probe needed where a k-token forward costs ~k single ones) and the
  hardware ceiling measured at any smaller bucket (a larger batch is no less compute-bound);
  "off" decodes plainly: 1."""
  prior = float(arm.steps + 1)
  here = measured(s.at[b])
  if arm in here:
    return here[arm][1]
  bounds = [max(c for _, c in m.values()) for q in s.buckets if q <= b
            if (m := measured(s.at[q]))]
  plain = plain_bound(s.steps_at, b, arm)
  return min([prior] + bounds + ([plain] if plain is not None else []))


def carried(s, b: int) -> float:
  """The speed-up over plain decoding at `b` that a speculating batch has there without
  anything compiled at `b`: it stays at the next larger bucket with funded arms (the compile
  plan compacts a speculating batch only to buckets whose arms are ready), at that bucket's
  best measured ratio, slowed by the larger batch's step (the plain steps measured at both);
  1.0 where there is none (the rows decode plainly)."""
  above = next((q for q in s.buckets if q > b and s.at[q].status == PAYS and s.at[q].funded),
               None)
  if above is None:
    return 1.0
  here = measured(s.at[above])
  best = max((here[a][0] for a in s.at[above].funded if a in here), default=1.0)
  t_b, t_above = step_seconds(s.steps_at, b), step_seconds(s.steps_at, above)
  if not t_b or not t_above:
    return 1.0
  return max(1.0, best * t_b / t_above)


def price(s, b: int, arm: Strategy, every_worker: bool) -> float | None:
  """Seconds to compile `arm` at `b`, with the bucket's one-off speculative compiles where
  nothing is funded there yet: on every worker (what a paying bucket costs each), or on the
  prober (a probe: what it compiled in this run already is paid for)."""
  led = s.ledger
  arm_s = (0.0 if not every_worker and (b, arm) in led.made
           else led.arm_cost(b, arm, s.cfg.compile_factor))
  open_s = (0.0 if s.at[b].funded or (not every_worker and led.opened(b))
            else led.open_cost(b))
  if arm_s is None or open_s is None:
    return None
  return arm_s + open_s


def worth(s, b: int, gain: float, cost: float | None) -> bool:
  """Whether saving `gain` of the time a rollout spends at `b` repays `cost` (payoff.py)."""
  c = s.cfg
  return payoff.repays(s.ledger.per_rollout(b), horizon=c.horizon, rollouts=s.rollouts,
                       payback=c.payback, gain=gain, cost=cost)


def with_funded(s, b: int, arm: Strategy):
  return dataclasses.replace(s, at={**s.at, b: dataclasses.replace(
      s.at[b], funded=s.at[b].funded | {arm})})


def fund_bucket(s, b: int):
  """On probation: funds each probed arm whose best case (1 - 1/ceiling of the time spent
  at `b`) repays what the prober has left to compile for it there, each on its own. Where
  it pays: funds arms, the measured ones by speed first, whose best case beats the fastest
  funded one (else what a speculating batch gets at `b` without compiling there,
  `carried`) by enough to repay what every worker compiles for them. Each bucket is funded
  on its own: a speculating batch compacts only to buckets whose arms are compiled, so
  nothing runs where nothing is funded. A funded arm stays funded. An open-ended run
  (horizon 0) funds every arm."""
  r, c = s.at[b], s.cfg
  if r.status not in (PROBING, PAYS) or not c.gating:
    return s
  if c.horizon <= 0:  # open-ended: every compile repays
    every = frozenset(s.candidates(b) if r.status == PROBING else s.arms_at.get(b, ()))
    return s if every <= r.funded else dataclasses.replace(
        s, at={**s.at, b: dataclasses.replace(r, funded=r.funded | every)})
  if r.status == PROBING:
    for a in s.candidates(b):
      if a in s.at[b].funded:
        continue
      if worth(s, b, 1.0 - 1.0 / ceiling(s, b, a), price(s, b, a, False)):
        s = with_funded(s, b, a)
    return s
  here = measured(r)
  base = max((here[a][0] for a in r.funded if a in here), default=carried(s, b))
  for a in sorted(s.arms_at.get(b, ()), key=lambda a: -here.get(a, (0.0,))[0]):
    if a in s.at[b].funded:
      continue
    if worth(s, b, 1.0 - base / ceiling(s, b, a), price(s, b, a, True)):
      s = with_funded(s, b, a)
      if a in here:
        base = max(base, here[a][0])
  return s


def repays_window(s, bucket: int, arm: Strategy, chunks_per_rollout: float, share: float) -> bool:
  """Whether a narrower attention window of `arm` at `bucket` is worth compiling (one more
  executable, as costly as the arm's: payoff.py) for chunks that would read `share` fewer of
  their step's bytes (the compile plan's estimate) than at the wider window they run at now,
  `chunks_per_rollout` times per rollout. Their time is the arm's measured chunks' there;
  before it has one, the plain chunks' there (a chunk the wider window would make lose runs
  plainly: `runs_wide`); before either, only an open-ended run compiles."""
  c = s.cfg
  r = s.at.get(bucket)
  if r is not None and r.status == PROBING:  # a probe measures at the rows' own windows (at
    return True  # a wider one its chunks are not counted: gate.py)
  chunks = (r.spec.get(arm) or r.plain) if r is not None else ()
  if not chunks:
    return c.horizon <= 0
  wall = sum(x.wall for x in chunks) / len(chunks)
  return payoff.repays_saving(chunks_per_rollout * wall * share, horizon=c.horizon,
                              rollouts=s.rollouts, payback=c.payback,
                              cost=s.ledger.arm_cost(bucket, arm, c.compile_factor))


def runs_wide(s, bucket: int, arm: Strategy, extra: float) -> bool:
  """Whether `arm` at `bucket` may run at a compiled attention window wider than its rows
  need (while theirs compiles, or where compiling it does not repay) instead of decoding
  plainly: a step there reads `extra` times the bytes of a plain step at the rows' own window
  (the compile plan's estimate), and a verification delivers the arm's measured tokens per
  row (its chunks here; before any, its best case, depth + 1). Where decoding is bound by
  bytes it costs at least `extra` plain steps, so it loses unless those tokens exceed
  `extra` (the 32B recipe's 120-row bulk: 3.9x the bytes for ~3 tokens, 0.89x measured)."""
  r = s.at.get(bucket)
  chunks = r.spec.get(arm, ()) if r is not None else ()
  return (accept_len(chunks) if chunks else arm.steps + 1) > extra


def terms(s, bucket: int, arm: Strategy) -> dict[str, float | None]:
  """The payoff rule's terms for compiling `arm` at `bucket` on a worker that has nothing
  speculative there yet (the metrics' view; `fund_bucket` decides with what each worker
  has)."""
  led, cfg = s.ledger, s.cfg
  best = ceiling(s, bucket, arm)
  cost = led.arm_cost(bucket, arm, cfg.compile_factor)
  opening = led.open_cost(bucket)
  left = payoff.rollouts_left(cfg.horizon, s.rollouts)
  return {"s_per_rollout": led.per_rollout(bucket), "ceiling": best,
          "best_saving": (payoff.best_saving(led.per_rollout(bucket), left, cfg.payback,
                                             1 - 1 / best)
                          if left != float("inf") else None),
          "compile": None if cost is None or opening is None else cost + opening}
