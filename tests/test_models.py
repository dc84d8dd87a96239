"""tlt_jax.models against Hugging Face transformers (PyTorch, CPU) as the independent reference.

Every checkpoint is a tiny random HF model whose EVERY tensor is randomised (HF's init leaves
biases at zero and norms at one, which would hide a mis-mapped bias or norm), saved with
`save_pretrained` (safetensors) and read back with `load_hf_model`.

Float32 tolerance: max|ours - hf| <= F32_TOL * max(1, max|hf|), with F32_TOL = 1e-4 (the same
metric as scripts/check_hf_parity.py); observed differences are ~1e-6 (summation order), while
any mapping bug is >= 1e-2.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tlt_jax.bench.hf_parity import UnloadableCheckpoint, check_parity
from tlt_jax.models import forward, init_cache, segment_causal_mask
from tlt_jax.models.hf_io import CheckpointFormatError, load_hf_model, save_hf_model
from tlt_jax.models.safetensors_io import (mmap_safetensors, read_safetensors_header,
                                           write_safetensors)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "check_hf_parity.py")
F32_TOL = 1e-4
# bfloat16 vs the float32 reference: bf16 rounds every activation (unit roundoff 2^-8 ~ 4e-3)
# and the rounding errors compound over the layers; ~1e-2 of the logit scale is observed on
# these 2-3 layer models, a mapping bug is O(1).
BF16_TOL = 5e-2
VOCAB = 128
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (arch, HF config kwargs). Together they cover: Qwen2 (qkv bias), Qwen3 (per-head q/k
# RMSNorm before RoPE, head_dim set apart from hidden/heads as on every Qwen3 size) and Llama;
# GQA (4 q / 2 kv, 8 q / 2 kv), MQA (kv=1), MHA (kv=heads); explicit head_dim != hidden/heads;
# tied and untied embeddings; Llama attention_bias (q/k/v/o biases); Llama-3 rope scaling;
# rope_theta 1e4 / 5e5 / 1e6; different rms_norm_eps.
CONFIGS = {
    "qwen2_gqa": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)),
    "qwen2_mqa_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1,
                                     rope_theta=1e4, tie_word_embeddings=True)),
    "llama_mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=5e5,
                                rms_norm_eps=1e-5)),
    "llama_hd24_bias_tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=24, attention_bias=True,
                                           tie_word_embeddings=True, num_hidden_layers=3)),
    # theta 1e4 with head_dim 16 puts rope wavelengths in all three llama3 bands
    # (6.3 < 8: kept, 19.9 in [8, 32]: blended, >= 63: divided by 8).
    "llama3_rope": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                  rope_theta=1e4, rope_scaling=dict(LLAMA3_ROPE))),
    # Qwen3-0.6B's shape in small: head_dim 32 != 64 / 4, tied embeddings, theta 1e6
    "qwen3_hd32_tied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3_gqa": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                rms_norm_eps=1e-5, num_hidden_layers=3)),
}

_fwd = jax.jit(forward, static_argnames=("cfg", "return_logits", "prefill", "kv_len"))
OBSERVED: dict[str, float] = {}  # check name -> max relative diff (printed with -s)


# ------------------------------------------------------------------------------------ helpers
def build_hf_checkpoint(path, arch, seed=0, **overrides):
  """Tiny random HF model with every tensor randomised, saved to `path`; returns the model."""
  kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  kw.update(overrides)
  config = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch](**kw)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
      else:  # weights AND biases
        p.normal_(0.0, 0.1)
  model.eval()
  model.save_pretrained(path)
  return model


def hf_logits(model, tokens):
  """HF logits [B, T, V] float32 numpy for a [T] or [B, T] token array (positions 0..T-1)."""
  ids = torch.as_tensor(np.atleast_2d(np.asarray(tokens)), dtype=torch.long)
  with torch.no_grad():
    return model(ids).logits.float().numpy()


def assert_close(ours, ref, tol=F32_TOL, what="logits"):
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
  assert np.all(np.isfinite(ours)), f"{what}: non-finite values"
  diff = float(np.max(np.abs(ours - ref)))
  rel = diff / max(1.0, float(np.max(np.abs(ref))))
  OBSERVED[what] = max(OBSERVED.get(what, 0.0), rel)
  assert rel <= tol, f"{what}: max|diff| {diff:.3e} = {rel:.3e} of logit scale > tol {tol:g}"


def rand_tokens(seed, *shape):
  return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)


def arange_positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


class Ckpt:
  def __init__(self, name, path, arch, hf_kwargs):
    self.name, self.path = name, str(path)
    self.hf = build_hf_checkpoint(self.path, arch, **hf_kwargs)
    self.cfg, self.params = load_hf_model(self.path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  cache = {}

  def get(name):
    if name not in cache:
      arch, kw = CONFIGS[name]
      cache[name] = Ckpt(name, tmp_path_factory.mktemp(name), arch, kw)
    return cache[name]
  return get


@pytest.fixture(scope="module", autouse=True)
def _report_observed():
  yield
  if OBSERVED:
    print("\nmax |diff| / max(1, |logit|) observed:")
    for k, v in sorted(OBSERVED.items()):
      print(f"  {k:45s} {v:.2e}")


# ------------------------------------------------------------------------- logits vs transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(ckpts, name):
  ck = ckpts(name)
  cfg = ck.cfg
  arch, kw = CONFIGS[name]
  # The loaded config reflects every feature under test.
  assert cfg.arch == arch
  assert cfg.num_heads == kw["num_attention_heads"]
  assert cfg.num_kv_heads == kw["num_key_value_heads"]
  assert cfg.head_dim_ == kw.get("head_dim", 64 // kw["num_attention_heads"])
  assert cfg.tie_word_embeddings == kw.get("tie_word_embeddings", False)
  assert ("lm_head" in ck.params) == (not cfg.tie_word_embeddings)
  assert cfg.qkv_bias == (arch == "qwen2" or kw.get("attention_bias", False))
  assert cfg.o_bias == kw.get("attention_bias", False)
  assert cfg.qk_norm == (arch == "qwen3")
  assert ({"q_norm", "k_norm"} <= set(ck.params["layers"])) == (arch == "qwen3")
  assert cfg.rope_theta == kw.get("rope_theta", 10000.0)  # HF default
  assert (cfg.rope_scaling is not None) == ("rope_scaling" in kw)
  if arch == "qwen2":
    assert set(ck.params["layers"]) >= {"q_bias", "k_bias", "v_bias"}

  tokens = rand_tokens(1, 2, 40)  # 40 > 32: past llama3's original_max_position_embeddings
  out = _fwd(ck.params, jnp.asarray(tokens), arange_positions(2, 40), cfg=cfg)
  assert out.logits.dtype == jnp.float32 and out.logits.shape == (2, 40, VOCAB)
  assert_close(out.logits, hf_logits(ck.hf, tokens), what=f"full forward [{name}]")

  if cfg.rope_scaling is not None:
    # transformers 5 writes the scaling (and rope_theta) under "rope_parameters".
    with open(os.path.join(ck.path, "config.json")) as f:
      rp = json.load(f)["rope_parameters"]
    assert rp["rope_type"] == "llama3" and rp["rope_theta"] == kw["rope_theta"]
    assert cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 32
    # The scaling must matter at these positions, or this test would not test it.
    plain = _fwd(ck.params, jnp.asarray(tokens), arange_positions(2, 40),
                 cfg=cfg.replace(rope_scaling=None)).logits
    assert float(jnp.max(jnp.abs(plain - out.logits))) > 1e-2


@pytest.mark.parametrize("name", ["qwen2_gqa", "llama_hd24_bias_tied"])
def test_hidden_is_post_final_norm(ckpts, name):
  """`out.hidden` is the last hidden state AFTER the final norm: the state vLLM's / SGLang's
  EAGLE-1 drafters read and HF's `last_hidden_state`.

  In transformers 5, `output_hidden_states=True` records each decoder layer's output, but its
  last entry is REPLACED by `last_hidden_state`, which is AFTER `model.norm` (`capture_outputs`
  with tie_last_hidden_states=True): it must equal out.hidden. The pre-norm residual, read with
  a forward pre-hook on `model.model.norm`, must differ from it (the norm weights are random).
  """
  ck = ckpts(name)
  tokens = rand_tokens(2, 2, 12)
  captured = {}
  handle = ck.hf.model.norm.register_forward_pre_hook(
      lambda mod, args: captured.__setitem__("pre", args[0].detach().clone()))
  try:
    with torch.no_grad():
      res = ck.hf(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
  finally:
    handle.remove()
  out = _fwd(ck.params, jnp.asarray(tokens), arange_positions(2, 12), cfg=ck.cfg)
  assert out.hidden.shape == (2, 12, ck.cfg.hidden_size)
  assert len(res.hidden_states) == ck.cfg.num_layers + 1
  assert_close(out.hidden, res.hidden_states[-1].numpy(), what=f"post-norm hidden [{name}]")
  assert float(np.max(np.abs(captured["pre"].numpy() - np.asarray(out.hidden)))) > 1e-2
  # The entries before the last are layer outputs: entry 0 is the embeddings.
  np.testing.assert_allclose(res.hidden_states[0].numpy(),
                             np.asarray(ck.params["embed"])[tokens], rtol=0, atol=0)


# ------------------------------------------------------------------------------- KV-cache paths
@pytest.mark.parametrize("name", ["qwen2_gqa", "llama3_rope", "qwen3_hd32_tied"])
def test_prefill_then_decode_equals_full_forward(ckpts, name):
  ck = ckpts(name)
  cfg, params = ck.cfg, ck.params
  b, t, prefix, max_len = 2, 40, 8, 48
  tokens = rand_tokens(3, b, t)
  full = _fwd(params, jnp.asarray(tokens), arange_positions(b, t), cfg=cfg).logits
  ref = hf_logits(ck.hf, tokens)

  cache = init_cache(cfg, b, max_len)
  # Garbage in never-written slots must be masked out, not merely be zero.
  noise = [jax.random.normal(jax.random.key(i), k.shape, k.dtype) for i, k in enumerate(cache.k)]
  cache = cache.replace(k=tuple(noise), v=tuple(-n for n in noise))
  pieces = []

  def step(cache, start, n):
    out = _fwd(params, jnp.asarray(tokens[:, start:start + n]), arange_positions(b, n, start),
               cfg=cfg, cache=cache)
    pieces.append(np.asarray(out.logits))
    assert out.cache.lengths.tolist() == cache.lengths.tolist()  # forward never commits
    return out.cache.replace(lengths=cache.lengths + n)

  cache = step(cache, 0, prefix)           # prefill
  cache = step(cache, prefix, 4)           # a 4-token chunk (causal within the chunk)
  for pos in range(prefix + 4, t):          # then token by token
    cache = step(cache, pos, 1)
  assert cache.lengths.tolist() == [t, t]
  got = np.concatenate(pieces, axis=1)
  assert_close(got, full, tol=1e-5, what=f"cache vs full forward (ours) [{name}]")
  assert_close(got, ref, what=f"cache decode vs transformers [{name}]")


@pytest.mark.parametrize("name", ["qwen2_gqa", "llama3_rope", "qwen3_hd32_tied"])
def test_prefill_within_the_prompt_then_decode_matches_transformers(ckpts, name):
  """forward(prefill=True) attends within the prompt only (never over the cache's other
  slots, here filled with noise): its logits, the k/v it writes, and a decode step after it
  equal the cache-wide path and transformers."""
  ck = ckpts(name)
  cfg, params = ck.cfg, ck.params
  b, t, p, max_len = 2, 24, 16, 40
  tokens = rand_tokens(5, b, t)
  ref = hf_logits(ck.hf, tokens)
  cache = init_cache(cfg, b, max_len)
  noise = [jax.random.normal(jax.random.key(i), k.shape, k.dtype) for i, k in enumerate(cache.k)]
  cache = cache.replace(k=tuple(noise), v=tuple(-n for n in noise))
  args = (params, jnp.asarray(tokens[:, :p]), arange_positions(b, p))
  fresh = _fwd(*args, cfg=cfg, cache=cache, prefill=True)
  wide = _fwd(*args, cfg=cfg, cache=cache)
  assert_close(fresh.logits, wide.logits, tol=1e-6, what=f"prefill vs cache-wide [{name}]")
  assert_close(fresh.logits, ref[:, :p], what=f"prefill vs transformers [{name}]")
  for a, w in zip(fresh.cache.k + fresh.cache.v, wide.cache.k + wide.cache.v):
    np.testing.assert_allclose(np.asarray(a)[:, :p], np.asarray(w)[:, :p], rtol=1e-5, atol=1e-5)
  cache = fresh.cache.replace(lengths=jnp.full((b,), p, jnp.int32))
  for pos in range(p, t):
    out = _fwd(params, jnp.asarray(tokens[:, pos:pos + 1]), arange_positions(b, 1, pos),
               cfg=cfg, cache=cache)
    assert_close(out.logits, ref[:, pos:pos + 1], what=f"decode after prefill [{name}]")
    cache = out.cache.replace(lengths=cache.lengths + 1)


@pytest.mark.parametrize("window", [False, True])
def test_ragged_batch_matches_each_sequence_alone(ckpts, window):
  """Right-padded prompts of different lengths in one batch, so every row has its own
  cache.lengths, give each sequence's logits from transformers run alone. window: the decode
  chunks attend over the tightest window (the longest row's length + the chunk: kv_len),
  not the cache's 24 slots."""
  ck = ckpts("llama_hd24_bias_tied")
  cfg, params = ck.cfg, ck.params
  lens = np.array([7, 3, 10], np.int32)
  b, t, n_dec = len(lens), int(lens.max()), 3
  seqs = [rand_tokens(10 + r, int(lens[r]) + n_dec + 1) for r in range(b)]  # prompt + decode
  refs = [hf_logits(ck.hf, s)[0] for s in seqs]
  prompts = np.full((b, t), 5, np.int32)  # pad token 5: a real token, not special
  for r in range(b):
    prompts[r, :lens[r]] = seqs[r][:lens[r]]

  cache = init_cache(cfg, b, 24)
  out = _fwd(params, jnp.asarray(prompts), arange_positions(b, t), cfg=cfg, cache=cache)
  for r in range(b):
    assert_close(np.asarray(out.logits)[r, :lens[r]], refs[r][:lens[r]],
                 what="ragged prefill vs transformers per sequence")
  cache = out.cache.replace(lengths=jnp.asarray(lens))  # commit only the real tokens

  # A 2-token chunk, then single tokens: each row writes at its own slots (overwriting its
  # padding) with its own positions.
  length = lens.copy()
  for n in (2, 1, 1):
    chunk = np.stack([seqs[r][length[r]:length[r] + n] for r in range(b)]).astype(np.int32)
    pos = length[:, None] + np.arange(n)[None, :]
    kv_len = int(length.max()) + n if window else None
    out = _fwd(params, jnp.asarray(chunk), jnp.asarray(pos, jnp.int32), cfg=cfg, cache=cache,
               kv_len=kv_len)
    for r in range(b):
      assert_close(np.asarray(out.logits)[r], refs[r][length[r]:length[r] + n],
                   what="ragged decode vs transformers per sequence")
    length = length + n
    cache = out.cache.replace(lengths=jnp.asarray(length))


# Token tree: node -> parent. Node 3 (child of 1) comes after node 2 (child of 0), so a causal
# mask would wrongly let it see node 2; node 4 is a grandchild via the other branch.
TREE_PARENTS = [-1, 0, 0, 1, 2]


def _tree_paths(parents):
  paths = []
  for i in range(len(parents)):
    path, j = [], i
    while j >= 0:
      path.append(j)
      j = parents[j]
    paths.append(path[::-1])
  return paths


def _tree_mask(parents):
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i, path in enumerate(_tree_paths(parents)):
    mask[i, path] = True
  return mask


@pytest.mark.parametrize("name,kv_len", [("qwen2_gqa", None), ("llama3_rope", None),
                                         ("qwen3_hd32_tied", 38),
                                         ("qwen2_gqa", 38)])
def test_tree_attention_with_cache(ckpts, name, kv_len):
  """Each tree node's logits equal transformers' on the linear path prefix -> root -> node.
  Rows have different committed prefix lengths; positions are prefix length + depth. kv_len
  38: attention over the tightest window (longest prefix 33 + 5 nodes) of the 48 slots."""
  ck = ckpts(name)
  cfg, params = ck.cfg, ck.params
  prefix_lens = np.array([5, 33], np.int32)  # 33 + depth: past 32 for the llama3 rope
  b, n = len(prefix_lens), len(TREE_PARENTS)
  prefixes = [rand_tokens(20 + r, int(prefix_lens[r])) for r in range(b)]
  tree_tokens = rand_tokens(30, b, n)
  paths = _tree_paths(TREE_PARENTS)
  depth = np.array([len(p) - 1 for p in paths], np.int32)

  t = int(prefix_lens.max())
  padded = np.zeros((b, t), np.int32)
  for r in range(b):
    padded[r, :prefix_lens[r]] = prefixes[r]
  cache = init_cache(cfg, b, 48)
  cache = _fwd(params, jnp.asarray(padded), arange_positions(b, t), cfg=cfg,
               cache=cache).cache.replace(lengths=jnp.asarray(prefix_lens))

  mask = jnp.asarray(np.broadcast_to(_tree_mask(TREE_PARENTS), (b, n, n)))
  positions = jnp.asarray(prefix_lens[:, None] + depth[None, :])
  out = _fwd(params, jnp.asarray(tree_tokens), positions, cfg=cfg, cache=cache, attn_mask=mask,
             kv_len=kv_len)
  logits = np.asarray(out.logits)
  for r in range(b):
    for i, path in enumerate(paths):
      seq = np.concatenate([prefixes[r], tree_tokens[r, path]])
      assert_close(logits[r, i], hf_logits(ck.hf, seq)[0, -1],
                   what=f"tree node (cache) vs transformers path [{name}]")

  if kv_len is not None:
    # Power: a window one slot short hides the last node's own k/v from the longest row.
    short = _fwd(params, jnp.asarray(tree_tokens), positions, cfg=cfg, cache=cache,
                 attn_mask=mask, kv_len=kv_len - 1)
    assert np.abs(np.asarray(short.logits)[1, -1] - logits[1, -1]).max() > 1e-3
    return
  # The same tree without a cache: one chunk [prefix | tree] with a causal-prefix + tree mask
  # and explicit positions (row 0 only).
  p = int(prefix_lens[0])
  full_mask = np.zeros((p + n, p + n), bool)
  full_mask[:p, :p] = np.tril(np.ones((p, p), bool))
  full_mask[p:, :p] = True
  full_mask[p:, p:] = _tree_mask(TREE_PARENTS)
  toks = np.concatenate([prefixes[0], tree_tokens[0]])[None]
  pos = np.concatenate([np.arange(p), p + depth])[None].astype(np.int32)
  out = _fwd(params, jnp.asarray(toks), jnp.asarray(pos), cfg=cfg,
             attn_mask=jnp.asarray(full_mask[None]))
  for i, path in enumerate(paths):
    seq = np.concatenate([prefixes[0], tree_tokens[0, path]])
    assert_close(np.asarray(out.logits)[0, p + i], hf_logits(ck.hf, seq)[0, -1],
                 what=f"tree node (no cache) vs transformers path [{name}]")


def test_packed_segments_equal_separate_sequences(ckpts):
  ck = ckpts("qwen2_mqa_tied")
  cfg, params = ck.cfg, ck.params
  rows = [[5, 7], [9, 6]]  # segment lengths per packed row
  t = 16
  tokens = np.zeros((2, t), np.int32)
  seg = np.zeros((2, t), np.int32)
  pos = np.zeros((2, t), np.int32)
  seqs = []
  for r, lens in enumerate(rows):
    start = 0
    for s, n in enumerate(lens):
      toks = rand_tokens(40 + 10 * r + s, n)
      tokens[r, start:start + n] = toks
      seg[r, start:start + n] = s + 1
      pos[r, start:start + n] = np.arange(n)  # positions restart at 0 per segment
      seqs.append((r, start, toks))
      start += n
  mask = segment_causal_mask(jnp.asarray(seg))
  out = _fwd(params, jnp.asarray(tokens), jnp.asarray(pos), cfg=cfg, attn_mask=mask)
  logits = np.asarray(out.logits)
  # Padding queries (segment 0) see nothing; they must still be finite (no NaN in the loss).
  assert np.all(np.isfinite(logits))
  for r, start, toks in seqs:
    assert_close(logits[r, start:start + len(toks)], hf_logits(ck.hf, toks)[0],
                 what="packed segment vs transformers alone")


# ----------------------------------------------------------------------------------- bfloat16
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_bfloat16_close_to_float32(ckpts, param_dtype):
  ck = ckpts("qwen2_gqa")
  cfg, params = load_hf_model(ck.path, dtype="bfloat16", param_dtype=param_dtype)
  assert cfg.dtype == "bfloat16" and cfg.param_dtype == param_dtype
  assert all(x.dtype == jnp.dtype(param_dtype) for x in jax.tree.leaves(params))
  tokens = rand_tokens(4, 2, 24)
  ref = hf_logits(ck.hf, tokens)  # float32 reference
  out = _fwd(params, jnp.asarray(tokens), arange_positions(2, 24), cfg=cfg)
  assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
  assert_close(out.logits, ref, tol=BF16_TOL, what=f"bf16 compute, {param_dtype} params")
  if param_dtype != "bfloat16":
    return
  # The bf16 KV-cache path (cache in bf16) too: prefill 16, then decode 8 one at a time.
  cache = init_cache(cfg, 2, 24)
  assert all(k.dtype == jnp.bfloat16 for k in cache.k + cache.v)
  res = _fwd(params, jnp.asarray(tokens[:, :16]), arange_positions(2, 16), cfg=cfg, cache=cache)
  pieces, cache = [np.asarray(res.logits)], res.cache.replace(lengths=jnp.full((2,), 16))
  for p in range(16, 24):
    res = _fwd(params, jnp.asarray(tokens[:, p:p + 1]), arange_positions(2, 1, p), cfg=cfg,
               cache=cache)
    pieces.append(np.asarray(res.logits))
    cache = res.cache.replace(lengths=cache.lengths + 1)
  assert_close(np.concatenate(pieces, 1), ref, tol=BF16_TOL,
               what="bf16 cache decode")


# ------------------------------------------------------------------------- save / load round trip
def _assert_params_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["qwen2_gqa", "llama_hd24_bias_tied", "llama3_rope",
                                  "qwen3_gqa"])
def test_save_round_trip_through_transformers(ckpts, name, tmp_path):
  ck = ckpts(name)
  out_dir = str(tmp_path / "export")
  save_hf_model(ck.params, ck.cfg, out_dir)
  assert os.listdir(out_dir) and os.path.exists(os.path.join(out_dir, "model.safetensors"))
  hf2 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
  # transformers sees exactly the original weights (tying, biases, rope config included).
  assert hf2.config.tie_word_embeddings == ck.cfg.tie_word_embeddings
  if ck.cfg.rope_scaling is not None:  # our legacy "rope_scaling" key is understood by HF 5
    assert hf2.config.rope_parameters["rope_type"] == "llama3"
    assert hf2.config.rope_parameters["rope_theta"] == ck.cfg.rope_theta
  sd1, sd2 = ck.hf.state_dict(), hf2.state_dict()
  assert set(sd1) == set(sd2)
  for k in sd1:
    assert torch.equal(sd1[k], sd2[k]), k
  tokens = rand_tokens(5, 2, 40)
  ours = _fwd(ck.params, jnp.asarray(tokens), arange_positions(2, 40), cfg=ck.cfg).logits
  assert_close(ours, hf_logits(hf2, tokens), what=f"saved -> transformers [{name}]")
  np.testing.assert_array_equal(hf_logits(hf2, tokens), hf_logits(ck.hf, tokens))
  cfg2, params2 = load_hf_model(out_dir)
  # The export always writes head_dim explicitly; everything else is identical.
  assert cfg2.head_dim_ == ck.cfg.head_dim_
  assert cfg2.replace(head_dim=ck.cfg.head_dim) == ck.cfg
  _assert_params_equal(params2, ck.params)


def test_sharded_save_with_index(ckpts, tmp_path):
  ck = ckpts("qwen2_gqa")
  out_dir = str(tmp_path / "sharded")
  save_hf_model(ck.params, ck.cfg, out_dir, max_shard_bytes=40_000)
  files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
  assert len(files) > 2 and "model.safetensors" not in files
  with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
    index = json.load(f)
  assert sorted(set(index["weight_map"].values())) == files
  assert set(index["weight_map"]) == set(ck.hf.state_dict())
  for fname in files:  # each tensor lives in the shard the index says
    names = set(read_safetensors_header(os.path.join(out_dir, fname))[0])
    assert names == {k for k, v in index["weight_map"].items() if v == fname}

  cfg2, params2 = load_hf_model(out_dir)
  _assert_params_equal(params2, ck.params)
  hf2 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
  tokens = rand_tokens(6, 2, 16)
  np.testing.assert_array_equal(hf_logits(hf2, tokens), hf_logits(ck.hf, tokens))

  # Re-saving unsharded into the same directory removes the stale shards and index.
  save_hf_model(ck.params, ck.cfg, out_dir)
  assert sorted(f for f in os.listdir(out_dir) if "safetensors" in f) == ["model.safetensors"]
  _assert_params_equal(load_hf_model(out_dir)[1], ck.params)


def test_bfloat16_save_round_trip(ckpts, tmp_path):
  ck = ckpts("llama_hd24_bias_tied")
  out_dir = str(tmp_path / "bf16")
  save_hf_model(ck.params, ck.cfg, out_dir, dtype="bfloat16")
  header, _ = read_safetensors_header(os.path.join(out_dir, "model.safetensors"))
  assert {v["dtype"] for v in header.values()} == {"BF16"}
  with open(os.path.join(out_dir, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"

  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), ck.params)
  cfg2, params2 = load_hf_model(out_dir)  # upcast to float32 params on load
  _assert_params_equal(params2, rounded)
  _, params_bf16 = load_hf_model(out_dir, param_dtype="bfloat16")
  _assert_params_equal(params_bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), ck.params))

  hf2 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
  tokens = rand_tokens(7, 2, 16)
  ours = _fwd(params2, jnp.asarray(tokens), arange_positions(2, 16), cfg=cfg2).logits
  assert_close(ours, hf_logits(hf2, tokens), what="bf16-saved -> transformers (f32 compute)")


# ------------------------------------------------------------------------------------ errors
def _copy_ckpt(ck, tmp_path, name="copy"):
  dst = str(tmp_path / name)
  shutil.copytree(ck.path, dst)
  return dst


def _edit_config(path, **changes):
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    d = json.load(f)
  d.update(changes)
  with open(cfg_path, "w") as f:
    json.dump(d, f)


def _rewrite_tensors(path, fn):
  st = os.path.join(path, "model.safetensors")
  tensors = {k: np.array(v) for k, v in mmap_safetensors(st).items()}
  write_safetensors(st, fn(tensors))


def test_error_missing_dir(tmp_path):
  with pytest.raises(CheckpointFormatError, match="does not exist"):
    load_hf_model(str(tmp_path / "nope"))


def test_error_no_config_json(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(CheckpointFormatError, match="no config.json"):
    load_hf_model(str(tmp_path))


def test_error_unsupported_model_type(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
               "n_layer": 2, "n_head": 4, "vocab_size": VOCAB}, f)
  with pytest.raises(CheckpointFormatError) as e:  # caught as a user error by the CLIs
    load_hf_model(str(tmp_path))
  msg = str(e.value)
  assert "'gpt2'" in msg and "not supported" in msg and "GPT2LMHeadModel" in msg


def test_error_missing_config_key(ckpts, tmp_path):
  path = _copy_ckpt(ckpts("qwen2_gqa"), tmp_path)
  with open(os.path.join(path, "config.json")) as f:
    d = json.load(f)
  del d["num_hidden_layers"]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(d, f)
  with pytest.raises(CheckpointFormatError, match="required key 'num_hidden_layers' is missing"):
    load_hf_model(path)


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors.index.json"])
def test_error_corrupt_json(ckpts, tmp_path, victim):
  ck = ckpts("qwen2_gqa")
  path = str(tmp_path / "sharded")
  save_hf_model(ck.params, ck.cfg, path, max_shard_bytes=40_000)
  with open(os.path.join(path, victim), "r+") as f:
    text = f.read()
    f.seek(0)
    f.write(text[:len(text) // 2])  # a download or copy cut in the middle
    f.truncate()
  with pytest.raises(CheckpointFormatError, match=re.escape(victim)) as e:
    load_hf_model(path)
  assert str(e.value).count("\n") == 0


@pytest.mark.parametrize("changes,needle", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": None},
     "rope_scaling type 'linear' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_error_unsupported_features(ckpts, tmp_path, changes, needle):
  path = _copy_ckpt(ckpts("qwen2_gqa"), tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(CheckpointFormatError, match="config.json") as e:
    load_hf_model(path)
  assert needle in str(e.value)


def test_error_no_safetensors(ckpts, tmp_path):
  path = _copy_ckpt(ckpts("qwen2_gqa"), tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  (tmp_path / "copy" / "pytorch_model.bin").write_bytes(b"\0")
  with pytest.raises(CheckpointFormatError) as e:
    load_hf_model(path)
  assert "no *.safetensors" in str(e.value) and "pytorch_model.bin" in str(e.value)


def test_error_index_lists_missing_shard(ckpts, tmp_path):
  ck = ckpts("qwen2_gqa")
  path = str(tmp_path / "sharded")
  save_hf_model(ck.params, ck.cfg, path, max_shard_bytes=40_000)
  victim = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
  os.remove(os.path.join(path, victim))
  with pytest.raises(CheckpointFormatError, match=re.escape(f"lists {victim}, which is missing")):
    load_hf_model(path)


@pytest.mark.parametrize("field,value,tensor", [
    ("hidden_size", 96, "model.embed_tokens.weight"),
    ("intermediate_size", 64, "model.layers.0.mlp.gate_proj.weight"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight"),
])
def test_error_shape_mismatch(ckpts, tmp_path, field, value, tensor):
  path = _copy_ckpt(ckpts("qwen2_gqa"), tmp_path)
  _edit_config(path, **{field: value})
  with pytest.raises(CheckpointFormatError) as e:
    load_hf_model(path)
  msg = str(e.value)
  assert repr(tensor) in msg and "has shape" in msg and "config.json" in msg


@pytest.mark.parametrize("name,tensor", [
    ("qwen2_gqa", "model.layers.1.self_attn.v_proj.bias"),
    ("qwen2_gqa", "lm_head.weight"),
    ("llama_hd24_bias_tied", "model.layers.2.self_attn.o_proj.bias"),
    ("llama_mha", "model.norm.weight"),
])
def test_error_missing_tensor(ckpts, tmp_path, name, tensor):
  path = _copy_ckpt(ckpts(name), tmp_path)
  _rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != tensor})
  with pytest.raises(CheckpointFormatError) as e:
    load_hf_model(path)
  assert repr(tensor) in str(e.value) and "is missing" in str(e.value)


# ------------------------------------------------------------------- scripts/check_hf_parity.py
def test_parity_script(ckpts, tmp_path):
  """Passes on good Qwen2/Llama checkpoints; fails (non-zero) on corrupted ones.

  The three subprocess runs (the CLI: output and exit status) go concurrently; more failure
  modes run in-process through tlt_jax.bench.hf_parity meanwhile, which saves the seconds of
  importing torch + transformers + jax per process.
  """
  good_q, good_l = ckpts("qwen2_gqa"), ckpts("llama3_rope")
  # Corrupted: tied config, but the file also carries a perturbed lm_head.weight (written with
  # write_safetensors). transformers 5 then does NOT tie ("both are present in the checkpoints
  # with different values, so we will NOT tie them") and uses the file's lm_head, while
  # tlt_jax ties (a tied config never reads lm_head.weight): the logits differ.
  tied = _copy_ckpt(ckpts("qwen2_mqa_tied"), tmp_path, "tied_bad_head")
  _rewrite_tensors(tied, lambda t: {**t, "lm_head.weight":
                                    t["model.embed_tokens.weight"] + np.float32(0.05)})
  runs = {
      "qwen2": [good_q.path, "--seq", "40"],
      "llama3": [good_l.path, "--seq", "40", "--batch", "3"],
      "tied_bad_head": [tied, "--no-ragged"],
  }
  env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
  procs = {k: subprocess.Popen([sys.executable, SCRIPT, "--model", *args], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for k, args in runs.items()}
  try:
    # Corrupted: a NaN in one weight. Both sides agree on NaN logits, which must still fail
    # (a plain `diff > tol` test would pass NaN).
    nan = _copy_ckpt(good_l, tmp_path, "nan")

    def poison(t):
      w = t["model.layers.1.mlp.down_proj.weight"].copy()
      w[3, 5] = np.nan
      return {**t, "model.layers.1.mlp.down_proj.weight": w}
    _rewrite_tensors(nan, poison)
    report = check_parity(nan, ragged=False)
    assert report.failures == ["full batch"] and report.checks[0].finite == (False, False)
    assert report.greedy is None
    # Unloadable checkpoints: UnloadableCheckpoint (the CLI's exit status 2) with the reason.
    with pytest.raises(UnloadableCheckpoint, match="does not exist"):
      check_parity(str(tmp_path / "does_not_exist"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnloadableCheckpoint, match="'gpt2'"):
      check_parity(str(gpt2))
  finally:
    res = {k: (p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for k, p in procs.items()}

  for k in ("qwen2", "llama3"):
    rc, out, err = res[k]
    assert rc == 0, f"{k}: rc={rc}\n{out}\n{err[-3000:]}"
    assert "max|diff|" in out and "PARITY OK" in out
    assert "ragged decode step (cache)" in out
    assert "greedy next tokens: agree" in out
  assert "llama, 2 layers" in res["llama3"][1] and "rope_scaling=llama3" in res["llama3"][1]
  assert "qwen2, 2 layers" in res["qwen2"][1]

  rc, out, err = res["tied_bad_head"]
  assert rc == 1, f"rc={rc}\n{out}\n{err[-3000:]}"
  assert "FAIL" in out and "PARITY FAILED: full batch" in out


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("name", ["qwen2_gqa", "llama_hd24_bias_tied", "qwen3_gqa"])
def test_unstacked_layers_match_transformers(ckpts, name, fused):
  """The rollout replicas' layout (models.unstack_layers: one dict per layer; fused: one qkv
  and one gate/up matmul a layer, models.fuse_projections) through the full forward
  (prompt_hidden) and the cached forward (prefill, decode) gives transformers' logits."""
  from tlt_jax.models import fuse_projections, unstack_layers
  ck = ckpts(name)
  cfg = ck.cfg
  params = jax.jit(unstack_layers)(ck.params)
  assert isinstance(params["layers"], tuple) and len(params["layers"]) == cfg.num_layers
  if fused:
    params = fuse_projections(params, cfg)
    assert {"qkv", "gate_up"} <= set(params["layers"][0]) and "q" not in params["layers"][0]
  tokens = rand_tokens(3, 2, 12)
  want = hf_logits(ck.hf, tokens)
  full = forward(params, jnp.asarray(tokens), arange_positions(2, 12), cfg=cfg).logits
  assert_close(full, want, what=f"unstacked full forward [{name}]")
  cache = init_cache(cfg, 2, 16)
  out = forward(params, jnp.asarray(tokens[:, :8]), arange_positions(2, 8), cfg=cfg,
                cache=cache, prefill=True)
  cache = out.cache.replace(lengths=jnp.full((2,), 8, jnp.int32))
  pos = jnp.asarray(np.broadcast_to(np.arange(8, 12), (2, 4)), jnp.int32)
  step = forward(params, jnp.asarray(tokens[:, 8:]), pos, cfg=cfg, cache=cache).logits
  assert_close(jnp.concatenate([out.logits, step], axis=1), want,
               what=f"unstacked cached forward [{name}]")
