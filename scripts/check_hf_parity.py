#!/usr/bin/env python
"""Checks that tlt_jax computes the same logits as Hugging Face transformers for a checkpoint.

  python scripts/check_hf_parity.py --model /path/to/hf_dir [--dtype float32|bfloat16]
      [--batch 2 --seq 32 --seed 0 --tol X] [--no-ragged]

What it runs and the error metric: tlt_jax/bench/hf_parity.py (--no-ragged skips the KV-cache
check). Prints the max abs logit difference, the same relative to the logit scale, and whether
greedy next tokens agree.

Exit status: 0 parity holds; 1 parity fails (difference above --tol, or non-finite logits);
2 the checkpoint cannot be loaded (missing directory, unsupported or inconsistent checkpoint).
"""

from __future__ import annotations

import argparse
import sys

from tlt_jax.bench.hf_parity import DEFAULT_TOL, UnloadableCheckpoint, check_parity


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="local Hugging Face model directory")
  p.add_argument("--dtype", default="float32", choices=sorted(DEFAULT_TOL),
                 help="param and compute dtype on both sides (default float32)")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tol", type=float, default=None,
                 help="max allowed max|diff| / max(1, max|hf logit|) "
                      f"(default: {DEFAULT_TOL})")
  p.add_argument("--no-ragged", action="store_true",
                 help="skip the right-padded KV-cache check")
  args = p.parse_args(argv)
  if args.batch < 1 or args.seq < 2:
    p.error("--batch must be >= 1 and --seq >= 2")
  if args.tol is None:
    args.tol = DEFAULT_TOL[args.dtype]
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    r = check_parity(args.model, dtype=args.dtype, batch=args.batch, seq=args.seq,
                     seed=args.seed, tol=args.tol, ragged=not args.no_ragged)
  except UnloadableCheckpoint as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg = r.cfg
  print(f"model: {args.model}\n  {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} (q/kv), head_dim {cfg.head_dim_}, "
        f"vocab {cfg.vocab_size}, tied={cfg.tie_word_embeddings}, "
        f"rope_scaling={'llama3' if cfg.rope_scaling else None}, dtype {args.dtype}")
  if r.ragged_lengths is not None:
    print(f"  ragged row lengths: {r.ragged_lengths}")
  for c in r.checks:
    if not all(c.finite):
      print(f"{c.name:28s} NON-FINITE logits (tlt_jax finite: {c.finite[0]}, "
            f"transformers finite: {c.finite[1]})")
      continue
    print(f"{c.name:28s} max|diff| {c.diff:.3e}   logit scale {c.scale:.3e}   "
          f"max|diff|/max(1,scale) {c.rel:.3e}   {'ok' if c.ok else 'FAIL'} (tol {r.tol:g})")
  if r.greedy is not None:
    ours, ref, agree_all = r.greedy
    rows = sum(a == b for a, b in zip(ours, ref))
    print(f"greedy next tokens: {'agree' if rows == len(ours) else 'DISAGREE'} "
          f"({rows}/{len(ours)} rows; argmax agrees at {agree_all:.1%} of all positions)  "
          f"tlt_jax {ours} transformers {ref}")
  if r.failures:
    print(f"PARITY FAILED: {', '.join(r.failures)}")
    return 1
  print("PARITY OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())
