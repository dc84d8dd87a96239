"""Model configuration: one frozen, hashable dataclass for Qwen2/Qwen2.5, Qwen3 (dense and
mixture-of-experts) and Llama(-3.x).

The config is hashable so it can be a static argument of `jax.jit`; every field that changes
the computation graph lives here, every array lives in the params pytree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

SUPPORTED_ARCHS = ("qwen2", "qwen3", "qwen3_moe", "llama")
_HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}
ATTENTION_IMPLS = ("auto", "fused", "xla")
EXPERTS_IMPLS = ("auto", "kernel", "xla")
REMAT_POLICIES = ("full", "dots")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_BYTES = {k: jnp.dtype(v).itemsize for k, v in _DTYPES.items()}  # config name -> bytes


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (HF `rope_type: "llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str  # "qwen2" | "qwen3" | "qwen3_moe" | "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None  # None -> hidden_size // num_heads
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2: True; Llama: `attention_bias`
  o_bias: bool = False  # Llama `attention_bias` also biases o_proj
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  dtype: str = "float32"  # compute dtype of matmuls
  param_dtype: str = "float32"  # storage dtype of params
  remat: bool = False  # rematerialise each layer in the backward pass (training memory)
  # what a rematerialised layer keeps from its forward: "full" nothing but its input (the
  # backward recomputes the whole forward), "dots" every projection's output (the matmuls
  # are not recomputed, only the elementwise ops and the attention: ~1 forward less)
  remat_policy: str = "full"
  # packed (and causal) attention's implementation: "auto" (a fused kernel where the backend
  # has one, models/attention.py), "fused" (the Pallas kernel; interpreted off a GPU) or "xla"
  attention: str = "auto"
  # attention over a KV cache (the rollout's decode and verification steps): "window" (the
  # window's pages gathered, XLA's attention: models/kv_cache.py) or "paged" (a Pallas kernel
  # that reads each row's live pages only, kernels/paged_attention.py; set by the engine,
  # rollout EngineConfig.paged_attention)
  cache_attention: str = "window"
  # mixture of experts (Qwen3-MoE; models/moe.py): every layer's MLP is `num_experts` SiLU
  # MLPs of width `moe_intermediate_size`, each token routed to `experts_per_token` of them by
  # a softmax router (the top weights renormalised to sum to 1 with `norm_topk_prob`).
  # 0 experts: the dense MLP of width intermediate_size (which an MoE config keeps: it is the
  # width of the dense layer an EAGLE drafter of the model has, `dense()`)
  num_experts: int = 0
  experts_per_token: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  # the grouped experts' implementation (models/moe.py: prefill, the learner): "auto" (the
  # Pallas grouped matmul on a GPU once its start-up check passes, else XLA's ragged_dot),
  # "kernel" (forced; interpreted off a GPU: tests) or "xla"
  experts: str = "auto"

  def __post_init__(self):
    def bad(field, value, fix):
      raise ValueError(f"ModelConfig.{field}={value!r} is invalid: {fix}")

    if self.arch not in SUPPORTED_ARCHS:
      bad("arch", self.arch, f"use one of {SUPPORTED_ARCHS}")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads"):
      if int(getattr(self, f)) <= 0:
        bad(f, getattr(self, f), "must be a positive integer")
    if self.num_heads % self.num_kv_heads:
      bad("num_kv_heads", self.num_kv_heads,
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      bad("head_dim", None, "set head_dim explicitly: hidden_size is not divisible by num_heads")
    if self.head_dim_ % 2:
      bad("head_dim", self.head_dim_, "RoPE needs an even head_dim")
    if self.remat_policy not in REMAT_POLICIES:
      bad("remat_policy", self.remat_policy, f"use one of {REMAT_POLICIES}")
    if self.attention not in ATTENTION_IMPLS:
      bad("attention", self.attention, f"use one of {ATTENTION_IMPLS}")
    if self.experts not in EXPERTS_IMPLS:
      bad("experts", self.experts, f"use one of {EXPERTS_IMPLS}")
    if self.cache_attention not in ("window", "paged"):
      bad("cache_attention", self.cache_attention, "use 'window' or 'paged'")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in _DTYPES:
        bad(f, getattr(self, f), f"use one of {sorted(_DTYPES)}")
    if self.num_experts:
      if not 0 < self.experts_per_token <= self.num_experts:
        bad("experts_per_token", self.experts_per_token,
            f"route each token to 1..num_experts ({self.num_experts}) experts")
      if self.moe_intermediate_size <= 0:
        bad("moe_intermediate_size", self.moe_intermediate_size, "must be a positive integer")

  @property
  def moe(self) -> bool:
    """Whether the layers' MLPs are mixtures of experts (models/moe.py)."""
    return self.num_experts > 0

  def dense(self) -> "ModelConfig":
    """This config with a dense MLP of width intermediate_size in place of the experts, as
    dense Qwen3 (an MoE target's EAGLE drafter layer: the serving engines' drafters of
    Qwen3-MoE are dense layers)."""
    if not self.moe:
      return self
    return dataclasses.replace(self, arch="qwen3", num_experts=0, experts_per_token=0,
                               moe_intermediate_size=0, norm_topk_prob=False, experts="auto")

  @property
  def head_dim_(self) -> int:
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # ---------------------------------------------------------------- HF config.json interop
  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json",
                   **overrides) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict; unsupported features are errors."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_ARCHS:
      archs = d.get("architectures")
      raise ValueError(
          f"{source}: model_type={model_type!r} (architectures={archs}) is not supported; "
          f"tlt_jax implements {SUPPORTED_ARCHS} (Qwen2/Qwen2.5, dense Qwen3 and "
          "Llama/Llama-3.x, Qwen3-MoE)")
    if d.get("mlp_bias"):
      raise ValueError(f"{source}: mlp_bias=true is not supported (no released Qwen2, Qwen3 or "
                       "Llama uses it)")
    if d.get("use_sliding_window") and model_type in ("qwen2", "qwen3"):
      raise ValueError(f"{source}: use_sliding_window=true is not supported; set it to false "
                       "(Qwen2.5 and Qwen3 checkpoints ship with it off)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    scaling = None
    if rs:
      rope_type = rs.get("rope_type", rs.get("type"))
      if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
      elif rope_type not in (None, "default"):
        raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported "
                         "(supported: default, llama3)")
    # transformers 5 nests rope_theta in rope_parameters and prefers it over a top-level one.
    theta = rs.get("rope_theta") if isinstance(rs, Mapping) else None
    if theta is None:
      theta = d.get("rope_theta")
    n_heads = int(d["num_attention_heads"])
    attn_bias = bool(d.get("attention_bias", False))
    head_dim = d.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads == int(d["hidden_size"]):
      head_dim = None  # the implied default: keep configs equal (and jit caches warm)
    kw = dict(
        arch=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=None if head_dim is None else int(head_dim),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        # Qwen2: q/k/v biases, never o; Qwen3 and Llama: `attention_bias` covers all four
        qkv_bias=True if model_type == "qwen2" else attn_bias,
        o_bias=False if model_type == "qwen2" else attn_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
    )
    if model_type == "qwen3_moe":
      kw.update(_moe_fields(d, source))
    kw.update(overrides)
    return cls(**kw)

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` transformers needs to load params saved by `save_hf_model`."""
    if self.arch == "qwen2" and self.o_bias:
      raise ValueError("Qwen2 has no o_proj bias; a qwen2 config with o_bias cannot be exported")
    if self.arch in ("llama", "qwen3", "qwen3_moe") and self.qkv_bias != self.o_bias:
      raise ValueError(f"{self.arch}'s attention_bias covers q/k/v/o together; qkv_bias != "
                       f"o_bias cannot be exported as a {_HF_CLASSES[self.arch]} checkpoint")
    if self.qk_norm != (self.arch in ("qwen3", "qwen3_moe")):
      raise ValueError(f"qk_norm={self.qk_norm} cannot be exported as a {self.arch} checkpoint "
                       "(Qwen3 always has q/k norms, Qwen2 and Llama never)")
    d = {
        "architectures": [_HF_CLASSES[self.arch]],
        "model_type": self.arch,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim_,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "torch_dtype": self.param_dtype,
        "attention_dropout": 0.0,
    }
    if self.arch in ("llama", "qwen3", "qwen3_moe"):
      d["attention_bias"] = self.qkv_bias
    if self.arch == "llama":
      d["mlp_bias"] = False
    else:
      d["use_sliding_window"] = False
    if self.moe != (self.arch == "qwen3_moe"):
      raise ValueError(f"num_experts={self.num_experts} cannot be exported as a {self.arch} "
                       "checkpoint (only qwen3_moe has experts, and it always has)")
    if self.moe:
      d.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
               moe_intermediate_size=self.moe_intermediate_size,
               norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
               output_router_logits=False)
    if self.rope_scaling is not None:
      d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
    return d


def _moe_fields(d: Mapping[str, Any], source: str) -> dict[str, Any]:
  """A Qwen3-MoE config.json's expert fields (transformers 5 writes `num_local_experts`, the
  released checkpoints `num_experts`); a layout other than experts in every layer is an
  error."""
  mlp_only = list(d.get("mlp_only_layers") or [])
  step = int(d.get("decoder_sparse_step", 1))
  if mlp_only or step != 1:
    raise ValueError(f"{source}: mlp_only_layers={mlp_only}, decoder_sparse_step={step}: "
                     "tlt_jax runs Qwen3-MoE models whose every layer has experts (all released "
                     "ones: [] and 1)")
  n = d.get("num_experts", d.get("num_local_experts"))
  if n is None:
    raise KeyError("num_experts")
  return dict(num_experts=int(n), experts_per_token=int(d["num_experts_per_tok"]),
              moe_intermediate_size=int(d["moe_intermediate_size"]),
              norm_topk_prob=bool(d.get("norm_topk_prob", False)))


def num_params(cfg: ModelConfig) -> int:
  d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim_
  attn = d * h * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
  if cfg.qkv_bias:
    attn += h * (cfg.num_heads + 2 * cfg.num_kv_heads)
  if cfg.o_bias:
    attn += d
  if cfg.qk_norm:
    attn += 2 * h
  mlp = (cfg.num_experts * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
         if cfg.moe else 3 * d * f)
  per_layer = attn + mlp + 2 * d
  emb = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
  return cfg.num_layers * per_layer + emb + d
