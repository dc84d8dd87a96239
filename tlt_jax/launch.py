"""The multi-process launch: what starts this process, found from the environment and the config.

Pure: no JAX, no sockets. tlt_jax/distributed.py joins the launch found here
(`jax.distributed.initialize`) and holds the collectives the run uses.

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
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Mapping

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


def int_env(env: Mapping[str, str], name: str) -> int | None:
  v = env.get(name)
  if v is None or v.strip() == "":
    return None
  try:
    return int(v)
  except ValueError:
    raise ConfigError(f"{name}={v!r}: not an integer; fix or unset this environment "
                      "variable") from None


def slurm_env(env: Mapping[str, str]) -> dict | None:
  """The launch fields of a task started by srun; None outside an srun step."""
  if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
    return None
  if "SLURM_STEP_NUM_TASKS" not in env and "SLURM_STEP_NODELIST" not in env:
    return None  # the batch script or an salloc shell: one process whatever SLURM_NTASKS says
  n = int_env(env, "SLURM_STEP_NUM_TASKS") or int_env(env, "SLURM_NTASKS") or 1
  out = dict(kind="slurm", num_processes=n, process_id=int_env(env, "SLURM_PROCID"),
             local_rank=int_env(env, "SLURM_LOCALID"), local_count=None, coordinator="")
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  node = int_env(env, "SLURM_NODEID")
  if spec and node is not None:
    try:
      counts = expand_tasks_per_node(spec)
    except ValueError as e:
      raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {e}") from None
    if node < len(counts):
      out["local_count"] = counts[node]
  if out["local_count"] is None:
    nodes = int_env(env, "SLURM_STEP_NUM_NODES") or int_env(env, "SLURM_NNODES")
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
    job = int_env(env, "SLURM_JOB_ID")
    port = int_env(env, "JAX_COORDINATOR_PORT") or 61440 + job % 4096
    if hosts:
      out["coordinator"] = f"{hosts[0]}:{port}"
  return out


def _openmpi(env: Mapping[str, str]) -> dict | None:
  if "OMPI_COMM_WORLD_SIZE" not in env:
    return None
  return dict(kind="openmpi", num_processes=int_env(env, "OMPI_COMM_WORLD_SIZE"),
              process_id=int_env(env, "OMPI_COMM_WORLD_RANK"),
              local_rank=int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
              local_count=int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), coordinator="")


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
    n = int_env(env, "SLURM_GPUS_ON_NODE")
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
  found = _openmpi(env) or slurm_env(env)
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
      # a launch by hand missing its coordinator: never run alone (a process of a multi-process
      # job training by itself writes the shared workdir beside the others)
      env_n, env_pid = int_env(env, ENV_NUM_PROCESSES), int_env(env, ENV_PROCESS_ID)
      if (env_n or 0) > 1 or (env_pid or 0) > 0 or config.process_id > 0:
        said = ", ".join(f"{k}={v}" for k, v in ((ENV_NUM_PROCESSES, env_n),
                                                   (ENV_PROCESS_ID, env_pid),
                                                   ("config.distributed.process_id",
                                                    config.process_id if config.process_id >= 0
                                                    else None)) if v is not None)
        raise ConfigError(f"{said} but no coordinator address; set {ENV_COORDINATOR}=HOST:PORT "
                          "(or config.distributed.coordinator_address) in every process, or "
                          "unset these to run a single process")
      return None
    found = dict(kind="explicit", num_processes=int_env(env, ENV_NUM_PROCESSES),
                 process_id=int_env(env, ENV_PROCESS_ID), local_rank=None, local_count=None,
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
  if coordinator and parse_address(coordinator) is None:
    raise ConfigError(f"the {kind} launch's coordinator address {coordinator!r} is not HOST:PORT "
                      "with a port in 1..65535; set config.distributed.coordinator_address (or "
                      "JAX_COORDINATOR_PORT)")
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
