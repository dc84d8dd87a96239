"""Named device mesh and partition rules: the one place a Mesh is built (`make_mesh`).

Axes: `data` (pure data parallel: replicas), `fsdp` (data parallel whose params/optimizer
state are sharded: ZeRO-3 style), `tensor` (Megatron-style model parallel inside a layer).
Params are sharded by regex rules on their path; an axis that does not divide a dimension is
dropped for that dimension (e.g. 2 KV heads on a tensor axis of 4), so every config works on
every mesh, with the fallback logged once rather than failing deep inside XLA.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # activations' batch dimension is split over both data axes

# First match wins. Param layout: tlt_jax/models/transformer.py docstring.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"embed$", P("tensor", "fsdp")),
    (r"lm_head$", P("fsdp", "tensor")),
    (r"layers/(q|k|v)$", P(None, "fsdp", "tensor", None)),
    (r"layers/(q|k|v)_bias$", P(None, "tensor", None)),
    (r"layers/o$", P(None, "tensor", None, "fsdp")),
    (r"layers/(gate|up)$", P(None, "fsdp", "tensor")),
    (r"layers/qkv$", P(None, "fsdp", "tensor", None, None)),  # fused [L, D, K, G + 2, H]
    (r"layers/qkv_bias$", P(None, "tensor", None, None)),
    (r"layers/gate_up$", P(None, "fsdp", None, "tensor")),  # fused [L, D, 2, F]
    (r"layers/down$", P(None, "tensor", "fsdp")),
    # experts (models/moe.py): [L, E, D, F] / [L, E, F, D], the experts over fsdp (each
    # device stores E / n of them whole), their width over tensor as a dense MLP's
    (r"layers/expert_(gate|up)$", P(None, "fsdp", None, "tensor")),
    (r"layers/expert_down$", P(None, "fsdp", "tensor", None)),
    (r"layers/router$", P(None, "fsdp", None)),  # [L, D, E]
    (r"fc$", P("fsdp", "tensor")),  # drafter input projection [2D, D]
    # LoRA adapters (models/lora.py): a [L, *in, r], b [L, r, *out], over their first in /
    # out dim (small: what matters is that their Adam moments are not replicated)
    (r"layers/\w+/a$", P(None, "fsdp")),
    (r"layers/\w+/b$", P(None, None, "fsdp")),
    (r".*", P()),  # norms, o_bias, scalars: replicated
)

_log = logging.getLogger(__name__)


def mesh_sizes(shape: dict[str, int] | Sequence[int], num_devices: int) -> dict[str, int]:
  """Every axis's size for a mesh of `num_devices`: shape maps axis -> size (a sequence is
  in AXES order; a missing axis is 1); -1 (one axis at most) takes the remaining devices.
  The product is not checked: memory plans a mesh for devices this machine lacks."""
  if not isinstance(shape, dict):
    shape = dict(zip(AXES, shape))
  unknown = set(shape) - set(AXES)
  if unknown:
    raise ValueError(f"mesh axes {sorted(unknown)} are unknown; use {AXES}")
  sizes = [int(shape.get(a, 1)) for a in AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
  if -1 in sizes:
    rest = int(np.prod([s for s in sizes if s != -1]))
    if num_devices % rest:
      raise ValueError(f"mesh shape {shape} does not divide {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // rest
  return dict(zip(AXES, sizes))


def make_mesh(shape: dict[str, int] | Sequence[int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh over `devices` (default: all), in their order. shape: see mesh_sizes. Default:
  everything on `fsdp`."""
  devices = list(devices if devices is not None else jax.devices())
  if shape is None:
    shape = {"data": 1, "fsdp": -1, "tensor": 1}
  sizes = list(mesh_sizes(shape, len(devices)).values())
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh shape {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, "
                     f"but {len(devices)} are available; fix config.mesh so the product matches "
                     "(or use -1 on one axis)")
  return Mesh(np.asarray(devices).reshape(sizes), AXES)


def _path_str(path) -> str:
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh, name: str = "") -> P:
  """Drops mesh axes that do not divide their dimension (logged), pads spec to rank."""
  out = []
  entries = list(spec) + [None] * (len(shape) - len(spec))
  for dim, entry in zip(shape, entries[:len(shape)]):
    if entry is None:
      out.append(None)
      continue
    axes = entry if isinstance(entry, tuple) else (entry,)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    if dim % size:
      _log.info("sharding: %s dim %d not divisible by %s=%d; replicating that dim",
                name, dim, entry, size)
      out.append(None)
    else:
      out.append(entry)
  return P(*out)


_LAYER_INDEX = re.compile(r"layers/\d+/")


def spec_for(name: str, shape: Sequence[int], mesh: Mesh,
             rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
  """The first matching rule's spec. Unstacked layers (`layers/3/q`, the rollout layout of
  models.unstack_layers) take the stacked rule without its layer axis."""
  unstacked = _LAYER_INDEX.search(name) is not None
  key = _LAYER_INDEX.sub("layers/", name) if unstacked else name
  for pattern, spec in rules:
    if re.search(pattern, key):
      if unstacked and key != name and pattern.startswith("layers/"):
        spec = P(*tuple(spec)[1:])
      return fit_spec(spec, shape, mesh, name)
  return P()


def tree_shardings(tree: Any, mesh: Mesh,
                   rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """NamedSharding per leaf of a pytree of arrays / ShapeDtypeStructs, from path regex rules."""
  def one(path, leaf):
    return NamedSharding(mesh, spec_for(_path_str(path), np.shape(leaf), mesh, rules))
  return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, rank: int, batch_axis: int = 0) -> NamedSharding:
  """Activations / token batches: split the batch dimension over (data, fsdp)."""
  spec = [None] * rank
  spec[batch_axis] = BATCH
  return NamedSharding(mesh, P(*spec))


def cache_sharding(mesh: Mesh, batch_size: int, num_kv_heads: int, num_layers: int) -> Any:
  """A paged KVCache: page pools (num_layers x [P, page, K, H]) with kv heads over tensor (every
  device of a replica holds every page, a slice of its heads); page tables [B, R] and
  lengths [B] with the batch over data axes."""
  from tlt_jax.models.kv_cache import KVCache  # local: keep this module model-agnostic
  kv = NamedSharding(mesh, fit_spec(P(None, None, "tensor", None), (1, 1, num_kv_heads, 1),
                                    mesh, "kv_cache"))
  table = NamedSharding(mesh, fit_spec(P(BATCH, None), (batch_size, 1), mesh, "table"))
  lengths = NamedSharding(mesh, fit_spec(P(BATCH), (batch_size,), mesh, "lengths"))
  return KVCache(k=(kv,) * num_layers, v=(kv,) * num_layers, table=table, lengths=lengths)


def local_view(tree: Any, shardings: Any) -> Any:
  """The arrays of `tree` as arrays of `shardings` without a copy, where every device of a
  target sharding already holds exactly the slice that sharding gives it (e.g. one replica's
  rows of the global rollout layout); None if any leaf does not."""
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for x, sh in zip(leaves, jax.tree.leaves(shardings)):
    if not isinstance(x, jax.Array):
      return None
    have = {s.device: s for s in x.addressable_shards}
    want = sh.addressable_devices_indices_map(x.shape)
    if any(d not in have or have[d].index != idx for d, idx in want.items()):
      return None
    out.append(jax.make_array_from_single_device_arrays(x.shape, sh,
                                                        [have[d].data for d in want]))
  return jax.tree.unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
