#!/usr/bin/env python
"""Speculative rollout where it can pay on this CPU: the memory-bound benchmark target.

    python scripts/make_bench_model.py --out workdirs/bench_model     # once: seconds
    python scripts/bench_regime.py --bench workdirs/bench_model [--prompts 6] [--tail_prompts 8]
        [--tail_n 4] [--arms 3_1_4,4_1_5,6_1_7,4_2_8] [--skip_hf] [--only_roofline]
        [--out out/bench_regime]

The shipped model (1M params) sits in cache: a k-token forward costs ~k single ones, so drafts
cannot pay here (docs/engine.md: where speculation can pay). The bench target
(scripts/make_bench_model.py: the shipped model widened and deepened to 189M params, the same
function, so the same outputs and acceptance) streams ~750 MB of weights per step, as decoding on an
accelerator is bound by weight reads. One invocation, every ratio measured in it (this machine
drifts between runs):

 0. Roofline: copy bandwidth, then per workload of 2-4 the bytes a plain decode step moves
    (weights + the KV window the engine reads) / step time, as a fraction of that bandwidth,
    at batch 1 and 8 (tlt_jax/bench/roofline.py). --only_roofline runs it alone (a minute).
 1. Regime check: k-token target forward / 1-token forward (k = 5, 9, 17) and drafter step /
    target step, bench target vs shipped model.
 2. Batch 1, greedy, default-task prompts with EOS (one prompt at a time): plain decoding vs
    every arm (chains and an EAGLE-2 tree), end to end (prefill included); tokens per
    verification; outputs checked identical to plain decoding (where not: per differing row
    the first differing token and its float32 logit margin vs the dtype's rounding, near-tie
    or bug signal: tlt_jax/bench/divergence.py). HF transformers `generate` and
    assisted generation (assistant: the target cut to its first layer, tlt_jax/bench/rollout.py) on
    the same checkpoint.
 3. Batch 8, greedy and sampled (temperature 1), the same prompts x 8, plain vs the first arm.
 4. Long tail: one RL step's worth (--tail_prompts x --tail_n responses, temperature 1, EOS,
    the task's real length distribution) through one worker: continuous batching, compaction,
    speculation switched on once the live batch is <= --threshold, per arm and with BEG-MAB;
    where its time goes (decode at live > threshold, at <= threshold, the rest) and the bound
    that puts on the whole (Amdahl, with the batch-1 speedup for the <= threshold phase).
 5. Cost model: per-forward costs in compiled loops (tlt_jax/bench/spec_costs.py) at batch 1 and
    the acceptance measured in 2 give the speedup the engine should reach; printed beside the
    one it reached, with the gap.
 6. The speculation gate as a training run meets it: --gate_rollouts rollouts of new prompts,
    compile included, plain vs BEG-MAB behind the gate vs BEG-MAB ungated; the gate's verdicts.

Compile time is excluded in 2-4 (a warm-up run of each workload first) and reported separately.
Writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tlt_jax.bench.regime import BenchMissing, RegimeArgs, run  # noqa: E402

D = RegimeArgs(bench="")  # the defaults


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--bench", required=True, help="scripts/make_bench_model.py's --out directory")
  ap.add_argument("--prompts", type=int, default=D.prompts,
                  help="default-task prompts, workloads 2-3")
  ap.add_argument("--tail_prompts", type=int, default=D.tail_prompts)
  ap.add_argument("--tail_n", type=int, default=D.tail_n,
                  help="responses per prompt (the group)")
  ap.add_argument("--threshold", type=int, default=D.threshold,
                  help="long tail: speculate at live <= this")
  ap.add_argument("--arms", default=D.arms)
  ap.add_argument("--tail_arms", default=D.tail_arms)
  ap.add_argument("--max_new_tokens", type=int, default=D.max_new_tokens)
  ap.add_argument("--gate_rollouts", type=int, default=D.gate_rollouts,
                  help="rollouts of the gate's run (0: skip it)")
  ap.add_argument("--gate_prompts", type=int, default=D.gate_prompts,
                  help="prompts per gate rollout")
  ap.add_argument("--only_gate", action="store_true", help="run section 6 alone")
  ap.add_argument("--only_roofline", action="store_true", help="run section 0 alone")
  ap.add_argument("--skip_hf", action="store_true")
  ap.add_argument("--skip_regime", action="store_true")
  ap.add_argument("--skip_roofline", action="store_true", help="no section 0 "
                  "(scripts/gpu_decode.py measures it with the engine's variants)")
  ap.add_argument("--skip_tail", action="store_true", help="no section 4")
  ap.add_argument("--skip_costs", action="store_true", help="no section 5")
  ap.add_argument("--dtype", default=D.dtype,
                  help="compute and param dtype of the target (default: its config's; "
                       "bfloat16 on a GPU)")
  ap.add_argument("--out", default=D.out)
  args = ap.parse_args(argv)
  try:
    run(RegimeArgs(**vars(args)))
  except BenchMissing as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
