"""HistoryIndex at scale: memory, insert/lookup time, perfect-verifier acceptance by epoch.

  python scripts/bench_history.py [--prompts 8] [--samples 16] [--length 16384] [--epochs 2]
  python scripts/bench_history.py --overlap [--arm 4_1_5|plain] [--shadows 0] [--rounds 3]

--overlap: the engine on the embedded default model with no index, a synchronous one and the
background one (HistoryIndex), wall time per token; --shadows N adds a synthetic load.

What it measures and how the samples are made: tlt_jax/bench/history.py.
"""

from __future__ import annotations

import argparse

from tlt_jax.bench.history import automaton_cost, history_table, overlap_table


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
  ap.add_argument("--overlap", action="store_true",
                  help="the engine with no / a synchronous / a background index instead")
  ap.add_argument("--arm", default="4_1_5", help="--overlap: drafter arm, or plain")
  ap.add_argument("--shadows", type=int, default=0,
                  help="--overlap: synthetic load, shadow rows fed each row's tokens")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  if args.overlap:
    for line in overlap_table(args.rounds, prompts=args.prompts, samples=args.samples,
                              arm=args.arm, shadows=args.shadows, seed=args.seed):
      print(line, flush=True)
    return
  if args.automaton:
    b, us = automaton_cost(args.automaton)
    print(f"CPython suffix automaton (dict transitions, {args.automaton} tokens): {b:.0f} "
          f"bytes/token, {us:.2f} us/token insert", flush=True)
  for line in history_table(args.prompts, args.samples, args.length, epochs=args.epochs,
                            span=args.span, mut=args.mut, seed=args.seed):
    print(line, flush=True)


if __name__ == "__main__":
  main()
