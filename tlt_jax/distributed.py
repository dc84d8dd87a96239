"""Multi-process runtime: join the launch (`initialize`, once), fail fast, and the host-side
collectives the run uses (barriers, process shards, object gathers, the spot trainer's global
barrier).

One process per host (or per GPU) runs the same program; `initialize` must run in every one
of them before anything else touches JAX (after `runtime.setup_jax`, which only sets flags).
What launch a process belongs to, and which devices it takes, is tlt_jax/launch.py's
`detect` (pure).

Failure detection. The coordination service (in process 0) declares a process dead when it
sends no heartbeat for `heartbeat_timeout` and then aborts every other process with
"Terminating process because the JAX distributed service detected fatal errors ... tasks
are unhealthy (stopped sending heartbeats)"; this holds whatever the survivors are blocked
in (a collective on a dead peer can otherwise wait forever). When process 0 itself dies the
others abort at once (their error-poll RPC to the service fails). So a killed process
brings the job down within about heartbeat_timeout (measured on CPU, JAX 0.10.2 and 0.12,
10 s timeout: 9-10 s after the death; under 1 s when process 0 died, or when a CPU (gloo)
collective sees the peer's connection close and raises). A process that dies of an uncaught
Python exception would instead wait in JAX's shutdown barrier (up to `shutdown_timeout`)
while its peers block on it; `initialize` installs an excepthook that prints the traceback
and exits at once, so that case is bounded the same way. A process that hangs but stays
alive keeps heartbeating and is not detected here: the run's watchdog (watchdog.py) ends
the job when none of its processes progressed for train.hang_timeout_s (`ProgressBoard`).

Start-up. A process other than 0 first waits (initialization_timeout) for the coordinator's
port to accept connections and otherwise fails with an error naming the address; if not all
processes join in time, JAX aborts them, after a line from here saying what to check.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Sequence

from tlt_jax.errors import ConfigError
from tlt_jax.launch import (DistributedConfig, Launch, detect, guess_platform, int_env,
                            parse_address, slurm_env)
# ---------------------------------------------------------------------------- initialisation
_launch: Launch | None = None


def _warn(msg: str) -> None:
  print(f"distributed: {msg}", file=sys.stderr, flush=True)


def _fail_fast_excepthook(previous):
  """An uncaught exception: print it and leave now. Exiting normally would run JAX's
  shutdown barrier, where this process would wait (shutdown_timeout) while the others wait
  for it in a collective; gone at once, it is seen dead within heartbeat_timeout."""
  def hook(etype, value, tb):
    try:
      previous(etype, value, tb)
      if _launch is not None:
        _warn(f"process {_launch.process_id}/{_launch.num_processes} failed with "
              f"{etype.__name__}; exiting at once so the other processes stop too")
    finally:
      for stream in (sys.stdout, sys.stderr):
        try:
          stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not block the exit
          pass
      os._exit(1)
  return hook


def _wait_for_coordinator(address: str, timeout: float, who: str) -> float:
  """Waits until process 0's coordinator accepts TCP connections; returns the seconds left
  of `timeout`. A clear error instead of JAX's abort when the address is wrong or
  unreachable, or process 0 never started."""
  host, port = parse_address(address)
  host = host.strip("[]")
  start = time.monotonic()
  last = None
  while time.monotonic() - start < timeout:
    try:
      with socket.create_connection((host, port), timeout=min(5.0, timeout)):
        return max(1.0, timeout - (time.monotonic() - start))
    except OSError as e:
      last = e
      time.sleep(0.5)
  raise RuntimeError(f"distributed: {who} cannot reach the coordinator {address} within "
                     f"{timeout:.0f} s ({last}); check that process 0 started on {host} and "
                     f"that port {port} there is reachable from this host (firewall, address)")


def _check_port_free(address: str, who: str) -> None:
  """Process 0 is about to serve `address`: something already accepting connections there is
  another job's coordinator (or a second process started with process_id=0). Joining it would
  abort that job (JAX takes a second registration of a task as its restart), so stop here."""
  host, port = parse_address(address)
  try:
    with socket.create_connection((host.strip("[]"), port), timeout=2.0):
      pass
  except OSError:
    return  # nothing listens there: free (or not reachable, which initialize reports)
  raise ConfigError(f"{who}: the coordinator address {address} is already in use on this "
                    "host (another job, or another process started with process_id=0); pick "
                    "another port (config.distributed.coordinator_address, TLT_COORDINATOR_"
                    "ADDRESS, or JAX_COORDINATOR_PORT under Slurm) or give each process its "
                    "own process_id")


def initialize(config: DistributedConfig | None = None) -> Launch | None:
  """Joins the multi-process launch this process belongs to; None when it runs alone.

  Calls jax.distributed.initialize once (later calls return the same Launch), then creates
  the backends to count devices and prints one line per process to stderr. Must run before
  any other JAX computation or device query.
  """
  global _launch
  import jax
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge

  config = config or DistributedConfig()
  if jax.distributed.is_initialized():
    if _launch is None:  # initialised by someone else: describe what JAX holds
      s = jax_distributed.global_state
      _launch = Launch("explicit", s.coordinator_address or "", s.num_processes, s.process_id,
                       None, None, None, guess_platform(os.environ))
    return _launch
  launch = detect(os.environ, config)
  if launch is None:
    if config.enabled is False:
      try:
        seen = detect(os.environ, dataclasses.replace(config, enabled="auto"))
      except ConfigError:
        seen = None
      if seen is not None:
        _warn(f"a {seen.kind} launch of {seen.num_processes} processes is running with "
              "config.distributed.enabled=False: each process trains on its own")
    elif (int_env(os.environ, "SLURM_NTASKS") or 1) > 1 and slurm_env(os.environ) is None:
      _warn(f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} but this process was not started by "
            "srun: running single-process (launch the program with srun to use every task)")
    return None
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("distributed.initialize must run before anything uses JAX's backends "
                       "(jax.devices(), a computation, device_put); call it first in main")
  if launch.platform == "cpu" and jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  who = f"process {launch.process_id}/{launch.num_processes} ({launch.kind})"
  timeout = config.initialization_timeout
  if launch.process_id != 0:
    timeout = _wait_for_coordinator(launch.coordinator_address, timeout, who)
  else:
    _check_port_free(launch.coordinator_address, who)
  # JAX aborts the process (a C++ fatal error) when not every process joins in time; say why
  # first. A timer, since the wait happens inside one native call.
  timer = threading.Timer(timeout, _warn, [
      f"{who}: not all {launch.num_processes} processes joined the coordinator "
      f"{launch.coordinator_address} within {config.initialization_timeout} s; JAX is about "
      "to stop this process. Check that every process was started (and did not fail early) "
      "and that all use the same coordinator address and process count"])
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(
        coordinator_address=launch.coordinator_address, num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
        cluster_detection_method="deactivate", initialization_timeout=max(1, int(timeout)),
        heartbeat_timeout_seconds=config.heartbeat_timeout,
        shutdown_timeout_seconds=config.shutdown_timeout)
  except Exception as e:  # noqa: BLE001 - rewrapped with what to check
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise RuntimeError(f"distributed: {who} could not join the coordinator "
                       f"{launch.coordinator_address}: {first}") from e
  finally:
    timer.cancel()
  _launch = launch
  sys.excepthook = _fail_fast_excepthook(sys.excepthook)
  if jax.process_count() != launch.num_processes:
    # the coordinator's job has another count: this process was started with the wrong one.
    # Leave at once (no shutdown barrier): the others then stop within heartbeat_timeout.
    _warn(f"{who}: num_processes={launch.num_processes}, but the coordinator "
          f"{launch.coordinator_address} runs a job of {jax.process_count()} processes; give "
          "every process the same count (config.distributed.num_processes or "
          f"TLT_NUM_PROCESSES)")
    os._exit(2)
  _warn(f"process {launch.process_id}/{launch.num_processes} ({launch.kind}), "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices, "
        f"coordinator {launch.coordinator_address}")
  return launch


# ----------------------------------------------------------------------------------- helpers
def is_primary() -> bool:
  """True in process 0 (the one that writes checkpoints, logs and metrics)."""
  import jax
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Blocks until every process reaches barrier `name` (a no-op in a single process)."""
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def process_shard(items: Sequence, process_index: int | None = None,
                  process_count: int | None = None) -> list:
  """This process's contiguous, equal share of `items` (e.g. an RL step's prompts):
  process i of n gets items[i*k:(i+1)*k] with k = len(items) / n."""
  if process_index is None or process_count is None:
    import jax
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_shard: process_index={process_index} is not in "
                     f"0..{process_count - 1}")
  if len(items) % process_count:
    raise ValueError(f"process_shard: {len(items)} items do not split evenly across "
                     f"{process_count} processes; make the count a multiple of "
                     f"{process_count}")
  k = len(items) // process_count
  return list(items[process_index * k:(process_index + 1) * k])


def all_gather_objects(obj: Any) -> list:
  """Every process's `obj` (any picklable host value), in process order; [obj] in a single
  process. A collective: every process must call it at the same point."""
  import jax
  if jax.process_count() == 1:
    return [obj]
  import pickle

  import numpy as np
  from jax.experimental import multihost_utils
  data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64)))
  sizes = sizes.reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:data.size] = data
  every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  return [pickle.loads(every[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def _coordination_client(who: str):
  """The coordination service's client (its key-value store), once jax.distributed joined."""
  from jax._src import distributed as _dist
  client = _dist.global_state.client
  if client is None:
    raise RuntimeError(f"{who} needs jax.distributed to be initialised")
  return client


class GlobalBarrier:
  """A barrier every process arrives at without blocking: `arrive()` records this process,
  `event` (a threading.Event) is set once all have, as seen by a poller thread reading the
  coordination service's key-value store. The rollout uses it so that a process whose
  replicas are done trains its drafter until the LAST replica of ANY process is done (the
  straggler wait of a multi-host run), not merely its own. `name` must be unique per use and
  the same in every process (e.g. a counter advanced in lockstep)."""

  def __init__(self, name: str, *, poll_s: float = 0.02,
               on_all: Callable[[], None] | None = None):
    import jax
    self._client = _coordination_client("GlobalBarrier")
    self._dir = f"tlt_jax/barrier/{name}/"
    self._n = jax.process_count()
    self._me = jax.process_index()
    self.event = threading.Event()
    self._on_all = on_all
    self._poll_s = poll_s
    self._thread = threading.Thread(target=self._poll, name=f"barrier-{name}", daemon=True)
    self._thread.start()

  def arrive(self) -> None:
    self._client.key_value_set(f"{self._dir}{self._me}", "1")

  def _poll(self) -> None:
    while not self.event.is_set():
      if len(self._client.key_value_dir_get(self._dir)) >= self._n:
        if self._on_all is not None:
          self._on_all()
        self.event.set()
        return
      time.sleep(self._poll_s)

  def close(self) -> None:
    """After the event (this process saw every key: the poller has ended)."""
    self._thread.join()

  def forget(self) -> None:
    """Deletes this process's key. Only once every process has seen the event (e.g. after a
    later collective): a key deleted earlier could hide this arrival from a peer still
    polling, which would then wait forever."""
    try:
      self._client.key_value_delete(f"{self._dir}{self._me}")
    except Exception:  # noqa: BLE001 - hygiene only
      pass


class ProgressBoard:
  """The job's progress for the run's watchdog (watchdog.py): each process's latest progress
  (wall-clock seconds) under its key in the coordination service's key-value store,
  `latest()` the newest any process published. A process that waits on others' work (a
  straggler's rollout, process 0's evaluation) is then not hung while they progress; when
  no process progresses, every one is."""

  def __init__(self):
    import jax
    self._client = _coordination_client("ProgressBoard")
    self._dir = "tlt_jax/progress/"
    self._key = f"{self._dir}{jax.process_index()}"

  def publish(self, t: float) -> None:
    self._client.key_value_set(self._key, repr(float(t)), allow_overwrite=True)

  def latest(self) -> float:
    return max(float(v) for _, v in self._client.key_value_dir_get(self._dir))


class Stopped(KeyboardInterrupt):
  """The run stopped at a step boundary on a stop request (`StopRequest`): its checkpoint is
  on disk and the same command resumes from it. An interrupt, as Ctrl-C is (no `except
  Exception` swallows it); the command says "stopped ..." and exits 143 (128 + SIGTERM)."""
  verb, exit_code = "stopped", 143


class StopRequest:
  """SIGTERM as a request to stop at the next step boundary, with the step's checkpoint saved,
  instead of dying mid-step and losing the steps since the last periodic checkpoint. Slurm
  sends SIGTERM to every task at its time limit or a preemption (then SIGKILL after the
  cluster's KillWait, often 30 s: `sbatch --signal=TERM@SECONDS` sends it that long before the
  limit, which should exceed a step plus a save). A context: the handler is installed on
  entry (from the main thread only: Python delivers signals there) and the previous one
  restored on exit. `agreed()` is a collective: every process calls it at each step boundary
  and all stop where any was asked to, so a multi-process run saves one step everywhere."""

  def __init__(self, signals: Sequence[int] | None = None):
    import signal
    self.signals = tuple(signals) if signals is not None else (signal.SIGTERM,)
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.received = signum

  def __enter__(self) -> StopRequest:
    import signal
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    import signal
    for s, h in self._previous.items():
      signal.signal(s, h)
    self._previous.clear()

  def agreed(self) -> int | None:
    """The signal that asked this process or any other to stop (None: carry on)."""
    asked = [s for s in all_gather_objects(self.received) if s is not None]
    return asked[0] if asked else None
