"""What the cluster simulator decodes: response lengths, and how many drafts each arm gets
accepted.

Lengths (`lengths`):
  lognormal:median=M,sigma=S[,tail=P,alpha=A,tail_from=T]
      a log-normal body (median M tokens, log-space spread S) and, with share P of the
      responses, a Pareto tail from T tokens (index A: the smaller, the heavier), every length
      capped at the run's max_new_tokens (a capped response is truncated, as a real one is)
  FILE.jsonl / FILE.txt
      a JSONL of lengths (a number per line, or objects with "length" / "response_length" /
      "tokens") or a run's metrics.jsonl (its per-step response_length p50 and p90 fit the
      log-normal body of each step; its max caps it): lengths are drawn from them with
      replacement, step by step
`REASONING` is the default for the shipped recipes (docs/scale.md says why).

Acceptance (`acceptance`): tokens per verification per arm, "4_1_5=3.1,6_1_7=3.6" or a JSON
file {"4_1_5": 3.1, ...} (the generate CLI's and the drift benchmark's figure), or one number
for every drafter arm; "default=" sets the drafter arms not named, "history=" the history
arms not named (1.8 unless set: `hist_4` drafted 1.84 tokens per verification at batch 1 in
the history benchmark's first epoch, docs/engine.md; a hybrid counts as a drafter arm). A chain of depth K whose drafts are accepted with probability a each, until the
first rejection, delivers sum_{k<=K} a^k tokens per verification; the simulator solves for a
and draws each verification's accepted drafts from it. "off" delivers 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import numpy as np

from tlt_jax.errors import ConfigError
from tlt_jax.rollout.policies.strategy import Strategy

# A reasoning run's response lengths at max_new_tokens 8192 (docs/scale.md): a median around
# 2.5k tokens, a log-space spread of 0.7, and 8% of responses in a heavy tail from 4k tokens
# that runs into the cap.
REASONING = "lognormal:median=2500,sigma=0.7,tail=0.08,alpha=1.2,tail_from=4000"


@dataclasses.dataclass(frozen=True)
class Lengths:
  """Draws the response lengths of one RL step."""

  kind: str  # "lognormal" | "empirical" | "steps"
  median: float = 0.0
  sigma: float = 0.0
  tail: float = 0.0
  alpha: float = 1.5
  tail_from: float = 0.0
  values: tuple[int, ...] = ()  # empirical lengths
  steps: tuple[tuple[float, float, int], ...] = ()  # per step (p50, p90, max) of a run
  source: str = ""

  def draw(self, n: int, cap: int, rng: np.random.Generator, step: int = 0) -> np.ndarray:
    if self.kind == "empirical":
      out = rng.choice(np.asarray(self.values), size=n, replace=True)
    elif self.kind == "steps":
      p50, p90, top = self.steps[step % len(self.steps)]
      sigma = max(math.log(max(p90, p50 + 1e-9) / max(p50, 1e-9)) / 1.2816, 1e-3)
      out = np.minimum(rng.lognormal(math.log(max(p50, 1.0)), sigma, n), top)
    else:
      out = rng.lognormal(math.log(self.median), self.sigma, n)
      if self.tail > 0:
        heavy = rng.random(n) < self.tail
        out[heavy] = self.tail_from * (1.0 - rng.random(int(heavy.sum()))) ** (-1 / self.alpha)
    return np.clip(np.round(out), 1, cap).astype(np.int64)

  def describe(self) -> str:
    if self.kind == "lognormal":
      t = (f", {self.tail:.0%} Pareto tail from {self.tail_from:.0f} (alpha {self.alpha})"
           if self.tail else "")
      return f"log-normal (median {self.median:.0f}, sigma {self.sigma}){t}"
    if self.kind == "empirical":
      return f"{len(self.values)} lengths from {self.source}"
    return f"per-step log-normal fits of {len(self.steps)} steps of {self.source}"


def lengths(spec: str) -> Lengths:
  """A `Lengths` from its text (module docstring); ConfigError naming the input."""
  if spec.startswith("lognormal:"):
    kw = {}
    for part in spec[len("lognormal:"):].split(","):
      k, _, v = part.partition("=")
      if k not in ("median", "sigma", "tail", "alpha", "tail_from") or not v:
        raise ConfigError("use lognormal:median=M,sigma=S[,tail=P,alpha=A,tail_from=T]",
                          "--lengths", spec)
      try:
        kw[k] = float(v)
      except ValueError:
        raise ConfigError(f"{k}={v!r} is not a number", "--lengths", spec) from None
    if "median" not in kw or "sigma" not in kw or kw["median"] <= 0 or kw["sigma"] < 0:
      raise ConfigError("needs median > 0 and sigma >= 0", "--lengths", spec)
    if not 0 <= kw.get("tail", 0.0) < 1 or kw.get("alpha", 1.5) <= 0:
      raise ConfigError("needs 0 <= tail < 1 and alpha > 0", "--lengths", spec)
    kw.setdefault("tail_from", 2 * kw["median"])
    return Lengths("lognormal", **kw)
  if not os.path.isfile(spec):
    raise ConfigError("is neither lognormal:... nor a file; give a JSONL of lengths or a "
                      "run's metrics.jsonl", "--lengths", spec)
  values, steps = [], []
  with open(spec) as f:
    for i, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        raise ConfigError(f"line {i} is not JSON or a number", "--lengths", spec) from None
      if isinstance(rec, (int, float)):
        values.append(int(rec))
      elif isinstance(rec, dict) and isinstance(rec.get("response_length"), dict):
        r = rec["response_length"]  # a run's metrics.jsonl (evaluation rows have it nested)
        if "step" in rec and "reward" in rec and {"p50", "p90", "max"} <= set(r):
          steps.append((float(r["p50"]), float(r["p90"]), int(r["max"])))
      elif isinstance(rec, dict) and any(k in rec for k in ("length", "response_length",
                                                            "tokens")):
        values.append(int(next(rec[k] for k in ("length", "response_length", "tokens")
                               if k in rec)))
      elif not (isinstance(rec, dict) and "step" in rec):
        raise ConfigError(f"line {i} has no length ('length', 'response_length', 'tokens')",
                          "--lengths", spec)
  if values:
    return Lengths("empirical", values=tuple(values), source=spec)
  if steps:
    return Lengths("steps", steps=tuple(steps), source=spec)
  raise ConfigError("holds no lengths", "--lengths", spec)


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """Tokens per verification per arm (module docstring); `default` for arms not named."""

  tpv: tuple[tuple[str, float], ...] = ()
  default: float = 3.0
  history: float = 1.8

  def tokens_per_verification(self, arm: Strategy) -> float:
    if arm == "off" or not arm.steps:
      return 1.0
    fallback = self.history if arm.history and not arm.hybrid else self.default
    v = dict(self.tpv).get(str(arm), fallback)
    return min(max(v, 1.0), arm.steps + 1)

  def rate(self, arm: Strategy) -> float:
    """Per-draft acceptance a with sum_{k=0..K} a^k = the arm's tokens per verification."""
    want, k = self.tokens_per_verification(arm), arm.steps
    if want >= k + 1 - 1e-9:
      return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
      mid = (lo + hi) / 2
      if sum(mid ** j for j in range(k + 1)) < want:
        lo = mid
      else:
        hi = mid
    return lo

  def draw(self, arm: Strategy, rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    """Accepted drafts per verification (0..K), shaped `shape`."""
    if arm == "off" or not arm.steps:
      return np.zeros(shape, np.int64)
    a = self.rate(arm)
    u = rng.random(tuple(shape) + (arm.steps,))
    return np.cumprod(u < a, axis=-1).sum(-1)


def acceptance(spec: str) -> Acceptance:
  """An `Acceptance` from "arm=v,...", a JSON file, or one number (module docstring)."""
  try:
    return Acceptance(default=float(spec))
  except ValueError:
    pass
  if os.path.isfile(spec):
    try:
      with open(spec) as f:
        d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"cannot be read as JSON ({e})", "--acceptance", spec) from None
    items = list(d.items()) if isinstance(d, dict) else None
  else:
    items = [p.partition("=")[::2] for p in spec.split(",") if p]
  if not items:
    raise ConfigError("use arm=tokens_per_verification,... (4_1_5=3.1), a JSON file of "
                      "them, or one number", "--acceptance", spec)
  out, default = [], {}
  for arm, v in items:
    try:
      if arm in ("default", "history"):  # the drafter / history arms not named
        default[arm] = float(v)
      else:
        out.append((str(Strategy(arm)), float(v)))
    except ValueError as e:
      raise ConfigError(f"{arm}={v!r}: {e}", "--acceptance", spec) from None
  return Acceptance(tpv=tuple(out), **default)
