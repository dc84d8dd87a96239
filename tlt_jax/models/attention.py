"""Attention for the model's forward: over a KV cache (`attend`, the rollout), causal over a
chunk (`causal_attention`: prefill), and causal within packed segments (`packed_attention`:
the learner's and the drafter's packed rows, several sequences laid end to end in one row).

Which implementation runs is `ModelConfig.attention` ("auto" unless a user pins it), decided
at trace time by `packed_impl` / `causal_attention`:
- on a GPU in bf16/fp16, packed segments go through our Pallas (Triton) flash attention
  (tlt_jax/kernels/flash_attention.py): each query block visits only the key blocks from its
  segments' first tokens to the diagonal (and each key block, in the backward, only the
  query blocks its segments reach), the mask applied per score; the [T, T] scores never
  exist in memory, grouped-query heads share their key reads, and the backward is fused too.
  A causal kernel over whole rows (cuDNN's `jax.nn.dot_product_attention`, which also has no
  segment ids; JAX's Pallas `mha`, deprecated for tokamax) computes every block below the
  diagonal: a row of eight 2k-token responses, 8x the scores its segments use. Unpacked
  causal chunks use cuDNN through `jax.nn.dot_product_attention`.
- everywhere else XLA's reference: the [T, T] scores formed and masked (float32 softmax).
- attention="fused" forces the Pallas kernel on any backend: off a GPU it runs in Pallas
  interpret mode (slow; for parity tests on a CPU). "xla" forces the reference.
- "auto" on a GPU compiles and runs the kernel once per shape of heads first (forward and
  backward on one small row against the reference, `_fused_check`): a JAX or Triton release
  the kernel does not compile under, or miscompiles, falls back to the reference with the
  error in the reason a run logs, instead of ending the run at its first update or training
  on wrong gradients.

Under a learner mesh of several devices the kernel runs per shard (`jax.shard_map` over the
batch axes, heads over "tensor" where they are split): a custom call left to the SPMD
partitioner would be gathered onto every device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tlt_jax.kernels import error_line, flash_attention
from tlt_jax.kernels.paged_attention import paged_attention
from tlt_jax.models.config import ModelConfig

_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention. q [B, T, N, H], k/v [B, S, K, H], mask [B|1, T, S] -> [B, T, N, H].

  Each kv head's G x T queries are one matrix ([B, K, G*T, H], kv heads before positions), so
  both products are plain batched matmuls over (B, K): with the queries as [B, T, K, G, H],
  XLA:CPU transposed and copied the scores and their gradient around each product (the
  learner's attention backward 1.2-1.5x slower at 64-512 tokens a row)."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  qg = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
  scores = jnp.einsum("BKQH,BKSH->BKQS", qg, kt, preferred_element_type=jnp.float32)
  scores = (scores / math.sqrt(h)).reshape(b, kv_heads, g, t, -1)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv_heads, g * t, -1)
  out = jnp.einsum("BKQS,BKSH->BKQH", probs, vt).reshape(b, kv_heads, g, t, h)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def causal_mask(t: int) -> jax.Array:
  return jnp.tril(jnp.ones((1, t, t), jnp.bool_))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids (0 = padding) -> [B, T, T]: causal within each packed segment."""
  t = segment_ids.shape[1]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & (segment_ids[:, :, None] != 0) & causal_mask(t)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Causal self-attention of a chunk (prefill of an empty cache, an unpacked forward) through
  `jax.nn.dot_product_attention`: cuDNN's fused flash attention on a GPU in bf16/fp16 (no
  [T, T] score matrix in memory), XLA's reference elsewhere (float32 scores, as `attend`).
  jax's implementation=None means XLA today, so the backend is chosen here."""
  impl = "xla"
  if (cfg.attention != "xla" and jax.default_backend() == "gpu"
      and cfg.compute_dtype in _FUSED_DTYPES):
    impl = "cudnn"
  try:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  except (NotImplementedError, ValueError, RuntimeError):  # shape/GPU cuDNN cannot run
    if impl == "xla":
      raise
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def packed_impl(cfg: ModelConfig, t: int) -> tuple[str, str]:
  """(implementation, reason) of `packed_attention` for rows of t tokens: "fused" (the Pallas
  flash attention, interpreted off a GPU) or "xla" (the reference); the reason is the one line
  a run logs (the learner at start-up)."""
  fits = t % 16 == 0  # rows of whole 16-token blocks, the kernel's smallest
  backend = jax.default_backend()
  if cfg.attention == "xla":
    return "xla", "XLA's reference attention (model.attention='xla')"
  if cfg.attention == "fused":
    if not fits:
      raise ValueError(f"model.attention='fused' needs rows of a multiple of 16 tokens, got "
                       f"{t}: set grpo.pad_multiple to a multiple of 16")
    mode = "" if backend == "gpu" else f" in interpret mode (on {backend}: slow, for tests)"
    return "fused", f"Pallas flash attention (model.attention='fused'){mode}"
  if backend != "gpu":
    return "xla", (f"XLA's reference attention: no fused kernel for packed segments on "
                   f"{backend} ([T, T] scores, masked)")
  if cfg.compute_dtype not in _FUSED_DTYPES:
    return "xla", (f"XLA's reference attention: the fused kernel runs in bf16/fp16, the model "
                   f"computes in {cfg.dtype}")
  if not fits:
    return "xla", (f"XLA's reference attention: rows of {t} tokens are no multiple of 16 "
                   "(grpo.pad_multiple)")
  failed = _fused_check(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_,
                        jnp.dtype(cfg.compute_dtype).name)
  if failed:
    return "xla", f"XLA's reference attention: the fused kernel {failed}"
  return "fused", ("Pallas (Triton) flash attention: causal within packed segments, only "
                   "the blocks each segment reaches, no [T, T] scores")


@functools.cache
def _fused_check(heads: int, kv_heads: int, head_dim: int, dtype: str) -> str | None:
  """None if the kernel's forward and backward compile on this backend and agree with XLA's
  reference, else why not (one line). One row of 256 tokens, two segments and padding: the
  code is the blocks', the grid only repeats it. A JAX or Triton release that miscompiles the
  kernel is caught here, not by a run whose updates are silently wrong. Its inputs are numpy
  arrays, the executables' own calls run them: a trace may be what asked (the drafter's
  step), and a jnp op there would be staged into it."""
  import numpy as np
  rng = np.random.default_rng(0)
  t = 256
  seg = np.array([[1] * 100 + [2] * 120 + [0] * 36], np.int32)
  q = rng.normal(size=(1, t, heads, head_dim))
  k, v = (rng.normal(size=(1, t, kv_heads, head_dim)) for _ in range(2))
  w = (rng.normal(size=q.shape) * (seg > 0)[..., None, None]).astype(np.float32)
  args = [np.asarray(x, jnp.dtype(dtype)) for x in (q, k, v)] + [seg, w]

  def fwd_bwd(attn):
    def f(q, k, v, s, w):
      out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, s).astype(jnp.float32), q, k, v)
      return (out,) + pull(w)
    return jax.jit(f).lower(*args).compile()
  f32 = lambda x: x.astype(jnp.float32)
  try:
    got = fwd_bwd(flash_attention.packed_flash_attention)(*args)
  except Exception as e:  # noqa: BLE001 - any failure means: do not use it here
    return f"does not compile here ({error_line(e)})"
  want = fwd_bwd(lambda q, k, v, s: attend(f32(q), f32(k), f32(v), segment_causal_mask(s)))(*args)
  valid = (seg > 0)[..., None, None]
  err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)) * m)
                  / (np.max(np.abs(np.asarray(b, np.float32)) * m) + 1e-6))
            for a, b, m in zip(got, want, (valid, 1, 1, 1)))
  if not err < 0.02:  # bf16 rounding: ~0.5% (7B-70B heads, CPU); a miscompile is far off or NaN
    return f"disagrees with XLA's reference here (max relative difference {err:.2g})"
  return None


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     cfg: ModelConfig) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H], segment_ids [B, T] (0 = padding) -> [B, T, N, H]:
  each token attends to the earlier tokens of its own segment only. Padding tokens' outputs
  are unspecified (finite): nothing reads them."""
  impl, _ = packed_impl(cfg, q.shape[1])
  if impl == "xla":
    return attend(q, k, v, segment_causal_mask(segment_ids))
  interpret = jax.default_backend() != "gpu"
  kernel = functools.partial(flash_attention.packed_flash_attention, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q, k, v, segment_ids)
  batch = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1)
  qs = P(batch or None, None, _head_axis(mesh, k.shape[2]), None)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(qs, qs, qs, P(batch or None, None)),
                       out_specs=qs, check_vma=False)(q, k, v, segment_ids)


def _head_axis(mesh, kv_heads: int) -> str | None:
  """The mesh axis a kernel's heads are split over per shard: "tensor" where it splits them,
  None where each shard holds every head (no tensor axis, or fewer kv heads than it has
  devices: the weights' and the cache's shardings drop it then too, sharding.fit_spec)."""
  t = mesh.shape.get("tensor", 1) if "tensor" in mesh.axis_names else 1
  return "tensor" if t > 1 and kv_heads % t == 0 else None


def paged_cache_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                          lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                          chunk_mask: jax.Array | None) -> jax.Array:
  """`kernels.paged_attention.paged_attention` (a rollout forward over a paged cache, the
  rows' live pages read in place) under the mesh being traced for: on a replica whose kv
  heads are split over "tensor" it runs per device on that device's heads (`jax.shard_map`;
  the queries' heads of a kv head are consecutive, so a device's query heads are its kv
  heads' groups): no collective, as tensor-parallel attention needs none. A custom call
  (the Pallas kernel on a GPU) left to the SPMD partitioner would be gathered onto every
  device. Rows, page tables and the chunk's mask are whole on every device."""
  mesh = jax.sharding.get_abstract_mesh()
  heads = None if mesh.empty else _head_axis(mesh, k_pool.shape[2])
  if heads is None:
    return paged_attention(q, k_pool, v_pool, table, lengths, k_new, v_new, chunk_mask)
  hs = P(None, None, heads, None)
  mask = causal_mask(q.shape[1]) if chunk_mask is None else chunk_mask  # (None: causal)
  return jax.shard_map(paged_attention, mesh=mesh, in_specs=(hs, hs, hs, P(), P(), hs, hs, P()),
                       out_specs=hs, check_vma=False)(q, k_pool, v_pool, table, lengths, k_new,
                                                      v_new, mask)
