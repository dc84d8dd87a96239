"""The compile plan's third grid: attention windows. Decoding reads cache slots [0, kv_len)
only (`kv_len`), so a speculative executable exists per (bucket, arm, window). An arm's
window not compiled yet is one more executable: a chunk runs the narrowest compiled window
that holds its rows while the rows' own compiles on the compile thread (queued ahead of
everything not started: a running chunk needs it), and with a gate a window narrower than one
compiled is compiled only when what it saves repays its compile (`_window_pays`: the gate's
payoff rule, payoff.py), and a wider one runs only while the arm's tokens per verification
outweigh the extra bytes it reads (`runs_wide`), so a run's speculative executables do not
multiply by the windows its tail visits unless reading fewer slots pays for them.

`Windows` is a part of `CompilePlan` (compile_plan.py), which owns what it reads: the engine
config (`ecfg`), the executable cache (`exes`), the compile thread (`_submit`, `_compiler`),
the lock and the counters `_needs`, `_window_submitted`, `rollouts`, `_bytes`, and
`_spec_key`, `spec`, `_abstract`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import length_grid
from tlt_jax.rollout.policies.strategy import Strategy


class Windows:
  """The attention-window rules (module docstring)."""

  def window(self, call: PlanCall, sp: SamplingParams, arm: Strategy | None, state,
             need: int, urgent: bool = True) -> int:
    """The attention window of a chunk (plain: arm None) whose rows reach `need` cache slots
    (the longest row + `chunk_reach`): the `kv_bucket` holding them. A speculative window not
    compiled yet is one more executable of the arm: with a gate, where a wider one that holds
    the rows is compiled, the narrower one is compiled only when what it saves repays it
    (`_window_pays`), else the wider one runs. With background compilation a window to compile
    is queued on the compile thread (`urgent`: before every job not started) and the
    narrowest compiled one that holds the rows runs meanwhile (the whole cache's is compiled
    with each bucket's first arm): no chunk waits."""
    ecfg = self.ecfg
    kv_len = ecfg.window_for(need)
    if arm is None:
      return kv_len
    abstract = self._abstract(state)
    with self._lock:
      key = (state.batch_size, arm, kv_len)
      self._needs[key] = self._needs.get(key, 0) + 1
    wider = self._compiled_window(call, sp, arm, abstract, kv_len)
    if wider == kv_len:
      return kv_len
    if wider is not None and not self._window_pays(call, state.batch_size, arm, kv_len, wider):
      return wider
    if not ecfg.spec.background_compile or self._compiler is None:
      return kv_len
    with self._lock:
      queue = key not in self._window_submitted
      self._window_submitted.add(key)
    if queue:
      args = (call, sp, arm, abstract, kv_len)
      self._submit(lambda: self.spec(*args), urgent=urgent)
    return wider if wider is not None else ecfg.cache_len

  def want(self, call: PlanCall, sp: SamplingParams, arm: Strategy, state, need: int,
           urgent: bool = False) -> None:
    """A chunk's policies want `arm` (the bandit exploring it, a probe measuring it) where it
    cannot run the rows without a compile (`fits`): its rows' window is queued on the compile
    thread behind what is queued (the chunk runs an arm that fits meanwhile), as `window`
    would for a chunk of it; one at a time per bucket (rows that outgrow it meanwhile want
    the next). urgent: before every compile not started (`_submit`: a probe's verdict, or a
    batch whose measured arms all gave way to plain decoding, waits on this one; the 7B
    recipe at a per-draft 0.3, its probe's third arm queued behind the arms under the
    probe, was judged three rollouts late)."""
    abstract = self._abstract(state)
    if any(self._spec_key(call, sp, arm, abstract, n) not in self.exes
           for n in self._queued_windows(state.batch_size, arm)):
      return
    self.window(call, sp, arm, state, need, urgent=urgent)

  def fits(self, call: PlanCall, sp: SamplingParams, arm: Strategy, state, need: int) -> bool:
    """Whether a chunk of `arm` whose rows reach `need` slots has a compiled window to run at
    without losing to plain decoding (`runs_wide`; nothing queued, nothing counted: `window`
    does that). Compiling as it runs (no background compilation): always."""
    ecfg = self.ecfg
    if not ecfg.spec.background_compile or self._compiler is None:
      return True
    b = state.batch_size
    with self._lock:  # (nothing of the arm compiled or queued here: no key to look up)
      ahead = any((b, arm) in d.get(sp, ()) for d in (self._ready, self._submitted))
    if not ahead and not self._queued_windows(b, arm):
      return False
    want = ecfg.window_for(need)
    have = self._compiled_window(call, sp, arm, self._abstract(state), want)
    return have is not None and self.runs_wide(call, state.batch_size, arm, have, want)

  def _queued_windows(self, batch: int, arm: Strategy) -> list[int]:
    """The windows of `arm` at bucket `batch` queued by `window` (compiled or not)."""
    with self._lock:
      return [n for b, a, n in self._window_submitted if (b, a) == (batch, arm)]

  def _compiled_window(self, call: PlanCall, sp, arm: Strategy, abstract, want: int):
    """The narrowest window >= `want` compiled for `arm` at the state's bucket (None: none)."""
    return next((n for n in length_grid(self.ecfg.prompt_bucket, self.ecfg.cache_len)
                 if n >= want and self._spec_key(call, sp, arm, abstract, n) in self.exes), None)

  def runs_wide(self, call: PlanCall, batch: int, arm: Strategy, have: int, want: int) -> bool:
    """Whether a speculative chunk of `arm` may run at window `have` (`window`'s answer)
    when its rows need `want`: with a gate, the gate's rule on the bytes a step reads at each
    (funding.runs_wide); else always."""
    gate = call.gate
    if gate is None or have <= want:
      return True
    return gate.runs_wide(batch, arm, self.step_bytes(call, batch, have) /
                          self.step_bytes(call, batch, want))

  def step_bytes(self, call: PlanCall, batch: int, window: int) -> float:
    """Bytes one decode step of the replica reads: the weights and, per row, its attention
    window's KV slots (the target's layers and the drafter's one)."""
    if self._bytes is None:  # (weight bytes, KV bytes per cache slot)
      leaves = jax.tree.leaves([call.params, call.drafter_params])
      weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
      itemsize = jnp.dtype(self.cfg.compute_dtype).itemsize
      slot = (self.cfg.num_layers + 1) * 2 * self.cfg.num_kv_heads * self.cfg.head_dim_ * itemsize
      self._bytes = (weights, slot)
    weights, slot = self._bytes
    return float(weights + batch * window * slot)

  def _window_pays(self, call: PlanCall, batch: int, arm: Strategy, want: int, have: int) -> bool:
    """The gate's payoff rule for compiling window `want` of (batch, arm) while `have` runs
    (no gate: always): chunks needing it per generate call so far, and the share of a step's
    bytes it would not read (the KV slots between the two windows, of the weights and KV a
    step at `have` reads: decoding at small batch is bound by those bytes)."""
    gate = call.gate
    if gate is None:
      return True
    share = 1 - self.step_bytes(call, batch, want) / self.step_bytes(call, batch, have)
    with self._lock:
      per_rollout = self._needs.get((batch, arm, want), 0) / max(self.rollouts, 1)
    return gate.repays_window(batch, arm, per_rollout, share)
