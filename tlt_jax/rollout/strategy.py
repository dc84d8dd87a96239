"""The one arm type: a speculative decoding strategy and its name.

A strategy is (draft depth `steps`, branching `topk`, `num_verify_tokens`), named
"<steps>_<topk>_<verify_tokens>" ("4_1_5": a chain of 4 drafts, 5 tokens verified;
"6_4_24": an EAGLE-2 tree of depth 6, branching 4, pruned to 24 nodes), or "off" (plain
decoding inside the speculative state, so the bandit can turn speculation off). Pure Python:
the selectors (mab.py) and config validation use it without JAX.
"""

from __future__ import annotations

import dataclasses
import re

_ARM = re.compile(r"^(\d+)_(\d+)_(\d+)$")
# The arm a fixed selector runs (SpecConfig.strategy); the default bandit's arm set per
# live-batch bucket is mab.default_mab_buckets
DEFAULT_ARM = "4_1_5"


@dataclasses.dataclass(frozen=True)
class Strategy:
  """topk=1: a chain of `steps` drafts, steps+1 tokens verified. topk>1: an EAGLE-2 tree of
  depth `steps` pruned to `num_verify_tokens` nodes, the root (pending token) included
  (default: steps * topk + 1, capped at the number of candidates the expansion produces).
  steps=0 is "off"."""

  steps: int
  topk: int = 1
  num_verify_tokens: int = 0

  def __post_init__(self):
    if self.steps < 0 or self.topk < 1:
      raise ValueError(f"strategy {self.steps}_{self.topk}_{self.num_verify_tokens}: steps "
                       "must be >= 0 and topk >= 1")
    if self.num_verify_tokens and self.steps:
      if self.topk == 1 and self.num_verify_tokens != self.steps + 1:
        raise ValueError(f"strategy {self.steps}_1_{self.num_verify_tokens}: a chain verifies "
                         f"steps + 1 tokens; write '{self.steps}_1_{self.steps + 1}'")
      if not 2 <= self.num_verify_tokens <= self.max_nodes:
        raise ValueError(f"strategy {self.steps}_{self.topk}_{self.num_verify_tokens}: a tree "
                         f"of depth {self.steps} and branching {self.topk} has {self.max_nodes} "
                         f"candidate nodes; verify between 2 and {self.max_nodes}")

  @property
  def max_nodes(self) -> int:
    """Candidates of the expansion, root included: 1 + k + (steps - 1) k^2."""
    return 1 + self.topk + max(self.steps - 1, 0) * self.topk ** 2 if self.steps else 1

  @property
  def name(self) -> str:
    return "off" if self.steps == 0 else f"{self.steps}_{self.topk}_{self.verify_tokens}"

  @property
  def verify_tokens(self) -> int:
    if self.num_verify_tokens:
      return self.num_verify_tokens
    return self.steps + 1 if self.topk == 1 else min(self.steps * self.topk + 1, self.max_nodes)

  @classmethod
  def parse(cls, arm: str) -> "Strategy":
    """A strategy from its name; the name round-trips (`parse(a).name == a`)."""
    if arm == "off":
      return cls(steps=0)
    m = _ARM.match(arm) if isinstance(arm, str) else None
    if not m:
      raise ValueError(f"strategy {arm!r}: use '<steps>_<topk>_<verify_tokens>' (e.g. '4_1_5') "
                       "or 'off'")
    steps, topk, verify = map(int, m.groups())
    if steps == 0:
      raise ValueError(f"strategy {arm!r}: zero draft steps is plain decoding; write 'off'")
    if verify < 2:
      raise ValueError(f"strategy {arm!r}: verify_tokens must be >= 2 (the pending token and "
                       "at least one draft)")
    return cls(steps, topk, verify)
