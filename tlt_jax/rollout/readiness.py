"""Where a batch may switch speculation on and compact to, given what the compile plan has
compiled or queued: `ready` (switch on here now), `compacts_to` (a speculating batch's
buckets), `coming` (speculation here waits only for a queued compile) and `compaction` (the
Scheduler's rule for a batch, the gate's hold on the prober included).

`Readiness` is a part of `CompilePlan` (compile_plan.py), which owns what it reads: the
engine's config (`ecfg`), the arms wanted and compiled (`_wanted_pairs`, `compiled_arms`) and
the compile thread's sets (`_lock`, `_submitted`, `_ready`).
"""

from __future__ import annotations

import functools
from typing import Callable

from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.sampling import SamplingParams


class Readiness:
  """Where speculation may run and a batch may compact (module docstring)."""

  def compacts_to(self, call: PlanCall, sp: SamplingParams, bucket: int) -> bool:
    """Whether a speculating batch may compact to `bucket`: the gate allows speculation there
    and one of the arms wanted there is compiled (without background compilation: always).
    Its chunks there choose among the compiled ones (the engine's `compiled_arms`); the
    rest compile in the background meanwhile."""
    gate = call.gate
    if gate is not None and not gate.allows(call.worker_id, bucket):
      return False
    if not self.ecfg.spec.background_compile:
      return True
    return bool(self.compiled_arms(sp, bucket, self._wanted_pairs(call).get(bucket, ())))

  def ready(self, call: PlanCall, sp: SamplingParams, bucket: int) -> bool:
    """Whether speculation may run at `bucket` now: the gate allows it and one arm wanted
    there is compiled, or none is wanted there (its chunks choose among the compiled ones,
    `compiled_arms`; always, without background compilation: a chunk compiles what it
    needs)."""
    if self.compacts_to(call, sp, bucket):
      return True
    gate = call.gate
    return ((gate is None or gate.allows(call.worker_id, bucket))
            and not self._wanted_pairs(call).get(bucket))

  def leaves(self, call: PlanCall, sp: SamplingParams, bucket: int, live: int) -> bool:
    """Whether a batch speculating at `bucket` with `live` rows switches speculation off to
    compact (the gate's `leaves`): its rows fit a smaller bucket, none of the buckets from
    there up to its own has an arm it could speculate with compiled or queued (`compacts_to`,
    `coming`: a batch that left would decode plainly at its rows' bucket while an arm queued
    above it compiles; the 32B recipe at a per-draft 0.6, 128 rows left for 16 two seconds
    before 64's arm was ready, 60 s plain against 30 s at 64 speculating, the rollout 1.38 ->
    1.13x at step 2), no probe holds it here (`holds`), and by the gate's measure plain
    decoding at the rows' bucket beats speculating on here. Without a gate: never."""
    gate, to = call.gate, self.ecfg.bucket_for(live)
    if gate is None or to >= bucket:
      return False
    ready = self.compiled_arms(sp, bucket, self._wanted_pairs(call).get(bucket, ()))
    if gate.holds(call.worker_id, bucket, ready):
      return False
    if any(self.compacts_to(call, sp, q) or self.coming(call, sp, q)
           for q in self.ecfg.buckets if to <= q < bucket):
      return False
    return gate.leaves(bucket, to)

  def compaction(self, call: PlanCall, sp: SamplingParams, bucket: int, *, started: bool,
                 tracked: bool, wants: bool, live: int = 0) -> Callable[[int], bool] | None:
    """Which buckets a batch at `bucket` may compact to (the Scheduler's `compacts_to`; None:
    any). A tracked call's batch (it may speculate) on the prober at the bucket on probation:
    none until the probe is judged (the gate's `holds`, told the arms compiled there), while
    the probe's executable there is queued or compiled (`coming`: a probe placed during the
    call compiles from the next call's start, so held for it the batch would wait the call
    out for nothing). A speculating batch (`started`), and a tracked one that `wants` to
    switch on where its bucket's arm is queued (`coming`): only buckets where it can
    speculate without a compile nobody paid for (`compacts_to`); but a tracked batch whose
    compiled arms there all gave way (gate.gives_way), or whose `live` rows are better off
    decoding plainly at their own bucket (`leaves`: the engine switched it off for that),
    has nothing to wait for: any."""
    gate = call.gate
    coming = tracked and self.coming(call, sp, bucket)
    if coming and gate is not None:
      ready = self.compiled_arms(sp, bucket, self._wanted_pairs(call).get(bucket, ()))
      if gate.holds(call.worker_id, bucket, ready):
        return lambda b: False
      if not started and ready and all(gate.gives_way(bucket, a) for a in ready):
        return None
      if not started and live and self.leaves(call, sp, bucket, live):
        return None
    if started or (wants and coming):
      return functools.partial(self.compacts_to, call, sp)
    return None

  def coming(self, call: PlanCall, sp: SamplingParams, bucket: int) -> bool:
    """Whether speculation at `bucket` waits only for a compile already queued: the gate
    allows it and an arm wanted there is handed to the compile thread (`submit`; compiled
    or not). A tracked batch that wants to speculate there compacts meanwhile only to buckets
    where it can speculate (`compaction`): every smaller bucket's first arm is
    queued after this one's (`compile_order`), so compacting to one would only chase the
    compiles down (the 32B recipe's worker 2: each bucket's arm ready 0.3-24 s after its
    batch had compacted below it, 128 down to 2, all plain). Background compilation only."""
    if not self.ecfg.spec.background_compile:
      return False
    gate = call.gate
    if gate is not None and not gate.allows(call.worker_id, bucket):
      return False
    wanted = self._wanted_pairs(call).get(bucket, ())
    with self._lock:
      queued = self._submitted.get(sp, set()) | self._ready.get(sp, set())
    return any((bucket, a) in queued for a in wanted)
