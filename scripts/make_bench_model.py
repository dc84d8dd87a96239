#!/usr/bin/env python
"""Builds a memory-bound benchmark target + drafter that compute exactly the shipped tiny model.

    python scripts/make_bench_model.py --out /tmp/bench      # ~190M target, ~14M drafter, seconds
    python -m tlt_jax.generate --model /tmp/bench/model --drafter /tmp/bench/drafter \
        --spec 4_1_5 --prompts tlt_jax/assets/default/data/test.jsonl --output /tmp/out.jsonl

Why and how (weight surgery in numpy, no training): tlt_jax/bench/bench_model.py.

Writes OUT/model (HF checkpoint: config.json, model.safetensors, tokenizer, generation_config),
OUT/drafter (save_drafter's format) and OUT/bench_model.json (arguments, param counts), then
prints the max logit difference to the shipped model and (unless --no_regime) a regime check:
median times of k-token vs 1-token cached forwards at batch 1, bench vs shipped.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tlt_jax.bench.bench_model import (SHIPPED, BuildError, build,  # noqa: E402
                                       logit_diff, regime_report)


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="output directory (gets model/ and drafter/)")
  p.add_argument("--source", default=SHIPPED, help="directory with model/ + drafter/ "
                 "(+ data/test.jsonl for the checks); default: the shipped assets")
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv_heads", type=int, default=16)
  p.add_argument("--intermediate", type=int, default=2816)
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--seed", type=int, default=0, help="seed of the added layers' weights")
  p.add_argument("--overwrite", action="store_true", help="replace OUT/model and OUT/drafter")
  p.add_argument("--no_regime", action="store_true", help="skip the timing check")
  args = p.parse_args(argv)
  try:
    s = build(args.out, source=args.source, hidden=args.hidden, heads=args.heads,
              kv_heads=args.kv_heads, intermediate=args.intermediate, layers=args.layers,
              seed=args.seed, overwrite=args.overwrite)
  except BuildError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}/model ({s['target_params'] / 1e6:.1f}M params, shipped "
        f"{s['shipped_target_params'] / 1e6:.2f}M) and {args.out}/drafter "
        f"({s['drafter_params'] / 1e6:.1f}M, shipped {s['shipped_drafter_params'] / 1e6:.2f}M) "
        f"in {s['build_seconds']:.1f}s")
  if os.path.exists(os.path.join(args.source, "data", "test.jsonl")):
    diff, same = logit_diff(args.out, args.source)
    print(f"function check: max |logit diff| vs the shipped model {diff:.2e}, greedy argmax "
          f"{'identical' if same else 'DIFFERENT'}")
    if not same:
      return 1
  if not args.no_regime:
    print(regime_report(args.out, args.source))
  return 0


if __name__ == "__main__":
  sys.exit(main())
