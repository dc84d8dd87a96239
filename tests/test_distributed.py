"""tlt_jax.launch and tlt_jax.distributed: launch detection on fake Slurm / Open MPI / by-hand
environments, the config section and its errors, then real 2-process x 4-CPU-device runs
(tests/mp_launch.py):
global collectives give the numpy answer in both processes, and a process that dies (killed,
or an uncaught exception; process 0 or not) brings the other down in bounded time instead of
leaving it hanging."""

import json
import os
import re
import sys

import ml_collections
import numpy as np
import pytest

from tlt_jax import config as config_lib
from tlt_jax import distributed as dist
from tlt_jax import launch as launch_lib
from tlt_jax.errors import ConfigError
from tlt_jax.launch import DistributedConfig, detect

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_launch import ROOT, describe, launch  # noqa: E402

JOB = 123456  # port 61440 + 123456 % 4096 = 62016
PORT = 62016


def slurm_env(procid, localid, nodeid, ntasks=16, per_node="8(x2)", nodes=2,
              nodelist="gpu[007-008]", **extra):
  """The variables srun gives one task of a step."""
  env = {"SLURM_JOB_ID": str(JOB), "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
         "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
         "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(nodes),
         "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_STEP_NODELIST": nodelist,
         "SLURM_JOB_NODELIST": nodelist}
  env.update(extra)
  return env


def ompi_env(rank, size=16, local_rank=1, local_size=8, **extra):
  env = {"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
         "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
         "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)}
  env.update(extra)
  return env


# ----------------------------------------------------------------------------- host lists
@pytest.mark.parametrize("text,hosts", [
    ("gpu5", ["gpu5"]),
    ("node001,gpu5", ["node001", "gpu5"]),
    ("node[001-003,007],gpu5", ["node001", "node002", "node003", "node007", "gpu5"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
])
def test_expand_hostlist(text, hosts):
  assert launch_lib.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[001-003", "node001]", "node[a-b]"])
def test_expand_hostlist_rejects(text):
  with pytest.raises(ValueError, match="host list"):
    launch_lib.expand_hostlist(text)


def test_expand_tasks_per_node():
  assert launch_lib.expand_tasks_per_node("8(x2),4") == [8, 8, 4]
  assert launch_lib.expand_tasks_per_node("1") == [1]


# -------------------------------------------------------------------------------- Slurm
def test_slurm_two_nodes_eight_tasks_each():
  env = slurm_env(procid=11, localid=3, nodeid=1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  got = detect(env, platform="gpu")
  assert got == launch_lib.Launch("slurm", f"gpu007:{PORT}", 16, 11, 3, 8, (3,), "gpu")
  # on CPU every process keeps its own (fake) devices
  assert detect(env, platform="cpu").local_device_ids is None
  # no CUDA_VISIBLE_DEVICES: one GPU per task, as JAX assumes
  env.pop("CUDA_VISIBLE_DEVICES")
  assert detect(env, platform="gpu").local_device_ids == (3,)


def test_slurm_gpu_binding():
  base = dict(procid=5, localid=1, nodeid=1, ntasks=8, per_node="4(x2)")
  # 4 tasks sharing 8 GPUs: two each
  env = slurm_env(**base, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  assert detect(env, platform="gpu").local_device_ids == (2, 3)
  env = slurm_env(**base, SLURM_GPUS_ON_NODE="8")
  assert detect(env, platform="gpu").local_device_ids == (2, 3)
  # srun --gpus-per-task=1 (or any launcher-side binding): each task sees only its own GPU
  env = slurm_env(**base, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="1")
  assert detect(env, platform="gpu").local_device_ids is None
  env = slurm_env(**base, CUDA_VISIBLE_DEVICES="5")
  assert detect(env, platform="gpu").local_device_ids is None
  # one task per node keeps all the node's GPUs (JAX's own detection would give it GPU 0)
  env = slurm_env(procid=1, localid=0, nodeid=1, ntasks=2, per_node="1(x2)")
  assert detect(env, platform="gpu") == launch_lib.Launch("slurm", f"gpu007:{PORT}", 2, 1, 0, 1,
                                                    None, "gpu")
  # 3 tasks cannot share 8 GPUs evenly
  env = slurm_env(procid=0, localid=0, nodeid=0, ntasks=3, per_node="3", nodes=1,
                  CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  with pytest.raises(ConfigError, match="local_device_ids"):
    detect(env, platform="gpu")


def test_slurm_coordinator_and_overrides():
  env = slurm_env(procid=0, localid=0, nodeid=0, nodelist="node[001-003,007],gpu5")
  assert detect(env).coordinator_address == f"node001:{PORT}"
  assert detect({**env, "JAX_COORDINATOR_PORT": "2222"}).coordinator_address == "node001:2222"
  assert detect({**env, "TLT_COORDINATOR_ADDRESS": "10.0.0.1:3"}).coordinator_address == \
      "10.0.0.1:3"
  cfg = DistributedConfig(coordinator_address="head:29500", num_processes=32, process_id=7,
                          local_device_ids="0,1")
  got = detect(env, cfg, platform="gpu")
  assert (got.kind, got.coordinator_address, got.num_processes, got.process_id,
          got.local_device_ids) == ("slurm", "head:29500", 32, 7, (0, 1))
  cfg = DistributedConfig(local_device_ids="all")
  assert detect(slurm_env(3, 3, 0, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), cfg,
                platform="gpu").local_device_ids is None
  # no SLURM_STEP_TASKS_PER_NODE: tasks / nodes
  env = slurm_env(procid=9, localid=1, nodeid=1)
  env.pop("SLURM_STEP_TASKS_PER_NODE")
  assert detect(env).local_count == 8


def test_slurm_single_task_and_batch_script():
  single = slurm_env(procid=0, localid=0, nodeid=0, ntasks=1, per_node="1", nodes=1,
                     nodelist="gpu001")
  assert detect(single) is None  # auto: nothing to initialise
  got = detect(single, DistributedConfig(enabled=True))
  assert (got.num_processes, got.coordinator_address) == (1, f"gpu001:{PORT}")
  # the batch script of a 16-task job (no srun step) is one process, not a launch
  batch = {"SLURM_JOB_ID": str(JOB), "SLURM_NTASKS": "16", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[1-2]"}
  assert detect(batch) is None
  assert detect(slurm_env(3, 3, 0), DistributedConfig(enabled=False)) is None


# ----------------------------------------------------------------------------- Open MPI
def test_openmpi():
  env = ompi_env(rank=9, TLT_COORDINATOR_ADDRESS="node001:29500")
  assert detect(env, platform="gpu") == launch_lib.Launch("openmpi", "node001:29500", 16, 9, 1, 8,
                                                    (1,), "gpu")
  assert detect(ompi_env(rank=9, JAX_COORDINATOR_ADDRESS="h:1")).coordinator_address == "h:1"
  cfg = DistributedConfig(coordinator_address="head:1234")
  assert detect(ompi_env(rank=9), cfg).coordinator_address == "head:1234"
  with pytest.raises(ConfigError, match="coordinator_address.*TLT_COORDINATOR_ADDRESS"):
    detect(ompi_env(rank=9))
  # mpirun inside a Slurm allocation: the ranks also see the daemons' srun step
  env = {**slurm_env(1, 0, 1, ntasks=2, per_node="1(x2)"), **env}
  assert detect(env).kind == "openmpi"
  assert detect(ompi_env(rank=0, size=1, local_size=1, TLT_COORDINATOR_ADDRESS="h:1")) is None


# ----------------------------------------------------------------------- explicit / by hand
def test_explicit():
  env = {"TLT_COORDINATOR_ADDRESS": "127.0.0.1:5000", "TLT_NUM_PROCESSES": "2",
         "TLT_PROCESS_ID": "1"}
  assert detect(env, platform="cpu") == launch_lib.Launch("explicit", "127.0.0.1:5000", 2, 1, None,
                                                    None, None, "cpu")
  assert detect(env, DistributedConfig(process_id=0)).process_id == 0
  cfg = DistributedConfig(coordinator_address="[::1]:5000", num_processes=4, process_id=3)
  got = detect({}, cfg)
  assert (got.kind, got.coordinator_address, got.num_processes) == ("explicit", "[::1]:5000", 4)
  assert detect({}) is None
  assert detect({}, DistributedConfig(num_processes=1)) is None


@pytest.mark.parametrize("env,cfg,match", [
    ({"TLT_COORDINATOR_ADDRESS": "h:1"}, {}, r"config\.distributed\.num_processes=0"),
    ({"TLT_COORDINATOR_ADDRESS": "h:1", "TLT_NUM_PROCESSES": "2"}, {},
     r"config\.distributed\.process_id=-1"),
    ({"TLT_COORDINATOR_ADDRESS": "h:1", "TLT_NUM_PROCESSES": "2", "TLT_PROCESS_ID": "2"}, {},
     r"config\.distributed\.process_id=2: must be in 0\.\.1"),
    ({"TLT_COORDINATOR_ADDRESS": "nope"}, {}, r"TLT_COORDINATOR_ADDRESS='nope'"),
    ({}, {"enabled": True}, r"config\.distributed\.enabled=True"),
    ({}, {"num_processes": 2}, r"config\.distributed\.num_processes=2: no coordinator"),
    ({**slurm_env(0, 0, 0), "SLURM_PROCID": "x"}, {}, r"SLURM_PROCID='x': not an integer"),
    (slurm_env(0, 0, 0, nodelist="gpu[1-"), {}, r"SLURM_STEP_NODELIST"),
    # a process of a hand launch missing its coordinator never trains alone (into the
    # workdir the others share)
    ({"TLT_NUM_PROCESSES": "2", "TLT_PROCESS_ID": "1"}, {},
     r"TLT_NUM_PROCESSES=2, TLT_PROCESS_ID=1 but no coordinator address"),
    ({}, {"process_id": 1}, r"config\.distributed\.process_id=1 but no coordinator"),
    ({**slurm_env(0, 0, 0), "JAX_COORDINATOR_PORT": "70000"}, {},
     r"coordinator address 'gpu007:70000' is not HOST:PORT"),
])
def test_detect_errors(env, cfg, match):
  with pytest.raises(ConfigError, match=match):
    detect(env, DistributedConfig(**cfg))


# ------------------------------------------------------------------------ config section
def test_config_section_defaults_and_overrides():
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  assert config_lib.run_spec(cfg).distributed == DistributedConfig()
  config_lib.check_overrides(["--config", "configs/default.py",
                              "--config.distributed.enabled=auto",
                              "--config.distributed.heartbeat_timeout=30"])
  cfg.distributed.enabled = "True"  # what --config.distributed.enabled=True gives a str field
  cfg.distributed.heartbeat_timeout = 30
  got = config_lib.distributed_config(cfg)
  assert (got.enabled, got.heartbeat_timeout) == (True, 30)
  assert config_lib.distributed_config(ml_collections.ConfigDict()) == DistributedConfig()


@pytest.mark.parametrize("key,value,match", [
    ("enabled", "maybe", r"config\.distributed\.enabled='maybe': use auto, True or False"),
    ("coordinator_address", "node001", r"config\.distributed\.coordinator_address='node001'"),
    ("coordinator_address", "node001:70000", r"coordinator_address=.*HOST:PORT"),
    ("num_processes", -2, r"config\.distributed\.num_processes=-2"),
    ("process_id", 4, r"config\.distributed\.process_id=4: must be below num_processes=2"),
    ("local_device_ids", "0,x", r"config\.distributed\.local_device_ids='0,x'"),
    ("local_device_ids", "1,1", r"config\.distributed\.local_device_ids='1,1'"),
    ("initialization_timeout", 0, r"config\.distributed\.initialization_timeout=0"),
    ("heartbeat_timeout", 0, r"config\.distributed\.heartbeat_timeout=0: use a number"),
])
def test_config_errors(key, value, match):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.distributed.num_processes = 2
  with cfg.unlocked():
    cfg.distributed[key] = value  # (a bad type too: ConfigDict would refuse it on the CLI)
  with pytest.raises(ConfigError, match=match) as e:
    config_lib.run_spec(cfg)
  assert e.value.key == f"distributed.{key}"


# --------------------------------------------------------------------------------- helpers
def test_process_shard():
  items = list(range(12))
  assert dist.process_shard(items, 0, 3) == [0, 1, 2, 3]
  assert dist.process_shard(items, 2, 3) == [8, 9, 10, 11]
  assert dist.process_shard(items, 0, 1) == items
  assert dist.process_shard(items) == items  # this (single) process
  with pytest.raises(ValueError, match="12 items do not split evenly across 5 processes"):
    dist.process_shard(items, 0, 5)
  with pytest.raises(ValueError, match="process_index=3"):
    dist.process_shard(items, 3, 3)


def _clean_env(monkeypatch):
  for k in list(os.environ):
    if re.match(r"(SLURM_|OMPI_|TLT_|JAX_COORDINATOR)", k):
      monkeypatch.delenv(k)


def test_process_0_does_not_join_a_coordinator_already_serving():
  """A second process 0 (a duplicated id, or a second job on the same port) would register
  with the running job's coordinator, which takes it for a restart and aborts that job: it
  stops first, with one error naming the address."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError, match=f"coordinator address {address} is already in use"):
      dist._check_port_free(address, "process 0/2")
  dist._check_port_free(address, "process 0/2")  # closed: free


def test_initialize_single_process(monkeypatch, capsys):
  _clean_env(monkeypatch)
  assert dist.initialize() is None
  assert dist.is_primary()
  dist.barrier("single")  # a no-op
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  monkeypatch.setenv("SLURM_PROCID", "0")
  assert dist.initialize() is None
  assert "not started by srun" in capsys.readouterr().err
  for k, v in slurm_env(0, 0, 0).items():
    monkeypatch.setenv(k, v)
  assert dist.initialize(DistributedConfig(enabled=False)) is None
  assert "enabled=False" in capsys.readouterr().err


def test_initialize_after_backend_use(monkeypatch):
  import jax
  jax.devices()  # the backends exist now
  _clean_env(monkeypatch)
  monkeypatch.setenv("TLT_COORDINATOR_ADDRESS", "127.0.0.1:1")
  monkeypatch.setenv("TLT_NUM_PROCESSES", "2")
  monkeypatch.setenv("TLT_PROCESS_ID", "0")
  with pytest.raises(RuntimeError, match="must run before anything uses JAX"):
    dist.initialize()


# ------------------------------------------------------------------ 2 processes x 4 devices
def test_two_processes_collectives():
  """Sharded sum, all-gather and process all-gather over the global 8-device mesh: both
  processes print numpy's answer."""
  results = launch("tests/mp_workers/collectives.py", 2, devices_per_process=4, timeout=90)
  assert all(r.returncode == 0 for r in results), describe(results)
  full = np.arange(48, dtype=np.float32).reshape(16, 3) ** 1.5
  for r in results:
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["process"] == r.process_id
    np.testing.assert_allclose(got["sum"], full.sum(dtype=np.float64), rtol=1e-6)
    np.testing.assert_allclose(np.array(got["gathered"]), 2 * full, rtol=1e-6)
    assert got["ids"] == [1, 11]
    assert re.search(rf"distributed: process {r.process_id}/2 \(explicit\), 4 local / 8 global "
                     r"devices, coordinator 127\.0\.0\.1:\d+", r.stderr), r.stderr


def test_processes_compile_a_program_once_and_load_it_from_each_other():
  """Executables across processes (rollout/exchange.py), 3 processes x 2 devices, each asking
  for programs on a mesh of its own devices (tests/mp_workers/exchange.py): a program
  process 0 is compiling is put off by process 1's compile thread, which compiles the next
  one first and then loads process 0's; process 0 loads that next one from process 1, and
  process 2 both; a program asked by all at once is compiled once in the job; a program whose
  module differs between the processes is compiled by each; one the claimer took from JAX's
  persistent cache is claimed again by the others, compiled by one and loaded by the other.
  Every executable computes numpy's answer on its own process's devices, and the store keeps
  no executable every other process has taken."""
  results = launch("tests/mp_workers/exchange.py", 3, devices_per_process=2, timeout=120)
  assert all(r.returncode == 0 for r in results), describe(results)
  got = [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
         for r in results]
  a, b, c, d = "2.0", "5.0", "7.0", "9.0"
  assert got[1]["order"] == [5.0, 2.0], got[1]  # (b compiled while process 0 compiled a)
  everyone = [k for p in got for k in p["compiled"]]
  assert sorted(everyone) == [2.0, 5.0, 7.0, 9.0, 9.0, 10.0, 11.0, 12.0], got
  assert 2.0 in got[0]["compiled"] and 5.0 in got[1]["compiled"], got
  assert 9.0 in got[0]["compiled"], got
  assert (9.0 in got[1]["compiled"]) != (9.0 in got[2]["compiled"]), got
  ported = [p["ported"] for p in got]
  assert [p[a] for p in ported] == [False, True, True], ported
  assert [p[b] for p in ported] == [True, False, True], ported
  assert [p[str(10.0 + i)] for i, p in enumerate(ported)] == [False] * 3, ported
  assert sum(not p[c] for p in ported) == 1, ported
  assert not ported[0][d] and ported[1][d] != ported[2][d], ported
  assert all(all(p["checks"].values()) and len(p["checks"]) == 5 for p in got), got
  assert {p["data_keys"] for p in got} == {3}, got  # (10.0's, 11.0's, 12.0's: nobody took them)


class _Store:
  """The coordination service's key-value store as exchange.py uses it, in one process (its
  errors by their status names), with `down` making every call fail as an unreachable
  coordinator does."""

  def __init__(self):
    self.kv, self.calls, self.down = {}, 0, False

  def _call(self):
    self.calls += 1
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

  def key_value_set(self, k, v, allow_overwrite=False):
    self._call()
    if k in self.kv and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: key {k} already exists.")
    self.kv[k] = v

  key_value_set_bytes = key_value_set

  def key_value_try_get(self, k):
    self._call()
    if k not in self.kv:
      raise RuntimeError(f"NOT_FOUND: Config key {k} not found.")
    return self.kv[k]

  key_value_try_get_bytes = key_value_try_get

  def key_value_increment(self, k, n):
    self._call()
    self.kv[k] = self.kv.get(k, 0) + n
    return self.kv[k]

  def key_value_delete(self, k):
    self._call()
    for key in [key for key in self.kv if key == k or key.startswith(k + "/")]:
      del self.kv[key]


def test_the_exchange_caps_what_it_publishes_and_compiles_where_the_store_fails(monkeypatch,
                                                                                caplog):
  """rollout/exchange.py against a store in one process: a process past its publishing cap
  publishes nothing to load (the other compiles its own, not waiting); a store that stops
  answering is logged once and every later program compiled here, the store not asked
  again; a program another process is compiling is BUSY to a thread that may put it off."""
  import jax
  import jax.numpy as jnp

  from tlt_jax.rollout import exchange, port
  lowered = jax.jit(lambda v: v * 3.0).lower(jnp.ones((4,), jnp.float32))
  exe, dev = lowered.compile(), jax.devices()[:1]
  portable = port.portable(exe, dev)
  store = _Store()
  one, two = exchange.Exchange(store, 0, 2), exchange.Exchange(store, 1, 2)
  assert one.take("p", lowered) is None and one.claimed("p")  # (claimed: compile, publish)
  assert two.take("p", lowered, wait=False) is exchange.BUSY
  one.publish("p", portable, 1.5, 64)
  got, compile_s, memory = two.take("p", lowered)
  assert (compile_s, memory) == (1.5, 64)
  np.testing.assert_array_equal(np.asarray(port.port(got, dev)(jnp.arange(4.0))),
                                3 * np.arange(4.0))
  assert not [k for k in store.kv if "/data/" in k]  # (every other process took it)
  monkeypatch.setattr(exchange, "PUBLISH_CAP", len(portable.data) + 1)
  assert one.take("q", lowered) is None
  one.publish("q", portable, 1.0, None)  # (past the cap: the first's bytes counted)
  assert two.take("q", lowered) is None and not two.claimed("q")
  assert "cap" in store.kv[f"{exchange.PREFIX}q/0/meta"]
  store.down = True
  with caplog.at_level("WARNING", logger="tlt_jax.rollout.exchange"):
    assert two.take("r", lowered) is None and two.take("s", lowered) is None
  calls = store.calls
  assert two.take("t", lowered) is None and store.calls == calls
  assert len([r for r in caplog.records if "no longer shared" in r.message]) == 1


def test_a_program_handed_to_a_next_round_is_kept_for_each_of_its_takers():
  """rollout/exchange.py, three processes against a store in one: the first claims a program
  and took it from JAX's persistent cache (nothing to load: the next round's), the second
  claims that round and publishes it; the first asking for it again (another key of the same
  module) loads it without counting as one of the round's takers, so the third still finds it,
  and its taking, the last, deletes the data."""
  import jax
  import jax.numpy as jnp

  from tlt_jax.rollout import exchange, port
  lowered = jax.jit(lambda v: v - 1.0).lower(jnp.ones((4,), jnp.float32))
  dev = jax.devices()[:1]
  portable = port.portable(lowered.compile(), dev)
  store = _Store()
  one, two, three = (exchange.Exchange(store, i, 3) for i in range(3))
  assert one.take("c", lowered) is None and one.claimed("c")
  one.publish("c", None, 0.2, None, cached=True)
  assert two.take("c", lowered) is None and two.claimed("c")  # (round 1's claim)
  two.publish("c", portable, 2.0, 32)
  for ex in (one, three):
    got, compile_s, _ = ex.take("c", lowered)
    assert compile_s == 2.0
    np.testing.assert_array_equal(np.asarray(port.port(got, dev)(jnp.arange(4.0))),
                                  np.arange(4.0) - 1.0)
  assert not [k for k in store.kv if "/data/" in k]


def test_the_progress_board_holds_the_jobs_latest():
  """The watchdog's shared clock (distributed.ProgressBoard): each process's latest progress
  under its key, `latest()` the newest of all, a process's later publication replacing its
  own."""
  results = launch("tests/mp_workers/progress.py", 2, devices_per_process=1, timeout=90)
  assert all(r.returncode == 0 for r in results), describe(results)
  for r in results:
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert got == {"process": r.process_id, "seen": 1001.0, "after": 5.0}, got


HEARTBEAT_S = 10
# From the victim's exit to the survivor's: about heartbeat_timeout, plus slack for a loaded
# 2-core machine (measured 9-10 s on JAX 0.10.2 and 0.12 where the heartbeat decides; under
# 1 s where the victim is process 0 or gloo sees the closed connection).
BOUND_S = HEARTBEAT_S + 20
FAILURE = re.compile(r"Terminating process because the JAX distributed service detected "
                     r"fatal errors|distributed: process \d/2 failed with")


@pytest.mark.parametrize("mode,victim,wait", [
    ("kill", 1, "collective"),  # the survivor is blocked in a collective with the dead peer
    ("kill", 1, "sleep"),  # it waits on something that cannot notice: only the heartbeat can
    ("kill", 0, "sleep"),  # the coordinator itself dies
    ("raise", 1, "sleep"),  # an uncaught exception: the excepthook exits at once
])
def test_dead_process_stops_the_other(mode, victim, wait):
  results = launch("tests/mp_workers/die.py", 2, devices_per_process=4,
                   args=[mode, str(victim), wait, str(HEARTBEAT_S)], timeout=90)
  dead, survivor = results[victim], results[1 - victim]
  msg = describe(results)
  assert "DYING" in dead.stdout and "BLOCKING" in survivor.stdout, msg
  assert dead.returncode == (7 if mode == "kill" else 1), msg
  assert not survivor.timed_out and survivor.returncode != 0, msg
  assert "UNEXPECTED" not in survivor.stdout, msg
  assert survivor.end - dead.end < BOUND_S, msg
  assert FAILURE.search(survivor.stderr), msg
  if mode == "raise":
    assert "RuntimeError: boom" in dead.stderr and FAILURE.search(dead.stderr), msg


@pytest.mark.parametrize("process_id,match", [
    (1, r"RuntimeError: distributed: process 1/2 \(explicit\) cannot reach the coordinator "
        r"127\.0\.0\.1:\d+ within 4 s"),
    (0, r"distributed: process 0/2 \(explicit\): not all 2 processes joined the coordinator"),
])
def test_missing_process_fails_at_start(process_id, match):
  """Process 0 alone, or process 1 with no coordinator: an error saying what to check, within
  about the initialization timeout (4 s here), not a hang."""
  r = launch("tests/mp_workers/join.py", 1, devices_per_process=4, args=["4"], timeout=60,
             env={"TLT_NUM_PROCESSES": "2", "TLT_PROCESS_ID": str(process_id)})[0]
  assert not r.timed_out and r.returncode != 0 and "JOINED" not in r.stdout, r.tail()
  assert re.search(match, r.stderr), r.tail()


def test_a_process_started_with_another_count_stops_the_job():
  """Process 1 told 3 processes joins a job of 2: it leaves at once with one line naming the
  counts (exit 2), and process 0 stops within the heartbeat (5 s here), not at its shutdown
  barrier minutes later."""
  results = launch("tests/mp_workers/join.py", 2, devices_per_process=2, args=["10", "5"],
                   timeout=60, env=lambda i: {"TLT_NUM_PROCESSES": "3"} if i == 1 else {})
  first, wrong = results
  msg = describe(results)
  assert wrong.returncode == 2 and "JOINED" not in wrong.stdout, msg
  assert re.search(r"distributed: process 1/3 \(explicit\): num_processes=3, but the "
                   r"coordinator 127\.0\.0\.1:\d+ runs a job of 2 processes; give every "
                   r"process the same count", wrong.stderr), msg
  assert not first.timed_out and first.returncode != 0, msg
  assert first.end - wrong.end < 5 + 20, msg
