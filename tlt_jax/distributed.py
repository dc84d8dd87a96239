"""Multi-process start-up: find the launch, call `jax.distributed.initialize` once, fail fast.

One process per host (or per GPU) runs the same program; `initialize` must run in every one
of them before anything else touches JAX (after `runtime.setup_jax`, which only sets flags).

What is detected (`detect`, a pure function of the environment and the config):
  openmpi   OMPI_COMM_WORLD_SIZE/RANK/LOCAL_SIZE/LOCAL_RANK (mpirun, Open MPI 4 and 5). Open MPI
            names no coordinator (Open MPI 4's OMPI_MCA_orte_hnp_uri, JAX's guess, is mpirun's
            host, not necessarily rank 0's; Open MPI 5 has none), so one must be supplied: the
            config's `coordinator_address`, or TLT_COORDINATOR_ADDRESS (JAX_COORDINATOR_ADDRESS
            also works) exported to every rank, e.g.
              mpirun -np 16 -x TLT_COORDINATOR_ADDRESS=$(hostname):29500 python -m ...
            naming the host rank 0 runs on (by default the first host of the mapping).
  slurm     a task started by srun: SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_PROCID,
            SLURM_LOCALID, the tasks on this node from SLURM_STEP_TASKS_PER_NODE ("8(x2)")
            indexed by SLURM_NODEID. The coordinator is the first host of SLURM_STEP_NODELIST
            (else SLURM_JOB_NODELIST; compressed forms like "gpu[001-003,007],dgx5" are
            expanded here) on port 61440 + SLURM_JOB_ID % 4096 (JAX's choice; JAX_COORDINATOR_PORT
            overrides it). The batch script itself (SLURM_NTASKS > 1 but no srun step) is not a
            multi-process launch: `initialize` says so and runs single-process.
  explicit  a coordinator address from the config or TLT_COORDINATOR_ADDRESS, with the process
            count and id from the config or TLT_NUM_PROCESSES / TLT_PROCESS_ID (a launch by
            hand, or tests/mp_launch.py).
Open MPI wins over Slurm (mpirun inside an allocation starts its daemons through an srun
step whose variables the ranks inherit). Any non-default config value overrides the
environment's.

Devices per process. CPU: never restricted (every process has its own host devices). GPU,
several processes on a node (one per GPU): each takes its contiguous share of the node's
visible GPUs (CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE), e.g. [SLURM_LOCALID] with
8 tasks on 8 GPUs; nothing is restricted when the launcher already bound GPUs to tasks
(srun --gpus-per-task, or a single visible GPU). One process per node sees all its GPUs
(JAX's own Slurm detection would give it only GPU 0; it is switched off here).

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
alive keeps heartbeating and is not detected.

Start-up. A process other than 0 first waits (initialization_timeout) for the coordinator's
port to accept connections and otherwise fails with an error naming the address; if not all
processes join in time, JAX aborts them, after a line from here saying what to check.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from tlt_jax.errors import ConfigError

# Environment variables of an explicit (by hand) launch.
ENV_COORDINATOR = "TLT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "TLT_NUM_PROCESSES"
ENV_PROCESS_ID = "TLT_PROCESS_ID"

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


# ------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """What the user asked for (config.distributed; the fields are its keys); the defaults mean
  "from the environment".

  enabled: "auto" (initialise when the environment shows a multi-process launch or a
    coordinator address is given), True (always; an error if nothing says how), False (never).
  coordinator_address: "HOST:PORT" of process 0's coordination service ("" = detected).
  num_processes: 0 = detected. process_id: -1 = detected.
  local_device_ids: "" / "auto" (see the module docstring), "all" (never restrict), or a
    comma list of this process's local GPU ordinals, e.g. "0,1".
  initialization_timeout: seconds a process waits for all the others to connect.
  heartbeat_timeout: seconds after which a silent process is declared dead and the job aborted.
  shutdown_timeout: seconds a finishing process waits at exit for the others to finish.
  """
  enabled: Any = "auto"
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  local_device_ids: str = ""
  initialization_timeout: int = 300
  heartbeat_timeout: int = 60
  shutdown_timeout: int = 300

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    e = self.enabled
    if isinstance(e, str):
      low = e.strip().lower()
      e = "auto" if low == "auto" else True if low in _TRUE else False if low in _FALSE else e
    if not (e == "auto" or isinstance(e, bool)):
      raise ConfigError("use auto, True or False", "enabled", self.enabled)
    set_("enabled", e)
    addr = str(self.coordinator_address or "").strip()
    if addr and parse_address(addr) is None:
      raise ConfigError("use HOST:PORT with a port in 1..65535, e.g. node001:29500 (or \"\" to "
                        "detect it)", "coordinator_address", addr)
    set_("coordinator_address", addr)
    for name, low in (("num_processes", 0), ("process_id", -1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"use an integer >= {low} ({low} = from the environment)", name, v)
    if self.num_processes and self.process_id >= self.num_processes:
      raise ConfigError(f"must be below num_processes={self.num_processes} (ids run "
                        f"0..{self.num_processes - 1})", "process_id", self.process_id)
    ids = str(self.local_device_ids or "").strip().lower()
    if ids not in ("", "auto", "all"):
      parts = [p.strip() for p in ids.split(",")]
      if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError("use \"\" (auto), \"all\", or distinct GPU ordinals like \"0,1\"",
                          "local_device_ids", self.local_device_ids)
      ids = ",".join(str(int(p)) for p in parts)
    set_("local_device_ids", "" if ids == "auto" else ids)
    for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1:
        raise ConfigError("use a number of seconds >= 1", name, v)
      set_(name, int(v))


# ------------------------------------------------------------------------------- detection
@dataclasses.dataclass(frozen=True)
class Launch:
  """A multi-process launch as detected: who this process is and where the coordinator is."""
  kind: str  # "slurm" | "openmpi" | "explicit"
  coordinator_address: str
  num_processes: int
  process_id: int
  local_rank: int | None  # this process's index among those on its node (None: unknown)
  local_count: int | None  # processes on this node (None: unknown)
  local_device_ids: tuple[int, ...] | None  # None: every device the process sees
  platform: str = "cpu"  # "cpu" | "gpu" | "tpu": decides the device restriction


def parse_address(addr: str) -> tuple[str, int] | None:
  """("host", port) from "host:port" or "[v6]:port"; None if malformed."""
  m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})", addr.strip())
  if not m or not 1 <= int(m.group(2)) <= 65535:
    return None
  return m.group(1), int(m.group(2))


def expand_hostlist(hostlist: str) -> list[str]:
  """Slurm's compressed host list, expanded: "gpu[001-003,007],dgx5" -> gpu001, gpu002,
  gpu003, gpu007, dgx5 (zero padding kept; several bracket groups multiply out)."""
  hosts, depth, start = [], 0, 0
  items = []
  for i, ch in enumerate(hostlist + ","):
    depth += ch == "["
    depth -= ch == "]"
    if depth < 0:
      raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
    if ch == "," and depth == 0:
      items.append(hostlist[start:i].strip())
      start = i + 1
  if depth:
    raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
  for item in filter(None, items):
    names = [""]
    for text, group in re.findall(r"([^\[]+)|\[([^\]]*)\]", item):
      if text:
        names = [n + text for n in names]
        continue
      values = []
      for part in group.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or hi and not hi.isdigit():
          raise ValueError(f"bad range {part!r} in host list {hostlist!r}")
        width = len(lo)
        values += [str(k).zfill(width) for k in range(int(lo), int(hi or lo) + 1)]
      names = [n + v for n in names for v in values]
    hosts += names
  return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
  """Slurm's per-node task counts: "8(x2),4" -> [8, 8, 4]."""
  counts = []
  for part in spec.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not m:
      raise ValueError(f"bad tasks-per-node entry {part!r} in {spec!r}")
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts


def guess_platform(env: Mapping[str, str]) -> str:
  """The platform JAX will pick, without starting it: JAX_PLATFORMS, else an installed GPU
  plugin, else cpu."""
  first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
  if first:
    return "gpu" if first in ("cuda", "gpu", "rocm") else first
  try:
    import pkgutil

    import jax_plugins  # namespace package of the CUDA / ROCm plugins
    names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    names = []
  return "gpu" if any("cuda" in n or "rocm" in n for n in names) else "cpu"


def _int_env(env: Mapping[str, str], name: str) -> int | None:
  v = env.get(name)
  if v is None or v.strip() == "":
    return None
  try:
    return int(v)
  except ValueError:
    raise ConfigError(f"{name}={v!r}: not an integer; fix or unset this environment "
                      "variable") from None


def _slurm(env: Mapping[str, str]) -> dict | None:
  """The launch fields of a task started by srun; None outside an srun step."""
  if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
    return None
  if "SLURM_STEP_NUM_TASKS" not in env and "SLURM_STEP_NODELIST" not in env:
    return None  # the batch script or an salloc shell: one process whatever SLURM_NTASKS says
  n = _int_env(env, "SLURM_STEP_NUM_TASKS") or _int_env(env, "SLURM_NTASKS") or 1
  out = dict(kind="slurm", num_processes=n, process_id=_int_env(env, "SLURM_PROCID"),
             local_rank=_int_env(env, "SLURM_LOCALID"), local_count=None, coordinator="")
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  node = _int_env(env, "SLURM_NODEID")
  if spec and node is not None:
    try:
      counts = expand_tasks_per_node(spec)
    except ValueError as e:
      raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {e}") from None
    if node < len(counts):
      out["local_count"] = counts[node]
  if out["local_count"] is None:
    nodes = _int_env(env, "SLURM_STEP_NUM_NODES") or _int_env(env, "SLURM_NNODES")
    if nodes and n % nodes == 0:
      out["local_count"] = n // nodes
  nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                   "SLURM_NODELIST") if env.get(v)), None)
  if nodelist_var:
    try:
      hosts = expand_hostlist(env[nodelist_var])
    except ValueError as e:
      raise ConfigError(f"{nodelist_var}: {e}; set config.distributed.coordinator_address"
                        ) from None
    job = _int_env(env, "SLURM_JOB_ID")
    port = _int_env(env, "JAX_COORDINATOR_PORT") or 61440 + job % 4096
    if hosts:
      out["coordinator"] = f"{hosts[0]}:{port}"
  return out


def _openmpi(env: Mapping[str, str]) -> dict | None:
  if "OMPI_COMM_WORLD_SIZE" not in env:
    return None
  return dict(kind="openmpi", num_processes=_int_env(env, "OMPI_COMM_WORLD_SIZE"),
              process_id=_int_env(env, "OMPI_COMM_WORLD_RANK"),
              local_rank=_int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
              local_count=_int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), coordinator="")


def _gpu_share(env: Mapping[str, str], local_rank: int | None,
               local_count: int | None) -> tuple[int, ...] | None:
  """This process's GPU ordinals when several processes share a node's GPUs."""
  if local_count is None or local_count <= 1 or local_rank is None:
    return None
  if env.get("SLURM_GPUS_PER_TASK"):
    return None  # srun --gpus-per-task binds each task to its own GPUs already
  visible = env.get("CUDA_VISIBLE_DEVICES", env.get("ROCR_VISIBLE_DEVICES", ""))
  n = len([v for v in visible.split(",") if v.strip()]) if visible.strip() else None
  if n is None:
    n = _int_env(env, "SLURM_GPUS_ON_NODE")
  if n is None:
    return (local_rank,)  # one GPU per process, as JAX assumes
  if n == 1:
    return None  # the launcher left this process its one GPU
  if n % local_count:
    raise ConfigError(f"{local_count} processes on this node do not share its {n} visible "
                      "GPUs evenly; run one process per GPU (or per node), or set "
                      "config.distributed.local_device_ids")
  k = n // local_count
  return tuple(range(local_rank * k, (local_rank + 1) * k))


def detect(env: Mapping[str, str] | None = None, config: DistributedConfig | None = None,
           platform: str | None = None) -> Launch | None:
  """The launch this process belongs to, or None when it runs alone (or `enabled` is False).

  Pure: reads only `env` (default os.environ) and `config`; `platform` (default: guessed from
  the environment) decides whether GPUs are split among the processes of a node.
  """
  env = os.environ if env is None else env
  config = config or DistributedConfig()
  if config.enabled is False:
    return None
  platform = platform or guess_platform(env)
  found = _openmpi(env) or _slurm(env)
  coord_env = env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS") or ""
  if coord_env and parse_address(coord_env) is None:
    raise ConfigError(f"{ENV_COORDINATOR}={coord_env!r}: use HOST:PORT, e.g. node001:29500")
  coordinator = config.coordinator_address or coord_env
  if found is None:
    if not coordinator:
      if config.enabled is True:
        raise ConfigError("config.distributed.enabled=True: no Slurm (srun) or Open MPI "
                          "(mpirun) launch found; set config.distributed.coordinator_address, "
                          "num_processes and process_id, or launch with srun / mpirun")
      if config.num_processes > 1:
        raise ConfigError(f"config.distributed.num_processes={config.num_processes}: no "
                          "coordinator; set config.distributed.coordinator_address=HOST:PORT "
                          f"(or {ENV_COORDINATOR})")
      return None
    found = dict(kind="explicit", num_processes=_int_env(env, ENV_NUM_PROCESSES),
                 process_id=_int_env(env, ENV_PROCESS_ID), local_rank=None, local_count=None,
                 coordinator="")
  n = config.num_processes or found["num_processes"]
  pid = config.process_id if config.process_id >= 0 else found["process_id"]
  coordinator = coordinator or found["coordinator"]
  kind = found["kind"]
  if not n:
    raise ConfigError(f"config.distributed.num_processes=0: the {kind} launch does not say "
                      f"how many processes; set it (or {ENV_NUM_PROCESSES})")
  if pid is None:
    raise ConfigError(f"config.distributed.process_id=-1: the {kind} launch does not say "
                      f"which process this is; set it (or {ENV_PROCESS_ID})")
  if not 0 <= pid < n:
    raise ConfigError(f"config.distributed.process_id={pid}: must be in 0..{n - 1} for "
                      f"num_processes={n} ({kind} launch)")
  if not coordinator:
    fix = ("export TLT_COORDINATOR_ADDRESS=HOST:PORT to every rank (mpirun -x), HOST being "
           "rank 0's host" if kind == "openmpi" else "set it to HOST:PORT")
    raise ConfigError(f"config.distributed.coordinator_address='': the {kind} launch gives no "
                      f"coordinator address; {fix}")
  if config.enabled == "auto" and n == 1 and kind != "explicit":
    return None
  ids: tuple[int, ...] | None
  if config.local_device_ids == "all":
    ids = None
  elif config.local_device_ids:
    ids = tuple(int(x) for x in config.local_device_ids.split(","))
  elif env.get("JAX_LOCAL_DEVICE_IDS"):
    try:
      ids = tuple(int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
    except ValueError:
      raise ConfigError(f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r}: use a comma "
                        "list of GPU ordinals like 0,1") from None
  elif platform == "gpu":
    ids = _gpu_share(env, found["local_rank"], found["local_count"])
  else:
    ids = None
  return Launch(kind=kind, coordinator_address=coordinator, num_processes=n, process_id=pid,
                local_rank=found["local_rank"], local_count=found["local_count"],
                local_device_ids=ids, platform=platform)


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
    elif (_int_env(os.environ, "SLURM_NTASKS") or 1) > 1 and _slurm(os.environ) is None:
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
  _warn(f"process {launch.process_id}/{launch.num_processes} ({launch.kind}), "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices, "
        f"coordinator {launch.coordinator_address}")
  return launch


def launch_info() -> Launch | None:
  """The Launch `initialize` joined, or None (single process)."""
  return _launch


# ----------------------------------------------------------------------------------- helpers
def is_primary() -> bool:
  """True in process 0 (the one that writes checkpoints, logs and metrics)."""
  import jax
  return jax.process_index() == 0


def primary_only(fn: Callable) -> Callable:
  """`fn` run in process 0 only; the others get None."""
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return fn(*args, **kwargs) if is_primary() else None
  return wrapper


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
    from jax._src import distributed as _dist  # the coordination service's client
    self._client = _dist.global_state.client
    if self._client is None:
      raise RuntimeError("GlobalBarrier needs jax.distributed to be initialised")
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
