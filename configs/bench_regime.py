"""The default task on the memory-bound benchmark target: a rollout-dominated RL step on CPU.

  python scripts/make_bench_model.py --out workdirs/bench_model     # once: seconds
  python scripts/bench_e2e.py --config configs/bench_regime.py --runs on,off --steps 6

The target is the shipped model widened and deepened to 189M params (scripts/make_bench_model.py:
the same function, so the same responses, rewards and drafter acceptance), whose decoding streams
~750 MB of weights per step, as a 7B+ model's does on a GPU. The step is shaped so that rollout
dominates it as in long-response RL at scale (docs/engine.md: where speculation can pay): few
prompts per step, the task's long-tailed lengths, one rollout worker decoding the tail. What the
learner costs per token here (a 2-core CPU computes ~100x less per byte of bandwidth than a GPU)
bounds how large a step can stay rollout-dominated: see docs/engine.md "Where speculation can pay".
"""

import os

from tlt_jax.config import load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  c = load_config_file(os.path.join(ROOT, "configs", "default.py"))
  bench = os.path.join(ROOT, "workdirs", "bench_model")
  c.workdir = "workdirs/bench_regime"
  c.model.path = os.path.join(bench, "model")
  c.tlt.drafter.init = os.path.join(bench, "drafter")
  c.cpu_devices = 2
  c.rollout.num_workers = 1  # one replica: the learner and spot training get the other core
  c.rollout.max_batch = 8
  c.rollout.buckets = (1, 2, 4, 8)
  c.grpo.num_prompts = 2
  c.grpo.n = 4
  c.grpo.minibatches = 1
  c.train.steps = 6
  c.train.eval_every = 0  # 400 held-out prompts at 189M: not part of the step
  c.train.checkpoint_every = 100
  # speculate from live <= 8 (every bucket is memory-bound here); the gate opens them in turn
  c.tlt.spec.bs_threshold = 8
  c.tlt.spec.buckets = "1:4_1_5,6_1_7,off 3:4_1_5,3_1_4,off"
  c.tlt.spec.gate.min_chunks = 2
  c.tlt.drafter.rows = 2  # a 14M drafter's step on CPU: keep the barrier's wait short
  return c
