"""The rollout replicas' weight layouts, made from the learner's (stacked layers, separate
projections) and run through the same `forward`.

Rollout replicas hold their layers unstacked (`unstack_layers`: `layers` a tuple of per-layer
dicts, each leaf without the L axis): XLA on CPU copies a layer's slice out of a stacked
[L, ...] weight before every use, which costs a decode step about as much as the step itself
in the weight-bandwidth-bound regime (1.9x per token for a 189M model at batch 1, measured;
scripts/make_bench_model.py). Both layouts run through the same functions.

On GPUs the replicas also fuse q/k/v into one `qkv` and gate/up into one `gate_up` matmul a
layer (`fuse_projections`, rollout EngineConfig.fused_projections): the same bytes in fewer,
larger kernels (2% at batch 1, 5% at batch 8 on one H200, docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.lora import merge_layer

Params = dict[str, Any]


def unstack_layers(params: Params) -> Params:
  """The rollout layout: `layers` as a tuple of per-layer dicts (see the module docstring).
  Under jit every layer's leaves are buffers of their own."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers)
                                    for i in range(n))}


def fuse_projections(params: Params, cfg: ModelConfig) -> Params:
  """Each layer's q/k/v as one `qkv` [D, K, G + 2, H] (kv head j's G query heads, then its key
  and value head; biases likewise [K, G + 2, H]) and gate/up as one `gate_up` [D, 2, F]: two
  matmuls a layer instead of five, the same weights (a step reads the same bytes in fewer,
  larger kernels). Grouping by kv head keeps a tensor-parallel split on K whole heads, as the
  separate q/k/v are split. Stacked or unstacked layers; `_layer` takes either layout, with
  the same results as the separate projections up to the matmuls' summation order."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return {**params, "layers": tuple(_fuse_layer(lp, cfg) for lp in layers)}
  return {**params, "layers": _fuse_layer(layers, cfg)}


def _fuse_layer(lp: Params, cfg: ModelConfig) -> Params:
  if "qkv" in lp or "q" not in lp:
    return lp
  n, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_
  lp = dict(lp)
  q, k, v = lp.pop("q"), lp.pop("k"), lp.pop("v")
  lead = q.shape[:-2]  # (L?, D)
  q = q.reshape(lead + (kh, n // kh, hd))
  lp["qkv"] = jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)
  if "q_bias" in lp:
    qb, kb, vb = lp.pop("q_bias"), lp.pop("k_bias"), lp.pop("v_bias")
    qb = qb.reshape(qb.shape[:-2] + (kh, n // kh, hd))
    lp["qkv_bias"] = jnp.concatenate([qb, kb[..., None, :], vb[..., None, :]], axis=-2)
  if "gate" in lp:  # (experts keep their own layout: models/moe.py)
    lp["gate_up"] = jnp.stack([lp.pop("gate"), lp.pop("up")], axis=-2)
  return lp


def replica_layout(params: Params, cfg: ModelConfig, fused: bool, dtype: Any = None) -> Params:
  """The rollout replicas' layout: layers unstacked (`unstack_layers`), LoRA adapters attached
  to them merged into their weights (lora.merge_layer), cast to `dtype` (None: as they are),
  and with `fused` the projections fused (`fuse_projections`).

  Under jit (the weight sync's program) the layers are made one after another: each layer's
  inputs pass an optimization barrier with the previous layer's outputs, so the program's
  working memory (the merge's float32 products; the learner's shards gathered) is a layer's
  or two, not a share of the model that grows with its depth (XLA otherwise starts every
  layer's products first: half a 16-layer model in float32 on this CPU)."""
  cast = (lambda t: t) if dtype is None else (
      lambda t: jax.tree.map(lambda x: x.astype(dtype), t))
  stacked = params["layers"]
  unstacked = isinstance(stacked, (tuple, list))
  n = len(stacked) if unstacked else jax.tree.leaves(stacked)[0].shape[0]
  layers: list[Params] = []
  for i in range(n):
    source = stacked
    if layers:  # (the layer's slices are taken after the barrier: else all are taken first)
      source, _ = jax.lax.optimization_barrier((stacked, layers[-1]))
    lp = source[i] if unstacked else jax.tree.map(lambda a, i=i: a[i], source)
    lp = cast(merge_layer(lp))
    layers.append(_fuse_layer(lp, cfg) if fused else lp)
  rest = cast({k: v for k, v in params.items() if k != "layers"})
  return {**rest, "layers": tuple(layers)}
