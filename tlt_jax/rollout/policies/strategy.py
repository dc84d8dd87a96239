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

import re

_ARM = re.compile(r"^(\d+)_(\d+)_(\d+)$")
_HIST = re.compile(r"^hist_(\d+)$")
_HYB = re.compile(r"^hyb_(\d+)$")
_HIST_TREE = re.compile(r"^histtree_(\d+)_(\d+)_(\d+)$")
# The arm a fixed selector runs (SpecConfig.strategy); the default bandit's arm set per
# live-batch bucket is mab.default_mab_buckets
DEFAULT_ARM = "4_1_5"  # (a name: configs hold names)


class Strategy(str):
  """An arm: its name, parsed once. `Strategy("4_1_5")` reads the name (ValueError naming the
  grammar for one that is not an arm) and carries the numbers; it is the name as a string
  too, so arms are dict keys, JSON and log text as they are, and equal to their names.
  Strings become strategies only at the edges: the config (rollout/config.py, the bandit's
  buckets), the CLI and saved state; inside, an arm is read (`arm.steps`), never re-parsed.

  topk=1: a chain of `steps` drafts, steps+1 tokens verified. topk>1: an EAGLE-2 tree of
  depth `steps` pruned to `num_verify_tokens` nodes, the root (pending token) included.
  steps=0 is "off". history: the drafts come from the host's history index (module
  docstring), not the drafter; hybrid: the index's chain and the drafter's as one tree."""

  steps: int
  topk: int
  num_verify_tokens: int
  history: bool
  hybrid: bool

  def __new__(cls, arm: str) -> "Strategy":
    if isinstance(arm, Strategy):
      return arm
    steps, topk, verify, history, hybrid = _parse(arm)
    self = super().__new__(cls, arm)
    for k, v in (("steps", steps), ("topk", topk), ("num_verify_tokens", verify),
                 ("history", history), ("hybrid", hybrid)):
      object.__setattr__(self, k, v)
    return self

  @classmethod
  def of(cls, steps: int, topk: int = 1, num_verify_tokens: int = 0) -> "Strategy":
    """A drafter arm from its numbers (num_verify_tokens 0: steps * topk + 1, capped at the
    expansion's candidates; a chain's is steps + 1); steps 0 is "off"."""
    if steps == 0:
      return cls("off")
    if steps < 0 or topk < 1:
      raise ValueError(f"strategy {steps}_{topk}_{num_verify_tokens}: steps must be >= 0 and "
                       "topk >= 1")
    verify = num_verify_tokens or (steps + 1 if topk == 1
                                   else min(steps * topk + 1, _max_nodes(steps, topk, False)))
    return cls(f"{steps}_{topk}_{verify}")

  def __setattr__(self, name, value):
    raise AttributeError(f"Strategy {str(self)!r} is immutable")

  def __reduce__(self):
    return (Strategy, (str(self),))

  @property
  def name(self) -> str:
    return str(self)

  @property
  def max_nodes(self) -> int:
    """Candidates of the expansion, root included: 1 + k + (steps - 1) k^2 (a history tree:
    every node of depth <= steps with <= k children, 1 + k + ... + k^steps)."""
    return _max_nodes(self.steps, self.topk, self.history)

  @property
  def kind(self) -> str:
    """Where the drafts come from: "off", "drafter", "history" or "hybrid" (metrics, gate)."""
    if not self.steps:
      return "off"
    return "hybrid" if self.hybrid else "history" if self.history else "drafter"

  @property
  def verify_tokens(self) -> int:
    return self.num_verify_tokens


def _max_nodes(steps: int, topk: int, history: bool) -> int:
  if not steps:
    return 1
  if history:
    return sum(topk ** d for d in range(steps + 1))
  return 1 + topk + max(steps - 1, 0) * topk ** 2


def _parse(arm) -> tuple[int, int, int, bool, bool]:
  """(steps, topk, verify_tokens, history, hybrid) of an arm's name; ValueError naming the
  grammar for anything else."""
  if arm == "off":
    return 0, 1, 1, False, False
  name = arm if isinstance(arm, str) else ""
  if (m := _HIST.match(name)):
    steps = int(m.group(1))
    if steps == 0:
      raise ValueError("a history strategy drafts at least one token: steps must be >= 1")
    _canonical(arm, f"hist_{steps}")
    return steps, 1, steps + 1, True, False
  if (m := _HYB.match(name)):
    steps = int(m.group(1))
    if steps == 0:
      raise ValueError("a history strategy drafts at least one token: steps must be >= 1")
    _canonical(arm, f"hyb_{steps}")
    return steps, 2, 2 * steps + 1, True, True
  history = name.startswith("histtree_")
  m = (_HIST_TREE if history else _ARM).match(name)
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
  if topk < 1:
    raise ValueError(f"strategy {arm!r}: topk must be >= 1")
  if topk == 1 and verify != steps + 1:
    raise ValueError(f"strategy {arm}: a chain verifies steps + 1 tokens; write "
                     f"'{steps}_1_{steps + 1}'")
  nodes = _max_nodes(steps, topk, history)
  if verify > nodes:
    raise ValueError(f"strategy {arm}: a tree of depth {steps} and branching {topk} has "
                     f"{nodes} candidate nodes; verify between 2 and {nodes}")
  _canonical(arm, ("histtree_" if history else "") + f"{steps}_{topk}_{verify}")
  return steps, topk, verify, history, False


def _canonical(arm: str, name: str) -> None:
  """An arm is its one name: '04_1_5' would be a second key for 4_1_5's rewards."""
  if arm != name:
    raise ValueError(f"strategy {arm!r}: write {name!r}")
