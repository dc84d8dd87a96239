"""The merge of drafter copies trained apart (one per idle rollout worker) from the same start.

The token-weighted mean of params and of Adam's moments, the largest step count: local SGD /
federated averaging. With equal data per copy it is the mean of the updates, and a copy that
trained on nothing (weight 0) changes nothing. Two ways to compute it, one rule:
`average_states` where every copy is addressable here (one process), `average_replicas` where
each process holds only its own replicas' copies (an on-device reduction over the rollout
mesh). `make_merge` picks one for the coordinator.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.distributed import all_gather_objects
from tlt_jax.drafter.train_step import DrafterState


def average_states(states: Sequence[DrafterState], weights: Sequence[float]) -> DrafterState:
  """The weighted mean of `states` (weights: tokens each trained on): one jitted program (an
  executable per number of copies that trained), or the one copy that trained. States must
  be on the same devices (the caller moves them)."""
  if not states or len(states) != len(weights):
    raise ValueError("average_states: give one weight per state")
  total = float(sum(weights))
  if total <= 0:
    raise ValueError("average_states: the weights sum to 0 (nothing was trained)")
  kept = [(s, float(x) / total) for s, x in zip(states, weights) if x]
  if len(kept) == 1:  # one copy trained: it is the mean
    return kept[0][0]
  w = np.asarray([x for _, x in kept], np.float32)
  return _weighted_mean(tuple(s for s, _ in kept), w)


@jax.jit
def _weighted_mean(states: tuple, w: jax.Array) -> DrafterState:
  def mean(*leaves):
    if jnp.issubdtype(leaves[0].dtype, jnp.integer):  # step counts
      return functools.reduce(jnp.maximum, leaves)
    acc = sum(w[i] * x.astype(jnp.float32) for i, x in enumerate(leaves))
    return acc.astype(leaves[0].dtype)
  return jax.tree.map(mean, *states)


def average_replicas(states: Sequence[DrafterState], weights: Sequence[float],
                     ids: Sequence[int], rollout_mesh: Mesh, shardings: DrafterState
                     ) -> DrafterState | None:
  """The weighted mean of every replica's copy, with several processes: each process passes
  its workers' states, their global replica indices `ids` and the tokens each trained on (0:
  not trained); every process calls this (it runs collectives). The copies become one array
  per leaf stacked over the rollout mesh's replica axis (each replica's slice is its own
  shards, no copy), and one jitted weighted sum onto `shardings` (the store's layout) reduces
  them on the devices. None if no replica trained."""
  pairs = [p for part in all_gather_objects(list(zip(ids, map(float, weights)))) for p in part]
  total = sum(w for _, w in pairs)
  if total <= 0:
    return None
  n = rollout_mesh.shape["data"]
  share = np.zeros((n,), np.float32)
  for i, w in pairs:
    share[i] = w / total
  share = jax.make_array_from_callback((n,), NamedSharding(rollout_mesh, PartitionSpec()),
                                       lambda idx: share[idx])

  def stacked(*copies):  # one leaf of every local copy -> [replicas, ...] over the mesh
    x = copies[0]
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    sharding = NamedSharding(rollout_mesh, PartitionSpec("data", *spec))
    parts = [s.data[None] for c in copies for s in c.addressable_shards]
    return jax.make_array_from_single_device_arrays((n,) + x.shape, sharding, parts)

  def mean(tree, w):
    def one(x):
      if jnp.issubdtype(x.dtype, jnp.integer):  # step counts
        return x.max(axis=0)
      return jnp.tensordot(w, x.astype(jnp.float32), axes=1).astype(x.dtype)
    return jax.tree.map(one, tree)

  return jax.jit(mean, out_shardings=shardings)(jax.tree.map(stacked, *states), share)


def make_merge(shardings: DrafterState, rollout_mesh: Mesh, ids: Sequence[int]
               ) -> Callable[[list, list], DrafterState | None]:
  """The coordinator's `merge(states, weights)`: onto `shardings` (the store's layout), from
  this process's workers (global replica indices `ids`)."""
  if jax.process_count() > 1:
    return functools.partial(average_replicas, ids=list(ids), rollout_mesh=rollout_mesh,
                             shardings=shardings)
  return lambda states, weights: average_states(
      [jax.device_put(s, shardings) for s in states], weights)
