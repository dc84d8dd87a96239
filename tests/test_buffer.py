"""tlt_jax.drafter.buffer: `align`, `tiles`, BufferConfig and the DrafterBuffer.

`align` is checked against a brute-force per-position definition of the drafter's pair
convention written here (hidden row t is the prompt's hidden state for t < P-1, the response
hidden state h[t-P+1] for P-1 <= t <= T-2, 0 at T-1; loss_mask 1 on [P-1, T-2]); `tiles`
against the covering properties it promises. The buffer is checked against brute-force
bookkeeping in the test (expected windows and weights recomputed from positions, the token
budget and the (step, key) eviction order replayed by hand), sampling frequencies against
the weights with a chi-square test, the kept-window choice against weighted draws without
replacement (inclusion probabilities computed exactly here) and against an unbiased control
buffer. Windows are identified through the public `sample` by their token ids, which encode
(response, position).
"""

import threading

import numpy as np
import pytest
from scipy import stats

from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer, align, tiles

D = 3


def brute_align(p, y, h, ph=None):
  """The pair convention, one position at a time."""
  P, R = len(p), len(y)
  T = P + R
  tokens = list(p) + list(y)
  hidden = np.zeros((T, h.shape[1]))
  mask = np.zeros(T)
  for t in range(T):
    if t < P - 1:
      hidden[t] = ph[t] if ph is not None else 0.0
    elif t <= T - 2:
      hidden[t] = h[t - P + 1]  # P-1 <= t: h[t-P+1] produced token t+1 (P = 0: h[t+1])
      mask[t] = 1.0
    else:
      hidden[t] = 0.0
  return np.asarray(tokens), hidden, mask


def response(rng, r, base=0, d=D):
  """Distinct token ids (base + position) so a window's first token names its position."""
  ids = (base + np.arange(r)).astype(np.int32)
  return ids, rng.normal(size=(r, d)).astype(np.float32)


def expected_weight(s, e, r, spec_start, tail, prompt=0):
  """A window's weight: over its pair positions with a loss, `tail` where the pair's target
  (the next token: response token pos + 1 - prompt) was decoded at or after spec_start (a
  response position), else 1."""
  total = 0.0
  for pos in range(s, e):
    if prompt - 1 <= pos <= prompt + r - 2:  # the pairs whose target is a response token
      target = pos + 1 - prompt
      total += tail if (spec_start is not None and target >= spec_start) else 1.0
  return total


def all_windows(buf, rng_seed=0, n=4000):
  """The buffer's windows, enumerated through the public `sample` (many draws)."""
  got = buf.sample(n, rng=np.random.default_rng(rng_seed))
  uniq = {}
  for w in got:
    uniq[id(w)] = w
  return list(uniq.values())


# ----------------------------------------------------------------------------------- align
@pytest.mark.parametrize("seed", range(10))
def test_align_matches_brute_force_pair_convention(seed):
  rng = np.random.default_rng(seed)
  for P in [0, 1, 2, int(rng.integers(3, 9))]:
    for R in [0, 1, 2, int(rng.integers(3, 12))]:
      p = rng.integers(0, 50, P).astype(np.int32)
      y = rng.integers(0, 50, R).astype(np.int32)
      h = rng.normal(size=(R, D)).astype(np.float32)
      ph = rng.normal(size=(P, D)).astype(np.float32)
      for with_ph in (True, False):
        tok, hid, mask = align(y, h, p, ph if with_ph else None)
        rt, rh, rm = brute_align(p, y, h, ph if with_ph else None)
        np.testing.assert_array_equal(tok, rt)
        np.testing.assert_array_equal(hid, rh)
        np.testing.assert_array_equal(mask, rm)
        assert tok.dtype == np.int32 and mask.dtype == np.float32


def test_align_response_alone_by_hand():
  y = np.array([7, 8, 9, 10], np.int32)
  h = np.arange(8, dtype=np.float32).reshape(4, 2)  # h[j] produced y[j]
  tok, hid, mask = align(y, h)
  np.testing.assert_array_equal(tok, y)
  np.testing.assert_array_equal(hid, [[2, 3], [4, 5], [6, 7], [0, 0]])  # h[1], h[2], h[3], 0
  np.testing.assert_array_equal(mask, [1, 1, 1, 0])


def test_align_rejects_mismatched_hidden():
  with pytest.raises(ValueError):
    align(np.arange(4), np.zeros((3, D)))
  with pytest.raises(ValueError):
    align(np.arange(4), np.zeros((4,)))


@pytest.mark.parametrize("seed", range(20))
def test_response_window_equals_slice_of_full_prompt_response_alignment(seed):
  """What the spot trainer's windows see is what the offline trainer's full sequences see."""
  rng = np.random.default_rng(100 + seed)
  P, R = int(rng.integers(1, 10)), int(rng.integers(2, 30))
  s = int(rng.integers(0, R))
  e = int(rng.integers(s + 1, R + 1))
  p = rng.integers(0, 50, P).astype(np.int32)
  y = rng.integers(0, 50, R).astype(np.int32)
  h = rng.normal(size=(R, D)).astype(np.float32)
  ph = rng.normal(size=(P, D)).astype(np.float32)
  wt, wh, wm = (a[s:e] for a in align(y, h))
  ft, fh, fm = (a[P + s:P + e] for a in align(y, h, p, ph))
  np.testing.assert_array_equal(wt, ft)
  np.testing.assert_array_equal(wh, fh)
  np.testing.assert_array_equal(wm, fm)


# ----------------------------------------------------------------------------------- tiles
@pytest.mark.parametrize("length,window", [(1, 1), (1, 4), (4, 4), (5, 4), (8, 4), (9, 4),
                                           (37, 5), (100, 7), (3, 10), (0, 3)])
def test_tiles_cover_exactly_disjoint_end_aligned(length, window):
  ts = tiles(length, window)
  covered = [i for s, e in ts for i in range(s, e)]
  assert sorted(covered) == list(range(length))  # exact, disjoint cover
  assert len(covered) == len(set(covered))
  if length:
    assert max(e for _, e in ts) == length
    first = min(ts)
    for s, e in ts:
      assert 0 < e - s <= window
      if (s, e) != first:
        assert e - s == window  # all full except possibly the first
    assert len(ts) == -(-length // window)
  else:
    assert ts == []


def test_tiles_by_hand():
  assert sorted(tiles(10, 4)) == [(0, 2), (2, 6), (6, 10)]


# ------------------------------------------------------------------------------ BufferConfig
@pytest.mark.parametrize("kw", [dict(window=0), dict(tail_weight=0.5), dict(tail_weight=-1.0),
                                dict(tail_weight=float("nan")), dict(buffer_tokens=10, window=11),
                                dict(buffer_tokens=0), dict(keep_steps=0),
                                dict(windows_per_response=0)])
def test_buffer_config_rejects_bad_values(kw):
  with pytest.raises(ValueError):
    BufferConfig(**kw)


def test_buffer_config_accepts_boundary_values():
  BufferConfig(buffer_tokens=8, window=8, tail_weight=1.0, keep_steps=1, windows_per_response=1)


# ------------------------------------------------------------------------------------ add
def test_windows_equal_align_slices_with_weights_from_positions():
  rng = np.random.default_rng(0)
  cfg = BufferConfig(buffer_tokens=10_000, window=4, windows_per_response=100, tail_weight=3.0)
  buf = DrafterBuffer(cfg)
  cases = [(11, None), (8, 5), (9, 0), (2, None), (6, 100), (13, -2)]
  refs = {}
  for k, (r, spec) in enumerate(cases):
    ids, h = response(rng, r, base=1000 * k)
    kept = buf.add(7, ids, h, spec_start=spec, key=(k,))
    assert kept == r  # all tiles kept: each has a target position
    refs[k] = (r, spec, brute_align([], ids, h))
  assert buf.tokens == sum(r for r, _ in cases)
  got = all_windows(buf)
  n_tiles = sum(-(-r // 4) for r, _ in cases)
  assert len(buf) == n_tiles == len(got)
  seen = set()
  for w in got:
    k, s = divmod(int(w.tokens[0]), 1000)
    r, spec, (rt, rh, rm) = refs[k]
    e = s + w.length
    assert (s, e) in tiles(r, 4)
    seen.add((k, s))
    assert w.step == 7
    np.testing.assert_array_equal(w.tokens, rt[s:e])
    np.testing.assert_array_equal(w.hidden, rh[s:e])
    np.testing.assert_array_equal(w.loss_mask, rm[s:e])
    assert w.weight == pytest.approx(expected_weight(s, e, r, spec, 3.0))
  assert len(seen) == n_tiles


def test_tail_weight_counts_response_positions_after_a_prompt():
  """spec_start is a response position whether or not the prompt comes with the response
  (the context windows' case): the windows' weights follow the tokens decoded with
  speculation, not the positions in the prompt + response sequence."""
  rng = np.random.default_rng(1)
  ids, h = response(rng, 20, base=1000)
  prompt = np.arange(500, 506, dtype=np.int32)
  ph = rng.standard_normal((6, D)).astype(np.float32)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=1000, window=4, windows_per_response=100,
                                   tail_weight=3.0))
  buf.add(0, ids, h, spec_start=7, prompt_ids=prompt, prompt_hidden=ph)
  tokens = np.concatenate([prompt, ids])
  wins = all_windows(buf)
  assert sum(w.length for w in wins) == 21  # pairs 5..25 (the last prompt token's on)
  for w in wins:
    s = int(np.flatnonzero(tokens == w.tokens[0])[0])
    assert w.weight == pytest.approx(expected_weight(s, s + w.length, 20, 7, 3.0, prompt=6))


def test_responses_shorter_than_two_tokens_add_nothing():
  rng = np.random.default_rng(0)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=100, window=4, keep_steps=1))
  assert buf.add(5, np.zeros((0,), np.int32), np.zeros((0, D), np.float32)) == 0
  assert buf.add(5, *response(rng, 1)) == 0
  assert buf.tokens == 0 and len(buf) == 0 and buf.sample(3, np.random.default_rng(0)) == []
  # and they did not advance the step: a step-0 response is still kept with keep_steps=1
  assert buf.add(0, *response(rng, 5)) == 5
  assert buf.tokens == 5


def test_window_of_one_drops_the_targetless_last_tile():
  rng = np.random.default_rng(0)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=100, window=1, windows_per_response=100))
  assert buf.add(0, *response(rng, 5)) == 4  # position 4 has mask 0: zero weight
  assert buf.tokens == 4 and len(buf) == 4


def test_at_most_windows_per_response_are_kept():
  rng = np.random.default_rng(0)
  cfg = BufferConfig(buffer_tokens=10_000, window=4, windows_per_response=3)
  buf = DrafterBuffer(cfg, seed=3)
  total = 0
  for k in range(20):
    r = 16 if k < 3 else int(rng.integers(2, 40))  # 16: one tile more than the limit
    kept = buf.add(0, *response(rng, r, base=1000 * k), key=(k,))
    per = sorted(e - s for s, e in tiles(r, 4))
    # at most 3 tiles; the kept token count is a sum of some <= 3 distinct tiles' lengths
    assert kept <= sum(per[-3:])
    if r == 16:
      assert kept == 12  # 3 of 4 full tiles
    total += kept
  counts = {}
  for w in all_windows(buf, n=20000):
    counts[int(w.tokens[0]) // 1000] = counts.get(int(w.tokens[0]) // 1000, 0) + 1
  assert max(counts.values()) <= 3
  firsts = [int(w.tokens[0]) for w in all_windows(buf, n=20000)]
  assert len(firsts) == len(set(firsts))  # distinct tiles: none is kept twice
  assert buf.tokens == total
  assert len(buf) == sum(counts.values())


def test_buffer_tokens_evicts_oldest_first():
  rng = np.random.default_rng(0)
  cfg = BufferConfig(buffer_tokens=50, window=10, windows_per_response=4)
  buf = DrafterBuffer(cfg)
  for k in range(3):  # 3 responses x 2 full windows of 10 tokens
    assert buf.add(0, *response(rng, 20, base=1000 * k), key=(k,)) == 20
    assert buf.tokens <= 50
  # 60 tokens > 50: exactly one window (of the oldest response) went
  assert buf.tokens == 50 and len(buf) == 5 and buf.evicted_tokens == 10
  resp = sorted(int(w.tokens[0]) // 1000 for w in all_windows(buf))
  assert resp == [0, 1, 1, 2, 2]
  # a 40-token response pushes out everything older than it would need
  assert buf.add(0, *response(rng, 40, base=5000), key=(5,)) == 40
  assert buf.tokens == 50
  resp = sorted(int(w.tokens[0]) // 1000 for w in all_windows(buf))
  assert resp == [2, 5, 5, 5, 5]
  assert buf.evicted_tokens == 60 + 40 - 50


def test_budget_evicts_lowest_step_then_key_not_arrival_order():
  """The docstring's order is (step, key): a late-arriving response with a low key of the
  newest step goes before higher keys, and any older step goes before the newest."""
  rng = np.random.default_rng(0)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=40, window=10, keep_steps=5))
  for step, key in [(1, (3,)), (1, (1,)), (0, (9,)), (1, (2,))]:
    buf.add(step, *response(rng, 10, base=1000 * (10 * step + key[0])), key=key)
  assert buf.tokens == 40
  buf.add(1, *response(rng, 10, base=1000 * 14), key=(4,))  # 50 > 40: one must go
  held = sorted(int(w.tokens[0]) // 1000 for w in all_windows(buf))
  assert held == [11, 12, 13, 14]  # step 0's window went, though it arrived third
  buf.add(1, *response(rng, 10, base=1000 * 15), key=(0,))  # lowest key: evicted at once
  held = sorted(int(w.tokens[0]) // 1000 for w in all_windows(buf))
  assert held == [11, 12, 13, 14] and buf.tokens == 40


def test_contents_and_draws_do_not_depend_on_add_order():
  """Kept windows are a function of (seed, step, key); order is (step, key, position)."""
  rng = np.random.default_rng(3)
  cfg = BufferConfig(buffer_tokens=10_000, window=4, windows_per_response=2, tail_weight=3.0)
  data = [(int(rng.integers(0, 2)), (k, int(rng.integers(0, 3))),
           response(rng, int(rng.integers(2, 40)), base=1000 * k), int(rng.integers(0, 40)))
          for k in range(30)]
  a, b = DrafterBuffer(cfg, seed=4), DrafterBuffer(cfg, seed=4)
  for step, key, (ids, h), spec in data:
    a.add(step, ids, h, spec_start=spec, key=key)
  for i in np.random.default_rng(5).permutation(len(data)):
    step, key, (ids, h), spec = data[i]
    b.add(step, ids, h, spec_start=spec, key=key)
  assert a.tokens == b.tokens and len(a) == len(b)
  da = [int(w.tokens[0]) for w in a.sample(200, rng=np.random.default_rng(8))]
  db = [int(w.tokens[0]) for w in b.sample(200, rng=np.random.default_rng(8))]
  assert da == db
  # and the picks do depend on the key (a different key set keeps different tiles)
  c = DrafterBuffer(cfg, seed=4)
  for step, key, (ids, h), spec in data:
    c.add(step, ids, h, spec_start=spec, key=(key[0] + 100,))
  assert sorted({int(w.tokens[0]) for w in all_windows(a)}) != sorted(
      {int(w.tokens[0]) for w in all_windows(c)})


def test_old_steps_are_dropped_after_keep_steps():
  rng = np.random.default_rng(0)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=10_000, window=8, keep_steps=2))
  lengths = {0: [10, 7], 1: [12], 2: [5, 9], 3: [3]}
  for step in range(4):
    for r in lengths[step]:
      buf.add(step, *response(rng, r))
    kept_steps = [s for s in range(step + 1) if s >= step - 2 + 1]
    assert buf.tokens == sum(sum(lengths[s]) for s in kept_steps)
    assert {w.step for w in all_windows(buf)} == set(kept_steps)
  # an add of an already-too-old step keeps nothing of it
  buf.add(0, *response(rng, 10))
  assert buf.tokens == sum(lengths[2]) + sum(lengths[3])
  assert {w.step for w in all_windows(buf)} == {2, 3}


# --------------------------------------------------------------------------------- sample
def test_sampling_frequencies_are_proportional_to_weights():
  rng = np.random.default_rng(1)
  cfg = BufferConfig(buffer_tokens=10_000, window=6, windows_per_response=100, tail_weight=5.0)
  buf = DrafterBuffer(cfg)
  spec = {0: 9, 1: None, 2: 0, 3: 14}
  lens = {0: 17, 1: 13, 2: 7, 3: 20}
  for k in spec:
    buf.add(0, *response(rng, lens[k], base=1000 * k), spec_start=spec[k], key=(k,))
  keys, weights = [], []
  for k in spec:
    for s, e in tiles(lens[k], 6):
      wgt = expected_weight(s, e, lens[k], spec[k], 5.0)
      if wgt > 0:
        keys.append(1000 * k + s)
        weights.append(wgt)
  n = 20000
  draws = buf.sample(n, rng=np.random.default_rng(7))
  assert len(draws) == n
  count = {key: 0 for key in keys}
  for w in draws:
    count[int(w.tokens[0])] += 1  # KeyError: a window that should not exist
  obs = np.array([count[k] for k in keys], np.float64)
  exp = n * np.array(weights) / np.sum(weights)
  chi2 = ((obs - exp) ** 2 / exp).sum()
  p = stats.chi2.sf(chi2, len(keys) - 1)
  assert p > 1e-3, (chi2, p, obs, exp)
  # sanity of the test's power: uniform frequencies would be rejected
  uni = np.full(len(keys), n / len(keys))
  assert stats.chi2.sf(((obs - uni) ** 2 / uni).sum(), len(keys) - 1) < 1e-6


def successive_inclusion(weights):
  """P(tile i among 2 drawn one by one without replacement, each in proportion to weight)."""
  p = np.asarray(weights, np.float64) / np.sum(weights)
  return np.array([p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(len(p)) if j != i)
                   for i in range(len(p))])


def test_tail_weighting_keeps_windows_after_spec_start_more_often():
  """Responses of 10 tiles, 2 kept each, speculation on from position 30 (tiles [28, 32),
  [32, 36), [36, 40)): inclusion rates match weighted draws without replacement (weights
  recomputed here from positions), and the tail tiles are kept far more often than with
  tail_weight 1."""
  window, r, spec, n = 4, 40, 30, 400

  def inclusion(tail_weight, seed):
    rng = np.random.default_rng(seed)
    buf = DrafterBuffer(BufferConfig(buffer_tokens=1 << 20, window=window, keep_steps=1,
                                     windows_per_response=2, tail_weight=tail_weight),
                        seed=seed)
    per_start = np.zeros(r // window)
    for k in range(n):
      buf.add(0, *response(rng, r, base=1000 * k), spec_start=spec, key=(k,))
    for w in all_windows(buf, n=60000):
      per_start[(int(w.tokens[0]) % 1000) // window] += 1
    assert per_start.sum() == 2 * n  # 2 per response
    rate = per_start / n
    ref = successive_inclusion([expected_weight(i * window, (i + 1) * window, r, spec,
                                                tail_weight) for i in range(r // window)])
    z = np.abs(rate - ref) / np.sqrt(ref * (1 - ref) / n)
    assert np.all(z < 4.5), (rate, ref)
    return rate

  biased, control = inclusion(8.0, 0), inclusion(1.0, 1)
  tail = slice(7, 10)  # tiles starting at 28, 32, 36
  assert biased[tail].sum() > control[tail].sum() + 0.6, (biased, control)
  assert biased[tail].min() > biased[:7].max()


def test_sample_with_caller_rng_is_reproducible():
  rng = np.random.default_rng(0)
  data = [response(rng, int(rng.integers(2, 30)), base=1000 * k) for k in range(10)]
  cfg = BufferConfig(buffer_tokens=10_000, window=4, windows_per_response=100)
  a, b = DrafterBuffer(cfg, seed=5), DrafterBuffer(cfg, seed=5)
  for ids, h in data:
    a.add(0, ids, h)
    b.add(0, ids, h)
  s1 = [int(w.tokens[0]) for w in a.sample(50, rng=np.random.default_rng(42))]
  s2 = [int(w.tokens[0]) for w in a.sample(50, rng=np.random.default_rng(42))]
  assert s1 == s2
  assert len(set(s1)) > 5
  assert s1 == [int(w.tokens[0]) for w in b.sample(50, rng=np.random.default_rng(42))]


def test_clear_empties_the_buffer():
  rng = np.random.default_rng(0)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=100, window=4))
  buf.add(0, *response(rng, 9))
  buf.clear()
  assert buf.tokens == 0 and len(buf) == 0 and buf.sample(4, np.random.default_rng(0)) == []


# ---------------------------------------------------------------------------- concurrency
def test_concurrent_add_and_sample_keep_the_token_count_consistent():
  cfg = BufferConfig(buffer_tokens=3000, window=16, windows_per_response=3, keep_steps=3)
  buf = DrafterBuffer(cfg, seed=0)
  kept_total, added = [0] * 4, [0] * 4
  errors = []
  stop = threading.Event()

  def writer(i):
    rng = np.random.default_rng(i)
    try:
      for k in range(150):
        ids, h = response(rng, int(rng.integers(0, 120)))
        added[i] += len(ids) >= 2
        kept_total[i] += buf.add(k // 50, ids, h, spec_start=int(rng.integers(0, 120)),
                                 key=(i, k))
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  def reader(i):
    rng = np.random.default_rng(100 + i)
    try:
      while not stop.is_set():
        for w in buf.sample(8, rng=rng):
          assert w.length == w.tokens.shape[0] == w.hidden.shape[0] == w.loss_mask.shape[0]
          assert 0 < w.length <= cfg.window
        assert 0 <= buf.tokens <= cfg.buffer_tokens
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
  readers = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
  for t in readers + writers:
    t.start()
  for t in writers:
    t.join()
  stop.set()
  for t in readers:
    t.join()
  assert not errors, errors
  # Public-API bookkeeping: every kept token is either still held or was evicted.
  assert sum(kept_total) == buf.tokens + buf.evicted_tokens
  assert buf.tokens <= cfg.buffer_tokens
  # And the count is the sum of the held windows' lengths.
  assert buf.tokens == sum(w.length for w in buf._windows)  # white-box: no public listing
  assert buf.added_responses == sum(added)


def test_windows_carry_their_context_without_a_loss_on_it():
  """With a prompt and its hidden states, the first window attends to the prompt (the
  drafter drafts with it); every window carries up to `context` tokens before it, masked."""
  rng = np.random.default_rng(0)
  ids, h = response(rng, 10)
  prompt = np.arange(100, 106, dtype=np.int32)
  ph = rng.standard_normal((6, D)).astype(np.float32)
  buf = DrafterBuffer(BufferConfig(buffer_tokens=1000, window=4, context=3,
                                   windows_per_response=100))
  kept = buf.add(0, ids, h, prompt_ids=prompt, prompt_hidden=ph)
  tokens, hidden, mask = align(ids, h, prompt, ph)  # the whole sequence, 16 tokens
  wins = all_windows(buf)
  # the budget counts what the windows hold, their context included
  assert kept == buf.tokens == sum(w.length for w in wins) > 10
  trained = []  # global pair indices each window trains on
  for w in wins:
    first = int(np.flatnonzero(w.loss_mask)[0])
    assert first <= 3 and not w.loss_mask[:first].any()  # <= 3 context tokens, no loss
    # the window is a slice of the aligned sequence: find it and check every field
    at = [s for s in range(len(tokens) - w.length + 1)
          if np.array_equal(tokens[s:s + w.length], w.tokens)]
    assert len(at) == 1
    s = at[0]
    np.testing.assert_array_equal(w.hidden, hidden[s:s + w.length])
    np.testing.assert_array_equal(w.loss_mask[first:], mask[s + first:s + w.length])
    trained += [s + j for j in np.flatnonzero(w.loss_mask)]
  # every pair that produced a response token (5..14: f_5 produced the first), once each
  assert sorted(trained) == list(np.flatnonzero(mask)) == list(range(5, 15))
  assert any(w.tokens[0] >= 100 for w in wins)  # the first window's context is the prompt
