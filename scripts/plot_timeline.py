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


COLORS = {"generating": "#4C72B0", "idle": "#DD8452", "training": "#55A868"}


def load(workdir: str) -> tuple[dict[int, dict], dict[int, dict]]:
  from tlt_jax.metrics import read_records

  def read(name):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      raise SystemExit(f"error: {path} does not exist; run `python -m tlt_jax.train` with "
                       f"--workdir {workdir} first")
    return {int(rec["step"]): rec for rec in read_records(path)}
  return read("timeline.jsonl"), read("metrics.jsonl")


def plot(timelines: dict[int, dict], metrics: dict[int, dict], steps: list[int], out: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch
  fig, axes = plt.subplots(len(steps), 1, figsize=(11, 1.0 + 1.1 * len(steps) * max(
      1 + max((iv[0] for t in timelines.values() for iv in t["intervals"]), default=0), 2) / 2),
                           squeeze=False)
  for ax, step in zip(axes[:, 0], steps):
    tl = timelines[step]
    workers = sorted({iv[0] for iv in tl["intervals"]})
    for w, state, start, end in tl["intervals"]:
      if state in COLORS and end > start:
        ax.barh(w, end - start, left=start, height=0.6, color=COLORS[state])
    if tl.get("barrier") is not None:
      ax.axvline(tl["barrier"], color="k", lw=1)
    if tl.get("released") is not None:
      ax.axvline(tl["released"], color="k", lw=1, ls=":")
    spot = metrics.get(step, {}).get("spot", {})
    share = spot.get("idle_share_trained")
    title = f"step {step}"
    if share is not None:
      title += (f": {spot['idle_s']:.1f} s idle worker time, {share:.0%} of it training the "
                f"drafter; {spot['critical_path_s'] * 1000:.0f} ms of drafter time after the "
                "barrier")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_yticks(workers)
    ax.set_yticklabels([f"worker {w}" for w in workers])
    ax.invert_yaxis()
  axes[-1, 0].set_xlabel("seconds since the rollout began (solid line: barrier, the last "
                         "worker done; dotted: merged drafter on every worker)")
  fig.legend(handles=[Patch(color=c, label=s) for s, c in COLORS.items()], loc="upper right",
             ncol=3, fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.96))
  fig.savefig(out, dpi=120)
  plt.close(fig)


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
  plot(timelines, metrics, steps, out)
  print(f"wrote {out} (steps {', '.join(map(str, steps))})", file=sys.stderr)


if __name__ == "__main__":
  main()
