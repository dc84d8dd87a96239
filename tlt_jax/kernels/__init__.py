"""Pallas kernels (GPU: Triton lowering; CPU: interpret mode) with pure-jnp references."""

from tlt_jax.kernels.verify import (
    draw_tree_randomness,
    draw_verify_randomness,
    verify_chain,
    verify_chain_pallas,
    verify_chain_reference,
    verify_tree,
    verify_tree_pallas,
    verify_tree_reference,
)

__all__ = [
    "draw_tree_randomness",
    "draw_verify_randomness",
    "verify_chain",
    "verify_chain_pallas",
    "verify_chain_reference",
    "verify_tree",
    "verify_tree_pallas",
    "verify_tree_reference",
]
