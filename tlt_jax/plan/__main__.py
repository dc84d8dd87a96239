"""Know before you rent: a recipe's RL step on a simulated cluster, TLT on and off.

    python -m tlt_jax.plan --config configs/qwen2_5_7b_math.py --hardware h100|PROFILE.json \\
        [--gpus 8] [--lengths lognormal:median=2500,sigma=0.7,...|FILE] \\
        [--acceptance 4_1_5=3.1,rate=0.8,history=1.8,...|FILE|NUMBER] [--steps 3] \\
        [--gate open|learn] [--compile_s 0] [--signal 0.67] [--jitter 0.15] [--out DIR] \\
        [--config.key=value ...]
    python -m tlt_jax.plan --config ... --rates 0.5,0.6,0.7,0.8,0.9 [same flags]

Runs `--steps` RL steps of the recipe twice on the simulator (tlt_jax/plan/sim.py: the
project's own rollout loop, Scheduler, page policy, gate and bandit on a simulated clock,
priced by the cost model on the hardware profile), TLT on and TLT off, on the same response
lengths, and prints per phase the predicted seconds of the last step (the bandit and the
gate have learnt over the earlier ones), the live batch over the rollout, rows preempted for
pages, the idle share spent training the drafter, and TLT on vs off. Writes OUT/plan.json,
OUT/timeline.png (the simulated workers' timeline, as scripts/plot_timeline.py draws a run's)
and OUT/live_batch.png. With `--rates`, a sweep instead (sweep.py): TLT off once and TLT on at
each per-draft acceptance, the speedups at each rate and where the run breaks even, OUT/sweep.json
and OUT/sweep.png. Everything printed is a prediction: docs/scale.md has the model's
assumptions and its validation.
"""

from __future__ import annotations

import json
import math
import os

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """(At run time only: importing this module defines no flags beside another command's.)"""
  config_flags.DEFINE_config_file("config", lock_config=True)
  flags.DEFINE_string("hardware", "h100", "a profile (h100, h200, a100) or a profile JSON "
                      "measured by scripts/bench_cost_model.py (its cost_model.json)")
  flags.DEFINE_integer("gpus", 0, "devices in the cluster (0: config.memory.num_devices)")
  flags.DEFINE_string("lengths", "", "response lengths: lognormal:..., a JSONL of lengths or a "
                      "run's metrics.jsonl ('': the reasoning default, tlt_jax/plan/workload.py)")
  flags.DEFINE_string("acceptance", "", "tokens per verification: arm=v,... with rate=A (a "
                      "per-draft acceptance for the drafter arms not named) or default=T (a "
                      "flat T for them) and history=T, a JSON file, or one number for every "
                      "drafter arm ('': per-draft rate 0.74, history arms 1.8; workload.py)")
  flags.DEFINE_integer("steps", 3, "RL steps simulated (the last one is reported)")
  flags.DEFINE_float("compile_s", 0.0, "seconds per executable compiled (0: a warm cache)")
  flags.DEFINE_string("gate", "open", "open: speculation at every bucket under the threshold "
                      "from the first step (a long run's steady state where drafts pay); learn: "
                      "the recipe's gate, probing from nothing over --steps")
  flags.DEFINE_float("signal", 0.67, "with grpo.filter_groups (DAPO's dynamic sampling): the "
                    "share of groups whose rewards differ, each group independently (0.67: the "
                    "default task's, measured; docs/training.md)")
  flags.DEFINE_string("rates", "", "a sweep over the drafter's per-draft acceptance, e.g. "
                      "0.5,0.6,0.7,0.8,0.9 (the drafter arms not named in --acceptance): TLT off "
                      "once, TLT on at each ('': one plan at --acceptance)")
  flags.DEFINE_integer("seed", 0, "the workload's seed")
  flags.DEFINE_float("jitter", 0.0, "each chunk's device time x a log-normal factor of mean 1 "
                     "and this sigma, as a real device's measured chunks vary (e.g. 0.15: the "
                     "gate's decisions under noise; 0: none)")
  flags.DEFINE_string("out", "", "where plan.json and the PNGs go ('': out/plan/<config name>)")


def _rates(spec: str) -> list[float]:
  """--rates: per-draft acceptance rates in [0, 1], comma-separated ('': none)."""
  from tlt_jax.errors import ConfigError
  out = []
  for p in (p.strip() for p in spec.split(",")):
    if not p:
      continue
    try:
      r = float(p)
    except ValueError:
      r = math.nan
    if not 0.0 <= r <= 1.0:
      raise ConfigError(f"{p!r} is not a per-draft acceptance in [0, 1]; e.g. "
                        "--rates 0.5,0.6,0.7,0.8,0.9", "--rates", spec)
    out.append(r)
  return sorted(set(out))


def main(argv):
  del argv
  from tlt_jax.errors import ConfigError, output_dir_problem
  from tlt_jax.plan import report, workload
  cfg = FLAGS.config
  if FLAGS.steps < 1:
    raise ConfigError("must be >= 1", "--steps", FLAGS.steps)
  if not 0 <= FLAGS.compile_s < math.inf:
    raise ConfigError("must be a finite number >= 0 (0: a warm compilation cache)", "--compile_s",
                      FLAGS.compile_s)
  if not 0 <= FLAGS.jitter < math.inf:
    raise ConfigError("must be a finite number >= 0 (0: no noise)", "--jitter", FLAGS.jitter)
  if not 0 < FLAGS.signal <= 1:
    raise ConfigError("must be in (0, 1]: the share of groups whose rewards differ", "--signal",
                      FLAGS.signal)
  lengths = workload.lengths(FLAGS.lengths or workload.REASONING)
  acc = workload.acceptance(FLAGS.acceptance)
  rates = _rates(FLAGS.rates)
  if rates and (acc.default is not None or acc.rate is not None):
    raise ConfigError("--rates sweeps the per-draft rate of the drafter arms not named: drop "
                      "default= and rate= from --acceptance (named arms and history= stay)",
                      "--acceptance", FLAGS.acceptance)
  name = os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0]
  out = FLAGS.out or os.path.join("out", "plan", name)
  report.cluster(cfg, hardware=FLAGS.hardware, gpus=FLAGS.gpus, gate=FLAGS.gate)
  why = output_dir_problem(out)  # (made once the inputs hold, before the simulation)
  if why:
    raise ConfigError(f"{why}; pass a directory this user can write", "--out", out)
  if rates:
    from tlt_jax.plan import sweep
    s = sweep.sweep(cfg, rates, hardware=FLAGS.hardware, gpus=FLAGS.gpus, lengths=lengths,
                    acceptance=acc, steps=FLAGS.steps, compile_s=FLAGS.compile_s,
                    gate=FLAGS.gate, seed=FLAGS.seed, progress=True, signal=FLAGS.signal,
                    jitter=FLAGS.jitter)
    print(sweep.text(s))
    with open(os.path.join(out, "sweep.json"), "w") as f:
      json.dump(s, f, indent=1)
    sweep.plot([s], os.path.join(out, "sweep.png"))
    print(f"wrote {out}/sweep.json, {out}/sweep.png")
    return
  plan = report.plan(cfg, hardware=FLAGS.hardware, gpus=FLAGS.gpus, lengths=lengths,
                     acceptance=acc, steps=FLAGS.steps, compile_s=FLAGS.compile_s,
                     gate=FLAGS.gate, seed=FLAGS.seed, progress=True, signal=FLAGS.signal,
                     jitter=FLAGS.jitter)
  print(report.text(plan))
  with open(os.path.join(out, "plan.json"), "w") as f:
    json.dump(report.to_json(plan), f, indent=1)
  report.plots(plan, out)
  print(f"wrote {out}/plan.json, {out}/timeline.png, {out}/live_batch.png")


if __name__ == "__main__":
  from tlt_jax.config import flags_parser
  from tlt_jax.runtime import exit_on_user_error
  _define_flags()
  app.run(exit_on_user_error(main), flags_parser=flags_parser)
