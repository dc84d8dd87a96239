"""Runs a program as N JAX processes on this host (CPU devices), the way srun would on a cluster.

Not a test module: the multi-process tests import `launch` from here. Each process is a fresh
interpreter (the pytest process has already started JAX with 8 devices) with its own
XLA_FLAGS device count, JAX_PLATFORMS=cpu, and the explicit launch variables
tlt_jax.distributed reads (TLT_COORDINATOR_ADDRESS on a free 127.0.0.1 port,
TLT_NUM_PROCESSES, TLT_PROCESS_ID). Slurm / Open MPI variables of the caller are removed so
a test run inside an allocation is still a launch by hand.

  results = launch("tests/mp_workers/collectives.py", 2, devices_per_process=4, timeout=90)
  results = launch("tlt_jax.train", 2, 4, args=["--config", "configs/default.py", ...])
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Mapping, Sequence

from tests.user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DROP = re.compile(r"^(SLURM_|SLURMD_|OMPI_|PMIX_|PMI_|JAX_COORDINATOR|JAX_LOCAL_DEVICE_IDS$|"
                   r"JAX_NUM_CPU_DEVICES$|TLT_)")


@dataclasses.dataclass
class Result:
  """One process's outcome; `end` is time.monotonic() at its exit (or kill)."""
  process_id: int
  returncode: int
  stdout: str
  stderr: str
  seconds: float
  end: float
  timed_out: bool = False

  def tail(self, n: int = 30) -> str:
    lines = [f"--- process {self.process_id}: rc={self.returncode} after {self.seconds:.1f} s"
             + (" (killed at the timeout)" if self.timed_out else "")]
    lines += self.stdout.strip().splitlines()[-n:]
    lines += ["  [stderr]"] + self.stderr.strip().splitlines()[-n:]
    return "\n".join(lines)


def describe(results: Sequence[Result], n: int = 30) -> str:
  """Every process's exit status and output tails, for an assertion message."""
  return "\n".join(r.tail(n) for r in results)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def command(target: str, args: Sequence[str]) -> list[str]:
  """`python script.py args` for a path, `python -m module args` for a module name."""
  if target.endswith(".py") or os.sep in target:
    path = target if os.path.isabs(target) else os.path.join(ROOT, target)
    return [sys.executable, "-u", path, *args]
  return [sys.executable, "-u", "-m", target, *args]


def process_env(process_id: int, n_processes: int, devices_per_process: int, port: int,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of process `process_id`: the caller's, minus launcher variables, plus
  the CPU device count and the explicit launch variables."""
  env = {k: v for k, v in os.environ.items() if not _DROP.match(k)}
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
  env["XLA_FLAGS"] = env["XLA_FLAGS"].strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p])
  env["TLT_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
  env["TLT_NUM_PROCESSES"] = str(n_processes)
  env["TLT_PROCESS_ID"] = str(process_id)
  env.update(extra or {})
  return user_env(env)  # torch hidden, as a user's install has it


def _kill(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the process and its children (reward workers, ...)
  except (ProcessLookupError, PermissionError):
    pass


def launch(target: str, n_processes: int, devices_per_process: int = 4,
           args: Sequence[str] | Callable[[int], Sequence[str]] = (),
           timeout: float = 120.0,
           env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
           cwd: str = ROOT) -> list[Result]:
  """Starts `n_processes` copies of `target` (a script path or a module name) and waits for
  all of them, at most `timeout` seconds in all; stragglers are killed (with their children)
  and marked timed_out. `args` / `env` may be functions of the process id (per-process argv,
  extra environment). Returns one Result per process, in process order."""
  port = free_port()
  procs, files, starts = [], [], []
  try:
    for i in range(n_processes):
      argv = args(i) if callable(args) else args
      extra = env(i) if callable(env) else env
      out = tempfile.TemporaryFile(mode="w+", prefix=f"mp{i}_out")
      err = tempfile.TemporaryFile(mode="w+", prefix=f"mp{i}_err")
      files.append((out, err))
      starts.append(time.monotonic())
      procs.append(subprocess.Popen(
          command(target, argv), cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
          env=process_env(i, n_processes, devices_per_process, port, extra),
          start_new_session=True))
    deadline = starts[0] + timeout
    ends: list[float | None] = [None] * n_processes
    while any(e is None for e in ends) and time.monotonic() < deadline:
      for i, p in enumerate(procs):
        if ends[i] is None and p.poll() is not None:
          ends[i] = time.monotonic()
      time.sleep(0.05)
    timed_out = [e is None for e in ends]
    for i, p in enumerate(procs):
      if timed_out[i]:
        _kill(p)
        p.wait()
        ends[i] = time.monotonic()
      else:
        _kill(p)  # leftover children of a finished process
    results = []
    for i, p in enumerate(procs):
      out, err = files[i]
      out.seek(0)
      err.seek(0)
      results.append(Result(i, p.returncode, out.read(), err.read(), ends[i] - starts[i],
                            ends[i], timed_out[i]))
    return results
  finally:
    for p in procs:
      if p.poll() is None:
        _kill(p)
        p.wait()
    for out, err in files:
      out.close()
      err.close()
