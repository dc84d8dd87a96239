"""Pallas kernels (Hopper+: Mosaic GPU; older GPUs: Triton; CPU: Mosaic GPU interpret mode) with
pure-jnp references."""
