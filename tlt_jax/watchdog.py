"""A run that stops making progress while its processes stay alive ends, with every thread's
stack, instead of holding its GPUs forever.

The coordination service (distributed.py) ends a job whose process died; it cannot see one
that is alive and stuck: a collective whose peer never comes (NCCL has no timeout for it: a
job then waits until something outside kills it), a filesystem that stops answering, a
deadlock. The loops that make progress call `beat()` (each rollout chunk, each learner
micro-batch, each exported tensor, each step's phases); while a `Watchdog` runs, a daemon
thread checks that a beat came within `timeout_s`. When none did, it prints what the run
was doing and each thread's Python stack (faulthandler's), writes the same to
<workdir>/hang.<process>.txt, and exits this process with `EXIT_CODE` (75, EX_TEMPFAIL:
try again) at once: the coordination service then ends the job's other processes (within
its heartbeat_timeout), and the same command resumes from the newest checkpoint, which a
hang does not touch (a save in flight is not committed and is set aside on restore).

A process that waits on another one's work, not its own (the others while process 0 evaluates
the held-out set), pauses its clock (`paused`): the process doing the work keeps its own, and
if that one hangs its exit ends the waiting ones too.

`beat()` is a module-level stamp, not state threaded through the calls: like logging, the
loops that call it are many and deep (the engines' worker threads among them), it costs an
assignment, and with no watchdog running it means nothing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Iterator

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the same command may succeed

_last = time.monotonic()  # the latest beat (time.monotonic)
_where = "start"  # what the latest `beat` named
_paused = 0  # `paused` contexts open: no clock while > 0


def beat(where: str | None = None) -> None:
  """Progress: a chunk decoded, a micro-batch stepped, a tensor written. `where` names the
  phase the hang report will say the run was in (None: the phase named last)."""
  global _last, _where
  _last = time.monotonic()
  if where is not None:
    _where = where


@contextlib.contextmanager
def paused(on: bool = True) -> Iterator[None]:
  """No clock inside (where `on`): this process waits on another's work, whose own watchdog
  runs. Leaving is progress."""
  global _paused
  if not on:
    yield
    return
  _paused += 1
  try:
    yield
  finally:
    _paused -= 1
    beat()


class Watchdog:
  """Ends this process when no `beat()` came for `timeout_s` seconds (0: never), between
  `start()` and `stop()` (or inside it as a context). `step` (a callable) says how many RL
  steps are done, for the report; `on_hang` replaces the exit (tests)."""

  def __init__(self, timeout_s: float, report_dir: str, process: int = 0,
               step: Callable[[], int] | None = None,
               on_hang: Callable[[str], None] | None = None):
    self.timeout_s = float(timeout_s)
    self.report_dir = report_dir
    self.process = process
    self.step = step or (lambda: 0)
    self.on_hang = on_hang
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> Watchdog:
    beat("start")
    if self.timeout_s > 0 and self._thread is None:
      self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()

  def __enter__(self) -> Watchdog:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def _watch(self) -> None:
    period = min(max(self.timeout_s / 10, 0.05), 10.0)
    while not self._stop.wait(period):
      quiet = time.monotonic() - _last
      if quiet >= self.timeout_s and not _paused:
        self._hang(quiet)
        return

  def _hang(self, quiet: float) -> None:
    done = self.step()
    msg = (f"hang: process {self.process} made no progress for {quiet:.0f} s "
           f"(train.hang_timeout_s={self.timeout_s:g}) "
           f"{f'after step {done}' if done else 'before the first step'}, last in "
           f"{_where}; every thread's stack follows (the main thread's innermost call is where "
           f"it waits). Exiting with {EXIT_CODE} so the other processes stop too; the same "
           "command resumes from the newest checkpoint")
    print(msg, file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    try:
      os.makedirs(self.report_dir, exist_ok=True)
      with open(os.path.join(self.report_dir, f"hang.{self.process}.txt"), "w") as f:
        f.write(msg + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError as e:  # (a workdir that stopped answering may be the hang itself)
      print(f"hang: the report was not written: {e}", file=sys.stderr, flush=True)
    if self.on_hang is not None:
      self.on_hang(msg)
      return
    os._exit(EXIT_CODE)  # no atexit, no JAX shutdown barrier: that would wait on the hang
