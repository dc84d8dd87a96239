"""Pallas kernels (Hopper+: Mosaic GPU; older GPUs: Triton; CPU: Mosaic GPU interpret mode) with
pure-jnp references."""

from tlt_jax.kernels.verify import kernel_backend, verify_chain, verify_tree
from tlt_jax.kernels.verify.mosaic import verify_chain_mosaic, verify_tree_mosaic
from tlt_jax.kernels.verify.reference import (
    draw_tree_randomness,
    draw_verify_randomness,
    verify_chain_reference,
    verify_tree_reference,
)
from tlt_jax.kernels.verify.triton import verify_chain_triton, verify_tree_triton

__all__ = [
    "draw_tree_randomness",
    "draw_verify_randomness",
    "kernel_backend",
    "verify_chain",
    "verify_chain_mosaic",
    "verify_chain_reference",
    "verify_chain_triton",
    "verify_tree",
    "verify_tree_mosaic",
    "verify_tree_reference",
    "verify_tree_triton",
]
