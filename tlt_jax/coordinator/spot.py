"""Spot drafter training: a worker whose share of the rollout is done trains its copy of the
drafter on its own devices until the global rollout barrier.

`train_until` is the worker-side loop (host logic over the small trainer interface below, so
tests drive it with fakes and no JAX): while the barrier is not set, draw a packed batch from
the buffer, dispatch one step, pack the next batch while the device works, and wait for the
step watching the barrier. At the barrier the in-flight step either finishes (`finish`: the
rollout waits at most one drafter step) or is dropped (`drop`: the worker's state stays the
last finished step, nothing waits; on a shared device the dropped step still runs to its end).

`DrafterTrainer` is the JAX side: a DrafterState on the worker's mesh and the one train step
of tlt_jax/drafter/train_step.py, fed from the shared DrafterBuffer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np

from tlt_jax.coordinator.timeline import Timeline, WorkerState
from tlt_jax.errors import ConfigError

MODES = ("off", "spot", "serial")
ON_BARRIER = ("finish", "drop")


@dataclasses.dataclass(frozen=True)
class SpotConfig:
  mode: str = "spot"  # off: drafter frozen; spot: idle workers; serial: after the update
  on_barrier: str = "finish"  # in-flight step at the barrier: finish it or drop it
  serial_steps: int = 4  # drafter steps per RL step in serial mode
  poll_s: float = 0.002  # how often a waiting worker looks at the barrier

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f"use one of {', '.join(MODES)}", "mode", self.mode)
    if self.on_barrier not in ON_BARRIER:
      raise ConfigError("use 'finish' or 'drop'", "on_barrier", self.on_barrier)
    if self.serial_steps < 0:
      raise ConfigError("must be >= 0", "serial_steps", self.serial_steps)


class Trainer(Protocol):
  """What the spot loop needs of a worker's drafter trainer."""

  def prepare(self) -> Any: ...  # idle windows will train: get ready (-> a compile's Future)
  def reseed(self, seed: Any) -> None: ...  # batch draws of a rollout: a function of its seed
  def next_batch(self) -> Any | None: ...  # host batch, None when there is no data yet
  def dispatch(self, batch: Any) -> Any: ...  # starts one step (async); -> in-flight handle
  def ready(self, inflight: Any) -> bool: ...
  def commit(self, inflight: Any) -> None: ...  # the step's state becomes the trainer's
  def discard(self, inflight: Any) -> None: ...  # the step's result is thrown away


@dataclasses.dataclass
class SpotReport:
  steps: int = 0
  dropped: int = 0
  waited_for_data_s: float = 0.0


def train_until(trainer: Trainer, barrier: threading.Event, *, on_barrier: str = "finish",
                timeline: Timeline | None = None, worker: int = 0, poll_s: float = 0.002,
                max_steps: int | None = None) -> SpotReport:
  """Trains until `barrier` is set (or `max_steps`); see the module docstring. The worker is
  IDLE while it waits for data, TRAINING from its first step on."""
  rep = SpotReport()
  batch = trainer.next_batch()
  training = False
  while not barrier.is_set() and (max_steps is None or rep.steps < max_steps):
    if batch is None:
      if max_steps is not None:  # a bounded run (serial mode) does not wait for data
        break
      t = time.perf_counter()
      barrier.wait(poll_s)
      rep.waited_for_data_s += time.perf_counter() - t
      batch = trainer.next_batch()
      continue
    if not training and timeline is not None:
      timeline.enter(worker, WorkerState.TRAINING)
    training = True
    inflight = trainer.dispatch(batch)
    batch = trainer.next_batch()  # host packing overlaps the device step
    dropped = False
    while not trainer.ready(inflight):
      if barrier.wait(poll_s) and on_barrier == "drop":
        trainer.discard(inflight)
        rep.dropped += 1
        dropped = True
        break
    if dropped:
      break
    trainer.commit(inflight)
    rep.steps += 1
  return rep


# ----------------------------------------------------------------------------------- JAX side
class DrafterTrainer:
  """One worker's drafter copy on its mesh. `target_params()` returns the worker's current
  actor params (the frozen embedding / final norm / LM head the loss reads)."""

  def __init__(self, *, step_fn: Callable, shardings: Any, buffer, rows: int, row_len: int,
               target_params: Callable[[], Any], seed: int = 0, hidden_dtype=None):
    self._step_fn, self._shardings = step_fn, shardings
    self.buffer, self.rows, self.row_len = buffer, rows, row_len
    self._target = target_params
    self._seed = seed
    self.reseed(0)
    self._hidden_dtype = np.dtype(hidden_dtype or np.float32)
    self._exe = None  # the AOT-compiled step (`compile`), else the jitted function
    self._compiling = None  # Future of a background `compile`
    self._deferred = None  # (hidden_size, executor): compile at the first next_batch
    self.state = None
    self._pending_metrics: list[Any] = []

  def load(self, state) -> None:
    import jax

    from tlt_jax.sharding import local_view
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
    from tlt_jax.drafter.packing import fill_batch
    self.prepare()
    if self._compiling is not None and not self._compiling.done():
      return None
    out = fill_batch(lambda n: self.buffer.sample(n, self._rng), self.rows, self.row_len,
                     hidden_dtype=self._hidden_dtype)
    return None if out is None else out[0]

  def compile(self, hidden_size: int) -> float:
    """Compiles the train step for this worker's batch shape ahead of time (call once the
    state is loaded), so the first idle window trains instead of compiling. Returns seconds."""
    import time

    import jax
    t0 = time.perf_counter()
    rep = self._replicated()
    shapes = {"tokens": ((self.rows, self.row_len), np.int32),
              "positions": ((self.rows, self.row_len), np.int32),
              "segment_ids": ((self.rows, self.row_len), np.int32),
              "loss_mask": ((self.rows, self.row_len), np.float32),
              "hidden": ((self.rows, self.row_len, hidden_size), self._hidden_dtype)}
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=rep) for k, (shape, dt) in shapes.items()}
    self._exe = self._step_fn.lower(self.state, self._target(), batch).compile()
    return time.perf_counter() - t0

  def dispatch(self, batch):
    import jax
    rep = self._replicated()
    dev = jax.device_put(batch, {k: rep for k in batch})
    return (self._exe or self._step_fn)(self.state, self._target(), dev)

  def _replicated(self):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(jax.tree.leaves(self._shardings)[0].mesh, P())

  @staticmethod
  def ready(inflight) -> bool:
    import jax
    return all(x.is_ready() for x in jax.tree.leaves(inflight[1]))

  def commit(self, inflight) -> None:
    self.state, metrics = inflight
    self._pending_metrics.append(metrics)

  def discard(self, inflight) -> None:
    del inflight

  def take_metrics(self) -> list[dict[str, float]]:
    """Metrics of the steps committed since the last call (host floats)."""
    import jax
    out = [{k: float(v) for k, v in m.items()} for m in jax.device_get(self._pending_metrics)]
    self._pending_metrics = []
    return out
