"""Hugging Face checkpoint I/O: local `config.json` + `*.safetensors` <-> tlt_jax params.

Loading never materialises a whole model on one device: each safetensors file is memory-
mapped, every param is built with `jax.make_array_from_callback`, and the callback reads only
the slice of the HF tensor that lands on that device (the layout transform is a numpy view,
so slicing happens before any bytes are copied). Saving writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads, so trained actors go straight to
serving engines; it streams the other way: one tensor (a stacked leaf's one layer) gathered to
the host at a time and written as it comes, each file's header planned from the shapes first
(the format itself: safetensors_io.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from tlt_jax import watchdog
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.lora import merge_layer
from tlt_jax.models.safetensors_io import (CheckpointFormatError, mmap_safetensors,
                                           write_safetensors_stream)
from tlt_jax.models.tokenizer import TOKENIZER_FILES
from tlt_jax.models.transformer import Params, param_shapes
from tlt_jax.sharding import make_mesh, tree_shardings



# ------------------------------------------------------------------------------- key mapping
# (our path, HF name template, hf->ours view, ours->hf). Views only reshape/transpose, so a
# device's shard can be sliced out of the memory map before any copy. A stacked leaf's template
# takes the layer; an expert leaf's ([L, E, ...], `_per_expert`) the layer and the expert: the
# released Qwen3-MoE checkpoints, and transformers' save_pretrained, keep a tensor per expert.
def _per_expert(ours: str) -> bool:
  return ours.startswith("layers/expert_")


def _hf_names(cfg: ModelConfig, ours: str, hf_name: str) -> list:
  """The HF tensors of one of our leaves: a name (unstacked), a name per layer, or a list of
  names per expert per layer."""
  if not ours.startswith("layers/"):
    return [hf_name]
  if _per_expert(ours):
    return [[hf_name.format(i, e) for e in range(cfg.num_experts)]
            for i in range(cfg.num_layers)]
  return [hf_name.format(i) for i in range(cfg.num_layers)]


def _mapping(cfg: ModelConfig):
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_
  ident = lambda w: w
  t = lambda w: w.T
  rows = [
      ("embed", "model.embed_tokens.weight", ident, ident),
      ("final_norm", "model.norm.weight", ident, ident),
      ("layers/attn_norm", "model.layers.{}.input_layernorm.weight", ident, ident),
      ("layers/mlp_norm", "model.layers.{}.post_attention_layernorm.weight", ident, ident),
      ("layers/q", "model.layers.{}.self_attn.q_proj.weight",
       lambda w: w.reshape(n, h, d).transpose(2, 0, 1), lambda w: w.reshape(d, n * h).T),
      ("layers/k", "model.layers.{}.self_attn.k_proj.weight",
       lambda w: w.reshape(k, h, d).transpose(2, 0, 1), lambda w: w.reshape(d, k * h).T),
      ("layers/v", "model.layers.{}.self_attn.v_proj.weight",
       lambda w: w.reshape(k, h, d).transpose(2, 0, 1), lambda w: w.reshape(d, k * h).T),
      ("layers/o", "model.layers.{}.self_attn.o_proj.weight",
       lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T),
  ]
  if cfg.moe:
    rows += [("layers/router", "model.layers.{}.mlp.gate.weight", t, t),
             ("layers/expert_gate", "model.layers.{}.mlp.experts.{}.gate_proj.weight", t, t),
             ("layers/expert_up", "model.layers.{}.mlp.experts.{}.up_proj.weight", t, t),
             ("layers/expert_down", "model.layers.{}.mlp.experts.{}.down_proj.weight", t, t)]
  else:
    rows += [("layers/gate", "model.layers.{}.mlp.gate_proj.weight", t, t),
             ("layers/up", "model.layers.{}.mlp.up_proj.weight", t, t),
             ("layers/down", "model.layers.{}.mlp.down_proj.weight", t, t)]
  if cfg.qkv_bias:
    rows += [
        ("layers/q_bias", "model.layers.{}.self_attn.q_proj.bias",
         lambda w: w.reshape(n, h), lambda w: w.reshape(n * h)),
        ("layers/k_bias", "model.layers.{}.self_attn.k_proj.bias",
         lambda w: w.reshape(k, h), lambda w: w.reshape(k * h)),
        ("layers/v_bias", "model.layers.{}.self_attn.v_proj.bias",
         lambda w: w.reshape(k, h), lambda w: w.reshape(k * h)),
    ]
  if cfg.o_bias:
    rows.append(("layers/o_bias", "model.layers.{}.self_attn.o_proj.bias", ident, ident))
  if cfg.qk_norm:
    rows += [("layers/q_norm", "model.layers.{}.self_attn.q_norm.weight", ident, ident),
             ("layers/k_norm", "model.layers.{}.self_attn.k_norm.weight", ident, ident)]
  if not cfg.tie_word_embeddings:
    rows.append(("lm_head", "lm_head.weight", t, t))
  return rows


def _get(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def _set(tree, path, value):
  parts = path.split("/")
  for part in parts[:-1]:
    tree = tree.setdefault(part, {})
  tree[parts[-1]] = value


# ------------------------------------------------------------------------------------ loading
def read_hf_config(model_dir: str) -> dict[str, Any]:
  if not os.path.isdir(model_dir):
    raise CheckpointFormatError(f"model directory {model_dir!r} does not exist; pass a local "
                                "Hugging Face model directory (config.json + *.safetensors)")
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointFormatError(f"{model_dir}: no config.json; is this a Hugging Face model "
                                "directory? (tlt_jax never downloads from a hub)")
  try:
    with open(path) as f:
      d = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFormatError(f"{path} is not valid JSON ({e}); restore it from the original "
                                "checkpoint (e.g. re-save with save_pretrained)") from None
  if not isinstance(d, dict):
    raise CheckpointFormatError(f"{path} holds a JSON {type(d).__name__}, not an object")
  return d


def _tensor_index(model_dir: str) -> dict[str, np.ndarray]:
  index_path = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index_path):
    try:
      with open(index_path) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointFormatError(
          f"{index_path} is not a safetensors index (a JSON object with a 'weight_map' of "
          f"tensor -> file; {type(e).__name__}: {e}); restore it, or delete it when the weights "
          "are a single model.safetensors") from None
  else:
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
  if not files:
    bins = [f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth"))]
    hint = (" (found PyTorch pickles " + ", ".join(bins) + ": re-save with "
            "`model.save_pretrained(dir, safe_serialization=True)`)") if bins else ""
    raise CheckpointFormatError(f"{model_dir}: no *.safetensors weights{hint}")
  tensors: dict[str, np.ndarray] = {}
  for fname in files:
    path = os.path.join(model_dir, fname)
    if not os.path.exists(path):
      raise CheckpointFormatError(f"{model_dir}: the index lists {fname}, which is missing")
    tensors.update(mmap_safetensors(path))
  return tensors


def load_hf_config(model_dir: str, **overrides) -> ModelConfig:
  """ModelConfig of a local HF directory; any problem with its config.json (unsupported
  model_type or feature, a missing or mistyped key) is one CheckpointFormatError."""
  source = os.path.join(model_dir, "config.json")
  d = read_hf_config(model_dir)
  try:
    return ModelConfig.from_hf_dict(d, source=source, **overrides)
  except KeyError as e:
    raise CheckpointFormatError(
        f"{source}: required key {e.args[0]!r} is missing (model_type={d.get('model_type')!r}); "
        "the file is incomplete: restore it from the original checkpoint") from None
  except (TypeError, ValueError) as e:
    if isinstance(e, CheckpointFormatError) or str(e).startswith(source):
      raise CheckpointFormatError(str(e)) from None
    raise CheckpointFormatError(f"{source}: {e}") from None


def load_hf_model(model_dir: str, *, dtype: str | None = None, param_dtype: str | None = None,
                  mesh: Mesh | None = None, shardings: Any = None,
                  **cfg_overrides) -> tuple[ModelConfig, Params]:
  """Loads (cfg, params) from a local HF directory straight onto their shardings.

  shardings: a params-shaped pytree of `jax.sharding.Sharding`; default: the partition rules
  of `tlt_jax.sharding` over `mesh`, or the first device when no mesh is given.
  """
  overrides = dict(cfg_overrides)
  if dtype is not None:
    overrides["dtype"] = dtype
  if param_dtype is not None:
    overrides["param_dtype"] = param_dtype
  cfg = load_hf_config(model_dir, **overrides)
  tensors = _tensor_index(model_dir)
  shapes = param_shapes(cfg)
  if shardings is None:
    if mesh is None:
      mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    shardings = tree_shardings(jax.tree.map(np.zeros, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple)), mesh)

  params: Params = {}
  for ours, hf_name, to_ours, _ in _mapping(cfg):
    shape = _get(shapes, ours)
    stacked = ours.startswith("layers/")
    experts = _per_expert(ours)
    want = shape[1 + experts:] if stacked else shape

    def view_of(name, ours=ours, to_ours=to_ours, want=want):
      if name not in tensors:
        raise CheckpointFormatError(
            f"{model_dir}: tensor {name!r} is missing (needed for {ours}); the checkpoint does "
            f"not match its config.json ({cfg.arch}, {cfg.num_layers} layers"
            + (f", {cfg.num_experts} experts)" if cfg.moe else ")"))
      try:
        view = to_ours(tensors[name])
      except ValueError:  # the q/k/v/o reshape itself fails when the element count is off
        view = None
      if view is None or tuple(view.shape) != tuple(want):
        raise CheckpointFormatError(
            f"{model_dir}: tensor {name!r} has shape {tuple(tensors[name].shape)}, which does "
            f"not fit {ours} {tuple(want)} implied by config.json")
      return view

    views = [[view_of(n) for n in names] if experts else view_of(names)
             for names in _hf_names(cfg, ours, hf_name)]
    np_dtype = np.dtype(cfg.weight_dtype)

    def callback(index, views=views, stacked=stacked, experts=experts, np_dtype=np_dtype):
      if not stacked:
        return np.asarray(views[0][index], dtype=np_dtype)
      if experts:  # [L, E, ...]: each layer's experts' views, sliced
        return np.stack([np.stack([np.asarray(views[i][e][index[2:]], dtype=np_dtype)
                                   for e in range(len(views[i]))[index[1]]])
                         for i in range(len(views))[index[0]]])
      return np.stack([np.asarray(views[i][index[1:]], dtype=np_dtype)
                       for i in range(len(views))[index[0]]])

    arr = jax.make_array_from_callback(tuple(shape), _get(shardings, ours), callback)
    _set(params, ours, arr)
  return cfg, params


# ------------------------------------------------------------------------------------ saving
MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, max_shard_size="5GB"


def _to_host(x) -> np.ndarray:
  """x on this host as numpy; an array with shards on other processes is all-gathered (a
  collective: every process calls it, each gets all of x)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


@jax.jit
def _layer(x: jax.Array, i: jax.Array) -> jax.Array:
  """Layer i's slice of a stacked [L, ...] leaf, on the leaf's devices (one executable per
  leaf shape, whatever i)."""
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


@jax.jit
def _expert(x: jax.Array, i: jax.Array, e: jax.Array) -> jax.Array:
  """Layer i's expert e of a stacked [L, E, ...] leaf, on the leaf's devices."""
  return _layer(_layer(x, i), e)


@jax.jit
def _merged_layer(w: jax.Array, a: jax.Array, b: jax.Array, i: jax.Array) -> jax.Array:
  """Layer i of an attached target merged (lora.merge's rule), on the leaves' devices."""
  one = {"w": _layer(w, i), "w_lora": {"a": _layer(a, i), "b": _layer(b, i)}}
  return merge_layer(one)["w"]


def _np_dtype(dtype: str) -> np.dtype:
  return np.dtype(jax.numpy.dtype(dtype))


def hf_tensor_specs(cfg: ModelConfig, dtype: str | None = None
                    ) -> list[tuple[str, tuple[int, ...], np.dtype]]:
  """(HF name, shape, dtype) of each tensor `hf_state_dict` yields, in its order, from the
  config alone (the layout transforms traced on shapes): a file's header before its data."""
  np_dtype = _np_dtype(dtype or cfg.param_dtype)
  shapes = param_shapes(cfg)
  out = []
  for ours, hf_name, _, to_hf in _mapping(cfg):
    shape = _get(shapes, ours)
    lead = (1 + _per_expert(ours)) if ours.startswith("layers/") else 0
    hf_shape = tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape[lead:], np.float32)).shape)
    names = _hf_names(cfg, ours, hf_name)
    out += [(name, hf_shape, np_dtype)
            for name in (sum(names, []) if _per_expert(ours) else names)]
  return out


def hf_state_dict(params: Params, cfg: ModelConfig, dtype: str | None = None
                  ) -> Iterable[tuple[str, np.ndarray]]:
  """(HF name, numpy array) pairs in HF layout and `hf_tensor_specs` order, one tensor at a
  time: a stacked [L, ...] leaf comes to the host one layer's slice at a time, so the host
  holds one tensor of the model at once, whatever the model's size. `params` may carry LoRA
  adapters attached (lora.attach: layers/<t>_lora beside a target): each layer's target is
  then merged on the devices as it is taken (lora.merge's W + a b), so the merged model never
  exists beside the base. With several processes each tensor is a collective: every process
  iterates this to the end, in step."""
  np_dtype = _np_dtype(dtype or cfg.param_dtype)

  def convert(x, to_hf):
    watchdog.beat()
    return np.array(to_hf(_to_host(x)), dtype=np_dtype, order="C")

  for ours, hf_name, _, to_hf in _mapping(cfg):
    leaf = _get(params, ours)
    if not ours.startswith("layers/"):
      yield hf_name, convert(leaf, to_hf)
      continue
    if _per_expert(ours):  # an expert at a time (LoRA never targets experts)
      for i, names in enumerate(_hf_names(cfg, ours, hf_name)):
        for e, name in enumerate(names):
          one = (_expert(leaf, np.int32(i), np.int32(e)) if isinstance(leaf, jax.Array)
                 else leaf[i][e])
          yield name, convert(one, to_hf)
      continue
    ab = params["layers"].get(ours[len("layers/"):] + "_lora")
    for i in range(cfg.num_layers):
      if ab is not None:  # LoRA attached (lora.attach): W + a b, this layer's alone
        layer = _merged_layer(leaf, ab["a"], ab["b"], np.int32(i))
      else:
        layer = _layer(leaf, np.int32(i)) if isinstance(leaf, jax.Array) else leaf[i]
      yield hf_name.format(i), convert(layer, to_hf)


def _shards(specs: list, max_shard_bytes: int) -> list[list]:
  """`specs` cut, in order, into files of at most max_shard_bytes (a bigger tensor alone)."""
  shards: list[list] = [[]]
  size = 0
  for spec in specs:
    n = int(np.prod(spec[1], dtype=np.int64)) * spec[2].itemsize
    if size and size + n > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += n
  return shards


def save_hf_model(params: Params, cfg: ModelConfig, out_dir: str, *,
                  dtype: str | None = None, extra_config: dict[str, Any] | None = None,
                  generation_config: dict[str, Any] | None = None,
                  tokenizer_dir: str | None = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
  """Writes config.json + safetensors (sharded with model.safetensors.index.json above
  max_shard_bytes, as transformers names them) in `dtype` (default: cfg.param_dtype), and
  generation_config.json and tokenizer_dir's tokenizer files when given.

  Streamed: each file's header is planned from the shapes, then each tensor is gathered
  (`hf_state_dict`), converted and written as it comes, so no host ever holds the model
  twice. Every process of a multi-process run calls this (the gathers are collectives);
  process 0 alone writes."""
  tensors = iter(hf_state_dict(params, cfg, dtype))
  if jax.process_index() != 0:
    for _ in tensors:  # every process joins the all-gathers
      pass
    return
  os.makedirs(out_dir, exist_ok=True)
  config = cfg.to_hf_dict()
  if dtype:
    config["torch_dtype"] = dtype
  config.update(extra_config or {})
  for stale in os.listdir(out_dir):
    if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
      os.remove(os.path.join(out_dir, stale))
  specs = hf_tensor_specs(cfg, dtype)
  shards = _shards(specs, max_shard_bytes)
  if len(shards) == 1:
    write_safetensors_stream(os.path.join(out_dir, "model.safetensors"), specs, tensors)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      write_safetensors_stream(os.path.join(out_dir, fname), shard, tensors)
      weight_map.update((name, fname) for name, _, _ in shard)
    total = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, shape, dt in specs)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  if generation_config is not None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump(generation_config, f, indent=2)
  if tokenizer_dir is not None and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
    for fname in TOKENIZER_FILES:
      src = os.path.join(tokenizer_dir, fname)
      if os.path.exists(src):
        shutil.copy(src, os.path.join(out_dir, fname))
