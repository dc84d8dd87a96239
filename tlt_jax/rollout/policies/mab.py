"""Strategy selection for speculative rollout: which arm decodes the next chunk.

Why a bandit: a strategy's speed-up depends on the live batch size (verifying B x V tokens is
nearly free at B=1 and compute-bound at large B) and on the drafter's acceptance rate, which
drifts as the policy trains and the drafter is retrained. No fixed arm is best over a whole
rollout, and the best arm of a batch size changes over training. BEG-MAB (TLT; docs/engine.md)
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

Reward (reported by the engine per chunk, records.ChunkMetrics.row_speed): tokens per
verification x steps / wall time of the chunk's draft + verify, in tokens/s per live row (the
rate its rows decoded at had none ended mid-chunk); per row, not the batch's tokens/s, so that
chunks at different sizes of one bucket compare (row_speed says why).

The policy is a value, as the speculation gate's is (gate.py): `BanditConfig` (the rule, its
buckets and parameters, validated once) and `BanditState` (the reward windows and pull counts).
`BanditState.select` is a pure function of the state (its random draws are seeded by (seed,
bucket, pulls so far), so asking again before an update gives the same arm) and `update`
returns the next state; both run without devices or threads (a simulator drives them on its own
clock). The train state holds the value between rollouts; during one, the workers share it in a
`Selector` (cells.py). `BanditState.state_dict`
is JSON and `BanditState.restore` continues the sequence exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import statistics
from typing import Any, Mapping, Sequence

from tlt_jax.errors import ConfigError
from tlt_jax.rollout.policies.strategy import Strategy

RULES = ("fixed", "egreedy", "ucb1")  # always one arm; epsilon-greedy on medians; UCB1 on means
SELECTORS = ("fixed", "beg", "eg", "ucb1", "bucb1")  # config names (bandit_config)


def default_mab_buckets() -> dict[int, list[Strategy]]:
  """BEG buckets for the default tiny model and its chain drafter. Every bucket has "off", so the
  bandit explores and can turn speculation off (TLT's buckets hold one arm each), drafter chains and
  a history arm. Drafter arms from notebooks/mab_bucket_ablation.ipynb (CPU): 6_1_7 was rarely the
  best anywhere, 3_1_4 and 4_1_5 usually were, and shallower chains only pay off at large live
  batches. History arms (scripts/bench_history_arms.py): hist_4 is the cheapest history draft (no
  drafter forward); the hybrid hyb_4 (the index's and the drafter's chains as one tree of 9 verified
  tokens) only where the batch is small enough for the wider verification. Bounds: TLT's [1, 2, 5,
  21], split further where the engine's power-of-two buckets split (9; 33, 65, 129): speculation
  runs up to max_batch here (the reference's stops at 32), and one bucket over 21-216 rows compared
  arms measured at sizes 5x apart, whose best arms differ (with the per-row reward, the simulator's
  7B-70B plans: -1% to +7% of the rollout, docs/scale.md)."""
  small = ("4_1_5", "3_1_4", "hyb_4", "hist_4", "off")
  large = ("3_1_4", "2_1_3", "hist_4", "off")
  return {lo: [Strategy(a) for a in (small if lo < 21 else large)]
          for lo in (1, 2, 5, 9, 21, 33, 65, 129)}


def parse_buckets(text: str) -> dict[int, list[Strategy]] | None:
  """config.tlt.spec.buckets: '1:4_1_5,3_1_4,off 2:...' -> {1: [Strategy("4_1_5"), ...],
  2: ...}; '' -> None."""
  if not text.strip():
    return None
  out = {}
  for part in text.split():
    bound, sep, arms = part.partition(":")
    if not sep or not bound.isdigit() or not arms:
      raise ConfigError(f"{part!r} is not 'LOWER_BOUND:ARM,ARM,...' (e.g. '1:4_1_5,3_1_4,off "
                        "5:3_1_4,off')", "tlt.spec.buckets", in_config=True)
    try:
      out[int(bound)] = [Strategy(a) for a in arms.split(",")]
    except ValueError as e:
      raise ConfigError(f"bucket {bound}: {e}", "tlt.spec.buckets", in_config=True) from None
  return out


def _check_size(batch_size: int) -> int:
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
  return int(batch_size)


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


def _buckets(buckets) -> tuple[tuple[int, tuple[Strategy, ...]], ...]:
  """Mappings (ConfigDicts, JSON: string keys) of lower bound -> arms, or one list of arms
  (one bucket: every live size), validated, sorted by bound; the arms as strategies."""
  if not hasattr(buckets, "items"):
    buckets = {1: buckets}
  if not buckets:
    raise ConfigError("no buckets given; e.g. {1: ['4_1_5', 'off']}", "buckets")
  out: dict[int, tuple[Strategy, ...]] = {}
  for lo, arms in sorted(((_bound(k), v) for k, v in buckets.items()), key=lambda x: x[0]):
    arms = (arms,) if isinstance(arms, str) else tuple(arms)
    if not arms:
      raise ConfigError(f"bucket {lo} has no arms; give it at least one (e.g. 'off')",
                        "buckets")
    try:
      arms = tuple(Strategy(a) for a in arms)
    except ValueError as e:
      raise ConfigError(f"bucket {lo}: {e}", "buckets") from None
    if len(set(arms)) != len(arms):
      raise ConfigError(f"bucket {lo} lists an arm twice: {list(arms)}", "buckets")
    if lo in out:
      raise ConfigError(f"bucket bound {lo} is given twice", "buckets")
    out[lo] = arms
  return tuple(out.items())


@dataclasses.dataclass(frozen=True)
class BanditConfig:
  """What a bandit fixes: its rule, buckets (lower bound on the live batch size -> arms) and
  parameters. Built by `bandit_config` from config values; validated here."""

  rule: str
  buckets: tuple[tuple[int, tuple[Strategy, ...]], ...]
  window: int = 300  # rewards an arm's value is computed over (the last ones)
  min_pulls: int = 1  # rewards of every arm of a bucket before the rule chooses
  epsilon: float = 0.1  # egreedy: the share of random choices
  c: float = 1.0  # ucb1: the exploration bonus's weight
  seed: int = 0  # the random draws (exploration rounds' orders, epsilon's coin)

  def __post_init__(self):
    if self.rule not in RULES:
      raise ConfigError(f"use one of {', '.join(RULES)}", "rule", self.rule)
    b = self.buckets  # a mapping, a list of arms, or this class's own (bound, arms) pairs
    if b and not hasattr(b, "items") and not isinstance(b[0], str):
      b = dict(b)
    object.__setattr__(self, "buckets", _buckets(b))
    w = self.window
    if isinstance(w, bool) or int(w) != w or w < 1:
      raise ConfigError("must be a positive integer", "window", w)
    m = self.min_pulls
    if isinstance(m, bool) or int(m) != m or not 1 <= m <= w:
      raise ConfigError(f"must be an integer in [1, window={w}]", "min_pulls", m)
    if not 0.0 <= self.epsilon <= 1.0:
      raise ConfigError("must be in [0, 1]", "epsilon", self.epsilon)
    if not self.c >= 0:
      raise ConfigError("must be >= 0", "c", self.c)
    if self.rule == "fixed" and len(self.arms) != 1:
      raise ConfigError("a fixed selector has one arm", "buckets", dict(self.buckets))

  @property
  def bounds(self) -> list[int]:
    return [lo for lo, _ in self.buckets]

  @property
  def by_bound(self) -> dict[int, tuple[Strategy, ...]]:
    return dict(self.buckets)

  @property
  def arms(self) -> list[Strategy]:
    """Every arm of every bucket, first-listed order."""
    return list(dict.fromkeys(a for _, arms in self.buckets for a in arms))

  def bucket_of(self, batch_size: int) -> int:
    """The largest bucket bound <= batch_size."""
    n = _check_size(batch_size)
    bounds = self.bounds
    i = bisect.bisect_right(bounds, n) - 1
    if i < 0:
      raise ValueError(f"batch_size={n} is below every bucket bound {bounds}; add a bucket "
                       "with bound 1")
    return bounds[i]

  def arms_for(self, batch_size: int) -> list[Strategy]:
    return list(self.by_bound[self.bucket_of(batch_size)])

  def choosable(self, lo: int, hi: int) -> list[Strategy]:
    """Arms select() can return for some live size in [lo, hi] (sizes below every bound have
    no arm)."""
    lo, hi = _check_size(lo), _check_size(hi)
    if lo > hi:
      raise ValueError(f"choosable({lo}, {hi}): lo must be <= hi")
    bounds = self.bounds + [math.inf]
    return list(dict.fromkeys(a for i, (b, arms) in enumerate(self.buckets)
                              if b <= hi and bounds[i + 1] > lo for a in arms))

  def to_json(self) -> dict[str, Any]:
    return {"rule": self.rule, "window": self.window, "min_pulls": self.min_pulls,
            "epsilon": self.epsilon, "c": self.c,
            "buckets": {str(lo): list(a) for lo, a in self.buckets}}


@dataclasses.dataclass(frozen=True)
class BanditState:
  """The bandit's state: per (bucket, arm) its last `window` rewards and its pull count.
  Transitions are pure: `select` reads, `update` returns the next state."""

  cfg: BanditConfig
  rewards: Mapping[int, Mapping[str, tuple[float, ...]]]
  pulls: Mapping[int, Mapping[str, int]]

  @classmethod
  def fresh(cls, cfg: BanditConfig) -> BanditState:
    return cls(cfg, {lo: {a: () for a in arms} for lo, arms in cfg.buckets},
               {lo: {a: 0 for a in arms} for lo, arms in cfg.buckets})

  def select(self, batch_size: int, arms: Sequence[Strategy] | None = None) -> Strategy:
    """The arm for a chunk of `batch_size` live rows, among `arms` where given (the ones the
    speculation gate has paid to compile there). None of them the bucket's (a speculating
    batch left at a larger bucket's executables): the first of them, a chunk the bandit does
    not learn from (`learns`)."""
    cfg = self.cfg
    lo = cfg.bucket_of(batch_size)
    if cfg.rule == "fixed":
      return cfg.arms[0]
    listed = cfg.by_bound[lo]
    rewards = self.rewards[lo]
    pool = [a for a in listed if arms is None or a in arms]
    if not pool:
      return Strategy(arms[0])
    # arms with fewer than min_pulls rewards first: rounds of the least measured, in random
    # order (module docstring: a fixed one aliases with periodic workloads). The order is a
    # function of (seed, bucket, round): an arm whose chunk reported nothing (it compiled)
    # is asked again, not swapped for another untried one.
    fewest = min(len(rewards[a]) for a in pool)
    if fewest < cfg.min_pulls:
      order = list(listed)
      random.Random(f"{cfg.seed}:{lo}:{fewest}").shuffle(order)
      return next(a for a in order if a in pool and len(rewards[a]) == fewest)
    # the bucket's draws: a function of (seed, bucket, pulls so far), so `select` is pure
    rng = random.Random(f"{cfg.seed}:{lo}:draw:{sum(self.pulls[lo].values())}")
    if cfg.rule == "egreedy":
      if rng.random() < cfg.epsilon:
        return pool[rng.randrange(len(pool))]
      return max(pool, key=lambda a: self._value(lo, a))
    means = {a: self._value(lo, a) for a in pool}  # ucb1
    scale = max(abs(m) for m in means.values()) or 1.0
    n = {a: len(rewards[a]) for a in pool}
    total = sum(n.values())
    return max(pool, key=lambda a: means[a] / scale
               + cfg.c * math.sqrt(2.0 * math.log(total) / n[a]))

  def learns(self, arm: Strategy, batch_size: int) -> bool:
    """Whether a chunk of `arm` at `batch_size` live rows is one of the bandit's pulls (the
    arm is listed at that bucket)."""
    return arm in self.rewards[self.cfg.bucket_of(batch_size)]

  def update(self, arm: Strategy, batch_size: int, reward: float) -> BanditState:
    """The state after `arm`'s chunk at `batch_size` earned `reward` (tokens/s per live row)."""
    cfg = self.cfg
    lo = cfg.bucket_of(batch_size)
    if arm not in self.rewards[lo]:
      raise ValueError(f"arm {arm!r} is not an arm of bucket {lo} {list(cfg.by_bound[lo])} "
                       f"(batch size {batch_size})")
    reward = float(reward)
    if not math.isfinite(reward):
      raise ValueError(f"reward {reward} for arm {arm!r} is not finite")
    window = (self.rewards[lo][arm] + (reward,))[-cfg.window:]
    return dataclasses.replace(
        self, rewards={**self.rewards, lo: {**self.rewards[lo], arm: window}},
        pulls={**self.pulls, lo: {**self.pulls[lo], arm: self.pulls[lo][arm] + 1}})

  def values(self, batch_size: int) -> dict[str, float | None]:
    """The arm values the rule compares (None: untried), for logs, plots and the compile
    plan's order; none for a size below every bucket bound."""
    if _check_size(batch_size) < self.cfg.bounds[0]:
      return {}
    lo = self.cfg.bucket_of(batch_size)
    return {a: self._value(lo, a) if r else None for a, r in self.rewards[lo].items()}

  def _value(self, lo: int, arm: Strategy) -> float:
    r = self.rewards[lo][arm]
    return statistics.fmean(r) if self.cfg.rule == "ucb1" else statistics.median(r)

  def state_dict(self) -> dict[str, Any]:
    return {**self.cfg.to_json(), "seed": self.cfg.seed,
            "rewards": {str(lo): {a: list(r) for a, r in d.items()}
                        for lo, d in self.rewards.items()},
            "pulls": {str(lo): dict(d) for lo, d in self.pulls.items()}}

  @classmethod
  def restore(cls, cfg: BanditConfig, state: Mapping[str, Any]) -> BanditState:
    """The state `state_dict` saved, for a bandit configured as `cfg` (its seed is the saved
    one: the sequence continues). A state of another rule, window or buckets is refused."""
    mine = cfg.to_json()
    if "rule" not in state:
      raise ValueError(f"selector state in an older layout ({state.get('type', 'untyped')}, "
                       "before BanditState): start the selector fresh")
    theirs = {k: state.get(k) for k in mine}
    if theirs != mine:
      raise ValueError(f"selector state was saved by {theirs}, this selector is {mine}: use "
                       "the same rule, window and buckets, or start the selector fresh")
    cfg = dataclasses.replace(cfg, seed=state["seed"])
    window = lambda r: tuple(map(float, r))[-cfg.window:]
    return cls(cfg, {lo: {a: window(state["rewards"][str(lo)][a]) for a in arms}
                     for lo, arms in cfg.buckets},
               {lo: {a: int(state["pulls"][str(lo)][a]) for a in arms}
                for lo, arms in cfg.buckets})


def bandit_config(selector: str, buckets: Mapping[int, Sequence[str]] | None = None, *,
                  strategy: str | None = None, epsilon: float = 0.1, window: int = 300,
                  min_pulls: int = 1, seed: int = 0, c: float = 1.0) -> BanditConfig:
  """A bandit's config from config values (arguments named as config.tlt.spec's keys). selector:
  "beg" (bucketed epsilon-greedy), "eg" (epsilon-greedy, one bandit over every arm of
  `buckets`), "ucb1" (likewise, UCB1), "bucb1" (UCB1 per bucket), "fixed" (always the arm
  `strategy`). buckets default to `default_mab_buckets()`."""
  if selector == "fixed":
    if strategy is None:
      raise ConfigError("the 'fixed' selector needs an arm, e.g. '4_1_5'", "strategy", None)
    try:
      arm = Strategy(strategy)
    except ValueError as e:
      raise ConfigError(str(e), "strategy", strategy) from None
    return BanditConfig("fixed", {1: [arm]})
  if selector not in SELECTORS:
    raise ConfigError(f"use one of {', '.join(SELECTORS)}", "selector", selector)
  buckets = _buckets(default_mab_buckets() if buckets is None else buckets)
  if selector in ("eg", "ucb1"):  # one bandit over every arm
    buckets = ((1, tuple(dict.fromkeys(a for _, arms in buckets for a in arms))),)
  rule = "egreedy" if selector in ("beg", "eg") else "ucb1"
  return BanditConfig(rule, buckets, window=window, min_pulls=min_pulls, epsilon=epsilon, c=c,
                      seed=seed)
