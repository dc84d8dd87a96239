"""Pure-functional Qwen2 / Qwen3 (dense and mixture-of-experts) / Llama decoder.

Params are a plain nested dict (layout below); `forward` is a pure function of
(params, tokens, positions, cache) and is meant to be called under `jax.jit` with `cfg`
static. Layers are stacked on a leading axis. Without a cache (training, log-probs) they run
under `lax.scan`, so compile time does not grow with depth. With a cache (rollout) the layers
are unrolled over a per-layer cache: a scan would carry the whole [L, ...] cache through the
loop and copy a layer's slice in and out every step, which measured 2.4x slower per decode
token at batch 1 on CPU (scripts/profile_spec.py); unrolled, each layer's k/v buffer is
updated in place.

The rollout replicas' layouts (layers unstacked, projections fused) are in layouts.py, the
paged KV cache a forward reads and writes in kv_cache.py.

Param layout (L layers, D hidden, N query heads, K kv heads, H head dim, F mlp, V vocab):
  embed       [V, D]
  layers/     attn_norm [L, D]   q [L, D, N, H]   k, v [L, D, K, H]   o [L, N, H, D]
              q_bias [L, N, H]   k_bias, v_bias [L, K, H]  (qkv_bias)   o_bias [L, D]  (o_bias)
              q_norm, k_norm [L, H]  (qk_norm: Qwen3's per-head RMSNorm before RoPE)
              mlp_norm [L, D]    gate, up [L, D, F]   down [L, F, D]
              or, with experts (cfg.moe; E experts of width F'): router [L, D, E]
              expert_gate, expert_up [L, E, D, F']   expert_down [L, E, F', D]  (models/moe.py)
  final_norm  [D]
  lm_head     [D, V]   (absent when tie_word_embeddings: the head is embed.T)
LoRA adapters attached for the learner's forward (lora.attach) sit beside their weights as
  layers/<t>_lora = {a [L, *in, r], b [L, r, *out]} (`_proj`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.attention import (attend, causal_attention, packed_attention,
                                     paged_cache_attention)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, cache_addr, gather_window, write_kv
from tlt_jax.models.moe import moe_mlp

Params = dict[str, Any]


class PagedView(NamedTuple):
  """What a layer's paged attention reads besides its pools (cfg.cache_attention="paged"):
  the rows' committed lengths, their page tables and the chunk's mask (None: causal)."""
  lengths: jax.Array  # [B]
  table: jax.Array  # [B, R]
  chunk_mask: jax.Array | None  # [B|1, T, T]


class ModelOutput(NamedTuple):
  logits: jax.Array | None  # [B, T, V] float32 (None when return_logits=False)
  hidden: jax.Array  # [B, T, D] last-layer hidden state AFTER the final norm (EAGLE's input)
  cache: KVCache | None


def param_shapes(cfg: ModelConfig) -> Params:
  """The params pytree as shapes: the single source of truth for the layout."""
  L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim_, cfg.intermediate_size, cfg.vocab_size)
  layers = {
      "attn_norm": (L, D), "q": (L, D, N, H), "k": (L, D, K, H), "v": (L, D, K, H),
      "o": (L, N, H, D), "mlp_norm": (L, D),
  }
  if cfg.moe:
    E, Fe = cfg.num_experts, cfg.moe_intermediate_size
    layers.update(router=(L, D, E), expert_gate=(L, E, D, Fe), expert_up=(L, E, D, Fe),
                  expert_down=(L, E, Fe, D))
  else:
    layers.update(gate=(L, D, F), up=(L, D, F), down=(L, F, D))
  if cfg.qkv_bias:
    layers.update(q_bias=(L, N, H), k_bias=(L, K, H), v_bias=(L, K, H))
  if cfg.o_bias:
    layers.update(o_bias=(L, D))
  if cfg.qk_norm:
    layers.update(q_norm=(L, H), k_norm=(L, H))
  shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def abstract_params(cfg: ModelConfig) -> Params:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, cfg.weight_dtype), param_shapes(cfg),
                      is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random init (HF's: N(0, std) weights, unit norms, zero biases)."""
  shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  treedef = jax.tree.structure(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]]
  keys = jax.random.split(rng, len(shapes))
  leaves = []
  for path, shape, key in zip(paths, shapes, keys):
    if "norm" in path:
      leaf = jnp.ones(shape, cfg.weight_dtype)
    elif "bias" in path:
      leaf = jnp.zeros(shape, cfg.weight_dtype)
    else:
      leaf = (std * jax.random.normal(key, shape, jnp.float32)).astype(cfg.weight_dtype)
    leaves.append(leaf)
  return jax.tree.unflatten(treedef, leaves)


# ------------------------------------------------------------------------------- building blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """HF-exact RMSNorm: statistics in float32, scale applied in the input dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """[H/2] inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
  h = cfg.head_dim_
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  rs = cfg.rope_scaling
  if rs is None:
    return inv_freq
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths (low frequencies) are interpolated by `factor`, short ones are kept, and
  # the band between is blended smoothly.
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
  smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
            / (rs.high_freq_factor - rs.low_freq_factor))
  blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, blended, scaled)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, H] (halves duplicated, HF's rotate_half convention)."""
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, heads, H]."""
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)


def _cache_mask(lengths: jax.Array, t: int, s: int, attn_mask: jax.Array | None) -> jax.Array:
  """[B, T, s]: query t sees the committed prefix and the new slots its chunk mask allows,
  over the attention window of the first s cache slots."""
  slots = jnp.arange(s)[None, None, :]
  rel = slots - lengths[:, None, None]  # slot index relative to the first new token
  committed = rel < 0
  in_chunk = (rel >= 0) & (rel < t)
  if attn_mask is None:
    allowed = rel <= jnp.arange(t)[None, :, None]
  else:
    rel_c = jnp.clip(rel, 0, t - 1)
    allowed = jnp.take_along_axis(
        jnp.broadcast_to(attn_mask, (lengths.shape[0], t, t)),
        jnp.broadcast_to(rel_c, (lengths.shape[0], t, s)), axis=2)
  return committed | (in_chunk & allowed)


def _dense(x, w, eq, dtype):
  """x [B, T, ...] times a weight, `eq` over "BT...": B and T merged into one row dimension
  for the einsum. The same products, but XLA:CPU lays the weight gradient's contraction over
  two dims (B and T) out with a copy of the whole transposed [B, T, F] gradient first: over
  rows, a linear layer's backward took half the time, and the default run's learner update
  1.32-1.36x less (docs/training.md); the rest unchanged (an XLA GPU dot takes either)."""
  b, t = x.shape[:2]
  lhs, rest = eq.split(",", 1)
  assert lhs.startswith("BT") and rest.split("->")[1].startswith("BT"), eq
  y = jnp.einsum("R" + lhs[2:] + "," + rest.replace("->BT", "->R"),
                 x.reshape(b * t, *x.shape[2:]), w.astype(dtype))
  return y.reshape(b, t, *y.shape[1:])


def _proj(x, lp, name: str, eq: str, dtype):
  """A projection `_dense(x, lp[name], eq)`, plus its LoRA update where the layer carries one
  (lp[name + "_lora"]: a [*in, r], b [r, *out] already scaled; models/lora.py): (x a) b, two
  narrow matmuls, never the merged weight (the backward then computes no full-weight
  gradient)."""
  y = _dense(x, lp[name], eq, dtype)
  ad = lp.get(name + "_lora")
  if ad is None:
    return y
  lhs, rest = eq.split(",", 1)
  ins, outs = lhs[2:], rest.split("->")[1][2:]
  low = _dense(x, ad["a"], f"BT{ins},{ins}r->BTr", dtype)
  return y + _dense(low, ad["b"], f"BTr,r{outs}->BT{outs}", dtype)


def _layer(cfg: ModelConfig, x, lp, cos, sin, mask, kv, within_chunk: bool = False,
           segment_ids=None, live=None):
  """One decoder layer. kv: None (training: attend within the chunk; segment_ids [B, T]:
  causal within each packed segment, `packed_attention`) or
  (k_pool [P, page, K, H], v_pool, addr: CacheAddr) of this layer -> writes this chunk's k/v
  at `addr` and returns the updated (k_pool, v_pool). mask None: causal within the chunk.
  With a cache, mask [B|1, T, W] spans the attention window: the first W slots of each row
  are read (its window pages gathered; the module docstring's `kv_len`); mask a `PagedView`
  (cfg.cache_attention="paged"): each row's live pages only, whatever the window
  (kernels/paged_attention.py).
  within_chunk: attend to the chunk's own k/v even with a cache (a prefill of an empty cache:
  nothing else is visible, so the [T, S] scores over the whole cache are never formed).
  live [B, T] bool (None: all): the tokens whose outputs are used; an MoE layer routes the
  others to no expert (models/moe.py), a dense layer ignores it."""
  dt = cfg.compute_dtype
  # An EAGLE drafter's layer has no input norm (its input is already a projection): no key.
  h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps) if "attn_norm" in lp else x
  if "qkv" in lp:  # fused (`fuse_projections`): one matmul, split per kv-head group
    qkv = _dense(h, lp["qkv"], "BTD,DKGH->BTKGH", dt)
    if cfg.qkv_bias:
      qkv = qkv + lp["qkv_bias"].astype(dt)
    b_, t_, kh, g2, hd = qkv.shape
    q = qkv[:, :, :, :g2 - 2].reshape(b_, t_, kh * (g2 - 2), hd)
    k, v = qkv[:, :, :, g2 - 2], qkv[:, :, :, g2 - 1]
  else:
    q = _proj(h, lp, "q", "BTD,DNH->BTNH", dt)
    k = _proj(h, lp, "k", "BTD,DKH->BTKH", dt)
    v = _proj(h, lp, "v", "BTD,DKH->BTKH", dt)
    if cfg.qkv_bias:
      q, k, v = (q + lp["q_bias"].astype(dt), k + lp["k_bias"].astype(dt),
                 v + lp["v_bias"].astype(dt))
  if cfg.qk_norm:  # over each head's H features, every head sharing the weight
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  if kv is None:
    k_all, v_all, new_kv = k, v, None
  else:
    k_pool, v_pool, addr = kv
    # Scatter into this layer's pool (in place under donation); NO_PAGE slots drop.
    k_pool, v_pool = write_kv(k_pool, addr, k), write_kv(v_pool, addr, v)
    if within_chunk:
      k_all, v_all = k, v
    elif isinstance(mask, PagedView):  # the live pages only (kernels/paged_attention.py)
      k_new, v_new = (a.astype(k_pool.dtype).astype(dt) for a in (k, v))  # as the pools hold
      attn = paged_cache_attention(q, k_pool, v_pool, mask.table, mask.lengths, k_new, v_new,
                                   mask.chunk_mask)
      mask = k_all = v_all = None
    else:
      w = mask.shape[-1]
      k_all = gather_window(k_pool, addr.window, w).astype(dt)
      v_all = gather_window(v_pool, addr.window, w).astype(dt)
    new_kv = (k_pool, v_pool)
  if k_all is None:
    pass  # attended above (paged)
  elif segment_ids is not None:
    attn = packed_attention(q, k_all, v_all, segment_ids, cfg)
  elif mask is None:
    attn = causal_attention(q, k_all, v_all, cfg)
  else:
    attn = attend(q, k_all, v_all, mask)
  out = _proj(attn, lp, "o", "BTNH,NHD->BTD", dt)
  if cfg.o_bias:
    out = out + lp["o_bias"].astype(dt)
  x = x + out
  h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
  if "router" in lp:  # experts (models/moe.py); a drafter's layer over an MoE target is dense
    return x + moe_mlp(h, lp, cfg, dt, live), new_kv
  if "gate_up" in lp:  # fused: [D, 2, F]
    gu = _dense(h, lp["gate_up"], "BTD,DCF->BTCF", dt)
    gate, up = gu[:, :, 0], gu[:, :, 1]
  else:
    gate = _proj(h, lp, "gate", "BTD,DF->BTF", dt)
    up = _proj(h, lp, "up", "BTD,DF->BTF", dt)
  x = x + _proj(jax.nn.silu(gate) * up, lp, "down", "BTF,FD->BTD", dt)
  return x, new_kv


def embed_tokens(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  return jnp.take(params["embed"], tokens, axis=0).astype(cfg.compute_dtype)


def compute_logits(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
  """LM head on hidden states [..., D] that are already normed (`forward`'s `hidden`, or the
  drafter's output, which the head reads as is) -> float32 logits [..., V]."""
  rows = h.reshape(-1, h.shape[-1])  # one row dimension, as `_dense` (its docstring: why)
  if cfg.tie_word_embeddings:
    logits = jnp.einsum("RD,VD->RV", rows, params["embed"].astype(h.dtype))
  else:
    logits = jnp.einsum("RD,DV->RV", rows, params["lm_head"].astype(h.dtype))
  return logits.reshape(*h.shape[:-1], logits.shape[-1]).astype(jnp.float32)


def decoder_stack(params_layers: Params, x: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
                  cache: KVCache | None = None, attn_mask: jax.Array | None = None,
                  num_layers: int | None = None, prefill: bool = False,
                  kv_len: int | None = None, window_mask: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, live: jax.Array | None = None):
  """Runs the decoder layers over residual stream x [B, T, D]: stacked ([L, ...] leaves) or
  unstacked (a tuple of per-layer dicts, `unstack_layers`). Shared with the drafter, which is
  one layer of the same architecture. prefill: the cache is empty (lengths 0), so the chunk
  attends within itself (causal, or attn_mask) and is written to slots 0..T-1. kv_len: the
  attention window over the cache (None: all of it; see the module docstring; with
  cfg.cache_attention="paged" each row's live pages are read whatever it is). window_mask
  [B|1, T, W] (with a cache; W the window): which window slot each query sees, in place of
  "the committed prefix and the chunk's mask" (the drafter's teacher-forced chains: each
  sees only part of the prefix). segment_ids [B, T] (no cache, no attn_mask): packed rows,
  each token attending to the earlier tokens of its own segment (0 = padding). live [B, T]
  or [B] (a row's every token) bool: the tokens whose outputs the caller uses (`forward`)."""
  b, t, _ = x.shape
  if live is not None:  # ([B]: a row's every token)
    live = jnp.broadcast_to(live[:, None] if live.ndim == 1 else live, (b, t))
  cos, sin = rope_tables(cfg, positions)
  unstacked = isinstance(params_layers, (tuple, list))
  n_layers = num_layers or (len(params_layers) if unstacked
                            else jax.tree.leaves(params_layers)[0].shape[0])

  if cache is None:  # training / log-probs: scanned layers, optionally rematerialised
    if segment_ids is not None and attn_mask is not None:
      raise ValueError("give segment_ids or attn_mask, not both")
    mask = attn_mask  # None: causal (causal_attention), or packed segments
    layer_fn = lambda x, lp: _layer(cfg, x, lp, cos, sin, mask, None, segment_ids=segment_ids,
                                    live=live)
    if cfg.remat:  # "dots": projections' outputs saved, attention scores (batched dots) not
      policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                if cfg.remat_policy == "dots" else None)
      layer_fn = jax.checkpoint(layer_fn, policy=policy)
    if unstacked:  # a replica's full forward (prompt_hidden): layer after layer
      for lp in params_layers[:n_layers]:
        x, _ = layer_fn(x, lp)
      return x, None

    def body(x, lp):
      x, _ = layer_fn(x, lp)
      return x, None

    x, _ = jax.lax.scan(body, x, params_layers)
    return x, None

  if cache.num_layers != n_layers:
    raise ValueError(f"KV cache has {cache.num_layers} layers, the params {n_layers}")
  w = min(kv_len or cache.max_len, cache.max_len)
  if prefill:
    mask = attn_mask
    slots = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  else:
    if window_mask is not None:
      mask = window_mask
    elif cfg.cache_attention == "paged":  # a row none of whose tokens is live reads no page
      lengths = cache.lengths if live is None else jnp.where(live.any(axis=1), cache.lengths, 0)
      mask = PagedView(lengths, cache.table, attn_mask)
    else:
      mask = _cache_mask(cache.lengths, t, w, attn_mask)
    slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
  addr = cache_addr(cache, slots, w)
  ks, vs = [], []
  for i in range(n_layers):  # unrolled: see the module docstring
    lp = params_layers[i] if unstacked else jax.tree.map(lambda a, i=i: a[i], params_layers)
    x, (k_i, v_i) = _layer(cfg, x, lp, cos, sin, mask, (cache.k[i], cache.v[i], addr),
                           within_chunk=prefill, live=live)
    ks.append(k_i)
    vs.append(v_i)
  return x, cache.replace(k=tuple(ks), v=tuple(vs))


def forward(params: Params, tokens: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
            cache: KVCache | None = None, attn_mask: jax.Array | None = None,
            return_logits: bool = True, prefill: bool = False,
            kv_len: int | None = None, segment_ids: jax.Array | None = None,
            live: jax.Array | None = None) -> ModelOutput:
  """tokens, positions [B, T] int32 -> ModelOutput.

  attn_mask [B|1, T, T] bool restricts which tokens of THIS chunk a query sees (causal when
  None): packed-segment masks in training, tree masks when verifying drafts. With a cache,
  the committed prefix (slots < cache.lengths) is always visible. prefill=True: the cache is
  empty (a fresh `init_cache`): attention stays within the chunk. kv_len (static): attention
  reads cache slots [0, kv_len) only; the caller guarantees that every row whose output it
  uses has lengths + T <= kv_len (None: the whole cache). segment_ids [B, T] (no cache):
  packed rows, several sequences end to end, 0 on padding; attention stays within a segment
  (`attention.packed_attention`: a fused kernel where the backend has one) and positions are
  the caller's (each segment's own, from 0).

  live [B, T] or [B] bool (None: every token; with segment_ids, the non-padding ones): the tokens
  whose outputs the caller uses; an empty batch row's, a finished row's or a padding token's
  may be False, and then costs what it can not to: a mixture of experts routes it to no
  expert (models/moe.py: the experts a step reads are its live tokens'), and under paged
  attention a row with no live token reads none of its pages (a finished row kept in a batch
  still holds its length; its pages are already another row's). The caller guarantees that
  no live token attends to a token that is not live (their hidden states are not the
  model's).

  `hidden` is the last hidden state AFTER the final norm, as vLLM's and HF's model forwards
  return it: the state the serving engines' EAGLE drafters read (tlt_jax/drafter/model.py),
  which the LM head alone (`compute_logits`) turns into logits. The norm runs here rather
  than in `compute_logits`: the same ops in the same order, so logits are unchanged.
  """
  if live is None and segment_ids is not None:
    live = segment_ids != 0
  x = embed_tokens(params, tokens, cfg)
  x, cache = decoder_stack(params["layers"], x, positions, cfg=cfg, cache=cache,
                           attn_mask=attn_mask, prefill=prefill, kv_len=kv_len,
                           segment_ids=segment_ids, live=live)
  h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  logits = compute_logits(params, h, cfg) if return_logits else None
  return ModelOutput(logits=logits, hidden=h, cache=cache)


@functools.lru_cache(maxsize=8)
def _hidden_fn(cfg: ModelConfig):
  return jax.jit(lambda p, t, pos: forward(p, t, pos, cfg=cfg, return_logits=False).hidden)


def sequence_hidden(params: Params, seqs, *, cfg: ModelConfig, batch: int, multiple: int
                    ) -> list[jax.Array]:
  """Each token sequence's [len, D] post-norm hidden states (on the device, cfg's compute
  dtype), by causal forwards without a cache of `batch` sequences at a time, padded at the end
  to a multiple of `multiple` tokens (fewer compiles; causal, so padding changes nothing
  before it). For tools over whole sequences (the drafter's offline data, a divergence's
  logits), not for rollouts."""
  out = []
  fwd = _hidden_fn(cfg)
  for i in range(0, len(seqs), batch):
    group = seqs[i:i + batch]
    t = -(-max(len(s) for s in group) // multiple) * multiple
    toks = np.zeros((batch, t), np.int32)
    for j, s in enumerate(group):
      toks[j, :len(s)] = s
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), toks.shape)
    h = fwd(params, jnp.asarray(toks), jnp.asarray(pos))
    out += [h[j, :len(s)] for j, s in enumerate(group)]
  return out
