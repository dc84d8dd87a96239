"""Profiler traces of chosen RL steps (tlt_jax/profiling.py): the steps a config names and
only those, read back from the trace files the profiler writes (Perfetto's JSON, XLA's
xplane), and the config's mistakes as one error."""

import gzip
import io
import json
import os

import jax
import jax.numpy as jnp
import pytest

from tlt_jax.errors import ConfigError
from tlt_jax.profiling import ProfileConfig, StepProfiler, read_trace


def _trace_dirs(workdir):
  root = os.path.join(workdir, "tb", "plugins", "profile")
  return sorted(os.path.join(root, d) for d in os.listdir(root)) if os.path.isdir(root) else []


def _events(trace_dir):
  with gzip.open(os.path.join(trace_dir, "perfetto_trace.json.gz")) as f:
    return json.load(f)["traceEvents"]


def _steps_in(trace_dir):
  return sorted(int(e["args"]["step_num"]) for e in _events(trace_dir)
                if e.get("name") == "rl_step")


def _run(profiler, steps, fail_at=None):
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((64, 64)) / 64
  for n in range(1, steps + 1):
    with profiler.step(n):
      with jax.profiler.TraceAnnotation("update"):
        x = f(x).block_until_ready()
      if n == fail_at:
        raise RuntimeError("a step that fails")
    profiler.after(n)


def test_steps_parse_and_a_mistake_is_one_error():
  assert ProfileConfig().range is None and ProfileConfig("").range is None
  assert ProfileConfig("3").range == (3, 3) and ProfileConfig(" 2-5 ").range == (2, 5)
  for bad in ("x", "3-", "1-2-3", "0", "5-3", "-2"):
    with pytest.raises(ConfigError, match="steps"):
      ProfileConfig(bad)


def test_only_the_named_steps_are_traced_with_their_summary(tmp_path):
  """steps 2-3 of 5: one trace holding rl_step 2 and 3 (and their phases), none of 1, 4, 5;
  summary.md beside it; the line names the folder."""
  out = io.StringIO()
  _run(StepProfiler(ProfileConfig("2-3"), str(tmp_path), out=out), 5)
  (d,) = _trace_dirs(tmp_path)
  assert _steps_in(d) == [2, 3]
  assert sum(e.get("name") == "update" for e in _events(d)) == 2
  assert f"profile: steps 2-3 traced in {d} (tensorboard --logdir {tmp_path}/tb" in out.getvalue()
  summary = open(os.path.join(d, "summary.md")).read()
  assert summary.startswith("#### RL steps 2-3: device time per step")
  got = json.load(open(os.path.join(d, "summary.json")))
  assert got["steps"] == [2, 3] and got["lines"] and not got["device_plane"]  # (a CPU here)
  xplane = [f for f in os.listdir(d) if f.endswith(".xplane.pb")]
  prof = read_trace(os.path.join(d, xplane[0]), 2, 1.0)
  assert prof["wall_s"] == 0.5 and prof["lines"]  # (the CPU's XLA threads, here)


def test_a_run_that_ends_inside_the_range_keeps_what_it_traced(tmp_path):
  """A step that fails inside the range ends the trace there (the steps up to it kept); a
  resumed run that starts inside the range traces from its first step; a range past the run's
  end traces nothing; other processes trace into their own folder."""
  p = StepProfiler(ProfileConfig("2-4"), str(tmp_path), out=None)
  with pytest.raises(RuntimeError, match="a step that fails"):
    _run(p, 5, fail_at=3)
  p.close()  # (train's finally: nothing under way any more, a no-op)
  (d,) = _trace_dirs(tmp_path)
  assert _steps_in(d) == [2, 3]
  resumed = StepProfiler(ProfileConfig("2-4"), str(tmp_path / "resumed"), out=None)
  for n in (3, 4, 5):
    with resumed.step(n):
      pass
    resumed.after(n)
  (d,) = _trace_dirs(tmp_path / "resumed")
  assert _steps_in(d) == [3, 4]
  _run(StepProfiler(ProfileConfig("9"), str(tmp_path / "late"), out=None), 3)
  assert not (tmp_path / "late").exists()
  p = StepProfiler(ProfileConfig("1"), str(tmp_path / "mp"), process=3, out=None)
  _run(p, 1)
  assert os.listdir(tmp_path / "mp" / "tb" / "process_3" / "plugins" / "profile")
