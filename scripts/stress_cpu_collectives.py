"""Stress test: does XLA's CPU client deadlock the sharded learner's collectives?

On 8 fake CPU devices XLA sizes its execution pool to max(cores, devices) threads, "enough for
one collective" (xla/pjrt/cpu/cpu_client.cc): 8 on a 2-core machine. With the suite's
settings the GRPO learner's 8-device programs deadlocked in it: every pool thread blocked in
a partition of a collective program, waiting for partitions queued behind them (gdb). The
suite runs with NPROC=16 (tests/conftest.py; XLA sizes its pools from NPROC where it is set).
This script decides, for a JAX version and machine, whether that is still needed: for each
NPROC value, processes of their own (two at once, as the suite's two xdist workers) run the
suite's sharded-learner test (tests/test_grpo.py: 8 GRPO steps of a tiny model, rollout on
one device, the FSDP update on 8) over and over under tests/conftest.py's settings; a run
that does not end within --hang_s counts as hung (its stacks printed) and ends its process.

    .venv/bin/python scripts/stress_cpu_collectives.py [--runs 30] [--nproc 8,16] [--procs 2]
        [--test test_train::test_resume_with_spot_training_and_the_bandit_restores_every_state]

2026-12-02, 2-vCPU Intel Xeon, JAX 0.12.0.1: NPROC=8 (XLA's own choice here), 8 of 8
processes hung within their first 6 runs (4 with nothing else running; this script's last
invocation: 2 of 2, after 5 and 0 runs; one process alone hung in its first run, and with
JAX_CPU_ENABLE_ASYNC_DISPATCH=false in its second); NPROC=9 and 12, 0 of 2 in 20 runs each (the pool
is one thread short); NPROC=16, 0 of 4 in 30-60 runs each. XLA's stuck-rendezvous log
(`--xla_cpu_collective_call_warn_stuck_timeout_seconds=10` in XLA_FLAGS) shows where: ranks
0-6 of one execution (one run id) wait in an all-gather (op 24) for rank 7, which has no
thread, and the 8th thread holds rank 0 of the same run id waiting in an all-reduce (op 1).
It reads as one partition running two independent collectives at once on two pool threads,
where XLA sized the pool at one thread per partition. 2026-12-03, 2-core AMD EPYC,
the same JAX: NPROC=8, 0 of 2 processes hung in 60 runs each (and 0 of 2 in 8 runs each with
`--xla_cpu_multi_thread_eigen=false`), so the deadlock depends on the machine's timing; and
with `--test test_train::test_resume_with_spot_training_and_the_bandit_restores_every_state`
(the acceptance measurement's 8-device program beside the drafter's overlapped settle; it hung
once in a suite run of session 60) at NPROC=16, 0 of 4 processes in 12 runs each, then 1 of 2
in 30 runs each (in its 12th: ranks 0-6 of an 8-device all-to-all waiting for rank 7, the
main thread in the acceptance program, the settle thread in the merge's eager ops: two
threads launching multi-device programs at once); with the merge and push moved onto the
learner's thread (tlt_jax/coordinator/coordinator.py), 0 of 2 in 40 runs each. A loop of RL
steps with the learner on 2 devices (the main job's CPU layout is 1 learner device): 0 of 2
processes hung in 400 steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOOP = r"""
import faulthandler, importlib, inspect, pathlib, sys, tempfile
sys.path.insert(0, sys.argv[3])
import conftest  # noqa: F401 - the suite's settings (flags, caches, precision), before jax

steps, hang_s, (module, name) = int(sys.argv[1]), float(sys.argv[2]), sys.argv[4].split("::")
test = getattr(importlib.import_module(module), name)
args = set(inspect.signature(test).parameters)
if args - {"tmp_path"}:
  sys.exit(f"{module}::{name} takes fixtures {sorted(args)}; this loop supplies tmp_path only")
for step in range(steps):
  faulthandler.dump_traceback_later(hang_s, exit=True)  # a hung test: stacks, exit 1
  test(**({"tmp_path": pathlib.Path(tempfile.mkdtemp())} if args else {}))
  faulthandler.cancel_dump_traceback_later()
  print("step", step, flush=True)
"""


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--runs", type=int, default=30, help="runs of the test per process")
  p.add_argument("--nproc", default="8,16", help="NPROC values to try (XLA's own choice is "
                 "max(cores, devices): 8 for 8 fake devices on up to 8 cores)")
  p.add_argument("--procs", type=int, default=2, help="processes per value, run at once")
  p.add_argument("--hang_s", type=float, default=120.0, help="seconds a run may take")
  p.add_argument("--test", default="test_grpo::test_grpo_raises_a_toy_reward_on_a_sharded_learner",
                 help="module::function of tests/ to run over and over (no fixtures but "
                 "tmp_path)")
  a = p.parse_args()
  for nproc in a.nproc.split(","):
    env = dict(os.environ, NPROC=nproc, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP, str(a.runs), str(a.hang_s),
                               os.path.join(ROOT, "tests"), a.test], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(a.procs)]
    hung = 0
    for i, proc in enumerate(procs):
      out, _ = proc.communicate()
      done = sum(line.startswith("step ") for line in out.splitlines())
      if proc.returncode != 0:
        hung += 1
        print(f"NPROC={nproc} process {i}: stopped after {done} runs (exit "
              f"{proc.returncode}); its last lines:\n" + "\n".join(out.splitlines()[-150:]))
    print(f"NPROC={nproc}: {hung} of {a.procs} processes hung or failed ({a.runs} runs of "
          f"{a.test} each, {time.perf_counter() - t0:.0f} s)", flush=True)

if __name__ == "__main__":
  main()
