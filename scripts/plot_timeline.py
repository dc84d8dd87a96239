#!/usr/bin/env python
"""Per-worker timeline (Gantt) of RL steps: when each rollout worker was GENERATING, IDLE
(its share done, waiting for the slowest worker) or TRAINING the drafter, the rollout
barrier, and the time until the merged drafter reached every worker.

    python scripts/plot_timeline.py --workdir workdirs/default [--steps 1,20,40] \\
        [--out workdirs/default/timeline.png]

Reads <workdir>/timeline.jsonl (written by `python -m tlt_jax.train`, one line per step) and
metrics.jsonl (for the idle share trained); writes one PNG with a panel per step.
"""

from __future__ import annotations

import argparse
import os
import sys


def load(workdir: str) -> tuple[dict[int, dict], dict[int, dict]]:
  from tlt_jax.metrics import read_records

  def read(name):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      raise SystemExit(f"error: {path} does not exist; run `python -m tlt_jax.train` with "
                       f"--workdir {workdir} first")
    return {int(rec["step"]): rec for rec in read_records(path)}
  return read("timeline.jsonl"), read("metrics.jsonl")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--steps", default="", help="comma-separated steps (default: first, middle, "
                                             "last)")
  p.add_argument("--out", default=None, help="default: <workdir>/timeline.png")
  a = p.parse_args(argv)
  timelines, metrics = load(a.workdir)
  if not timelines:
    raise SystemExit(f"error: {a.workdir}/timeline.jsonl has no steps")
  have = sorted(timelines)
  if a.steps:
    try:
      steps = [int(s) for s in a.steps.split(",")]
    except ValueError:
      raise SystemExit(f"error: --steps {a.steps!r}: give comma-separated integers") from None
    missing = [s for s in steps if s not in timelines]
    if missing:
      raise SystemExit(f"error: --steps {missing} not in {a.workdir}/timeline.jsonl "
                       f"(steps {have[0]}..{have[-1]})")
  else:
    steps = sorted({have[0], have[len(have) // 2], have[-1]})
  out = a.out or os.path.join(a.workdir, "timeline.png")
  from tlt_jax.coordinator.timeline import plot
  plot(timelines, metrics, steps, out)
  print(f"wrote {out} (steps {', '.join(map(str, steps))})", file=sys.stderr)


if __name__ == "__main__":
  main()
