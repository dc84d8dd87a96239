#!/usr/bin/env python
"""Prints a config's per-device memory plan and exits non-zero when a phase does not fit.

  python scripts/plan_memory.py --config configs/qwen2_5_7b_math.py
  python scripts/plan_memory.py --config configs/llama3_3_70b_math.py --config.memory.device=h200
  python scripts/plan_memory.py --config configs/qwen2_5_7b_math.py --config.rollout.max_batch=256

What is resident on each device in the rollout, log-prob and update phases (tlt_jax/memory.py):
the learner's FSDP shards of params, AdamW state, gradients and reference weights; a rollout
replica's weights in the compute dtype and its KV cache; the drafter; activation estimates.
The model's shape comes from config.model.path's config.json, or, where that directory is not
on this machine, the architecture named by config.model.architecture. The device and device
count come from config.memory (device: a kind such as h100 or a size such as 80gb; '' plans for
this machine; num_devices: 0 = the visible ones). rollout.max_batch=0 is sized from memory, as
the run would.

Exit status: 0 every phase fits; 1 a phase does not (the line says which knob to turn); 2 a
bad config value or path.
"""

from __future__ import annotations

import sys


def main(argv):
  del argv
  from tlt_jax import memory, memory_phases, runtime
  from tlt_jax.config import run_spec
  from tlt_jax.runtime import model_config
  from tlt_jax.errors import ConfigError
  cfg = _CONFIG.value
  runtime.setup_jax(cfg)  # the CPU device count a CPU config asks for
  spec = run_spec(cfg)
  model_cfg = model_config(cfg)
  device = cfg.memory.device or runtime.local_device()
  n = int(cfg.memory.num_devices or 0) or memory.visible_devices()
  sized = ""
  if spec.max_batch == 0:
    spec = spec.with_max_batch(*memory.derive_max_batch(spec, model_cfg, device=device,
                                                        num_devices=n))
    sized = " (sized from memory)"
  p = memory.plan(spec, model_cfg, device=device, num_devices=n)
  print(f"{cfg.model.get('architecture') or cfg.model.path}: {p.num_devices} x {p.device}, "
        f"learner mesh {memory_phases.learner_axes(cfg, n)}, "
        f"{cfg.rollout.num_workers} rollout replicas x {cfg.rollout.tensor_parallel} device(s), "
        f"rollout.max_batch={p.max_batch}, rollout.kv_pages={p.kv_pages}{sized}")
  print(p.table())
  phase, peak = p.peak()
  if p.capacity is not None:
    print(f"peak: {phase} {memory.human(peak)} of {memory.human(p.capacity)} usable "
          f"({peak / p.capacity:.0%})")
  try:
    p.check()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  from absl import app
  from ml_collections import config_flags

  from tlt_jax.config import flags_parser
  from tlt_jax.runtime import exit_on_user_error
  _CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
  app.run(exit_on_user_error(main), flags_parser=flags_parser)
