"""One rollout worker's drafter copy and its train step: the JAX side of spot training.

tlt_jax/coordinator/spot.py `train_until` drives it (its `Trainer` protocol) in the worker's
idle windows; serial training drives it after the policy update. The step is
tlt_jax/drafter/train_step.py's, fed from the shared DrafterBuffer.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from tlt_jax import watchdog
from tlt_jax.drafter.packing import fill_batch
from tlt_jax.drafter.train_step import program_of
from tlt_jax.rollout.executables import compile_shared
from tlt_jax.sharding import local_view, replicated


class DrafterTrainer:
  """One worker's drafter copy on its mesh. `target_params()` returns the worker's current
  actor params (the frozen embedding / LM head the loss reads)."""

  def __init__(self, *, step_fn: Callable, shardings: Any, buffer, rows: int, row_len: int,
               target_params: Callable[[], Any], seed: int = 0, hidden_dtype=None):
    self._step_fn, self._shardings = step_fn, shardings
    self.buffer, self.rows, self.row_len = buffer, rows, row_len
    self._target = target_params
    self._seed = seed
    self.reseed(0)
    self._hidden_dtype = np.dtype(hidden_dtype or np.float32)
    self._exe = None  # the AOT-compiled step (`compile`), else the jitted function
    self.ported = False  # `compile` loaded it from another worker's compile
    self._compiling = None  # Future of a background `compile`
    self._deferred = None  # (hidden_size, executor): compile at the first next_batch
    self.state = None
    self._pending_metrics: list[Any] = []

  def load(self, state) -> None:
    # The store's drafter on this worker's devices (its slices of the rollout layout; with
    # several processes the only way to reach them), then a copy even where the layout
    # matches: the train step donates this state, which must not delete the store's.
    view = local_view(state, self._shardings)
    self.state = jax.device_put(state if view is None else view, self._shardings,
                                may_alias=False)

  def reseed(self, seed) -> None:
    """The batches this trainer draws next are a function of `seed` (the coordinator passes
    (rollout seed, worker)), not of how many it drew before: resume stays reproducible."""
    self._rng = np.random.default_rng([self._seed, *np.atleast_1d(seed).tolist(), 83])

  def compile_on_first_use(self, hidden_size: int, executor) -> None:
    """`compile` on `executor` (a low-priority compile thread) at the first `prepare` (the
    coordinator's, when a rollout starts whose idle windows will train) or batch asked for:
    a run whose spot training never starts (the speculation gate found that drafts cannot pay
    on this hardware) never compiles it. Until it is done this trainer has no batch to train
    on, so an idle worker waits instead of compiling in its window."""
    self._deferred = (hidden_size, executor)

  def prepare(self):
    """Starts a deferred compile (`compile_on_first_use`) if none ran yet. Returns its Future
    (done once the step is compiled), None where nothing was deferred."""
    if self._deferred is not None and self._exe is None and self._compiling is None:
      hidden_size, executor = self._deferred
      self._compiling = executor.submit(self.compile, hidden_size)
    return self._compiling

  def next_batch(self):
    self.prepare()
    if self._compiling is not None and not self._compiling.done():
      return None
    out = fill_batch(lambda n: self.buffer.sample(n, self._rng), self.rows, self.row_len,
                     hidden_dtype=self._hidden_dtype)
    return None if out is None else out[0]

  def compile(self, hidden_size: int) -> float:
    """Compiles the train step for this worker's batch shape ahead of time (call once the
    state is loaded), so the first idle window trains instead of compiling. Returns seconds."""
    t0 = time.perf_counter()
    rep = self._replicated()
    shapes = {"tokens": ((self.rows, self.row_len), np.int32),
              "positions": ((self.rows, self.row_len), np.int32),
              "segment_ids": ((self.rows, self.row_len), np.int32),
              "loss_mask": ((self.rows, self.row_len), np.float32),
              "hidden": ((self.rows, self.row_len, hidden_size), self._hidden_dtype)}
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=rep) for k, (shape, dt) in shapes.items()}
    args = (self.state, self._target(), batch)
    # (the workers' steps are one program: compiled once, loaded onto each worker's devices)
    self._exe, self.ported = compile_shared(program_of(self._step_fn),
                                            lambda: self._step_fn.lower(*args), args)
    return time.perf_counter() - t0

  def dispatch(self, batch):
    rep = self._replicated()
    dev = jax.device_put(batch, {k: rep for k in batch})
    return (self._exe or self._step_fn)(self.state, self._target(), dev)

  def _replicated(self):
    return replicated(jax.tree.leaves(self._shardings)[0].mesh)

  @staticmethod
  def ready(inflight) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(inflight[1]))

  def commit(self, inflight) -> None:
    watchdog.beat()
    self.state, metrics = inflight
    self._pending_metrics.append(metrics)

  def discard(self, inflight) -> None:
    del inflight

  def take_metrics(self) -> list[dict[str, float]]:
    """Metrics of the steps committed since the last call (host floats)."""
    out = [{k: float(v) for k, v in m.items()} for m in jax.device_get(self._pending_metrics)]
    self._pending_metrics = []
    return out
