"""History drafts vs the drafter vs both under one bandit, by epoch, at batch 1 / 8 / long tail.

  python scripts/bench_history_arms.py [--bench /tmp/bench] [--epochs 2] [--out DIR]

Default target: the embedded default model and its shipped drafter; --bench DIR: the
memory-bound bench target (python scripts/make_bench_model.py --out DIR). What is measured and
how: tlt_jax/bench/history_arms.py. Tables go to stdout, the summary to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os

from tlt_jax.bench.history_arms import Args, run


def main():
  d = Args()
  ap = argparse.ArgumentParser()
  ap.add_argument("--bench", default=None, help="make_bench_model.py output dir (default: the "
                  "embedded default model)")
  ap.add_argument("--drafter_arms", default=d.drafter_arms, help="drafter arms, comma-separated")
  ap.add_argument("--history_arms", default=d.history_arms, help="history arms")
  ap.add_argument("--hybrid_arms", default=d.hybrid_arms, help="hybrid arms")
  ap.add_argument("--no_bandit", action="store_true", help="skip the bandit over all arms")
  ap.add_argument("--bandit_warmup", type=int, default=d.bandit_warmup,
                  help="at most this many untimed passes the bandit learns from first (a "
                  "scratch index), until it is past its min_pulls exploration")
  ap.add_argument("--min_pulls", type=int, default=d.min_pulls,
                  help="the bandit measures each arm this often before exploiting "
                  "(configs/default.py's tlt.spec.min_pulls)")
  ap.add_argument("--workloads", default=d.workloads, help="batch1,batch8,tail (a subset)")
  ap.add_argument("--prompts", type=int, default=d.prompts, help="groups at batch 1 and 8")
  ap.add_argument("--samples", type=int, default=d.samples, help="samples per group at batch 1")
  ap.add_argument("--tail_prompts", type=int, default=d.tail_prompts)
  ap.add_argument("--tail_samples", type=int, default=d.tail_samples)
  ap.add_argument("--threshold", type=int, default=d.threshold,
                  help="long tail: speculate at <= this many live rows")
  ap.add_argument("--epochs", type=int, default=d.epochs)
  ap.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens)
  ap.add_argument("--temperature", type=float, default=d.temperature)
  ap.add_argument("--out", default=os.path.join("out", "bench_history_arms"))
  a = vars(ap.parse_args())
  out = a.pop("out")
  a["bandit"] = not a.pop("no_bandit")
  summary = run(Args(**a))
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  print(f"wrote {os.path.join(out, 'summary.json')}")


if __name__ == "__main__":
  main()
