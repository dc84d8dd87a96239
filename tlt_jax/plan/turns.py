"""The simulated workers of one rollout decoding side by side (sim.py): each worker's generate
call in a thread of its own, one chunk at a time in the order of their simulated clocks.

A run's workers decode at once and share the rollout's cells of the gate and the bandit: a
probe that pays on the prober mid-rollout reaches every other worker mid-call, at the moment
it was measured. Simulated one whole call after another, the workers after the prober had
started their calls with its verdict already in (their arms compiling from the rollout's
start, not from the verdict's moment: the simulator's step 2 over-stated). Here the worker
whose clock is earliest runs its next chunk (ties: the lower worker id), so every worker's
chunk sees the shared cells as they were at that simulated moment. Exactly one thread runs
at a time: the simulation stays deterministic, and nothing the engines share needs more than
the locks it already has. The calls start in worker order, each up to its first chunk (the
first to begin a rollout is the gate's prober, as worker 0 is in a run's coordinator)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence


class Turns:
  """Whose chunk runs next: the started worker with the earliest clock (the lower id on a
  tie); a worker not started yet goes first (in id order), so calls start in worker order."""

  def __init__(self, n: int, t0: float):
    self.clock = [t0] * n
    self.active = set(range(n))
    self.started: set[int] = set()
    self.go = [threading.Event() for _ in range(n)]
    self.lock = threading.Lock()

  def _next(self) -> int | None:
    return min(self.active, key=lambda j: (j in self.started, self.clock[j], j), default=None)

  def _hand_on(self, i: int | None) -> None:
    """(Under the lock) wakes the worker whose turn it is, unless it is `i`'s own."""
    nxt = self._next()
    if nxt is not None and nxt != i:
      self.go[nxt].set()

  def begin(self) -> None:
    """The first call's turn (worker 0's)."""
    with self.lock:
      self._hand_on(None)

  def start(self, i: int) -> None:
    """Worker i's call begins (its turn came: `run`)."""
    with self.lock:
      self.started.add(i)

  def wait(self, i: int, now: float) -> None:
    """Before worker i's next chunk, its clock at `now`: returns once it is its turn."""
    with self.lock:
      self.clock[i] = now
      if self._next() == i:
        return
      self.go[i].clear()
      self._hand_on(i)
    self.go[i].wait()

  def done(self, i: int) -> None:
    """Worker i's call has returned (or raised): the next worker's turn."""
    with self.lock:
      self.active.discard(i)
      self._hand_on(None)


def run(calls: Sequence[Callable[[Callable[[], None]], None]],
        clocks: Sequence[Callable[[], float]], t0: float) -> None:
  """Runs `calls[i](before_chunk)` for every worker i, each in a thread, taking turns by
  `clocks[i]()` at each `before_chunk()` (module docstring). Re-raises the first worker's
  exception once every call has returned."""
  turns = Turns(len(calls), t0)
  errors: list[BaseException] = []

  def body(i: int) -> None:
    turns.go[i].wait()
    turns.start(i)
    try:
      calls[i](lambda: turns.wait(i, clocks[i]()))
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
      errors.append(e)
    finally:
      turns.done(i)

  threads = [threading.Thread(target=body, args=(i,), daemon=True,
                              name=f"simulated-worker-{i}") for i in range(len(calls))]
  for t in threads:
    t.start()
  turns.begin()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
