"""Lockstep runs (tlt_jax/bench/lockstep.py): never two jobs running at once, each job's time
is its own, a failing job stops the rest. Checked against the jobs' own clocks: each child
spins the CPU and writes, per step, the wall interval it saw itself running in."""

import json
import os
import sys
import textwrap
import time
import warnings

import jax
import pytest

from tlt_jax.bench import lockstep

CHILD = textwrap.dedent("""
  import json, os, sys, time
  out, steps, work, fail = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
  time.sleep(0.05)  # start-up
  with open(out, "w") as f:
    for k in range(steps):
      # spin in short slices and keep the wall-clock slices it saw: a stop shows up as a gap
      slices, t0 = [], time.time()
      # (a slice that straddles a stop lasts as long as the stop: it is not counted as work)
      while sum(b - a for a, b in slices if b - a < 0.01) < work:
        a = time.time()
        while time.time() - a < 0.002:
          pass
        slices.append((a, time.time()))
      if fail and k == 1:
        sys.exit(3)
      f.write(json.dumps({"step": k, "slices": slices, "nice": os.nice(0),
                          "leader": os.getpgid(0) == os.getpid()}) + "\\n")
      f.flush()
  # (the exit a turn of its own: a loop starved on a loaded machine would see the last record
  # and the exit in one poll, and count one turn fewer)
  time.sleep(0.3)
""")


def _jobs(tmp_path, n, steps, work, fail=()):
  script = tmp_path / "child.py"
  script.write_text(CHILD)
  return [lockstep.Job(f"j{i}", [sys.executable, str(script), str(tmp_path / f"j{i}.jsonl"),
                                 str(steps), str(work), "1" if i in fail else "0"],
                       log=str(tmp_path / f"j{i}.log"), records=str(tmp_path / f"j{i}.jsonl"))
          for i in range(n)]


def test_one_job_at_a_time_and_own_time(tmp_path):
  steps, work = 4, 0.08
  t = time.perf_counter()
  # the jobs start without Python running in a fork of this process, which JAX's threads can
  # deadlock (JAX warns from its at-fork hook once its backend runs, as in bench_e2e's driver)
  jax.devices()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = lockstep.run(_jobs(tmp_path, 3, steps, work))
  assert not [w for w in caught if "fork" in str(w.message)], caught
  wall = time.perf_counter() - t
  spans = {}
  for i in range(3):
    recs = [json.loads(l) for l in open(tmp_path / f"j{i}.jsonl")]
    assert [r["step"] for r in recs] == list(range(steps))
    spans[i] = [(a, b) for r in recs for a, b in r["slices"] if b - a < 0.01]
    assert out[f"j{i}"].returncode == 0
    # niced by 5 over this process, and the command itself leads the group the stops go to
    assert {(r["nice"], r["leader"]) for r in recs} == {(os.nice(0) + 5, True)}
    assert out[f"j{i}"].turns == steps + 1  # a turn per record, then one to its exit
  # no two children ever ran at once: every slice of one lies outside every slice of another
  # (slices that straddled a stop are left out above; the 3 ms allow for a stop's latency)
  for i in range(3):
    for j in range(i + 1, 3):
      for a0, a1 in spans[i]:
        for b0, b1 in spans[j]:
          assert min(a1, b1) - max(a0, b0) < 0.003
  # each job's time covers its own work, and the jobs' times add up to the wall time
  for i in range(3):
    assert out[f"j{i}"].seconds >= steps * work
  assert sum(o.seconds for o in out.values()) == pytest.approx(wall, rel=0.05, abs=0.1)


def test_failed_job_stops_the_others(tmp_path):
  jobs = _jobs(tmp_path, 2, 5, 0.02, fail=(0,))
  with pytest.raises(RuntimeError, match=r"run j0 failed \(exit 3\); see .*j0\.log"):
    lockstep.run(jobs)
  # the other job was killed, not left stopped: its record file no longer grows
  n = sum(1 for _ in open(tmp_path / "j1.jsonl"))
  time.sleep(0.3)
  assert sum(1 for _ in open(tmp_path / "j1.jsonl")) == n < 5
