"""A mixture of experts' MLP on the device: the grouped-matmul kernel's start-up check, a
learner micro-batch's experts forward + backward (the kernel vs ragged_dot) and a rollout
step's experts at a few batch sizes against the copy bandwidth (gpu_check's experts stage).

  python scripts/gpu_experts.py [--dims 2048,768,128,8] [--dtype bfloat16] [--tokens 4096]
      [--decode 1,8,64] [--iters 5] [--budget_s 0] [--out DIR]

What each cell measures: tlt_jax/bench/experts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tlt_jax.bench import experts  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dims", default="2048,768,128,8",
                  help="hidden, expert width, experts, experts a token (Qwen3-30B-A3B's)")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--tokens", type=int, default=4096, help="the learner cell's tokens")
  ap.add_argument("--decode", default="1,8,64", help="the decode cells' tokens a step")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--budget_s", type=float, default=0.0, help="start no cell after this")
  ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_experts"))
  args = ap.parse_args(argv)
  d, f, e, k = (int(v) for v in args.dims.split(","))
  os.makedirs(args.out, exist_ok=True)
  records = []
  print("\n".join(experts.table([])), flush=True)
  for r in experts.cells(d, f, e, k, args.dtype, args.tokens,
                         [int(v) for v in args.decode.split(",")], args.iters, args.budget_s):
    records.append(r)
    print(experts.table([r])[-1], flush=True)
    with open(os.path.join(args.out, "experts.json"), "w") as fh:
      json.dump({"dims": [d, f, e, k], "dtype": args.dtype, "cells": records}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
