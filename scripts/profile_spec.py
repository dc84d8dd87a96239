"""Where a speculative step's time goes: per-forward costs inside compiled loops.

  python scripts/profile_spec.py [--batch_sizes 1,8] [--arms 4_1_5,4_4_16] [--iters 200]
      [--model DIR --drafter DIR]   (default: the shipped model; e.g. scripts/make_bench_model.py's)

What each row measures, and the bounds on the speedup it prints: tlt_jax/bench/spec_costs.py.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from tlt_jax.bench.spec_costs import bounds, measure_costs


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default=None, help="HF model dir (default: the shipped one)")
  ap.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one)")
  ap.add_argument("--batch_sizes", default="1,8")
  ap.add_argument("--arms", default="4_1_5,6_1_7,4_4_16,6_4_24")
  ap.add_argument("--iters", type=int, default=200)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--cache_len", type=int, default=384)  # 96 prompt + 288 new (the bench's)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--accept", default=None,
                  help="arm=tokens per verification,... for the bounds (default: the chain "
                       "arms get 1 + the drafter eval's accept_len at depth 4, others none)")
  args = ap.parse_args()

  from tlt_jax.config import asset_path
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.rollout.sampling import SamplingParams

  cfg, params = load_hf_model(args.model or asset_path("default", "model"))
  dparams = load_drafter(args.drafter or asset_path("default", "drafter"), cfg)
  arms = args.arms.split(",")
  if args.accept:
    accept = {a: float(x) for a, x in (kv.split("=") for kv in args.accept.split(","))}
  else:
    with open(asset_path("default", "drafter", "eval.json")) as f:
      accept = {"4_1_5": 1.0 + json.load(f)["eval"]["accept_len"]}
  sp = SamplingParams(temperature=args.temperature)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; target {cfg.num_layers} layers "
        f"D={cfg.hidden_size} V={cfg.vocab_size}; cache {args.cache_len}, prompt "
        f"{args.prompt_len}, temperature {args.temperature}; in-loop microseconds per call")
  for b in [int(x) for x in args.batch_sizes.split(",")]:
    costs = measure_costs(params, dparams, cfg, b, arms, sp, iters=args.iters,
                          prompt_len=args.prompt_len, cache_len=args.cache_len, rules=True)
    unit = costs["plain step"]
    print(f"\n## batch {b}\n\n| component | us / call | / plain step |\n|---|---:|---:|")
    for name, t in costs.items():
      print(f"| {name} | {t * 1e6:.0f} | {t / unit:.2f} |")
    for arm in arms:
      bd = bounds(costs, arm, accept.get(arm, 1.0))
      print(f"\n{arm}: r = {bd['r']:.3f}; forwards cost {bd['ideal_cost']:.2f}, whole step "
            f"{bd['step_cost']:.2f} plain steps; with every draft accepted the speedup is <= "
            f"{bd['perfect']:.2f}x (forwards only)")
      if arm in accept:
        print(f"  at {accept[arm]:.2f} tokens per verification the speedup is <= "
              f"{bd['lead']:.2f}x (lead's formula), <= {bd['ideal']:.2f}x (forwards only), <= "
              f"{bd['measured']:.2f}x (whole step)")


if __name__ == "__main__":
  main()
