"""What the compile plan (compile_plan.py) reads of its engine: `PlanCall`, the engine's view
given with each call (it holds no reference to the engine), and `choosable_pairs`, the
(engine bucket, arm) pairs an engine's bandit can choose: the executables speculation may
need at all."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from tlt_jax.models import Params
from tlt_jax.rollout import decode
from tlt_jax.rollout.pages import KVPages
from tlt_jax.rollout.policies.strategy import Strategy

Pairs = dict[int, list[Strategy]]  # engine bucket -> arms


def abstract(tree):
  """ShapeDtypeStructs of a pytree of arrays (compiling for it later, on another thread)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def resized(tree, b: int):
  """An abstract state (or cache) with `b` rows: its batch-major leaves resized (the page
  pools are not)."""
  return decode.map_rows(
      lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype, sharding=x.sharding), tree)


@dataclasses.dataclass(frozen=True)
class PlanCall:
  """What the plan reads of its engine, given with each call: the worker, its weights (only
  their shapes and shardings are read: `view` makes them abstract), the engine's bandit config
  (its arms and their bucket grid), the call's gate (None: every bucket open), its page
  pools (`KVPages`: their abstract shapes), and the call's bandit (cells.Selector: what it has
  measured ranks each bucket's arms, compile_plan.py; None: their listed order)."""
  worker_id: int
  params: Params
  drafter_params: Params | None
  bandit: Any
  gate: Any
  kv: KVPages
  selector: Any = None

  @classmethod
  def view(cls, worker_id: int, params: Params, drafter_params: Params | None, bandit: Any,
           gate: Any, kv: KVPages, selector: Any = None) -> PlanCall:
    return cls(worker_id, abstract(params), abstract(drafter_params), bandit, gate, kv,
               selector)


def choosable_pairs(ecfg, bandit) -> Pairs:
  """Engine bucket -> the arms `bandit` (its config) can return for a chunk decoded at that
  bucket.

  Speculation runs only at live sizes <= top (`EngineConfig.spec_top`: max_batch, or the
  bs_threshold cap): it switches on at a live size <= top, which (when max_batch > top)
  needs the queue to be empty, and the live batch never grows after that. With compaction,
  a chunk at bucket b has live size in (previous bucket, b]; without, anything in [1, b]
  (a speculating batch may also stay at a larger bucket than its rows need: the compile
  plan's floor). Engine buckets (compiled batch sizes) and the bandit's bucket bounds are
  different grids: this intersects them."""
  spec = ecfg.spec
  if spec is None:
    return {}
  top = ecfg.spec_top
  pairs, prev = {}, 0
  for b in ecfg.buckets:
    lo = prev + 1 if ecfg.compaction else 1
    prev = b
    if lo > top:
      break
    arms = bandit.choosable(lo, min(b, top))
    if arms:
      pairs[b] = arms
  return pairs
