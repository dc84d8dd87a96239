"""The cost model's profile of the machine it runs on, and its predictions checked there.

`calibrate` times the rollout's forwards as the engine runs them (`bench/spec_costs.py`: N
repetitions inside one compiled loop, weights as arguments) at several batch sizes: the
target's forward over 1 and each arm's `verify_tokens` new tokens with a cache, and the
drafter's over 1, `topk` and `steps + 1`. It fits a `cost.Hardware` to those components alone (`cost.fit`), then
predicts what it did not see: the plain decode step (a forward, sampling and the chunk's
bookkeeping) and each arm's whole speculative step (the verification forward over its
`verify_tokens`, the drafter's catch-up over steps + 1, steps - 1 more drafter steps of
topk tokens, the acceptance rule), and the ratio of the two, which is what decides whether
speculation pays. `scripts/bench_cost_model.py` prints the table; scripts/gpu_check.sh runs
the same on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tlt_jax.models.config import ModelConfig
from tlt_jax.plan import cost
from tlt_jax.rollout.strategy import Strategy

@dataclasses.dataclass
class Calibration:
  """What `calibrate` measured and fitted: `hardware`; per (batch, label) the measured
  seconds and the profile's prediction, `fitted` marking the components it was fitted on."""

  hardware: cost.Hardware
  rows: list[dict]

  def table(self) -> str:
    lines = ["| batch | forward | measured ms | predicted ms | predicted / measured | in fit |",
             "|---:|---|---:|---:|---:|:---:|"]
    for r in self.rows:
      lines.append(f"| {r['batch']} | {r['label']} | {r['measured'] * 1e3:.3f} | "
                   f"{r['predicted'] * 1e3:.3f} | {r['predicted'] / r['measured']:.2f} | "
                   f"{'yes' if r['fitted'] else ''} |")
    return "\n".join(lines)

  def ratios(self) -> list[dict]:
    """Per batch and arm: the speculative step over the plain step, measured and predicted."""
    by = {(r["batch"], r["label"]): r for r in self.rows}
    out = []
    for (b, label), r in by.items():
      if label.startswith("spec step "):
        plain = by[(b, "plain step")]
        out.append({"batch": b, "arm": label[len("spec step "):],
                    "measured": r["measured"] / plain["measured"],
                    "predicted": r["predicted"] / plain["predicted"]})
    return out


def component_cost(cfg: ModelConfig, label: str, batch: int, cache_len: int,
                   kv_len: int) -> cost.Cost:
  """The cost of a `measure_costs` entry (its label) at `batch`: the loops attend over the
  whole cache (`cache_len`) except the plain step, which reads `kv_len`."""
  kind, _, rest = label.partition(" fwd T=")
  if label == "plain step":
    return cost.forward(cfg, batch, 1, kv_len)
  if kind == "verify":
    return cost.forward(cfg, batch, int(rest), cache_len)
  if kind == "drafter":
    return cost.draft(cfg, batch, int(rest), cache_len)
  if label.startswith("spec step "):
    arm = Strategy(label[len("spec step "):])
    c = (cost.forward(cfg, batch, arm.verify_tokens, cache_len)
         + cost.draft(cfg, batch, arm.steps + 1, cache_len))
    for _ in range(arm.steps - 1):
      c = c + cost.draft(cfg, batch, arm.topk, cache_len)
    return c
  raise ValueError(f"component_cost: unknown forward {label!r}")


def calibrate(params, dparams, cfg: ModelConfig, sp, *, batches: Sequence[int] = (1, 4, 16),
              arms: Sequence[str] = ("4_1_5", "3_2_6"), iters: int = 64, prompt_len: int = 64,
              cache_len: int = 256, name: str = "this machine",
              progress=None) -> Calibration:
  """Times the forwards (module docstring) on this machine, fits a profile to the
  components, predicts every entry. progress(done, total): called after each batch."""
  from tlt_jax.bench.spec_costs import measure_costs
  from tlt_jax.rollout.scheduler import kv_bucket
  kv_len = kv_bucket(prompt_len + iters, 16, cache_len)
  measured: dict[tuple[int, str], float] = {}
  for i, b in enumerate(batches):
    out = measure_costs(params, dparams, cfg, b, arms, sp, iters=iters, prompt_len=prompt_len,
                        cache_len=cache_len, kv_len=kv_len)
    for label, s in out.items():
      measured[(b, label)] = s
    if progress:
      progress(i + 1, len(batches))
  fitted = [k for k in measured if " fwd T=" in k[1]]
  costs = {k: component_cost(cfg, k[1], k[0], cache_len, kv_len) for k in measured}
  hw = cost.fit([costs[k] for k in fitted], [measured[k] for k in fitted], name=name)
  rows = [{"batch": b, "label": label, "measured": measured[(b, label)],
           "predicted": hw.seconds(costs[(b, label)]), "fitted": (b, label) in fitted}
          for b, label in sorted(measured, key=lambda k: (k[0], _order(k[1])))]
  return Calibration(hw, rows)


def _order(label: str) -> tuple:
  kind = 0 if label == "plain step" else 1 if "verify" in label else 2 if "drafter" in label \
      else 3
  return (kind, label)
