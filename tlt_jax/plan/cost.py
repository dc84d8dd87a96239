"""What a forward costs: the bytes it moves and the FLOPs it does, priced on a hardware profile.

The cluster simulator (issue #38) prices every step of a run with these functions, so
speculation's price is never a typed-in constant: a verification of K+1 tokens, a tree
level, a drafter step and a prefill are all the same `forward` with different shapes.

Bytes and FLOPs of one forward over `batch` rows of `tokens` new tokens each, attending over
a window of `kv_len` cache slots, on one device of a replica split `tp` ways (the rules of
`tlt_jax.memory`: what does not divide is replicated):
  weights   every parameter the forward reads, once whatever the batch (the rollout's
            replica layout, `memory_phases.sharded_bytes`); an untied embedding table is gathered
            (B x T rows), not read whole (`bench/roofline.py`'s rule)
  KV        batch x kv_len slots of every layer's keys and values read (masked slots cost
            as much as live ones: the window is read whole), batch x tokens written
  FLOPs     2 per weight per token through the matmuls (the LM head included), plus the
            attention's 4 x heads x head_dim per (query, slot) pair
  experts   (a mixture of experts) the weights read are the experts the forward's live
            tokens route to (models/moe.py's `experts_read`; `live` of the batch's rows: an
            empty or finished row routes to none), the FLOPs each live token's k experts:
            the grouped-matmul kernel's, which a GPU runs (its tiles' padding not counted)
  collective  with tp > 1, two all-reduces of the residual stream per layer (attention out,
            MLP out) of batch x tokens x hidden activations, ring cost 2 (tp - 1) / tp

A profile turns that into seconds:
    t = max(bytes / mem_bw, flops / flops) + collective bytes / link_bw
        + fixed_s + layer_s x layers
`fixed_s` is what one forward costs whatever its size (dispatch of the executable, host
work per step), `layer_s` what each layer adds on top of its bytes and FLOPs (kernel
launches). A profile fitted on a machine also keeps, per forward it measured (the target's or
the drafter's, rows x new tokens), how far that forward's size-dependent terms were off
(`shape_factors`: measured over fitted, less `fixed_s`): one rate and one bandwidth cannot fit
every shape (XLA:CPU's 1-token forwards at 4+ rows run at 0.6-0.7x of the fitted rate, a GPU's
batch-1 dots below its batch-8 ones), so a forward's roofline and per-layer terms are scaled by
the factor interpolated at its shape (log rows, log tokens; rows clamped to the measured ones,
no factor at a token count outside them: a prefill, a chunk's drafter tracking); a sum of
forwards (a speculative step) by its parts' factors weighted by their terms.
The shipped profiles take vendor peak figures (stated with each) scaled by achievable
fractions that are assumptions until a GPU session calibrates them (scripts/gpu_check.sh),
and no shape factors; `calibrate` fits all four numbers to forwards measured on the machine it
runs on (this CPU included) by non-negative least squares, then the factors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from tlt_jax.models.config import DTYPE_BYTES, ModelConfig


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What one device does per second (module docstring): achieved, not peak."""

  name: str
  mem_bw: float  # bytes/s streamed from device memory
  flops: float  # matmul FLOP/s in the compute dtype
  link_bw: float  # bytes/s per device into a tensor-parallel all-reduce
  fixed_s: float  # seconds per forward, whatever its size
  layer_s: float  # seconds per layer per forward beyond bytes and FLOPs
  note: str = ""  # where the numbers come from
  # the host's seconds per engine chunk beyond its forwards (dispatch, the host sync, the
  # loop's bookkeeping and layout operations): the simulator adds it per chunk; fitted by
  # calibrate.host_overhead, 0 in the vendor profiles (small beside a large model's chunk)
  chunk_s: float = 0.0
  op_s: float = 0.0  # ... per layout operation (a refill's or a resize's host work), the same
  # (kind, rows, tokens, factor) per measured forward: "target" or "drafter" (module docstring)
  shape_factors: tuple[tuple[str, int, int, float], ...] = ()

  def __post_init__(self):  # from JSON: lists
    object.__setattr__(self, "shape_factors",
                       tuple((str(k), int(r), int(t), float(f))
                             for k, r, t, f in self.shape_factors))

  def roofline(self, nbytes: float, flops: float) -> float:
    return max(nbytes / self.mem_bw, flops / self.flops)

  def seconds(self, cost: "Cost") -> float:
    """The forward's time on this device."""
    t = self.roofline(cost.bytes, cost.flops) + self.layer_s * cost.layers
    if self.shape_factors and cost.shapes:
      w = [self.roofline(b, f) + self.layer_s * n_layers
           for _, _, _, b, f, n_layers in cost.shapes]
      if sum(w) > 0:
        t *= sum(wi * self.factor(k, r, n)
                 for wi, (k, r, n, *_) in zip(w, cost.shapes)) / sum(w)
    return t + cost.collective_bytes / self.link_bw + self.fixed_s

  def factor(self, kind: str, rows: int, tokens: int) -> float:
    """The size-dependent terms' correction at a forward's shape (`_factor`)."""
    return _factor(self.shape_factors, kind, rows, tokens)


@functools.lru_cache(maxsize=4096)  # pure; asked for every forward a fitted profile prices
def _factor(shape_factors: tuple[tuple[str, int, int, float], ...], kind: str, rows: int,
            tokens: int) -> float:
  """Bilinear in (log rows, log tokens) over the measured grid of `kind`, rows clamped to its
  edges; 1 where nothing of `kind` was measured at tokens around this one."""
  pts = [(r, t, f) for k, r, t, f in shape_factors if k == kind]
  if not pts or not min(t for _, t, _ in pts) <= tokens <= max(t for _, t, _ in pts):
    return 1.0

  def interp(x: float, xs: list[float], ys: list[float]) -> float:
    return float(np.interp(np.log(x), np.log(xs), ys))

  by_tokens: dict[int, list[tuple[int, float]]] = {}
  for r, t, f in pts:
    by_tokens.setdefault(t, []).append((r, f))
  ts = sorted(by_tokens)
  per_t = [interp(max(rows, 1), [r for r, _ in sorted(by_tokens[t])],
                  [f for _, f in sorted(by_tokens[t])]) for t in ts]
  return interp(tokens, ts, per_t)


# Vendor peaks (dense bf16 tensor-core FLOP/s, HBM bandwidth, NVLink per direction), scaled by
# what a JAX decode/prefill loop reaches: 80% of HBM bandwidth on streaming reads, 60% of
# matmul peak, 70% of NVLink; launches assumed at 20 us per layer, 100 us per forward (no CUDA
# graphs). Assumptions until scripts/gpu_check.sh's calibration stage measures them.
_MEM_EFF, _FLOP_EFF, _LINK_EFF = 0.8, 0.6, 0.7
PROFILES = {
    "h100": Hardware("h100", 3.35e12 * _MEM_EFF, 989e12 * _FLOP_EFF, 450e9 * _LINK_EFF,
                     100e-6, 20e-6, "H100 SXM 80 GB: 3.35 TB/s HBM3, 989 TFLOP/s bf16 dense, "
                     "NVLink 4 900 GB/s (450 per direction)"),
    "h200": Hardware("h200", 4.8e12 * _MEM_EFF, 989e12 * _FLOP_EFF, 450e9 * _LINK_EFF,
                     100e-6, 20e-6, "H200 SXM 141 GB: 4.8 TB/s HBM3e, 989 TFLOP/s bf16 dense, "
                     "NVLink 4 900 GB/s"),
    "a100": Hardware("a100", 2.039e12 * _MEM_EFF, 312e12 * _FLOP_EFF, 300e9 * _LINK_EFF,
                     100e-6, 20e-6, "A100 SXM 80 GB: 2.04 TB/s HBM2e, 312 TFLOP/s bf16 dense, "
                     "NVLink 3 600 GB/s (300 per direction)"),
}


def profile(spec: str) -> Hardware:
  """A profile by name (`PROFILES`) or from a JSON file: scripts/bench_cost_model.py's
  cost_model.json (its "hardware", the profile fitted on the machine it ran on: this CPU, or a
  GPU in a gpu_check session) or a bare {"mem_bw": ..., ...}. ConfigError naming the input."""
  import json
  import os

  from tlt_jax.errors import ConfigError
  if spec in PROFILES:
    return PROFILES[spec]
  if not os.path.isfile(spec):
    raise ConfigError(f"use one of {sorted(PROFILES)} or a profile JSON "
                      "(scripts/bench_cost_model.py's cost_model.json)", "--hardware", spec)
  try:
    with open(spec) as f:
      d = json.load(f)
    d = d.get("hardware", d)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: v for k, v in d.items() if k in fields})
  except (OSError, ValueError, TypeError, AttributeError) as e:
    raise ConfigError(f"is not a profile JSON ({e})", "--hardware", spec) from None


@dataclasses.dataclass(frozen=True)
class Cost:
  """One forward's work on one device (module docstring)."""

  bytes: float  # weights read + KV read and written + activations in and out
  flops: float
  collective_bytes: float = 0.0
  layers: int = 0
  # the forwards it sums, (kind, rows, tokens, bytes, flops, layers): what a profile's
  # shape_factors are looked up by (Hardware.seconds)
  shapes: tuple[tuple[str, int, int, float, float, int], ...] = ()

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.bytes + other.bytes, self.flops + other.flops,
                self.collective_bytes + other.collective_bytes, self.layers + other.layers,
                self.shapes + other.shapes)

  def as_shape(self, kind: str, rows: int, tokens: int) -> "Cost":
    """This cost as one forward of `kind` over rows x tokens."""
    return dataclasses.replace(
        self, shapes=((kind, rows, tokens, self.bytes, self.flops, self.layers),))


def _split(x: int, tp: int) -> int:
  """A dimension split over tensor parallelism when it divides (the sharding rules'), else
  replicated."""
  return x // tp if tp > 1 and x % tp == 0 else x


def layer_weights(cfg: ModelConfig, tp: int = 1) -> int:
  """Parameters of one decoder layer on one device of a tp-way replica (every expert's, in a
  mixture of experts: what it holds, not what a token reads, `_layer_read`)."""
  base, expert = _layer_parts(cfg, tp)
  return base + cfg.num_experts * expert if cfg.moe else base


def _layer_parts(cfg: ModelConfig, tp: int) -> tuple[int, int]:
  """(one layer's parameters on a device but its experts', one expert's): a dense layer's
  MLP is in the first; an MoE layer's router is, its experts (each split over tp as a dense
  MLP) are not."""
  d, h = cfg.hidden_size, cfg.head_dim_
  n, k = _split(cfg.num_heads, tp), _split(cfg.num_kv_heads, tp)
  w = d * h * (2 * n + 2 * k) + 2 * d
  if cfg.qkv_bias:
    w += h * (n + 2 * k)
  if cfg.o_bias:
    w += d
  if cfg.qk_norm:
    w += 2 * h
  if not cfg.moe:
    return w + 3 * d * _split(cfg.intermediate_size, tp), 0
  return w + d * cfg.num_experts, 3 * d * _split(cfg.moe_intermediate_size, tp)


def _layer_read(cfg: ModelConfig, tp: int, tokens: int, live: int) -> tuple[float, float]:
  """(the parameters a forward over `tokens` tokens, `live` of them routed to experts,
  reads in a layer; the parameter-token products its matmuls do: what its FLOPs count)."""
  base, expert = _layer_parts(cfg, tp)
  if not cfg.moe:
    return base, float(base) * tokens
  from tlt_jax.models import moe
  return (base + expert * moe.experts_read(cfg, live),
          float(base) * tokens + float(expert) * cfg.experts_per_token * live)


def model_weights(cfg: ModelConfig) -> int:
  """The matmuls' parameters of the whole model (every layer's, every expert's, the head's):
  what the learner's FSDP gathers and its optimizer steps."""
  return cfg.num_layers * layer_weights(cfg) + head_weights(cfg)


def head_weights(cfg: ModelConfig, tp: int = 1) -> int:
  """The LM head's parameters on one device (the vocabulary split over tp when it divides)."""
  return cfg.hidden_size * _split(cfg.vocab_size, tp)


def forward(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, *, tp: int = 1,
            layers: int | None = None, head: bool = True, dtype: str | None = None,
            live: int | None = None) -> Cost:
  """A forward of the target (or, with layers=1 and the drafter's extras added by `draft`,
  the drafter) over batch x tokens new tokens attending over kv_len slots (module
  docstring). head: the LM head runs on every new token (verification, decode); prefill
  runs it on the last token only (head=False, then one token's head added by the caller).
  live: the rows whose tokens a mixture of experts routes (None: all `batch`; the engine
  passes the others as not live, models/transformer.py's `forward`)."""
  nb = DTYPE_BYTES[dtype or cfg.dtype]
  n_layers = cfg.num_layers if layers is None else layers
  bt = batch * tokens
  d, h = cfg.hidden_size, cfg.head_dim_
  n, k = _split(cfg.num_heads, tp), _split(cfg.num_kv_heads, tp)
  live_t = bt if live is None else min(live, batch) * tokens
  w_read, w_products = _layer_read(cfg, tp, bt, live_t)
  weights = n_layers * w_read + (head_weights(cfg, tp) if head else 0)
  gathered = 0 if cfg.tie_word_embeddings and head else bt * d  # embedding rows gathered
  kv = n_layers * 2 * k * h * nb * (batch * kv_len + bt)
  acts = 2 * bt * d * nb + (bt * _split(cfg.vocab_size, tp) * 4 if head else 0)
  flops = 2.0 * (n_layers * w_products + bt * (head_weights(cfg, tp) if head else 0))
  flops += 4.0 * bt * kv_len * n * h * n_layers
  coll = 0.0
  if tp > 1:
    coll = n_layers * 2 * (2 * (tp - 1) / tp) * bt * d * nb
  return Cost((weights + gathered) * nb + kv + acts, flops, coll, n_layers).as_shape(
      "target" if layers is None and head else "part", batch, tokens)


def draft(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, *, tp: int = 1,
          dtype: str | None = None) -> Cost:
  """One drafter forward (tlt_jax/drafter/model.py): fc over [embedding, hidden] (2D x D),
  one target layer (a dense one over an MoE target: `ModelConfig.dense`), the target's LM
  head over every new token."""
  cfg = cfg.dense()
  nb = DTYPE_BYTES[dtype or cfg.dtype]
  d, bt = cfg.hidden_size, batch * tokens
  fc = Cost(2 * d * d * nb + bt * 3 * d * nb, 2.0 * bt * 2 * d * d)
  return (fc + forward(cfg, batch, tokens, kv_len, tp=tp, layers=1, dtype=dtype)).as_shape(
      "drafter", batch, tokens)


def prefill(cfg: ModelConfig, prompts: int, prompt_len: int, *, tp: int = 1,
            dtype: str | None = None) -> Cost:
  """A prefill of `prompts` prompts of prompt_len tokens into an empty cache (causal: the
  average query attends over half the prompt), the LM head on each prompt's last token."""
  body = forward(cfg, prompts, prompt_len, max(prompt_len // 2, 1), tp=tp, head=False,
                 dtype=dtype)
  return (body + Cost(head_weights(cfg, tp) * DTYPE_BYTES[dtype or cfg.dtype],
                      2.0 * prompts * head_weights(cfg, tp))).as_shape(
      "prefill", prompts, prompt_len)


def spec_step(cfg: ModelConfig, arm, batch: int, kv_len: int, *, tp: int = 1,
              dtype: str | None = None, live: int | None = None) -> Cost:
  """One speculative step of `arm` (a rollout.policies.strategy.Strategy): the target's verification
  over its verify tokens, the drafter's catch-up over steps + 1 tokens and steps - 1 more
  drafter steps of topk (a history arm drafts on the host: its verification only; "off" one
  target token and the drafter's catch-up over it). Host work (a history lookup) is not in
  it. live: the rows still decoding (`forward`'s)."""
  if arm == "off" or not arm.steps:
    return forward(cfg, batch, 1, kv_len, tp=tp, dtype=dtype, live=live) + draft(
        cfg, batch, 1, kv_len, tp=tp, dtype=dtype)
  c = forward(cfg, batch, arm.verify_tokens, kv_len, tp=tp, dtype=dtype, live=live)
  if arm.history and not arm.hybrid:  # (a hybrid's drafter chain runs beside the history's)
    return c
  c = c + draft(cfg, batch, arm.steps + 1, kv_len, tp=tp, dtype=dtype)
  for _ in range(arm.steps - 1):
    c = c + draft(cfg, batch, arm.topk, kv_len, tp=tp, dtype=dtype)
  return c


# ------------------------------------------------------------------------------ calibration
def fit(costs: Sequence[Cost], seconds: Sequence[float], *, name: str = "calibrated",
        link_bw: float = float("inf")) -> Hardware:
  """The profile whose `seconds` best fits measured forwards (relative least squares, every
  coefficient >= 0). Which forwards are FLOP-bound depends only on where the profile's ridge
  (flops / mem_bw) falls among the forwards' FLOPs-per-byte, so every split of them by
  FLOPs-per-byte is tried (a linear non-negative fit of (1/mem_bw, 1/flops, fixed_s,
  layer_s) each) and the best fit whose own ridge agrees with its split is kept."""
  from scipy.optimize import nnls
  t = np.asarray(seconds, np.float64)
  b = np.asarray([c.bytes for c in costs], np.float64)
  f = np.asarray([c.flops for c in costs], np.float64)
  layers = np.asarray([c.layers for c in costs], np.float64)
  if len(costs) < 4:
    raise ValueError(f"fit: {len(costs)} forwards measured; 4 numbers need at least 4")
  intensity = f / b
  best = None
  for cut in np.concatenate([[0.0], np.unique(intensity)]):
    flop_bound = intensity > cut
    a = np.stack([np.where(flop_bound, 0.0, b), np.where(flop_bound, f, 0.0),
                  np.ones_like(t), layers], 1) / t[:, None]  # relative residuals
    coef, resid = nnls(a, np.ones_like(t))
    inv_bw, inv_fl = coef[:2]
    # consistent: under the fitted profile, the split's forwards are the ones bound as assumed
    bound = np.maximum(inv_bw * b, inv_fl * f)
    used = np.where(flop_bound, inv_fl * f, inv_bw * b)
    if not np.allclose(used, bound, rtol=1e-6, atol=0.0):
      continue
    if best is None or resid < best[0]:
      best = (resid, coef)
  inv_bw, inv_fl, fixed, per_layer = best[1]
  return Hardware(name, 1.0 / max(inv_bw, 1e-30), 1.0 / max(inv_fl, 1e-30), link_bw,
                  float(fixed), float(per_layer), f"fitted to {len(costs)} measured forwards")
