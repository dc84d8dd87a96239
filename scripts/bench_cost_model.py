"""The cost model (tlt_jax/plan/cost.py) on this machine: predict, then compare with measured.

  python scripts/bench_cost_model.py [--target DIR] [--dtype bfloat16] [--batch_sizes 1,4,16]
      [--arms 4_1_5,3_2_6] [--iters 64] [--out out/bench_cost_model]

Fits a hardware profile to the rollout's component forwards (the target's over 1 and each
arm's verified tokens, the drafter's) timed as the engine runs them, then predicts what the
fit did not see: the plain decode step and each arm's whole speculative step, and their
ratio (tlt_jax/plan/calibrate.py). Then whole rollouts: the cluster simulator
(tlt_jax/plan/sim.py) predicts batch 1, batch 8 and a long tail, plain and with the first arm,
on the fitted profile, and the engine decodes them (`validate_rollouts`). Then the RL step's
learner phases: the learner of --config (configs/default.py) priced on probes of its own
(`learner_profile`), then RL steps' log-prob pass and update predicted and run on samples of
the lengths a default run produces (`validate_learner`). Prints the tables
(and writes OUT/cost_model.md, .json): the figures that say whether the simulator's step
prices can be trusted here.
--target: a bench target dir (scripts/make_bench_model.py; default the shipped model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tlt_jax.bench.bench_model import load_target  # noqa: E402
from tlt_jax.plan.calibrate import (calibrate, host_overhead, learner_profile,  # noqa: E402
                                    learner_setup, learner_table, rollout_table,
                                    validate_learner, validate_rollouts)
from tlt_jax.rollout.sampling import SamplingParams  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default=None)
  ap.add_argument("--dtype", default=None, help="compute and param dtype (default: the "
                  "checkpoint's)")
  ap.add_argument("--batch_sizes", default="1,4,16")
  ap.add_argument("--arms", default="4_1_5,3_2_6")
  ap.add_argument("--iters", type=int, default=64)
  ap.add_argument("--cache_len", type=int, default=256)
  ap.add_argument("--out", default=os.path.join("out", "bench_cost_model"))
  ap.add_argument("--rollouts", type=int, default=1, help="1: also predict, then decode, "
                  "whole rollouts (batch 1, batch 8, a long tail; plain and the first arm)")
  ap.add_argument("--learner", type=int, default=1, help="1: also the learner's phases of "
                  "--config's RL step, predicted and measured")
  ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                   "default.py"))
  # a default run's response lengths: p50 22, p90 50, max ~150 tokens (its metrics.jsonl)
  ap.add_argument("--learner_lengths", default="lognormal:median=22,sigma=0.65,tail=0.03,"
                  "tail_from=60", help="response lengths of the learner's steps (tlt_jax.plan "
                  "--lengths syntax)")
  a = ap.parse_args()
  cfg, params, dparams, *_ = load_target(a.target, a.dtype)
  batches = [int(b) for b in a.batch_sizes.split(",")]
  cal = calibrate(params, dparams, cfg, SamplingParams(temperature=1.0), batches=batches,
                  arms=a.arms.split(","), iters=a.iters, cache_len=a.cache_len,
                  progress=lambda i, n, got: print(  # as it goes: a cut-off keeps these
                      f"batch {batches[i - 1]} timed ({i}/{n}): " + ", ".join(
                          f"{k} {s * 1e3:.3f} ms" for k, s in got.items()), flush=True))
  hw = cal.hardware
  lines = [f"profile fitted here: memory {hw.mem_bw / 1e9:.1f} GB/s, matmul "
           f"{hw.flops / 1e9:.1f} GFLOP/s, {hw.fixed_s * 1e6:.0f} us per forward + "
           f"{hw.layer_s * 1e6:.1f} us per layer", "", cal.table(), "",
           "| batch | arm | spec / plain measured | predicted | predicted / measured | one rate "
           "/ measured |", "|---:|---|---:|---:|---:|---:|"]
  for r in cal.ratios():
    lines.append(f"| {r['batch']} | {r['arm']} | {r['measured']:.2f} | {r['predicted']:.2f} | "
                 f"{r['predicted'] / r['measured']:.2f} | {r['one_rate'] / r['measured']:.2f} |")
  rollouts = []
  if a.rollouts:
    # whole rollouts, predicted by the simulator on the profile just fitted, then decoded
    hw = host_overhead(params, cfg, hw)
    lines += ["", f"host work beyond the forwards (two batch-1 probes): {hw.chunk_s * 1e3:.2f} "
              f"ms per chunk, {hw.op_s * 1e3:.2f} ms per layout operation"]
    rollouts = validate_rollouts(params, dparams, cfg, hw, arm=a.arms.split(",")[0],
                                 progress=lambda i, n: print(f"rollout {i}/{n} decoded",
                                                             file=sys.stderr))
    lines += ["", "Whole rollouts (tlt_jax/plan/sim.py on the profile above, then the engine):",
              "", rollout_table(rollouts)]
  learner_rows = []
  if a.learner:
    from tlt_jax.config import load_config_file
    from tlt_jax.plan.workload import lengths
    rcfg = load_config_file(a.config)
    ls, state, mcfg, prompts = learner_setup(rcfg)
    learner, state = learner_profile(ls, state, mcfg, hw)
    learner_rows = validate_learner(
        ls, state, mcfg, hw, learner, lengths(a.learner_lengths), prompts,
        max_new_tokens=rcfg.rollout.max_new_tokens,
        responses=rcfg.grpo.num_prompts * rcfg.grpo.n, minibatches=rcfg.grpo.minibatches,
        progress=lambda i, n: print(f"learner step {i}/{n} run", file=sys.stderr))
    lines += ["", f"The RL step's learner phases ({os.path.basename(a.config)}, response lengths "
              f"{lengths(a.learner_lengths).describe()}):", "",
              learner_table(learner, learner_rows)]
  text = "\n".join(lines)
  print(text)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "cost_model.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(a.out, "cost_model.json"), "w") as f:
    json.dump({"hardware": dataclasses.asdict(hw), "rows": cal.rows, "ratios": cal.ratios(),
               "rollouts": rollouts, "learner": learner_rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
