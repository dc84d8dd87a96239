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

Acceptance (`acceptance`): how many tokens each arm's verification delivers. A chain of
depth K whose drafts are each accepted with probability a, until the first rejection, delivers
sum_{k<=K} a^k tokens per verification; the simulator draws each verification's accepted
drafts from that. Given as "arm=v,..." (tokens per verification, "4_1_5=3.1": the generate
CLI's and the drift benchmark's figure), a JSON file {"4_1_5": 3.1, ...}, a run's
metrics.jsonl (its drafter's chain at the mean `drafter_acceptance` of its last 5 steps that
measured it), or one number, with the drafter arms not named priced by one of:
  rate=A     one per-draft acceptance for every drafter arm not named (a deeper chain delivers
             more tokens, a shallower one fewer, as a real drafter's do);
  default=T  the same T tokens per verification for every drafter arm not named, whatever its
             depth (one number alone means this);
and without either, the per-draft rate of the named drafter arms (their mean), else
`RATE` (0.74: 4_1_5 delivers 3.0 tokens per verification, 2_1_3 2.29, 6_1_7 3.39). A tree
is priced as the chain of its depth (its other branches earn nothing: a lower bound) and a
hybrid as a drafter chain. "history=" sets the history arms not named (1.8 tokens per
verification unless set: `hist_4` drafted 1.84 at batch 1 in the history benchmark's first
epoch, docs/engine.md); "off" delivers 1.
"""

from __future__ import annotations

import dataclasses
import functools
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


# The per-draft acceptance of drafter arms when nothing is measured: a depth-4 chain at 3.0
# tokens per verification. Conservative: the shipped drafter's 3.84 at depth 4 (greedy) is
# a = 0.87, TLT's published 8.67 at depth 12 a = 0.93.
RATE = 0.74


def chain_tokens(a: float, k: int) -> float:
  """Tokens per verification of a depth-k chain accepting each draft with probability a."""
  return sum(a ** j for j in range(k + 1))


@functools.lru_cache(maxsize=None)  # pure; asked for every speculative chunk simulated
def solve_rate(tpv: float, k: int) -> float:
  """The per-draft acceptance a with chain_tokens(a, k) = tpv (clipped to [1, k + 1])."""
  if tpv >= k + 1 - 1e-9:
    return 1.0
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if chain_tokens(mid, k) < tpv else (lo, mid)
  return lo


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """Tokens per verification per arm (module docstring): `tpv` for the arms named; the drafter
  arms not named at the flat `default` where it is set, else at the per-draft `rate` (None:
  the named drafter arms' mean rate, else RATE); history arms not named at `history`."""

  tpv: tuple[tuple[str, float], ...] = ()
  default: float | None = None
  rate: float | None = None
  history: float = 1.8

  def __post_init__(self):
    if self.default is not None and self.rate is not None:
      raise ValueError("give the drafter arms not named either a flat default= or a per-draft "
                       "rate=, not both")
    if self.rate is not None and not 0.0 <= self.rate <= 1.0:
      raise ValueError(f"rate={self.rate}: a per-draft acceptance is in [0, 1]")
    given = [*self.tpv, ("default", self.default), ("history", self.history)]
    for name, v in given:
      if v is not None and not v >= 1.0:  # (NaN too)
        raise ValueError(f"{name}={v}: tokens per verification are >= 1 (a verification "
                         "keeps the target's own token; a per-draft acceptance is rate=)")

  def draft_rate(self) -> float:
    """The per-draft acceptance of the drafter arms not named (when `default` is None)."""
    if self.rate is not None:
      return self.rate
    named = [Strategy(a) for a, _ in self.tpv]
    rates = [solve_rate(v, s.steps) for s, (_, v) in zip(named, self.tpv)
             if s.steps and not (s.history and not s.hybrid)]
    return float(np.mean(rates)) if rates else RATE

  def tokens_per_verification(self, arm: Strategy) -> float:
    if arm == "off" or not arm.steps:
      return 1.0
    named = dict(self.tpv)
    if str(arm) in named:
      v = named[str(arm)]
    elif arm.history and not arm.hybrid:
      v = self.history
    elif self.default is not None:
      v = self.default
    else:
      v = chain_tokens(self.draft_rate(), arm.steps)
    return min(max(v, 1.0), arm.steps + 1)

  def rate_of(self, arm: Strategy) -> float:
    """Per-draft acceptance a with sum_{k=0..K} a^k = the arm's tokens per verification."""
    return solve_rate(self.tokens_per_verification(arm), arm.steps)

  def describe(self) -> str:
    named = ", ".join(f"{a} {v:.2f}" for a, v in self.tpv)
    drafter = (f"{self.default:g} tokens per verification each" if self.default is not None
               else f"per-draft rate {self.draft_rate():.3f} (4_1_5 "
               f"{chain_tokens(self.draft_rate(), 4):.2f} tokens per verification)")
    return ((f"{named}; " if named else "") + f"other drafter arms {drafter}; history arms "
            f"{self.history:g}")

  def draw(self, arm: Strategy, rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    """Accepted drafts per verification (0..K), shaped `shape`."""
    if arm == "off" or not arm.steps:
      return np.zeros(shape, np.int64)
    a = self.rate_of(arm)
    u = rng.random(tuple(shape) + (arm.steps,))
    return np.cumprod(u < a, axis=-1).sum(-1)


def _run_acceptance(path: str, last: int = 5) -> list[tuple[str, float]]:
  """A run's metrics.jsonl: its drafter's chain, `{depth}_1_{depth + 1}`, at the mean tokens per
  verification of the last `last` steps that measured it (`drafter_acceptance`: the policy's
  own samples at the rollout's temperature, train.py)."""
  seen: list[tuple[int, float]] = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      try:
        rec = json.loads(line) if line.strip() else {}
      except json.JSONDecodeError as e:
        raise ConfigError(f"line {i} is not JSON ({e})", "--acceptance", path) from None
      m = rec.get("drafter_acceptance") if isinstance(rec, dict) else None
      if isinstance(m, dict) and "tokens_per_verify" in m:
        seen.append((int(m["depth"]), float(m["tokens_per_verify"])))
  if not seen:
    raise ConfigError("has no drafter_acceptance (a run's metrics.jsonl records it at each step "
                      "where the drafter is wanted): give tokens per verification instead, "
                      "4_1_5=3.1", "--acceptance", path)
  depth = seen[-1][0]
  tpv = [v for d, v in seen if d == depth][-last:]
  return [(f"{depth}_1_{depth + 1}", float(np.mean(tpv)))]


def acceptance(spec: str) -> Acceptance:
  """An `Acceptance` from "arm=v,...", a JSON file, or one number (module docstring); "":
  the default (every drafter arm at the per-draft RATE, history arms 1.8)."""
  if not spec.strip():
    return Acceptance()
  try:
    number = float(spec)
  except ValueError:
    number = None
  if number is not None:
    try:
      return Acceptance(default=number)
    except ValueError as e:
      raise ConfigError(str(e), "--acceptance", spec) from None
  if os.path.isfile(spec):
    items = _run_acceptance(spec) if spec.endswith(".jsonl") else None
    if items is None:
      try:
        with open(spec) as f:
          d = json.load(f)
      except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot be read as JSON ({e})", "--acceptance", spec) from None
      items = list(d.items()) if isinstance(d, dict) else None
  elif spec.endswith((".json", ".jsonl")) or os.sep in spec:
    raise ConfigError("no such file; pass a run's metrics.jsonl, a JSON file of "
                      "arm=tokens_per_verification, or them inline", "--acceptance", spec)
  else:
    items = [p.partition("=")[::2] for p in spec.split(",") if p]
  if not items:
    raise ConfigError("use arm=tokens_per_verification,... (4_1_5=3.1, rate=0.8, default=3.0, "
                      "history=1.8), a JSON file of them, or one number", "--acceptance", spec)
  out, kw = [], {}
  for arm, v in items:
    try:
      if arm in ("default", "history", "rate"):  # the drafter / history arms not named
        kw[arm] = float(v)
      else:
        out.append((str(Strategy(arm)), float(v)))
    except ValueError as e:
      raise ConfigError(f"{arm}={v!r}: {e}", "--acceptance", spec) from None
  try:
    return Acceptance(tpv=tuple(out), **kw)
  except ValueError as e:
    raise ConfigError(str(e), "--acceptance", spec) from None
