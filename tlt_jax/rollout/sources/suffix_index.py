"""The history index itself: model-free drafts from what the same prompt already wrote.

In GRPO a prompt is answered n times per step and again in later epochs, and the answers share
long stretches. For a row, `SuffixIndex.draft` finds the longest suffix of the row's own text
(prompt + response so far; min_match..max_match tokens) that occurs in the prompt's history,
then follows the most frequent continuation: a chain (topk=1) or a tree (top-k children per
node, expanded best-first by cumulative log frequency). The history of a prompt is its finished
sequences (this step's siblings and earlier steps; oldest dropped first past
max_tokens_per_prompt; prompts past max_prompts evicted least-recently-used), the live
siblings' tokens so far, and the row's own text. Every sequence is stored as prompt + output.

Definitions (tests/test_history.py holds a brute-force reference of exactly these):
- An occurrence of a context c (length L) is a position p in a sequence s with
  s[p-L+1 : p+1] == c AND a next token s[p+1]. So the row's own end (no next token yet) is
  never a match, nor is a live sibling's end.
- Match length L: the largest L in [min_match, max_match] with an occurrence of the row's last
  L tokens; no such L -> empty draft.
- Counts: after the matched context, the drafted path extends the context (a suffix-tree walk),
  so node v's children are the next tokens over all occurrences of (matched context + path to
  v), counted; ties go to the smaller token id.
- Support rule: a child with count 1 is kept only when its context (L + its depth - 1) is at
  least `long_match` (default 8) tokens; otherwise a child needs count >= 2. Why: a lone
  occurrence after a long match is a copied stretch (siblings copy whole paragraphs), which
  continues; after a 2-3 token match it is a coincidence, and a verifier rejects it while
  paying for the longer verification. Draft length thus adapts to match length and frequency.
- Scores: cumulative log of the relative frequency (count / total of the parent's counts)
  along the path; the tree is expanded best-first by it up to max_nodes (default max_tokens),
  depth <= max_tokens.

Data structure (and why not a suffix automaton). Per prompt, one flat arena of token ids
(uint32 big-endian, sequences separated by a sentinel) and a suffix array `sa` of the arena
positions that have a next token, sorted by the BACKWARD window of max_match tokens ending
there (the reversed context). A context's occurrences are then one contiguous range of `sa`:
one bisect (CPython `bisect` over 4-byte big-endian windows, memcmp order) finds the longest
match from the two neighbours' common prefix; galloping out from there bounds its range (long
matches have few occurrences); continuations are numpy gathers at `arena[p + 1]` that narrow
as the path grows. Backward keys never change once a position exists, so tokens emitted after
the last sort are "pending": each position gets one uint64 (its token and the one before it)
in a per-prompt array that a lookup filters with one numpy compare, then checks the few
candidates' [C, max_match] windows in their rows' buffers; the arena is re-sorted lazily when
pending exceeds max(pending_min, indexed * pending_frac), so sorting is amortised O(n log n)
over a geometric series. Sorting is prefix doubling on uint64 keys (`backward_sorted`).
Dropping a sequence (eviction, end(keep=False)) filters `sa` with a mask (a filtered sorted
array stays sorted); its arena bytes are reclaimed at the next re-sort.
Updates are cheap and deferred: extend only appends to the row's buffer (its per-call Python
cost is most of an insert: the engine extends every live row by a few tokens per step);
`settle` registers all new positions of a prompt as pending in one vectorised pass (or
re-sorts), run by HistoryIndex's worker thread when idle, else by the next draft of that
prompt.
Memory: 8 bytes per indexed token (4 arena + 4 sa; finished sequences are views into the
arena) plus the live rows' own buffers. A suffix automaton (incremental, O(1) amortised
extend) was measured in CPython with dict transitions (tlt_jax/bench/history.py
`automaton_cost`): hundreds of bytes per token, i.e. tens of GB at 512 prompts x 256k
tokens; it also cannot delete (eviction and dropped rows would rebuild it) and its occurrence
counts need propagating along suffix links. The arena + sorted array is numpy-sized and exact.

Measured (scripts/bench_history.py): 11-14 bytes and ~1.9 us of host time per history token,
68-156 us per chain-8 lookup; the whole account in docs/engine.md ("History drafts vs the
drafter").

On the engine's host the index runs behind `HistoryIndex` (history.py), which applies its
updates on a worker thread where the model runs on an accelerator.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
import time
from typing import NamedTuple

import numpy as np

from tlt_jax.rollout.sources.suffix_arena import (BITS, SENTINEL, PromptHistory, Seq,
                                                  backward_sorted, checked_ids, in_ranges)

_SMALL = 32  # occurrence sets up to this size are walked as Python lists
_NEVER = np.uint64((1 << 64) - 1)  # a pending key no (token, previous token) pair equals


class Draft(NamedTuple):
  tokens: np.ndarray   # [N] int32 draft tokens, nodes in topological order
  parents: np.ndarray  # [N] int32 parent index in this array, -1 = child of the row's last token
  scores: np.ndarray   # [N] float32 cumulative log relative frequency of the path to the node


_EMPTY = Draft(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))


class SuffixIndex:
  """The index, synchronous (module docstring); `HistoryIndex` (history.py) runs its updates
  on a worker thread. Updates only append tokens (a slice copy per call); the positions they
  add are registered as pending, or sorted, by `settle` (the worker calls it whenever it is idle;
  a draft settles its own prompt first)."""

  def __init__(self, *, max_tokens_per_prompt: int = 1 << 20, max_prompts: int = 4096,
               min_match: int = 2, max_match: int = 32, long_match: int = 8,
               pending_min: int = 4096, pending_frac: float = 0.5):
    if not 1 <= min_match <= max_match:
      raise ValueError(f"HistoryIndex: need 1 <= min_match <= max_match, got {min_match}, "
                       f"{max_match}")
    self.max_tokens_per_prompt = max_tokens_per_prompt
    self.max_prompts = max_prompts
    self.min_match, self.max_match, self.long_match = min_match, max_match, long_match
    self.pending_min, self.pending_frac = pending_min, pending_frac
    self._prompts: collections.OrderedDict = collections.OrderedDict()  # LRU order
    self._where: dict = {}  # live seq_key -> (prompt_key, PromptHistory, Seq)
    self._unsettled: set = set()  # prompt keys with fresh positions
    self._lookups = self._hits = self._match_sum = 0
    self._sorts, self._sort_s, self._update_s = 0, 0.0, 0.0

  # ---- updates -----------------------------------------------------------------------------

  def begin(self, prompt_key, seq_key, prompt_ids) -> None:
    t0 = time.perf_counter()
    if seq_key in self._where:
      raise ValueError(f"HistoryIndex.begin: sequence {seq_key!r} is already live")
    s = Seq(prompt_ids)
    p = self._prompts.get(prompt_key)
    if p is None:
      p = self._prompts[prompt_key] = PromptHistory()
    self._prompts.move_to_end(prompt_key)
    p.live[seq_key] = s
    if s.n > 1:
      p.fresh += s.n - 1
      p.dirty[id(s)] = s
      self._unsettled.add(prompt_key)
    self._where[seq_key] = (prompt_key, p, s)
    self._evict_prompts()
    self._update_s += time.perf_counter() - t0

  def extend(self, seq_key, tokens) -> None:
    t0 = time.perf_counter()
    toks = checked_ids(tokens)
    k = len(toks)
    if k:
      pk, p, s = self._live(seq_key)
      p.fresh += k if s.n else k - 1  # the old last position gets its next token
      s.append(toks)
      p.dirty[id(s)] = s
      self._unsettled.add(pk)
    self._update_s += time.perf_counter() - t0

  def end(self, seq_key, keep: bool = True) -> None:
    t0 = time.perf_counter()
    _, p, s = self._live(seq_key)
    del self._where[seq_key]
    del p.live[seq_key]
    s.live = False
    if not keep:
      self._drop(p, [s])
    else:
      if s.start < 0 or s.n > s.snap:  # not (all) in the arena yet: trim its buffer
        s.ids = s.ids[:s.n].copy()
      else:
        s.ids = p.arena[s.start:s.start + s.n]
      p.done.append(s)
      p.done_tokens += s.n
      old = []
      while p.done_tokens > self.max_tokens_per_prompt and p.done:
        o = p.done.popleft()
        p.done_tokens -= o.n
        old.append(o)
      self._drop(p, old)
    self._update_s += time.perf_counter() - t0

  def settle(self) -> None:
    """Registers every prompt's fresh positions (or re-sorts a prompt whose unsorted positions
    passed the threshold): the work a draft would do first, done ahead."""
    t0 = time.perf_counter()
    while self._unsettled:
      p = self._prompts.get(self._unsettled.pop())
      if p is not None:
        self._settle(p)
    self._update_s += time.perf_counter() - t0

  def _settle(self, p: PromptHistory):
    if p.pending + p.fresh > max(self.pending_min, self.pending_frac * len(p.sa)):
      self._sort(p)
    else:
      p.register(p.dirty.values())
      p.dirty.clear()

  def _live(self, seq_key):
    """(prompt_key, PromptHistory, Seq) of a live sequence."""
    try:
      return self._where[seq_key]
    except KeyError:
      raise KeyError(f"HistoryIndex: sequence {seq_key!r} is not live (begin() it first)") \
          from None

  def _drop(self, p: PromptHistory, seqs):
    """Removes sequences: sa entries filtered out (order kept), pending ones made unmatchable."""
    inarena = [s for s in seqs if s.start >= 0]
    for s in seqs:
      p.forget(s)
      if s.slot >= 0:
        p.pkey[:p.pending][p.pslot[:p.pending] == s.slot] = _NEVER
        s.slot = -1
    if inarena:
      p.sa = p.sa[~in_ranges(p.sa, [(s.start, s.start + s.snap) for s in inarena])]
      for s in inarena:
        s.start = -1  # arena bytes stay until the next sort; nothing points at them

  def _evict_prompts(self):
    while len(self._prompts) > self.max_prompts:
      victim = next((k for k, p in self._prompts.items() if not p.live), None)
      if victim is None:
        return  # every prompt has live rows: keep them all (the engine bounds live rows)
      del self._prompts[victim]

  # ---- the sorted arena --------------------------------------------------------------------

  def _sort(self, p: PromptHistory):
    """Rebuilds the arena from every sequence and sorts its positions by backward window."""
    t0 = time.perf_counter()
    w = self.max_match
    seqs = p.all_seqs()
    parts, starts, pos = [np.full(w, SENTINEL, np.uint32)], [], []
    at = w
    for s in seqs:
      parts += [s.ids[:s.n], np.full(1, SENTINEL, np.uint32)]
      starts.append(at)
      if s.n >= 2:
        pos.append(np.arange(at, at + s.n - 1))
      s.start, s.snap, s.reg = at, s.n, s.n
      at += s.n + 1
    arena = np.concatenate(parts)
    pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    p.arena = arena.astype(">u4")
    p.starts = np.asarray(starts, np.int64)
    p.seqs = seqs
    p.sa = backward_sorted(arena.astype(np.uint64), pos, w).astype(np.int32)
    for s in seqs:  # finished sequences live in the arena only: 4 bytes a token, not 8
      if not s.live:
        s.ids = p.arena[s.start:s.start + s.n]
    p.pending = 0
    p.pkey, p.pslot, p.poff = (np.zeros(256, t) for t in (np.uint64, np.int32, np.int32))
    p.pseqs = []
    p.fresh = 0
    p.dirty.clear()
    for s in seqs:
      s.slot = -1
    self._sorts += 1
    self._sort_s += time.perf_counter() - t0

  # ---- lookup ------------------------------------------------------------------------------

  def draft(self, seq_key, max_tokens: int, *, topk: int = 1,
            max_nodes: int | None = None) -> Draft:
    pk, p, row = self._live(seq_key)
    self._prompts.move_to_end(pk)
    self._lookups += 1
    if max_tokens <= 0:
      return _EMPTY
    if p.dirty:
      t0 = time.perf_counter()
      self._settle(p)
      self._update_s += time.perf_counter() - t0
    q = row.ids[max(0, row.n - self.max_match):row.n][::-1].astype(np.int64)  # [<=W] reversed
    if len(q) < self.min_match:
      return _EMPTY
    la, lo, hi = self._match_arena(p, q)
    lp, pend = self._match_pending(p, q)
    length = max(la, lp)
    if length < self.min_match:
      return _EMPTY
    occ_a = p.sa[lo:hi] if la == length else np.zeros(0, np.int32)
    occ_p = [(s, o[m >= length]) for s, o, m in pend]
    occ_p = [(s, o) for s, o in occ_p if len(o)]
    d = self._expand(p, occ_a, occ_p, length, max_tokens, topk,
                     max_tokens if max_nodes is None else max_nodes)
    if len(d.tokens):
      self._hits += 1
      self._match_sum += length
    return d

  def _match_arena(self, p: PromptHistory, q):
    """(L, lo, hi): the longest common prefix of q with a sorted backward window, its range."""
    if not len(p.sa):
      return 0, 0, 0
    arena, w = p.arena, len(q)
    qkey = q.astype(">u4").tobytes()

    def key(pos, n=w):
      return arena[pos - n + 1:pos + 1][::-1].tobytes()

    i = bisect.bisect_left(p.sa, qkey, key=key)
    best = 0
    for j in (i - 1, i):
      if 0 <= j < len(p.sa):
        win = arena[p.sa[j] - w + 1:p.sa[j] + 1][::-1].astype(np.int64)
        neq = np.flatnonzero(win != q)
        best = max(best, int(neq[0]) if len(neq) else w)
    if best == 0:
      return 0, 0, 0
    # the range of entries sharing the first `best` tokens holds i-1 or i: gallop out from i
    # (long matches have few occurrences: a handful of key builds instead of 2 log2(M))
    qk, sa, n = qkey[:4 * best], p.sa, len(p.sa)
    kb = lambda pos: key(pos, best)  # noqa: E731
    s = 1
    while i - s >= 0 and kb(sa[i - s]) == qk:
      s *= 2
    lo = bisect.bisect_left(sa, qk, lo=max(0, i - s), hi=i, key=kb)
    s = 1
    while i + s - 1 < n and kb(sa[i + s - 1]) == qk:
      s *= 2
    hi = bisect.bisect_right(sa, qk, lo=i, hi=min(n, i + s), key=kb)
    return best, lo, hi

  def _match_pending(self, p: PromptHistory, q):
    """Pending positions: (max match length, [(seq, offsets, match lengths)])."""
    keys = p.pkey[:p.pending]
    if len(q) > 1 and self.min_match >= 2:
      cand = np.flatnonzero(keys == np.uint64((int(q[0]) << BITS) | int(q[1])))
    else:
      cand = np.flatnonzero((keys >> np.uint64(BITS)) == np.uint64(q[0]))
    if not len(cand):
      return 0, []
    slots, offs = p.pslot[cand], p.poff[cand].astype(np.int64)
    out, best = [], 0
    k = np.arange(len(q))
    for slot in np.unique(slots):
      s = p.pseqs[slot]
      o = offs[slots == slot]
      idx = o[:, None] - k[None, :]  # [C, len(q)] backward windows
      eq = (s.ids[np.maximum(idx, 0)] == q[None, :]) & (idx >= 0)
      m = np.cumprod(eq, axis=1).sum(axis=1)
      best = max(best, int(m.max()))
      out.append((s, o, m))
    return best, out

  def _next(self, p: PromptHistory, occ_a, occ_p):
    """Next tokens after each occurrence: (tok_a, occ_a kept, [(seq, offsets, toks)])."""
    tok = p.arena[occ_a + 1].astype(np.int64) if len(occ_a) else np.zeros(0, np.int64)
    cut = tok == SENTINEL
    moved = []
    if cut.any():  # the arena copy of a sequence ends here: live rows continue in their buffer
      for a in occ_a[cut]:
        j = int(np.searchsorted(p.starts, a, "right")) - 1
        s = p.seqs[j]
        if s.start == p.starts[j]:  # still this sequence (not dropped)
          moved.append((s, np.array([a - s.start])))
      occ_a, tok = occ_a[~cut], tok[~cut]
    pend = []
    for s, o in occ_p + moved:
      o = o[o + 1 < s.n]
      if len(o):
        pend.append((s, o, s.ids[o + 1].astype(np.int64)))
    return tok, occ_a, pend

  def _to_list(self, p: PromptHistory, occ_a, occ_p):
    """Occurrences as [(seq, offset)]: small sets walk faster in plain Python than in numpy."""
    out = []
    if len(occ_a):
      j = np.searchsorted(p.starts, occ_a, "right") - 1
      for a, jj in zip(occ_a.tolist(), j.tolist()):
        s = p.seqs[jj]
        if s.start == p.starts[jj]:  # not dropped since the sort
          out.append((s, a - s.start))
    for s, o in occ_p:
      out += [(s, x) for x in o.tolist()]
    return out

  def _expand(self, p, occ_a, occ_p, length, max_tokens, topk, max_nodes):
    """Best-first expansion by cumulative log frequency (topk=1: the chain).

    A node's occurrences are (occ_a, occ_p) arrays while many, a [(seq, offset)] list once at
    most `_SMALL` (both give the same counts and the same order: count desc, token asc)."""
    toks, parents, scores = [], [], []
    heap = []  # (-score, tie, token, parent, depth, occurrences)
    tie = 0

    def children(occ):
      """[(-count, token, child occurrences)] best first, and the total count."""
      if isinstance(occ, list):
        groups: dict = {}
        for s, o in occ:
          if o + 1 < s.n:
            groups.setdefault(int(s.ids[o + 1]), []).append((s, o + 1))
        kids = sorted((-len(g), x) for x, g in groups.items())[:topk]
        return [(nc, x, groups[x]) for nc, x in kids], sum(map(len, groups.values()))
      tok_a, occ_a, pend = self._next(p, *occ)
      allt = np.concatenate([tok_a] + [t for _, _, t in pend])
      if not len(allt):
        return [], 0
      vals, counts = np.unique(allt, return_counts=True)
      out = []
      for j in np.lexsort((vals, -counts))[:topk]:
        x = int(vals[j])
        ca = occ_a[tok_a == x] + 1
        cp = [(s, o[t == x] + 1) for s, o, t in pend]
        cp = [(s, o) for s, o in cp if len(o)]
        child = self._to_list(p, ca, cp) if counts[j] <= _SMALL else (ca, cp)
        out.append((-int(counts[j]), x, child))
      return out, len(allt)

    def push_children(parent, depth, score, occ):
      nonlocal tie
      if depth >= max_tokens:
        return
      kids, total = children(occ)
      need1 = length + depth >= self.long_match  # context of a child = length + depth tokens
      for negc, x, child in kids:
        c = -negc
        if c < (1 if need1 else 2):
          continue
        heapq.heappush(heap, (-(score + math.log(c / total)), tie, x, parent, depth + 1, child))
        tie += 1

    n_occ = len(occ_a) + sum(len(o) for _, o in occ_p)
    root = self._to_list(p, occ_a, occ_p) if n_occ <= _SMALL else (occ_a, occ_p)
    push_children(-1, 0, 0.0, root)
    while heap and len(toks) < max_nodes:
      negs, _, x, parent, depth, occ = heapq.heappop(heap)
      toks.append(x)
      parents.append(parent)
      scores.append(-negs)
      push_children(len(toks) - 1, depth, -negs, occ)
    if not toks:
      return _EMPTY
    return Draft(np.asarray(toks, np.int32), np.asarray(parents, np.int32),
                 np.asarray(scores, np.float32))

  # ---- accounting --------------------------------------------------------------------------

  def stats(self) -> dict:
    seqs = tokens = mem = 0
    for p in self._prompts.values():
      for s in p.all_seqs():
        seqs += 1
        tokens += s.n
        if s.ids.base is None:  # own buffer (live rows, finished ones not sorted yet)
          mem += s.ids.nbytes
      mem += p.arena.nbytes + p.sa.nbytes + p.starts.nbytes
      mem += p.pkey.nbytes + p.pslot.nbytes + p.poff.nbytes
    return {"prompts": len(self._prompts), "sequences": seqs, "tokens": tokens,
            "memory_bytes": mem, "lookups": self._lookups, "hits": self._hits,
            "mean_match_len": self._match_sum / max(self._hits, 1), "sorts": self._sorts,
            "sort_s": self._sort_s, "update_s": self._update_s}


