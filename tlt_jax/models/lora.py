"""LoRA adapters: low-rank updates of a frozen base model's projections (Hu et al. 2021).

A target projection y = x W becomes y = x W + scale x (x A) B, with A [in, r], B [r, out]
and scale = alpha / r: only A and B are trained, so the learner holds the base once, frozen
(in the compute dtype: every forward casts weights to it anyway), and gradients, Adam moments
and checkpoints are the adapters' alone. B starts at zero, so the first policy is the base
model exactly, and the base IS the reference policy of a KL term (no copy). The rollout
decodes the merged weights W + scale A B (`merge`): its engine, kernels and drafter never
see an adapter.

Adapters of the stacked layout (transformer.py's docstring), one pair per target:
  layers/<t>/a  [L, *in, r]    layers/<t>/b  [L, r, *out]
where in / out are the weight's input and output dims (q: D | N, H; o: N, H | D; gate, up:
D | F; down: F | D). `attach` puts each pair beside its weight as layers/<t>_lora, which the
forward reads (transformer._proj).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.safetensors_io import write_safetensors

Params = dict[str, Any]

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Hugging Face's module names (PEFT's target_modules) for ours
HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
            "up_proj": "up", "down_proj": "down"}
_IN_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
_HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int  # r > 0
  alpha: float = 32.0  # scale = alpha / rank
  targets: tuple[str, ...] = TARGETS

  def __post_init__(self):
    if not (isinstance(self.rank, int) and self.rank > 0):
      raise ValueError(f"LoRA rank {self.rank!r}: a positive integer")
    if not self.alpha > 0:
      raise ValueError(f"LoRA alpha {self.alpha!r}: a positive number")
    bad = [t for t in self.targets if t not in TARGETS]
    if bad or not self.targets:
      raise ValueError(f"LoRA targets {bad or self.targets}: choose from {TARGETS}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def from_settings(lo: dict[str, Any]) -> LoraConfig | None:
  """config.model.lora's values (the live config's section, or a run's saved config.json's)
  -> LoraConfig; None at rank 0 (the whole model trained). ValueError names a target that is
  not a projection (config.lora_config checks the rest first, under their config keys)."""
  if not lo.get("rank", 0):
    return None
  return LoraConfig(int(lo["rank"]), float(lo.get("alpha", LoraConfig.alpha)),
                    parse_targets(str(lo.get("targets", "all-linear"))))


def parse_targets(text: str) -> tuple[str, ...]:
  """"all-linear" (PEFT's name: every projection of a layer), or a comma-separated list of
  ours (q, k, v, o, gate, up, down) or Hugging Face's (q_proj, ..., down_proj) -> ours, in
  the layer's order. ValueError names what is not a projection."""
  text = text.strip()
  if text in ("all-linear", "all"):
    return TARGETS
  names = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in names if s not in TARGETS and s not in HF_NAMES]
  if bad or not names:
    raise ValueError(f"{bad or text!r} is not a projection: use all-linear, or a list of "
                     f"{', '.join(TARGETS)} (or their Hugging Face names, q_proj ... down_proj)")
  chosen = {HF_NAMES.get(s, s) for s in names}
  return tuple(t for t in TARGETS if t in chosen)


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> Params:
  """{"layers": {target: {"a": [L, *in, r], "b": [L, r, *out]}}} as shape tuples, from the
  base's layout (transformer.param_shapes)."""
  from tlt_jax.models.transformer import param_shapes
  layers = param_shapes(cfg)["layers"]
  absent = [t for t in lora.targets if t not in layers]
  if absent and tuple(lora.targets) != TARGETS:
    raise ValueError(f"LoRA targets {absent}: a {cfg.arch} layer has no such projection (a "
                     "mixture of experts takes no adapters; all-linear adapts its attention, as "
                     "PEFT's all-linear does)")
  out = {}
  for t in (t for t in lora.targets if t in layers):
    shape = layers[t]
    k = 1 + _IN_DIMS[t]
    out[t] = {"a": (*shape[:k], lora.rank), "b": (shape[0], lora.rank, *shape[k:])}
  return {"layers": out}


def init_adapters(cfg: ModelConfig, lora: LoraConfig, rng: jax.Array) -> Params:
  """A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's default Kaiming-uniform bound), B = 0,
  in float32 (the adapters' master weights, whatever the base's dtype)."""
  shapes = adapter_shapes(cfg, lora)["layers"]
  keys = jax.random.split(rng, len(shapes))
  layers = {}
  for key, (t, s) in zip(keys, shapes.items()):
    fan_in = math.prod(s["a"][1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    layers[t] = {"a": jax.random.uniform(key, s["a"], jnp.float32, -bound, bound),
                 "b": jnp.zeros(s["b"], jnp.float32)}
  return {"layers": layers}


def attach(base: Params, adapters: Params, scale: float) -> Params:
  """The base's tree with each adapter pair beside its weight (layers/<t>_lora: a, and b
  times the scale), for `forward` (differentiable in the adapters)."""
  layers = dict(base["layers"])
  for t, ab in adapters["layers"].items():
    layers[t + "_lora"] = {"a": ab["a"], "b": ab["b"] * scale}
  return {**base, "layers": layers}


def merge(base: Params, adapters: Params, scale: float) -> Params:
  """The base's tree (stacked layers) with every target weight W + scale A B (summed in
  float32, stored in W's dtype): the policy the adapters make, as the exports take it. The
  rollout's copy is merged by its layout conversion instead (models.replica_layout)."""
  return {**base, "layers": merge_layer(attach(base, adapters, scale)["layers"], stacked=True)}


def merge_layer(lp: Params, stacked: bool = False) -> Params:
  """One layer's dict (or, `stacked`, every layer's [L, ...], merged by a scan over them)
  with its attached adapters (`attach`: <t>_lora beside each target) merged, none left:
  W + a b (b carries the scale) summed in float32 and stored in W's dtype; a layer without
  adapters is returned as it is. One layer's target at a time, so the float32 product is
  one layer's, never a whole target's (at 7B an MLP target's would be 7.6 GB)."""
  targets = [k[:-len("_lora")] for k in lp if k.endswith("_lora")]
  if not targets:
    return lp
  lp = dict(lp)
  for t in targets:
    ab = lp.pop(t + "_lora")
    x = (lp[t], ab["a"], ab["b"])
    lp[t] = jax.lax.map(_merged, x) if stacked else _merged(x)
  return lp


def _merged(x: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
  """One layer's W [*in, *out] + a [*in, r] b [r, *out], in float32, stored in W's dtype."""
  w, a, b = x
  r = a.shape[-1]
  d = jnp.dot(a.astype(jnp.float32).reshape(-1, r), b.astype(jnp.float32).reshape(r, -1),
              precision=jax.lax.Precision.HIGHEST)
  return (w.astype(jnp.float32) + d.reshape(w.shape)).astype(w.dtype)


def num_adapter_params(cfg: ModelConfig, lora: LoraConfig) -> int:
  return sum(math.prod(s) for t in adapter_shapes(cfg, lora)["layers"].values()
             for s in t.values())


def peft_tensors(adapters: Params) -> dict[str, np.ndarray]:
  """The adapters (host arrays) under PEFT's names for a Qwen2 / Qwen3 / Llama causal LM:
  base_model.model.model.layers.<i>.<module>.lora_A.weight [r, in] and lora_B.weight
  [out, r], in and out flattened in the order the Hugging Face weight's are (hf_io's map)."""
  out = {}
  for t, ab in adapters["layers"].items():
    a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
    r = a.shape[-1]
    for i in range(a.shape[0]):
      name = f"base_model.model.model.layers.{i}.{_HF_MODULE[t]}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
  return out


def save_peft_adapter(path: str, adapters: Params, lora: LoraConfig, *, base_model: str) -> None:
  """`path`/adapter_model.safetensors + adapter_config.json: the adapters as PEFT saves a
  LoRA of a causal LM (`peft.PeftModel.from_pretrained(base, path)` loads them; vLLM and
  SGLang serve them as LoRA adapters of `base_model`)."""
  os.makedirs(path, exist_ok=True)
  write_safetensors(os.path.join(path, "adapter_model.safetensors"), peft_tensors(adapters),
                    metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(_HF_MODULE[t].split(".")[1] for t in lora.targets),
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}
  with open(os.path.join(path, "adapter_config.json"), "w") as fh:
    json.dump(config, fh, indent=2)


def load_peft_adapter(path: str, cfg: ModelConfig, lora: LoraConfig) -> Params:
  """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors: what
  `PeftModel.save_pretrained` and `save_peft_adapter` write) as our adapters (float32 host
  arrays). ValueError, one line naming the fix, where it is not one we can continue: another
  rank, alpha or set of targets than `lora`, or options we do not implement (rsLoRA, DoRA,
  trained biases, per-layer ranks, layers left out)."""
  from tlt_jax.models.safetensors_io import mmap_safetensors
  conf_path = os.path.join(path, "adapter_config.json")
  weights = os.path.join(path, "adapter_model.safetensors")
  if not (os.path.isfile(conf_path) and os.path.isfile(weights)):
    raise ValueError("is not a PEFT adapter directory (adapter_config.json and "
                     "adapter_model.safetensors)")
  with open(conf_path) as fh:
    conf = json.load(fh)
  if conf.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"holds a {conf.get('peft_type')} adapter, not LoRA")
  unsupported = [k for k in ("use_rslora", "use_dora") if conf.get(k)]
  unsupported += [k for k in ("rank_pattern", "alpha_pattern", "layers_to_transform",
                              "modules_to_save") if conf.get(k)]
  if conf.get("bias", "none") != "none":
    unsupported.append(f"bias={conf['bias']!r}")
  if unsupported:
    raise ValueError(f"uses {', '.join(unsupported)}, which tlt_jax's LoRA does not implement")
  modules = conf.get("target_modules") or []
  targets = parse_targets(",".join(modules) if isinstance(modules, list) else str(modules))
  theirs = (int(conf.get("r", 0)), float(conf.get("lora_alpha", 0)), targets)
  if theirs != (lora.rank, lora.alpha, lora.targets):
    raise ValueError(f"was trained with r={theirs[0]}, lora_alpha={theirs[1]:g}, targets "
                     f"{','.join(targets)}: set model.lora.rank={theirs[0]}, "
                     f"model.lora.alpha={theirs[1]:g}, model.lora.targets={','.join(targets)}")
  tensors = mmap_safetensors(weights)
  shapes = adapter_shapes(cfg, lora)["layers"]
  layers = {}
  for t, s in shapes.items():
    a = np.zeros(s["a"], np.float32)
    b = np.zeros(s["b"], np.float32)
    r = lora.rank
    for i in range(s["a"][0]):
      name = f"base_model.model.model.layers.{i}.{_HF_MODULE[t]}"
      try:
        ta, tb = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
      except KeyError as e:
        raise ValueError(f"has no tensor {e.args[0]}: not an adapter of this model "
                         "(model.path)") from None
      if ta.shape != (r, a[i].size // r) or tb.shape != (b[i].size // r, r):
        raise ValueError(f"{name}: lora_A {tuple(ta.shape)}, lora_B {tuple(tb.shape)} do not "
                         "fit this model (model.path)")
      a[i] = np.asarray(ta, np.float32).T.reshape(s["a"][1:])
      b[i] = np.asarray(tb, np.float32).T.reshape(s["b"][1:])
    layers[t] = {"a": a, "b": b}
  return {"layers": layers}
