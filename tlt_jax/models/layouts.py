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
  n, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_

  def fuse(lp):
    if "qkv" in lp or "q" not in lp:
      return lp
    lp = dict(lp)
    q, k, v = lp.pop("q"), lp.pop("k"), lp.pop("v")
    lead = q.shape[:-2]  # (L?, D)
    q = q.reshape(lead + (kh, n // kh, hd))
    lp["qkv"] = jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)
    if "q_bias" in lp:
      qb, kb, vb = lp.pop("q_bias"), lp.pop("k_bias"), lp.pop("v_bias")
      qb = qb.reshape(qb.shape[:-2] + (kh, n // kh, hd))
      lp["qkv_bias"] = jnp.concatenate([qb, kb[..., None, :], vb[..., None, :]], axis=-2)
    lp["gate_up"] = jnp.stack([lp.pop("gate"), lp.pop("up")], axis=-2)
    return lp

  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return {**params, "layers": tuple(fuse(lp) for lp in layers)}
  return {**params, "layers": fuse(layers)}


def replica_layout(params: Params, cfg: ModelConfig, fused: bool) -> Params:
  """The rollout replicas' layout: layers unstacked (`unstack_layers`), and with `fused` the
  projections fused (`fuse_projections`)."""
  params = unstack_layers(params)
  return fuse_projections(params, cfg) if fused else params
