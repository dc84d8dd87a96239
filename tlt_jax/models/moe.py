"""The mixture-of-experts MLP of Qwen3-MoE: a softmax router picks `experts_per_token` (k) of
`num_experts` (E) SiLU MLPs per token, and the token's output is their outputs weighted by the
router's probabilities (renormalised over the k with `norm_topk_prob`), as transformers'
`Qwen3MoeSparseMoeBlock` computes it.

A layer's params (models/transformer.py's layout, L layers, D hidden, F moe_intermediate_size):
  router [L, D, E]   expert_gate, expert_up [L, E, D, F]   expert_down [L, E, F, D]

On a GPU every forward's experts run as a grouped matmul, our Pallas kernel
(kernels/grouped_matmul.py): the (token, expert) pairs grouped by expert in whole tiles of
rows (16 for a rollout step's few pairs, 64 for a learner's many), each tile times its
expert's weights read in place, forward and backward; so a decode step of one token reads
its k experts, a step's tokens the distinct experts they route to (`experts_read`, what the
cost model prices), and the learner computes k experts a token. Tokens whose outputs are
not used (`moe_mlp`'s live mask: a batch's empty and finished rows, a prompt's or a packed
row's padding) route to no expert, so a batch kept at 256 rows for a tail of 10 reads what
the 10 route to. A run checks it at start-up
against XLA's form at the model's shapes (`grouped_impl`, `cfg.experts`); under a mesh of
several devices it runs per shard (`jax.shard_map`: the tokens over the data axes, the
experts' width over "tensor", the down projection's partial sums added over it).

Elsewhere (a CPU), or where the check fails, XLA computes the same sums one of three ways by
the step's size:
- few pairs (R tokens x k <= E): each pair's expert weights gathered ([R, k, D, F]: a copy
  of the k experts a token uses) and applied;
- up to `DENSE_TOKENS` tokens: every expert applied to every token and the outputs weighted
  by the router's (zero off a token's k): every expert read once, in two plain matmuls, E / k
  times the pairs' FLOPs;
- more: the pairs sorted by expert and `jax.lax.ragged_dot`, which XLA:CPU lowers densely
  (each pair masked into every expert's product: E x its FLOPs, measured by
  tests/test_plan_cost.py) and XLA:GPU, as of JAX 0.12, to zero-padded operands unless its
  cuDNN fusion applies (38 GB a matmul at a 9k-token micro-batch of Qwen3-30B-A3B).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tlt_jax.kernels import grouped_matmul as gm
from tlt_jax.models.config import ModelConfig


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig, dtype
          ) -> tuple[jax.Array, jax.Array]:
  """x [R, D] -> (weights [R, k] in `dtype`, experts [R, k] int32): the router's logits in the
  compute dtype, softmax in float32, its top k (renormalised to sum to 1 with
  norm_topk_prob), cast back as transformers does."""
  logits = jnp.einsum("RD,DE->RE", x, router.astype(dtype))
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights.astype(dtype), experts.astype(jnp.int32)


def _gathered(x, weights, experts, lp, dtype, live=None):
  """Few tokens: each pair's expert weights gathered ([R, k, D, F]: the bytes of the experts
  used, once per pair; a token not live still gathers, its weights zero: `moe_mlp`)."""
  del live
  g = jnp.einsum("RD,RKDF->RKF", x, lp["expert_gate"][experts].astype(dtype))
  u = jnp.einsum("RD,RKDF->RKF", x, lp["expert_up"][experts].astype(dtype))
  y = jnp.einsum("RKF,RKFD->RKD", jax.nn.silu(g) * u, lp["expert_down"][experts].astype(dtype))
  return jnp.einsum("RKD,RK->RD", y, weights)


def _dense(x, weights, experts, lp, dtype, live=None):
  """Up to DENSE_TOKENS tokens: every expert on every token ([R, E, F]), the outputs weighted
  by the router's weights scattered over the E experts (zero off a token's k, and for a
  token not live: `moe_mlp`) and summed by one matmul over (E, F)."""
  del live
  e = lp["expert_gate"].shape[0]
  g = jnp.einsum("RD,EDF->REF", x, lp["expert_gate"].astype(dtype))
  u = jnp.einsum("RD,EDF->REF", x, lp["expert_up"].astype(dtype))
  dense = jnp.einsum("RK,RKE->RE", weights, jax.nn.one_hot(experts, e, dtype=dtype))
  h = jax.nn.silu(g) * u * dense[:, :, None]
  return jnp.einsum("REF,EFD->RD", h, lp["expert_down"].astype(dtype))


def _grouped(x, weights, experts, lp, dtype, live=None):
  """Many tokens in XLA: the pairs sorted by expert, each expert's group through its MLP
  (`ragged_dot`), weighted, and summed back per token; pairs not live sorted past every
  group (ragged_dot leaves rows past its groups zero)."""
  r, k = experts.shape
  e = lp["expert_gate"].shape[0]
  flat = experts.reshape(r * k)
  if live is not None:
    flat = jnp.where(jnp.repeat(live, k), flat, e)
  order = jnp.argsort(flat, stable=True)  # [R k] pairs grouped by expert
  token = order // k
  sizes = jnp.bincount(flat, length=e + 1)[:e].astype(jnp.int32)  # [E]
  xs = x[token]  # [R k, D]
  g = jax.lax.ragged_dot(xs, lp["expert_gate"].astype(dtype), sizes)
  u = jax.lax.ragged_dot(xs, lp["expert_up"].astype(dtype), sizes)
  y = jax.lax.ragged_dot(jax.nn.silu(g) * u, lp["expert_down"].astype(dtype), sizes)
  y = y * weights.reshape(r * k)[order][:, None]
  return jnp.zeros((r, x.shape[-1]), y.dtype).at[token].add(y)


def _kernel_local(x, weights, experts, live, wg, wu, wd, *, tensor: str | None):
  """The grouped matmul on one shard: its live tokens' pairs tiled by expert (`gm.layout`,
  tiles of `gm.tile_rows`), the gate and up products, SiLU, the down product, each pair's
  output weighted and its token's k summed (the pairs are in token order; a pair not live
  gets zeros); with the width split over `tensor`, the down product's partial sums added
  over it."""
  r, k = experts.shape
  bm = gm.tile_rows(r * k, wg.shape[0])
  lay = gm.layout(experts.reshape(r * k), wg.shape[0], bm, jnp.repeat(live, k))
  xs = jnp.zeros((lay.rows, x.shape[-1]), x.dtype).at[lay.dest].set(
      jnp.repeat(x, k, axis=0), mode="drop")
  mm = functools.partial(gm.gmm, tile_group=lay.tile_group, first_tile=lay.first_tile,
                         tiles=lay.tiles, bm=bm)
  h = jax.nn.silu(mm(xs, wg)) * mm(xs, wu)  # (the padding rows: zeros throughout)
  y = mm(h, wd).at[lay.dest].get(mode="fill", fill_value=0) * weights.reshape(r * k, 1)
  y = y.reshape(r, k, -1).sum(axis=1)
  return jax.lax.psum(y, tensor) if tensor else y


def _grouped_kernel(x, weights, experts, lp, dtype, live=None):
  """`_kernel_local` on the whole batch, or per shard under a mesh of several devices (the
  module docstring): a custom call left to the SPMD partitioner would be gathered onto every
  device."""
  wg, wu, wd = (lp[n].astype(dtype) for n in ("expert_gate", "expert_up", "expert_down"))
  live = jnp.ones(x.shape[:1], jnp.bool_) if live is None else live
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _kernel_local(x, weights, experts, live, wg, wu, wd, tensor=None)
  batch = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1)
  if batch and x.shape[0] % math.prod(mesh.shape[a] for a in batch):
    batch = ()  # (tokens that do not split evenly: every shard computes them all)
  t = mesh.shape.get("tensor", 1) if "tensor" in mesh.axis_names else 1
  tensor = "tensor" if t > 1 and wg.shape[-1] % t == 0 else None
  rows = P(batch or None, None)
  return jax.shard_map(functools.partial(_kernel_local, tensor=tensor), mesh=mesh,
                       in_specs=(rows, rows, rows, P(batch or None), P(None, None, tensor),
                                 P(None, None, tensor), P(None, tensor, None)),
                       out_specs=rows, check_vma=False)(x, weights, experts, live, wg, wu, wd)


def grouped_impl(cfg: ModelConfig) -> tuple[str, str]:
  """(implementation, reason) of the experts: "kernel" (kernels/grouped_matmul.py, every
  step; interpreted off a GPU) or "xla" (`path`'s ways); the reason is the line a run logs."""
  if cfg.experts == "xla":
    return "xla", "XLA's gathers, dense products and ragged_dot (model.experts='xla')"
  if cfg.experts == "kernel":
    mode = "" if jax.default_backend() == "gpu" else " in interpret mode (slow, for tests)"
    return "kernel", f"the Pallas grouped matmul (model.experts='kernel'){mode}"
  if jax.default_backend() != "gpu":
    return "xla", (f"XLA's gathers, dense products and ragged_dot: no grouped-matmul kernel "
                   f"on {jax.default_backend()}")
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  dtype = jnp.dtype(cfg.compute_dtype).name
  failed = (gm.kernel_limits(d, f) or gm.kernel_check(d, f, cfg.num_experts, dtype)
            or gm.kernel_check(f, d, cfg.num_experts, dtype))
  if failed:
    return "xla", (f"XLA's gathers, dense products and ragged_dot: the grouped-matmul kernel "
                   f"{failed}")
  return "kernel", ("the Pallas (Triton) grouped matmul: each tile of rows one expert's, its "
                    "weights read in place")


def experts_read(cfg: ModelConfig, tokens: int) -> float:
  """The distinct experts `tokens` tokens route to in a layer, in expectation with each
  token's k of E experts drawn independently and uniformly: E (1 - (1 - k / E)^tokens). One
  token reads k; a verification of 5 tokens of one row of Qwen3-30B-A3B (k 8 of 128) ~35:
  so the bytes an MoE forward reads grow with its tokens, where a dense model's stay flat
  (the cost model's price, plan/cost.py; docs/scale.md)."""
  e, k = cfg.num_experts, cfg.experts_per_token
  return e * (1.0 - (1.0 - k / e) ** tokens)


DENSE_TOKENS = 128  # up to this many tokens a step, every expert on every token (`_dense`)


def path(tokens: int, cfg: ModelConfig):
  """Which of XLA's three ways (module docstring) a forward over `tokens` tokens takes."""
  if tokens * cfg.experts_per_token <= cfg.num_experts:
    return _gathered
  return _dense if tokens <= DENSE_TOKENS else _grouped


def moe_mlp(h: jax.Array, lp, cfg: ModelConfig, dtype, live: jax.Array | None = None
            ) -> jax.Array:
  """h [B, T, D] (the layer's post-attention normed stream) -> the experts' output [B, T, D].
  live [B, T] bool (None: every token): tokens whose outputs are used (not an empty batch
  row's, a finished row's, a padding token's); the others route to no expert and get zeros,
  so the kernel reads only the experts live tokens chose (a tail of 10 rows in a batch of
  256 reads experts_read(10), not every expert) and ragged_dot skips them. Each token's
  experts are its own: a live token's output is the same whichever others are live."""
  b, t, d = h.shape
  x = h.reshape(b * t, d)
  weights, experts = route(x, lp["router"], cfg, dtype)
  flat = None
  if live is not None:
    flat = live.reshape(b * t)
    weights = jnp.where(flat[:, None], weights, 0)
  if grouped_impl(cfg)[0] == "kernel":
    y = _grouped_kernel(x, weights, experts, lp, dtype, flat)
  else:
    y = path(b * t, cfg)(x, weights, experts, lp, dtype, flat)
  return y.reshape(b, t, d).astype(h.dtype)
