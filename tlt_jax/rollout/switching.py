"""The compile plan's executable that moves a batch out of speculation: switch-off
(spec_state.switch_off), compiled on first use or, with background compilation, on the
compile thread ahead of need: right after a probe's first arm (`leaves_at`), else ahead of
every compile not started once a batch speculates where the gate may close its bucket.
(Speculation switches on at no cost: a tracked call's drafter cache is current, engine.py.)

`Switching` is a part of `CompilePlan` (compile_plan.py), which owns what it reads: the model
config and executable cache (`cfg`, `exes`), the compile thread (`_have`), `_abstract`, and
the queued set `_off_ahead`.
"""

from __future__ import annotations

import functools

from tlt_jax.rollout.executables import ExecKey
from tlt_jax.rollout.plan_call import Pairs, PlanCall


class Switching:
  """The switch-off executable (module docstring)."""

  @staticmethod
  def _switch_off_args(call: PlanCall, state) -> tuple:
    return (call.params, call.drafter_params, state)

  def switch_off(self, call: PlanCall, state):
    """The executable that turns a speculating batch back into a tracked one
    (spec_state.switch_off; state may be abstract: `switch_off_ahead` compiles it on the
    compile thread). It donates the state."""
    from tlt_jax.rollout import spec_state
    return self.exes.get("switch_off", None,
                         functools.partial(spec_state.switch_off, cfg=self.cfg),
                         self._switch_off_args(call, state), donate=(2,))

  @staticmethod
  def leaves_at(call: PlanCall, pairs: Pairs) -> int | None:
    """The bucket of `pairs` whose switch-off `submit` compiles right after its first arm:
    the largest the gate may close (`closes`: a probe's), where a batch switches on
    (speculation shrinks from the largest). A probe that declines, or whose measured arm
    gives way (gate.gives_way), then stops speculating at once, not after the arms queued
    behind its own (the 7B recipe's prober: its lead at the 8 buckets under the probe,
    240 s at 30 s a compile, longer than its call). None: no gate, or none it may close."""
    gate = call.gate
    if gate is None:
      return None
    return max((b for b in pairs if gate.closes(b)), default=None)

  def switch_off_ready(self, call: PlanCall, state) -> bool:
    """Whether switch-off at the state's bucket runs without a compile in its time (compiled;
    or compiled as it runs: no background compilation)."""
    spec = self.ecfg.spec
    if spec is None or not spec.background_compile or self._compiler is None:
      return True
    return self._switch_off_key(call, state) in self.exes

  def _switch_off_key(self, call: PlanCall, state) -> ExecKey:
    return ExecKey.of("switch_off", None, self._switch_off_args(call, state))

  def switch_off_ahead(self, call: PlanCall, state) -> None:
    """Queues switch-off's executable at a speculating batch's bucket on the compile thread
    (background compilation only; once per shape), before every compile not started: a
    batch whose bucket the gate closes later (a probe there that declines), or whose probed
    arm gives way to plain decoding (gate.gives_way), stops speculating without a compile in
    its time, and without waiting for the arms queued ahead of it (the 7B recipe's prober
    queued its lead at the 8 buckets under the probe first: 240 s, longer than its call)."""
    if state.batch_size in self._off_ahead:  # (a key over the weights' tree: not per chunk)
      return
    self._off_ahead.add(state.batch_size)
    key = self._switch_off_key(call, state)
    shapes = self._abstract(state)
    self._have(key, lambda: self.switch_off(call, shapes), urgent=True)
