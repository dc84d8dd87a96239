"""Lossless speculative verification: a chain rule and a (target-only) tree rule.

Each rule comes as a pure-jnp reference (`*_reference`, vectorised over the batch) and Pallas
kernels (one program per batch row, the vocabulary walked in tiles) on two backends: Mosaic GPU
(`*_mosaic`) and Triton (`*_triton`). The public entry points `verify_chain` / `verify_tree`
(here) pick the reference or the kernel of `kernel_backend()`. All of them take the same arrays
and compute the same float expressions in the same order (the small helpers of `reference`, and
the kernel bodies, are shared), so their integer outputs agree exactly; the tests check this.

One module per job:
* `reference`: the rules (conventions, chain and tree rule) as jnp references, the randomness
  draws, and the float math the kernels share with the references.
* `bodies`: the chain / tree kernel bodies, shared by both backends (the kernel design).
* `mosaic`, `triton`: each backend's tile loops and its `pallas` calls.

Backends (`kernel_backend`, the one place that picks)
----------------------------------------------------
* Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`) on NVIDIA GPUs of compute capability >= 9.0
  (Hopper, Blackwell), and off-GPU in Mosaic GPU's CPU interpret mode (`InterpretGPUParams`:
  it simulates GMEM and the warpgroup), which is what CPU tests and `use_kernel=True` on a CPU
  run, when JAX has the plgpu API they are written against (jax >= 0.11, `mosaic.AVAILABLE`;
  on jax 0.10 the Triton kernels run in their place everywhere). Exception: sampling chain
  verification WITH draft log-probs uses the jnp reference on
  Mosaic GPU (`mosaic._MOSAIC_NO_Q`): its residual needs log1p / expm1, which jax 0.12's Mosaic
  GPU lowering does not have, and a rewrite in exp / log would change the reference's (= the
  default CPU run's) sampled tokens.
* Triton (`jax.experimental.pallas.triton`) only on pre-Hopper GPUs (and GPUs without a CUDA
  compute capability). JAX >= 0.11 deprecates this backend (a DeprecationWarning when a kernel
  is lowered for a GPU); it stays as their fallback while JAX ships it and is never lowered on
  Hopper or off-GPU, so those paths are warning-free. Nothing outside `triton` imports it.
`use_kernel=False` is the jnp reference everywhere (the CPU default of the engine).
scripts/bench_verify.py times both kernels against the reference (XLA-fused) per shape; the
engine's default on a GPU (`use_kernel=None`) takes the kernel only where it measured faster
(`kernel_pays`).

Lowering for a GPU on a machine without one needs an abstract GPU device on JAX >= 0.11 (see
tests/test_verify_kernel.py::test_kernels_lower_to_triton / test_kernels_lower_to_mosaic_gpu);
jax 0.12 lowers Mosaic GPU kernels to their custom call without any CUDA plugin (its bindings
are only needed to compile the module to a cubin, on the GPU).
"""

from __future__ import annotations

import jax

from tlt_jax.kernels.verify import mosaic
from tlt_jax.kernels.verify.mosaic import verify_chain_mosaic, verify_tree_mosaic
from tlt_jax.kernels.verify.reference import verify_chain_reference, verify_tree_reference
from tlt_jax.kernels.verify.triton import verify_chain_triton, verify_tree_triton


def kernel_backend() -> str:
  """Which Pallas backend the verification kernels use on the default device.

  "mosaic_gpu": NVIDIA GPUs of compute capability >= 9.0 (Hopper, Blackwell), and every
  non-GPU device (the Mosaic GPU kernels in Mosaic GPU's CPU interpret mode).
  "triton": older GPUs (and GPUs without a CUDA compute capability): the Pallas Triton backend,
  deprecated since JAX 0.11, kept only as their fallback while JAX ships it; and every device
  on a JAX without the Mosaic GPU API the kernels use (jax 0.10: `mosaic.AVAILABLE`).
  """
  if not mosaic.AVAILABLE:
    return "triton"
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return "mosaic_gpu"
  cc = getattr(dev, "compute_capability", None)
  try:
    hopper = tuple(int(x) for x in str(cc).split(".")[:2]) >= (9, 0)
  except ValueError:
    hopper = False
  return "mosaic_gpu" if hopper else "triton"


# Rows from which the greedy chain kernel beats the XLA-fused reference (scripts/bench_verify.py,
# one H200, jax 0.11.2, V = 151936, K = 4, 2026-11-27: reference / kernel 0.59x at 1 row, 0.94x
# at 8, 2.36x at 64; the first GPU run had 0.79-0.88x at 1 row).
GREEDY_CHAIN_MIN_ROWS = 64


def kernel_pays(*, tree: bool, greedy: bool, rows: int) -> bool:
  """Whether the engine verifies with the Pallas kernel (`use_kernel=None` on a GPU): only
  where it was measured faster than the XLA-fused reference. Greedy chains at
  GREEDY_CHAIN_MIN_ROWS rows and more; sampled chains lost at 1 and 8 rows (0.25-0.39x) and
  trees are unmeasured, so both take the reference. Both paths make the same decisions, so
  the choice changes speed only."""
  return (not tree) and greedy and rows >= GREEDY_CHAIN_MIN_ROWS


def _auto_interpret(interpret):
  if interpret is None:
    return jax.default_backend() != "gpu"
  return bool(interpret)


def verify_chain(target_logp: jax.Array, draft_tokens: jax.Array, draft_logp: jax.Array | None,
                 uniforms: jax.Array | None, noise: jax.Array | None, *, greedy: bool,
                 use_kernel: bool = True, interpret: bool | None = None,
                 block_v: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Chain speculative verification.

  target_logp [B, K+1, V]: processed target log-probs at each draft position (+ bonus position).
  draft_tokens [B, K] int32; draft_logp [B, K, V] draft log-probs or None (one-hot drafts).
  uniforms [B, K], noise [B, K+1, V] (`draw_verify_randomness`); unused (may be None) if greedy.
  Returns (num_accepted [B] int32 in [0, K], next_token [B] int32).
  use_kernel: the Pallas kernel of `kernel_backend()` (interpret=None -> interpret mode unless
  the backend is GPU) or the jnp reference.
  """
  if use_kernel:
    interpret = _auto_interpret(interpret)
    if kernel_backend() == "triton":
      return verify_chain_triton(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                 greedy=greedy, interpret=interpret, block_v=block_v)
    if greedy or draft_logp is None:
      return verify_chain_mosaic(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                 greedy=greedy, interpret=interpret, block_v=block_v)
  return verify_chain_reference(target_logp, draft_tokens, draft_logp, uniforms, noise,
                                greedy=greedy)


def verify_tree(target_logp: jax.Array, tree_tokens: jax.Array, children: jax.Array,
                uniforms: jax.Array | None, noise: jax.Array | None, *, greedy: bool,
                max_depth: int, use_kernel: bool = True, interpret: bool | None = None,
                block_v: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Tree speculative verification (target-only rule, deterministic drafts).

  target_logp [B, T, V]: processed target log-probs at each node (distribution of the token
  after node n; node 0 = root = last committed token). tree_tokens [B, T] int32 (root entry
  unused). children [B, T, C] int32, -1 = none, siblings in draft-score order. max_depth D
  (static) bounds the accepted path; nodes deeper than D are never visited.
  uniforms [B, T], noise [B, T, V] (`draw_tree_randomness`); unused (may be None) if greedy.
  Returns (accepted_path [B, D+1] int32, num_accepted [B] int32, next_token [B] int32).
  """
  if use_kernel:
    kernel = verify_tree_triton if kernel_backend() == "triton" else verify_tree_mosaic
    return kernel(target_logp, tree_tokens, children, uniforms, noise, greedy=greedy,
                  max_depth=max_depth, interpret=_auto_interpret(interpret), block_v=block_v)
  return verify_tree_reference(target_logp, tree_tokens, children, uniforms, noise,
                               greedy=greedy, max_depth=max_depth)
