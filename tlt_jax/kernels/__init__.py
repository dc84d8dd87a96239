"""Pallas kernels (Hopper+: Mosaic GPU; older GPUs: Triton; CPU: Mosaic GPU interpret mode) with
pure-jnp references. They import nothing of the project outside kernels/ (tests/test_tree.py).
"""
