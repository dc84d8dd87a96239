"""`python -m tlt_jax.plan --rates 0.5,0.6,...`: TLT's predicted speedup against the drafter's
acceptance, the one input the simulator's figures rest on most and a GPU has not measured at
scale.

A sweep runs the recipe's steps once with TLT off and once with TLT on at each per-draft
acceptance rate (`Acceptance.rate`: the drafter arms not named in --acceptance; named arms and
history arms as given), on the same response lengths and seeds, and reports for each rate the
rollout's and the step's speedup at the last step (what a long run settles at) and over all
the steps simulated (compiles and the gate's probes included), with the rate where the run
breaks even. `plot` draws one or several sweeps (scripts/plot_plan_sweep.py overlays recipes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tlt_jax.plan.report import cluster, simulate
from tlt_jax.plan.workload import Acceptance, Lengths
from tlt_jax.rollout.policies.strategy import Strategy

ARMS = ("2_1_3", "4_1_5", "6_1_7")  # chains whose tokens per verification the table shows


def sweep(cfg, rates: Sequence[float], *, hardware: str = "h100", gpus: int = 0,
          lengths: Lengths, acceptance: Acceptance, steps: int = 3, compile_s: float = 0.0,
          gate: str = "open", seed: int = 0, signal: float = 1.0, jitter: float = 0.0,
          progress: bool = False) -> dict[str, Any]:
  """The recipe `cfg` with TLT off once and TLT on at each per-draft acceptance of `rates`
  (module docstring; each replaces `acceptance.rate`, and an `acceptance` with a flat
  default= is refused by Acceptance itself), as a JSON-ready dict: the settings, TLT off's
  seconds, and a row per rate."""
  from tlt_jax.runtime import model_config
  hw, device, n, workers, tp = cluster(cfg, hardware=hardware, gpus=gpus, gate=gate)
  model_cfg = model_config(cfg)
  common = dict(gate=gate, hw=hw, device=device, gpus=n, workers=workers, tp=tp,
                model_cfg=model_cfg, lengths=lengths, steps=steps, compile_s=compile_s,
                seed=seed, signal=signal, jitter=jitter, progress=progress)
  off, sized = simulate(cfg, False, sized=None, acceptance=acceptance, **common)
  rows = []
  for r in rates:
    acc = dataclasses.replace(acceptance, rate=float(r))
    on, sized = simulate(cfg, True, sized=sized, acceptance=acc, **common)
    rows.append(_row(float(r), acc, on, off))
  return {"model": cfg.model.get("architecture") or cfg.model.path, "hardware": hw.name,
          "gpus": n, "workers": workers, "tp": tp, "max_batch": off.ecfg.max_batch,
          "gate": gate, "steps": steps, "compile_s": compile_s, "jitter": jitter,
          "lengths": lengths.describe(), "history": acceptance.history,
          "named": dict(acceptance.tpv),
          "off": {"step_s": off.steps[-1].seconds, "rollout_s": off.steps[-1].phases["rollout"],
                  "run_s": sum(s.seconds for s in off.steps)},
          "rows": rows, "break_even": break_even(rows)}


def _row(rate: float, acc: Acceptance, on, off) -> dict[str, Any]:
  last_on, last_off = on.steps[-1], off.steps[-1]
  execs = [x for e in on.engines for x in e.exes.records]
  return {"rate": rate,
          "tokens_per_verification": {a: round(acc.tokens_per_verification(Strategy(a)), 2)
                                      for a in ARMS},
          "rollout": last_off.phases["rollout"] / last_on.phases["rollout"],
          "step": last_off.seconds / last_on.seconds,
          "rollout_run": (sum(s.phases["rollout"] for s in off.steps)
                          / sum(s.phases["rollout"] for s in on.steps)),
          "step_run": sum(s.seconds for s in off.steps) / sum(s.seconds for s in on.steps),
          "executables_per_worker": round(len(execs) / len(on.engines), 1),
          # each step's: the step's and the rollout's speedup (never slower: each >= ~1)
          "per_step": [round(b.seconds / a.seconds, 4) for a, b in zip(on.steps, off.steps)],
          "per_step_rollout": [round(b.phases["rollout"] / a.phases["rollout"], 4)
                               for a, b in zip(on.steps, off.steps)]}


def break_even(rows: Sequence[dict[str, Any]], key: str = "step_run") -> float | None:
  """The lowest per-draft rate at which `key` reaches 1.0 (linear between the rates swept;
  the first rate where it already does; None where no rate swept does)."""
  rows = sorted(rows, key=lambda r: r["rate"])
  for i, r in enumerate(rows):
    if r[key] >= 1.0:
      if i == 0:
        return r["rate"]
      a = rows[i - 1]
      return a["rate"] + (1.0 - a[key]) * (r["rate"] - a["rate"]) / (r[key] - a[key])
  return None


def text(s: dict[str, Any]) -> str:
  lines = [
      f"# {s['model']}: {s['gpus']} x {s['hardware']}, {s['workers']} rollout workers x tp "
      f"{s['tp']}, max_batch {s['max_batch']}; gate {s['gate']}, {s['steps']} steps, compiles "
      f"{s['compile_s']:g} s each"
      + (f", each chunk's time x log-normal noise, sigma {s['jitter']:g}" if s.get("jitter")
         else "")
      + " (predictions)",
      f"lengths: {s['lengths']}; history arms {s['history']:g} tokens per verification"
      + (f"; named arms {s['named']}" if s["named"] else ""),
      f"TLT off: {s['off']['step_s']:.1f} s the last step, {s['off']['rollout_s']:.1f} s of it "
      "the rollout",
      "",
      f"| per-draft acceptance | tokens/verification {', '.join(ARMS)} | rollout, step "
      f"{s['steps']} | step {s['steps']} | rollout, steps 1-{s['steps']} | steps 1-{s['steps']} "
      "| executables per worker |",
      "|---:|---|---:|---:|---:|---:|---:|"]
  for r in s["rows"]:
    tpv = ", ".join(f"{r['tokens_per_verification'][a]:.2f}" for a in ARMS)
    lines.append(f"| {r['rate']:.2f} | {tpv} | {r['rollout']:.2f}x | {r['step']:.2f}x | "
                 f"{r['rollout_run']:.2f}x | {r['step_run']:.2f}x | "
                 f"{r['executables_per_worker']:g} |")
  be, first = s["break_even"], s["rows"][0]
  if be is None:
    where = "not reached at the rates swept"
  elif be == first["rate"]:
    where = (f"at or below {be:.2f}, the lowest rate swept ({first['step_run']:.2f}x there; "
             "lower rates show where)")
  else:
    where = f"a per-draft acceptance of {be:.2f}"
  lines += ["", f"break-even (steps 1-{s['steps']} at 1.00x): {where}",
            "slowest step against TLT off's: " + ", ".join(
                f"{min(r['per_step']):.2f}x at {r['rate']:.2f}" for r in s["rows"])]
  return "\n".join(lines)


def plot(sweeps: Sequence[dict[str, Any]], path: str, labels: Sequence[str] | None = None
         ) -> None:
  """The rollout's (left) and the step's (right) speedup against the per-draft acceptance, a
  line per sweep: solid at the last step, dashed over all the steps; 1.0 and the simulator's
  default rate marked."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from tlt_jax.plan.workload import RATE
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
  for k, s in enumerate(sweeps):
    label = labels[k] if labels else f"{s['model']} ({s['gpus']} x {s['hardware']})"
    xs = [r["rate"] for r in s["rows"]]
    for ax, key in zip(axes, ("rollout", "step")):
      line, = ax.plot(xs, [r[key] for r in s["rows"]], marker="o", label=label)
      ax.plot(xs, [r[key + "_run"] for r in s["rows"]], linestyle="--",
              color=line.get_color())
  for ax, what in zip(axes, ("the rollout", "the RL step")):
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.axvline(RATE, color="gray", linestyle=":", linewidth=0.8)
    ax.set_xlabel("the drafter's per-draft acceptance (dotted: the simulator's default)")
    ax.set_ylabel(f"TLT on / off, {what}")
    ax.set_title(f"{what}: last step (solid), all steps (dashed)", fontsize=9)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

