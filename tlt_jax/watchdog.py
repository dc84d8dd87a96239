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

With several processes the clock is the job's (`peers`: distributed.ProgressBoard, each
process's latest progress in the coordination service's store): a process waiting on others'
work (a straggler's rollout, process 0's evaluation) is not hung while they progress; when
none does, every process reports its stacks and exits.

`beat()` is a module-level stamp, not state threaded through the calls: like logging, the
loops that call it are many and deep (the engines' worker threads among them), it costs an
assignment, and with no watchdog running it means nothing.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Any, Callable

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the same command may succeed

_last = time.monotonic()  # the latest beat (time.monotonic)
_where = "start"  # what the latest `beat` named


def beat(where: str | None = None) -> None:
  """Progress: a chunk decoded, a micro-batch stepped, a tensor written. `where` names the
  phase the hang report will say the run was in (None: the phase named last)."""
  global _last, _where
  _last = time.monotonic()
  if where is not None:
    _where = where


class Watchdog:
  """Ends this process when no `beat()` came for `timeout_s` seconds (0: never), between
  `start()` and `stop()` (or inside it as a context). `step` (a callable) says how many RL
  steps are done, for the report; `peers` (`publish(t)`, `latest()`: wall-clock seconds) shares
  progress between the job's processes; `on_hang` replaces the exit (tests)."""

  def __init__(self, timeout_s: float, report_dir: str, process: int = 0,
               step: Callable[[], int] | None = None, peers: Any = None,
               on_hang: Callable[[str], None] | None = None):
    self.timeout_s = float(timeout_s)
    self.peers = peers
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
    if self._thread is not None:
      self._thread.join()

  def __enter__(self) -> Watchdog:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def _watch(self) -> None:
    # a 30th of the timeout (a minute at the default 1800 s): each look is a key written and
    # the job's keys read at the coordination service, every process
    period = min(max(self.timeout_s / 30, 0.05), 60.0)
    while not self._stop.wait(period):
      now = time.time()
      last = now - (time.monotonic() - _last)  # this process's latest progress, wall clock
      if self.peers is not None:
        try:
          self.peers.publish(last)
          last = max(last, self.peers.latest())
        except Exception:  # noqa: BLE001 - the service gone: a peer died, which ends this
          pass  # process anyway; meanwhile its own progress decides
      quiet = now - last
      if quiet >= self.timeout_s:
        self._hang(quiet)
        return

  def _hang(self, quiet: float) -> None:
    done = self.step()
    who = ("no process of the job made progress" if self.peers is not None
           else f"process {self.process} made no progress")
    msg = (f"hang: {who} for {quiet:.0f} s (train.hang_timeout_s={self.timeout_s:g}) "
           f"{f'after step {done}' if done else 'before the first step'}; process "
           f"{self.process} last in {_where}; every thread's stack follows (the main thread's "
           f"innermost call is where it waits). Exiting with {EXIT_CODE} so the other "
           "processes stop too; the same command resumes from the newest checkpoint")
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
