"""Pure-functional Qwen2/Qwen3/Llama models: config, params, forward (transformer.py), its
attention implementations (attention.py: XLA's reference, cuDNN, Pallas flash attention), the
paged KV cache (kv_cache.py), the rollout replicas' weight layouts (layouts.py), LoRA adapters
(lora.py), HF checkpoint I/O (hf_io.py), a model directory's tokenizer and stop ids
(tokenizer.py). The bottom layer: it imports only the kernels and the
sharding rules (tests/test_tree.py)."""

from tlt_jax.models.config import ModelConfig, RopeScaling, num_params
from tlt_jax.models.kv_cache import KVCache, init_cache, init_pools, pages_for
from tlt_jax.models.layouts import fuse_projections, replica_layout, unstack_layers
from tlt_jax.models.attention import causal_mask, packed_impl, segment_causal_mask
from tlt_jax.models.transformer import (ModelOutput, Params, abstract_params, compute_logits,
                                        forward, init_params, param_shapes, sequence_hidden)

__all__ = [
    "ModelConfig", "RopeScaling", "num_params", "KVCache", "ModelOutput", "Params",
    "abstract_params", "causal_mask", "compute_logits", "forward", "fuse_projections",
    "init_cache", "init_pools", "init_params", "packed_impl", "pages_for", "param_shapes",
    "replica_layout",
    "segment_causal_mask", "sequence_hidden", "unstack_layers",
]
