"""Runs several training commands in lockstep: one step each, in turn, never two at once.

This machine's speed drifts by up to 1.7x over minutes, more than the differences end-to-end
benchmarks look for (TLT on vs off: a few percent). Runs made one after the other see
different machines; ABBA orders cancel only a drift linear in time. In lockstep every command
is started, and exactly one of them runs at any moment: it is given the CPU (SIGCONT to its
process group: itself, its reward processes, its threads) until it writes its next record
(one line of a JSONL file: a step's metrics), then stopped (SIGSTOP) and the next one runs.
Round after round, each run's step k meets the machine within one round of every other run's
step k, so drift on the scale of a round cancels from their ratio. A run's time is the sum
of its own turns: start-up, compiles and its exit included, the others' turns excluded.

The processes stay resident while stopped (memory: the sum of the runs'), and a stopped
process's clocks go on: a command's own wall-clock timers (metrics' per-phase seconds) are
exact only between records, where turns end. A turn ends within milliseconds of its record
because the jobs run niced (+5): this loop, which polls for the record, gets a core the moment
it wakes, however busy the job keeps both.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time


@dataclasses.dataclass
class Job:
  name: str
  cmd: list[str]
  log: str  # stdout + stderr
  records: str  # the JSONL file it appends one line to per step (its turn ends there)
  cwd: str | None = None
  env: dict | None = None


@dataclasses.dataclass
class Outcome:
  seconds: float  # the sum of its turns
  turns: int
  returncode: int


def _lines(path: str) -> int:
  """Whole lines in a file (0 when it does not exist yet)."""
  try:
    with open(path, "rb") as f:
      return f.read().count(b"\n")
  except FileNotFoundError:
    return 0


def _signal(p: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:  # the group is gone: it exited
    pass


def run(jobs: list[Job], *, poll_s: float = 0.002, nice: int = 5, on_turn=None
        ) -> dict[str, Outcome]:
  """Runs `jobs` in lockstep to their ends; -> name -> Outcome. A job's turn ends when its
  records file has one more whole line than when the turn began, or when it exits. A job
  that exits non-zero stops the others (killed) and raises RuntimeError naming its log.
  on_turn(name, seconds, lines) is called after each turn (progress)."""
  procs: dict[str, subprocess.Popen] = {}
  logs = {}
  out = {j.name: Outcome(0.0, 0, 0) for j in jobs}
  live = list(jobs)
  try:
    while live:
      for j in list(live):
        seen = _lines(j.records)
        t = time.perf_counter()
        if j.name not in procs:  # its first turn starts it
          logs[j.name] = open(j.log, "w")
          # niced through nice(1), which execs the command (its pid stays the group's): a
          # preexec_fn would make Popen fork this multithreaded process (JAX's threads) and run
          # Python in the child before exec, which can deadlock
          procs[j.name] = subprocess.Popen(["nice", "-n", str(nice), *j.cmd], cwd=j.cwd,
                                           env=j.env, stdout=logs[j.name],
                                           stderr=subprocess.STDOUT, start_new_session=True)
        else:
          _signal(procs[j.name], signal.SIGCONT)
        p = procs[j.name]
        while True:
          rc = p.poll()
          if rc is not None or _lines(j.records) > seen:
            break
          time.sleep(poll_s)
        if rc is None:
          _signal(p, signal.SIGSTOP)
        o = out[j.name]
        o.seconds += time.perf_counter() - t
        o.turns += 1
        if on_turn is not None:
          on_turn(j.name, o.seconds, _lines(j.records))
        if rc is not None:
          o.returncode = rc
          live.remove(j)
          logs.pop(j.name).close()
          if rc != 0:
            raise RuntimeError(f"run {j.name} failed (exit {rc}); see {j.log}")
  finally:
    for p in procs.values():
      if p.poll() is None:
        _signal(p, signal.SIGKILL)
        _signal(p, signal.SIGCONT)
        p.wait()
    for f in logs.values():
      f.close()
  return out
