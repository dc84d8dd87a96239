"""Where a compiled step's device time goes: JAX's profiler trace, read back in Python.

`kernel_profile(run, steps)` traces `run()` (which executes `steps` steps of a compiled loop),
then reads the trace (`jax.profiler.ProfileData`, no TensorBoard) and sums the device's events
per line and per name: on a GPU the device plane's lines are its streams (every kernel, by
kernel name) and "XLA Ops" (the HLO op each kernel ran for). Per step: how many kernels ran,
the time they were busy (the union of their intervals, so overlap is counted once), and the
step's wall time from the host: busy / wall near 1 means the kernels themselves are slow (bytes
or arithmetic); far below 1 means the device waits between them (launches, host syncs). The
top names by time say which kernels to fix first. Off a GPU there is no device plane: the
host's XLA threads stand in (the code path is exercised, the numbers mean little).
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time
from typing import Callable

import jax


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


def kernel_profile(run: Callable[[], None], steps: int, top: int = 12) -> dict:
  """Traces one call of `run` (warm: compiled and run once before) covering `steps` steps.
  -> {wall_s, lines: [{plane, line, events_per_step, busy_s_per_step, top: [(name, s per
  step, events per step)]}]} for the device planes (or the host's XLA lines off a GPU)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    t = time.perf_counter()
    run()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return {"wall_s": wall / steps, "lines": [], "error": "the profiler wrote no trace"}
    data = jax.profiler.ProfileData.from_file(files[0])
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


def profile_markdown(title: str, prof: dict) -> str:
  """The profile as markdown: a row per line (kernels a step, busy time vs the wall), then
  each busy line's top names."""
  wall = prof["wall_s"]
  rows = [f"#### {title}: device time per step (wall {wall * 1e3:.3f} ms)", "",
          "| plane / line | events a step | busy ms a step | busy / wall |", "|---|---:|---:|---:|"]
  lines = sorted(prof["lines"], key=lambda ln: -ln["busy_s_per_step"])
  for ln in lines:
    rows.append(f"| {ln['plane']} / {ln['line']} | {ln['events_per_step']:.1f} | "
                f"{ln['busy_s_per_step'] * 1e3:.3f} | {ln['busy_s_per_step'] / wall:.0%} |")
  if prof.get("error"):
    rows.append(f"\n{prof['error']}")
  for ln in lines[:2]:
    rows += ["", f"top of {ln['line']}:", "", "| name | us a step | a step |", "|---|---:|---:|"]
    rows += [f"| {n[:90]} | {s * 1e6:.1f} | {c:.1f} |" for n, s, c in ln["top"]]
  return "\n".join(rows)
