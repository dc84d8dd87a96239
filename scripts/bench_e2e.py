#!/usr/bin/env python
"""End to end, side by side: tlt_jax with TLT on, tlt_jax with TLT off, and TRL's GRPOTrainer
(the trainer users would otherwise pick) on the default config, each run whole, one after
the other, on this machine.

    bash scripts/bench_trl_setup.sh            # once: TRL's own venv (.venv-trl), benchmark-only
    .venv/bin/python scripts/bench_e2e.py [--steps 40] [--runs on,off,off_seed1,on_seed1,trl] \\
        [--out out/bench_e2e] [--warm_cache] [--extra "--config.key=value ..."]

Runs (each a fresh process with a cold JAX compilation cache: a user's first run pays every
compile, so it is in the total; --warm_cache re-runs with the caches the previous invocation
left, what every later run of the same config costs):
  on         python -m tlt_jax.train --config configs/default.py          (TLT on: the main job)
  off        ... --config.tlt.enabled=False                               (the baseline)
  off_seed1  ... --config.tlt.enabled=False --config.seed=1     (a second baseline: the spread
                                                                 learning curves have anyway)
  on_seed1   ... --config.seed=1                                (TLT on, the second seed)
  trl        .venv-trl/bin/python scripts/bench_trl_grpo.py     (same model, task, settings)

The default order on, off, off_seed1, on_seed1 is ABBA: this machine's speed drifts by up to
1.7x over minutes, and a drift linear in time cancels from the mean of the two on runs vs the
mean of the two off runs (printed with each seed's pair, whose spread is the noise).

Prints per-phase seconds and ratios, seconds per RL step (the whole command's wall time minus
held-out evaluation, divided by the steps: start-up and compiles included), the compile time
separately, held-out accuracy before and after (the same 400 test prompts and verifier), and
whether TLT on learns like the baseline: the per-window difference of the training reward and
the held-out accuracy against the difference between the two baseline seeds. Writes
OUT/curves.png (reward and held-out accuracy over steps, every run) and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("rollout", "reward_wait", "logprobs", "update", "weight_sync", "drafter",
          "checkpoint")


def tlt_cmd(workdir: str, steps: int, extra: list[str], cache: str, config: str) -> list[str]:
  return [os.path.join(ROOT, ".venv", "bin", "python"), "-m", "tlt_jax.train", "--config",
          config, "--workdir", workdir,
          f"--config.train.steps={steps}", f"--config.compilation_cache={cache}", *extra]


def run(name: str, cmd: list[str], log: str, env: dict | None = None) -> float:
  print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[2:])}", file=sys.stderr,
        flush=True)
  t = time.perf_counter()
  with open(log, "w") as f:
    p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
  wall = time.perf_counter() - t
  if p.returncode != 0:
    raise SystemExit(f"error: run {name} failed (exit {p.returncode}); see {log}")
  print(f"[{time.strftime('%H:%M:%S')}] {name}: {wall:.0f}s", file=sys.stderr, flush=True)
  return wall


def summarize_tlt(workdir: str, wall: float, steps: int) -> dict:
  from tlt_jax.metrics import read_records
  recs = read_records(os.path.join(workdir, "metrics.jsonl"))
  phases = {k: 0.0 for k in PHASES + ("eval", "compile", "total")}
  for r in recs:
    for k, v in r.get("time", {}).items():
      if k in phases:
        phases[k] += v
  evals = [(r["step"], r["eval"]["accuracy"]) for r in recs if "eval" in r]
  steps_recs = [r for r in recs if r.get("step", 0) >= 1 and "reward" in r]
  out = {"wall": wall, "phases": phases, "eval_curve": evals,
         "reward_curve": [(r["step"], r["reward"]) for r in steps_recs],
         "s_per_step": (wall - phases["eval"]) / steps}
  spec = [r["spec"] for r in steps_recs if "spec" in r]
  if spec:
    out["spec_chunks"] = sum(s["chunks"] for s in spec)
  spot = [r["spot"] for r in steps_recs if "spot" in r]
  if spot:
    idle = sum(s["idle_s"] for s in spot)
    out["idle_share_trained"] = sum(s["training_s"] for s in spot) / idle if idle else None
  return out


def summarize_trl(out_dir: str, wall: float, steps: int) -> dict:
  from tlt_jax.metrics import read_records
  summary = json.load(open(os.path.join(out_dir, "trl_summary.json")))
  recs = read_records(os.path.join(out_dir, "trl_metrics.jsonl"))
  t = summary["phase_totals"]
  phases = {"rollout": t.get("generate", 0.0), "reward_wait": t.get("reward", 0.0),
            "logprobs": t.get("logprobs", 0.0), "update": t.get("update", 0.0),
            "weight_sync": 0.0, "drafter": 0.0, "checkpoint": 0.0,
            "eval": summary.get("eval_seconds", 0.0), "compile": 0.0,
            "total": t.get("total", 0.0)}
  evals = [(r["step"], r["eval"]["accuracy"]) for r in recs if "eval" in r]
  return {"wall": wall, "phases": phases, "eval_curve": evals,
          "reward_curve": [(r["step"], r["reward"]) for r in recs if "reward" in r],
          "s_per_step": (wall - phases["eval"]) / steps}


def windows(curve, size):
  """Mean of a (step, value) curve per window of `size` steps: {window start: mean}."""
  out: dict[int, list[float]] = {}
  for step, v in curve:
    out.setdefault((step - 1) // size * size + 1, []).append(v)
  return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def learning_check(res: dict, size: int) -> list[str]:
  """TLT on vs off against the spread of two baseline seeds, per window of `size` steps."""
  lines = []
  if not {"on", "off", "off_seed1"} <= set(res):
    return ["(learning check needs runs on, off and off_seed1)"]
  w_on, w_off, w_s1 = (windows(res[k]["reward_curve"], size) for k in ("on", "off", "off_seed1"))
  lines.append(f"training reward, mean per {size}-step window: on / off / off seed 1; "
               "|on - off| vs |off - off seed 1|")
  within = 0
  for k in w_off:
    d_on, d_seed = abs(w_on.get(k, float("nan")) - w_off[k]), abs(w_s1.get(k, float("nan"))
                                                                  - w_off[k])
    ok = d_on <= max(d_seed, 0.02) * 1.5
    within += ok
    lines.append(f"  steps {k}-{k + size - 1}: {w_on.get(k, float('nan')):.3f} / {w_off[k]:.3f} / "
                 f"{w_s1.get(k, float('nan')):.3f}; {d_on:.3f} vs {d_seed:.3f} "
                 f"{'(within)' if ok else '(OUTSIDE)'}")
  e = {k: dict(res[k]["eval_curve"]) for k in ("on", "off", "off_seed1")}
  lines.append("held-out accuracy at eval steps: on / off / off seed 1")
  for step in sorted(e["off"]):
    lines.append(f"  step {step}: {e['on'].get(step, float('nan')):.3f} / {e['off'][step]:.3f} / "
                 f"{e['off_seed1'].get(step, float('nan')):.3f}")
  lines.append(f"{within}/{len(w_off)} windows: TLT on is as close to the baseline as a second "
               "baseline seed is (|diff| <= 1.5 x the seed spread, at least 0.03)")
  if "on_seed1" in res:  # the same check on the second seed's pair
    w_on1 = windows(res["on_seed1"]["reward_curve"], size)
    ok1 = sum(abs(w_on1.get(k, float("nan")) - w_s1[k])
              <= max(abs(w_s1[k] - w_off[k]), 0.02) * 1.5 for k in w_s1)
    e1 = dict(res["on_seed1"]["eval_curve"])
    lines.append(f"seed 1: {ok1}/{len(w_s1)} windows within; held-out accuracy at the last "
                 f"eval on_seed1 / off_seed1: "
                 + (f"{e1[max(e1)]:.3f} / {e['off_seed1'].get(max(e1), float('nan')):.3f}"
                    if e1 else "-"))
  return lines


def plot(res: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
  for name, r in res.items():
    w = windows(r["reward_curve"], 5)
    a.plot([k + 2 for k in w], list(w.values()), marker="o", label=name)
    if r["eval_curve"]:
      b.plot(*zip(*r["eval_curve"]), marker="o", label=name)
  a.set(title="training reward (mean per 5 steps)", xlabel="RL step")
  b.set(title="held-out greedy accuracy (400 test prompts)", xlabel="RL step")
  for ax in (a, b):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "default.py"),
                 help="the tlt_jax runs' config (the trl run exists for the default only)")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--runs", default="on,off,off_seed1,on_seed1,trl")
  p.add_argument("--out", default=os.path.join(ROOT, "out", "bench_e2e"))
  p.add_argument("--warm_cache", action="store_true",
                 help="keep each run's JAX compilation cache from the previous invocation with "
                      "the same --out (a second run of a config); default: every run cold")
  p.add_argument("--window", type=int, default=10, help="steps per learning-check window")
  p.add_argument("--extra", default="", help="space-separated --config.key=value overrides for "
                                            "every tlt_jax run (ablations)")
  a = p.parse_args(argv)
  runs = a.runs.split(",")
  default = os.path.abspath(a.config) == os.path.join(ROOT, "configs", "default.py")
  if "trl" in runs and not default:
    raise SystemExit(f"error: --runs trl: the TRL peer runs the default config only; drop it "
                     f"for --config {a.config}")
  os.makedirs(a.out, exist_ok=True)
  res: dict[str, dict] = {}
  for name in runs:
    workdir = os.path.join(a.out, name)
    shutil.rmtree(workdir, ignore_errors=True)
    cache = os.path.join(a.out, f"jax_cache_{name}")
    if not a.warm_cache:
      shutil.rmtree(cache, ignore_errors=True)
    log = os.path.join(a.out, f"{name}.log")
    if name == "trl":
      py = os.path.join(ROOT, ".venv-trl", "bin", "python")
      if not os.path.exists(py):
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "bench_trl_setup.sh")], check=True)
      wall = run(name, [py, os.path.join(ROOT, "scripts", "bench_trl_grpo.py"), "--out", workdir,
                        "--steps", str(a.steps), "--eval_every", "10"], log)
      res[name] = summarize_trl(workdir, wall, a.steps)
      continue
    extra = {"on": [], "off": ["--config.tlt.enabled=False"],
             "off_seed1": ["--config.tlt.enabled=False", "--config.seed=1"],
             "on_seed1": ["--config.seed=1"]}.get(name)
    if extra is None:
      raise SystemExit(f"error: --runs: unknown run {name!r}; use on, off, off_seed1, on_seed1, "
                       "trl")
    wall = run(name, tlt_cmd(workdir, a.steps, extra + a.extra.split(), cache, a.config), log)
    res[name] = summarize_tlt(workdir, wall, a.steps)

  # ---- report
  print(f"\n{a.steps} RL steps of {os.path.relpath(a.config, ROOT)}, each run whole, one "
        "after the other; seconds")
  cols = [n for n in runs if n in res]
  print("| phase | " + " | ".join(cols) + " |")
  print("|---|" + "---:|" * len(cols))
  for k in PHASES + ("eval", "compile"):
    print(f"| {k} | " + " | ".join(f"{res[n]['phases'][k]:.1f}" for n in cols) + " |")
  print("| command wall | " + " | ".join(f"{res[n]['wall']:.0f}" for n in cols) + " |")
  print("| **s per RL step** (eval excluded, start-up + compile included) | "
        + " | ".join(f"**{res[n]['s_per_step']:.2f}**" for n in cols) + " |")
  if all(res[n]["eval_curve"] for n in cols):  # (configs without evaluation have none)
    print("| held-out accuracy first -> last | " + " | ".join(
        f"{res[n]['eval_curve'][0][1]:.3f} -> {res[n]['eval_curve'][-1][1]:.3f}" for n in cols)
          + " |")
  for n in cols:
    ph = res[n]["phases"]
    print(f"{n}: rollout {ph['rollout'] / max(ph['total'], 1e-9):.0%} of the steps' time "
          f"(rollout {ph['rollout']:.1f} s, update + log-probs "
          f"{ph['update'] + ph['logprobs']:.1f} s)")
  abba = None
  for x, y in (("on", "off"), ("on_seed1", "off_seed1"), ("on", "trl"), ("off", "trl")):
    if x in res and y in res:
      print(f"speed {x} vs {y}: {res[y]['s_per_step'] / res[x]['s_per_step']:.2f}x "
            f"(s per step {res[x]['s_per_step']:.2f} vs {res[y]['s_per_step']:.2f}; > 1: "
            f"{x} faster)")
  if {"on", "off", "off_seed1", "on_seed1"} <= set(res):
    on = (res["on"]["s_per_step"] + res["on_seed1"]["s_per_step"]) / 2
    off = (res["off"]["s_per_step"] + res["off_seed1"]["s_per_step"]) / 2
    spread = max(abs(res[a]["s_per_step"] / res[b]["s_per_step"] - 1)
                 for a, b in (("off", "off_seed1"), ("on", "on_seed1")))
    print(f"speed on vs off, mean of both seeds (ABBA order): {off / on:.2f}x (s per step "
          f"{on:.2f} vs {off:.2f}); noise: runs of one mode differ by up to {spread:.0%}")
    abba = {"ratio": off / on, "on": on, "off": off, "noise": spread}
  for line in learning_check(res, a.window):
    print(line)
  plot(res, os.path.join(a.out, "curves.png"))
  with open(os.path.join(a.out, "summary.json"), "w") as f:
    json.dump({**res, "on_vs_off_abba": abba}, f, indent=2)
  print(f"wrote {a.out}/curves.png and {a.out}/summary.json")


if __name__ == "__main__":
  main()
