"""HistoryIndex at scale: memory per history token, time per inserted token and per lookup,
and tokens accepted per lookup by a perfect verifier, first epoch vs a later one.

Synthetic "reasoning-like" groups: per prompt a base text (random tokens); each sample copies
random spans of it (mean `span` tokens) with mutations (a token replaced with probability
`mut`, a short random run inserted between spans), so siblings share long stretches in
different orders, like n answers to one problem. Every epoch draws fresh samples from the
same base, so in a later epoch the earlier epoch's responses are history.

Decoding is simulated as speculative decoding with a perfect verifier: the rows of all
prompts advance in rounds, like the engine's history loop (every live row drafts, then every
row extends by what it emitted); each round a row drafts (chain of `chain` tokens), the accepted
count is the longest prefix equal to the row's own next tokens (its future is known here), and
the row emits accepted + 1 tokens (the bonus token), exactly what a lossless verifier commits
under greedy decoding. Every `tree_every`-th round the row also drafts a tree (topk, nodes)
and scores the longest root path matching its future (a tree verifier's acceptance), timed
separately. These timings run the synchronous index (SuffixIndex, the engine that
HistoryIndex's worker thread drives) so that they split its work: insert time covers
begin/extend/end plus settling the new positions (registering them as pending, the lazy
re-sorts: stats()["update_s"]), which a synchronous draft does first and which is subtracted
from the lookup time.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np

from tlt_jax.rollout.sources.history import HistoryIndex
from tlt_jax.rollout.sources.suffix_index import SuffixIndex


def make_sample(rng, base, length, span, mut, vocab):
  """[length] tokens: random spans of `base` with mutations and short random insertions."""
  out, n = [], 0
  while n < length:
    k = int(min(rng.geometric(1 / span), len(base)))
    a = int(rng.integers(0, len(base) - k + 1))
    piece = base[a:a + k].copy()
    flip = rng.random(k) < mut
    piece[flip] = rng.integers(0, vocab, int(flip.sum()))
    out += [piece, rng.integers(0, vocab, int(rng.integers(0, 4)))]
    n += len(out[-2]) + len(out[-1])
  return np.concatenate(out)[:length].astype(np.int64)


def _tree_accept(d, future):
  """Longest root path of the tree whose tokens equal future[:depth]."""
  depth = np.zeros(len(d.tokens), np.int64)
  best = 0
  for i, (t, par) in enumerate(zip(d.tokens, d.parents)):
    pd = 0 if par < 0 else depth[par]
    if (par < 0 or depth[par] > 0) and pd < len(future) and t == future[pd]:
      depth[i] = pd + 1
      best = max(best, depth[i])
  return best


def run_epoch(idx, rng, bases, epoch, samples, length, prompt_len, span, mut, vocab, chain,
              topk, nodes, tree_every):
  """Decodes one epoch of all prompts on `idx` (a SuffixIndex); returns the epoch's
  counters."""
  u0 = idx._update_s
  rows = []
  for pk, base in enumerate(bases):
    prompt = base[:prompt_len]
    for j in range(samples):
      out = make_sample(rng, base, length, span, mut, vocab)
      key = (epoch, pk, j)
      rows.append([key, out, 0])
      idx.begin(pk, key, prompt)
  c = dict(insert_s=0.0, chain_s=0.0, tree_s=0.0, lookups=0, accepted=0, trees=0,
           tree_accepted=0, tokens=len(bases) * samples * (length + prompt_len))
  rnd = 0
  live = rows
  while live:
    for r in live:
      key, out, at = r
      future = out[at:at + chain + 1]
      s0 = idx._update_s
      t0 = time.perf_counter()
      d = idx.draft(key, chain)
      c["chain_s"] += time.perf_counter() - t0 - (idx._update_s - s0)
      c["lookups"] += 1
      acc = 0
      while acc < len(d.tokens) and acc < len(future) and d.tokens[acc] == future[acc]:
        acc += 1
      c["accepted"] += acc
      if rnd % tree_every == 0:
        s0 = idx._update_s
        t0 = time.perf_counter()
        dt = idx.draft(key, chain, topk=topk, max_nodes=nodes)
        c["tree_s"] += time.perf_counter() - t0 - (idx._update_s - s0)
        c["trees"] += 1
        c["tree_accepted"] += _tree_accept(dt, future)
      r.append(min(acc + 1, len(out) - at))
    for r in live:  # as the engine's history loop: every row drafts, then every row extends
      key, out, at, step = r
      idx.extend(key, out[at:at + step])
      r[2] = at + step
      del r[3]
      if r[2] >= len(out):
        idx.end(key)
    live = [r for r in live if r[2] < len(r[1])]
    rnd += 1
  c["insert_s"] = idx._update_s - u0
  return c


def history_table(prompts=8, samples=16, length=16384, prompt_len=256, epochs=2, span=200,
                  mut=0.02, vocab=32000, chain=8, topk=4, nodes=32, tree_every=8, seed=0,
                  full_prompts=512, **index_kw):
  """Lines of the benchmark (see the module docstring), one block per epoch."""
  rng = np.random.default_rng(seed)
  bases = [rng.integers(0, vocab, 2 * length) for _ in range(prompts)]
  idx = SuffixIndex(**index_kw)
  lines = [f"HistoryIndex: {prompts} prompts x {samples} samples x {length} tokens "
           f"(+{prompt_len} prompt), span {span}, mutation {mut}, vocab {vocab}"]
  for ep in range(epochs):
    sort0 = idx._sort_s
    c = run_epoch(idx, rng, bases, ep, samples, length, prompt_len, span, mut, vocab, chain,
                  topk, nodes, tree_every)
    st = idx.stats()
    ins = c["insert_s"] / c["tokens"]
    lines += [
      f"epoch {ep} ({'siblings only' if ep == 0 else 'earlier responses in history'}):",
      f"  accepted/lookup chain{chain}: {c['accepted'] / c['lookups']:.2f} "
      f"(tokens/verification {1 + c['accepted'] / c['lookups']:.2f}); "
      f"tree top{topk}x{nodes}: {c['tree_accepted'] / max(c['trees'], 1):.2f}",
      f"  insert {1e6 * ins:.2f} us/token (sorts {1e6 * (idx._sort_s - sort0) / c['tokens']:.2f}"
      f" us/token of it), lookup chain{chain} {1e6 * c['chain_s'] / c['lookups']:.0f} us, "
      f"tree {1e6 * c['tree_s'] / max(c['trees'], 1):.0f} us ({c['lookups']} lookups)",
      f"  memory {st['memory_bytes'] / st['tokens']:.2f} bytes/history token "
      f"({st['tokens']} tokens, {st['memory_bytes'] / 2**20:.1f} MiB)",
    ]
  per_step = full_prompts * samples * (length + prompt_len)
  bpt = st["memory_bytes"] / st["tokens"]
  look = 1e6 * c["chain_s"] / c["lookups"]
  lines += [
    f"extrapolation to {full_prompts} prompts x {samples} samples (per-prompt costs are "
    f"independent, so totals scale linearly in prompts):",
    f"  insert CPU per step = tokens/step x {1e6 * ins:.2f} us: {per_step / 1e6:.0f}M tokens "
    f"(all {length}+{prompt_len} long) -> {per_step * ins:.0f} s; 8M tokens -> {8e6 * ins:.0f} s",
    f"  memory = {bpt:.1f} B x history tokens kept: {epochs} epochs at full length -> "
    f"{bpt * per_step * epochs / 2**30:.1f} GiB; cap {full_prompts} x max_tokens_per_prompt "
    f"(2^20) -> {bpt * full_prompts * 2**20 / 2**30:.1f} GiB",
    f"  lookups per decode step = live rows x {look:.0f} us (e.g. 224 rows: "
    f"{224 * look / 1e3:.0f} ms)"]
  return lines


def automaton_cost(n=100_000, vocab=32000, seed=0):
  """(bytes per token, us per token) of a plain CPython suffix automaton (dict transitions,
  no occurrence counts): the alternative rollout/sources/suffix_index.py's docstring rejects."""
  toks = np.random.default_rng(seed).integers(0, vocab, n).tolist()
  tracemalloc.start()
  t0 = time.perf_counter()
  nxt, link, length, last = [{}], [-1], [0], 0
  for c in toks:
    cur = len(nxt)
    nxt.append({})
    link.append(0)
    length.append(length[last] + 1)
    p = last
    while p != -1 and c not in nxt[p]:
      nxt[p][c] = cur
      p = link[p]
    if p != -1:
      q = nxt[p][c]
      if length[p] + 1 == length[q]:
        link[cur] = q
      else:
        clone = len(nxt)
        nxt.append(dict(nxt[q]))
        link.append(link[q])
        length.append(length[p] + 1)
        while p != -1 and nxt[p].get(c) == q:
          nxt[p][c] = clone
          p = link[p]
        link[q] = link[cur] = clone
    last = cur
  dt = time.perf_counter() - t0
  mem = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  return mem / n, 1e6 * dt / n


class _Shadowed:
  """A SuffixIndex proxy that also feeds `n` shadow rows per row the same tokens: n + 1 times
  the index's ingest work at this toy scale (a synthetic load, stated as such in the output),
  done where the index works (the caller's thread, or HistoryIndex's worker)."""

  def __init__(self, index, n):
    self.index, self.n = index, n

  def begin(self, prompt_key, seq_key, prompt_ids):
    for i in range(self.n + 1):
      self.index.begin(prompt_key, (seq_key, i), prompt_ids)

  def extend(self, seq_key, tokens):
    for i in range(self.n + 1):
      self.index.extend((seq_key, i), tokens)

  def end(self, seq_key, keep=True):
    for i in range(self.n + 1):
      self.index.end((seq_key, i), keep)

  def draft(self, seq_key, *a, **kw):
    return self.index.draft((seq_key, 0), *a, **kw)

  def settle(self):
    self.index.settle()

  def stats(self):
    return self.index.stats()


def _loaded(index, shadows):
  """The index with `shadows` shadow rows per row (_Shadowed) inside: HistoryIndex's queued
  updates then call the proxy on the worker thread."""
  if isinstance(index, HistoryIndex):
    index._index = _Shadowed(index._index, shadows)
    return index
  return _Shadowed(index, shadows)


class _Recorder:
  """Records the engine's index calls, cut into chunks by the on_chunk hook."""

  def __init__(self):
    self.ops, self.chunks = [], []  # chunks: [(decode seconds, [(method, args, kwargs)])]

  def __getattr__(self, name):
    return lambda *a, **kw: self.ops.append((name, a, kw))

  def on_chunk(self, m):
    self.chunks.append((m.wall_time, self.ops))
    self.ops = []


def _replay(chunks, index):
  """Each chunk: its measured decode time as a sleep (a device that needs no host core, as on
  a GPU host), then its index updates; the index caught up at the end. Returns seconds."""
  t0 = time.perf_counter()
  for dev_s, ops in chunks:
    time.sleep(dev_s)
    for name, args, kw in ops:
      getattr(index, name)(*args, **kw)
  index.stats()
  return time.perf_counter() - t0


def overlap_table(rounds=3, prompts=8, samples=8, arm="4_1_5", max_new_tokens=256,
                  chunk_size=16, shadows=0, seed=0):
  """Engine wall time per token on the embedded default model with the history index (a)
  absent, (b) updated synchronously (SuffixIndex) and (c) updated on HistoryIndex's
  worker thread, in interleaved rounds (rotated order; one warm-up round each first:
  compiles), each timed until the index has caught up (its stats()); plus the host seconds
  the index spent updating (update_s: begin/extend/end, registering, sorting; on the worker
  it includes waiting for the GIL and a core) and the engine thread's waits for the worker
  (wait_s). On a CPU backend the "device" is the same few cores the worker needs, so a second
  table replays one run's chunks with their measured decode times as sleeps (a device that
  needs no host core, as on a GPU host), each followed by the chunk's index calls. `arm`: a
  drafter arm ("plain": plain decoding); prompts x samples requests sampled at temperature 1,
  one generate call per round, a fresh index per round. shadows: synthetic load, each row's
  tokens also fed to that many shadow rows."""
  import jax

  from tlt_jax.bench.bench_model import load_target
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import EngineHooks, Request
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.scheduler import buckets_upto

  cfg, params, shipped_drafter, _, _, ids = load_target()
  ids = ids[:prompts]
  batch = prompts * samples
  spec = None if arm == "plain" else SpecConfig(strategy=arm, bs_threshold=batch, patience=1,
                                                use_kernel=jax.default_backend() == "gpu")
  # no stop tokens: the toy model's answers end after ~20 tokens, inside the first chunk; the
  # index's work only overlaps a device chunk that follows it
  ecfg = EngineConfig(max_batch=batch, buckets=buckets_upto(batch), chunk_size=chunk_size,
                      max_prompt_len=-(-max(map(len, ids)) // 16) * 16,
                      max_new_tokens=max_new_tokens, stop_tokens=(), spec=spec)
  dparams = shipped_drafter if spec else None
  engine = Engine(params, cfg, ecfg, drafter_params=dparams)
  requests = [Request(p, request_id=i, sample_index=j) for i, p in enumerate(ids)
              for j in range(samples)]
  sp = SamplingParams(temperature=1.0)
  make = {"none": lambda: None, "sync": lambda: SuffixIndex(),
          "background": lambda: HistoryIndex(background=True)}
  acc = {k: [0.0, 0, 0.0, 0.0] for k in make}  # seconds, tokens, update_s, wait_s
  order = list(make)
  for rnd in range(rounds + 1):
    for name in order[rnd % 3:] + order[:rnd % 3]:  # rotated: no variant always runs first
      index = make[name]()
      engine.history = None if index is None else _loaded(index, shadows)
      t0 = time.perf_counter()
      res = engine.generate(requests, sp, seed=seed + rnd)
      st = index.stats() if index is not None else {}
      dt = time.perf_counter() - t0
      if isinstance(index, HistoryIndex):
        index.close()
      if rnd:  # round 0 compiles
        a = acc[name]
        a[0] += dt
        a[1] += sum(r.num_tokens for r in res)
        a[2] += st.get("update_s", 0.0)
        a[3] += st.get("wait_s", 0.0)
  lines = [f"history index beside the engine: default model on {jax.default_backend()}, "
           f"{prompts} prompts x {samples} samples, temperature 1, "
           f"{'plain decoding' if spec is None else 'arm ' + arm}, chunk {chunk_size}, "
           f"{max_new_tokens} new tokens a row (no stop tokens), {rounds} interleaved rounds"
           + (f"; SYNTHETIC LOAD: each row's tokens also fed to {shadows} shadow rows "
              f"({shadows + 1}x the index's work)" if shadows else "")]
  base = acc["none"][0] / max(acc["none"][1], 1)
  for name, (sec, ntok, upd, wait) in acc.items():
    per = sec / max(ntok, 1)
    lines.append(f"  {name:10s} {1e6 * per:8.1f} us/token ({per / base:.3f}x none), "
                 f"{ntok} tokens in {sec:.2f} s; index updates {upd:.2f} s "
                 f"({1e6 * upd / max(ntok, 1):.1f} us/token), engine waited {wait:.3f} s")
  rec = _Recorder()
  engine.history = rec
  ntok = sum(r.num_tokens for r in engine.generate(requests, sp, seed=seed,
                                                     hooks=EngineHooks(on_chunk=rec.on_chunk)))
  dev = sum(d for d, _ in rec.chunks)
  secs = {k: 0.0 for k in make}
  for rnd in range(rounds):
    for name in order[rnd % 3:] + order[:rnd % 3]:
      index = make[name]()
      secs[name] += _replay(rec.chunks, _Null() if index is None else _loaded(index, shadows))
      if isinstance(index, HistoryIndex):
        index.close()
  lines.append(f"replay of one run ({len(rec.chunks)} chunks, {ntok} tokens, decode "
               f"{dev:.2f} s as sleeps), {rounds} interleaved rounds:")
  for name, sec in secs.items():
    lines.append(f"  {name:10s} {1e6 * sec / rounds / ntok:8.1f} us/token "
                 f"({sec / secs['none']:.3f}x none)")
  return lines


class _Null:
  """No index."""

  def __getattr__(self, name):
    return lambda *a, **kw: None
