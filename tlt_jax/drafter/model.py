"""EAGLE-style drafter: params, forward, KV cache, save/load and EAGLE export.

Alignment and normalisation: the serving engines' EAGLE-1/2 convention, so an export drafts in
vLLM / SGLang exactly as it does here. Let f_t be the target's last-layer hidden state AFTER
the final norm after processing token x_t (`forward`'s `hidden`, HF's `last_hidden_state`;
f_t produces the distribution of x_{t+1} through the LM head alone). The drafter's input at
step t is the pair (x_{t+1}, f_t):

    z_t = fc(concat(embed(x_{t+1}), f_t))            fc: Linear(2D -> D, no bias)
    g_t = DecoderLayer_without_input_norm(z_t)        one layer of the target's architecture
    q_t = softmax(target_lm_head(g_t))                NO norm between the layer and the head

g_t is trained to match f_{t+1} (so q_t predicts x_{t+2}). This is what the engines run:
  - vLLM `vllm/model_executor/models/llama_eagle.py`: `LlamaModel.forward` computes
    `fc(cat(embed_tokens(ids), hidden_states))`, the layers (layer 0's `input_layernorm` an
    `nn.Identity`), and returns `hidden_states + residual` with no norm; `EagleLlamaForCausalLM`
    applies the target's LM head to it (`compute_logits`). The `hidden_states` it is fed are
    the target model's output, which vLLM's `LlamaModel.forward` returns after `self.norm`.
  - SGLang `python/sglang/srt/models/{llama,qwen2}_eagle.py`: the same `fc(cat(embeds,
    spec_info.hidden_states))`, `input_layernorm = lambda x: x` for layer 0, `return
    hidden_states + residual`; the head is the target's `lm_head` (`Qwen2ForCausalLMEagle`).
  - The EAGLE reference `eagle/model/ea_model.py` (`EaModel.forward`: `hidden_states =
    outputs[0]` of `base_model.model`, i.e. HF's post-norm `last_hidden_state`, and
    `base_model.lm_head(outputs[0])` for the target's logits) and `eagle/model/cnets1.py`
    (`Model.forward`: fc over `cat((inputs_embeds, hidden_states))`, no final norm;
    `topK_genrate` applies `head` = the target's `lm_head` to the drafter output).
The drafter's output feeds back as the next step's hidden without a norm too (EAGLE's
`topK_genrate` passes `out_hidden` back): g_t lives in the space of post-norm features.

In the rollout engine's convention (`Result.hidden[j]` is the hidden state that PRODUCED
response token j) the pair for response token j is (token_j, hidden[j]). Drafting step k > 1
feeds the drafter's own g back as the hidden and the drafted token as the token. Positions:
the pair (x_{t+1}, f_t) sits at the position of x_t (the token f_t was computed at), as in
SGLang's EAGLE extend; only relative positions matter to RoPE, so any convention that is
consistent between training and drafting gives the same outputs.

Params (trainable, nothing else):
    fc      [2D, D]   (input = concat(embedding, hidden) in THAT order, as in EAGLE)
    layers  the target layer layout of `tlt_jax.models.transformer` with L = 1 and no
            `attn_norm` (q, k, v, o, biases per the target cfg, mlp_norm, gate, up, down):
            `decoder_stack` skips the input norm of a layer without that key.
The embedding and LM head are the TARGET's arrays (the drafter never reads its final norm),
passed in as `target_params`
at every call; they are never copied into drafter params, the drafter optimizer or its
checkpoints (an RL update of the target is seen by the drafter at once).

Files
  save_drafter(dir)  ->  dir/drafter.safetensors (our layout, keys "fc", "layers.q", ...)
                         dir/drafter_config.json (format tag + the target signature it fits)
  export_eagle(dir)  ->  dir/model.safetensors + dir/config.json in the EAGLE-1/2 drafter
                         layout that SGLang (`LlamaForCausalLMEagle`, `Qwen2ForCausalLMEagle`,
                         `Qwen3ForCausalLMEagle`: python/sglang/srt/models/{llama,qwen2,
                         qwen3}_eagle.py) and vLLM (`EagleLlamaForCausalLM`,
                         vllm/model_executor/models/llama_eagle.py) load as
                         `--speculative-draft-model-path` / `speculative_config.model`:
      fc.weight                                   [D, 2D]  (torch Linear: out x in)
      fc.bias                                     [D]      zeros; see below
      layers.0.self_attn.{q,k,v,o}_proj.weight    HF layout, as in the target checkpoint
      layers.0.self_attn.{q,k,v}_proj.bias        when the target has qkv biases (Qwen2)
      layers.0.self_attn.o_proj.bias              when the target has an o bias (Llama)
      layers.0.self_attn.{q,k}_norm.weight        [H]  Qwen3 (its decoder layer has them)
      layers.0.post_attention_layernorm.weight    [D]
      layers.0.mlp.{gate,up,down}_proj.weight     HF layout
    For a Qwen3 target the projection is `eagle_fc.{weight,bias}`: SGLang's
    Qwen3ForCausalLMEagle is a Qwen3ForCausalLM with `model.eagle_fc` added (its load_weights
    prefixes `model.` to every name), its layer 0's input norm and its final norm the
    identity, as the other classes.
    No `layers.0.input_layernorm.weight` (the engines replace layer 0's input norm with the
    identity and would reject or ignore it), no `embed_tokens` / `lm_head` (the engines share
    the target's). config.json is the target's HF config with num_hidden_layers = 1 and
    `architectures` set for the engine:
      engine="sglang": ["<target class>Eagle"], e.g. ["Qwen3ForCausalLMEagle"] (SGLang picks
        the class from `architectures`; it does not rename a draft's architecture).
      engine="vllm":   the target's own name (["LlamaForCausalLM"]): vLLM's EAGLEConfig prefixes
        "Eagle" itself (LlamaForCausalLM -> EagleLlamaForCausalLM). vLLM has no EAGLE-1 class
        for Qwen2 or Qwen3, so engine="vllm" with such a target is an error.
    Why fc.bias: SGLang builds `fc = nn.Linear(2D, D)` WITH a bias and does not zero params a
    checkpoint omits, so a checkpoint without fc.bias would leave a random bias; a zero bias
    is exactly our bias-free fc. vLLM's fc has no bias and skips checkpoint names its model
    lacks.

    tests/test_eagle_serving.py checks an export against a PyTorch forward written from the
    engines' code (not this file), with the target from transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import DEFAULT_PAGE, KVCache, cache_addr, init_cache
from tlt_jax.models.transformer import (Params, _dense, _layer, compute_logits, decoder_stack,
                                        embed_tokens, param_shapes, rope_tables)

FORMAT = "tlt_jax.drafter"
FORMAT_VERSION = 1
WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"
EAGLE_WEIGHTS_FILE = "model.safetensors"
ENGINES = ("sglang", "vllm")

# Fields of the target config a drafter depends on: shapes (hidden, heads, mlp, vocab, biases)
# and the layer's math (rope, norm eps, arch). A drafter loaded against a target that differs
# in any of them is an error.
SIGNATURE_FIELDS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_heads",
                    "num_kv_heads", "head_dim", "qkv_bias", "o_bias", "rope_theta",
                    "rope_scaling", "rms_norm_eps")


class DrafterLoadError(ValueError):
  """A drafter directory that cannot be loaded for the given target config."""


# ------------------------------------------------------------------------------ params
def drafter_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
  """The drafter pytree as shapes: fc + a stacked L=1 target layer without `attn_norm` (a
  dense one over a mixture-of-experts target: `ModelConfig.dense`)."""
  layers = dict(param_shapes(cfg.dense().replace(num_layers=1))["layers"])
  del layers["attn_norm"]
  d = cfg.hidden_size
  return {"fc": (2 * d, d), "layers": layers}


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def init_drafter(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
  """Random drafter params.

  The layer is initialised like HF (weights N(0, std), norm 1, biases 0). fc is N(0, 1/(2D)):
  each output is a sum of 2D inputs, so its variance is the mean variance of
  [embedding, hidden] and the residual stream entering the layer keeps the inputs' scale
  (with std=0.02 it would start ~0.02*sqrt(2D) times smaller than the features it predicts).
  """
  shapes = drafter_param_shapes(cfg)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      leaf = jnp.ones(shape, jnp.float32)
    elif "bias" in name:
      leaf = jnp.zeros(shape, jnp.float32)
    elif name == "['fc']":
      leaf = jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
    else:
      leaf = std * jax.random.normal(k, shape, jnp.float32)
    leaves.append(leaf.astype(cfg.weight_dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def drafter_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
                  page_size: int = DEFAULT_PAGE) -> KVCache:
  """A 1-layer KV cache for the drafter (one page pool each for k and v, rows with their own
  contiguous pages: `init_cache`, whose page ids it shares for the same arguments)."""
  return init_cache(cfg.replace(num_layers=1), batch, max_len, dtype, page_size)


def check_drafter_params(dparams: Params, cfg: ModelConfig) -> None:
  """ValueError naming the first key/shape that does not fit `cfg`."""
  want = drafter_param_shapes(cfg)
  if not isinstance(dparams, dict) or set(dparams) != set(want):
    have = sorted(dparams) if isinstance(dparams, dict) else type(dparams).__name__
    raise ValueError(f"drafter params have top-level keys {have}; expected {sorted(want)} "
                     "(target embed / norm / head are passed separately, never in dparams)")
  if set(dparams["layers"]) != set(want["layers"]):
    raise ValueError(f"drafter layer keys {sorted(dparams['layers'])} do not match the target "
                     f"config's {sorted(want['layers'])} (arch {cfg.arch}, qkv_bias "
                     f"{cfg.qkv_bias}, o_bias {cfg.o_bias})")
  for name, shape in [("fc", want["fc"])] + [(f"layers/{k}", v)
                                             for k, v in want["layers"].items()]:
    arr = dparams["fc"] if name == "fc" else dparams["layers"][name.split("/")[1]]
    if tuple(arr.shape) != tuple(shape):
      raise ValueError(f"drafter param {name} has shape {tuple(arr.shape)}; the target config "
                       f"(hidden_size={cfg.hidden_size}, heads={cfg.num_heads}/"
                       f"{cfg.num_kv_heads}, head_dim={cfg.head_dim_}, "
                       f"intermediate_size={cfg.intermediate_size}) needs {tuple(shape)}")


# ----------------------------------------------------------------------------- forward
def drafter_forward(dparams: Params, target_params: Params, tokens: jax.Array,
                    hidden: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
                    cache: KVCache | None = None, attn_mask: jax.Array | None = None,
                    return_logits: bool = True, kv_len: int | None = None,
                    window_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    live: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
  """tokens [B, T] (x_{t+1}), hidden [B, T, D] (f_t, post-norm), positions [B, T] ->
  (g [B, T, D] drafter output, logits [B, T, V] float32 | None, cache): logits = the
  target's LM head on g, no norm (the module docstring).

  cache: a `drafter_cache` (1 layer). Like the target's `forward`, the new k/v are written at
  slots lengths .. lengths + T - 1 and `lengths` is NOT advanced: the caller commits.
  attn_mask [B|1, T, T]: within-chunk visibility (causal when None): segment masks in
  training, tree masks when drafting trees. kv_len: the attention window over the cache
  (`tlt_jax.models.transformer`'s docstring); window_mask [B|1, T, W]: which of its slots each
  query sees, in place of the committed-prefix rule (`decoder_stack`). segment_ids [B, T]
  (no cache): packed training rows, causal within each segment (`packed_attention`: a fused
  kernel where the backend has one). live [B, T] or [B] bool: the tokens whose outputs
  the caller uses (the target's `forward`: a row with none reads none of its pages).
  """
  if tokens.ndim != 2 or hidden.ndim != 3 or hidden.shape[:2] != tokens.shape:
    raise ValueError(f"drafter_forward: tokens {tuple(tokens.shape)} must be [B, T] and hidden "
                     f"{tuple(hidden.shape)} [B, T, D] with the same B, T")
  if hidden.shape[-1] != cfg.hidden_size:
    raise ValueError(f"drafter_forward: hidden size {hidden.shape[-1]} != the target config's "
                     f"hidden_size {cfg.hidden_size}")
  x = _drafter_input(dparams, target_params, tokens, hidden, cfg)
  g, cache = decoder_stack(dparams["layers"], x, positions, cfg=cfg, cache=cache,
                           attn_mask=attn_mask, num_layers=1, kv_len=kv_len,
                           window_mask=window_mask, segment_ids=segment_ids, live=live)
  logits = compute_logits(target_params, g, cfg) if return_logits else None
  return g, logits, cache


def _drafter_input(dparams, target_params, tokens, hidden, cfg):
  """z = fc(concat(embed(x_{t+1}), f_t)) [B, T, D]."""
  dt = cfg.compute_dtype
  emb = embed_tokens(target_params, tokens, cfg)
  x = jnp.concatenate([emb, hidden.astype(dt)], axis=-1)
  return _dense(x, dparams["fc"], "BTE,ED->BTD", dt)


def drafter_tree_forward(dparams: Params, target_params: Params, tokens: jax.Array,
                         hidden: jax.Array, positions: jax.Array, slots: jax.Array,
                         visible: jax.Array, *, cfg: ModelConfig, cache: KVCache
                         ) -> tuple[jax.Array, jax.Array, KVCache]:
  """One level of a draft tree: tokens [B, T], hidden [B, T, D], positions [B, T] ->
  (g [B, T, D], logits [B, T, V], cache).

  Unlike `drafter_forward`, whose new tokens are one contiguous chunk at `lengths` with a
  within-chunk mask, a tree level's nodes attend to ancestors that earlier levels wrote at
  scattered slots: so the k/v are written at explicit `slots` [B, T] (out of range: dropped)
  and query t sees exactly the cache slots `visible` [B, T, W] allows (the committed prefix,
  its ancestors and itself) among the first W <= S (the attention window). Nothing is
  committed (`lengths` is unchanged).
  """
  x = _drafter_input(dparams, target_params, tokens, hidden, cfg)
  cos, sin = rope_tables(cfg, positions)
  layer = jax.tree.map(lambda a: a[0], dparams["layers"])
  addr = cache_addr(cache, slots, visible.shape[-1])
  g, (k, v) = _layer(cfg, x, layer, cos, sin, visible, (cache.k[0], cache.v[0], addr))
  return g, compute_logits(target_params, g, cfg), cache.replace(k=(k,), v=(v,))


# --------------------------------------------------------------------------- save / load
def target_signature(cfg: ModelConfig) -> dict[str, Any]:
  sig = {}
  for f in SIGNATURE_FIELDS:
    v = cfg.head_dim_ if f == "head_dim" else getattr(cfg, f)
    if dataclasses.is_dataclass(v):
      v = dataclasses.asdict(v)
    sig[f] = v
  return sig


def _flat_items(dparams: Params):
  yield "fc", dparams["fc"]
  for k in sorted(dparams["layers"]):
    yield f"layers.{k}", dparams["layers"][k]


def save_drafter(directory: str, dparams: Params, cfg: ModelConfig) -> None:
  """Writes the trainable params (our layout) + the target signature they fit."""
  from tlt_jax.models.safetensors_io import write_safetensors
  check_drafter_params(dparams, cfg)
  os.makedirs(directory, exist_ok=True)
  tensors = {name: np.asarray(jax.device_get(arr)) for name, arr in _flat_items(dparams)}
  write_safetensors(os.path.join(directory, WEIGHTS_FILE), tensors,
                    metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})
  meta = {"format": FORMAT, "version": FORMAT_VERSION, "target": target_signature(cfg),
          "param_dtype": str(np.dtype(cfg.weight_dtype)),
          "num_params": int(sum(int(np.prod(a.shape)) for a in tensors.values()))}
  tmp = os.path.join(directory, CONFIG_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, os.path.join(directory, CONFIG_FILE))


def _norm(v):
  return json.loads(json.dumps(v))  # tuples -> lists, as stored


def load_drafter(directory: str, cfg: ModelConfig) -> Params:
  """Reads `save_drafter` output for target `cfg`; params come back in cfg.weight_dtype.

  Raises DrafterLoadError (a ValueError) for a missing directory/file, a file that is not a
  tlt_jax drafter, or a drafter trained for a different target (naming both values).
  """
  from tlt_jax.models.safetensors_io import CheckpointFormatError, mmap_safetensors
  if not os.path.isdir(directory):
    raise DrafterLoadError(f"drafter directory {directory!r} does not exist; pass the --out of "
                           "scripts/train_drafter.py (it holds drafter.safetensors)")
  cpath, wpath = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
  for p in (cpath, wpath):
    if not os.path.exists(p):
      hint = (" (this looks like an EAGLE export; load_drafter reads save_drafter's layout, "
              "usually the parent directory)") if os.path.exists(
                  os.path.join(directory, EAGLE_WEIGHTS_FILE)) else ""
      raise DrafterLoadError(f"{directory}: no {os.path.basename(p)}; not a tlt_jax drafter "
                             f"directory{hint}")
  try:
    with open(cpath) as f:
      meta = json.load(f)
  except json.JSONDecodeError as e:
    raise DrafterLoadError(f"{cpath}: not valid JSON ({e.msg})") from None
  if meta.get("format") != FORMAT:
    raise DrafterLoadError(f"{cpath}: format {meta.get('format')!r} is not {FORMAT!r}")
  if meta.get("version") != FORMAT_VERSION:
    raise DrafterLoadError(f"{cpath}: format version {meta.get('version')} is not supported "
                           f"(this code reads version {FORMAT_VERSION})")
  saved, want = meta.get("target", {}), _norm(target_signature(cfg))
  diffs = [f"{k}: drafter {saved.get(k)!r} vs target {want[k]!r}" for k in SIGNATURE_FIELDS
           if saved.get(k) != want[k]]
  if diffs:
    raise DrafterLoadError(f"{directory}: the drafter was trained for a different target "
                           f"model ({'; '.join(diffs)}); train a drafter for this target "
                           "(scripts/train_drafter.py --model <target dir>)")
  try:
    tensors = mmap_safetensors(wpath)
  except CheckpointFormatError as e:
    raise DrafterLoadError(str(e)) from None
  shapes = drafter_param_shapes(cfg)
  expected = {"fc": shapes["fc"], **{f"layers.{k}": v for k, v in shapes["layers"].items()}}
  missing = sorted(set(expected) - set(tensors))
  extra = sorted(set(tensors) - set(expected))
  if missing or extra:
    raise DrafterLoadError(f"{wpath}: tensors do not match the target config: missing "
                           f"{missing}, unexpected {extra}")
  out: dict[str, Any] = {"fc": None, "layers": {}}
  for name, shape in expected.items():
    arr = tensors[name]
    if tuple(arr.shape) != tuple(shape):
      raise DrafterLoadError(f"{wpath}: tensor {name} has shape {tuple(arr.shape)}, the target "
                             f"config needs {tuple(shape)}")
    val = jnp.asarray(np.asarray(arr), dtype=cfg.weight_dtype)
    if name == "fc":
      out["fc"] = val
    else:
      out["layers"][name.split(".", 1)[1]] = val
  return out


# ------------------------------------------------------------------------------ export
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
             "router_aux_loss_coef")


def eagle_fc_name(cfg: ModelConfig) -> str:
  """The input projection's tensor name: SGLang's Qwen3ForCausalLMEagle calls it `eagle_fc`
  (a Qwen3ForCausalLM with the projection added to its model), the EAGLE-1 classes of Llama
  and Qwen2 `fc`."""
  return "eagle_fc" if cfg.arch in ("qwen3", "qwen3_moe") else "fc"


def eagle_state_dict(dparams: Params, cfg: ModelConfig, dtype: str | None = None,
                     fc_bias: bool = True) -> dict[str, np.ndarray]:
  """EAGLE-1/2 drafter tensors (see the module docstring), HF layout, numpy."""
  from tlt_jax.models.hf_io import _mapping  # the target's own name/layout table
  check_drafter_params(dparams, cfg)
  np_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  host = jax.device_get(dparams)
  fc = np.asarray(host["fc"])
  fc_name = eagle_fc_name(cfg)
  out = {f"{fc_name}.weight": np.ascontiguousarray(fc.T.astype(np_dtype))}
  if fc_bias:
    out[f"{fc_name}.bias"] = np.zeros((cfg.hidden_size,), np_dtype)
  one = cfg.dense().replace(num_layers=1)
  for ours, hf_name, _, to_hf in _mapping(one):
    if not ours.startswith("layers/") or ours == "layers/attn_norm":
      continue
    arr = np.asarray(host["layers"][ours.split("/")[1]])[0]
    name = hf_name.format(0)
    assert name.startswith("model."), name
    out[name[len("model."):]] = np.ascontiguousarray(to_hf(arr).astype(np_dtype))
  return out


def eagle_architecture(cfg: ModelConfig, engine: str) -> str:
  base = cfg.dense().to_hf_dict()["architectures"][0]  # (an MoE target's drafter is dense)
  if engine == "sglang":
    return base + "Eagle"
  if engine == "vllm":
    if cfg.arch != "llama":
      raise ValueError(f"export_eagle(engine='vllm'): vLLM has no EAGLE-1 drafter class for "
                       f"{cfg.arch} targets (only EagleLlamaForCausalLM); use engine='sglang'")
    return base
  raise ValueError(f"export_eagle: engine={engine!r}; use one of {ENGINES}")


def export_eagle(directory: str, dparams: Params, cfg: ModelConfig, *,
                 target_hf_config: dict[str, Any] | None = None, engine: str = "sglang",
                 dtype: str | None = None, fc_bias: bool = True) -> dict[str, Any]:
  """Writes dir/model.safetensors + dir/config.json (EAGLE-1/2 drafter layout; see the module
  docstring). target_hf_config: the target's config.json dict (default: rebuilt from cfg), so
  the engines read the target's own rope settings, vocab, norm eps and head tying; returns the
  config written.

  config.json: the target's with num_hidden_layers 1, `architectures` for the engine and
  `torch_dtype` the dtype of the tensors written (transformers 5's `dtype` key is dropped: an
  engine on transformers 4 would keep the target's stale value beside it). Dropped too, as
  what the drafter is not: `layer_types` (per-layer lists of L entries),
  `quantization_config` (the drafter is written unquantised), `auto_map` (remote code of the
  target's repository) and `_name_or_path`."""
  arch = eagle_architecture(cfg, engine)
  base = dict(target_hf_config) if target_hf_config is not None else cfg.to_hf_dict()
  if int(base.get("hidden_size", -1)) != cfg.hidden_size:
    raise ValueError(f"export_eagle: target_hf_config hidden_size {base.get('hidden_size')} "
                     f"!= the drafter config's hidden_size {cfg.hidden_size}")
  tensors = eagle_state_dict(dparams, cfg, dtype, fc_bias)
  config = {k: v for k, v in base.items()
            if k not in ("layer_types", "quantization_config", "auto_map", "_name_or_path",
                         "dtype")}
  config.update(num_hidden_layers=1, architectures=[arch],
                torch_dtype=str(next(iter(tensors.values())).dtype))
  if cfg.moe:  # the drafter of an MoE target is a dense Qwen3 layer of intermediate_size
    for k in _MOE_KEYS:
      config.pop(k, None)
    config["model_type"] = cfg.dense().arch
  from tlt_jax.models.safetensors_io import write_safetensors
  os.makedirs(directory, exist_ok=True)
  # both files renamed into place (write_safetensors does too): a run killed mid-export leaves
  # whole files, never a torn one an engine would load
  write_safetensors(os.path.join(directory, EAGLE_WEIGHTS_FILE), tensors)
  cpath = os.path.join(directory, "config.json")
  with open(cpath + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
  os.replace(cpath + ".tmp", cpath)
  return config
