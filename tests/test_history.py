"""The history index (tlt_jax/rollout/sources/suffix_index.py, and HistoryIndex around it:
history.py) against a brute-force reference.

The reference scans every sequence of the prompt for every occurrence of the context (a
position with a next token) and counts next tokens; it expands the same best-first rule.
"""

import heapq
import math

import numpy as np
import pytest

from tlt_jax.rollout.sources import suffix_index
from tlt_jax.rollout.sources.history import HistoryIndex


class RefIndex:
  """Lists of lists; eviction by the same rules; drafts by scanning everything."""

  def __init__(self, max_tokens_per_prompt, max_prompts, min_match, max_match, long_match):
    self.budget, self.max_prompts = max_tokens_per_prompt, max_prompts
    self.min_match, self.max_match, self.long_match = min_match, max_match, long_match
    self.prompts = {}  # key -> {"live": {seq: list}, "done": [list]}; dict order = LRU order
    self.where = {}

  def _touch(self, pk):
    self.prompts[pk] = self.prompts.pop(pk)

  def begin(self, pk, sk, ids):
    self.prompts.setdefault(pk, {"live": {}, "done": []})
    self._touch(pk)
    self.prompts[pk]["live"][sk] = list(ids)
    self.where[sk] = pk
    while len(self.prompts) > self.max_prompts:
      victim = next((k for k, p in self.prompts.items() if not p["live"]), None)
      if victim is None:
        break
      del self.prompts[victim]

  def extend(self, sk, toks):
    self.prompts[self.where[sk]]["live"][sk] += list(toks)

  def end(self, sk, keep=True):
    p = self.prompts[self.where.pop(sk)]
    s = p["live"].pop(sk)
    if keep:
      p["done"].append(s)
      while sum(map(len, p["done"])) > self.budget:
        p["done"].pop(0)

  def _occ(self, seqs, ctx):
    """[(seq index, position of the context's last token)] with a next token."""
    n = len(ctx)
    return [(i, e) for i, s in enumerate(seqs) for e in range(n - 1, len(s) - 1)
            if s[e - n + 1:e + 1] == ctx]

  def match(self, sk):
    pk = self.where[sk]
    p = self.prompts[pk]
    seqs = p["done"] + list(p["live"].values())
    own = p["live"][sk]
    for n in range(min(self.max_match, len(own)), self.min_match - 1, -1):
      if self._occ(seqs, own[len(own) - n:]):
        return n, seqs, own[len(own) - n:]
    return 0, seqs, None

  def draft(self, sk, max_tokens, topk=1, max_nodes=None):
    self._touch(self.where[sk])
    max_nodes = max_tokens if max_nodes is None else max_nodes
    n, seqs, ctx = self.match(sk)
    if not n:
      return [], [], []
    out_t, out_p, out_s, heap, tie = [], [], [], [], 0

    def push(parent, path, score):
      nonlocal tie
      if len(path) >= max_tokens:
        return
      nxt = [seqs[i][e + 1] for i, e in self._occ(seqs, ctx + path)]
      if not nxt:
        return
      vals, counts = np.unique(nxt, return_counts=True)
      kids = sorted(zip(-counts, vals))[:topk]
      for negc, x in kids:
        c = -negc
        if c < (1 if n + len(path) >= self.long_match else 2):
          continue
        heapq.heappush(heap, (-(score + math.log(c / len(nxt))), tie, int(x), parent,
                              path + [int(x)]))
        tie += 1

    push(-1, [], 0.0)
    while heap and len(out_t) < max_nodes:
      negs, _, x, parent, path = heapq.heappop(heap)
      out_t.append(x)
      out_p.append(parent)
      out_s.append(-negs)
      push(len(out_t) - 1, path, -negs)
    return out_t, out_p, out_s


def _both(background=None, **kw):
  ref = RefIndex(kw.get("max_tokens_per_prompt", 1 << 20), kw.get("max_prompts", 4096),
                 kw.get("min_match", 2), kw.get("max_match", 32), kw.get("long_match", 8))
  return HistoryIndex(background=background, **kw), ref


def _check(idx, ref, sk, max_tokens, topk=1, max_nodes=None):
  d = idx.draft(sk, max_tokens, topk=topk, max_nodes=max_nodes)
  t, p, s = ref.draft(sk, max_tokens, topk=topk, max_nodes=max_nodes)
  assert d.tokens.tolist() == t
  assert d.parents.tolist() == p
  np.testing.assert_allclose(d.scores, s, rtol=1e-6, atol=1e-6)
  if t:  # a draft came from a match, and the index counted one
    assert idx.stats()["mean_match_len"] > 0
  return d


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("small", [0, 4, 1 << 30])  # occurrences as arrays / lists / both
def test_random_against_reference(seed, small, monkeypatch):
  """Interleaved begin/extend/end/draft on a 4-token vocabulary (many repeats, many ties),
  eviction on, frequent re-sorts: every chain and tree equals the reference's."""
  monkeypatch.setattr(suffix_index, "_SMALL", small)
  rng = np.random.default_rng(seed)
  kw = dict(max_tokens_per_prompt=300, max_prompts=3, min_match=2, max_match=6, long_match=4,
            pending_min=8, pending_frac=0.3)
  idx, ref = _both(**kw)
  live, next_key, n_checked = [], 0, 0
  for step in range(400):
    op = rng.random()
    if op < 0.08 or not live:
      pk = int(rng.integers(5))
      prompt = [pk % 4, (pk + 1) % 4] + rng.integers(0, 4, int(rng.integers(0, 4))).tolist()
      for x in (idx, ref):
        x.begin(pk, next_key, prompt)
      live.append(next_key)
      next_key += 1
    elif op < 0.13:
      sk = live.pop(int(rng.integers(len(live))))
      keep = bool(rng.random() < 0.8)
      for x in (idx, ref):
        x.end(sk, keep=keep)
    elif op < 0.6:
      sk = live[int(rng.integers(len(live)))]
      toks = rng.integers(0, 4, int(rng.integers(1, 6))).tolist()
      for x in (idx, ref):
        x.extend(sk, toks)
    else:
      sk = live[int(rng.integers(len(live)))]
      _check(idx, ref, sk, int(rng.integers(1, 7)))
      _check(idx, ref, sk, int(rng.integers(1, 5)), topk=int(rng.integers(2, 4)),
             max_nodes=int(rng.integers(1, 12)))
      n_checked += 1
  assert n_checked > 50


def test_match_length_and_chain_counts():
  """A hand-made history: the longest suffix wins over a more frequent shorter one, and the
  chain follows the majority continuation with log-frequency scores."""
  idx, ref = _both(min_match=2, max_match=8, long_match=3)
  for i, s in enumerate([[9, 1, 2, 3, 4, 5], [7, 1, 2, 3, 4, 5], [8, 2, 3, 6, 6],
                         [8, 2, 3, 6, 6], [8, 2, 3, 6, 6]]):
    idx.begin("p", i, s)
    ref.begin("p", i, s)
    idx.end(i)
    ref.end(i)
  for x in (idx, ref):
    x.begin("p", "row", [0, 1, 2, 3])
  d = _check(idx, ref, "row", 4)
  assert d.tokens.tolist() == [4, 5]  # "1 2 3" (twice) beats "2 3" (5 times, mostly -> 6)
  np.testing.assert_allclose(d.scores, [0.0, 0.0])
  assert idx.stats()["mean_match_len"] == 3


def test_support_rule():
  """A single occurrence after a short match is not drafted; after a long one it is."""
  idx = HistoryIndex(min_match=2, max_match=16, long_match=5)
  idx.begin("p", 0, [1, 2, 3, 4, 5, 6, 7, 8])
  idx.end(0)
  idx.begin("p", 1, [9, 9, 2, 3])
  assert len(idx.draft(1, 4).tokens) == 0  # "2 3" once: coincidence
  idx.extend(1, [4, 5])
  # "2 3 4 5" (4 tokens) -> 6 needs context 4 < 5: count 1 is not enough
  assert len(idx.draft(1, 4).tokens) == 0
  idx.end(1)
  idx.begin("p", 2, [1, 2, 3, 4, 5])
  assert idx.draft(2, 3).tokens.tolist() == [6, 7, 8]


def test_no_trivial_self_match_and_min_match():
  idx = HistoryIndex(min_match=2, long_match=0)
  idx.begin("p", 0, [1, 2, 3])
  assert len(idx.draft(0, 4).tokens) == 0  # "2 3" occurs only at the row's own end
  idx.extend(0, [1, 2])
  assert idx.draft(0, 4).tokens.tolist() == [3, 1, 2]  # its own earlier "1 2" -> 3 1 2 (end)
  idx.begin("p", 1, [5, 6])
  assert len(idx.draft(1, 4).tokens) == 0  # no match at all
  idx.extend(1, [1])  # "6 1": 1 token matches ("1"), below min_match
  assert len(idx.draft(1, 4).tokens) == 0


def test_drop_leaves_no_trace():
  """end(keep=False) after sorting and while pending: drafts equal an index that never saw it."""
  rng = np.random.default_rng(3)
  base = rng.integers(0, 5, 200).tolist()
  a = HistoryIndex(pending_min=4, pending_frac=0.1, long_match=0)
  b = HistoryIndex(pending_min=4, pending_frac=0.1, long_match=0)
  for x in (a, b):
    x.begin("p", "keep", base[:50])
    x.end("keep")
    x.begin("p", "row", base[:3])
  a.begin("p", "junk", rng.integers(0, 5, 120).tolist())
  a.draft("row", 4)  # sorts with junk inside
  a.extend("junk", rng.integers(0, 5, 30).tolist())  # and some pending
  a.end("junk", keep=False)
  for t in base[3:40]:
    for x in (a, b):
      x.extend("row", [t])
    da, db = a.draft("row", 6, topk=3, max_nodes=8), b.draft("row", 6, topk=3, max_nodes=8)
    assert da.tokens.tolist() == db.tokens.tolist()
    assert da.parents.tolist() == db.parents.tolist()


def test_backward_sort_orders_positions_by_their_backward_windows():
  """backward_sorted against sorting the windows arena[p], arena[p-1], ..., arena[p-w+1]
  directly (positions before the arena read its front pad), for windows of 1-9 tokens over
  a 3-token vocabulary (long runs of ties that only the window's last tokens break)."""
  from tlt_jax.rollout.sources.suffix_arena import SENTINEL, backward_sorted
  rng = np.random.default_rng(0)
  for w in range(1, 10):
    for _ in range(4):
      arena = np.concatenate([np.full(w, SENTINEL), rng.integers(0, 3, 60), [SENTINEL],
                              rng.integers(0, 3, 40), [SENTINEL]]).astype(np.uint64)
      body = np.flatnonzero(arena != SENTINEL)
      pos = np.sort(rng.choice(body, size=len(body) * 3 // 4, replace=False))
      out = backward_sorted(arena, pos, w)
      window = lambda p: tuple(int(arena[max(p - i, 0)]) for i in range(w))  # noqa: E731
      assert sorted(out.tolist()) == pos.tolist()
      keys = [window(p) for p in out.tolist()]
      assert keys == sorted(keys), w


def test_in_ranges_is_half_open():
  from tlt_jax.rollout.sources.suffix_arena import in_ranges
  got = in_ranges(np.arange(10), [(6, 7), (2, 4)])
  assert got.tolist() == [x in (2, 3, 6) for x in range(10)]


def test_dropped_rows_do_not_count_toward_the_next_sort():
  """A row dropped before its positions were registered takes them out of the count that
  triggers a re-sort: four 8-token rows begun and dropped leave 1 new position (the next
  row's), under pending_min=10, so the next draft registers it instead of sorting."""
  idx = HistoryIndex(background=False, pending_min=10, pending_frac=0.0)
  for i in range(4):
    idx.begin("p", i, [1, 2, 3, 4, 5, 6, 7, 8])
    idx.end(i, keep=False)
  idx.begin("p", "row", [1, 2])
  idx.draft("row", 2)
  assert idx.stats()["sorts"] == 0


def test_new_positions_are_counted_exactly_toward_the_next_sort():
  """A sort is due once the unsorted positions (those with a next token) exceed
  pending_min: an 8-token prompt has 7, as has an empty prompt extended by 8 tokens; at
  pending_min 7 neither sorts (they are registered as pending)."""
  for prompt, more in (([1, 2, 3, 4, 5, 6, 7, 8], []), ([], [1, 2, 3, 4, 5, 6, 7, 8])):
    idx = HistoryIndex(background=False, pending_min=7, pending_frac=0.0)
    idx.begin("p", "row", prompt)
    if more:
      idx.extend("row", more)
    idx.draft("row", 2)
    assert idx.stats()["sorts"] == 0


def test_a_one_token_match_finds_pending_positions():
  """min_match 1: a context of one token matches wherever that token occurs with a next one,
  whatever precedes it, in the unsorted (pending) positions too."""
  idx, ref = _both(min_match=1, long_match=0)
  for x in (idx, ref):
    x.begin("p", "a", [5, 7])
    x.end("a")
    x.begin("p", "row", [9, 5])
  d = _check(idx, ref, "row", 2)
  assert d.tokens.tolist() == [7] and idx.stats()["sorts"] == 0


def test_eviction_oldest_sequence_and_lru_prompt():
  idx = HistoryIndex(max_tokens_per_prompt=10, max_prompts=2, long_match=0)
  idx.begin("p", 0, [1, 2, 3, 4, 5])
  idx.end(0)
  idx.begin("p", 1, [6, 7, 8, 9, 10])
  idx.end(1)
  idx.begin("p", "row", [1, 2])
  assert idx.draft("row", 2).tokens.tolist() == [3, 4]
  idx.end("row", keep=False)
  idx.begin("p", 2, [11, 12, 13])  # 13 tokens > 10: sequence 0 goes
  idx.end(2)
  idx.begin("p", "row", [1, 2])
  assert len(idx.draft("row", 2).tokens) == 0
  idx.begin("p", "row2", [6, 7])
  assert idx.draft("row2", 2).tokens.tolist() == [8, 9]
  idx.end("row", keep=False)
  idx.end("row2", keep=False)
  idx.begin("q", "r", [1])
  idx.end("r")
  idx.begin("p", "x", [0])  # touches p: q is the least recently used
  idx.end("x", keep=False)
  idx.begin("z", "r", [1])  # third prompt: q goes, p stays
  assert idx.stats()["prompts"] == 2
  idx.begin("p", "row3", [6, 7])
  assert idx.draft("row3", 1).tokens.tolist() == [8]


def test_bad_token_ids():
  idx = HistoryIndex()
  with pytest.raises(ValueError, match="token ids"):
    idx.begin("p", 0, [-1])


def test_finished_tails_after_sort():
  """A row that finishes with unsorted tokens stays searchable whatever ends after it."""
  idx = HistoryIndex(pending_min=4, pending_frac=1.0, long_match=0)
  idx.begin("p", "a", [1, 2])
  idx.begin("p", "b", [3, 4, 3, 4, 3, 4])
  idx.begin("p", "row", [9, 9, 9])
  idx.draft("row", 1)  # sorts a, b, row
  idx.extend("a", [5, 6, 7])  # a's new tail is pending
  idx.end("a")
  idx.end("b")  # b ends after a, with nothing pending
  idx.extend("row", [5, 6])
  assert idx.draft("row", 1).tokens.tolist() == [7]
  assert idx.stats()["sorts"] == 1  # the last draft read a's tail from the pending scan


def test_bench_later_epoch_drafts_more():
  """tlt_jax/bench/history.py at toy scale: with the earlier epoch's responses in the history a
  perfect verifier accepts more per lookup than with siblings alone; the tree (top-4, 32 nodes,
  mostly holding the chain's path) accepts at least 90% of what the chain does."""
  from tlt_jax.bench.history import run_epoch
  rng = np.random.default_rng(0)
  bases = [rng.integers(0, 500, 1024) for _ in range(2)]
  idx = suffix_index.SuffixIndex()  # the bench times the synchronous engine
  acc = []
  for ep in range(2):
    c = run_epoch(idx, rng, bases, ep, samples=4, length=512, prompt_len=16, span=50, mut=0.02,
                  vocab=500, chain=8, topk=4, nodes=32, tree_every=1)
    acc.append(c["accepted"] / c["lookups"])
    assert c["tree_accepted"] >= 0.9 * c["accepted"] * c["trees"] / c["lookups"]
  assert acc[1] > acc[0] + 0.5, acc


@pytest.mark.parametrize("seed", [0, 1])
def test_background_updates_equal_the_reference(seed):
  """HistoryIndex applies begin/extend/end on its worker thread: on a random sequence of calls
  (bursts of updates between drafts, as the engine makes them) every draft equals the
  brute-force reference's and the synchronous index's."""
  rng = np.random.default_rng(10 + seed)
  kw = dict(max_tokens_per_prompt=400, max_prompts=3, min_match=2, max_match=6, long_match=4,
            pending_min=8, pending_frac=0.3)
  idx, ref = _both(background=True, **kw)
  assert idx.background
  sync = suffix_index.SuffixIndex(**kw)
  live, next_key, n_checked = [], 0, 0
  for _ in range(150):
    for _ in range(int(rng.integers(1, 12))):  # a burst of updates, no draft in between
      op = rng.random()
      if op < 0.15 or not live:
        pk = int(rng.integers(5))
        prompt = rng.integers(0, 4, int(rng.integers(1, 5))).tolist()
        for x in (idx, ref, sync):
          x.begin(pk, next_key, prompt)
        live.append(next_key)
        next_key += 1
      elif op < 0.25:
        sk = live.pop(int(rng.integers(len(live))))
        keep = bool(rng.random() < 0.8)
        for x in (idx, ref, sync):
          x.end(sk, keep=keep)
      else:
        sk = live[int(rng.integers(len(live)))]
        toks = np.asarray(rng.integers(0, 4, int(rng.integers(1, 6))))
        for x in (idx, ref, sync):
          x.extend(sk, toks)
        toks[:] = 0  # the caller reuses its buffer: the queued update holds a copy
    if live:
      sk = live[int(rng.integers(len(live)))]
      mt, topk, nodes = int(rng.integers(1, 7)), int(rng.integers(1, 4)), int(rng.integers(1, 12))
      d = _check(idx, ref, sk, mt, topk=topk, max_nodes=nodes)
      ds = sync.draft(sk, mt, topk=topk, max_nodes=nodes)
      assert d.tokens.tolist() == ds.tokens.tolist() and d.parents.tolist() == ds.parents.tolist()
      n_checked += 1
  st = idx.stats()
  assert st["tokens"] == sync.stats()["tokens"] and st["update_s"] > 0
  idx.close()
  assert n_checked > 100


def test_worker_errors_surface_on_the_next_call():
  """An update that fails on the worker thread raises that exception on the caller's next call
  (not swallowed); the updates queued after it are skipped (a synchronous caller would have
  stopped at the error); the index keeps working afterwards; close() raises a pending one."""
  inline = HistoryIndex()  # the CPU backend: updates on the caller's thread, errors at once
  assert not inline.background
  inline.begin("p", "a", [1, 2])
  with pytest.raises(KeyError, match="ghost"):
    inline.extend("ghost", [1])
  idx = HistoryIndex(background=True, long_match=0)
  idx.begin("p", "a", [1, 2, 3, 1, 2])
  idx.extend("ghost", [1])  # never begun: fails in the worker
  idx.extend("a", [3])      # queued after the failure: skipped
  with pytest.raises(KeyError, match="ghost"):
    idx.draft("a", 2)
  assert idx.draft("a", 2).tokens.tolist() == [3, 1]  # "1 2" -> 3 1: the skipped [3] is absent
  idx.end("a")
  idx.end("a")  # no longer live
  with pytest.raises(KeyError, match="not live"):
    idx.stats()
  idx.begin("p", "b", [1])
  idx.extend("b", [2])
  assert idx.draft("b", 3).tokens.tolist() == [3, 1, 2]
  idx.end("nobody")
  with pytest.raises(KeyError, match="nobody"):
    idx.close()
  with pytest.raises(RuntimeError, match="closed"):
    idx.begin("p", "c", [1])
  idx = HistoryIndex(background=True)
  with pytest.raises(ValueError, match="token ids"):  # a prompt is checked at once
    idx.begin("p", "a", [1, 1 << 30])
  idx.begin("p", "a", [1])
  idx.extend("a", [2, 1 << 30])  # a response token in the worker
  with pytest.raises(ValueError, match="token ids"):
    idx.draft("a", 1)
  idx.close()


def test_engine_with_background_index_equals_synchronous():
  """The engine's history arm over HistoryIndex (updates on the worker thread, overlapping
  the device chunks) drafts exactly what the synchronous index drafts: same outputs and the
  same accepted drafts per chunk (greedy; the second epoch's drafts are accepted)."""
  import jax

  from tlt_jax.drafter.model import init_drafter
  from tlt_jax.models import ModelConfig, init_params
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  cfg = ModelConfig(arch="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                    tie_word_embeddings=True)
  params, dparams = init_params(cfg, jax.random.key(0), std=0.3), init_drafter(cfg,
                                                                               jax.random.key(1))
  rng = np.random.RandomState(0)
  reqs = [Request(list(rng.randint(1, 61, rng.randint(2, 12))), i // 2, i % 2)
          for i in range(6)]
  ecfg = EngineConfig(max_batch=4, buckets=(1, 2, 4), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=24, spec=SpecConfig(strategy="hist_3", bs_threshold=4,
                                                         patience=1, use_kernel=False))
  runs = []
  for index in (suffix_index.SuffixIndex(), HistoryIndex(background=True)):
    w = Engine(params, cfg, ecfg, drafter_params=dparams, history=index)
    out = [{(r.request_id, r.sample_index): r.response_ids.tolist()
            for r in w.generate(reqs, SamplingParams(temperature=0.0))}
           for _ in range(2)]  # the second epoch drafts from the first one's answers
    runs.append((out, [(m.mode, m.accepted, m.verifications) for m in w.chunk_log],
                 index.stats()["tokens"]))
  assert runs[0] == runs[1]
  assert sum(a for _, a, _ in runs[0][1]) > 0  # history drafts were accepted
