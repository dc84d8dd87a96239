"""A memory-bound benchmark target + drafter that compute exactly the shipped tiny model.

Built by scripts/make_bench_model.py (the CLI); scripts/bench_regime.py and
tests/test_bench_model.py use the build and the regime check from here.

Why: the shipped model (1M params) is launch-bound on any accelerator, so a k-token verify
costs what a 1-token step costs and speculative decoding's trade-off never shows. These
weights make a batch-1 step read ~750 MB, as a real LLM's step is memory-bound, while every
output (tokens, rewards, acceptance) stays the shipped model's: benchmarks on the default task
remain comparable.

How (weight surgery in numpy, no training; the defaults are the flags' defaults):
  widen   hidden D0=128 -> D, zero-padded. Added attention heads (head_dim kept) have zero
          q/k/v/o; original heads keep their GQA grouping (query head n reads kv head
          n // group, in ours and in HF's repeat_kv): old kv head j stays j and old query head
          j*g0 + r moves to j*g + r. MLP width zero-padded. RMSNorm: a zero-padded x has
          mean(x^2) over D equal to D0/D times the one over D0, so norm weights are scaled by
          sqrt(D0/D) and rms_norm_eps by D0/D; then every norm output equals the original
          exactly (in real arithmetic; float rounding leaves ~1e-6 on the logits).
  deepen  L0=4 -> L layers, the originals spread evenly among added ones whose o_proj and
          down_proj are zero (identity residual blocks) and whose q/k/v/gate/up are seeded
          N(0, 0.02): their compute and memory traffic are real, their contribution is zero.
  drafter the same widening of its layer; fc's input is concat(embedding, hidden), so the
          original fc rows move to offsets 0 and D.

`build` writes OUT/model (HF checkpoint: config.json, model.safetensors, tokenizer,
generation_config), OUT/drafter (save_drafter's format) and OUT/bench_model.json (arguments,
param counts); `logit_diff` checks the function against the shipped model; `regime_report`
times k-token vs 1-token cached forwards at batch 1, bench vs shipped.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.config import asset_path
from tlt_jax.drafter.model import drafter_cache, drafter_forward, load_drafter, save_drafter
from tlt_jax.models import ModelConfig, forward, init_cache, num_params, unstack_layers
from tlt_jax.models.hf_io import load_hf_model, read_hf_config, save_hf_model
from tlt_jax.models.tokenizer import load_tokenizer

SHIPPED = asset_path("default")
NEW_LAYER_STD = 0.02
# Axis kinds of each param (after the stacked layer axis): D hidden, N query heads, K kv heads,
# H head dim, F mlp, V vocab.
AXES = {
    "embed": "VD", "final_norm": "D", "lm_head": "DV",
    "attn_norm": "D", "mlp_norm": "D", "q": "DNH", "k": "DKH", "v": "DKH", "o": "NHD",
    "gate": "DF", "up": "DF", "down": "FD", "q_bias": "NH", "k_bias": "KH", "v_bias": "KH",
    "o_bias": "D", "q_norm": "H", "k_norm": "H",
}
RANDOM_IN_NEW_LAYERS = ("q", "k", "v", "gate", "up")


class BuildError(ValueError):
  """Arguments or an --out directory that cannot give a function-preserving build."""


# --------------------------------------------------------------------------------- surgery
def head_placement(n0: int, k0: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """New indices of the old query heads [n0] and old kv heads [k0], grouping preserved."""
  g0, g = n0 // k0, n // k
  q_idx = np.array([(i // g0) * g + i % g0 for i in range(n0)])
  return q_idx, np.arange(k0)


def _embed(a: np.ndarray, axes: str, sizes: dict, where: dict) -> np.ndarray:
  """a [lead..., axes] zero-padded into a [lead..., sizes] array at the `where` indices."""
  lead = a.ndim - len(axes)
  out = np.zeros(a.shape[:lead] + tuple(sizes[c] for c in axes), np.float32)
  out[(slice(None),) * lead + tuple(where[c] for c in axes)] = a
  return out


def _layout(cfg0: ModelConfig, cfg: ModelConfig):
  q_idx, kv_idx = head_placement(cfg0.num_heads, cfg0.num_kv_heads, cfg.num_heads,
                                 cfg.num_kv_heads)
  sizes = dict(D=cfg.hidden_size, N=cfg.num_heads, K=cfg.num_kv_heads, H=cfg.head_dim_,
               F=cfg.intermediate_size, V=cfg.vocab_size)
  where = dict(D=slice(0, cfg0.hidden_size), N=q_idx, K=kv_idx, H=slice(None),
               F=slice(0, cfg0.intermediate_size), V=slice(None))
  return sizes, where


def _widen(name: str, a: np.ndarray, sizes: dict, where: dict, scale: float) -> np.ndarray:
  out = _embed(np.asarray(a, np.float32), AXES[name], sizes, where)
  if name.endswith("norm"):
    out[..., where["D"]] *= np.float32(scale)
  return out


def bench_config(cfg0: ModelConfig, *, hidden: int, heads: int, kv_heads: int,
                 intermediate: int, layers: int) -> ModelConfig:
  """The widened config; BuildError when it cannot hold cfg0's function."""
  checks = [
      ("--hidden", hidden, cfg0.hidden_size, "the shipped hidden size"),
      ("--heads", heads, cfg0.num_heads, "the shipped query heads"),
      ("--kv_heads", kv_heads, cfg0.num_kv_heads, "the shipped kv heads"),
      ("--intermediate", intermediate, cfg0.intermediate_size, "the shipped MLP width"),
      ("--layers", layers, cfg0.num_layers, "the shipped depth"),
  ]
  for flag, value, least, what in checks:
    if value < least:
      raise BuildError(f"{flag} {value} is smaller than {what} ({least}); the bench model "
                       f"only adds capacity: pass {flag} >= {least}")
  g0 = cfg0.num_heads // cfg0.num_kv_heads
  if heads % kv_heads or heads // kv_heads < g0:
    raise BuildError(f"--heads {heads} / --kv_heads {kv_heads}: heads must be a multiple of "
                     f"kv_heads with a group of at least {g0} query heads per kv head (the "
                     f"shipped model's), e.g. --heads {kv_heads * g0}")
  return cfg0.replace(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=cfg0.head_dim_, intermediate_size=intermediate,
                      num_layers=layers,
                      rms_norm_eps=cfg0.rms_norm_eps * cfg0.hidden_size / hidden)


def original_layer_slots(l0: int, l: int) -> list[int]:
  """Where the original layers go among l: spread evenly (0, 4, 8, 12 for 4 -> 16)."""
  return [i * l // l0 for i in range(l0)]


def widen_target(params0, cfg0: ModelConfig, cfg: ModelConfig, seed: int) -> dict:
  """The bench target's params (numpy float32); same function as params0 (see the docstring)."""
  sizes, where = _layout(cfg0, cfg)
  scale = np.sqrt(cfg0.hidden_size / cfg.hidden_size)
  out = {k: _widen(k, v, sizes, where, scale) for k, v in params0.items() if k != "layers"}
  old = {k: _widen(k, v, sizes, where, scale) for k, v in params0["layers"].items()}
  slots = original_layer_slots(cfg0.num_layers, cfg.num_layers)
  rng = np.random.default_rng(seed)
  layers = {}
  for name, a in old.items():
    layers[name] = np.zeros((cfg.num_layers,) + a.shape[1:], np.float32)
    layers[name][slots] = a
  for i in sorted(set(range(cfg.num_layers)) - set(slots)):
    for name in sorted(layers):  # fixed order: the same seed gives the same weights
      if name.endswith("norm"):
        layers[name][i] = 1.0
      elif name in RANDOM_IN_NEW_LAYERS:
        layers[name][i] = NEW_LAYER_STD * rng.standard_normal(layers[name].shape[1:],
                                                              np.float32)
      # o, down and biases stay zero: the block adds nothing to the residual stream
  out["layers"] = layers
  return out


def widen_drafter(dparams0, cfg0: ModelConfig, cfg: ModelConfig) -> dict:
  """The drafter for the bench target; on zero-padded (token, hidden) inputs its output is
  the shipped drafter's, zero-padded."""
  sizes, where = _layout(cfg0, cfg)
  scale = np.sqrt(cfg0.hidden_size / cfg.hidden_size)
  d0, d = cfg0.hidden_size, cfg.hidden_size
  fc0 = np.asarray(dparams0["fc"], np.float32)  # [2*d0, d0]: rows = concat(embedding, hidden)
  fc = np.zeros((2 * d, d), np.float32)
  fc[:d0, :d0] = fc0[:d0]
  fc[d:d + d0, :d0] = fc0[d0:]
  layers = {k: _widen(k, v, sizes, where, scale) for k, v in dparams0["layers"].items()}
  return {"fc": fc, "layers": layers}


def _count(tree) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------------- build
def build(out_dir: str, *, source: str = SHIPPED, hidden: int = 1024, heads: int = 32,
          kv_heads: int = 16, intermediate: int = 2816, layers: int = 16, seed: int = 0,
          overwrite: bool = False) -> dict:
  """Writes out_dir/{model, drafter, bench_model.json}; returns the summary written."""
  model0, drafter0 = os.path.join(source, "model"), os.path.join(source, "drafter")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise BuildError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace "
                     "its model/ and drafter/, or choose a new directory")
  for path in (model0, drafter0):
    if not os.path.isdir(path):
      raise BuildError(f"--source {source}: no {os.path.basename(path)}/ directory; pass a "
                       "directory laid out as tlt_jax/assets/default (model/ + drafter/)")
  t0 = time.perf_counter()
  cfg0, params0 = load_hf_model(model0)
  params0 = jax.tree.map(np.asarray, params0)
  dparams0 = jax.tree.map(np.asarray, load_drafter(drafter0, cfg0))
  cfg = bench_config(cfg0, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, layers=layers)
  params = widen_target(params0, cfg0, cfg, seed)
  dparams = widen_drafter(dparams0, cfg0, cfg)

  model_dir, drafter_dir = os.path.join(out_dir, "model"), os.path.join(out_dir, "drafter")
  for d in (model_dir, drafter_dir):
    if os.path.isdir(d):
      shutil.rmtree(d)
  # Keys of the shipped config.json that ModelConfig does not carry (eos/pad/bos ids).
  hf0 = read_hf_config(model0)
  extra = {k: v for k, v in hf0.items() if k not in cfg.to_hf_dict()}
  with open(os.path.join(model0, "generation_config.json")) as f:
    gen = json.load(f)
  save_hf_model(params, cfg, model_dir, extra_config=extra, generation_config=gen,
                tokenizer_dir=model0)
  save_drafter(drafter_dir, dparams, cfg)
  summary = {
      "source": os.path.abspath(source), "seed": seed,
      "shipped": {"hidden": cfg0.hidden_size, "heads": cfg0.num_heads,
                  "kv_heads": cfg0.num_kv_heads, "intermediate": cfg0.intermediate_size,
                  "layers": cfg0.num_layers, "rms_norm_eps": cfg0.rms_norm_eps},
      "bench": {"hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                "intermediate": intermediate, "layers": layers, "rms_norm_eps": cfg.rms_norm_eps,
                "original_layer_slots": original_layer_slots(cfg0.num_layers, layers)},
      "target_params": num_params(cfg), "drafter_params": _count(dparams),
      "shipped_target_params": num_params(cfg0), "shipped_drafter_params": _count(dparams0),
      "build_seconds": round(time.perf_counter() - t0, 2),
  }
  with open(os.path.join(out_dir, "bench_model.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


# ---------------------------------------------------------------------------------- checks
def logit_diff(out_dir: str, source: str = SHIPPED, num_prompts: int = 8) -> tuple[float, bool]:
  """(max |logit diff|, argmax equal everywhere) of the bench model vs the shipped one over
  the first test prompts, concatenated into one sequence."""
  model0 = os.path.join(source, "model")
  tok = load_tokenizer(model0)
  with open(os.path.join(source, "data", "test.jsonl")) as f:
    prompts = [json.loads(line)["prompt"] for line in f][:num_prompts]
  ids = jnp.asarray([sum((tok.encode(p) for p in prompts), [])], jnp.int32)
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  logits = []
  for path in (model0, os.path.join(out_dir, "model")):
    cfg, params = load_hf_model(path)
    logits.append(jax.jit(functools.partial(forward, cfg=cfg))(params, ids, pos).logits)
  diff = float(jnp.max(jnp.abs(logits[0] - logits[1])))
  same = bool(jnp.all(jnp.argmax(logits[0], -1) == jnp.argmax(logits[1], -1)))
  return diff, same


def step_times(model_dir: str, drafter_dir: str, ks=(5, 9, 17), *, context: int = 128,
               reps: int = 7, warmup: int = 2) -> dict:
  """Median seconds of cached batch-1 target forwards over 1 and k tokens, and of one drafter
  step, with `context` tokens committed (the engine's calls: cache donated, not advanced).
  The calls take turns within each repetition, so background load hits them alike."""
  cfg, params = load_hf_model(model_dir)
  params = jax.jit(unstack_layers)(params)  # the rollout replicas' layout
  dparams = load_drafter(drafter_dir, cfg)
  cache_len = context + max(ks) + 1

  @functools.partial(jax.jit, donate_argnums=(1,))
  def target(params, cache, tokens, positions):
    out = forward(params, tokens, positions, cfg=cfg, cache=cache)
    return out.cache, out.logits

  @functools.partial(jax.jit, donate_argnums=(2,))
  def draft(dparams, params, cache, tokens, hidden, positions):
    _, logits, cache = drafter_forward(dparams, params, tokens, hidden, positions, cfg=cfg,
                                       cache=cache)
    return cache, logits

  lengths = lambda: jnp.full((1,), context, jnp.int32)  # a fresh one per cache: donated
  calls = {}  # name -> [fn(state) -> (state, array to wait on), state]
  for k in (1,) + tuple(ks):
    toks = jnp.zeros((1, k), jnp.int32)
    pos = context + jnp.arange(k, dtype=jnp.int32)[None]
    calls[k] = [functools.partial(target, params, tokens=toks, positions=pos),
                init_cache(cfg, 1, cache_len).replace(lengths=lengths())]
  calls["drafter"] = [
      functools.partial(draft, dparams, params, tokens=jnp.zeros((1, 1), jnp.int32),
                        hidden=jnp.zeros((1, 1, cfg.hidden_size), cfg.compute_dtype),
                        positions=jnp.full((1, 1), context, jnp.int32)),
      drafter_cache(cfg, 1, cache_len).replace(lengths=lengths())]
  times = {name: [] for name in calls}
  for i in range(warmup + reps):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call[1], out = call[0](call[1])
      out.block_until_ready()
      if i >= warmup:
        times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def regime_report(out_dir: str, source: str = SHIPPED, ks=(5, 9, 17)) -> str:
  """The regime check as printed lines: 1-token forward time, k-token forwards and a drafter
  step as multiples of it, bench (out_dir) vs shipped (source)."""
  rows = []
  for name, base in (("bench", out_dir), ("shipped", source)):
    t = step_times(os.path.join(base, "model"), os.path.join(base, "drafter"), ks)
    ratios = "  ".join(f"k={k}: {t[k] / t[1]:.2f}x" for k in ks)
    rows.append(f"  {name:8s} 1-token forward {t[1] * 1e3:8.2f} ms | {ratios} | drafter step "
                f"{t['drafter'] / t[1]:.2f}x")
  head = (f"regime check ({jax.default_backend()}, batch 1, 128 cached tokens, median of 7; "
          "k-token target forward and drafter step as multiples of a 1-token target forward):")
  return "\n".join([head] + rows)


def load_target(target_dir: str | None = None, dtype: str | None = None):
  """A target ready to benchmark, the one loader of a model dir with its drafter: a built
  target (`build`'s out dir) or, None, the shipped default (tlt_jax/assets/default, the same
  layout): (cfg, params, dparams, tokenizer, stop tokens, the default task's test prompts as
  token ids). dtype: the compute and param dtype (None: the checkpoint's)."""
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.tokenizer import stop_token_ids
  root = target_dir or asset_path("default")
  model_dir, drafter_dir = (os.path.join(root, x) for x in ("model", "drafter"))
  kw = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
  cfg, params = load_hf_model(model_dir, **kw)
  dparams = load_drafter(drafter_dir, cfg)
  tok = load_tokenizer(model_dir)
  stop = tuple(stop_token_ids(model_dir, tok))
  rows, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  return cfg, params, dparams, tok, stop, [tok.encode(r.prompt) for r in rows]
