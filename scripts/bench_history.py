"""HistoryIndex at scale: memory, insert/lookup time, perfect-verifier acceptance by epoch.

  python scripts/bench_history.py [--prompts 8] [--samples 16] [--length 16384] [--epochs 2]

What it measures and how the samples are made: tlt_jax/bench/history.py.
"""

from __future__ import annotations

import argparse

from tlt_jax.bench.history import automaton_cost, history_table


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--length", type=int, default=16384)
  ap.add_argument("--epochs", type=int, default=2)
  ap.add_argument("--span", type=int, default=200)
  ap.add_argument("--mut", type=float, default=0.02)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--automaton", type=int, default=100_000,
                  help="tokens for the suffix-automaton comparison (0: skip)")
  args = ap.parse_args()
  if args.automaton:
    b, us = automaton_cost(args.automaton)
    print(f"CPython suffix automaton (dict transitions, {args.automaton} tokens): {b:.0f} "
          f"bytes/token, {us:.2f} us/token insert", flush=True)
  for line in history_table(args.prompts, args.samples, args.length, epochs=args.epochs,
                            span=args.span, mut=args.mut, seed=args.seed):
    print(line, flush=True)


if __name__ == "__main__":
  main()
