#!/usr/bin/env python
"""Does the spot-trained drafter keep up with the policy? (tlt_jax/bench/drift.py; #36)

    .venv/bin/python scripts/bench_drift.py [--config configs/default.py] [--steps 40] \\
        [--every 10] [--num_prompts 128] [--eval_samples 2] [--train_prompts 64] \\
        [--samples 8] [--out out/bench_drift] [--run OUT/run] \\
        [--extra="--config.optim.lr=... ..."]

Runs one TLT training run of the config with the speculation gate off (so the drafter is
spot-trained in every idle window), checkpointing every --every steps (re-running resumes
it), then for step 0 and every checkpoint measures on --num_prompts held-out prompts how far
the policy moved (per-token KL to step 0, entropy, held-out greedy accuracy, response
lengths) and chain 4_1_5's tokens per verification, greedy and at the rollout temperature
(--eval_samples samples per prompt), each with its standard error, for the frozen drafter,
the run's spot-trained one and a ceiling (the frozen one fitted offline on the step's own
rollouts with the spot trainer's token budget), and the paired differences spot - frozen and
spot - ceiling. Prints the tables, writes OUT/drift.json, OUT/drift.md and OUT/drift.png.
--run: the run's workdir (default OUT/run; an existing, finished run is only measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "default.py"))
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--every", type=int, default=10)
  p.add_argument("--num_prompts", type=int, default=128)
  p.add_argument("--eval_samples", type=int, default=2, help="samples per held-out prompt "
                 "the T=1 figures are read off")
  p.add_argument("--train_prompts", type=int, default=64)
  p.add_argument("--samples", type=int, default=8, help="rollouts per training prompt the "
                 "ceiling drafter is fitted on")
  p.add_argument("--out", default=os.path.join(ROOT, "out", "bench_drift"))
  p.add_argument("--run", default=None, help="the run's workdir (default OUT/run)")
  p.add_argument("--extra", default="", help="space-separated --config.key=value overrides")
  args = p.parse_args()
  if args.steps < 1 or args.every < 1 or args.steps % args.every:
    sys.exit("error: --steps must be a positive multiple of --every")
  from tlt_jax.bench import drift
  os.makedirs(args.out, exist_ok=True)
  workdir = args.run or os.path.join(args.out, "run")
  drift.train_run(workdir, config=args.config, steps=args.steps, every=args.every,
                  extra=args.extra.split(), cache=os.path.join(args.out, "jax_cache"))
  ctx = drift.context(workdir, num_prompts=args.num_prompts,
                      num_train_prompts=args.train_prompts, samples=args.samples,
                      eval_samples=args.eval_samples)
  rows = [drift.measure_step(0, ctx["params0"], ctx["dparams0"], ctx)]
  for t in range(args.every, args.steps + 1, args.every):
    params, dparams = drift.load_step(workdir, t)
    rows.append(drift.measure_step(t, params, dparams, ctx))
  title = (f"{os.path.basename(args.config)} {args.extra}".strip()
           + f": {args.steps} steps, {args.num_prompts} held-out prompts "
           f"(x{args.eval_samples} samples at T)")
  text = drift.table(rows)
  print(f"## {title}\n\n{text}")
  with open(os.path.join(args.out, "drift.json"), "w") as f:
    json.dump({"title": title, "rows": rows, "verdicts": drift.verdicts(rows)}, f, indent=1)
  with open(os.path.join(args.out, "drift.md"), "w") as f:
    f.write(f"## {title}\n\n{text}\n")
  drift.plot(rows, os.path.join(args.out, "drift.png"), title)
  print(f"wrote {args.out}/drift.json, drift.md, drift.png", file=sys.stderr)


if __name__ == "__main__":
  main()
