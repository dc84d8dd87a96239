"""Paged attention (tlt_jax/kernels/paged_attention.py: the Pallas kernel in interpret mode on
this CPU, and its XLA form) against a float64 numpy reference written from the definition
(each query's visible slots gathered one by one through the page table), against the
windowed XLA path it replaces in a model forward, and the kernel lowered to Triton for an
abstract H100. The engine running
it is tests/test_rollout.py::test_paged_attention_engine_matches_transformers."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.kernels import paged_attention as pa
from tlt_jax.kernels.paged_attention import geometry, paged_attention
from tlt_jax.models.kv_cache import NO_PAGE, pages_for


def _tree_mask(rng, t: int) -> np.ndarray:
  """A draft tree's mask: node j's parent is some earlier node; each sees its ancestors and
  itself."""
  mask = np.eye(t, dtype=bool)
  for j in range(1, t):
    mask[j] |= mask[rng.integers(0, j)]
  return mask


def _case(seed, B, T, K, G, H, page, cols, lengths, dtype, tree):
  rng = np.random.default_rng(seed)
  P = B * cols + 3
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k_pool, v_pool = f(B, T, K * G, H), f(P, page, K, H), f(P, page, K, H)
  k_new, v_new = f(B, T, K, H), f(B, T, K, H)
  table = np.full((B, cols), NO_PAGE, np.int32)
  perm = rng.permutation(P)  # pages scattered over the pool, not in row order
  for b in range(B):
    n = pages_for(lengths[b] + T, page)
    table[b, :n] = perm[b * cols:b * cols + n]
  mask = np.stack([_tree_mask(rng, T) for _ in range(B)]) if tree else None
  cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the inputs' values
  return dict(q=cast(q), k_pool=cast(k_pool), v_pool=cast(v_pool), table=table,
              lengths=np.asarray(lengths, np.int32), k_new=cast(k_new), v_new=cast(v_new),
              mask=mask)


def _reference(c) -> np.ndarray:
  """float64: query t of row b sees the row's committed slots and the chunk's tokens its mask
  allows (causal without one)."""
  q, table, lengths = c["q"], c["table"], c["lengths"]
  B, T, N, H = q.shape
  K = c["k_new"].shape[2]
  page = c["k_pool"].shape[1]
  out = np.zeros((B, T, N, H))
  for b in range(B):
    L = int(lengths[b])
    prefix = [(table[b, s // page], s % page) for s in range(L)]
    for t in range(T):
      seen = c["mask"][b, t] if c["mask"] is not None else np.arange(T) <= t
      for n in range(N):
        kh = n // (N // K)
        ks = [c["k_pool"][p, o, kh] for p, o in prefix] + [c["k_new"][b, j, kh]
                                                             for j in range(T) if seen[j]]
        vs = [c["v_pool"][p, o, kh] for p, o in prefix] + [c["v_new"][b, j, kh]
                                                             for j in range(T) if seen[j]]
        ks, vs = np.asarray(ks, np.float64), np.asarray(vs, np.float64)
        s = ks @ q[b, t, n].astype(np.float64) / np.sqrt(H)
        p = np.exp(s - s.max())
        out[b, t, n] = (p / p.sum()) @ vs
  return out


def _run(c, dtype, splits=None, impl="pallas"):
  a = lambda x: jnp.asarray(x, dtype)
  return np.asarray(paged_attention(
      a(c["q"]), a(c["k_pool"]), a(c["v_pool"]), jnp.asarray(c["table"]),
      jnp.asarray(c["lengths"]), a(c["k_new"]), a(c["v_new"]),
      None if c["mask"] is None else jnp.asarray(c["mask"]), impl=impl, splits=splits,
      interpret=True).astype(jnp.float32))


@pytest.mark.parametrize("T,G,tree,splits", [
    (1, 2, False, None),  # a decode step, grouped heads
    (5, 1, True, None),  # a tree verification
    (5, 4, False, 3),  # a chain verification, the prefix split three ways
    (40, 2, True, 2),  # 80 query rows: two query blocks
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_kernel_matches_a_float64_reference(T, G, tree, splits, dtype, impl):
  """Rows committed to 0 slots, mid-page, a page's end and several loop blocks (pages of 8
  slots, 16 per block), unallocated table entries past each row's pages."""
  lengths = [0, 13, 16, 300]
  c = _case(0, 4, T, 2, G, 16, 8, pages_for(300 + T, 8) + 2, lengths, dtype, tree)
  got = _run(c, dtype, splits, impl)
  want = _reference(c)
  tol = 2e-5 if dtype == "float32" else 2e-2  # bf16: the probabilities' cast before p @ v
  np.testing.assert_allclose(got, want, atol=tol, rtol=0)


@pytest.mark.parametrize("K,tensor,tree", [(4, 4, True), (4, 2, False), (3, 2, True)])
def test_split_heads_run_per_device_and_match_the_reference(K, tensor, tree, monkeypatch):
  """models.attention.paged_cache_attention under a mesh whose "tensor" axis splits the kv
  heads (pools and queries placed so, as a replica's cache and projections are): the kernel
  (interpreted) runs on each device's heads and the result is the float64 reference's; kv
  heads the axis does not divide stay whole on every device."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tlt_jax.models.attention import paged_cache_attention
  from tlt_jax.sharding import make_mesh
  monkeypatch.setattr(pa, "default_impl", lambda: "pallas")
  seen = []
  real = pa.prefix_attention
  monkeypatch.setattr(pa, "prefix_attention",
                      lambda q, *a, **k: seen.append(q.shape[1]) or real(q, *a, **k))
  c = _case(2, 3, 4, K, 2, 16, 8, 6, [0, 9, 37], "float32", tree)
  mesh = make_mesh((1, 1, tensor), jax.devices()[:tensor])
  split = NamedSharding(mesh, P(None, None, "tensor" if K % tensor == 0 else None, None))
  whole = NamedSharding(mesh, P())
  args = [jax.device_put(c[n], split if n in ("q", "k_pool", "v_pool", "k_new", "v_new")
                         else whole)
          for n in ("q", "k_pool", "v_pool", "table", "lengths", "k_new", "v_new")]
  mask = None if c["mask"] is None else jax.device_put(c["mask"], whole)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    got = jax.jit(paged_cache_attention)(*args, mask)
  np.testing.assert_allclose(np.asarray(got), _reference(c), atol=2e-5, rtol=0)
  assert set(seen) == {K // tensor if K % tensor == 0 else K}, seen


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_kernel_reads_only_live_pages(impl):
  """What lies past a row's committed length (its own stale slots, NaN in unowned pages)
  does not reach its output: the kernel's loop ends at the live pages, and the partial last
  page is masked."""
  c = _case(1, 2, 3, 2, 2, 16, 8, 8, [11, 30], "float32", True)
  want = _run(c, "float32", impl=impl)
  poisoned = dict(c)
  k_pool, v_pool = c["k_pool"].copy(), c["v_pool"].copy()
  for b, L in enumerate(c["lengths"]):
    for s in range(int(L), 8 * 8):
      col = s // 8
      if c["table"][b, col] != NO_PAGE:
        k_pool[c["table"][b, col], s % 8] = np.nan
        v_pool[c["table"][b, col], s % 8] = np.nan
  owned = set(c["table"][c["table"] != NO_PAGE].tolist())
  for p in set(range(k_pool.shape[0])) - owned:
    k_pool[p] = v_pool[p] = np.nan
  poisoned.update(k_pool=k_pool, v_pool=v_pool)
  np.testing.assert_array_equal(_run(poisoned, "float32", impl=impl), want)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_forward_with_paged_attention_matches_the_window(impl, monkeypatch):
  """A model forward of a draft tree over a cache of ragged rows: the paged attention's
  logits and cache (the kernel, interpreted; its XLA form) equal the windowed XLA path's
  (models.attend over the gathered window)."""
  from tlt_jax.kernels import paged_attention as module
  from tlt_jax.models import forward, init_cache, init_params
  monkeypatch.setattr(module, "default_impl", lambda: impl)
  from tlt_jax.models.config import ModelConfig
  cfg = ModelConfig(arch="qwen3", vocab_size=48, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
  params = init_params(cfg, jax.random.key(0), std=0.2)
  b, p, t = 3, 40, 6
  toks = jax.random.randint(jax.random.key(1), (b, p), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(p), (b, p))
  cache = forward(params, toks, pos, cfg=cfg, cache=init_cache(cfg, b, 96), prefill=True).cache
  cache = cache.replace(lengths=jnp.array([40, 7, 23], jnp.int32))
  new = jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size)
  npos = cache.lengths[:, None] + jnp.arange(t)
  mask = jnp.asarray(np.stack([_tree_mask(np.random.default_rng(i), t) for i in range(b)]))
  win = forward(params, new, npos, cfg=cfg, cache=cache, attn_mask=mask, kv_len=48)
  paged = forward(params, new, npos, cfg=cfg.replace(cache_attention="paged"), cache=cache,
                  attn_mask=mask)
  assert float(jnp.abs(win.logits).max()) > 0.1  # not a vacuous comparison
  np.testing.assert_allclose(paged.logits, win.logits, atol=2e-5, rtol=0)
  for a, w in zip(paged.cache.k + paged.cache.v, win.cache.k + win.cache.v):
    np.testing.assert_allclose(a, w, atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_a_row_that_is_not_live_reads_none_of_its_pages(impl, monkeypatch):
  """A finished row kept in a batch holds its length while its pages are already another
  row's (the engine releases them): given as not live (models/transformer.py's `forward`),
  it reads none of them (its pages full of NaN reach no output), and the live rows' logits
  are those of a forward without it."""
  from tlt_jax.kernels import paged_attention as module
  from tlt_jax.models import forward, init_cache, init_params
  monkeypatch.setattr(module, "default_impl", lambda: impl)
  from tlt_jax.models.config import ModelConfig
  cfg = ModelConfig(arch="qwen3", vocab_size=48, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                    cache_attention="paged")
  params = init_params(cfg, jax.random.key(0), std=0.2)
  b, p = 3, 40
  toks = jax.random.randint(jax.random.key(1), (b, p), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(p), (b, p))
  cache = forward(params, toks, pos, cfg=cfg, cache=init_cache(cfg, b, 96), prefill=True).cache
  cache = cache.replace(lengths=jnp.array([40, 33, 23], jnp.int32))
  new = jax.random.randint(jax.random.key(2), (b, 1), 0, cfg.vocab_size)
  npos = cache.lengths[:, None]
  want = forward(params, new, npos, cfg=cfg, cache=cache).logits
  pages = np.asarray(cache.table[1])
  pages = pages[pages != NO_PAGE]
  poison = lambda pools: tuple(a.at[pages].set(jnp.nan) for a in pools)
  dead = cache.replace(k=poison(cache.k), v=poison(cache.v))
  live = jnp.array([[True], [False], [True]])
  got = forward(params, new, npos, cfg=cfg, cache=dead, live=live).logits
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_array_equal(got[::2], want[::2])
  assert not np.isfinite(np.asarray(forward(params, new, npos, cfg=cfg, cache=dead).logits[1])
                         ).all()  # (the same row, live, reads them)


def test_shapes_triton_cannot_block_are_one_error_before_lowering():
  """Compiled for a GPU (interpret=False), a head_dim or page size Triton cannot block is one
  error naming both and the setting to turn off, raised before anything is lowered."""
  from tlt_jax.kernels.paged_attention import prefix_attention
  for h, page in ((8, 16), (48, 16), (32, 12)):
    q = jnp.zeros((1, 2, 2, h))
    pool = jnp.zeros((4, page, 2, h))
    with pytest.raises(ValueError, match=rf"got head_dim {h}, page_size {page}: set "
                                         r"rollout.attention='windows'"):
      prefix_attention(q, pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                       interpret=False)


def test_splits_fill_the_device_only_where_rows_are_few():
  """Flash-decoding splits of the prefix: a lone row over a long table is split until the
  programs reach the device-filling count, a full batch is not; never more splits than
  loop blocks."""
  bq, nq, ppb, s = geometry(1, 4, 2, 512, 16)  # batch 1, 4 kv heads, 8k slots
  assert (bq, nq, ppb) == (16, 1, 8) and s == 64
  assert geometry(64, 8, 2, 512, 16)[3] == 1
  assert geometry(1, 1, 2, 8, 16)[3] == 1  # one loop block: nothing to split
  assert geometry(1, 2, 200, 64, 16)[:2] == (64, 4)  # 200 query rows: 4 blocks of 64


# JAX >= 0.11 deprecates the Pallas Triton backend (the kernel module's docstring says why it
# is used); lowering with it on purpose.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_to_triton(dtype):
  """The kernel lowers to Triton IR for CUDA (an abstract H100, no GPU needed): the Pallas ->
  TTIR step (power-of-two blocks, the page gather, the dynamic loop); compiling it for the
  device is the GPU checklist's kernels stage."""
  try:
    from jax._src.lib import triton  # noqa: F401  (the TTIR dialect bindings)
  except ImportError as e:
    pytest.skip(f"jaxlib without Triton bindings: {e}")
  S = jax.ShapeDtypeStruct
  B, T, K, G, H, P, page, C = 2, 5, 2, 2, 32, 64, 16, 16
  args = (S((B, T, K * G, H), dtype), S((P, page, K, H), dtype), S((P, page, K, H), dtype),
          S((B, C), jnp.int32), S((B,), jnp.int32), S((B, T, K, H), dtype),
          S((B, T, K, H), dtype), S((B, T, T), jnp.bool_))
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")
  fn = functools.partial(paged_attention, impl="pallas", interpret=False)
  with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text and "paged_prefix_attention" in text


@pytest.mark.parametrize("groups", [1, 2, 3, 7, 8, 16, 64])
def test_query_blocks_are_every_block_a_chunk_can_meet(groups):
  """The start-up check compiles one chunk per query block: `query_blocks` must hold every
  block `geometry` gives a chunk of 1..100 tokens, each with a token count that gives it."""
  blocks = pa.query_blocks(groups)
  seen = {geometry(2, 2, t * groups, 8, 16)[0] for t in range(1, 101)}
  assert set(blocks) == seen
  assert all(geometry(2, 2, t * groups, 8, 16)[0] == bq for bq, t in blocks.items())


def test_start_up_check_passes_the_kernel_and_catches_a_bad_one(monkeypatch):
  """`kernel_check` (interpreted here, compiled on a GPU) passes the kernel at a 7B model's
  grouping in bf16, and fails, with the reason, a kernel whose output is 10% off or that
  does not compile: a run then takes the windows instead of decoding wrong tokens."""
  assert pa.kernel_check(2, 7, 16, 16, "bfloat16", 6) is None
  real = pa.prefix_attention
  monkeypatch.setattr(pa, "prefix_attention",
                      lambda *a, **k: (lambda o, m, l: (o * 1.1, m, l))(*real(*a, **k)))
  assert re.fullmatch(r"disagrees with the XLA form at \d+ chunk tokens \(relative error "
                      r"\S+\)", pa.kernel_check.__wrapped__(2, 3, 16, 16, "float32", 6))

  def broken(*a, **k):
    raise RuntimeError("Triton: no such intrinsic\nmore")
  monkeypatch.setattr(pa, "prefix_attention", broken)
  assert pa.kernel_check.__wrapped__(2, 3, 16, 16, "float32", 6) == (
      "does not compile here at 5 chunk tokens (Triton: no such intrinsic)")


def test_gpu_verdict_names_the_kernels_limits_and_checks_one_devices_heads(monkeypatch):
  """The limits are named; within them the start-up check runs on the kv heads one device
  of the replica holds (all of them where the tensor width does not divide them, as the
  cache's sharding keeps them whole)."""
  for h, page in ((8, 16), (48, 16), (32, 12)):
    assert f"not {h} and {page}" in pa.gpu_verdict(2, 2, h, page, "bfloat16", 8)
  asked = []
  monkeypatch.setattr(pa, "kernel_check", lambda *a: asked.append(a) or None)
  for kv_heads, tensor in ((8, 4), (8, 1), (2, 2), (3, 2)):
    assert pa.gpu_verdict(kv_heads, 7, 128, 16, "bfloat16", 8, tensor=tensor) is None
  assert [a[0] for a in asked] == [2, 8, 1, 3]
  assert all(a[1:] == (7, 128, 16, "bfloat16", 8) for a in asked)


@pytest.mark.parametrize("paged,verdict,want", [
    (None, None, r"paged attention: each row's live pages read in place by the Pallas "
                 r"\(Triton\) kernel, one window \(rollout.attention=auto\)"),
    (None, "does not compile here at 2 chunk tokens (x)",
     r"attention windows, an executable per window \(rollout.attention=auto: the paged kernel "
     r"does not compile here at 2 chunk tokens \(x\)\)"),
    (False, None, r"attention windows, an executable per window \(rollout.attention=windows\)"),
    (True, "unused", r"paged attention: .* \(rollout.attention=paged\)")])
def test_a_gpu_replica_takes_paged_attention_where_the_kernel_serves_it(monkeypatch, paged,
                                                                         verdict, want):
  """On a GPU "auto" is the paged kernel where its verdict (limits, start-up check) passes
  it, else the windows with the reason; a pinned setting is not checked. The verdict gets
  the replica's geometry."""
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.rollout.config import EngineConfig
  asked = []
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pa, "gpu_verdict", lambda *a: asked.append(a) or verdict)
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=1, num_heads=8, num_kv_heads=2, head_dim=32, dtype="bfloat16")
  ecfg = EngineConfig(max_prompt_len=32, max_new_tokens=64, paged_attention=paged)
  out, why = ecfg.resolve_attention(cfg, tensor=1)
  assert re.fullmatch(want, why), why
  assert out.paged_attention is (paged if paged is not None else verdict is None)
  assert asked == ([(2, 4, 32, 16, "bfloat16", 6, 1)] if paged is None else [])


@pytest.mark.parametrize("fault", ["large_block", "long_rows", "nan", "five_percent"])
def test_start_up_check_covers_every_block_and_the_whole_table(monkeypatch, fault):
  """A kernel that is wrong only where a rollout would meet it still fails the check: only at
  the 64-row query block (a chunk of many tokens), only past a row's first 3 pages (a long
  response), NaN everywhere, or 5% off (2% is the check's bar)."""
  real = pa.prefix_attention

  def faulty(q, k_pool, v_pool, table, lengths, **k):
    if fault == "long_rows":  # reads no page past the third
      return real(q, k_pool, v_pool, table, jnp.minimum(lengths, 3 * k_pool.shape[1]), **k)
    o, m, l = real(q, k_pool, v_pool, table, lengths, **k)
    if fault == "large_block" and q.shape[2] > 32:
      o = o * 1.1
    elif fault == "nan":
      o = o * jnp.nan
    elif fault == "five_percent":
      o = o * 1.05
    return o, m, l
  monkeypatch.setattr(pa, "prefix_attention", faulty)
  groups, page, table_pages = 3, 16, 6
  why = pa.kernel_check.__wrapped__(2, groups, 16, page, "float32", table_pages)
  found = re.fullmatch(r"disagrees with the XLA form at (\d+) chunk tokens \(relative error "
                       r"(\S+)\)", why or "")
  assert found, why
  t = int(found.group(1))
  if fault == "large_block":  # the first chunk size that meets the 64-row block fails
    assert geometry(2, 2, t * groups, table_pages, page)[0] == 64
  if fault == "nan":
    assert found.group(2) == "nan"


def test_gpu_replica_with_tensor_parallel_takes_the_kernel(monkeypatch):
  """A replica whose kv heads are split over 2 devices takes the paged kernel on a GPU where
  the start-up check passes it, checked on one device's kv heads: the tensor width reaches the
  verdict from the replica's mesh."""
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.replica import Replica
  from tlt_jax.models import init_params
  from tlt_jax.sharding import make_mesh
  asked = []
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pa, "kernel_check", lambda *a: asked.append(a[0]) or None)
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
  ecfg = EngineConfig(max_prompt_len=16, max_new_tokens=16)
  params = init_params(cfg, jax.random.PRNGKey(0))
  rep = Replica(params, cfg, ecfg, mesh=make_mesh((1, 1, 2), jax.devices()[:2]))
  assert rep.ecfg.paged_attention is True and "Pallas (Triton) kernel" in rep.attention
  assert asked == [1]


@pytest.mark.parametrize("paged", [None, True, False])
@pytest.mark.parametrize("tp", [1, 4])
def test_the_simulator_resolves_attention_as_a_gpu_replica(monkeypatch, paged, tp):
  """plan/sim_engine prices the attention a GPU replica of the same tensor width would run
  (its kernel check passing): "auto" is the paged kernel at tp 1 and 4 alike."""
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.plan import cost
  from tlt_jax.plan.sim_engine import SimEngine
  from tlt_jax.rollout.config import EngineConfig
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=1, num_heads=8, num_kv_heads=4, head_dim=16, dtype="bfloat16")
  ecfg = EngineConfig(max_prompt_len=16, max_new_tokens=16, paged_attention=paged)
  sim = SimEngine(cfg, ecfg, cost.profile("h200"), tp=tp)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pa, "kernel_check", lambda *a: None)
  want = ecfg.resolve_attention(cfg, tensor=tp)[0].paged_attention
  assert sim.ecfg.paged_attention is want is (paged if paged is not None else True)
