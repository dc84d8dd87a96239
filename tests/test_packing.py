"""tlt_jax.drafter.packing (pack, fill_batch) together with the drafter loss on packed rows.

The key property: the loss and gradients of a packed batch equal those of the same windows
run one by one. Checked two ways, in sum form (token-mean loss x token count, since the loss
is a mean over all valid pairs of the batch):
  (a) against jax `drafter_loss` on each window alone (a one-row batch, positions 0..L-1,
      segment ids all 1): the loss and the gradients w.r.t. the drafter params;
  (b) against a float64 numpy reference of the drafter forward (fc, one decoder layer without
      input norm, RoPE, GQA, the target's head with no norm) and the EAGLE loss, written here.
The reference implementation's packing (one causal mask, running positions) is shown to give
a different loss. Layout (positions, segment ids, padding, first-fit placement, truncation,
rows=None, skipped windows, fill_batch) is checked against hand-worked expectations and a
brute-force first-fit written in the test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.drafter import LossConfig, drafter_loss, drafter_param_shapes
from tlt_jax.drafter.buffer import Window
from tlt_jax.drafter.packing import fill_batch, pack
from tlt_jax.models import ModelConfig, param_shapes

CFG = ModelConfig(arch="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True, rope_theta=1e4)
ROWS, ROW_LEN = 3, 24
LENGTHS = [8, 5, 11, 5, 8, 11, 5, 8]  # first-fit: [8 5 11] [5 8 11] [5 8 + 11 padding]


# ----------------------------------------------------------------------------- helpers
def random_params(shapes, seed, scale=0.2):
  """Every leaf random (norms around 1, biases non-zero), built in numpy from the modules'
  own shape tables (eager jax.random would compile once per leaf)."""
  rng = np.random.default_rng(seed)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  out = []
  for path, shape in flat:
    noise = scale * rng.normal(size=shape)
    leaf = 1.0 + noise if "norm" in jax.tree_util.keystr(path) else noise
    out.append(jnp.asarray(leaf, jnp.float32))
  return jax.tree_util.tree_unflatten(treedef, out)


def random_windows(seed, lengths=LENGTHS, d=CFG.hidden_size, vocab=CFG.vocab_size):
  """Windows as the buffer makes them: random ids/hidden; loss_mask 1 except, at random, a
  few leading 0s (prompt-like) and a trailing 0 (the response's last token)."""
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    mask = np.ones(n, np.float32)
    mask[:int(rng.integers(0, 3))] = 0.0
    if rng.random() < 0.5:
      mask[-1] = 0.0
    out.append(Window(step=0, tokens=rng.integers(0, vocab, n).astype(np.int32),
                      hidden=rng.normal(size=(n, d)).astype(np.float32), loss_mask=mask,
                      weight=float(mask.sum())))
  return out


def one_row(w):
  """A window alone: one-row batch, positions 0..L-1, segment ids all 1."""
  n = w.length
  return {"tokens": w.tokens[None], "hidden": w.hidden[None], "loss_mask": w.loss_mask[None],
          "positions": np.arange(n, dtype=np.int32)[None],
          "segment_ids": np.ones((1, n), np.int32)}


def sum_form(dp, tp, batch, loss_cfg):
  """sum_k decay^(k-1) * (w_v * vloss_k + w_p * ploss_k) * tokens_k: the batch's loss as a
  SUM over its valid pairs (for unroll 1: loss * tokens), which adds up over windows."""
  loss, m = drafter_loss(dp, tp, batch, cfg=CFG, loss_cfg=loss_cfg)
  total = 0.0
  for k in range(1, loss_cfg.unroll_steps + 1):
    total = total + loss_cfg.step_decay ** (k - 1) * m[f"tokens_{k}"] * (
        loss_cfg.w_v * m[f"vloss_{k}"] + loss_cfg.w_p * m[f"ploss_{k}"])
  return total, (loss, m)


_sum_and_grad = jax.jit(jax.value_and_grad(sum_form, has_aux=True), static_argnames="loss_cfg")


@pytest.fixture(scope="module")
def model():
  tp = random_params(param_shapes(CFG), 0)
  dp = random_params(drafter_param_shapes(CFG), 1)
  return tp, dp


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


# -------------------------------------------------------------- float64 numpy reference
def np_rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_rope(x, pos, theta):
  """x [T, heads, H]; HF rotate_half convention."""
  h = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h)
  freqs = pos[:, None] * inv[None]
  cos = np.cos(np.concatenate([freqs, freqs], -1))[:, None]
  sin = np.sin(np.concatenate([freqs, freqs], -1))[:, None]
  x1, x2 = x[..., :h // 2], x[..., h // 2:]
  return x * cos + np.concatenate([-x2, x1], -1) * sin


def np_logits(tp, g):
  """The LM head alone: the drafter's output and the target's (post-norm) hidden states are
  read by the head as they are, as in vLLM's / SGLang's EAGLE-1 (no final norm)."""
  return g @ tp["lm_head"]


def np_drafter(dp, tp, tok, hid, pos):
  """One sequence: tokens x_{t+1} [T], hidden f_t [T, D], positions [T] -> (g, logits)."""
  lp = {k: v[0] for k, v in dp["layers"].items()}
  z = np.concatenate([tp["embed"][tok], hid], -1) @ dp["fc"]
  q = np.einsum("td,dnh->tnh", z, lp["q"]) + lp["q_bias"]
  k = np.einsum("td,dkh->tkh", z, lp["k"]) + lp["k_bias"]
  v = np.einsum("td,dkh->tkh", z, lp["v"]) + lp["v_bias"]
  q, k = np_rope(q, pos, CFG.rope_theta), np_rope(k, pos, CFG.rope_theta)
  t, n, h = q.shape
  group = n // k.shape[1]
  attn = np.zeros_like(q)
  causal = np.tril(np.ones((t, t), bool))
  for head in range(n):
    s = q[:, head] @ k[:, head // group].T / math.sqrt(h)
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn[:, head] = p @ v[:, head // group]
  x = z + np.einsum("tnh,nhd->td", attn, lp["o"])
  hm = np_rms(x, lp["mlp_norm"], CFG.rms_norm_eps)
  gate, up = hm @ lp["gate"], hm @ lp["up"]
  x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["down"]
  return x, np_logits(tp, x)


def np_window_sums(dp, tp, w):
  """EAGLE loss of one window as sums: pair t = (x_{t+1}, f_t) at position t, scored against
  f_{t+1} and softmax(head(f_{t+1})) where loss_mask[t+1] = 1. -> (v_sum, p_sum, count)."""
  x, f, m = w.tokens, w.hidden.astype(np.float64), w.loss_mask
  g, dl = np_drafter(dp, tp, x[1:], f[:-1], np.arange(w.length - 1, dtype=np.float64))
  fn = f[1:]
  tl = np_logits(tp, fn)
  d = g - fn
  vtok = np.where(np.abs(d) < 1.0, 0.5 * d * d, np.abs(d) - 0.5).mean(-1)
  p = np.exp(tl - tl.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  logq = dl - dl.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  ptok = -(p * logq).sum(-1)
  valid = m[1:] > 0
  return vtok[valid].sum(), ptok[valid].sum(), valid.sum()


# --------------------------------------------------------- packed == one by one (jax)
@pytest.mark.parametrize("loss_cfg", [LossConfig(w_v=1.0, w_p=0.1),
                                      LossConfig(w_v=0.7, w_p=0.5, unroll_steps=2,
                                                 step_decay=0.8)],
                         ids=["eagle", "unroll2"])
def test_packed_loss_and_grads_equal_windows_run_one_by_one(model, loss_cfg):
  tp, dp = model
  windows = random_windows(0)
  batch, packed = pack(windows, ROWS, ROW_LEN)
  assert packed == len(windows)
  assert (batch["segment_ids"] == 0).any()  # the batch has padding too
  (s_packed, (loss, m)), g_packed = _sum_and_grad(dp, tp, batch, loss_cfg=loss_cfg)
  s_sum, n_sum = 0.0, 0.0
  g_sum = jax.tree.map(lambda a: np.zeros(a.shape, np.float64), dp)
  for w in windows:
    (s_w, (_, m_w)), g_w = _sum_and_grad(dp, tp, one_row(w), loss_cfg=loss_cfg)
    s_sum += float(s_w)
    n_sum += float(m_w["tokens"])
    g_sum = jax.tree.map(lambda acc, g: acc + np.asarray(g, np.float64), g_sum, g_w)
  assert float(m["tokens"]) == n_sum == sum(float(w.loss_mask[1:].sum()) for w in windows)
  if loss_cfg.unroll_steps == 1:
    # token-mean loss x token count == sum over windows of (loss x count)
    np.testing.assert_allclose(float(loss) * float(m["tokens"]), s_sum, rtol=1e-5)
  np.testing.assert_allclose(float(s_packed), s_sum, rtol=1e-5)
  errs = jax.tree.map(rel_err, g_packed, g_sum)
  assert max(jax.tree.leaves(errs)) < 2e-5, errs
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_packed))


def test_packed_loss_matches_float64_numpy_reference(model):
  tp, dp = model
  np_tp = jax.tree.map(lambda a: np.asarray(a, np.float64), tp)
  np_dp = jax.tree.map(lambda a: np.asarray(a, np.float64), dp)
  windows = random_windows(1)
  batch, packed = pack(windows, ROWS, ROW_LEN)
  assert packed == len(windows)
  w_v, w_p = 1.0, 0.1
  loss, m = drafter_loss(dp, tp, batch, cfg=CFG, loss_cfg=LossConfig(w_v=w_v, w_p=w_p))
  sums = np.array([np_window_sums(np_dp, np_tp, w) for w in windows]).sum(0)
  v_ref, p_ref = sums[0] / sums[2], sums[1] / sums[2]
  assert float(m["tokens"]) == sums[2]
  np.testing.assert_allclose(float(m["vloss"]), v_ref, rtol=1e-5)
  np.testing.assert_allclose(float(m["ploss"]), p_ref, rtol=1e-5)
  np.testing.assert_allclose(float(loss), w_v * v_ref + w_p * p_ref, rtol=1e-5)


def test_reference_implementations_single_causal_mask_packing_gives_a_different_loss(model):
  """Packing under ONE causal mask with running positions (segment ids all 1, positions
  0..row_len-1) lets windows attend to each other and scores cross-window pairs: the loss
  moves well beyond float error, so the tests above distinguish correct packing from it."""
  tp, dp = model
  np_tp = jax.tree.map(lambda a: np.asarray(a, np.float64), tp)
  np_dp = jax.tree.map(lambda a: np.asarray(a, np.float64), dp)
  windows = random_windows(1)
  batch, _ = pack(windows, ROWS, ROW_LEN)
  naive = dict(batch)
  naive["segment_ids"] = np.ones_like(batch["segment_ids"])
  naive["positions"] = np.broadcast_to(np.arange(ROW_LEN, dtype=np.int32),
                                       batch["positions"].shape).copy()
  lc = LossConfig(w_v=1.0, w_p=0.1)
  good, _ = drafter_loss(dp, tp, batch, cfg=CFG, loss_cfg=lc)
  bad, _ = drafter_loss(dp, tp, naive, cfg=CFG, loss_cfg=lc)
  sums = np.array([np_window_sums(np_dp, np_tp, w) for w in windows]).sum(0)
  ref = (1.0 * sums[0] + 0.1 * sums[1]) / sums[2]
  assert abs(float(good) - ref) / ref < 1e-5
  assert abs(float(bad) - ref) / ref > 1e-3, (float(bad), ref)
  # Even with the cross-window pairs masked out, attending across windows changes the loss.
  naive2 = dict(naive)
  lm = batch["loss_mask"].copy()
  starts = np.zeros_like(lm, bool)
  starts[:, 1:] = batch["segment_ids"][:, 1:] != batch["segment_ids"][:, :-1]
  lm[starts] = 0.0  # a window's first token is never a target of the previous one
  naive2["loss_mask"] = lm
  bad2, _ = drafter_loss(dp, tp, naive2, cfg=CFG, loss_cfg=lc)
  assert abs(float(bad2) - ref) / ref > 1e-4, (float(bad2), ref)


# ------------------------------------------------------------------------------ layout
def id_windows(lengths, d=2):
  """Windows whose token ids name (window, position): 100 * i + position."""
  out = []
  for i, n in enumerate(lengths):
    out.append(Window(step=0, tokens=(100 * i + np.arange(n)).astype(np.int32),
                      hidden=(np.full((n, d), i + 1.0) + np.arange(n)[:, None]).astype(np.float32),
                      loss_mask=(np.arange(n) % 3 != 0).astype(np.float32), weight=1.0))
  return out


def brute_first_fit(lengths, rows, row_len):
  """[[window index, ...] per row], in placement order: the first row with room, in order."""
  placed = [] if rows is None else [[] for _ in range(rows)]
  used = [] if rows is None else [0] * rows
  for i, n in enumerate(lengths):
    n = min(n, row_len)
    for r in range(len(placed)):
      if used[r] + n <= row_len:
        placed[r].append(i)
        used[r] += n
        break
    else:
      if rows is None:
        placed.append([i])
        used.append(n)
  return placed


def decode_rows(batch):
  """Per row: [(window index, n tokens)] read back from segment ids and token ids, checking
  the per-segment layout on the way."""
  out = []
  for r in range(batch["tokens"].shape[0]):
    seg, pos, tok = batch["segment_ids"][r], batch["positions"][r], batch["tokens"][r]
    lm = batch["loss_mask"][r]
    row, at = [], 0
    nseg = int(seg.max())
    for s in range(1, nseg + 1):
      idx = np.flatnonzero(seg == s)
      assert len(idx) and idx[0] == at and np.all(np.diff(idx) == 1), "contiguous, in order"
      np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # restart at 0
      row.append((int(tok[idx[0]]) // 100, len(idx)))
      at = idx[-1] + 1
    assert np.all(seg[at:] == 0), "segments then padding"
    assert np.all(lm[at:] == 0) and np.all(tok[at:] == 0) and np.all(pos[at:] == 0)
    assert np.all(batch["hidden"][r, at:] == 0)
    out.append(row)
  return out


def test_pack_by_hand_first_fit_skips_what_fits_nowhere():
  # row_len 10, 2 rows: 6 -> r0; 5 -> r1; 4 -> r0 (full); 7 fits nowhere; 3 -> r1; 1 -> r1.
  ws = id_windows([6, 5, 4, 7, 3, 1])
  batch, packed = pack(ws, 2, 10)
  assert packed == 5
  assert decode_rows(batch) == [[(0, 6), (2, 4)], [(1, 5), (4, 3), (5, 1)]]
  np.testing.assert_array_equal(batch["segment_ids"],
                                [[1] * 6 + [2] * 4, [1] * 5 + [2] * 3 + [3] + [0]])
  np.testing.assert_array_equal(batch["positions"][1], [0, 1, 2, 3, 4, 0, 1, 2, 0, 0])
  for k in ("tokens", "positions", "segment_ids"):
    assert batch[k].dtype == np.int32 and batch[k].shape == (2, 10)
  assert batch["loss_mask"].dtype == np.float32
  assert batch["hidden"].shape == (2, 10, 2) and batch["hidden"].dtype == np.float32


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rows", [1, 3, None])
def test_pack_layout_matches_brute_force_first_fit(seed, rows):
  rng = np.random.default_rng(seed)
  row_len = int(rng.integers(6, 20))
  lengths = [int(x) for x in rng.integers(1, row_len + 5, int(rng.integers(1, 15)))]
  ws = id_windows(lengths)
  batch, packed = pack(ws, rows, row_len)
  want = brute_first_fit(lengths, rows, row_len)
  assert packed == sum(len(r) for r in want)
  got = decode_rows(batch)
  assert [[i for i, _ in row] for row in got] == want
  if rows is None:
    assert packed == len(ws)  # everything, in as many rows as it takes
    assert batch["tokens"].shape[0] == len(want)
  else:
    assert batch["tokens"].shape == (rows, row_len)
  # contents: each segment is its window (its last row_len tokens when longer)
  for r, row in enumerate(got):
    at = 0
    for i, n in row:
      w = ws[i]
      assert n == min(w.length, row_len)
      sl = slice(at, at + n)
      np.testing.assert_array_equal(batch["tokens"][r, sl], w.tokens[w.length - n:])
      np.testing.assert_array_equal(batch["hidden"][r, sl], w.hidden[w.length - n:])
      np.testing.assert_array_equal(batch["loss_mask"][r, sl], w.loss_mask[w.length - n:])
      at += n


def test_window_longer_than_a_row_keeps_its_last_tokens():
  ws = id_windows([15])
  batch, packed = pack(ws, 1, 10)
  assert packed == 1
  np.testing.assert_array_equal(batch["tokens"][0], 100 * 0 + np.arange(5, 15))
  np.testing.assert_array_equal(batch["hidden"][0], ws[0].hidden[5:])
  np.testing.assert_array_equal(batch["loss_mask"][0], ws[0].loss_mask[5:])
  np.testing.assert_array_equal(batch["positions"][0], np.arange(10))
  np.testing.assert_array_equal(batch["segment_ids"][0], np.ones(10))


def test_pack_hidden_dtype_and_empty_input():
  batch, _ = pack(id_windows([3, 4]), 1, 8, hidden_dtype=np.float16)
  assert batch["hidden"].dtype == np.float16
  with pytest.raises(ValueError):
    pack([], 2, 8)


# -------------------------------------------------------------------------- fill_batch
def test_fill_batch_none_for_an_empty_source():
  assert fill_batch(lambda n: [], 2, 16) is None


@pytest.mark.parametrize("draws", [0, 1, 40])
def test_fill_batch_returns_a_full_shape_batch_of_drawn_windows(draws):
  rng = np.random.default_rng(draws)
  pool = id_windows([int(x) for x in rng.integers(2, 7, 30)])
  calls, drawn = [], []

  def draw(n):
    calls.append(n)
    got = [pool[int(i)] for i in rng.integers(0, len(pool), n)]
    drawn.extend(got)
    return got

  rows, row_len = 3, 16
  out = fill_batch(draw, rows, row_len, draws=draws)
  assert out is not None
  batch, packed = out
  assert calls[0] == max(draws, 1)
  assert batch["tokens"].shape == (rows, row_len)
  assert batch["hidden"].shape == (rows, row_len, 2)
  for k in ("positions", "segment_ids", "loss_mask"):
    assert batch[k].shape == (rows, row_len)
  # 1.5x the batch's tokens over the first draw's mean length (<= 6), at least `draws`
  assert len(drawn) >= max(draws, math.ceil(1.5 * rows * row_len / 6))
  # first fit: a row with room for any window (lengths <= 6) means nothing was left out
  used = (batch["segment_ids"] > 0).sum(1)
  assert packed == len(drawn) or np.all(used > row_len - 6), (used, packed, len(drawn))
  if draws == 40:  # 40 windows of >= 2 tokens: more than the batch holds
    assert np.all(used > row_len - 6), used
  got = decode_rows(batch)
  assert packed == sum(len(r) for r in got)
  # the drawn windows, in draw order, first-fit (brute force)
  want = brute_first_fit([w.length for w in drawn], rows, row_len)
  ids = [int(w.tokens[0]) // 100 for w in drawn]
  assert [[i for i, _ in row] for row in got] == [[ids[j] for j in row] for row in want]
  for row in got:  # every segment is a drawn pool window, whole
    for i, n in row:
      assert n == pool[i].length
