"""Speculative verification (tlt_jax/kernels/verify/): kernel == reference, greedy == a plain
Python loop, and losslessness (chi-square against the exact target distribution), including a
check that deliberately broken rules are rejected by the same statistic.

Pallas runs in interpret mode here (CPU), so the kernel tests use small B / V; the statistical
tests use the vectorised jnp reference (the kernel is shown equal to it bit-for-bit).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tlt_jax.kernels.verify import kernel_backend, verify_chain, verify_tree
from tlt_jax.kernels.verify import reference as vref
from tlt_jax.kernels.verify import mosaic
from tlt_jax.kernels.verify.mosaic import verify_chain_mosaic, verify_tree_mosaic
from tlt_jax.kernels.verify.reference import (
    draw_tree_randomness,
    draw_verify_randomness,
    verify_chain_reference,
    verify_tree_reference,
)
from tlt_jax.kernels.verify.triton import verify_chain_triton, verify_tree_triton
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs

# the Mosaic GPU kernels need jax >= 0.11 (mosaic.AVAILABLE); on jax 0.10 Triton runs instead
needs_mosaic = pytest.mark.skipif(not mosaic.AVAILABLE, reason=mosaic.UNAVAILABLE)

NEG_INF = -np.inf

# ------------------------------------------------------------------------------------------------
# Random inputs with edge cases mixed in per row
# ------------------------------------------------------------------------------------------------

def _np_processed(logits, temperature, top_k, top_p):
  """numpy twin of `processed_logprobs` (temperature, top-k, top-p; threshold ties kept), for
  cheap random test inputs (eager/jitted jax calls per shape would dominate the test time)."""
  x = logits / temperature
  if top_k and top_k < x.shape[-1]:
    kth = np.sort(x, axis=-1)[..., -top_k][..., None]
    x = np.where(x < kth, NEG_INF, x)
  if top_p < 1.0:
    pr = np.exp(x - x.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    sp = -np.sort(-pr, axis=-1)
    kept = np.where(np.cumsum(sp, -1) - sp < top_p, sp, np.inf)
    x = np.where(pr < kept.min(-1, keepdims=True), NEG_INF, x)
  m = x.max(-1, keepdims=True)
  return (x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))).astype(np.float32)


_SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.9)]


def _processed_rows(rng, shape, ties_rows=()):
  """Random processed target log-probs [B, ..., V]: each row b gets its own logit scale and
  a random temperature/top-k/top-p setting; rows in ties_rows get integer logits (ties)."""
  B = shape[0]
  logits = rng.normal(size=shape) * rng.uniform(0.5, 3.0, size=(B,) + (1,) * (len(shape) - 1))
  for b in ties_rows:
    logits[b] = np.round(logits[b])  # few distinct values -> argmax / race ties
  return np.stack([_np_processed(logits[b], *_SETTINGS[rng.integers(len(_SETTINGS))])
                   for b in range(B)])


def _top2(rng, shape, scale):
  return _np_processed(rng.normal(size=shape) * scale, 1.0, 2, 1.0)


def test_np_processed_matches_sampler():
  rng = np.random.default_rng(0)
  for t, k, p in _SETTINGS:
    logits = rng.normal(size=(6, 23)) * 2
    if p == 1.0:  # ties at the top-k threshold (top-p sums are float-order sensitive there)
      logits = np.round(logits, 1)
    want = np.asarray(processed_logprobs(jnp.asarray(logits, jnp.float32),
                                         SamplingParams(t, top_k=k, top_p=p)))
    got = _np_processed(logits.astype(np.float32), t, k, p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=1e-5)


def _log(x):
  with np.errstate(divide="ignore"):
    return np.log(np.asarray(x, np.float32))


def _argmax(x):
  return int(np.argmax(x))  # lowest index on ties, like jnp.argmax


def make_chain_inputs(seed, B, K, V):
  """Rows cycle through edge cases: random, all-accept (draft = argmax p, q = p), top-k targets
  with random drafts (p(d) = 0), q == p with out-of-support drafts (empty residual), integer
  logits + zero noise (ties), q(d) = 0 < p(d)."""
  rng = np.random.default_rng(seed)
  tlp = np.zeros((B, K + 1, V), np.float32)
  qlp = np.zeros((B, K, V), np.float32)
  d = np.zeros((B, K), np.int32)
  u = rng.uniform(size=(B, K)).astype(np.float32)
  g = rng.gumbel(size=(B, K + 1, V)).astype(np.float32)
  ties = [b for b in range(B) if b % 7 == 4]
  tlp[:] = _processed_rows(rng, (B, K + 1, V), ties)
  qlp[:] = _processed_rows(rng, (B, K, V), ties)
  top2_a, top2_b = _top2(rng, (B, K + 1, V), 2.0), _top2(rng, (B, K + 1, V), 1.0)
  for b in range(B):
    kind = b % 7
    for i in range(K):
      qp = np.exp(qlp[b, i].astype(np.float64))
      d[b, i] = rng.choice(V, p=qp / qp.sum())
    if kind == 1:  # all accepted in greedy and sampling: d = argmax p, q = p
      d[b] = [_argmax(tlp[b, i]) for i in range(K)]
      qlp[b] = tlp[b, :K]
    elif kind == 2:  # top-k target, random drafts: often p(d) = 0
      tlp[b] = top2_a[b]
      d[b] = rng.integers(V, size=K)
    elif kind == 3:  # q == p, drafts outside the support -> residual has no mass
      tlp[b] = top2_b[b]
      qlp[b] = tlp[b, :K]
      for i in range(K):
        out = np.flatnonzero(tlp[b, i] == NEG_INF)
        d[b, i] = rng.choice(out) if len(out) and rng.uniform() < 0.7 else _argmax(tlp[b, i])
    elif kind == 4:  # ties: zero noise so the race is an argmax with ties
      g[b] = 0.0
      d[b, : K // 2] = [_argmax(tlp[b, i]) for i in range(K // 2)]
    elif kind == 5:  # q(d) = 0 < p(d): always accepted
      for i in range(K):
        d[b, i] = _argmax(tlp[b, i]) if rng.uniform() < 0.5 else d[b, i]
        qlp[b, i, d[b, i]] = NEG_INF
    elif kind == 6:  # first draft rejected for sure
      sup0 = np.flatnonzero(tlp[b, 0] == NEG_INF)
      if len(sup0):
        d[b, 0] = sup0[0]
      else:
        tlp[b, 0, d[b, 0]] = NEG_INF
  return tuple(map(jnp.asarray, (tlp, d, qlp, u, g)))


def make_tree(seed, kind, T, C, D):
  """children [T, C] and depth of each node for a tree of the given kind."""
  rng = np.random.default_rng(seed)
  kids = -np.ones((T, C), np.int32)
  depth = np.zeros(T, np.int32)
  if kind == "chain":
    for n in range(1, T):
      kids[n - 1, 0] = n
      depth[n] = n
  elif kind == "wide":
    assert T - 1 <= C
    kids[0, : T - 1] = np.arange(1, T)
    depth[1:] = 1
  else:  # "deep_wide" / "gaps": random tree, depth <= D, <= C children per node
    count = np.zeros(T, np.int32)
    for n in range(1, T):
      ok = [m for m in range(n) if depth[m] < D and count[m] < C]
      m = ok[-1] if rng.uniform() < 0.4 else rng.choice(ok)  # bias towards depth
      kids[m, count[m]] = n
      count[m] += 1
      depth[n] = depth[m] + 1
    if kind == "gaps":  # -1 holes between children: must be skipped, not end the list
      for m in range(T):
        row = [c for c in kids[m] if c >= 0]
        if row and len(row) < C:
          slots = np.sort(rng.choice(C, size=len(row), replace=False))
          kids[m] = -1
          kids[m, slots] = row
  return kids, depth


def make_tree_inputs(seed, B, kind, T, C, D, V):
  """Per row: processed targets at every node, tokens mostly sampled from the parent's target
  (so paths get accepted), some argmax children, duplicate siblings, out-of-support tokens."""
  rng = np.random.default_rng(seed)
  kids, depth = make_tree(seed, kind, T, C, D)
  parent = -np.ones(T, np.int32)
  for m in range(T):
    for c in kids[m]:
      if c >= 0:
        parent[c] = m
  tlp = _processed_rows(rng, (B, T, V), [b for b in range(B) if b % 5 == 4])
  toks = np.zeros((B, T), np.int32)
  for b in range(B):
    for n in range(T):
      if n == 0:
        toks[b, 0] = rng.integers(V)
        continue
      p = np.exp(tlp[b, parent[n]].astype(np.float64))
      r = rng.uniform()
      if r < 0.35:
        toks[b, n] = _argmax(tlp[b, parent[n]])
      elif r < 0.5:
        toks[b, n] = rng.integers(V)  # possibly outside the support
      else:
        toks[b, n] = rng.choice(V, p=p / p.sum())
    if b % 3 == 2:  # duplicate siblings
      for m in range(T):
        row = [c for c in kids[m] if c >= 0]
        if len(row) >= 2:
          toks[b, row[1]] = toks[b, row[0]]
  u = rng.uniform(size=(B, T)).astype(np.float32)
  g = rng.gumbel(size=(B, T, V)).astype(np.float32)
  g[B - 1] = 0.0  # one row with ties in the race
  children = np.broadcast_to(kids, (B, T, C)).copy()
  return tuple(map(jnp.asarray, (tlp, toks, children, u, g)))


# ------------------------------------------------------------------------------------------------
# Plain Python loop references (greedy)
# ------------------------------------------------------------------------------------------------


def py_greedy_chain(tlp, d):
  tlp, d = np.asarray(tlp), np.asarray(d)
  B, K = d.shape
  n_out, nxt_out = [], []
  for b in range(B):
    n = 0
    while n < K and d[b, n] == _argmax(tlp[b, n]):
      n += 1
    n_out.append(n)
    nxt_out.append(_argmax(tlp[b, n]))
  return np.array(n_out), np.array(nxt_out)


def py_greedy_tree(tlp, toks, kids, D):
  tlp, toks, kids = map(np.asarray, (tlp, toks, kids))
  paths, ns, nxts = [], [], []
  for b in range(tlp.shape[0]):
    c, path = 0, [0]
    while len(path) - 1 < D:
      a = _argmax(tlp[b, c])
      nxt_node = next((ch for ch in kids[b, c] if ch >= 0 and toks[b, ch] == a), None)
      if nxt_node is None:
        break
      c = int(nxt_node)
      path.append(c)
    ns.append(len(path) - 1)
    nxts.append(_argmax(tlp[b, c]))
    paths.append(path + [-1] * (D + 1 - len(path)))
  return np.array(paths), np.array(ns), np.array(nxts)


# ------------------------------------------------------------------------------------------------
# Kernel == reference (exact)
# ------------------------------------------------------------------------------------------------

# Off-GPU the kernels run interpreted (Triton: Pallas' HLO interpreter; Mosaic GPU: its GPU
# interpreter, which simulates GMEM and the warpgroup); on a GPU (scripts/gpu_check.sh) compiled.
INTERPRET = jax.default_backend() != "gpu"

# Triton (K, V, block_v): V not a multiple of the block (masked last tile), multiple tiles,
# one tile.
CHAIN_CONFIGS = [(1, 7, None), (2, 37, 16), (3, 64, 16), (4, 130, 32), (5, 20, 8), (6, 33, 8),
                 (7, 9, 8), (8, 45, 16)]
# Mosaic GPU (K, V, block_v): tiles are multiples of the 128 lanes; V not a multiple of 128
# (padded outside the kernel), several full tiles, full tiles + a remainder tile, one tile.
MOSAIC_CHAIN_CONFIGS = [(1, 7, None), (2, 37, 128), (4, 300, 128), (3, 640, 256),
                        (8, 130, 128), (5, 1000, 512)]


def _assert_equal(got, want):
  for g_, w_ in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))


def _check_chain_kernel(kernel, modes, K, V, block_v):
  B = 14
  tlp, d, qlp, u, g = make_chain_inputs(1000 + K, B, K, V)
  for mode in modes:
    greedy = mode == "greedy"
    q = qlp if mode == "q" else None
    want = verify_chain(tlp, d, q, u, g, greedy=greedy, use_kernel=False)
    got = kernel(tlp, d, q, u, g, greedy=greedy, interpret=INTERPRET, block_v=block_v)
    _assert_equal(got, want)
    n, nxt = map(np.asarray, got)
    assert ((0 <= n) & (n <= K)).all()
    # never a token outside the support of the distribution it was drawn from
    assert np.isfinite(np.asarray(tlp)[np.arange(B), n, nxt]).all()
    if greedy:
      _assert_equal(got, py_greedy_chain(tlp, d))
  # the edge-case rows really occur: all accepted (greedy; sampling with q), first rejected
  n_g = np.asarray(verify_chain_reference(tlp, d, None, u, g, greedy=True)[0])
  n_s = np.asarray(verify_chain_reference(tlp, d, qlp if "q" in modes else None, u, g,
                                          greedy=False)[0])
  assert (n_g == K).any() and (n_s == 0).any()
  assert "q" not in modes or (n_s == K).any()


@pytest.mark.parametrize("K,V,block_v", CHAIN_CONFIGS)
def test_chain_kernel_matches_reference(K, V, block_v):
  """Triton kernel (the pre-Hopper fallback) == reference, exactly."""
  _check_chain_kernel(verify_chain_triton, ("greedy", "q", "onehot"), K, V, block_v)


@needs_mosaic
@pytest.mark.parametrize("K,V,block_v", MOSAIC_CHAIN_CONFIGS)
def test_mosaic_chain_kernel_matches_reference(K, V, block_v):
  """Mosaic GPU kernel == reference, exactly (greedy and one-hot sampling; with draft q the
  dispatcher keeps the reference on Mosaic GPU, see mosaic._MOSAIC_NO_Q)."""
  _check_chain_kernel(verify_chain_mosaic, ("greedy", "onehot"), K, V, block_v)


@needs_mosaic
def test_mosaic_chain_with_draft_q_uses_the_reference():
  tlp, d, qlp, u, g = make_chain_inputs(7, 3, 2, 40)
  with pytest.raises(NotImplementedError, match="log1p"):
    verify_chain_mosaic(tlp, d, qlp, u, g, greedy=False, interpret=True)
  assert kernel_backend() == "mosaic_gpu"  # this CPU: Mosaic GPU in interpret mode
  _assert_equal(verify_chain(tlp, d, qlp, u, g, greedy=False),
                verify_chain_reference(tlp, d, qlp, u, g, greedy=False))


class _FakeDevice:
  def __init__(self, platform, cc=None):
    self.platform = platform
    if cc is not None:
      self.compute_capability = cc


@pytest.mark.parametrize("platform,cc,want", [
    ("cpu", None, "mosaic_gpu"), ("tpu", None, "mosaic_gpu"), ("gpu", "8.0", "triton"),
    ("gpu", "8.9", "triton"), ("gpu", "9.0", "mosaic_gpu"), ("gpu", "10.0", "mosaic_gpu"),
    ("gpu", "12.1", "mosaic_gpu"), ("gpu", None, "triton")])
def test_kernel_backend_by_device(monkeypatch, platform, cc, want):
  """Mosaic GPU on Hopper or newer (cc 10.0 > 9.0 numerically, not as strings), Triton before
  (and on GPUs without a CUDA compute capability), Mosaic GPU's interpreter off-GPU; Triton
  everywhere on a JAX without the Mosaic GPU API the kernels use (jax 0.10)."""
  monkeypatch.setattr(jax, "devices", lambda *a: [_FakeDevice(platform, cc)])
  monkeypatch.setattr(mosaic, "AVAILABLE", True)
  assert kernel_backend() == want
  monkeypatch.setattr(mosaic, "AVAILABLE", False)
  assert kernel_backend() == "triton"


TREE_CONFIGS = [  # (kind, T, C, D, V, block_v)
    ("chain", 6, 1, 5, 19, 8),
    ("wide", 6, 5, 1, 37, 16),
    ("deep_wide", 15, 3, 4, 45, 16),
    ("deep_wide", 20, 4, 3, 8, None),
    ("gaps", 12, 4, 4, 33, 32),
]


MOSAIC_TREE_CONFIGS = [  # (kind, T, C, D, V, block_v)
    ("chain", 6, 1, 5, 19, 128),
    ("wide", 6, 5, 1, 37, None),
    ("deep_wide", 15, 3, 4, 300, 128),
    ("deep_wide", 20, 4, 3, 8, None),
    ("gaps", 12, 4, 4, 640, 256),
]


def _check_tree_kernel(kernel, kind, T, C, D, V, block_v):
  B = 12
  tlp, toks, kids, u, g = make_tree_inputs(2000 + T, B, kind, T, C, D, V)
  run = functools.partial(kernel, interpret=INTERPRET, block_v=block_v)
  for greedy in (True, False):
    want = verify_tree(tlp, toks, kids, u, g, greedy=greedy, max_depth=D, use_kernel=False)
    got = run(tlp, toks, kids, u, g, greedy=greedy, max_depth=D)
    _assert_equal(got, want)
    path, n, nxt = map(np.asarray, got)
    assert path.shape == (B, D + 1) and (path[:, 0] == 0).all()
    assert (n == (path[:, 1:] >= 0).sum(1)).all()
    last = path[np.arange(B), n]
    assert np.isfinite(np.asarray(tlp)[np.arange(B), last, nxt]).all()
    for b in range(B):  # the path follows parent -> child edges
      for j in range(n[b]):
        assert path[b, j + 1] in np.asarray(kids)[b, path[b, j]]
    if greedy:
      _assert_equal(got, py_greedy_tree(tlp, toks, kids, D))
  if kind == "deep_wide":  # truncating the walk below the tree's depth: still equal
    got = run(tlp, toks, kids, u, g, greedy=False, max_depth=1)
    want = verify_tree(tlp, toks, kids, u, g, greedy=False, max_depth=1, use_kernel=False)
    _assert_equal(got, want)


@pytest.mark.parametrize("kind,T,C,D,V,block_v", TREE_CONFIGS)
def test_tree_kernel_matches_reference(kind, T, C, D, V, block_v):
  """Triton kernel (the pre-Hopper fallback) == reference, exactly."""
  _check_tree_kernel(verify_tree_triton, kind, T, C, D, V, block_v)


@needs_mosaic
@pytest.mark.parametrize("kind,T,C,D,V,block_v", MOSAIC_TREE_CONFIGS)
def test_mosaic_tree_kernel_matches_reference(kind, T, C, D, V, block_v):
  _check_tree_kernel(verify_tree_mosaic, kind, T, C, D, V, block_v)


def _impls(rule):
  """(name, fn) for the reference and both kernels of a rule, same keyword contract."""
  ref, triton, mosaic_fn = ((verify_chain_reference, verify_chain_triton, verify_chain_mosaic)
                            if rule == "chain" else
                            (verify_tree_reference, verify_tree_triton, verify_tree_mosaic))
  mosaic_fn = mosaic_fn if mosaic.AVAILABLE else None
  return [("reference", ref)] + [
      (name, functools.partial(fn, interpret=INTERPRET))
      for name, fn in (("triton", triton), ("mosaic_gpu", mosaic_fn)) if fn is not None]


def test_chain_edge_cases_exact():
  """Hand-built rows: p(d) = 0 rejects, q(d) = 0 < p(d) accepts, p == q accepts everything,
  residual with no mass falls back to p (and stays inside p's support), ties -> lowest id."""
  V, K = 5, 2
  lp = _log([0.5, 0.3, 0.2, 0.0, 0.0])  # -inf outside the support
  tlp = np.broadcast_to(lp, (4, K + 1, V)).copy()
  qlp = np.broadcast_to(np.log(np.full(V, 0.2, np.float32)), (4, K, V)).copy()
  d = np.array([[3, 0], [1, 1], [0, 0], [4, 4]], np.int32)
  qlp[1, 0, 1] = NEG_INF  # row 1: q(d) = 0 < p(d): accepted
  qlp[1, 1, 1] = NEG_INF
  qlp[2] = tlp[2, :K]  # row 2: p == q: always accepted -> bonus from p_K
  qlp[3] = tlp[3, :K]  # row 3: p == q, p(d) = 0: rejected, residual empty -> sample from p
  u = np.full((4, K), 0.999, np.float32)
  g = np.zeros((4, K + 1, V), np.float32)
  g[:, :, 3] = 50.0  # the race would pick token 3 if it were not outside the support
  args = tuple(map(jnp.asarray, (tlp, d, qlp, u, g)))
  for name, run in _impls("chain"):
    if name != "mosaic_gpu":  # draft q: no Mosaic GPU kernel (mosaic._MOSAIC_NO_Q)
      n, nxt = map(np.asarray, run(*args, greedy=False))
      np.testing.assert_array_equal(n, [0, 2, 2, 0])
      np.testing.assert_array_equal(nxt, [0, 0, 0, 0])  # zero noise elsewhere: argmax p = 0
    # one-hot drafts: accept prob p(d) (u = 0.999 rejects everything but p(d) = 1)
    n1, nxt1 = map(np.asarray, run(*args[:2], None, *args[3:], greedy=False))
    np.testing.assert_array_equal(n1, [0, 0, 0, 0])
    np.testing.assert_array_equal(nxt1, [0, 0, 1, 0])  # row 2: d=0 removed -> next best 1
  assert not np.isnan(np.asarray(vref._residual_logp(jnp.asarray(tlp), jnp.asarray(tlp)))).any()
  # greedy ties: lowest index wins
  tie = _log([0.1, 0.4, 0.4, 0.1, 0.0])
  tl = jnp.asarray(np.broadcast_to(tie, (2, K + 1, V)).copy())
  dd = jnp.asarray(np.array([[1, 1], [2, 1]], np.int32))
  for _, run in _impls("chain"):
    n, nxt = map(np.asarray, run(tl, dd, None, None, None, greedy=True))
    np.testing.assert_array_equal(n, [2, 0])
    np.testing.assert_array_equal(nxt, [1, 1])


def test_tree_edge_cases_exact():
  """Duplicate siblings (the second copy is always rejected), leaves, p(tok) = 0 children."""
  V = 4
  p = _log([0.6, 0.4, 0.0, 0.0])
  tlp = jnp.asarray(np.broadcast_to(p, (3, 4, V)).copy())
  # root children: 1 (tok 0), 2 (tok 0, duplicate), 3 (tok 2, p = 0); nodes 1..3 are leaves
  kids = jnp.asarray(np.broadcast_to(np.array([[1, 2, 3], [-1] * 3, [-1] * 3, [-1] * 3]),
                                     (3, 4, 3)).copy())
  toks = jnp.asarray(np.array([[9 % V, 0, 0, 2]] * 3, np.int32))
  u = np.zeros((3, 4), np.float32)
  u[0, 1] = 0.0  # row 0: accept node 1 (u < 0.6)
  u[1, 1], u[1, 2] = 0.99, 0.0  # row 1: reject node 1; node 2 (dup) must be rejected even at u=0
  u[2, 1], u[2, 3] = 0.99, 0.0  # row 2: same; node 3 has p = 0
  g = np.zeros((3, 4, V), np.float32)
  g[:, :, 2] = 50.0  # would pick the out-of-support token 2 if the mask were wrong
  for _, run in _impls("tree"):
    path, n, nxt = map(np.asarray, run(tlp, toks, kids, jnp.asarray(u), jnp.asarray(g),
                                       greedy=False, max_depth=1))
    np.testing.assert_array_equal(path, [[0, 1], [0, -1], [0, -1]])
    np.testing.assert_array_equal(n, [1, 0, 0])
    # row 0: leaf -> sample from p (noise 0 off-token-2 -> argmax 0); rows 1-2: token 0 rejected
    # -> residual is token 1 only
    np.testing.assert_array_equal(nxt, [0, 1, 1])


def test_verify_is_jittable_and_randomness_shapes():
  key = jax.random.PRNGKey(0)
  u, g = draw_verify_randomness(key, 3, 4, 11)
  assert u.shape == (3, 4) and g.shape == (3, 5, 11)
  assert float(u.min()) >= 0.0 and float(u.max()) < 1.0 and bool(jnp.isfinite(g).all())
  ut, gt = draw_tree_randomness(key, 3, 6, 11)
  assert ut.shape == (3, 6) and gt.shape == (3, 6, 11)
  tlp, d, qlp, _, _ = make_chain_inputs(5, 3, 4, 11)

  @jax.jit
  def f(key, tlp, d, qlp):  # arrays as arguments: closed-over constants get constant-folded
    uu, gg = draw_verify_randomness(key, 3, 4, 11)
    # with draft q and one-hot (the latter through the Mosaic GPU kernel on every backend)
    return verify_chain(tlp, d, qlp, uu, gg, greedy=False), verify_chain(tlp, d, None, uu, gg,
                                                                        greedy=False)

  with_q, onehot = f(key, tlp, d, qlp)
  _assert_equal(with_q, verify_chain_reference(tlp, d, qlp, u, g, greedy=False))
  _assert_equal(onehot, verify_chain_reference(tlp, d, None, u, g, greedy=False))


def _abstract_gpu_mesh():
  """An empty abstract mesh on an abstract H100, for lowering GPU kernels on a machine without
  one: JAX >= 0.11 takes the target GPU (its compute capability) from the abstract mesh's
  device and refuses to lower Triton kernels without a GPU otherwise; 0.10 ignores it and falls
  back to compute capability 9.0, the same target."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


_S, _F32, _I32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
_LB, _LK, _LV, _LT, _LC, _LD = 4, 3, 1000, 7, 3, 3  # lowering shapes: V not a tile multiple


def _lower_for_h100(fn, args, **kw):
  f = functools.partial(fn, interpret=False, block_v=256, **kw)
  with _abstract_gpu_mesh():
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# JAX >= 0.11 deprecates the Pallas Triton backend (the module docstring of tlt_jax.kernels.verify
# says where it is still used); this test lowers with it on purpose.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_lower_to_triton():
  """The Triton kernels lower to Triton IR for CUDA (cross-platform lowering for an abstract
  H100; no GPU needed). This checks the Pallas -> TTIR step (supported primitives,
  power-of-two tensors); the Triton compiler itself only runs on a GPU."""
  try:
    from jax._src.lib import triton  # noqa: F401  (the TTIR dialect bindings)
  except ImportError as e:
    pytest.skip(f"jaxlib without Triton bindings: {e}")
  B, K, V, T, C, D = _LB, _LK, _LV, _LT, _LC, _LD
  cases = [
      (verify_chain_triton, (_S((B, K + 1, V), _F32), _S((B, K), _I32), _S((B, K, V), _F32),
                             _S((B, K), _F32), _S((B, K + 1, V), _F32)), {}),
      (verify_chain_triton, (_S((B, K + 1, V), _F32), _S((B, K), _I32), None,
                             _S((B, K), _F32), _S((B, K + 1, V), _F32)), {}),
      (verify_tree_triton, (_S((B, T, V), _F32), _S((B, T), _I32), _S((B, T, C), _I32),
                            _S((B, T), _F32), _S((B, T, V), _F32)), {"max_depth": D}),
  ]
  for fn, args, kw in cases:
    for greedy in (True, False):
      assert "xla.gpu.triton" in _lower_for_h100(fn, args, greedy=greedy, **kw)


@needs_mosaic
@pytest.mark.parametrize("V", [_LV, 151936])  # Qwen2.5's vocabulary: full tiles + remainder
def test_kernels_lower_to_mosaic_gpu(V):
  """The Mosaic GPU kernels lower for an abstract H100 without a GPU (jax 0.12 lowers Pallas
  to the Mosaic GPU dialect with jaxlib's own MLIR; the bindings of jax-cudaNN-plugin are only
  needed to compile it to a cubin): layouts, loads and reductions are checked here, the
  Mosaic GPU custom call is emitted, and nothing lowers through the deprecated Triton backend
  (no DeprecationWarning)."""
  B, K, T, C, D = _LB, _LK, _LT, _LC, _LD
  cases = [
      (verify_chain_mosaic, (_S((B, K + 1, V), _F32), _S((B, K), _I32), None,
                             _S((B, K), _F32), _S((B, K + 1, V), _F32)), {}),
      (verify_tree_mosaic, (_S((B, T, V), _F32), _S((B, T), _I32), _S((B, T, C), _I32),
                            _S((B, T), _F32), _S((B, T, V), _F32)), {"max_depth": D}),
  ]
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    for fn, args, kw in cases:
      for greedy in (True, False):
        text = _lower_for_h100(fn, args, greedy=greedy, **kw)
        assert "mosaic_gpu" in text and "triton" not in text


# ------------------------------------------------------------------------------------------------
# Losslessness (chi-square on the emitted tokens vs the exact target distribution)
# ------------------------------------------------------------------------------------------------

VS = 7  # vocabulary of the statistical tests
N = 40_000  # rows per vectorised verification call


def _softmax_logp(x):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def markov_model(seed, top_k=False, repeat=0.0):
  """Target: t1 ~ p0, t_{n+1} ~ P[t_n]. Drafter (deliberately mismatched): q0, Q[t].
  repeat: added to the target's logit of repeating the last token."""
  rng = np.random.default_rng(seed)
  tl0, tl = rng.normal(size=VS) * 2.0, rng.normal(size=(VS, VS)) * 2.0 + repeat * np.eye(VS)
  if top_k:
    sp = SamplingParams(0.8, top_k=4)
    p0 = np.asarray(processed_logprobs(jnp.asarray(tl0, jnp.float32), sp))
    P = np.asarray(processed_logprobs(jnp.asarray(tl, jnp.float32), sp))
  else:
    p0, P = _softmax_logp(tl0), _softmax_logp(tl)
  q0, Q = _softmax_logp(rng.normal(size=VS) * 1.5), _softmax_logp(rng.normal(size=(VS, VS)) * 1.5)
  return p0, P, q0, Q


def chi2_p(counts, probs):
  """Chi-square p-value of observed counts vs exact probs (cells with expected < 5 pooled);
  asserts that zero-probability cells were never hit."""
  counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
  assert counts[probs == 0].sum() == 0, "emitted a token outside the target support"
  exp = probs / probs.sum() * counts.sum()
  keep = exp >= 5
  obs_k, exp_k = list(counts[keep]), list(exp[keep])
  if (~keep & (probs > 0)).any():
    obs_k.append(counts[~keep].sum())
    exp_k.append(exp[~keep].sum())
  return stats.chisquare(obs_k, exp_k).pvalue


def _joint_pvalues(seqs, p0, P):
  """Chi-square p-values of the first 1, 2, ..., M tokens of `seqs` [N, M] against the
  Markov target's exact joint p0[t1] P[t1, t2] ... P[t_{M-1}, t_M]."""
  p0p, Pp = np.exp(p0.astype(np.float64)), np.exp(P.astype(np.float64))
  joint, cell = p0p, seqs[:, 0]
  out = [chi2_p(np.bincount(cell, minlength=VS), joint)]
  for m in range(1, seqs.shape[1]):
    # cell c of m tokens ends in token c % VS: the next token follows that token's row of P
    joint = (joint[:, None] * Pp[np.arange(joint.size) % VS]).reshape(-1)
    cell = cell * VS + seqs[:, m]
    out.append(chi2_p(np.bincount(cell, minlength=VS ** (m + 1)), joint))
  return out


def chain_round(key, start_p, start_q, P, Q, K, mode, rule):
  """One verification round for N rows starting from per-row target/drafter rows [N, V].
  mode: "q" (drafts ~ q, with draft_logp) | "onehot" (drafts = drafter argmax, no draft_logp).
  Returns the emitted tokens [N, K+1] (-1 past the end)."""
  kd, kr = jax.random.split(key)
  Pj, Qj = jnp.asarray(P), jnp.asarray(Q)
  tl, ql, ds = [start_p], [start_q], []
  for i in range(K):
    if mode == "q":
      tok = jax.random.categorical(jax.random.fold_in(kd, i), ql[-1]).astype(jnp.int32)
    else:
      tok = jnp.argmax(ql[-1], axis=-1).astype(jnp.int32)
    ds.append(tok)
    tl.append(Pj[tok])
    if i < K - 1:
      ql.append(Qj[tok])
  tlp, qlp, d = jnp.stack(tl, 1), jnp.stack(ql, 1), jnp.stack(ds, 1)
  u, g = draw_verify_randomness(kr, tlp.shape[0], K, VS)
  n, nxt = rule(tlp, d, qlp if mode == "q" else None, u, g, greedy=False)
  pos = jnp.arange(K + 1)[None, :]
  emitted = jnp.where(pos < n[:, None], jnp.pad(d, ((0, 0), (0, 1))), -1)
  return jnp.where(pos == n[:, None], nxt[:, None], emitted)


def first_tokens(seed, M, start, round_fn):
  """The first M tokens of N independent sequences, as many verification rounds as they take:
  each round starts every row from its last token's rows (`start(last)` -> (p rows, q rows);
  `start(None)`: the first round's) and appends what it emits (`round_fn(key, p, q)` ->
  [N, R] tokens, -1 past the end). So the accepted drafts, the token after the first
  rejection AND the bonus token after a fully accepted round are all in the joint."""
  out, filled = np.full((N, M), -1, np.int64), np.zeros(N, np.int64)
  rows, key, last = np.arange(N), jax.random.PRNGKey(seed), None
  while filled.min() < M:
    key, sub = jax.random.split(key)
    emitted = np.asarray(round_fn(sub, *start(last)))
    for tok in emitted.T:
      take = (tok >= 0) & (filled < M)
      out[rows[take], filled[take]] = tok[take]
      filled += take
    last = out[rows, filled - 1]
  return out


def _markov_start(model, jnp_rows):
  p0, P, q0, Q = model
  def start(last):
    if last is None:
      return jnp_rows(np.broadcast_to(p0, (N, VS))), jnp_rows(np.broadcast_to(q0, (N, VS)))
    return jnp_rows(np.asarray(P)[last]), jnp_rows(np.asarray(Q)[last])
  return start


def chain_first(seed, model, K, mode, rule, M=None):
  """The first M (default K + 1: every draft and the bonus) tokens of chain rounds of depth K
  under `rule`."""
  P, Q = jnp.asarray(model[1]), jnp.asarray(model[3])
  return first_tokens(seed, M or K + 1, _markov_start(model, jnp.asarray),
                      lambda key, sp, sq: chain_round(key, sp, sq, P, Q, K, mode, rule))


def build_q_tree(root_q, Q, widths, dup=False):
  """Deterministic draft tree from the drafter's top tokens: the root gets widths[0] children
  (top tokens of root_q, in score order), their children the top widths[1] of Q[tok], ...
  root_q [N, V] (per-row root). dup=True repeats the root's first child token as its second
  child. Returns tokens [N, T], children [N, T, C], parent-token index per node (-1 = root)."""
  Nr = root_q.shape[0]
  C = max(widths)
  toks, parent = [np.zeros(Nr, np.int32)], [-1]
  frontier = [(0, np.asarray(root_q))]
  kids_of = {}
  for depth, w in enumerate(widths):
    nxt = []
    for node, qrow in frontier:
      order = np.argsort(-qrow, axis=-1, kind="stable")[:, :w]
      if dup and depth == 0 and w >= 2:
        order = order.copy()
        order[:, 1] = order[:, 0]
      kids_of[node] = []
      for j in range(w):
        tok = order[:, j].astype(np.int32)
        toks.append(tok)
        parent.append(node)
        new = len(toks) - 1
        kids_of[node].append(new)
        nxt.append((new, Q[tok]))
    frontier = nxt
  T = len(toks)
  children = -np.ones((T, C), np.int32)
  for node, ch in kids_of.items():
    children[node, : len(ch)] = ch
  return np.stack(toks, 1), np.broadcast_to(children, (Nr, T, C)).copy(), parent


def tree_round(key, root_p, root_q, P, Q, widths, dup, rule):
  toks, kids, parent = build_q_tree(root_q, Q, widths, dup)
  T = toks.shape[1]
  tl = [root_p] + [P[toks[:, n]] for n in range(1, T)]  # p at node n: after its token
  tlp = jnp.asarray(np.stack(tl, 1))
  u, g = draw_tree_randomness(key, tlp.shape[0], T, VS)
  D = len(widths)
  path, n, nxt = rule(tlp, jnp.asarray(toks), jnp.asarray(kids), u, g, greedy=False,
                      max_depth=D)
  path, n, nxt = map(np.asarray, (path, n, nxt))
  rows = np.arange(toks.shape[0])
  emitted = -np.ones((toks.shape[0], D + 1), np.int64)
  for j in range(D):
    emitted[:, j] = np.where(j < n, toks[rows, np.maximum(path[:, j + 1], 0)], -1)
  emitted[rows, n] = nxt
  return emitted


def tree_first(seed, model, widths, dup, rule):
  """The first len(widths) + 1 tokens (the deepest path and the token after it) of tree
  rounds under `rule`."""
  P, Q = model[1], model[3]
  return first_tokens(seed, len(widths) + 1, _markov_start(model, np.asarray),
                      lambda key, sp, sq: tree_round(key, sp, sq, P, Q, widths, dup, rule))


# --- deliberately broken rules (modified copies of the reference) ------------------------------


def _accepted(target_logp, draft_tokens, draft_logp, uniforms):
  """The reference's count of accepted drafts [B]: d_i with probability min(1, p / q)
  (q = 1: one-hot drafts), up to the first rejection."""
  K = draft_tokens.shape[1]
  lp_d = jnp.take_along_axis(target_logp[:, :K], draft_tokens[..., None], -1)[..., 0]
  lq_d = (jnp.zeros_like(lp_d) if draft_logp is None else
          jnp.take_along_axis(draft_logp, draft_tokens[..., None], -1)[..., 0])
  acc = (uniforms < vref._accept_ratio(lp_d, lq_d)).astype(jnp.int32)
  return jnp.sum(jnp.cumprod(acc, axis=1), axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("greedy",))
def chain_broken_resample_from_p(target_logp, draft_tokens, draft_logp, uniforms, noise, *,
                                 greedy):
  """BROKEN: on rejection resample from p_j instead of norm(max(p_j - q_j, 0))."""
  del greedy
  rows = jnp.arange(target_logp.shape[0])
  n = _accepted(target_logp, draft_tokens, draft_logp, uniforms)
  lp_n = target_logp[rows, n]
  return n, jnp.argmax(lp_n + noise[rows, n], axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("greedy",))
def chain_broken_always_accept(target_logp, draft_tokens, draft_logp, uniforms, noise, *,
                               greedy):
  """BROKEN: accept every proposed draft (p/q acceptance without the coin), bonus from p_K."""
  del draft_logp, uniforms, greedy
  B, K1, _ = target_logp.shape
  n = jnp.full((B,), K1 - 1, jnp.int32)
  return n, jnp.argmax(target_logp[:, -1] + noise[:, -1], axis=-1).astype(jnp.int32)


def _chain_broken(*, bonus_from_residual=False, residual_without_q=False):
  """BROKEN copies of the reference's sampled chain rule: `bonus_from_residual` draws the
  token after K accepted drafts from the residual against the last draft's q (or without the
  last draft, one-hot) instead of from p_K; `residual_without_q` draws the token after a
  rejection from p restricted to p > q instead of norm(max(p - q, 0))."""
  @functools.partial(jax.jit, static_argnames=("greedy",))
  def rule(target_logp, draft_tokens, draft_logp, uniforms, noise, *, greedy):
    del greedy
    B, K1, V = target_logp.shape
    K = K1 - 1
    rows = jnp.arange(B)
    n = _accepted(target_logp, draft_tokens, draft_logp, uniforms)
    has_d = jnp.ones((B, 1), bool) if bonus_from_residual else (n < K)[:, None]
    jq = jnp.minimum(n, K - 1)
    lp_n = target_logp[rows, n]
    if draft_logp is None:
      hit = (jnp.arange(V)[None, :] == draft_tokens[rows, jq][:, None]) & has_d
      logr = jnp.where(hit, NEG_INF, lp_n)
    else:
      lq_n = jnp.where(has_d, draft_logp[rows, jq], NEG_INF)
      logr = (jnp.where(lp_n > lq_n, lp_n, NEG_INF) if residual_without_q else
              vref._residual_logp(lp_n, lq_n))
    return n, vref._gumbel_pick(logr, lp_n, noise[rows, n])
  return rule


chain_broken_bonus_from_residual = _chain_broken(bonus_from_residual=True)
chain_broken_residual_without_q = _chain_broken(residual_without_q=True)


@functools.partial(jax.jit, static_argnames=("greedy", "max_depth"))
def tree_broken_no_renormalise(target_logp, tree_tokens, children, uniforms, noise, *, greedy,
                               max_depth):
  """BROKEN: accept a child with prob p(tok) instead of r(tok) / sum(r) (no renormalisation
  after rejected siblings); otherwise the reference rule."""
  del greedy
  B, T, V = target_logp.shape
  C = children.shape[2]
  rows = jnp.arange(B)
  node = jnp.zeros((B,), jnp.int32)
  done = jnp.zeros((B,), bool)
  depth = jnp.zeros((B,), jnp.int32)
  path = [node]
  for _ in range(max_depth):
    ch = children[rows, node]
    valid, chc = ch >= 0, jnp.maximum(ch, 0)
    tok = jnp.take_along_axis(tree_tokens, chc, 1)
    p_tok = jnp.exp(jnp.take_along_axis(target_logp[rows, node], tok, 1))
    u = jnp.take_along_axis(uniforms, chc, 1)
    found, target = jnp.zeros((B,), bool), node
    for k in range(C):
      acc = valid[:, k] & ~found & (u[:, k] < p_tok[:, k])
      target = jnp.where(acc, chc[:, k], target)
      found = found | acc
    move = ~done & found
    node, depth = jnp.where(move, target, node), depth + move
    path.append(jnp.where(move, target, -1))
    done = done | ~found
  ch = children[rows, node]
  tok = jnp.take_along_axis(tree_tokens, jnp.maximum(ch, 0), 1)
  hit = jnp.any((ch >= 0)[:, :, None] & (tok[:, :, None] == jnp.arange(V)), 1)
  hit = hit & (depth < max_depth)[:, None]
  lp_c = target_logp[rows, node]
  nxt = vref._gumbel_pick(jnp.where(hit, -jnp.inf, lp_c), lp_c, noise[rows, node])
  return jnp.stack(path, 1), depth, nxt


# --- the tests ----------------------------------------------------------------------------------

STAT_SEEDS = {"q": 11, "onehot": 12}


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("top_k", [False, True])
@pytest.mark.parametrize("mode", ["q", "onehot"])
def test_chain_lossless(mode, top_k, K):
  """The joint of the first K + 1 tokens: every draft position and the bonus token after a
  fully accepted chain (K = 1: about half the rows take it)."""
  model = markov_model(3 + top_k, top_k=top_k)
  seqs = chain_first(STAT_SEEDS[mode] + top_k + 10 * K, model, K, mode, verify_chain_reference)
  ps = _joint_pvalues(seqs, model[0], model[1])
  assert min(ps) > 1e-3, ps


@pytest.mark.parametrize("widths,dup,top_k", [((3, 2, 1), False, False),
                                             ((3, 2, 1), True, True),
                                             ((4, 1), False, True)])
def test_tree_lossless(widths, dup, top_k):
  model = markov_model(5 + top_k, top_k=top_k)
  seqs = tree_first(21 + len(widths), model, widths, dup, verify_tree_reference)
  ps = _joint_pvalues(seqs, model[0], model[1])
  assert min(ps) > 1e-3, ps


@pytest.mark.parametrize("rule,mode,K", [(chain_broken_resample_from_p, "q", 3),
                                         (chain_broken_resample_from_p, "onehot", 3),
                                         (chain_broken_always_accept, "q", 3),
                                         (chain_broken_bonus_from_residual, "q", 1),
                                         (chain_broken_bonus_from_residual, "onehot", 1),
                                         (chain_broken_residual_without_q, "q", 3)],
                         ids=["resample_from_p-q", "resample_from_p-onehot", "always_accept",
                              "bonus_from_residual-q", "bonus_from_residual-onehot",
                              "residual_without_q"])
def test_chain_broken_rules_are_rejected(rule, mode, K):
  """The same statistic has power: a broken rule fails it decisively. (4: a one-hot draft's
  bonus drawn without the draft removes only the draft repeated, so the target repeats often
  here.)"""
  model = markov_model(3, repeat=4.0 if rule is chain_broken_bonus_from_residual else 0.0)
  ps = _joint_pvalues(chain_first(STAT_SEEDS[mode], model, K, mode, rule), model[0], model[1])
  assert min(ps) < 1e-6, ps


def test_tree_broken_rule_is_rejected():
  model = markov_model(5)
  ps = _joint_pvalues(tree_first(24, model, (3, 2, 1), False, tree_broken_no_renormalise),
                      model[0], model[1])
  assert min(ps) < 1e-6, ps
