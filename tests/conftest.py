"""Test setup: 8 fake CPU devices so sharded code paths really run sharded, and compiles made
cheap (the suite compiles far more than it runs).

The flags must be set before jax is imported anywhere, which is why they live here. They reach
the subprocesses tests start (CLI runs, multi-process launches) through the environment.
"""

import gc
import os
import signal
import sys
import tempfile

# XLA's CPU collectives exit the process when a participant misses a rendezvous by the
# termination timeout (40 s; "Termination timeout ... Exiting to ensure a consistent program
# state"): a worker died so in test_export's update, twice; that was the deadlock below (NPROC),
# but on 2 cores shared by two xdist workers and the processes they start a rendezvous can
# also be slow, which is not an error here.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_cpu_collective_call_terminate_timeout_seconds=1200 "
                      "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU client runs device programs on a pool of max(cores, devices) threads, "enough
# for one collective" (xla/pjrt/cpu/cpu_client.cc). With 8 fake devices on 2 cores that is
# 8, and the learner's 8-device programs deadlocked in it: every pool thread blocked in a
# partition of a collective program, waiting for partitions queued behind them (gdb: 8 of 8
# "XLAExecute" threads in CpuPjRtRawLoadedExecutable::Execute's wait; XLA's stuck-rendezvous
# log: 7 ranks in an all-gather, the 8th thread rank 0 of the same run in an all-reduce, so
# one partition held two threads; scripts/stress_cpu_collectives.py). test_grpo's sharded
# learner test, run over and over in two processes, hung in 8 of 8 within 6 runs; CI lost a
# worker to it after pytest-timeout's 20 minutes (and session 53 one in test_train). XLA
# sizes its pools from NPROC where it is set: twice the devices, 0 of 4 hung in 30-60 runs
# (scripts/stress_cpu_collectives.py); the suite's time unchanged (17m17s-17m35s vs 17m43s).
os.environ.setdefault("NPROC", "16")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# XLA's backend at optimisation level 0: tiny models spend most of a test in the compiler
# (measured: two engine tests 143 -> 105 s). It changes code generation, not the program.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One persistent compilation cache for the suite (both xdist workers and the processes they
# start; kept between runs): the same programs recur across tests and across a test's runs (a
# resumed run compiles what its uninterrupted twin did). Entries are keyed by the program, so a
# kept one is never stale. Only compiles over 0.2 s are kept: eager ops compile thousands of
# tiny programs, cheaper to compile again than to store. No size limit: JAX's LRU eviction
# rescans the whole directory on every write (quadratic: with it, a test_grpo case of eager
# ops took 138 s, without it 10 s). A CLI run's config may name its own cache
# (configs/default.py does).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "tlt_jax_test_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402

from tlt_jax.rollout import executables, sharing  # noqa: E402


# Seconds each test file took in the whole suite (cold cache, `bash scripts/test.sh
# --durations=0`, 2026-12-04; files under 10 s left out). The files are handed to the two xdist
# workers heaviest first (longest processing time first; scripts/test.sh turns off xdist's own
# order, by number of tests): in that order a one-test file of ~5 minutes (test_gpu_check) ran
# last on one worker while the other sat idle for ~280 s.
_FILE_SECONDS = {
    "test_speculative.py": 346, "test_train.py": 279, "test_history_spec.py": 248,
    "test_gpu_check.py": 242, "test_rollout.py": 215, "test_drafter.py": 167,
    "test_multihost.py": 225, "test_acceptance.py": 155, "test_bench_model.py": 141,
    "test_mab.py": 131, "test_grpo.py": 103, "test_models.py": 99, "test_export.py": 94,
    "test_generate_cli.py": 91, "test_verify_kernel.py": 81, "test_plan_sim.py": 81,
    "test_notebook.py": 56, "test_distributed.py": 52, "test_checkpoint.py": 51,
    "test_paged_attention.py": 46, "test_memory.py": 44, "test_coordinator.py": 43,
    "test_eagle_serving.py": 34, "test_eval.py": 33, "test_config.py": 27, "test_packing.py": 21,
    "test_gate.py": 21, "test_verl_data.py": 18, "test_sharding.py": 18, "test_tree.py": 17,
    "test_gpu_outputs.py": 17, "test_rewards.py": 16, "test_attention.py": 14,
    "test_plan_cost.py": 13, "test_history.py": 12, "test_imports.py": 10, "test_lora.py": 40}


def pytest_collection_modifyitems(items):
  """Test files in decreasing `_FILE_SECONDS` (a stable sort: each file's tests stay together
  and in their order; unlisted files last, in collection order)."""
  items.sort(key=lambda item: -_FILE_SECONDS.get(item.path.name, 0))


@pytest.fixture(scope="session")
def tiny():
  """(params, drafter params) of spec_helpers.TINY, the engine tests' tiny target."""
  from spec_helpers import make_tiny
  return make_tiny()


@pytest.fixture(scope="session")
def plain_greedy(tiny):
  """spec_helpers.PlainGreedy on the `tiny` target: plain greedy decoding's results, the
  engine tests' reference, computed once per request list for the session."""
  from spec_helpers import PlainGreedy
  return PlainGreedy(tiny[0])


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
  """After each test file, JAX's in-memory caches of what that file traced and compiled are
  dropped, and the executables its engines shared (the persistent cache keeps the slow
  compiles): an xdist worker otherwise holds every program of every file it ran (~6 GB by the
  end of the suite here), and one died on CI's machine without a traceback, as the kernel's
  OOM killer leaves it. Measured on four files in one process: peak 2.15 -> 1.77 GB, time
  unchanged. Compile threads the file's engines left running are waited for first: clearing
  JAX's caches beside a compile in another thread is a race (a worker crashed natively, with
  no traceback, in test_train and test_grpo once each, on 2026-12-01 and 12-02)."""
  yield
  executables.drain_compilers()
  jax.clear_caches()
  executables.forget_cache_loaded()
  sharing.clear_shared()
  gc.collect()
  log = os.environ.get("TLT_TEST_MEMORY_LOG")
  if log:  # scripts/test.sh prints its tail when a run fails (a worker killed leaves no trace)
    with open(log, "a") as f:
      f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {request.node.nodeid}: "
              f"{_memory()}\n")


@pytest.fixture
def fresh_jax_cache(tmp_path):
  """JAX's persistent compilation cache in an empty directory for this test, and JAX's
  in-memory caches emptied: what it compiles is compiled, not loaded from the suite's cache
  (an executable loaded from it is not ported to other devices: rollout/sharing.py's
  _SOURCES)."""
  from jax._src import compilation_cache
  # JAX's in-memory cache would hand back what an earlier test of the worker loaded from the
  # suite's cache (no port source either: rollout/executables.py's _FROM_CACHE)
  executables.drain_compilers()
  jax.clear_caches()
  executables.forget_cache_loaded()
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _unshared_while_patched(request):
  """A test that patches module attributes (`monkeypatch`) can change what a function computes
  without changing its key: it neither takes nor leaves executables shared across the
  process's engines (rollout/sharing.py; shared within a file otherwise)."""
  patched = "monkeypatch" in request.fixturenames
  if patched:
    sharing.clear_shared()
  yield
  if patched:
    sharing.clear_shared()


def _fault_file(worker: str) -> str | None:
  """Where worker `worker`'s faulthandler writes a fatal error's stacks (beside scripts/test.sh's
  memory log; None when the suite runs without it)."""
  log = os.environ.get("TLT_TEST_MEMORY_LOG")
  return f"{log}.{worker}.fault" if log else None


_FAULT_FILE = None  # (a worker's) the file its faulthandler writes to


def pytest_sessionstart(session):
  """(each xdist worker) A fatal error's stacks go to a file the controller reads when the
  worker dies (pytest_testnodedown): on the worker's stderr they interleave with the other
  worker's output, and CI shows a run's last lines, where the crashing thread's stack was cut
  off (2026-12-03: a SIGSEGV in test_checkpoint with only the main thread's frames shown).
  pytest's own faulthandler timeout dump (pyproject's faulthandler_timeout) is not affected."""
  import faulthandler
  global _FAULT_FILE
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  path = _fault_file(worker) if worker else None
  if path:
    _FAULT_FILE = open(path, "w")  # open for the process's life: faulthandler writes to its fd
    faulthandler.enable(file=_FAULT_FILE, all_threads=True)


def _fault_summary(text: str, frames: int = 4) -> str:
  """faulthandler's dump cut to what tells a crash apart: its first line, the crashing thread's
  whole stack, and the top `frames` frames of every other thread."""
  head, blocks = [], []
  for line in text.splitlines():
    if line.startswith(("Thread 0x", "Current thread 0x")):
      blocks.append([line])
    elif line.startswith("Extension modules:"):
      break
    elif blocks and line.startswith("  "):
      blocks[-1].append(line)
    elif not blocks and line.strip():
      head.append(line)

  def plumbing(line):  # pytest's and xdist's own frames, one line for a run of them
    return any(f"/{m}/" in line for m in ("_pytest", "pluggy", "execnet", "xdist"))

  out = head[:3]
  for b in sorted(blocks, key=lambda b: not b[0].startswith("Current")):
    b = [x for i, x in enumerate(b) if not (plumbing(x) and i and plumbing(b[i - 1]))]
    b = [x if not plumbing(x) else "  ... (pytest's frames)" for x in b]
    keep = b if b[0].startswith("Current") else b[:frames + 1]
    out += keep + ([f"  ... {len(b) - len(keep)} more frames"] if len(b) > len(keep) else [])
  return "\n".join(out)


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: unknown without it)
def pytest_testnodedown(node, error):
  """(xdist's controller) A worker that died says nothing of how: no traceback when the kernel
  killed it (out of memory), when a native thread overflowed its stack, when native code
  called exit(), or when pytest-timeout ended it (its stack dump does not leave the worker:
  measured). Its process's exit status tells these apart."""
  if not error:
    return
  popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
  try:
    rc = popen.wait(timeout=60)
  except Exception:  # noqa: BLE001 - no process to ask (another gateway kind) or still running
    return
  if rc is not None and rc < 0:
    name = signal.Signals(-rc).name
    how = {"SIGKILL": "killed: the kernel's OOM killer (see the memory lines below) or a kill "
                      "from outside",
           "SIGSEGV": "a segmentation fault: its faulthandler report follows where it wrote "
                      "one; none: a native thread's stack overflow"}.get(name, "")
    said = f"signal {name}" + (f" ({how})" if how else "")
  else:
    how = {1: "pytest-timeout ended it (a test past pyproject's timeout: the stacks "
              "faulthandler dumped above show where it hung)",
           42: "XLA ended it: a collective's rendezvous passed its termination timeout"}
    said = f"exit status {rc}" + (f" ({how[rc]})" if rc in how else "")
  print(f"[{node.gateway.id}] the worker's process ended with {said}", file=sys.stderr,
        flush=True)
  path = _fault_file(node.gateway.id)
  if path and os.path.exists(path) and os.path.getsize(path):
    with open(path, errors="replace") as f:
      print(f"[{node.gateway.id}] its faulthandler report (the crashing thread first):\n"
            + _fault_summary(f.read()), file=sys.stderr, flush=True)


def _memory() -> str:
  """This process's resident and peak memory and the machine's available memory (Linux)."""
  def fields(path):
    with open(path) as f:
      return dict(line.split(":", 1) for line in f)
  try:
    status, info = fields("/proc/self/status"), fields("/proc/meminfo")
  except OSError:
    return "n/a"
  mb = lambda v: int(v.split()[0]) // 1024  # noqa: E731 (kB)
  return (f"rss {mb(status['VmRSS'])} MB, peak {mb(status['VmHWM'])} MB; machine: "
          f"{mb(info['MemAvailable'])} of {mb(info['MemTotal'])} MB available")
