"""Spot drafter training: a worker whose share of the rollout is done trains its copy of the
drafter on its own devices until the global rollout barrier.

`train_until` is the worker-side loop (host logic over the small trainer interface below, so
tests drive it with fakes and no JAX): while the barrier is not set, draw a packed batch from
the buffer, dispatch one step, pack the next batch while the device works, and wait for the
step watching the barrier. At the barrier the in-flight step either finishes (`finish`: the
rollout waits at most one drafter step) or is dropped (`drop`: the worker's state stays the
last finished step, nothing waits; on a shared device the dropped step still runs to its end).

The JAX side, `Trainer` below, is tlt_jax/drafter/trainer.py's DrafterTrainer: a DrafterState on
the worker's mesh and the one train step of tlt_jax/drafter/train_step.py, fed from the shared
DrafterBuffer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

import jax

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
    with jax.profiler.TraceAnnotation(f"worker {worker}: drafter step"):
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
