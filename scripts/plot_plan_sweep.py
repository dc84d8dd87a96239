"""Overlays acceptance sweeps of several recipes (`python -m tlt_jax.plan --rates ...` writes
each one's sweep.json): TLT's predicted speedup of the rollout and of the step against the
drafter's per-draft acceptance, a line per recipe.

  python -m tlt_jax.plan --config configs/qwen2_5_7b_math.py --rates 0.3,0.5,0.74,0.9 --out A
  python -m tlt_jax.plan --config configs/qwen2_5_32b_math.py --rates 0.3,0.5,0.74,0.9 --out B
  python scripts/plot_plan_sweep.py --sweep A --sweep B --out sweep.png
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tlt_jax.plan import sweep  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sweep", action="append", required=True,
                 help="a sweep's output directory (its sweep.json) or the file; repeat")
  p.add_argument("--label", action="append", default=None,
                 help="a line's label, one per --sweep (default: the model and cluster)")
  p.add_argument("--out", required=True, help="the PNG to write")
  a = p.parse_args()
  if a.label and len(a.label) != len(a.sweep):
    p.error(f"--label given {len(a.label)} times for {len(a.sweep)} --sweep")
  sweeps = []
  for path in a.sweep:
    f = os.path.join(path, "sweep.json") if os.path.isdir(path) else path
    if not os.path.isfile(f):
      p.error(f"--sweep {path}: no sweep.json there (python -m tlt_jax.plan --rates ... "
              "--out DIR writes one)")
    with open(f) as fh:
      sweeps.append(json.load(fh))
  sweep.plot(sweeps, a.out, labels=a.label)
  for s in sweeps:
    print(sweep.text(s))
    print()
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
