"""The packed flash-attention kernel (tlt_jax/kernels/flash_attention.py, Pallas interpret mode
on this CPU): values against a float64 numpy reference, gradients against autodiff of XLA's
masked attention, the blocks it visits against a brute-force count of the blocks holding a
score that counts, that it never reads a block outside them, and its lowering to Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.kernels import flash_attention as fa
from tlt_jax.models.attention import attend, segment_causal_mask


def _reference(q, k, v, seg):
  """float64: causal within equal ids (padding included, as the kernel defines it)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, h, g = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  seg = np.asarray(seg)
  seen = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool))
  s = np.where(seen[:, None], s, -np.inf)
  p = np.exp(s - s.max(axis=-1, keepdims=True))
  return np.einsum("bnts,bsnh->btnh", p / p.sum(axis=-1, keepdims=True), v)


def _packed(t, seed, heads, kv_heads, head_dim, ids):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(2, t, heads, head_dim)).astype(np.float32)
  k, v = (rng.normal(size=(2, t, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
  return q, k, v, np.asarray(ids, np.int32)


def _ids(t, kind):
  if kind == "packed":  # ragged segments then padding; one row without padding
    a = [1] * 21 + [2] * 17 + [3] * 5
    return [a + [0] * (t - len(a)), [1] * (t - 7) + [2] * 7]
  # ids that are not contiguous, repeat after others, and exceed T (clipped for the ranges)
  a = ([5] * 10 + [1000] * 12 + [5] * 9 + [2] * (t - 40) + [1000] * 9)
  return [a, [3] * (t // 2) + [0] * 3 + [3] * (t - t // 2 - 3)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,kind", [
    (4, 2, 16, "packed"), (3, 1, 8, "packed"), (2, 2, 32, "scattered"), (6, 2, 8, "scattered")])
def test_values_and_gradients(heads, kv_heads, head_dim, kind):
  """Grouped heads (G = 1, 2, 3: R = 64 G rows), a head_dim padded to Triton's 16, contiguous
  and scattered ids."""
  t = 64
  q, k, v, seg = _packed(t, heads + head_dim, heads, kv_heads, head_dim, _ids(t, kind))
  got = np.asarray(fa.packed_flash_attention(q, k, v, seg, interpret=True))
  np.testing.assert_allclose(got, _reference(q, k, v, seg), rtol=2e-5, atol=2e-5)
  # gradients: autodiff of XLA's masked attention; the loss skips padding queries, whose
  # outputs the reference leaves unspecified
  w = np.random.default_rng(1).normal(size=q.shape).astype(np.float32) * (seg > 0)[..., None, None]
  mask = segment_causal_mask(jnp.asarray(seg))
  g_k = jax.grad(lambda *a: jnp.sum(fa.packed_flash_attention(*a, seg, interpret=True) * w),
                 argnums=(0, 1, 2))(q, k, v)
  g_x = jax.grad(lambda *a: jnp.sum(attend(*a, mask) * w), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", g_k, g_x):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5, err_msg=name)


def _counted_blocks(seg, g, bq, bk):
  """Brute force: the (query block, key block) pairs holding a query row that attends a key."""
  seg = np.asarray(seg)
  b, t = seg.shape
  tok = np.arange(t * g) // g
  pairs = set()
  for row in range(b):
    s = seg[row]
    seen = (s[tok][:, None] == s[None, :]) & (tok[:, None] >= np.arange(t)[None, :])
    qi, ki = np.nonzero(seen)
    pairs |= {(row, a, c) for a, c in zip(qi // bq, ki // bk)}
  return pairs


def _ranged_blocks(seg, g, bq, bk):
  kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in fa.block_ranges(jnp.asarray(seg), g, bq, bk))
  by_q = {(r, i, j) for r in range(seg.shape[0]) for i in range(kv_lo.shape[1])
          for j in range(kv_lo[r, i], kv_hi[r, i])}
  by_k = {(r, i, j) for r in range(seg.shape[0]) for j in range(q_lo.shape[1])
          for i in range(q_lo[r, j], q_hi[r, j])}
  return by_q, by_k


@pytest.mark.parametrize("g,bq,bk", [(1, 16, 16), (1, 32, 16), (3, 16, 32), (2, 64, 16)])
def test_ranges_visit_exactly_the_blocks_that_count(g, bq, bk):
  """Contiguous segments: each query block's key range and each key block's query range are
  exactly the blocks holding a counted score (so nothing is skipped that counts, and nothing
  is visited that does not); scattered ids: every counted block is still in range."""
  rng = np.random.default_rng(g * bq + bk)
  t = 128
  rows = []
  for _ in range(3):
    lens = rng.integers(1, 50, size=8)
    ids = np.repeat(np.arange(1, 9), lens)[:t - 5]
    rows.append(np.concatenate([ids, np.zeros(t - len(ids), int)]))
  seg = np.stack(rows)
  counted = _counted_blocks(seg, g, bq, bk)
  by_q, by_k = _ranged_blocks(seg, g, bq, bk)
  assert by_q == counted and by_k == counted
  scattered = np.stack([rng.integers(0, 4, size=t), rng.integers(0, 300, size=t)])
  counted = _counted_blocks(scattered, g, bq, bk)
  by_q, by_k = _ranged_blocks(scattered, g, bq, bk)
  assert counted <= by_q and counted <= by_k


def test_visited_blocks_of_a_packed_row():
  """A 512-token row of four 128-token responses at the forward's 128 x 64 blocks: each
  query block (one response) visits its own 2 key blocks, 8 in all, where a causal kernel
  visits 2 + 4 + 6 + 8 = 20."""
  seg = np.repeat(np.arange(1, 5), 128)[None]
  assert len(_counted_blocks(seg, 1, 128, 64)) == 8
  assert fa.visited_blocks(seg) == (8, 20)


def test_blocks_outside_the_ranges_are_never_read(monkeypatch):
  """Segment 1's values are NaN, over whole 16-token blocks: a query block of segment 2 that
  read them would output NaN (0 x NaN in its weighted sum, as XLA's masked attention does);
  the kernel's outputs and gradients there are finite, its outputs the reference's computed
  without the NaNs."""
  t = 64
  seg = np.array([[1] * 32 + [2] * 32], np.int32)
  q, k, v, _ = _packed(t, 3, 2, 2, 16, [[0] * t])
  q, k, v = q[:1], k[:1], v[:1]
  poisoned = v.copy()
  poisoned[0, :32] = np.nan
  monkeypatch.setattr(fa, "FWD_BLOCKS", (16, 16))
  monkeypatch.setattr(fa, "BWD_BLOCKS", (16, 16))
  run = functools.partial(fa.packed_flash_attention, interpret=True)
  got = np.asarray(run(q, k, poisoned, seg))
  assert np.isnan(got[0, :32]).all()
  np.testing.assert_allclose(got[0, 32:], _reference(q, k, v, seg)[0, 32:], rtol=2e-5,
                             atol=2e-5)
  grad = jax.grad(lambda q, k: jnp.sum(run(q, k, poisoned, seg)[:, 32:]), argnums=(0, 1))(q, k)
  assert all(np.isfinite(np.asarray(x)[0, 32:]).all() for x in grad)
  xla = attend(q, k, poisoned, segment_causal_mask(jnp.asarray(seg)))
  assert np.isnan(np.asarray(xla)[0, 32:]).all()


# JAX >= 0.11 deprecates the Pallas Triton backend (the kernel's docstring); lowered on purpose
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_the_kernels_lower_to_triton():
  """Forward, dK/dV and dQ lower to Triton IR for CUDA (cross-platform lowering for an abstract
  H100, no GPU needed): Qwen2.5-7B's heads (28 over 4 kv heads: R = 7 T rows, not a power of
  two) in bf16, and a head_dim of 8 (padded to 16) in float32. The Pallas -> TTIR step only;
  Triton's compiler runs on a GPU (gpu_check's learner stage)."""
  try:
    from jax._src.lib import triton  # noqa: F401  (the TTIR dialect bindings)
  except ImportError as e:
    pytest.skip(f"jaxlib without Triton bindings: {e}")
  S = jax.ShapeDtypeStruct
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")

  def loss(q, k, v, s):
    return jnp.sum(fa.packed_flash_attention(q, k, v, s).astype(jnp.float32))

  for t, n, kh, h, dt in [(384, 28, 4, 128, jnp.bfloat16), (48, 4, 2, 8, jnp.float32)]:
    args = (S((2, t, n, h), dt), S((2, t, kh, h), dt), S((2, t, kh, h), dt),
            S((2, t), jnp.int32))
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((), (), abstract_device=device)):
      text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
    for name in ("fwd", "dkv", "dq"):
      assert f"packed_flash_attention_{name}" in text


def test_rows_must_be_whole_blocks():
  q = jnp.zeros((1, 40, 2, 16))
  with pytest.raises(ValueError, match="multiple of 16"):
    fa.packed_flash_attention(q, q, q, jnp.ones((1, 40), jnp.int32), interpret=True)


def _reference_lse(q, k, v, seg):
  """float64, stable at any logit scale: `_reference` through a max-shifted softmax whose
  masked entries are exactly 0 (no finite mask value that real logits could fall below)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, h, g = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  seg = np.asarray(seg)
  seen = ((seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool)))[:, None]
  m = np.where(seen, s, -np.inf).max(axis=-1, keepdims=True)
  p = np.where(seen, np.exp(np.where(seen, s, m) - m), 0.0)
  return np.einsum("bnts,bsnh->btnh", p / p.sum(axis=-1, keepdims=True), v)


def test_logits_far_below_zero_and_negative_ids(monkeypatch):
  """Every score of some rows near -1.4e4 in base 2 (queries opposite the keys' shared
  direction): a masked score must never outweigh them (a finite mask of -1e4, or a running max
  started at 0 whose exp2 underflows, would). Negative ids are segments too (clipped with
  padding for the ranges only)."""
  t, h = 64, 16
  rng = np.random.default_rng(5)
  k = (1.0 + 0.01 * rng.normal(size=(1, t, 1, h))).astype(np.float32)
  v = rng.normal(size=(1, t, 1, h)).astype(np.float32)
  sign = np.where(rng.random(t) < 0.5, -1.0, 1.0)[None, :, None, None]
  q = (sign * 2.5e3 * (1.0 + 0.01 * rng.normal(size=(1, t, 2, h)))).astype(np.float32)
  seg = np.array([[3] * 9 + [-2] * 20 + [0] * 5 + [-2] * 14 + [7] * 16], np.int32)
  monkeypatch.setattr(fa, "FWD_BLOCKS", (16, 16))  # blocks that hold only negative ids
  got = np.asarray(fa.packed_flash_attention(q, k, v, seg, interpret=True))
  # float32 scores of this size are rounded by ~1e-3: the weights by ~0.1%
  np.testing.assert_allclose(got, _reference_lse(q, k, v, seg), rtol=1e-2, atol=1e-2)


def test_the_kernels_get_triton_tiles(monkeypatch):
  """What a CPU's interpret mode does not check and Triton does: tl.dot's operands are powers
  of two >= 16 along each dimension; the blocks are (geometry), the head_dim must be too, so
  8 and 24 reach the kernels zero-padded to 16 and 32."""
  calls = []
  real = fa._call

  def spy(kernel, grid, in_specs, out_specs, out_shape, name, interpret, warps):
    run = real(kernel, grid, in_specs, out_specs, out_shape, name, interpret, warps)

    def record(*args):
      calls.append((name, [a.shape for a in args]))
      return run(*args)
    return record
  monkeypatch.setattr(fa, "_call", spy)
  for h in (8, 24):
    q, k, v, seg = _packed(48, h, 3, 1, h, _ids(48, "packed"))
    jax.grad(lambda q: jnp.sum(fa.packed_flash_attention(q, k, v, seg, interpret=True)))(q)
  assert sorted({n for n, _ in calls}) == sorted(
      f"packed_flash_attention_{n}" for n in ("fwd", "dkv", "dq"))
  for name, shapes in calls:
    for shape in shapes[5:]:  # q, k, v (dO): [B, K, rows, head_dim]; lse, delta [B, K, R]
      if len(shape) == 4:
        assert shape[-1] >= 16 and shape[-1] & (shape[-1] - 1) == 0, (name, shape)


@pytest.mark.parametrize("t,g", [(48, 3), (64, 7), (16, 17), (48, 33)])
def test_visited_blocks_count_a_causal_kernel(t, g):
  """One segment a row: the blocks a causal kernel visits are exactly the blocks holding a
  counted score (brute force), and so are the forward's; query blocks of 16 rows that end
  inside a token (G > 16 heads a kv head, one key block of 16) included."""
  seg = np.ones((2, t), np.int32)
  bq, bk = fa.geometry(t, g, fa.FWD_BLOCKS)
  n = len(_counted_blocks(seg, g, bq, bk))
  assert fa.visited_blocks(seg, g) == (n, n)
