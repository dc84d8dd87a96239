"""Verification kernels vs XLA: Mosaic GPU vs Triton vs the jnp reference, per shape.

  python scripts/bench_verify.py [--batches 1,8,64] [--ks 4,8] [--vocab 151936] [--iters 50]

What each cell measures: tlt_jax/bench/verify_kernels.py. scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import warnings

from tlt_jax.bench.verify_kernels import kernel_table


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="1,8,64")
  ap.add_argument("--ks", default="4,8")
  ap.add_argument("--vocab", type=int, default=151936)  # Qwen2.5
  ap.add_argument("--iters", type=int, default=50)
  args = ap.parse_args()
  # the Triton column lowers the deprecated backend on purpose (kernels/verify says why)
  warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
  for line in kernel_table([int(b) for b in args.batches.split(",")],
                           [int(k) for k in args.ks.split(",")], args.vocab, iters=args.iters):
    print(line, flush=True)


if __name__ == "__main__":
  main()
