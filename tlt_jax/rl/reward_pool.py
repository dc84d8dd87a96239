"""Rewards in a pool of worker processes, with a per-call timeout.

Why processes: a reward function is user code (sympy, regexes on model output, a sandbox).
One that crashes, hangs on a pathological expression, or leaks memory must cost one reward,
not the run: a failed or timed-out call gives 0.0 and is counted, a hung or dead worker is
killed and replaced, and training goes on. Workers are plain subprocesses speaking JSON lines
(`tlt_jax.rl.reward_worker`), so nothing of the JAX parent (threads, device handles) is
forked into them.

Why every wait has a deadline: a serving thread that dies or blocks leaves `gather` waiting
for rewards that never come, and the run hangs with no error. So a worker's start-up and each
call (write, compute, reply) have deadlines; any exception in a serving thread is one crashed
call (scored 0, counted, worker replaced); workers that repeatedly cannot be started stop the
pool with the start-up error; and `gather` raises when no call has finished for longer than a
call can take.

Why a pool fed as responses finish: `submit` is called from the rollout engine's `on_result`
hook, so scoring overlaps the long tail of decoding instead of following it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any, Hashable

from tlt_jax import watchdog

_log = logging.getLogger(__name__)

# Worker starts that may fail in a row (no successful start in between) before the pool stops.
# One failure can be transient (fork under memory pressure); repeated ones mean the reward no
# longer loads, and scoring every response 0 from then on would silently train on noise.
MAX_START_FAILURES = 3
# Slack on top of the longest one call can take (start-up + timeout) before `gather` decides
# the pool has stopped making progress: reaping killed workers, thread scheduling on a busy host.
_STALL_MARGIN_S = 5.0
# How long to wait for a SIGKILLed worker to be reaped; one stuck in the kernel is left behind
# rather than blocking a serving thread.
_REAP_TIMEOUT_S = 2.0
# A protocol line is a few hundred bytes; a longer one means the pipe carries something else.
_MAX_LINE_BYTES = 1 << 20


class RewardError(RuntimeError):
  """The reward function cannot be used at all (e.g. it does not import)."""


@dataclasses.dataclass
class RewardStats:
  calls: int = 0
  errors: int = 0  # the function raised / returned a non-number
  timeouts: int = 0  # exceeded the per-call timeout (worker killed and replaced)
  crashes: int = 0  # the worker died mid-call or broke the protocol (killed and replaced)
  respawn_failures: int = 0  # no replacement worker could be started for the call
  seconds: float = 0.0  # summed worker time


def _named(name: str, msg: str) -> str:
  return msg if msg.startswith("config.reward.name") else f"config.reward.name={name!r}: {msg}"


def _wait_fd(fd: int, events: int, seconds: float) -> bool:
  """Whether `fd` is ready within `seconds`. poll(), not select(): a training process can hold
  more than FD_SETSIZE (1024) descriptors, which select() rejects."""
  poller = select.poll()
  poller.register(fd, events)
  return bool(poller.poll(math.ceil(max(seconds, 0.0) * 1000)))


class _StartFailed(Exception):
  """A replacement worker could not be started; the message is the user-facing reason."""


class _Worker:
  """One worker process. Every wait on it has a deadline, so a serving thread never blocks
  forever on a process that hangs or stops reading."""

  def __init__(self, name: str, env: dict[str, str], startup_timeout: float):
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_jax.rl.reward_worker", name], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=None, bufsize=0, env=env)
    self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
    self._buf = b""
    try:
      os.set_blocking(self._in, False)  # a large task must not block past the call's deadline
      line = self._read_line(time.monotonic() + startup_timeout)
      if line is None:
        fatal = (f"the reward worker did not start within {startup_timeout:g} s (does importing "
                 "the reward module hang?)")
      elif not line:
        try:
          code = self.proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
          code = None
        fatal = f"the reward worker exited at start-up (exit code {code}; see its stderr)"
      else:
        try:
          msg = json.loads(line)
          fatal = None if msg.get("ready") else str(msg.get("fatal", msg))
        except (ValueError, AttributeError):
          fatal = f"the reward worker sent {line[:200]!r} instead of its ready line"
    except BaseException:
      self.kill()
      raise
    if fatal is not None:
      self.kill()
      raise RewardError(_named(name, fatal))

  def call(self, task: dict[str, Any], timeout: float) -> tuple[str, Any]:
    """-> ("ok", (reward, extra or None)) | ("error", msg) | ("timeout", None) |
    ("crash", None).

    Raises on a reply it cannot read; the pool counts that as a crash too."""
    deadline = time.monotonic() + timeout
    # default=str: a row's extra_info may hold values JSON lacks (dates, bytes from Parquet)
    line = json.dumps(task, default=str).encode() + b"\n"
    try:
      if not self._write(line, deadline):
        return "timeout", None
    except OSError:  # BrokenPipeError: the process is gone
      return "crash", None
    line = self._read_line(deadline)
    if line is None:
      return "timeout", None
    if not line:
      return "crash", None
    msg = json.loads(line)
    if "reward" not in msg:
      return "error", msg.get("error")
    return "ok", (float(msg["reward"]), msg.get("extra"))

  def _write(self, data: bytes, deadline: float) -> bool:
    view = memoryview(data)
    while view:
      if not _wait_fd(self._in, select.POLLOUT, deadline - time.monotonic()):
        return False
      try:
        view = view[os.write(self._in, view):]
      except BlockingIOError:
        continue
    return True

  def _read_line(self, deadline: float) -> bytes | None:
    """-> the next line (with its newline), b"" at end of file, None at the deadline."""
    while b"\n" not in self._buf:
      if not _wait_fd(self._out, select.POLLIN, deadline - time.monotonic()):
        return None
      chunk = os.read(self._out, 65536)
      if not chunk:
        return b""
      self._buf += chunk
      if len(self._buf) > _MAX_LINE_BYTES:
        raise ValueError(f"reward worker sent over {_MAX_LINE_BYTES} bytes without a newline")
    line, _, self._buf = self._buf.partition(b"\n")
    return line + b"\n"

  def kill(self) -> None:
    try:
      if self.proc.poll() is None:
        self.proc.kill()
      self.proc.wait(timeout=_REAP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - never let cleanup take a serving thread down
      _log.warning("reward worker %d not reaped after SIGKILL: %s", self.proc.pid, e)
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


def _worker_env() -> dict[str, str]:
  """A reward worker's environment: ours, with the launch directory first on PYTHONPATH, so
  user reward modules import from it as with `python -m`."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def check_reward(name: str, startup_timeout: float = 30.0) -> None:
  """Raises RewardError (one line) unless the reward `name` loads in a reward worker within
  `startup_timeout` s. The user's module is imported there, never in the calling process: one
  that hangs, exits or fails at import costs a deadline and a message, not the run."""
  _Worker(name, _worker_env(), startup_timeout).kill()


class RewardPool:
  """`submit(key, response, answer, source, extra_info)` from any thread; `gather(keys)` ->
  {key: reward}. `source` and `extra_info` (the prompt row's) reach verl-style reward
  functions (rewards.py).

  `startup_timeout` bounds a worker's start-up (importing the reward module); by default
  max(timeout, 30 s). After `max_start_failures` failed worker starts in a row the pool stops
  and `gather` raises RewardError with the start-up error."""

  def __init__(self, name: str, *, num_workers: int = 2, timeout: float = 10.0,
               startup_timeout: float | None = None,
               max_start_failures: int = MAX_START_FAILURES):
    if num_workers < 1:
      raise ValueError(f"config.reward.num_workers={num_workers}: use >= 1")
    if timeout <= 0:
      raise ValueError(f"config.reward.timeout={timeout}: use a positive number of seconds")
    if startup_timeout is None:
      startup_timeout = max(timeout, 30.0)
    if startup_timeout <= 0:
      raise ValueError(f"startup_timeout={startup_timeout}: use a positive number of seconds")
    self.name, self.timeout, self.startup_timeout = name, timeout, startup_timeout
    self.max_start_failures = max(1, max_start_failures)
    # The longest any one call can legitimately keep a thread busy: starting a replacement
    # worker, then the call itself. `gather` gives up when no call finished for this long.
    self.stall_limit = startup_timeout + timeout + _STALL_MARGIN_S
    self.stats = RewardStats()
    self._env = _worker_env()
    self._tasks: queue.Queue = queue.Queue()
    self._results: dict[Hashable, float] = {}
    self._extras: dict[Hashable, dict] = {}  # a verl-style reward's extra entries, by key
    self._done = threading.Condition()  # guards stats, _results and the fields below
    self._pending = 0  # submitted tasks not yet finished
    self._last_progress = time.monotonic()
    self._start_failures = 0  # failed worker starts in a row
    self._said: set[str] = set()  # the kinds of failed call warned about (once each)
    self._broken: str | None = None  # why the pool stopped; gather raises it
    self._closed = False
    first = _Worker(name, self._env, startup_timeout)  # fails fast (RewardError) on a bad name
    self._threads = [threading.Thread(target=self._serve, args=(first if i == 0 else None,),
                                      daemon=True, name=f"reward-{i}")
                     for i in range(num_workers)]
    for t in self._threads:
      t.start()

  # ------------------------------------------------------------------------------ serving
  def _serve(self, worker: _Worker | None) -> None:
    try:
      while True:
        task = self._tasks.get()
        if task is None:
          break
        worker = self._run(worker, *task)
    except BaseException as e:
      # _run turns every failure of a call into a zero reward, so this is a bug in the pool
      # itself: stop the pool so that gather raises instead of waiting for this thread.
      self._stop(_named(self.name, f"a reward thread failed ({type(e).__name__}: {e})"))
      raise
    finally:
      if worker is not None:
        worker.kill()

  def _run(self, worker: _Worker | None, key: Hashable,
           task: dict[str, Any]) -> _Worker | None:
    """Scores one task (always recording a result) and returns the worker for the next one."""
    if self._closed or self._broken is not None:
      with self._done:  # gather raises; do not spend start-ups and timeouts on the backlog
        self._pending -= 1
      return worker
    t0 = time.perf_counter()
    try:
      if worker is None:
        worker = self._start_worker()
      status, value = worker.call(task, self.timeout)
    except _StartFailed:
      status, value = "start_failed", None
    except Exception as e:  # noqa: BLE001 - unreadable reply, broken pipe, ...: one crashed call
      _log.warning("reward worker failed mid-call (%s: %s); replacing it", type(e).__name__, e)
      status, value = "crash", None
    with self._done:
      s = self.stats
      s.calls += 1
      s.seconds += time.perf_counter() - t0
      if status == "error":
        s.errors += 1
      elif status == "timeout":
        s.timeouts += 1
      elif status == "crash":
        s.crashes += 1
      elif status == "start_failed":
        s.respawn_failures += 1
      self._results[key] = value[0] if status == "ok" else 0.0
      if status == "ok" and value[1]:
        self._extras[key] = value[1]
      first = status in ("error", "timeout", "crash") and status not in self._said
      self._said.add(status)
      self._pending -= 1
      self._last_progress = time.monotonic()
      watchdog.beat()
      self._done.notify_all()
    if first:  # once per kind: a function that raises (or hangs) on every call would
      # otherwise score 0 silently, the run training on nothing; the rest are counted
      what = {"error": f"raised ({value})", "timeout": f"ran past reward.timeout="
              f"{self.timeout:g} s", "crash": "killed its worker process"}[status]
      _log.warning("reward %r %s: scored 0 (further such calls are counted in the metrics' "
                   "reward_stats)", self.name, what)
    if status in ("timeout", "crash") and worker is not None:
      worker.kill()
      worker = None  # a fresh process for the next task
    return worker

  def _start_worker(self) -> _Worker:
    try:
      worker = _Worker(self.name, self._env, self.startup_timeout)
    except Exception as e:  # noqa: BLE001 - RewardError, or an OSError from fork/exec
      reason = str(e) if isinstance(e, RewardError) else _named(
          self.name, f"cannot start a reward worker ({type(e).__name__}: {e})")
      with self._done:
        self._start_failures += 1
        failures = self._start_failures
      _log.warning("reward call scored 0: %s", reason)
      if failures >= self.max_start_failures:
        self._stop(f"{reason} ({failures} worker starts failed in a row; fix the reward "
                   "function's module or its dependencies)")
      raise _StartFailed(reason) from e
    with self._done:
      self._start_failures = 0
    return worker

  def _stop(self, reason: str) -> None:
    with self._done:
      if self._broken is None:
        self._broken = reason
      self._done.notify_all()

  # ------------------------------------------------------------------------------ public
  def submit(self, key: Hashable, response: str, answer: str, source: str | None = None,
             extra_info: Any = None) -> None:
    with self._done:
      if self._closed:
        raise RewardError("submit on a closed reward pool")
      if self._pending == 0:
        # The progress clock starts when the pool gets work, not at its last result before
        # an idle spell (generation between two batches can take minutes).
        self._last_progress = time.monotonic()
      self._pending += 1
    self._tasks.put((key, {"response": response, "answer": answer, "source": source,
                           "extra_info": extra_info}))

  def gather(self, keys: list[Hashable], extras: dict | None = None
             ) -> dict[Hashable, float]:
    """Waits for (and removes) the rewards of `keys`; `extras`, where given, gets each key's
    extra entries of a verl-style reward that returned some (removed either way).

    Never waits forever: raises RewardError when the pool has stopped (its workers cannot be
    started) or is closed, or when no call has finished for `stall_limit` seconds (longer than
    any one call can take). The clock is progress, not total time, so a long queue of tasks
    behind few workers is fine as long as calls keep finishing."""
    with self._done:
      while True:
        missing = sum(k not in self._results for k in keys)
        if self._broken is not None:
          raise RewardError(f"{self._broken}; {missing} of {len(keys)} rewards missing")
        if not missing:
          for k in keys:
            extra = self._extras.pop(k, None)
            if extras is not None and extra:
              extras[k] = extra
          return {k: self._results.pop(k) for k in keys}
        if self._closed:
          raise RewardError(f"the reward pool is closed; {missing} of {len(keys)} rewards "
                            "missing")
        idle = time.monotonic() - self._last_progress
        if idle >= self.stall_limit:
          raise RewardError(
              f"config.reward.name={self.name!r}: no reward call finished in {idle:.0f} s "
              f"(a call takes at most config.reward.timeout={self.timeout:g} s plus "
              f"{self.startup_timeout:g} s to start a worker); {missing} of {len(keys)} "
              "rewards missing")
        self._done.wait(self.stall_limit - idle)

  def close(self) -> None:
    with self._done:
      if self._closed:
        return
      self._closed = True
      self._done.notify_all()  # a gather waiting in another thread raises instead of waiting
    for _ in self._threads:
      self._tasks.put(None)
    for t in self._threads:
      t.join(timeout=self.timeout + 5)

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
