"""Pure-functional Qwen2/Qwen3/Llama models: config, params, forward, KV cache, HF checkpoint
I/O."""

from tlt_jax.models.config import ModelConfig, RopeScaling, num_params
from tlt_jax.models.transformer import (KVCache, ModelOutput, Params, abstract_params,
                                        causal_mask, compute_logits, forward, fuse_projections,
                                        init_cache,
                                        init_params, init_pools, pages_for, param_shapes,
                                        replica_layout,
                                        segment_causal_mask, unstack_layers)

__all__ = [
    "ModelConfig", "RopeScaling", "num_params", "KVCache", "ModelOutput", "Params",
    "abstract_params", "causal_mask", "compute_logits", "forward", "fuse_projections",
    "init_cache", "init_pools",
    "init_params", "pages_for", "param_shapes", "replica_layout", "segment_causal_mask",
    "unstack_layers",
]
