"""One `generate` call's record (`Call`: what the call was given and where it is besides the
device state) and the host rules the engine's chunk loop reads off it: the longest row
(`longest_row`), a preempted request's tokens so far (`Call.done`, `Call.text_len`: it is
resumed from them, pages.py), the live row whose prompt pages a request admitted apart from
its group can share (`Call.leader`), and the refills that feed those rows apart
(`rows_apart`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tlt_jax.rollout.pages import PageAllocator
from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.records import EngineHooks, Output, Request, Result
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import Refill, Scheduler


def longest_row(sched: Scheduler, outputs: dict[Any, Output]) -> int:
  """The longest row in the batch: prompt + response so far, host-side (>= its committed
  cache length: a speculative row's pending token is emitted but not yet committed)."""
  return max((len(req.prompt_ids) + outputs[req.key].length
              for req in sched.slots if req is not None), default=1)


@dataclasses.dataclass
class Call:
  """One `generate` call: what it was given (sampling, its key, the selector and the gate it
  reports to, whether it captures hidden states, the hooks, the compile plan's view) and where
  it is besides the device state (the scheduler, the rows' outputs, the finished results, the
  pages its rows hold)."""
  sp: SamplingParams
  base_key: Any
  selector: Any
  gate: Any  # the gate this call measures (None: evaluation, or no gate)
  track: bool  # the drafter's cache kept current: the call may speculate (module docstring)
  capture: bool
  hooks: EngineHooks
  t_start: float
  plan: PlanCall
  sched: Scheduler
  pages: PageAllocator
  history: Any  # the history index this call feeds (None: not fed, `_feed_history`)
  # request key -> its response so far: a live row's, or a preempted one's (resumed from it)
  outputs: dict[Any, Output] = dataclasses.field(default_factory=dict)
  results: list[Result] = dataclasses.field(default_factory=list)
  # a prompt's text -> the requests whose rows were given it (`prefilled`): whose pages a
  # sibling admitted later may share (`adopting`)
  prompts: dict[tuple[int, ...], list[Any]] = dataclasses.field(default_factory=dict)
  # request key -> (the row whose prompt pages it shares, how many): its refill's decision
  adopting: dict[Any, tuple[Any, int]] = dataclasses.field(default_factory=dict)
  # an untracked call's: what a tracked call would add to its prefills (each one's shapes:
  # the drafter's `track_prompt`) and the buckets it decoded plainly at (its tracking there),
  # compiled before the next call where that one is tracked (`CompilePlan.next_call`)
  untracked_prefills: dict[Any, tuple] = dataclasses.field(default_factory=dict)
  plain_at: set[int] = dataclasses.field(default_factory=set)
  # a speculating engine compiling in the background: the largest bucket a batch of the call
  # can need (what is compiled ahead for it stops there; None: no background compiles)
  top: int | None = None

  def done(self, req: Request) -> int:
    """Response tokens `req` has so far (a preempted request's: resumed from them)."""
    out = self.outputs.get(req.key)
    return 0 if out is None else out.length

  def text_len(self, req: Request) -> int:
    """The slots `req`'s row holds once (re)admitted: its prompt and its tokens so far."""
    return len(req.prompt_ids) + self.done(req)

  def prefilled(self, req: Request) -> None:
    """`req`'s row holds its prompt's pages now (a sibling admitted later may share them)."""
    self.prompts.setdefault(tuple(int(t) for t in req.prompt_ids), []).append(req.key)

  def leader(self, req: Request) -> tuple[Any, int] | None:
    """(a live row holding `req`'s prompt, the pages `req` can share with it) where there is
    one: the pages wholly before the prompt's last slot (pages.share_prompts' rule), none when
    the prompt fills no page; a row finished or preempted holds none."""
    n = (len(req.prompt_ids) - 1) // self.pages.page_size
    for key in self.prompts.get(tuple(int(t) for t in req.prompt_ids), ()) if n else ():
      if key != req.key and self.pages.held(key) >= n:
        return key, n
    return None

  def adopt(self, reqs) -> list[int]:
    """Each of `reqs` (admitted apart from its group, its leader in `adopting`: `rows_apart`)
    holds its leader's pages wholly before its prompt's last slot in place of its own
    (pages.PageAllocator.share). Returns the slots each row starts with (Replica._adopt)."""
    starts = []
    for r in reqs:
      leader, n = self.adopting[r.key]
      self.pages.share(r.key, leader, n)
      starts.append(n * self.pages.page_size)
    return starts


def rows_apart(ops, c: Call, bucket_for) -> list:
  """The scheduler's layout ops with each request a refill admits that is fed more than a
  prefill of its prompt gives taken out into a refill of its own at the smallest bucket,
  before the fresh ones (at theirs, `bucket_for`): a preempted request (`c.done`: resumed
  from its tokens so far, `Replica._resume`) and a request whose prompt a live row holds
  (`c.leader`: it shares those pages, recorded in `c.adopting`, and only the rest of its
  prompt is fed, `Replica._adopt`). Their forwards run at one row (an executable per width of
  `resume_chunks`, however many rows come at once, none padded), and no fresh prompt is
  carried through them."""
  out = []
  for op in ops:
    requests = getattr(op, "requests", ())
    if not isinstance(op, Refill):
      out.append(op)
      continue
    back = []
    for i, r in enumerate(requests):
      lead = c.leader(r)
      if lead is not None:
        c.adopting[r.key] = lead
      else:  # (an earlier admission's decision is not this one's)
        c.adopting.pop(r.key, None)
      if lead is not None or c.done(r):
        back.append(i)
    out += [Refill((requests[i],), (op.slots[i],), bucket_for(1)) for i in back]
    fresh = [i for i in range(len(requests)) if i not in back]
    if fresh:
      out.append(Refill(tuple(requests[i] for i in fresh), tuple(op.slots[i] for i in fresh),
                        bucket_for(len(fresh)) if back else op.bucket))
  return out
