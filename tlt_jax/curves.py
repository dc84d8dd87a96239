"""A run's curves, drawn from its metrics.jsonl: training reward, held-out accuracy, response
length and seconds per step, several runs overlaid (TLT on vs off: the same curves, less time).

The main job writes `<workdir>/curves.png` when it ends; `scripts/plot_curves.py` compares
runs; `scripts/bench_e2e.py` draws its runs (TRL's too) through `plot_runs`. Host-side only.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# panel -> (title, y label)
PANELS = {
    "reward": ("training reward (thin: per step; bold: rolling mean)", "mean reward"),
    "accuracy": ("held-out accuracy (dashed: each source, where several)", "accuracy"),
    "length": ("response length (rolling mean)", "tokens"),
    "seconds": ("seconds per RL step (dashed: rollout)", "s"),
}

MARKERS = "s^vDxP*"  # a held-out source's curve, after the run's overall accuracy ("o")


def rolling_mean(y: Sequence[float], size: int) -> np.ndarray:
  """Mean of each point and the up to size - 1 before it (a trailing window: the first points
  average what there is)."""
  y = np.asarray(y, np.float64)
  c = np.concatenate([[0.0], np.cumsum(y)])
  i = np.arange(1, len(y) + 1)
  lo = np.maximum(i - size, 0)
  return (c[i] - c[lo]) / (i - lo)


def series(records: Sequence[dict[str, Any]], smooth: int = 5
           ) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
  """The curves `plot_runs` draws from one run's records: panel -> {curve: (steps, values)}.
  Steps without a value (a resumed run's step 0, an eval-only record) are left out."""
  def pick(get):
    xs, ys = [], []
    for rec in records:
      try:
        v = get(rec)
      except (KeyError, TypeError):
        continue
      if v is not None:
        xs.append(int(rec["step"]))
        ys.append(float(v))
    return np.asarray(xs, np.int64), np.asarray(ys, np.float64)

  out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
  x, y = pick(lambda r: r["reward"])
  if len(x):
    out["reward"] = {"per step": (x, y), "mean": (x, rolling_mean(y, smooth))}
  x, y = pick(lambda r: r["eval"]["accuracy"])
  if len(x):
    out["accuracy"] = {"eval": (x, y)}
    names = dict.fromkeys(name for r in records
                          for name in r.get("eval", {}).get("accuracy_by_source", {}))
    for name in names:  # each held-out source's (several test files): "source <name>"
      out["accuracy"][f"source {name}"] = pick(
          lambda r, name=name: r["eval"]["accuracy_by_source"][name])
  x, y = pick(lambda r: r["response_length"]["mean"])
  if len(x):
    out["length"] = {"mean": (x, rolling_mean(y, smooth))}
  x, y = pick(lambda r: r["time"]["total"])
  if len(x):
    out["seconds"] = {"total": (x, y)}
    xr, yr = pick(lambda r: r["time"]["rollout"])
    if len(xr):
      out["seconds"]["rollout"] = (xr, yr)
  return out


def plot_runs(runs: dict[str, Sequence[dict[str, Any]]], path: str, smooth: int = 5) -> None:
  """One PNG at `path`: a panel per quantity, each run (label -> its metrics records) in its
  own color. A panel no run has data for says so."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
  drawn = {name: False for name in PANELS}
  for i, (label, records) in enumerate(runs.items()):
    color = f"C{i}"
    for name, curves in series(records, smooth).items():
      ax = axes.flat[list(PANELS).index(name)]
      drawn[name] = True
      if name == "reward":
        ax.plot(*curves["per step"], color=color, alpha=0.25, lw=0.8)
        ax.plot(*curves["mean"], color=color, lw=2, label=label)
      elif name == "accuracy":
        ax.plot(*curves["eval"], color=color, marker="o", label=label)
        sources = [k for k in curves if k.startswith("source ")]
        for j, key in enumerate(sources):  # thinner, a marker each: one color per run
          ax.plot(*curves[key], color=color, lw=0.8, ls="--", marker=MARKERS[j % len(MARKERS)],
                  ms=4, label=f"{label}: {key[len('source '):]}")
      elif name == "length":
        ax.plot(*curves["mean"], color=color, lw=2, label=label)
      else:
        ax.plot(*curves["total"], color=color, lw=1.5, label=label)
        if "rollout" in curves:
          ax.plot(*curves["rollout"], color=color, lw=1, ls="--")
  for ax, (name, (title, ylabel)) in zip(axes.flat, PANELS.items()):
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if drawn[name]:
      ax.legend(fontsize=8)
    else:
      ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
