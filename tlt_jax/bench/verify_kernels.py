"""Verification kernels against XLA: Mosaic GPU vs Triton vs the jnp reference, per shape.

The question it answers (issue #25): where a library or XLA is as fast, delete the custom
kernel. Each cell is the in-loop time of one verification (`spec_costs.per_iter`: N calls in one
jitted fori_loop, the drafts shifted by the carry so nothing is hoisted), f32 log-probs
[B, K+1, V] (V = 151936: Qwen2.5), randomness drawn inside the loop as the engine does.
"reference" is the jnp rule as XLA fuses it; a backend that cannot run a case (Triton where
Pallas has no Triton lowering, Mosaic GPU's chain with draft q, see kernels/verify) or fails
to compile says so in its cell. Off-GPU the kernels run interpreted: the smoke run proves the
table is produced, not its numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.bench.spec_costs import per_iter
from tlt_jax.kernels.verify.mosaic import verify_chain_mosaic, verify_tree_mosaic
from tlt_jax.kernels.verify.reference import (draw_tree_randomness, verify_chain_reference,
                                              verify_tree_reference)
from tlt_jax.kernels.verify.triton import verify_chain_triton, verify_tree_triton

CASES = ("chain greedy", "chain sample one-hot", "chain sample q", "tree greedy",
         "tree sample")


def _rule(case: str, backend: str, interpret: bool):
  """fn(tlp, d, q, kids, u, g) for this case on this backend, or None where it has no kernel."""
  tree = case.startswith("tree")
  if backend == "reference":
    fn = verify_tree_reference if tree else verify_chain_reference
  else:
    if backend == "mosaic_gpu" and case == "chain sample q":
      return None  # mosaic._MOSAIC_NO_Q: the dispatcher runs the reference there
    mosaic, triton = ((verify_tree_mosaic, verify_tree_triton) if tree else
                      (verify_chain_mosaic, verify_chain_triton))
    fn = functools.partial(mosaic if backend == "mosaic_gpu" else triton, interpret=interpret)
  greedy = case.endswith("greedy")
  if tree:
    return lambda tlp, d, q, kids, u, g: fn(tlp, d, kids, None if greedy else u,
                                            None if greedy else g, greedy=greedy,
                                            max_depth=tlp.shape[1] - 1)[1:]
  with_q = case == "chain sample q"
  return lambda tlp, d, q, kids, u, g: fn(tlp, d[:, 1:], q if with_q else None,
                                          None if greedy else u[:, 1:],
                                          None if greedy else g, greedy=greedy)


def time_case(case: str, backend: str, batch: int, k: int, vocab: int, *, iters: int,
              interpret: bool) -> float | str:
  """Seconds per verification, or a short reason why this backend has no number."""
  rule = _rule(case, backend, interpret)
  if rule is None:
    return "n/a"
  rng = np.random.default_rng(0)
  n = k + 1
  tlp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((batch, n, vocab)), jnp.float32))
  q = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((batch, k, vocab)), jnp.float32))
  d0 = jnp.asarray(rng.integers(0, vocab, (batch, n)), jnp.int32)
  kids = jnp.full((batch, n, 2), -1, jnp.int32).at[:, :-1, 0].set(jnp.arange(1, n))
  kids = kids.at[:, 0, 1].set(n - 1)  # the root has two children: a chain and a leaf

  def loop(a, it):  # the inputs are arguments: closed over, XLA constant-folds them (seconds
    acc, tlp, q, d0, kids = a  # per case on a GPU, the first run's kernel bench found)

    def body(i, acc):
      u, g = draw_tree_randomness(jax.random.key(i), batch, n, vocab)
      out = rule(tlp, (d0 + acc[:, None]) % vocab, q, kids, u, g)
      return (acc + out[-2] + out[-1]) % 2
    return jax.lax.fori_loop(0, it, body, acc)

  try:
    return per_iter(loop, (jnp.zeros((batch,), jnp.int32), tlp, q, d0, kids), iters, repeats=3)
  except Exception as e:  # noqa: BLE001 - a backend that does not compile here is a result
    return f"fails: {type(e).__name__}"


def kernel_table(batches, ks, vocab: int, *, iters: int, interpret: bool | None = None,
                 backends=("mosaic_gpu", "triton", "reference")):
  """Markdown table lines (a generator: a time-boxed run keeps the rows it finished): one row
  per (case, B, K), microseconds per verification per backend, and the reference's time over
  the fastest kernel's (> 1: the kernel earns its place)."""
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  lines = [f"### Verification kernels vs XLA ({jax.devices()[0].device_kind}, V={vocab}, f32"
           f"{', interpreted' if interpret else ''})", "",
           "| case | B | K | " + " | ".join(f"{b} us" for b in backends)
           + " | reference / best kernel |", "|" + "---|" * (len(backends) + 4)]
  yield from lines
  for case in CASES:
    for b in batches:
      for k in ks:
        t = {be: time_case(case, be, b, k, vocab, iters=iters, interpret=interpret)
             for be in backends}
        cells = [f"{v * 1e6:.1f}" if isinstance(v, float) else v for v in t.values()]
        kern = [v for be, v in t.items() if be != "reference" and isinstance(v, float)]
        ref = t.get("reference")
        ratio = (f"{ref / min(kern):.2f}x" if kern and isinstance(ref, float) else "-")
        yield f"| {case} | {b} | {k} | " + " | ".join(cells) + f" | {ratio} |"
