"""Stress test: does XLA's CPU client deadlock the sharded learner's collectives?

On 8 fake CPU devices XLA sizes its execution pool to max(cores, devices) threads, "enough for
one collective" (xla/pjrt/cpu/cpu_client.cc). On a 2-core machine that is 8, and the GRPO
learner's 8-device programs deadlocked in it under load: every pool thread blocked in a
partition of a collective program, waiting for partitions queued behind them. The suite runs
with NPROC=16 (tests/conftest.py; XLA sizes the pool from it). This script decides, for a
JAX version and machine, whether that is still needed: each setting runs in processes of its
own (two at once by default, as the suite's two workers do), a few RL steps of a tiny model
(rollout on one device, FSDP learner update on 8) in a loop; a process whose step does not
finish in --hang_s counts as hung (its stacks are printed) and is killed.

    .venv/bin/python scripts/stress_cpu_collectives.py [--steps 60] [--nproc 0,16] [--procs 2]

2026-12-02, 2-vCPU Intel Xeon, JAX 0.12.0.1: NPROC unset, 4 of 4 processes hung within 6
steps; NPROC=16, 0 of 2 in 60 steps each (the learner on 2 devices: 0 of 2 in 400 steps).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOOP = r"""
import faulthandler, os, sys, time
import jax, numpy as np
from tlt_jax.models import ModelConfig, init_params
from tlt_jax.optim import make_optimizer
from tlt_jax.rl import batching, grpo
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import make_mesh

steps, hang_s = int(sys.argv[1]), float(sys.argv[2])
cfg = ModelConfig(arch="qwen2", vocab_size=23, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                  tie_word_embeddings=False)
params = init_params(cfg, jax.random.key(3), std=0.05)
tx = make_optimizer(3e-2, warmup_steps=1, weight_decay=0.0)
spec = grpo.LearnerSpec(cfg, grpo.GRPOConfig(), tx, make_mesh({"data": 1, "fsdp": 8,
                        "tensor": 1}), micro_batch=16, pad_multiple=8)
state = grpo.init_learner(params, spec)
worker = Engine(params, cfg, EngineConfig(max_batch=32, buckets=(8, 32), max_prompt_len=8,
                                          max_new_tokens=8))
rng = np.random.RandomState(0)
for step in range(steps):
  faulthandler.dump_traceback_later(hang_s, exit=True)  # a hung step: stacks, exit 1
  prompts = [list(rng.randint(1, 23, 4)) for _ in range(8)]
  res = worker.generate([Request(p, i, s) for i, p in enumerate(prompts) for s in range(4)],
                        SamplingParams(temperature=1.0), seed=step)
  r = np.zeros((8, 4))
  for x in res:
    r[x.request_id, x.sample_index] = np.mean(x.response_ids == 3)
  adv = grpo.group_advantages(r)
  samples = [batching.Sample(x.prompt_ids, x.response_ids, adv[x.request_id, x.sample_index])
             for x in res]
  batches = batching.minibatches(samples, spec, num_minibatches=2, seed=step)
  state, _ = grpo.update(state, grpo.prepare(state, batches, spec), spec)
  worker.set_params(state.params)
  faulthandler.cancel_dump_traceback_later()
  print("step", step, flush=True)
"""


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--nproc", default="0,16", help="NPROC values to try (0: unset)")
  p.add_argument("--procs", type=int, default=2, help="processes per setting, run at once")
  p.add_argument("--hang_s", type=float, default=240.0)
  a = p.parse_args()
  for nproc in [int(x) for x in a.nproc.split(",")]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=1200")
    env.pop("NPROC", None)
    if nproc:
      env["NPROC"] = str(nproc)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP, str(a.steps), str(a.hang_s)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(a.procs)]
    hung = 0
    for i, proc in enumerate(procs):
      out, _ = proc.communicate()
      done = out.count("\nstep ") + out.startswith("step ")
      if proc.returncode != 0:
        hung += 1
        print(f"NPROC={nproc or 'unset'} process {i}: stopped after {done} steps "
              f"(exit {proc.returncode}); its last lines:\n" + "\n".join(out.splitlines()[-25:]))
    print(f"NPROC={nproc or 'unset'}: {hung} of {a.procs} processes hung or failed "
          f"({a.steps} steps each, {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
