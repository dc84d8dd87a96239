"""Strategy selection for speculative rollout: which arm decodes the next chunk.

Why a bandit: a strategy's speed-up depends on the live batch size (verifying B x V tokens is
nearly free at B=1 and compute-bound at large B) and on the drafter's acceptance rate, which
drifts as the policy trains and the drafter is retrained. No fixed arm is best over a whole
rollout, and the best arm of a batch size changes over training. BEG-MAB (TLT; DESIGN.md 4)
keeps one epsilon-greedy bandit per bucket of live batch sizes. An arm's value is the median of
its last `window` rewards: a few slow chunks (a GC pause, a co-tenant) do not move it, and an
arm whose reward drops (a stale drafter) loses its lead within about one window. Every arm of a
bucket is pulled `min_pulls` times (rounds over the least measured arms) before the greedy
choice starts: one chunk's reward is noisy (at batch 1 it is one answer, whose drafts are
accepted more or less than the average), and an arm whose one reward came out low would
otherwise wait for epsilon's rare re-pulls while an arm of lower mean took every chunk
(scripts/bench_history_arms.py saw it). Within a round the order is random: rollouts are
periodic (a GRPO group per chunk at batch 8, prompts in a fixed order), and a fixed order
measured each arm on the same prompts only (bench_history_arms at batch 8: four groups, four
arms, the drafter always on the first group, its slowest, and the bandit chose the hybrid).

Arms are strategy names "<steps>_<topk>_<verify_tokens>" (a chain has topk=1 and verifies
steps+1 tokens), history arms "hist_<steps>" / "histtree_<steps>_<topk>_<verify_tokens>"
(drafts from the engine's history index, strategy.py) or "off" (plain decoding inside the
speculative state, so turning speculation off competes as an arm). Bucket keys are lower
bounds on the live batch size: {1: [...], 2: [...], 5: [...], 21: [...]} means sizes 1, 2-4,
5-20 and >= 21.

Reward (reported by the engine per chunk, records.ChunkMetrics.speed): accepted tokens per
verification x live rows x steps / wall time of the chunk's draft + verify, in tokens/s (the
batch's tokens/s had no row ended mid-chunk).

Every selector here is thread-safe (the workers of a rollout share one) and has the engine's
interface: select(batch_size) -> arm, update(arm,
batch_size, reward); arms_for(batch_size) and choosable(lo, hi) tell the engine which arms can
be chosen at which live sizes (it compiles only those); state_dict() is JSON-serialisable
(RNG included) and load_state_dict() continues the selection sequence exactly.
"""

from __future__ import annotations

import bisect
import collections
import math
import random
import statistics
import threading
from typing import Any, Mapping, Sequence

from tlt_jax.errors import ConfigError
from tlt_jax.rollout.strategy import Strategy

def check_arm(arm: str) -> str:
  """Validates an arm name (tlt_jax/rollout/strategy.py is the one grammar); returns it."""
  Strategy.parse(arm)
  return arm


def default_mab_buckets() -> dict[int, list[str]]:
  """BEG buckets for the default tiny model and its chain drafter. Every bucket has "off", so
  the bandit explores and can turn speculation off (DESIGN.md 4), drafter chains and a history
  arm. Drafter arms from notebooks/mab_bucket_ablation.ipynb (CPU): 6_1_7 was rarely the best
  anywhere, 3_1_4 and 4_1_5 usually were, and shallower chains only pay off at large live
  batches. History arms (scripts/bench_history_arms.py): hist_4 is the cheapest history draft
  (no drafter forward); the hybrid hyb_4 (the index's and the drafter's chains as one tree of
  9 verified tokens) only where the batch is small enough for the wider verification."""
  small = ["4_1_5", "3_1_4", "hyb_4", "hist_4", "off"]
  return {1: small, 2: list(small), 5: list(small), 21: ["3_1_4", "2_1_3", "hist_4", "off"]}


def _check_size(batch_size: int) -> int:
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
  return int(batch_size)


class FixedSelector:
  """One arm, always (speculation without a bandit, and the ablation baseline)."""

  def __init__(self, arm: str):
    self.arm = check_arm(arm)

  @property
  def arms(self) -> list[str]:
    return [self.arm]

  def select(self, batch_size: int, arms: Sequence[str] | None = None) -> str:
    return self.arm

  def update(self, arm: str, batch_size: int, reward: float) -> None:
    pass

  def arms_for(self, batch_size: int) -> list[str]:
    return [self.arm]

  def choosable(self, lo: int, hi: int) -> list[str]:
    return [self.arm]

  def state_dict(self) -> dict[str, Any]:
    return {"type": "FixedSelector", "arm": self.arm}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    if state.get("type") != "FixedSelector" or state.get("arm") != self.arm:
      raise ValueError(f"selector state {dict(state)} does not belong to FixedSelector"
                       f"({self.arm!r})")


class BucketedSelector:
  """Per-bucket reward windows, bucket lookup, state (de)serialisation; subclasses pick the arm
  once every arm of the bucket has a reward (`_choose`)."""

  def __init__(self, buckets: Mapping[int, Sequence[str]] | Sequence[str], *, window: int = 300,
               min_pulls: int = 1, seed: int = 0):
    if not hasattr(buckets, "items"):  # Mappings and ConfigDicts are buckets; lists are arms
      buckets = {1: buckets}  # one bucket: every live size
    if not buckets:
      raise ConfigError("no buckets given; e.g. {1: ['4_1_5', 'off']}", "buckets")
    self.buckets: dict[int, list[str]] = {}
    for lo, arms in sorted(((self._bound(k), v) for k, v in buckets.items()), key=lambda x: x[0]):
      arms = [arms] if isinstance(arms, str) else list(arms)
      if not arms:
        raise ConfigError(f"bucket {lo} has no arms; give it at least one (e.g. 'off')",
                          "buckets")
      for a in arms:
        try:
          check_arm(a)
        except ValueError as e:
          raise ConfigError(f"bucket {lo}: {e}", "buckets") from None
      if len(set(arms)) != len(arms):
        raise ConfigError(f"bucket {lo} lists an arm twice: {arms}", "buckets")
      if lo in self.buckets:
        raise ConfigError(f"bucket bound {lo} is given twice", "buckets")
      self.buckets[lo] = arms
    if isinstance(window, bool) or int(window) != window or window < 1:
      raise ConfigError("must be a positive integer", "window", window)
    self.window = int(window)
    if isinstance(min_pulls, bool) or int(min_pulls) != min_pulls or not 1 <= min_pulls <= window:
      raise ConfigError(f"must be an integer in [1, window={self.window}]", "min_pulls",
                        min_pulls)
    self.min_pulls = int(min_pulls)
    self._bounds = list(self.buckets)
    self._rewards = {lo: {a: collections.deque(maxlen=self.window) for a in arms}
                     for lo, arms in self.buckets.items()}
    self._pulls = {lo: {a: 0 for a in arms} for lo, arms in self.buckets.items()}
    self._seed = seed
    self._rng = random.Random(seed)
    # One selector serves every worker thread of a rollout: select/update/state are atomic.
    self._lock = threading.RLock()

  @staticmethod
  def _bound(key) -> int:
    # Config dicts and JSON have string keys: accept "21" as 21.
    try:
      lo = int(key)
    except (TypeError, ValueError):
      lo = None
    if lo is None or lo < 1 or str(lo) != str(key).strip():
      raise ConfigError(f"bucket key {key!r} must be a positive integer lower bound on the "
                        "live batch size", "buckets")
    return lo

  @property
  def arms(self) -> list[str]:
    """Every arm of every bucket, first-listed order."""
    return list(dict.fromkeys(a for arms in self.buckets.values() for a in arms))

  def bucket_of(self, batch_size: int) -> int:
    """The largest bucket bound <= batch_size."""
    n = _check_size(batch_size)
    i = bisect.bisect_right(self._bounds, n) - 1
    if i < 0:
      raise ValueError(f"batch_size={n} is below every bucket bound {self._bounds}; add a "
                       f"bucket with bound 1")
    return self._bounds[i]

  def arms_for(self, batch_size: int) -> list[str]:
    return list(self.buckets[self.bucket_of(batch_size)])

  def choosable(self, lo: int, hi: int) -> list[str]:
    """Arms select() can return for some live size in [lo, hi] (sizes below every bound have
    no arm)."""
    lo, hi = _check_size(lo), _check_size(hi)
    if lo > hi:
      raise ValueError(f"choosable({lo}, {hi}): lo must be <= hi")
    bounds = self._bounds + [math.inf]
    return list(dict.fromkeys(a for i, b in enumerate(self._bounds)
                              if b <= hi and bounds[i + 1] > lo for a in self.buckets[b]))

  def select(self, batch_size: int, arms: Sequence[str] | None = None) -> str:
    """The arm for a chunk of `batch_size` live rows, among `arms` where given (the ones the
    speculation gate has paid to compile there; none of the bucket's: every arm)."""
    with self._lock:
      lo = self.bucket_of(batch_size)
      rewards = self._rewards[lo]
      pool = [a for a in self.buckets[lo] if arms is None or a in arms] or self.buckets[lo]
      # arms with fewer than min_pulls rewards first: rounds of the least measured, in random
      # order (module docstring: a fixed one aliases with periodic workloads). The order is a
      # function of (seed, bucket, round): an arm whose chunk reported nothing (it compiled)
      # is asked again, not swapped for another untried one.
      fewest = min(len(rewards[a]) for a in pool)
      if fewest < self.min_pulls:
        order = list(self.buckets[lo])
        random.Random(f"{self._seed}:{lo}:{fewest}").shuffle(order)
        return next(a for a in order if a in pool and len(rewards[a]) == fewest)
      return self._choose(lo, pool)

  def _choose(self, lo: int, pool: Sequence[str]) -> str:
    raise NotImplementedError

  def update(self, arm: str, batch_size: int, reward: float) -> None:
    with self._lock:
      lo = self.bucket_of(batch_size)
      if arm not in self._rewards[lo]:
        raise ValueError(f"arm {arm!r} is not an arm of bucket {lo} {self.buckets[lo]} (batch "
                         f"size {batch_size})")
      reward = float(reward)
      if not math.isfinite(reward):
        raise ValueError(f"reward {reward} for arm {arm!r} is not finite")
      self._rewards[lo][arm].append(reward)
      self._pulls[lo][arm] += 1

  def values(self, batch_size: int) -> dict[str, float | None]:
    """The arm values _choose compares (None: untried), for logs and plots."""
    lo = self.bucket_of(batch_size)
    return {a: self._value(lo, a) if r else None for a, r in self._rewards[lo].items()}

  def _value(self, lo: int, arm: str) -> float:
    return statistics.median(self._rewards[lo][arm])

  def _config(self) -> dict[str, Any]:
    return {"type": type(self).__name__, "window": self.window, "min_pulls": self.min_pulls,
            "buckets": {str(lo): list(a) for lo, a in self.buckets.items()}}

  def state_dict(self) -> dict[str, Any]:
    with self._lock:
      version, internal, gauss = self._rng.getstate()
      return {**self._config(),
              "rewards": {str(lo): {a: list(r) for a, r in d.items()}
                          for lo, d in self._rewards.items()},
              "pulls": {str(lo): dict(d) for lo, d in self._pulls.items()},
              "seed": self._seed,  # the exploration rounds' orders
              "rng": [version, list(internal), gauss]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    with self._lock:
      mine = self._config()
      theirs = {k: state.get(k) for k in mine}
      if theirs != mine:
        raise ValueError(f"selector state was saved by {theirs}, this selector is {mine}: use "
                         "the same type, window and buckets, or start the selector fresh")
      for lo in self.buckets:
        for a in self.buckets[lo]:
          self._rewards[lo][a] = collections.deque(map(float, state["rewards"][str(lo)][a]),
                                                   maxlen=self.window)
          self._pulls[lo][a] = int(state["pulls"][str(lo)][a])
      self._seed = state["seed"]
      version, internal, gauss = state["rng"]
      self._rng.setstate((version, tuple(internal), gauss))


class BucketedEpsilonGreedy(BucketedSelector):
  """BEG-MAB: per bucket, with probability epsilon a uniformly random arm, else the arm with
  the best median over its last `window` rewards (ties: first listed)."""

  def __init__(self, buckets: Mapping[int, Sequence[str]] | Sequence[str], epsilon: float = 0.1,
               window: int = 300, seed: int = 0, *, min_pulls: int = 1):
    super().__init__(buckets, window=window, min_pulls=min_pulls, seed=seed)
    if not 0.0 <= epsilon <= 1.0:
      raise ConfigError("must be in [0, 1]", "epsilon", epsilon)
    self.epsilon = float(epsilon)

  def _choose(self, lo: int, pool: Sequence[str]) -> str:
    if self._rng.random() < self.epsilon:
      return pool[self._rng.randrange(len(pool))]
    return max(pool, key=lambda a: self._value(lo, a))

  def _config(self) -> dict[str, Any]:
    return {**super()._config(), "epsilon": self.epsilon}


class EpsilonGreedy(BucketedEpsilonGreedy):
  """Plain (unbucketed) epsilon-greedy over `arms`: one bandit for every live size."""

  def __init__(self, arms: Sequence[str], epsilon: float = 0.1, window: int = 300,
               seed: int = 0, *, min_pulls: int = 1):
    super().__init__({1: list(arms)}, epsilon=epsilon, window=window, min_pulls=min_pulls,
                     seed=seed)


class UCB1(BucketedSelector):
  """UCB1 on windowed means, per bucket (a plain list of arms: one bucket). Rewards are
  tokens/s, not in [0, 1], so means are divided by the bucket's best mean before the bonus
  c * sqrt(2 ln n / n_arm) is added; counts are window counts (sliding-window UCB), which keeps
  some exploration going so that a changed arm is noticed."""

  def __init__(self, arms: Mapping[int, Sequence[str]] | Sequence[str], window: int = 300,
               c: float = 1.0, seed: int = 0, *, min_pulls: int = 1):
    super().__init__(arms, window=window, min_pulls=min_pulls, seed=seed)
    if not c >= 0:
      raise ValueError(f"UCB1: c={c} must be >= 0")
    self.c = float(c)

  def _value(self, lo: int, arm: str) -> float:
    return statistics.fmean(self._rewards[lo][arm])

  def _choose(self, lo: int, pool: Sequence[str]) -> str:
    arms = list(pool)
    means = {a: self._value(lo, a) for a in arms}
    scale = max(abs(m) for m in means.values()) or 1.0
    n = {a: len(self._rewards[lo][a]) for a in arms}
    total = sum(n.values())
    return max(arms, key=lambda a: means[a] / scale
               + self.c * math.sqrt(2.0 * math.log(total) / n[a]))

  def _config(self) -> dict[str, Any]:
    return {**super()._config(), "c": self.c}


SELECTORS = ("fixed", "beg", "eg", "ucb1", "bucb1")


def make_selector(selector: str, buckets: Mapping[int, Sequence[str]] | None = None, *,
                  strategy: str | None = None, epsilon: float = 0.1, window: int = 300,
                  min_pulls: int = 1, seed: int = 0, c: float = 1.0):
  """A selector from config values (arguments named as config.tlt.spec's keys). selector:
  "beg" (bucketed epsilon-greedy), "eg" (epsilon-greedy, one bandit over every arm of
  `buckets`), "ucb1" (likewise, UCB1), "bucb1" (UCB1 per bucket), "fixed" (always the arm
  `strategy`). buckets default to `default_mab_buckets()`."""
  if selector == "fixed":
    if strategy is None:
      raise ConfigError("the 'fixed' selector needs an arm, e.g. '4_1_5'", "strategy", None)
    return FixedSelector(strategy)
  buckets = default_mab_buckets() if buckets is None else buckets
  flat = BucketedSelector(buckets).arms  # validates
  if selector == "beg":
    return BucketedEpsilonGreedy(buckets, epsilon=epsilon, window=window,
                                 min_pulls=min_pulls, seed=seed)
  if selector == "eg":
    return EpsilonGreedy(flat, epsilon=epsilon, window=window, min_pulls=min_pulls, seed=seed)
  if selector == "ucb1":
    return UCB1(flat, window=window, c=c, min_pulls=min_pulls, seed=seed)
  if selector == "bucb1":
    return UCB1(buckets, window=window, c=c, min_pulls=min_pulls, seed=seed)
  raise ConfigError(f"use one of {', '.join(SELECTORS)}", "selector", selector)
