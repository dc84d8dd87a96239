"""BEG-MAB vs fixed strategies on the long-tail rollout, measured in one run.

  python scripts/bench_mab.py [--num_prompts 64] [--passes 10] [--warmup 2] [--chunk_size 4]
                              [--arms A,B,...]

Arms: every arm of the default BEG buckets (`tlt_jax.rollout.policies.mab.default_mab_buckets()`),
or `--arms` in every bucket of the default bounds.
Each arm as a fixed strategy, and BEG over the default buckets, decode the long-tail workload
(default model + shipped drafter, default-task test prompts, temperature 1, EOS) pass by pass,
interleaved (tlt_jax/bench/mab.py). BEG keeps learning across passes and is reported
after its first --warmup passes; fixed arms over the same passes (same sampling seeds).
Prints tokens/s per configuration, BEG / best fixed and BEG / worst fixed (best and worst in
hindsight), and the compiled (bucket, arm) executables BEG needs (choosable pairs) against
every arm at every bucket: count, compile seconds, memory_analysis bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--num_prompts", type=int, default=64)
  ap.add_argument("--max_batch", type=int, default=64)
  ap.add_argument("--max_new_tokens", type=int, default=288)
  ap.add_argument("--chunk_size", type=int, default=4, help="decode steps per selector decision")
  ap.add_argument("--passes", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2, help="BEG passes left out of its number")
  ap.add_argument("--epsilon", type=float, default=0.1)
  ap.add_argument("--window", type=int, default=300)
  ap.add_argument("--arms", default="", help="comma-separated arms, each in every bucket of "
                  "the default bounds ('': the default buckets)")
  ap.add_argument("--bs_threshold", type=int, default=0,
                  help="speculate once live <= this (0: max_batch, every bucket speculates)")
  args = ap.parse_args()

  import jax
  import numpy as np

  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.policies.cells import make_selector
  from tlt_jax.rollout.policies.mab import default_mab_buckets
  from tlt_jax.bench.mab import LongTailBench, load_default_workload, throughput

  buckets = default_mab_buckets()
  if args.arms:
    buckets = {lo: args.arms.split(",") for lo in buckets}
  arms = make_selector("beg", buckets).arms
  work = load_default_workload(args.num_prompts)
  bench = LongTailBench(work, arms, max_batch=args.max_batch, chunk_size=args.chunk_size,
                        max_new_tokens=args.max_new_tokens, bs_threshold=args.bs_threshold)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {len(work.requests)} prompts, "
        f"max_batch {args.max_batch}, chunk {args.chunk_size}, arms {arms}", file=sys.stderr)
  print(f"precompile + warm-up pass: {bench.precompile():.0f}s", file=sys.stderr)

  def beg():
    return make_selector("beg", buckets, epsilon=args.epsilon, window=args.window, seed=0)

  configs = {f"fixed {a}": (lambda a=a: make_selector("fixed", strategy=a)) for a in arms}
  configs["BEG (default buckets)"] = beg
  passes, selectors = bench.run(configs, args.passes,
                                log=lambda m: print(m, file=sys.stderr, flush=True))

  tps = {name: throughput(passes, name, skip=args.warmup) for name in configs}
  fixed = {n: v for n, v in tps.items() if n.startswith("fixed")}
  best = max(fixed, key=lambda n: fixed[n][0])
  worst = min(fixed, key=lambda n: fixed[n][0])
  g = tps["BEG (default buckets)"][0]
  print(f"\n| configuration | tokens/s (passes {args.warmup}-{args.passes - 1}) | per-pass std |")
  print("|---|---:|---:|")
  for name, (v, sd) in tps.items():
    tag = " (best fixed)" if name == best else " (worst fixed)" if name == worst else ""
    print(f"| {name}{tag} | {v:.0f} | {sd:.0f} |")
  print(f"\nBEG / best fixed ({best}): {g / fixed[best][0]:.2f}x; "
        f"BEG / worst fixed ({worst}): {g / fixed[worst][0]:.2f}x")

  # Per-bucket view from the fixed runs: median chunk reward (the bandit's reward) per arm.
  sel = selectors["BEG (default buckets)"]
  print("\nmedian chunk tokens/s of each fixed arm, by BEG bucket (live size):")
  print("| live | " + " | ".join(arms) + " |\n|---|" + "---:|" * len(arms))
  for lo in sel.buckets:
    row = []
    for a in arms:
      r = [c.tokens / c.wall_time for p in passes if p.config == f"fixed {a}"
           and p.index >= args.warmup for c in p.chunks
           if c.mode == a and sel.bucket_of(c.live) == lo]
      row.append(f"{np.median(r):.0f}" if r else "-")
    print(f"| >= {lo} | " + " | ".join(row) + " |")
  print()
  # BEG's values per bucket after the run (median tokens/s of the window).
  for lo in sel.buckets:
    vals = ", ".join(f"{a} {v:.0f}" if v is not None else f"{a} -"
                     for a, v in sel.values(lo).items())
    print(f"BEG bucket >= {lo}: {vals}")

  # Compile: BEG's choosable pairs vs every arm at every bucket (bench.precompile compiled all).
  mem = bench.pair_memory()
  ecfg = bench.worker.ecfg
  print("\n| executables | speculation at live <= | count | compile s | memory MB |")
  print("|---|---:|---:|---:|---:|")
  for thr in sorted({ecfg.spec.bs_threshold, 16}):
    w = Engine(work.params, work.cfg, dataclasses.replace(
        ecfg, spec=dataclasses.replace(ecfg.spec, bs_threshold=thr)),
        drafter_params=work.drafter_params, bandit=beg().cfg,
        history=bench.worker.history)  # (the default buckets hold history arms)
    rows = {"BEG choosable pairs": [(a, b)
                                    for b, arms_b in w.choosable_pairs().items()
                                    for a in arms_b],
            "every arm x every bucket": [(a, b) for b in ecfg.buckets for a in arms]}
    for name, pairs in rows.items():
      got = [mem[p] for p in pairs if p in mem]
      note = "" if len(got) == len(pairs) else f" ({len(pairs) - len(got)} not measured)"
      print(f"| {name}{note} | {thr} | {len(pairs)} | {sum(s for _, s in got):.0f} | "
            f"{sum(m or 0 for m, _ in got) / 2**20:.0f} |")
  used = {(c.mode, c.bucket) for p in passes if p.config == "BEG (default buckets)"
          for c in p.chunks if c.mode != "plain"}
  print(f"\nBEG, lazily compiled (pairs it actually chose in {args.passes} passes): {len(used)}")


if __name__ == "__main__":
  main()
