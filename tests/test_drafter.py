"""tlt_jax.drafter: EAGLE drafter forward / cache / loss / unroll / training / I/O / export.

Independent references: transformers' Qwen2DecoderLayer / LlamaDecoderLayer (float64, input
norm replaced by Identity) loaded from OUR EAGLE export with safetensors' own torch reader (so
that test checks the layer math and the exported layout at once), and float64 numpy for the
loss. Targets are tiny random models built in-process.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tlt_jax.drafter import (DrafterLoadError, LossConfig, accept_lengths, chain_drafts,
                             check_drafter_params, drafter_cache, drafter_forward,
                             drafter_loss, drafter_param_shapes, export_eagle, init_drafter,
                             load_drafter, loss_terms, save_drafter)
from tlt_jax.drafter.loss import chain_window_mask
from tlt_jax.models import ModelConfig, compute_logits, forward, init_params, param_shapes
from tlt_jax.models.attention import segment_causal_mask
from tlt_jax.optim import make_optimizer
from user_env import user_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4

QWEN = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True, rope_theta=1e4)
LLAMA = ModelConfig(arch="llama", vocab_size=48, hidden_size=48, intermediate_size=80,
                    num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, qkv_bias=True,
                    o_bias=True, rope_theta=5e5, rms_norm_eps=1e-5)

_fwd = jax.jit(drafter_forward, static_argnames=("cfg", "return_logits"))


def randomize(tree, key, scale=0.2):
  """Every leaf random (norms around 1, biases non-zero): a mis-mapped tensor cannot hide."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys = jax.random.split(key, len(leaves))
  out = []
  for (path, x), k in zip(leaves, keys):
    noise = scale * jax.random.normal(k, x.shape, jnp.float32)
    out.append((1.0 + noise) if "norm" in jax.tree_util.keystr(path) else noise)
  return jax.tree_util.tree_unflatten(treedef, out)


def setup(cfg=QWEN, b=2, t=12, seed=0):
  tp = init_params(cfg, jax.random.key(seed), std=0.2)
  dp = randomize(init_drafter(cfg, jax.random.key(seed + 1)), jax.random.key(seed + 2))
  k1, k2 = jax.random.split(jax.random.key(seed + 3))
  tokens = jax.random.randint(k1, (b, t), 0, cfg.vocab_size, jnp.int32)
  hidden = jax.random.normal(k2, (b, t, cfg.hidden_size), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) + 3
  return tp, dp, tokens, hidden, positions


def close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
  assert err <= tol, err


# --------------------------------------------------------------------------- params / forward
@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen2", "llama_bias"])
def test_params_hold_only_fc_and_one_layer_without_input_norm(cfg):
  dp = init_drafter(cfg, jax.random.key(0))
  assert set(dp) == {"fc", "layers"}
  target_layers = set(param_shapes(cfg)["layers"])
  assert set(dp["layers"]) == target_layers - {"attn_norm"}
  assert all(v.shape[0] == 1 for v in dp["layers"].values())
  assert dp["fc"].shape == (2 * cfg.hidden_size, cfg.hidden_size)
  assert jax.tree.map(lambda x: tuple(x.shape), dp) == jax.tree.map(
      tuple, drafter_param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  # fc keeps the scale of its input: unit-variance [emb, hidden] -> ~unit-variance output
  x = jax.random.normal(jax.random.key(1), (4096, 2 * cfg.hidden_size))
  assert 0.8 < float(jnp.std(x @ dp["fc"])) < 1.2
  np.testing.assert_array_equal(dp["layers"]["mlp_norm"], 1.0)
  check_drafter_params(dp, cfg)


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen2", "llama_bias"])
def test_layer_matches_transformers_decoder_layer_from_eagle_export(cfg, tmp_path):
  """fc + HF decoder layer (input_layernorm = Identity), float64, weights read from our EAGLE
  export with safetensors.torch: checks the layer math and the export layout together."""
  import torch
  from safetensors.torch import load_file
  from transformers import LlamaConfig, Qwen2Config
  from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
  from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

  tp, dp, tokens, hidden, positions = setup(cfg)
  g, logits, _ = _fwd(dp, tp, tokens, hidden, positions, cfg=cfg)

  export_eagle(str(tmp_path), dp, cfg)
  hf_dict = json.load(open(tmp_path / "config.json"))
  hf_dict.pop("architectures")
  if cfg.arch == "qwen2":
    hcfg, Layer, Rope = Qwen2Config(**hf_dict), Qwen2DecoderLayer, Qwen2RotaryEmbedding
  else:
    hcfg, Layer, Rope = LlamaConfig(**hf_dict), LlamaDecoderLayer, LlamaRotaryEmbedding
  hcfg._attn_implementation = "eager"
  sd = load_file(str(tmp_path / "model.safetensors"))
  fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True).double()
  fc.load_state_dict({"weight": sd.pop("fc.weight"), "bias": sd.pop("fc.bias")})
  layer = Layer(hcfg, 0).double().eval()
  layer.input_layernorm = torch.nn.Identity()
  layer.load_state_dict({k[len("layers.0."):]: v.double() for k, v in sd.items()}, strict=True)
  rope = Rope(config=hcfg).double()

  emb = torch.from_numpy(np.asarray(tp["embed"], np.float64))[torch.from_numpy(
      np.asarray(tokens, np.int64))]
  x = fc(torch.cat([emb, torch.from_numpy(np.asarray(hidden, np.float64))], -1))
  pos = torch.from_numpy(np.asarray(positions, np.int64))
  t = tokens.shape[1]
  mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
  with torch.no_grad():
    cos, sin = rope(x, pos)
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
  ref = (out[0] if isinstance(out, tuple) else out).numpy()
  close(g, ref)
  # the target's LM head on hidden + residual with no norm (the engines' convention)
  head = (np.asarray(tp["embed"], np.float64).T if cfg.tie_word_embeddings
          else np.asarray(tp["lm_head"], np.float64))
  close(logits, ref @ head)


def test_cache_token_by_token_equals_no_cache():
  cfg = QWEN
  tp, dp, tokens, hidden, positions = setup(cfg, b=2, t=10)
  g_full, l_full, _ = _fwd(dp, tp, tokens, hidden, positions, cfg=cfg)
  cache = drafter_cache(cfg, 2, 16)
  assert len(cache.k) == 1 and cache.rows(0).shape == (2, 16, cfg.num_kv_heads, cfg.head_dim_)
  gs, ls = [], []
  for i in range(tokens.shape[1]):
    g, lg, cache = _fwd(dp, tp, tokens[:, i:i + 1], hidden[:, i:i + 1], positions[:, i:i + 1],
                        cfg=cfg, cache=cache)
    cache = cache.replace(lengths=cache.lengths + 1)  # the caller commits
    gs.append(g)
    ls.append(lg)
  close(jnp.concatenate(gs, 1), g_full)
  close(jnp.concatenate(ls, 1), l_full)
  # a 4-token prefill then a 6-token chunk also matches
  cache = drafter_cache(cfg, 2, 16)
  g1, _, cache = _fwd(dp, tp, tokens[:, :4], hidden[:, :4], positions[:, :4], cfg=cfg,
                      cache=cache)
  cache = cache.replace(lengths=cache.lengths + 4)
  g2, _, _ = _fwd(dp, tp, tokens[:, 4:], hidden[:, 4:], positions[:, 4:], cfg=cfg, cache=cache)
  close(jnp.concatenate([g1, g2], 1), g_full)
  _, none, _ = _fwd(dp, tp, tokens, hidden, positions, cfg=cfg, return_logits=False)
  assert none is None


def test_uses_target_embedding_and_head_passed_in():
  """Changing the target's embedding / head changes the drafter's outputs: they are read from
  target_params at every call, not copies."""
  cfg = QWEN
  tp, dp, tokens, hidden, positions = setup(cfg)
  g, lg, _ = _fwd(dp, tp, tokens, hidden, positions, cfg=cfg)
  tp2 = dict(tp, embed=tp["embed"] * 2.0)
  g2, lg2, _ = _fwd(dp, tp2, tokens, hidden, positions, cfg=cfg)
  assert float(jnp.max(jnp.abs(g2 - g))) > 1e-3
  # the logits are exactly the target's head on g (no norm)
  close(lg, compute_logits(tp, g, cfg), 1e-6)


# ------------------------------------------------------------------------------------- loss
def np_loss_terms(g, dl, f, tl, m, w_v, w_p, beta=1.0):
  g, dl, f, tl, m = (np.asarray(a, np.float64) for a in (g, dl, f, tl, m))
  d = g - f
  sl1 = np.where(np.abs(d) < beta, 0.5 * d * d / beta, np.abs(d) - 0.5 * beta).mean(-1)
  p = np.exp(tl - tl.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  logq = dl - dl.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  ce = -(p * logq).sum(-1)
  n = m.sum()
  v, c = (sl1 * m).sum() / n, (ce * m).sum() / n
  acc = ((dl.argmax(-1) == tl.argmax(-1)) * m).sum() / n
  return w_v * v + w_p * c, v, c, acc


def test_loss_terms_match_numpy_float64():
  rng = np.random.default_rng(0)
  b, t, d, v = 3, 7, 16, 11
  g = rng.normal(size=(b, t, d)) * 1.5  # both SmoothL1 branches (|x| < 1 and >= 1)
  f = rng.normal(size=(b, t, d)) * 1.5
  dl, tl = rng.normal(size=(b, t, v)) * 2, rng.normal(size=(b, t, v)) * 2
  m = (rng.random((b, t)) < 0.6).astype(np.float32)
  for w_v, w_p in [(1.0, 0.1), (0.5, 2.0)]:
    out = loss_terms(*(jnp.asarray(a, jnp.float32) for a in (g, dl, f, tl)), jnp.asarray(m),
                     w_v=w_v, w_p=w_p)
    ref = np_loss_terms(g, dl, f, tl, m, w_v, w_p)
    for name, r in zip(("loss", "vloss", "ploss", "acc"), ref):
      np.testing.assert_allclose(float(out[name]), r, rtol=1e-5, err_msg=name)
  assert float(out["tokens"]) == m.sum()


def packed_batch(cfg, tp, seed=0):
  """Two rows: [seq A (P=3, len 7) | seq B (P=2, len 6) | pad 3] and [seq C (P=1, len 9) |
  seq D (P=4, len 7)] with the target's real hidden states."""
  rng = np.random.default_rng(seed)
  layout = [[(3, 7), (2, 6)], [(1, 9), (4, 7)]]
  t = 16
  batch = {k: np.zeros((2, t), np.int32) for k in ("tokens", "positions", "segment_ids")}
  batch["loss_mask"] = np.zeros((2, t), np.float32)
  batch["hidden"] = np.zeros((2, t, cfg.hidden_size), np.float32)
  seqs = []
  for r, row in enumerate(layout):
    at = 0
    for s, (p, n) in enumerate(row, 1):
      tok = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
      h = np.array(forward(tp, jnp.asarray(tok)[None], jnp.arange(n)[None], cfg=cfg).hidden[0])
      h[-1] = 0.0  # f after the last token is never computed
      sl = slice(at, at + n)
      batch["tokens"][r, sl], batch["hidden"][r, sl] = tok, h
      batch["positions"][r, sl], batch["segment_ids"][r, sl] = np.arange(n), s
      batch["loss_mask"][r, at + p - 1:at + n - 1] = 1.0
      seqs.append((tok, h, p))
      at += n
  return {k: jnp.asarray(v) for k, v in batch.items()}, seqs


@pytest.mark.parametrize("chunk", [1024, 5])
def test_drafter_loss_on_packed_rows_matches_per_sequence_numpy_reference(chunk):
  """Packed rows (segments, padding) give the loss of the sequences run one by one, with
  the EAGLE alignment: pair (x_{t+1}, f_t) scored against f_{t+1} where f_{t+1} produced a
  response token. chunk 5: the LM-head terms in many chunks, the last one padded."""
  cfg = QWEN
  tp, dp, *_ = setup(cfg)
  batch, seqs = packed_batch(cfg, tp)
  loss, m = drafter_loss(dp, tp, batch, cfg=cfg,
                         loss_cfg=LossConfig(w_v=1.0, w_p=0.1, logit_chunk=chunk))
  gs, dls, fs, tls, ms = [], [], [], [], []
  for tok, h, p in seqs:
    n = len(tok)
    g, dl, _ = _fwd(dp, tp, jnp.asarray(tok[1:])[None], jnp.asarray(h[:-1])[None],
                    jnp.arange(n - 1)[None], cfg=cfg)
    gs.append(np.asarray(g[0]))
    dls.append(np.asarray(dl[0]))
    fs.append(h[1:])
    tls.append(np.asarray(compute_logits(tp, jnp.asarray(h[1:]), cfg)))
    mask = np.zeros(n - 1)
    mask[max(p - 2, 0):n - 2] = 1.0  # pair t counts when f_{t+1} produced a response token
    ms.append(mask)
  cat = lambda xs: np.concatenate(xs)[None]
  ref = np_loss_terms(cat(gs), cat(dls), cat(fs), cat(tls), cat(ms), 1.0, 0.1)
  np.testing.assert_allclose(float(loss), ref[0], rtol=1e-4)
  np.testing.assert_allclose(float(m["vloss"]), ref[1], rtol=1e-4)
  np.testing.assert_allclose(float(m["ploss"]), ref[2], rtol=1e-4)
  np.testing.assert_allclose(float(m["acc_1"]), ref[3], rtol=1e-6)
  # one pair per response token, except the first response token of a 1-token prompt
  # (produced by f_0, which no pair predicts): 4 + 4 + (8 - 1) + 3
  assert float(m["tokens"]) == 18


def test_chunked_lm_head_gives_the_same_gradients():
  cfg = QWEN
  tp, dp, *_ = setup(cfg)
  batch, _ = packed_batch(cfg, tp)
  grad = lambda chunk: jax.grad(lambda d: drafter_loss(
      d, tp, batch, cfg=cfg, loss_cfg=LossConfig(unroll_steps=2, logit_chunk=chunk))[0])(dp)
  whole, chunked = grad(4096), grad(7)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_unroll_n1_is_the_single_step_loss_and_n2_composes():
  cfg = QWEN
  tp, dp, *_ = setup(cfg)
  batch, _ = packed_batch(cfg, tp)
  l1, m1 = drafter_loss(dp, tp, batch, cfg=cfg, loss_cfg=LossConfig(unroll_steps=1))
  np.testing.assert_allclose(float(l1), float(1.0 * m1["vloss_1"] + 0.1 * m1["ploss_1"]),
                             rtol=1e-6)
  l2z, _ = drafter_loss(dp, tp, batch, cfg=cfg,
                        loss_cfg=LossConfig(unroll_steps=2, step_decay=0.0))
  np.testing.assert_allclose(float(l2z), float(l1), rtol=1e-6)
  # step 2 by hand: hidden input at t is step 1's g at t-1 (same sequence), tokens unchanged
  l2, m2 = drafter_loss(dp, tp, batch, cfg=cfg, loss_cfg=LossConfig(unroll_steps=2))
  seg = np.asarray(batch["segment_ids"])[:, :-1]
  mask = segment_causal_mask(jnp.asarray(seg))
  tok, hid, pos = batch["tokens"][:, 1:], batch["hidden"][:, :-1], batch["positions"][:, :-1]
  g1, _, _ = _fwd(dp, tp, tok, hid, pos, cfg=cfg, attn_mask=mask)
  g1, hid = np.asarray(g1), np.asarray(hid)
  hid2 = hid.copy()
  for r in range(seg.shape[0]):
    for t in range(1, seg.shape[1]):
      if seg[r, t] != 0 and seg[r, t] == seg[r, t - 1]:
        hid2[r, t] = g1[r, t - 1]
  g2, dl2, _ = _fwd(dp, tp, tok, jnp.asarray(hid2), pos, cfg=cfg, attn_mask=mask)
  f_next = batch["hidden"][:, 1:]
  lm, sg = np.asarray(batch["loss_mask"]), np.asarray(batch["segment_ids"])
  valid1 = (lm[:, 1:] > 0) & (sg[:, 1:] == sg[:, :-1]) & (sg[:, :-1] != 0)
  valid2 = valid1 & np.concatenate([np.zeros((2, 1), bool), valid1[:, :-1]], 1)
  ref2 = np_loss_terms(g2, dl2, f_next, compute_logits(tp, f_next, cfg), valid2, 1.0, 0.1)
  np.testing.assert_allclose(float(m2["vloss_2"]), ref2[1], rtol=1e-4)
  np.testing.assert_allclose(float(m2["ploss_2"]), ref2[2], rtol=1e-4)
  np.testing.assert_allclose(float(l2), float(l1) + 0.8 * ref2[0], rtol=1e-4)
  assert float(m2["tokens_2"]) == valid2.sum() < float(m2["tokens_1"])


def test_unrolled_loss_gradient_flows_through_the_unroll():
  """The gradient of the 2-step (test-time-training) loss is the loss's own derivative: along
  a random direction of the drafter's params it equals the central difference of the loss.
  Step 2 reads step 1's output state, so the step-2 loss also teaches step 1 (EAGLE-3); a
  gradient cut at that hand-over leaves every loss value as it is and halves this one."""
  cfg = QWEN
  tp, dp, *_ = setup(cfg)
  batch, _ = packed_batch(cfg, tp)
  loss = jax.jit(lambda d: drafter_loss(d, tp, batch, cfg=cfg,
                                         loss_cfg=LossConfig(unroll_steps=2))[0])
  grads = jax.grad(loss)(dp)
  rng = np.random.default_rng(0)
  v = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), dp)
  along = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(v)))
  eps = 1e-3
  moved = lambda sign: loss(jax.tree.map(lambda a, b: a + sign * eps * b, dp, v))  # noqa: E731
  np.testing.assert_allclose(along, float(moved(1) - moved(-1)) / (2 * eps), rtol=1e-2)


def test_gradients_only_for_drafter_params():
  cfg = QWEN
  tp, dp, *_ = setup(cfg)
  batch, _ = packed_batch(cfg, tp)
  loss_fn = lambda d, t: drafter_loss(d, t, batch, cfg=cfg,
                                      loss_cfg=LossConfig(unroll_steps=2))[0]
  grads, tgrads = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(dp, tp)
  assert jax.tree.structure(grads) == jax.tree.structure(dp)
  assert set(grads) == {"fc", "layers"} and "attn_norm" not in grads["layers"]
  for k in ("embed", "final_norm", "lm_head"):
    assert k not in grads and k not in grads["layers"]
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads))
  assert all(float(jnp.max(jnp.abs(x))) > 0 for x in jax.tree.leaves(grads))
  # and nothing flows into the target (its arrays are stop-gradiented inside the loss)
  assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(tgrads))


def test_training_on_random_target_reduces_loss_and_beats_chance():
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True)
  tp = init_params(cfg, jax.random.key(0), std=0.1)

  @jax.jit
  def make(key, b=16, t=32, p=4):
    tok = jax.random.randint(key, (b, t), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    h = forward(tp, tok, pos, cfg=cfg, return_logits=False).hidden
    return {"tokens": tok, "hidden": h, "positions": pos,
            "loss_mask": jnp.zeros((b, t)).at[:, p - 1:t - 1].set(1.0)}

  lc = LossConfig(unroll_steps=2)
  tx = optax.adam(3e-3)
  dp = init_drafter(cfg, jax.random.key(1))
  opt = tx.init(dp)

  @jax.jit
  def step(dp, opt, batch):
    (_, m), g = jax.value_and_grad(drafter_loss, has_aux=True)(dp, tp, batch, cfg=cfg,
                                                               loss_cfg=lc)
    upd, opt = tx.update(g, opt, dp)
    return optax.apply_updates(dp, upd), opt, m

  evaluate = jax.jit(lambda dp, b: drafter_loss(dp, tp, b, cfg=cfg, loss_cfg=lc)[1])
  held_out = make(jax.random.key(10_000))
  before = evaluate(dp, held_out)
  for i in range(150):
    dp, opt, _ = step(dp, opt, make(jax.random.key(i)))
  after = evaluate(dp, held_out)
  assert float(after["loss"]) < 0.85 * float(before["loss"]), (before["loss"], after["loss"])
  chance = 1.0 / cfg.vocab_size
  assert float(before["acc"]) < 3 * chance
  assert float(after["acc"]) > 15 * chance, after["acc"]  # ~0.4 observed
  assert float(after["acc_2"]) > 10 * chance, after["acc_2"]


# ------------------------------------------------------------------------ acceptance estimate
def _tiny_step_inputs():
  """(target config, target params, one packed batch) for a drafter step on a tiny target."""
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True)
  tp = init_params(cfg, jax.random.key(0), std=0.1)
  tok = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (4, 16))
  return cfg, tp, {"tokens": tok, "positions": pos,
                   "hidden": forward(tp, tok, pos, cfg=cfg, return_logits=False).hidden,
                   "loss_mask": jnp.ones((4, 16)).at[:, -1].set(0.0)}


def test_a_second_run_reuses_the_compiled_drafter_step():
  """make_train_step of equal arguments (a fresh optimizer of the same hyperparameters, as a
  process's next run builds it: a notebook's, a test file's) is one jitted step, compiled
  once; other hyperparameters compile their own. Counted by JAX's log of what it compiles."""
  import logging

  from tlt_jax.drafter import train_step as dts
  cfg, tp, batch = _tiny_step_inputs()
  compiled = []

  class Log(logging.Handler):
    def emit(self, record):
      compiled.extend(["step"] if record.getMessage().startswith("Compiling jit(step)") else [])

  handler, logger = Log(level=logging.DEBUG), logging.getLogger("jax")
  logger.addHandler(handler)
  level = logger.level
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles():
      state = dts.init_state(init_drafter(cfg, jax.random.key(2)), make_optimizer(1e-3))
      for lr in (1e-3, 1e-3, 2e-3):  # two runs of one config, then another learning rate
        state, _ = dts.make_train_step(cfg, make_optimizer(lr))(state, tp, batch)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  assert int(state.step) == 3
  assert compiled == ["step", "step"], compiled


def test_a_drafter_step_whose_gradients_are_not_finite_is_not_taken():
  """A batch of NaN hidden states (its gradients NaN) leaves the drafter's params, Adam's
  moments and the step count as they were; the next finite batch then steps as the first."""
  from tlt_jax.drafter import train_step as dts
  cfg, tp, batch = _tiny_step_inputs()
  bad = dict(batch, hidden=batch["hidden"].at[0, 3].set(jnp.nan))
  step = dts.make_train_step(cfg, make_optimizer(1e-3), donate=False)
  start = dts.init_state(init_drafter(cfg, jax.random.key(2)), make_optimizer(1e-3))
  kept, m = step(start, tp, bad)
  assert not np.isfinite(float(m["grad_norm"])) and int(kept.step) == 0
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(start)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  after, _ = step(kept, tp, batch)
  want, _ = step(start, tp, batch)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(after.step) == 1


def test_chain_drafts_equal_sequential_drafting_with_a_cache():
  """chain_drafts' one-pass tree evaluation equals drafting each chain with a KV cache:
  prefill the real pairs <= t, then feed (draft, g) back one token at a time."""
  cfg = QWEN
  tp, dp, tokens, hidden, positions = setup(cfg, b=1, t=9)
  depth = 3
  drafts, logits = jax.jit(chain_drafts, static_argnames=("cfg", "depth"))(
      dp, tp, tokens, hidden, positions, cfg=cfg, depth=depth)
  assert drafts.shape == (depth, 1, 8) and logits.shape == (depth, 1, 8, cfg.vocab_size)
  # the real pairs' k/v are the same for every chain: prefill all 8 once, then commit only
  # the first t + 1 (slots >= lengths are invisible and get overwritten by the chain)
  g_all, lg_all, prefilled = _fwd(dp, tp, tokens[:, 1:], hidden[:, :-1], positions[:, :-1],
                                  cfg=cfg, cache=drafter_cache(cfg, 1, 32))
  for t in range(8):
    cache = prefilled.replace(lengths=prefilled.lengths + t + 1)
    g, lg = g_all[:, t:t + 1], lg_all[:, t:t + 1]
    close(logits[0, 0, t], lg[0, 0])
    for j in range(2, depth + 1):
      y = jnp.argmax(lg, -1).astype(jnp.int32)
      g, lg, cache = _fwd(dp, tp, y, g, positions[:, t:t + 1] + j - 1, cfg=cfg, cache=cache)
      cache = cache.replace(lengths=cache.lengths + 1)
      close(logits[j - 1, 0, t], lg[0, 0])
      assert int(drafts[j - 1, 0, t]) == int(jnp.argmax(lg[0, 0]))


def test_chain_mask_and_accept_lengths():
  m = np.asarray(chain_window_mask(3, 3))[0]  # step 3's queries over 9 cache slots
  assert m.shape == (3, 9)
  np.testing.assert_array_equal(m[:, :3], np.tril(np.ones((3, 3))))  # real pairs <= t
  np.testing.assert_array_equal(m[:, 3:6], np.eye(3))  # its own step 2
  np.testing.assert_array_equal(m[:, 6:], np.eye(3))  # itself
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 0]])
  lengths = jnp.asarray([6])
  # drafts[j-1][t] guesses tokens[t + j + 1]
  d = np.zeros((3, 1, 6), np.int32)
  for t in range(6):
    for j in range(1, 4):
      d[j - 1, 0, t] = tokens[0, t + j + 1] if t + j + 1 < 7 else 0
  d[1, 0, 0] = 99  # chain 0: 1st right, 2nd wrong, 3rd right -> 1
  starts = jnp.ones((1, 6), bool).at[0, 5].set(False)
  acc = np.asarray(accept_lengths(jnp.asarray(d), tokens, starts, lengths))
  # t=1: 8, 9, 10 all right -> 3; t=2: 9, 10 then t+4=6 >= length -> 2; t=3 -> 1; t=4 -> 0
  np.testing.assert_array_equal(acc, [[1, 3, 2, 1, 0, 0]])


# --------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_exact(tmp_path, param_dtype):
  cfg = QWEN.replace(param_dtype=param_dtype)
  dp = jax.tree.map(lambda x: x.astype(cfg.weight_dtype),
                    randomize(init_drafter(cfg, jax.random.key(0)), jax.random.key(1)))
  save_drafter(str(tmp_path), dp, cfg)
  assert sorted(os.listdir(tmp_path)) == ["drafter.safetensors", "drafter_config.json"]
  back = load_drafter(str(tmp_path), cfg)
  assert jax.tree.structure(back) == jax.tree.structure(dp)
  for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(back)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_eagle_keys_shapes_and_config(tmp_path):
  from tlt_jax.models.safetensors_io import mmap_safetensors
  cfg = QWEN
  d, h = cfg.hidden_size, cfg.head_dim_
  n, k, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
  dp = init_drafter(cfg, jax.random.key(0))
  target_cfg = dict(cfg.to_hf_dict(), eos_token_id=1, num_hidden_layers=2)
  export_eagle(str(tmp_path), dp, cfg, target_hf_config=target_cfg)
  tensors = mmap_safetensors(str(tmp_path / "model.safetensors"))
  want = {
      "fc.weight": (d, 2 * d), "fc.bias": (d,),
      "layers.0.self_attn.q_proj.weight": (n * h, d), "layers.0.self_attn.q_proj.bias": (n * h,),
      "layers.0.self_attn.k_proj.weight": (k * h, d), "layers.0.self_attn.k_proj.bias": (k * h,),
      "layers.0.self_attn.v_proj.weight": (k * h, d), "layers.0.self_attn.v_proj.bias": (k * h,),
      "layers.0.self_attn.o_proj.weight": (d, n * h),
      "layers.0.post_attention_layernorm.weight": (d,),
      "layers.0.mlp.gate_proj.weight": (f, d), "layers.0.mlp.up_proj.weight": (f, d),
      "layers.0.mlp.down_proj.weight": (d, f),
  }
  assert {name: tuple(a.shape) for name, a in tensors.items()} == want
  np.testing.assert_array_equal(tensors["fc.weight"], np.asarray(dp["fc"]).T)
  np.testing.assert_array_equal(tensors["fc.bias"], 0.0)
  with open(tmp_path / "config.json") as fh:
    config = json.load(fh)
  assert config["architectures"] == ["Qwen2ForCausalLMEagle"]
  assert config["num_hidden_layers"] == 1 and config["hidden_size"] == d
  assert config["eos_token_id"] == 1 and config["model_type"] == "qwen2"
  from transformers import AutoConfig
  assert AutoConfig.from_pretrained(str(tmp_path)).num_hidden_layers == 1
  # vLLM naming: the target's own architecture (vLLM prefixes "Eagle"); Llama only
  llama_dp = init_drafter(LLAMA, jax.random.key(0))
  export_eagle(str(tmp_path / "v"), llama_dp, LLAMA, engine="vllm")
  assert json.load(open(tmp_path / "v" / "config.json"))["architectures"] == ["LlamaForCausalLM"]
  assert "layers.0.self_attn.o_proj.bias" in mmap_safetensors(
      str(tmp_path / "v" / "model.safetensors"))
  with pytest.raises(ValueError, match="vLLM has no EAGLE-1 drafter class for qwen2"):
    export_eagle(str(tmp_path / "w"), dp, cfg, engine="vllm")


def test_errors(tmp_path):
  cfg = QWEN
  dp = init_drafter(cfg, jax.random.key(0))
  with pytest.raises(DrafterLoadError, match="does not exist"):
    load_drafter(str(tmp_path / "nope"), cfg)
  save_drafter(str(tmp_path / "d"), dp, cfg)
  wide = cfg.replace(hidden_size=64)
  with pytest.raises(ValueError, match=r"hidden_size: drafter 32 vs target 64"):
    load_drafter(str(tmp_path / "d"), wide)
  with pytest.raises(ValueError, match=r"rope_theta: drafter 10000.0 vs target 1000000.0"):
    load_drafter(str(tmp_path / "d"), cfg.replace(rope_theta=1e6))
  export_eagle(str(tmp_path / "e"), dp, cfg)
  with pytest.raises(DrafterLoadError, match="looks like an EAGLE export"):
    load_drafter(str(tmp_path / "e"), cfg)
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "drafter.safetensors").write_bytes(b"\x00")
  (tmp_path / "bad" / "drafter_config.json").write_text("{not json")
  with pytest.raises(DrafterLoadError, match="not valid JSON"):
    load_drafter(str(tmp_path / "bad"), cfg)
  with pytest.raises(ValueError, match="fc has shape"):
    save_drafter(str(tmp_path / "x"), dp, wide)
  with pytest.raises(ValueError, match="top-level keys"):
    check_drafter_params(init_params(cfg, jax.random.key(0)), cfg)
  tp, _, tokens, hidden, positions = setup(cfg)
  with pytest.raises(ValueError, match="hidden size 16 != the target config's hidden_size 32"):
    drafter_forward(dp, tp, tokens, hidden[..., :16], positions, cfg=cfg)
  with pytest.raises(ValueError, match="unroll_steps=0"):
    LossConfig(unroll_steps=0)
  with pytest.raises(ValueError, match="hidden_size 64 != the drafter config's hidden_size"):
    export_eagle(str(tmp_path / "f"), dp, cfg, target_hf_config=wide.to_hf_dict())


# ------------------------------------------------------------------------------------ script
def _tiny_target(root):
  """A random 2-layer Qwen2 with the arithmetic task's tokenizer + train/test prompts."""
  from tlt_jax.data import arith
  from tlt_jax.models.hf_io import save_hf_model
  train, test = arith.generate_dataset(24, 1), arith.generate_dataset(4, 2)
  tok = arith.wrap_tokenizer(arith.train_tokenizer(p["prompt"] + p["response"] for p in train))
  cfg = ModelConfig(arch="qwen2", vocab_size=32, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                    tie_word_embeddings=True, max_position_embeddings=256)
  model = os.path.join(root, "model")
  save_hf_model(init_params(cfg, jax.random.key(0), std=0.3), cfg, model,
                extra_config={"eos_token_id": tok.eos_token_id},
                generation_config={"eos_token_id": tok.eos_token_id})
  tok.save_pretrained(model)
  os.makedirs(os.path.join(root, "data"))
  for name, rows in (("train", train), ("test", test)):
    with open(os.path.join(root, "data", f"{name}.jsonl"), "w") as fh:
      fh.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                    for r in rows)
  return cfg, model


@pytest.mark.slow
def test_train_drafter_script_end_to_end_and_resume(tmp_path):
  cfg, model = _tiny_target(str(tmp_path))
  out = tmp_path / "out"
  cmd = [sys.executable, os.path.join(REPO, "scripts", "train_drafter.py"), "--model", model,
         "--out", str(out), "--num_prompts", "8", "--num_samples", "2", "--max_new_tokens",
         "16", "--gen_batch", "4", "--batch", "2", "--seq_len", "64", "--eval_prompts", "2",
         "--save_every", "4", "--log_every", "2", "--lr", "1e-3"]
  env = user_env(JAX_PLATFORMS="cpu", XLA_FLAGS="")
  run = lambda steps: subprocess.run(cmd + ["--steps", str(steps)], env=env,
                                     capture_output=True, text=True, timeout=600)
  r = run(6)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "top-1 draft accuracy" in r.stdout and "mean accepted drafts" in r.stdout
  res = json.load(open(out / "eval.json"))
  assert res["eval"]["chain_depth"] == 4 and 0 <= res["eval"]["top1_acc"] <= 1
  assert 0 <= res["eval"]["accept_len"] <= 4
  assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [2, 4, 6]
  first = load_drafter(str(out), cfg)
  assert json.load(open(out / "eagle" / "config.json"))["num_hidden_layers"] == 1
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "lo')  # a kill mid-write
  r = run(8)  # resumes from step 6 (no regeneration: the generations are cached)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from" in r.stderr and "step 6" in r.stderr
  assert "cut short by a kill" in r.stderr
  assert "generate (train)" not in r.stderr
  assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [2, 4, 6, 8]
  second = load_drafter(str(out), cfg)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first),
                                                      jax.tree.leaves(second)))
  bad = subprocess.run(cmd[:4] + ["--out", str(tmp_path / "o2"), "--data",
                                  str(tmp_path / "missing.jsonl")],
                       env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "missing.jsonl: no such file" in bad.stderr
  no_model = subprocess.run([cmd[0], cmd[1], "--model", str(tmp_path / "nowhere"), "--out",
                             str(tmp_path / "o3")], env=env, capture_output=True, text=True,
                            timeout=300)
  assert no_model.returncode == 2 and "nowhere: no config.json" in no_model.stderr, \
      no_model.stderr


# --------------------------------------------------------- online (RL-loop) drafter training
@pytest.fixture(scope="module")
def policy_rollouts():
  """The shipped default policy's sampled answers to 24 held-out prompts, hidden captured."""
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  mdir = asset_path("default", "model")
  cfg, params = load_hf_model(mdir)
  tok = load_tokenizer(mdir)
  rows, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  prompts = [tok.encode(r.prompt) for r in rows[:24]]
  worker = Engine(params, cfg, EngineConfig(
      max_batch=24, buckets=(8, 16, 24), max_prompt_len=80, max_new_tokens=96,
      capture_hidden=True, stop_tokens=stop_token_ids(mdir, tok)))
  results = worker.generate([Request(p, i) for i, p in enumerate(prompts)],
                            SamplingParams(temperature=1.0), seed=0)
  return cfg, params, prompts, sorted(results, key=lambda r: r.request_id)


def _forward_rows(cfg, params, results, t=192):
  """prompt + response rows and the target's own full forward over them: f_t at every t."""
  tokens = np.zeros((len(results), t), np.int32)
  for i, r in enumerate(results):
    p, n = len(r.prompt_ids), len(r.response_ids)
    tokens[i, :p], tokens[i, p:p + n] = r.prompt_ids, r.response_ids
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
  return tokens, np.asarray(_full_forward(params, jnp.asarray(tokens), pos, cfg=cfg))


_full_forward = jax.jit(lambda p, t, pos, cfg: forward(p, t, pos, cfg=cfg,
                                                        return_logits=False).hidden,
                        static_argnames=("cfg",))


def _buffer_batch(results, *, rows, row_len, window, seed=0):
  """Rollout results -> the spot trainer's packed batch: the drafter buffer's windows of the
  captured hidden states, packed (tlt_jax/drafter/buffer.py, packing.py)."""
  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.packing import fill_batch
  buf = DrafterBuffer(BufferConfig(buffer_tokens=1 << 20, window=window,
                                   windows_per_response=64))
  for r in results:
    buf.add(0, r.response_ids, r.hidden, key=(r.request_id, r.sample_index))
  rng = np.random.default_rng(seed)
  batch, _ = fill_batch(lambda n: buf.sample(n, rng), rows, row_len)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def test_spot_trained_drafter_learns_the_policy(policy_rollouts):
  """A fresh drafter trained by the RL loop's train step on one fixed batch of the spot
  trainer's data (buffer windows of the rollout's captured hidden states, packed): its loss
  falls and its top-1 agreement with the policy on OTHER prompts' answers rises well above
  where it started (a step that updated nothing, fed the wrong pairs or trained the target's
  frozen parts would not)."""
  from tlt_jax.drafter import train_step as dts
  cfg, params, _, results = policy_rollouts
  batch = _buffer_batch(results[:16], rows=4, row_len=192, window=96)
  held = _buffer_batch(results[16:], rows=4, row_len=192, window=96, seed=1)
  tx = make_optimizer(1e-3)
  state = dts.init_state(init_drafter(cfg, jax.random.key(0)), tx)
  step = dts.make_train_step(cfg, tx)
  frozen = jax.tree.map(np.array, params)
  metrics = jax.jit(lambda dp: drafter_loss(dp, params, held, cfg=cfg)[1])
  before = metrics(state.params)
  losses = []
  for _ in range(30):
    state, m = step(state, params, batch)
    losses.append(float(m["loss"]))
  after = metrics(state.params)
  assert int(state.step) == 30
  assert losses[-1] < 0.7 * losses[0], losses
  assert float(after["loss"]) < float(before["loss"])
  assert float(after["acc"]) > float(before["acc"]) + 0.2, (before["acc"], after["acc"])
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(frozen),
                                                              jax.tree.leaves(params)))


def test_rollout_capture_aligns_as_the_targets_full_forward(policy_rollouts):
  """Drafter data without a target forward: `align` over the rollout engine's captured
  hidden states gives, at every position the loss reads, the hidden state the target's own
  full forward over prompt + response computes (an independent path: no cache, no chunks),
  with the loss on exactly the positions whose hidden state produced a response token. The
  offline trainer's sequences (scripts/train_drafter.py) and the spot trainer's windows are
  both cut from this alignment (tests/test_buffer.py)."""
  from tlt_jax.drafter.buffer import align
  cfg, params, prompts, results = policy_rollouts
  tokens, full = _forward_rows(cfg, params, results[:8])
  for i, r in enumerate(results[:8]):
    p, n = len(r.prompt_ids), len(r.response_ids)
    t = p + n
    tok, hid, mask = align(r.response_ids, r.hidden, r.prompt_ids, full[i, :p])
    np.testing.assert_array_equal(tok, tokens[i, :t])
    want_mask = np.zeros(t)
    want_mask[p - 1:t - 1] = 1
    np.testing.assert_array_equal(mask, want_mask)
    close(hid[:t - 1], full[i, :t - 1], tol=1e-4)  # f_{T-1} follows the last token: unread
