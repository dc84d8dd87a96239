#!/usr/bin/env python
"""Runs' curves side by side: training reward, held-out accuracy, response length and seconds
per RL step, from each workdir's metrics.jsonl (e.g. TLT on vs off: lossless, so the same
curves, in less time).

    python scripts/plot_curves.py --workdir workdirs/on --workdir workdirs/off \\
        [--label "TLT on" --label "TLT off"] [--smooth 5] [--out curves.png]

A run writes its own `<workdir>/curves.png` when it ends (the same figure, one run).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", action="append", required=True,
                 help="a tlt_jax.train workdir (repeat for several runs)")
  p.add_argument("--label", action="append", default=None,
                 help="a name per --workdir, in order (default: the folders' names)")
  p.add_argument("--smooth", type=int, default=5, help="steps in the reward's rolling mean")
  p.add_argument("--out", default=None,
                 help="default: <workdir>/curves.png for one run, ./curves.png for several")
  a = p.parse_args(argv)
  if a.label is not None and len(a.label) != len(a.workdir):
    p.error(f"{len(a.label)} --label for {len(a.workdir)} --workdir: give one per run")
  if a.smooth < 1:
    p.error(f"--smooth {a.smooth}: use >= 1")
  from tlt_jax.curves import plot_runs
  from tlt_jax.metrics import read_records
  labels = a.label or [os.path.basename(os.path.normpath(w)) for w in a.workdir]
  if len(set(labels)) != len(labels):
    p.error(f"runs share a name ({labels}): name each with --label")
  runs = {}
  for label, workdir in zip(labels, a.workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
      p.error(f"--workdir {workdir}: no metrics.jsonl; pass the workdir of a tlt_jax.train run")
    runs[label] = read_records(path)
  out = a.out or (os.path.join(a.workdir[0], "curves.png") if len(a.workdir) == 1
                  else "curves.png")
  plot_runs(runs, out, smooth=a.smooth)
  print(f"wrote {out} ({', '.join(labels)})", file=sys.stderr)


if __name__ == "__main__":
  main()
