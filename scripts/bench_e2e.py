#!/usr/bin/env python
"""End to end, side by side: tlt_jax with TLT on, tlt_jax with TLT off, and TRL's GRPOTrainer
(the trainer users would otherwise pick) on the default config, run in lockstep (one RL step
each in turn, never two at once) on this machine, on every supported Python/JAX stack it
finds.

    bash scripts/setup.sh                                    # stack 1: Python 3.12, JAX 0.12
    PYTHON=python3.11 VENV=.venv-py311 bash scripts/setup.sh # stack 2: Python 3.11, JAX 0.10
    bash scripts/bench_trl_setup.sh            # once: TRL's own venv (.venv-trl), benchmark-only
    .venv/bin/python scripts/bench_e2e.py [--steps 40] [--runs on,off,off_seed1,on_seed1,trl] \\
        [--stacks .venv,.venv-py311] [--out out/bench_e2e] [--warm_cache] \\
        [--extra "--config.key=value ..."]

Every run starts with its own empty JAX compilation cache, and so an empty speculation-gate
verdict cache (it lives beside the compilation cache): what a user's first run pays, compiles
and probes included. --warm_cache re-runs with the caches the previous invocation with the
same --out left: what every later run of the same config costs. Runs, per stack:
  on         python -m tlt_jax.train --config configs/default.py          (TLT on: the main job)
  off        ... --config.tlt.enabled=False                               (the baseline)
  off_seed1  ... --config.tlt.enabled=False --config.seed=1     (a second baseline: the spread
                                                                 learning curves have anyway)
  on_seed1   ... --config.seed=1                                (TLT on, the second seed)
  on_nogate  ... --config.tlt.spec.gate.enabled=False   (speculation at every bucket under the
                                                         threshold, the drafter spot-trained:
                                                         what the spot trainer's bars use)
  on_windows ... --config.rollout.attention=windows  (attention over gathered windows, an
                                                     executable per window, instead of the
                                                     CPU default's paged attention)
  on_noahead, off_noahead ... --config.rollout.compile_ahead=False  (each bucket's plain
                                             executable compiled when a chunk needs it, not
                                             ahead on the compile thread)
  off_lora   ... --config.tlt.enabled=False --config.model.lora.rank=8 --config.optim.lr=5e-4
                                                    (rank-8 LoRA adapters over the frozen model,
                                                     at 10x the whole model's learning rate)
  trl        .venv-trl/bin/python scripts/bench_trl_grpo.py     (same model, task, settings;
                                                                 once per stack)

Stacks: --stacks names virtual environments made by scripts/setup.sh (default: .venv and
.venv-py311, those that exist); each stack's runs go to OUT/<venv>/ and are reported with
its Python and JAX versions, its ratios measured among its own runs.

Lockstep (tlt_jax/bench/lockstep.py): this machine's speed drifts by up to 1.7x over minutes,
more than the few percent between TLT on and off, and runs made one after the other see
different machines (an ABBA order cancels only a drift linear in time; in three sessions the
4th run was the slowest). So every run of a stack is started, and exactly one runs at any
moment: it runs until it writes its next step's metrics line, is stopped (SIGSTOP, its whole
process group), and the next run gets the CPU, round after round. A run's time is the sum of
its own turns; step k of every run meets the machine within one round of the others'.

Prints per-phase seconds and ratios, seconds per RL step (the run's own time, start-up to
exit, minus held-out evaluation, divided by the steps: start-up and compiles included),
the mean of the two seeds' ratios with the spread between seeds, the compile time
separately, the speculative executables compiled, held-out accuracy before and after (the
same 400 test prompts and verifier), and whether TLT on learns like the baseline: the
per-window difference of the training reward and the held-out accuracy against the
difference between the two baseline seeds. Writes OUT/<venv>/curves.png (reward and held-out
accuracy over steps, every run) and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from tlt_jax.bench import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("rollout", "reward_wait", "logprobs", "update", "weight_sync", "drafter",
          "checkpoint")


STACKS = (".venv", ".venv-py311")  # scripts/setup.sh's default and second environment
RUNS = {"on": [], "off": ["--config.tlt.enabled=False"],
        "off_seed1": ["--config.tlt.enabled=False", "--config.seed=1"],
        "on_seed1": ["--config.seed=1"], "on_nogate": ["--config.tlt.spec.gate.enabled=False"],
        "on_windows": ["--config.rollout.attention=windows"],
        "on_noahead": ["--config.rollout.compile_ahead=False"],
        "off_noahead": ["--config.tlt.enabled=False", "--config.rollout.compile_ahead=False"],
        "off_lora": ["--config.tlt.enabled=False", "--config.model.lora.rank=8",
                     "--config.optim.lr=5e-4"], "trl": None}


def tlt_cmd(venv: str, workdir: str, steps: int, extra: list[str], cache: str,
            config: str) -> list[str]:
  return [os.path.join(ROOT, venv, "bin", "python"), "-m", "tlt_jax.train", "--config",
          config, "--workdir", workdir,
          f"--config.train.steps={steps}", f"--config.compilation_cache={cache}", *extra]


def stack_label(venv: str) -> str:
  """'Python 3.12.1, JAX 0.12.0.1' of a virtual environment."""
  code = ("import sys; from importlib.metadata import version as v; "
          "print('Python %s, JAX %s' % (sys.version.split()[0], v('jax')))")
  out = subprocess.run([os.path.join(ROOT, venv, "bin", "python"), "-c", code],
                       capture_output=True, text=True)
  return out.stdout.strip() or venv


def summarize_tlt(workdir: str, wall: float, steps: int) -> dict:
  from tlt_jax.metrics import read_records
  recs = read_records(os.path.join(workdir, "metrics.jsonl"))
  phases = {k: 0.0 for k in PHASES + ("eval", "compile", "compile_background", "total")}
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
  out["spec_chunks"] = sum(s["chunks"] for s in spec)
  execs = [r["executables"] for r in steps_recs if "executables" in r]
  if execs:
    out["executables"] = execs[-1]
  gate = [r["spec_gate"] for r in steps_recs if "spec_gate" in r]
  if gate:
    out["gate_status"] = gate[-1]["status"]
  spot = [r["spot"] for r in steps_recs if "spot" in r]
  if spot:
    idle = sum(s["idle_s"] for s in spot)
    out["idle_share_trained"] = sum(s["training_s"] for s in spot) / idle if idle else None
    out["drafter_critical_share"] = phases["drafter"] / max(phases["total"], 1e-9)
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
            "compile_background": 0.0}
  # (TRL's own per-step wall time runs on from its record to its next step's start, so in
  # lockstep it would count the other runs' turns: its steps' time is its own turns instead)
  phases["total"] = wall - phases["eval"]
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


TRL_PHASES = ("generate", "reward", "logprobs", "rollout_other", "update")


def trl_curve_records(recs: list[dict]) -> list[dict]:
  """TRL's per-step records in tlt_jax's metrics form for tlt_jax.curves: its step's seconds
  are the sum of its phases (its `total`, and with it `other`, runs on from its record into the
  other runs' lockstep turns), its rollout is `generate`."""
  out = []
  for r in recs:
    row = {k: r[k] for k in ("step", "reward", "eval", "response_length") if k in r}
    t = r.get("time", {})
    if "generate" in t:
      row["time"] = {"total": sum(t.get(k, 0.0) for k in TRL_PHASES), "rollout": t["generate"]}
    out.append(row)
  return out


def plot(out: str, runs: list[str], path: str) -> None:
  """Every run's curves (reward, held-out accuracy, response length, seconds per step and its
  rollout), TRL's too, in tlt_jax.curves' figure: read from the runs' records under `out`."""
  from tlt_jax.curves import plot_runs
  from tlt_jax.metrics import read_records
  curves = {}
  for name in runs:
    if name == "trl":
      curves[name] = trl_curve_records(
          read_records(os.path.join(out, name, "trl_metrics.jsonl")))
    else:
      curves[name] = read_records(os.path.join(out, name, "metrics.jsonl"))
  plot_runs(curves, path)


def run_stack(a, venv: str, runs: list[str], out: str) -> dict[str, dict]:
  """Every run of --runs with this stack's Python, in lockstep (tlt_jax/bench/lockstep.py:
  one RL step each in turn, never two at once); -> name -> summary."""
  os.makedirs(out, exist_ok=True)
  jobs = []
  for name in runs:
    workdir = os.path.join(out, name)
    shutil.rmtree(workdir, ignore_errors=True)
    cache = os.path.join(out, f"jax_cache_{name}")
    if not a.warm_cache:
      shutil.rmtree(cache, ignore_errors=True)
    log = os.path.join(out, f"{name}.log")
    if name == "trl":
      py = os.path.join(ROOT, ".venv-trl", "bin", "python")
      if not os.path.exists(py):
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "bench_trl_setup.sh")], check=True)
      os.makedirs(workdir, exist_ok=True)
      cmd = [py, os.path.join(ROOT, "scripts", "bench_trl_grpo.py"), "--out", workdir,
             "--steps", str(a.steps), "--eval_every", "10"]
      records = os.path.join(workdir, "trl_metrics.jsonl")
    else:
      cmd = tlt_cmd(venv, workdir, a.steps, RUNS[name] + a.extra.split(), cache, a.config)
      records = os.path.join(workdir, "metrics.jsonl")
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[2:])}", file=sys.stderr,
          flush=True)
    jobs.append(lockstep.Job(name, cmd, log, records, cwd=ROOT))

  done = {n: 0.0 for n in runs}

  def on_turn(name, seconds, lines):  # a line every 10 rounds: each run's seconds so far
    done[name] = seconds
    if name == runs[-1] and lines % 10 == 1:
      print(f"[{time.strftime('%H:%M:%S')}] after step {lines - 1}: " + ", ".join(
          f"{n} {done[n]:.0f}s" for n in runs), file=sys.stderr, flush=True)
  try:
    outcome = lockstep.run(jobs, on_turn=on_turn)
  except RuntimeError as e:
    raise SystemExit(f"error: {e}") from None
  res: dict[str, dict] = {}
  for name in runs:
    secs = outcome[name].seconds
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {secs:.0f}s of its own turns", file=sys.stderr)
    workdir = os.path.join(out, name)
    res[name] = (summarize_trl(workdir, secs, a.steps) if name == "trl"
                 else summarize_tlt(workdir, secs, a.steps))
  return res


def report(a, label: str, runs: list[str], res: dict[str, dict], out: str) -> dict | None:
  """Prints one stack's tables and ratios; -> the two seeds' on / off summary (None without
  both)."""
  print(f"\n## {label}: {a.steps} RL steps of {os.path.relpath(a.config, ROOT)}, the runs in "
        f"lockstep, {'warm' if a.warm_cache else 'cold'} caches; seconds")
  cols = [n for n in runs if n in res]
  print("| phase | " + " | ".join(cols) + " |")
  print("|---|" + "---:|" * len(cols))
  for k in PHASES + ("eval", "compile", "compile_background"):
    print(f"| {k} | " + " | ".join(f"{res[n]['phases'][k]:.1f}" for n in cols) + " |")
  print("| its own turns, start to exit | " + " | ".join(f"{res[n]['wall']:.0f}" for n in cols)
        + " |")
  print("| **s per RL step** (eval excluded, start-up + compile included) | "
        + " | ".join(f"**{res[n]['s_per_step']:.2f}**" for n in cols) + " |")
  if all(res[n]["eval_curve"] for n in cols):  # (configs without evaluation have none)
    print("| held-out accuracy first -> last | " + " | ".join(
        f"{res[n]['eval_curve'][0][1]:.3f} -> {res[n]['eval_curve'][-1][1]:.3f}" for n in cols)
          + " |")
  for n in cols:
    ph, r = res[n]["phases"], res[n]
    line = (f"{n}: rollout {ph['rollout'] / max(ph['total'], 1e-9):.0%} of the steps' time "
            f"(rollout {ph['rollout']:.1f} s, update + log-probs "
            f"{ph['update'] + ph['logprobs']:.1f} s)")
    if "executables" in r:
      e = r["executables"]
      line += (f"; executables {e['count']} ({e['speculative']} speculative), "
               f"{e['compile_s']:.0f} s compiling them")
    if "gate_status" in r:
      line += f"; gate {r['gate_status']}, {r['spec_chunks']} speculative chunks"
    if r.get("drafter_critical_share") is not None:
      line += (f"; drafter on the critical path {r['drafter_critical_share']:.1%} of the "
               f"steps' time, idle trained {r['idle_share_trained'] or 0:.0%}")
    print(line)
  both = None
  for x, y in (("on", "off"), ("on_seed1", "off_seed1"), ("on", "trl"), ("off", "trl"),
               ("on_nogate", "off"), ("on", "on_windows")):
    if x in res and y in res:
      print(f"speed {x} vs {y}: {res[y]['s_per_step'] / res[x]['s_per_step']:.2f}x "
            f"(s per step {res[x]['s_per_step']:.2f} vs {res[y]['s_per_step']:.2f}; > 1: "
            f"{x} faster)")
  if {"on", "off", "off_seed1", "on_seed1"} <= set(res):
    on = (res["on"]["s_per_step"] + res["on_seed1"]["s_per_step"]) / 2
    off = (res["off"]["s_per_step"] + res["off_seed1"]["s_per_step"]) / 2
    spread = max(abs(res[a]["s_per_step"] / res[b]["s_per_step"] - 1)
                 for a, b in (("off", "off_seed1"), ("on", "on_seed1")))
    print(f"speed on vs off, mean of both seeds: {off / on:.2f}x (s per step "
          f"{on:.2f} vs {off:.2f}); the two seeds of one mode differ by up to {spread:.0%}")
    both = {"ratio": off / on, "on": on, "off": off, "noise": spread}
    if "trl" in res:
      print(f"speed on vs trl, mean of both TLT-on seeds: "
            f"{res['trl']['s_per_step'] / on:.2f}x")
  for line in learning_check(res, a.window):
    print(line)
  plot(out, [n for n in runs if n in res], os.path.join(out, "curves.png"))
  return both


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "default.py"),
                 help="the tlt_jax runs' config (the trl run exists for the default only)")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--runs", default="on,off,off_seed1,on_seed1,trl")
  p.add_argument("--stacks", default="",
                 help=f"comma-separated virtual environments to run tlt_jax with (default: "
                      f"those of {', '.join(STACKS)} that exist)")
  p.add_argument("--out", default=os.path.join(ROOT, "out", "bench_e2e"))
  p.add_argument("--warm_cache", action="store_true",
                 help="keep each run's JAX compilation cache (and gate verdicts) from the "
                      "previous invocation with the same --out (a second run of a config); "
                      "default: every run cold")
  p.add_argument("--window", type=int, default=10, help="steps per learning-check window")
  p.add_argument("--extra", default="", help="space-separated --config.key=value overrides for "
                                            "every tlt_jax run (ablations)")
  a = p.parse_args(argv)
  runs = a.runs.split(",")
  unknown = sorted(set(runs) - set(RUNS))
  if unknown:
    raise SystemExit(f"error: --runs: unknown {unknown}; use {', '.join(RUNS)}")
  default = os.path.abspath(a.config) == os.path.join(ROOT, "configs", "default.py")
  if "trl" in runs and not default:
    raise SystemExit(f"error: --runs trl: the TRL peer runs the default config only; drop it "
                     f"for --config {a.config}")
  stacks = [v for v in a.stacks.split(",") if v] or [
      v for v in STACKS if os.path.exists(os.path.join(ROOT, v, "bin", "python"))]
  missing = [v for v in stacks if not os.path.exists(os.path.join(ROOT, v, "bin", "python"))]
  if missing or not stacks:
    raise SystemExit(f"error: --stacks: no Python in {missing or list(STACKS)}; make one with "
                     "scripts/setup.sh (VENV=<dir> PYTHON=<python> for a second one)")
  summary = {}
  for venv in stacks:
    label = stack_label(venv)
    out = os.path.join(a.out, venv.strip("./") or "venv")
    print(f"[{time.strftime('%H:%M:%S')}] stack {venv}: {label}", file=sys.stderr, flush=True)
    res = run_stack(a, venv, runs, out)
    both = report(a, label, runs, res, out)
    summary[venv] = {"stack": label, "runs": res, "on_vs_off_both_seeds": both}
  with open(os.path.join(a.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {a.out}/<stack>/curves.png and {a.out}/summary.json")


if __name__ == "__main__":
  main()
