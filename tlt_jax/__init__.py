"""tlt_jax: TLT-style (Taming the Long Tail) RL training for reasoning LLMs, in JAX."""

__version__ = "0.1.0"
