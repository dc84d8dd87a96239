"""Pallas kernels (Hopper+: Mosaic GPU; older GPUs: Triton; CPU: Mosaic GPU interpret mode) with
pure-jnp references. They import nothing of the project outside kernels/ (tests/test_tree.py).
"""


def error_line(e: BaseException) -> str:
  """The first line of an error (its type where it has no text): what a start-up check that
  falls back from a kernel says of why."""
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__
