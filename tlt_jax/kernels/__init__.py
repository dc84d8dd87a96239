"""Pallas kernels (GPU: Triton lowering; CPU: interpret mode) with pure-jnp references."""

from tlt_jax.kernels.verify import (
    draw_tree_randomness,
    draw_verify_randomness,
    verify_chain,
    verify_chain_triton,
    verify_chain_reference,
    verify_tree,
    verify_tree_triton,
    verify_tree_reference,
)

__all__ = [
    "draw_tree_randomness",
    "draw_verify_randomness",
    "verify_chain",
    "verify_chain_triton",
    "verify_chain_reference",
    "verify_tree",
    "verify_tree_triton",
    "verify_tree_reference",
]
