"""The compile plan's executables that move a batch between plain and speculative decoding:
switch-on over a grid of sequence lengths (`switch_lengths`: its target forward runs over the
shortest that holds the rows, not the whole cache) and switch-off, each compiled on first use
or, with background compilation, on the compile thread ahead of need.

`Switching` is a part of `CompilePlan` (compile_plan.py), which owns what it reads: the model
config, engine config and executable cache (`cfg`, `ecfg`, `exes`), the compile thread and
its lock (`_compiler`, `_lock`, `_have`), the replicated sharding and `_abstract`, the
catch-up room (`max_steps`), and the queued sets `_switch_submitted` / `_off_ahead`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tlt_jax.rollout.executables import ExecKey
from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.scheduler import length_grid


class Switching:
  """Switch-on and switch-off executables (module docstring)."""

  def switch_lengths(self) -> list[int]:
    """Sequence lengths switch-on is compiled for: prompt_bucket x 2^k, capped at the cache.
    Its target forward runs over the shortest that holds every row, not the whole cache (a
    forward over the cache's 368 slots cost a 189M model on CPU more than the speculative
    decoding after it)."""
    return list(length_grid(self.ecfg.prompt_bucket, self.ecfg.cache_len))

  def _switch_on_args(self, call: PlanCall, base, length: int, dpool=None) -> tuple:
    tokens = jax.ShapeDtypeStruct((base.hidden.shape[0], length), jnp.int32,
                                  sharding=self._replicated)
    return (call.params, call.drafter_params, base,
            call.kv.abstract(True) if dpool is None else dpool, tokens)

  def _switch_on_fn(self, call: PlanCall):
    from tlt_jax.rollout import spec_state
    return functools.partial(spec_state.switch_on, cfg=self.cfg, max_steps=self.max_steps(call))

  def switch_on(self, call: PlanCall, base, length: int, dpool=None):
    """The executable that turns a plainly decoded batch into a speculative one, over rows
    of up to `length` tokens (base, params, the drafter's page pools may be abstract, for
    compiling ahead). It donates the state and the drafter's pools."""
    return self.exes.get("switch_on", None, self._switch_on_fn(call),
                         self._switch_on_args(call, base, length, dpool), donate=(2, 3))

  @staticmethod
  def _switch_off_args(call: PlanCall, state) -> tuple:
    return (call.params, state.base, state.pending, state.has_pending)

  def switch_off(self, call: PlanCall, state):
    """The executable that turns a speculating batch back into a plainly decoded one
    (spec_state.switch_off; state may be abstract: `switch_off_ahead` compiles it on the
    compile thread). It donates the target's state; the caller keeps the drafter's pools."""
    from tlt_jax.rollout import spec_state
    return self.exes.get("switch_off", None,
                         functools.partial(spec_state.switch_off, cfg=self.cfg),
                         self._switch_off_args(call, state), donate=(1,))

  def switch_off_ahead(self, call: PlanCall, state) -> None:
    """Queues switch-off's executable at a speculating batch's bucket on the compile thread
    (background compilation only; once per shape): a batch whose bucket the gate closes
    later (a probe there that declines) stops speculating without a compile in its time."""
    if state.batch_size in self._off_ahead:  # (a key over the weights' tree: not per chunk)
      return
    self._off_ahead.add(state.batch_size)
    key = ExecKey.of("switch_off", None, self._switch_off_args(call, state))
    shapes = self._abstract(state)
    self._have(key, lambda: self.switch_off(call, shapes))

  def switch_length(self, call: PlanCall, state, need: int) -> int | None:
    """The length switch-on runs at now, for rows of up to `need` tokens: the shortest of
    `switch_lengths` holding them. With background compilation, if that one is not compiled
    yet it is queued on the compile thread and the next one up runs instead if it is
    compiled; None if it is not (the rows go on decoding plainly meanwhile)."""
    fits = [n for n in self.switch_lengths() if n >= need]
    if not self.ecfg.spec.background_compile:
      return fits[0]
    # a compiled length more than twice the rows' runs a forward over more than twice their
    # tokens (at a large batch, seconds): the rows decode plainly until theirs is compiled
    compiled = [n for n in fits[:2] if self._switch_key(call, state, n) in self.exes]
    if compiled and compiled[0] == fits[0]:
      return fits[0]
    with self._lock:
      queue = (state.batch_size, fits[0]) not in self._switch_submitted
      self._switch_submitted.add((state.batch_size, fits[0]))
    if queue and self._compiler is not None:
      args = (call, self._abstract(state), fits[0])
      self._compiler.submit(lambda: self.switch_on(*args))
    return compiled[0] if compiled else None

  def _switch_key(self, call: PlanCall, state, length: int) -> ExecKey:
    return ExecKey.of("switch_on", None, self._switch_on_args(call, state, length))
