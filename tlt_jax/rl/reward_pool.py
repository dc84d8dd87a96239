"""Rewards in a pool of worker processes, with a per-call timeout.

Why processes: a reward function is user code (sympy, regexes on model output, a sandbox).
One that crashes, hangs on a pathological expression, or leaks memory must cost one reward,
not the run: a failed or timed-out call gives 0.0 and is counted, a hung or dead worker is
killed and replaced, and training goes on. Workers are plain subprocesses speaking JSON lines
(`tlt_jax.rl.reward_worker`), so nothing of the JAX parent (threads, device handles) is
forked into them.

Why a pool fed as responses finish: `submit` is called from the rollout engine's `on_result`
hook, so scoring overlaps the long tail of decoding instead of following it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any, Hashable


class RewardError(RuntimeError):
  """The reward function cannot be used at all (e.g. it does not import)."""


@dataclasses.dataclass
class RewardStats:
  calls: int = 0
  errors: int = 0  # the function raised / returned a non-number
  timeouts: int = 0  # exceeded the per-call timeout (worker killed and replaced)
  crashes: int = 0  # the worker process died mid-call
  seconds: float = 0.0  # summed worker time


class _Worker:
  def __init__(self, name: str, env: dict[str, str]):
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_jax.rl.reward_worker", name], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1, env=env)
    line = self.proc.stdout.readline()
    msg = json.loads(line) if line else {"fatal": "the reward worker exited at start-up"}
    if "fatal" in msg:
      self.kill()
      raise RewardError(f"config.reward.name={name!r}: {msg['fatal']}")

  def call(self, response: str, answer: str, timeout: float) -> tuple[str, Any]:
    """-> ("ok", reward) | ("error", msg) | ("timeout", None) | ("crash", None)."""
    try:
      self.proc.stdin.write(json.dumps({"response": response, "answer": answer}) + "\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      return "crash", None
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
    if not ready:
      return "timeout", None
    line = self.proc.stdout.readline()
    if not line:
      return "crash", None
    msg = json.loads(line)
    return ("ok", msg["reward"]) if "reward" in msg else ("error", msg.get("error"))

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


class RewardPool:
  """`submit(key, response, answer)` from any thread; `gather(keys)` -> {key: reward}."""

  def __init__(self, name: str, *, num_workers: int = 2, timeout: float = 10.0):
    if num_workers < 1:
      raise ValueError(f"config.reward.num_workers={num_workers}: use >= 1")
    if timeout <= 0:
      raise ValueError(f"config.reward.timeout={timeout}: use a positive number of seconds")
    self.name, self.timeout = name, timeout
    self.stats = RewardStats()
    self._env = dict(os.environ)
    # User reward modules are importable from the launch directory, as with `python -m`.
    self._env["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd()] + [p for p in self._env.get("PYTHONPATH", "").split(os.pathsep) if p])
    self._tasks: queue.Queue = queue.Queue()
    self._results: dict[Hashable, float] = {}
    self._done = threading.Condition()
    self._closed = False
    first = _Worker(name, self._env)  # fails fast (RewardError) on a bad name
    self._threads = [threading.Thread(target=self._serve, args=(first if i == 0 else None,),
                                      daemon=True, name=f"reward-{i}")
                     for i in range(num_workers)]
    for t in self._threads:
      t.start()

  def _serve(self, worker: _Worker | None) -> None:
    while True:
      task = self._tasks.get()
      if task is None:
        break
      key, response, answer = task
      if worker is None:
        worker = _Worker(self.name, self._env)
      t0 = time.perf_counter()
      status, value = worker.call(response, answer, self.timeout)
      reward = float(value) if status == "ok" else 0.0
      with self._done:
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t0
        if status == "error":
          self.stats.errors += 1
        elif status == "timeout":
          self.stats.timeouts += 1
        elif status == "crash":
          self.stats.crashes += 1
        self._results[key] = reward
        self._done.notify_all()
      if status in ("timeout", "crash"):
        worker.kill()
        worker = None  # a fresh process for the next task
    if worker is not None:
      worker.kill()

  def submit(self, key: Hashable, response: str, answer: str) -> None:
    self._tasks.put((key, response, answer))

  def gather(self, keys: list[Hashable]) -> dict[Hashable, float]:
    """Waits for (and removes) the rewards of `keys`."""
    with self._done:
      self._done.wait_for(lambda: all(k in self._results for k in keys))
      return {k: self._results.pop(k) for k in keys}

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for _ in self._threads:
      self._tasks.put(None)
    for t in self._threads:
      t.join(timeout=self.timeout + 5)

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
