"""The one arm type: a speculative decoding strategy and its name.

A strategy is (draft depth `steps`, branching `topk`, `num_verify_tokens`), named
"<steps>_<topk>_<verify_tokens>" ("4_1_5": a chain of 4 drafts, 5 tokens verified;
"6_4_24": an EAGLE-2 tree of depth 6, branching 4, pruned to 24 nodes), or "off" (plain
decoding inside the speculative state, so the bandit can turn speculation off).

History arms draft from a host index of earlier text instead of the drafter (no drafter
forward; the engine asks the index before every verification): "hist_<steps>" (a chain of up
to `steps` tokens, steps + 1 verified) and "histtree_<steps>_<topk>_<verify_tokens>" (a tree of
depth <= steps, <= topk children per node, <= verify_tokens nodes with the root, as for drafter
trees). The same three numbers as a drafter arm, so every consumer of `steps` / `verify_tokens`
(catch-up capacity, chunk reach, the gate's depth) reads a history arm unchanged; the prefix
names the draft source. "hyb_<steps>" (hybrid) verifies two chains of up to `steps` tokens
as one tree: the index's, and the drafter's (argmax) from the same root, merged where they
agree (drafts.hybrid_draft), so the drafter extends a history draft that runs out and
replaces one that is missing or wrong; topk 2, 2 steps + 1 tokens verified; it costs the
drafter's forwards, a lookup and the wider verification. Pure Python: the selectors (mab.py)
and config validation use it without JAX.
"""

from __future__ import annotations

import dataclasses
import re

_ARM = re.compile(r"^(\d+)_(\d+)_(\d+)$")
_HIST = re.compile(r"^hist_(\d+)$")
_HYB = re.compile(r"^hyb_(\d+)$")
_HIST_TREE = re.compile(r"^histtree_(\d+)_(\d+)_(\d+)$")
# The arm a fixed selector runs (SpecConfig.strategy); the default bandit's arm set per
# live-batch bucket is mab.default_mab_buckets
DEFAULT_ARM = "4_1_5"


@dataclasses.dataclass(frozen=True)
class Strategy:
  """topk=1: a chain of `steps` drafts, steps+1 tokens verified. topk>1: an EAGLE-2 tree of
  depth `steps` pruned to `num_verify_tokens` nodes, the root (pending token) included
  (default: steps * topk + 1, capped at the number of candidates the expansion produces).
  steps=0 is "off". history: the drafts come from the host's history index (module
  docstring), not the drafter; hybrid: the index's chain and the drafter's as one tree."""

  steps: int
  topk: int = 1
  num_verify_tokens: int = 0
  history: bool = False
  hybrid: bool = False

  def __post_init__(self):
    label = ("histtree_" if self.history else "") + (
        f"{self.steps}_{self.topk}_{self.num_verify_tokens}")
    if self.steps < 0 or self.topk < 1:
      raise ValueError(f"strategy {label}: steps must be >= 0 and topk >= 1")
    if self.history and self.steps == 0:
      raise ValueError("a history strategy drafts at least one token: steps must be >= 1")
    if self.hybrid and not (self.history and self.topk == 2
                            and self.verify_tokens == 2 * self.steps + 1):
      raise ValueError(f"strategy {label}: a hybrid arm is 'hyb_<steps>' (two chains)")
    if self.num_verify_tokens and self.steps:
      if self.topk == 1 and self.num_verify_tokens != self.steps + 1:
        raise ValueError(f"strategy {label}: a chain verifies "
                         f"steps + 1 tokens; write '{self.steps}_1_{self.steps + 1}'")
      if not 2 <= self.num_verify_tokens <= self.max_nodes:
        raise ValueError(f"strategy {label}: a tree "
                         f"of depth {self.steps} and branching {self.topk} has {self.max_nodes} "
                         f"candidate nodes; verify between 2 and {self.max_nodes}")

  @property
  def max_nodes(self) -> int:
    """Candidates of the expansion, root included: 1 + k + (steps - 1) k^2 (a history tree:
    every node of depth <= steps with <= k children, 1 + k + ... + k^steps)."""
    if not self.steps:
      return 1
    if self.history:
      return sum(self.topk ** d for d in range(self.steps + 1))
    return 1 + self.topk + max(self.steps - 1, 0) * self.topk ** 2

  @property
  def name(self) -> str:
    if self.steps == 0:
      return "off"
    if self.hybrid:
      return f"hyb_{self.steps}"
    if self.history:
      return (f"hist_{self.steps}" if self.topk == 1
              else f"histtree_{self.steps}_{self.topk}_{self.verify_tokens}")
    return f"{self.steps}_{self.topk}_{self.verify_tokens}"

  @property
  def kind(self) -> str:
    """Where the drafts come from: "off", "drafter", "history" or "hybrid" (metrics, gate)."""
    if not self.steps:
      return "off"
    return "hybrid" if self.hybrid else "history" if self.history else "drafter"

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
    arm = arm if isinstance(arm, str) else ""
    if (m := _HIST.match(arm)):
      return cls(int(m.group(1)), history=True)
    if (m := _HYB.match(arm)):
      steps = int(m.group(1))
      return cls(steps, 2, 2 * steps + 1, history=True, hybrid=True)
    history = arm.startswith("histtree_")
    m = (_HIST_TREE if history else _ARM).match(arm)
    if not m:
      raise ValueError(f"strategy {arm!r}: use '<steps>_<topk>_<verify_tokens>' (e.g. '4_1_5'), "
                       "'hist_<steps>', 'hyb_<steps>', 'histtree_<steps>_<topk>_<verify_tokens>' or "
                     "'off'")
    steps, topk, verify = map(int, m.groups())
    if history and topk == 1:
      raise ValueError(f"strategy {arm!r}: a history chain is 'hist_{steps}'")
    if steps == 0:
      raise ValueError(f"strategy {arm!r}: zero draft steps is plain decoding; write 'off'")
    if verify < 2:
      raise ValueError(f"strategy {arm!r}: verify_tokens must be >= 2 (the pending token and "
                       "at least one draft)")
    return cls(steps, topk, verify, history=history)
