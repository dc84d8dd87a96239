"""Profiler traces: of chosen RL steps of a run, and of a compiled loop (the GPU checklist's).

A run: `--config.profile.steps=3` (or `3-4`) traces those steps with JAX's profiler into the
run's TensorBoard folder, `<workdir>/tb/plugins/profile/<time>/` (`tensorboard --logdir
<workdir>/tb`, its Profile tab, or xprof), with a `perfetto_trace.json.gz` beside it for
ui.perfetto.dev and a `summary.md` (and `summary.json`: `read_trace`'s) of where the traced
steps' device time went. Each step is one `rl_step` step annotation and its phases are named
(rollout, logprobs, update, spot, sync: see `device_memory.phase`), on the main thread; each
rollout worker's share and drafter training on the worker's own thread. Every process of a
multi-process run traces its own devices (the others into `tb/process_<i>/`). Tracing costs
time: the traced steps' seconds are not the run's.

Reading a trace (`read_trace`): `jax.profiler.ProfileData`, no TensorBoard. The device's
events are summed per line and per name: on a GPU the device plane's lines are its streams
(every kernel, by kernel name) and "XLA Ops" (the HLO op each kernel ran for). Per step: how
many kernels ran, the time they were busy (the union of their intervals, so overlap counts
once), and the wall time from the host: busy / wall near 1 means the kernels themselves are
slow (bytes or arithmetic); far below 1 means the device waits between them (launches, host
syncs, the host's own work). The top names by time say which kernels to fix first. Off a GPU
there is no device plane: the host's XLA threads stand in (the code path is exercised, the
numbers mean little).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
from typing import Callable, Iterator

import jax

from tlt_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """config.profile: `steps` "" (none), "N" or "N-M" (RL steps, 1-based as metrics.jsonl
  numbers them)."""
  steps: str = ""

  def __post_init__(self):
    _steps(self.steps)

  @property
  def range(self) -> tuple[int, int] | None:
    """(first, last) step to trace; None: no trace."""
    return _steps(self.steps)


def _steps(value) -> tuple[int, int] | None:
  text = str(value).strip()
  if not text:
    return None
  parts = text.split("-")
  if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
    raise ConfigError("use a step N or a range N-M of RL steps to trace, e.g. 3 or 3-4",
                      "steps", value)
  first, last = int(parts[0]), int(parts[-1])
  if first < 1 or last < first:
    raise ConfigError("the steps count from 1, and a range N-M needs M >= N", "steps", value)
  return first, last


class StepProfiler:
  """Traces the RL steps of `config.range` (`step`: each step's work; `after`: once it is
  written). A run that ends inside the range (stopped, failed, fewer steps) ends the trace
  there (`close`). `out`: where the one line saying where the trace is goes (None: nowhere)."""

  def __init__(self, config: ProfileConfig, workdir: str, process: int = 0, out=sys.stderr):
    self.range = config.range
    self.tb = os.path.join(workdir, "tb")  # (the run's TensorBoard folder)
    self.dir = os.path.join(self.tb, *([f"process_{process}"] if process else []))
    self.out = out
    self._started: tuple[int, float] | None = None  # (first step traced, its start time)
    self._last = 0

  @contextlib.contextmanager
  def step(self, n: int) -> Iterator[None]:
    """RL step `n`'s work: begins the trace at the range's first step (or the first one a
    resumed run reaches); `after(n)` ends it after the last."""
    if self.range and self._started is None and self.range[0] <= n <= self.range[1]:
      files = set(_traces(self.dir))
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self._started, self._before = (n, time.perf_counter()), files
    with jax.profiler.StepTraceAnnotation("rl_step", step_num=n):
      yield
    self._last = n

  def after(self, n: int) -> None:
    """Step `n` is done and its metrics written: the trace ends if `n` was the range's last
    (writing a trace takes a while; what the step measured is on disk first)."""
    if self._started is not None and n >= self.range[1]:
      self.close()

  def close(self) -> None:
    """Ends a trace under way: writes it, its summary, and says where (no-op otherwise)."""
    if self._started is None:
      return
    (first, t0), self._started = self._started, None
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    steps = max(self._last - first + 1, 1)
    new = [f for f in _traces(self.dir) if f not in self._before]
    if not new:
      self._say(f"profile: the profiler wrote no trace in {self.dir}")
      return
    where = os.path.dirname(new[0])
    done = f"step {first}" if steps == 1 else f"steps {first}-{first + steps - 1}"
    try:  # the summary is a convenience: the trace is what was asked for
      prof = dict(read_trace(new[0], steps, wall), steps=[first, first + steps - 1])
      with open(os.path.join(where, "summary.md"), "w") as f:
        f.write(markdown(f"RL {done}", prof) + "\n")
      with open(os.path.join(where, "summary.json"), "w") as f:  # (gpu_check's headline)
        json.dump(prof, f)
    except Exception as e:  # noqa: BLE001
      self._say(f"profile: no summary of the trace ({type(e).__name__}: {e})")
    self._say(f"profile: {done} traced in {where} (tensorboard --logdir {self.tb}, its "
              "Profile tab; perfetto_trace.json.gz there for ui.perfetto.dev; summary.md)")

  def _say(self, line: str) -> None:
    if self.out is not None:
      print(line, file=self.out, flush=True)


def _traces(d: str) -> list[str]:
  return sorted(glob.glob(os.path.join(d, "plugins", "profile", "*", "*.xplane.pb")))


# ----------------------------------------------------------------------- reading a trace
def _busy_ns(intervals: list[tuple[int, int]]) -> int:
  """Length of the union of [start, end) intervals."""
  total, end = 0, None
  for s, e in sorted(intervals):
    if end is None or s > end:
      total += e - s
      end = e
    elif e > end:
      total += e - end
      end = e
  return total


def read_trace(path: str, steps: int, wall: float, top: int = 12) -> dict:
  """An .xplane.pb covering `steps` steps that took `wall` seconds -> {wall_s, device_plane,
  lines: [{plane, line, events_per_step, busy_s_per_step, top: [(name, s per step, events per
  step)]}]} for the device planes (or the host's XLA lines off a GPU)."""
  data = jax.profiler.ProfileData.from_file(path)
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  host = not planes
  if host:
    planes = [p for p in data.planes if p.name.startswith("/host:CPU")]
  out = {"wall_s": wall / steps, "lines": [], "device_plane": not host}
  for plane in planes:
    for line in plane.lines:
      if host and not line.name.startswith("tf_XLA"):
        continue
      events = [(e.name, e.start_ns, e.end_ns) for e in line.events]
      if not events:
        continue
      by = collections.defaultdict(lambda: [0, 0])
      for name, s, e in events:
        by[name][0] += e - s
        by[name][1] += 1
      ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
      out["lines"].append({
          "plane": plane.name, "line": line.name, "events_per_step": len(events) / steps,
          "busy_s_per_step": _busy_ns([(s, e) for _, s, e in events]) * 1e-9 / steps,
          "top": [(n, ns * 1e-9 / steps, c / steps) for n, (ns, c) in ranked]})
  return out


def kernel_profile(run: Callable[[], None], steps: int, top: int = 12) -> dict:
  """Traces one call of `run` (warm: compiled and run once before) covering `steps` steps of
  a compiled loop, in a temporary folder -> `read_trace`'s dict (with "error" where the
  profiler wrote nothing)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    t = time.perf_counter()
    run()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    files = _traces(d)
    if not files:
      return {"wall_s": wall / steps, "lines": [], "error": "the profiler wrote no trace"}
    return read_trace(files[0], steps, wall, top)


def markdown(title: str, prof: dict) -> str:
  """A `read_trace` dict as markdown: a row per line (events a step, busy time vs the wall),
  then the two busiest lines' top names."""
  wall = prof["wall_s"]
  rows = [f"#### {title}: device time per step (wall {wall * 1e3:.3f} ms)", "",
          "| plane / line | events a step | busy ms a step | busy / wall |", "|---|---:|---:|---:|"]
  lines = sorted(prof["lines"], key=lambda ln: -ln["busy_s_per_step"])
  for ln in lines:
    rows.append(f"| {ln['plane']} / {ln['line']} | {ln['events_per_step']:.1f} | "
                f"{ln['busy_s_per_step'] * 1e3:.3f} | {ln['busy_s_per_step'] / wall:.0%} |")
  if prof.get("error"):
    rows.append(f"\n{prof['error']}")
  if not prof.get("device_plane", True):
    rows.append("\n(no device plane: the host's XLA threads stand in)")
  for ln in lines[:2]:
    rows += ["", f"top of {ln['line']}:", "", "| name | us a step | a step |", "|---|---:|---:|"]
    rows += [f"| {n[:90]} | {s * 1e6:.1f} | {c:.1f} |" for n, s, c in ln["top"]]
  return "\n".join(rows)
