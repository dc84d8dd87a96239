"""Jittable decode primitives: prefill, a chunk of decode steps, and batch re-layout.

Everything here is a pure function over a `DecodeState` pytree; the host-side engine
(engine.py) decides when to call what. Shapes are fixed per batch-size bucket, so each
(bucket, function) is compiled once and reused: the JAX analogue of CUDA-graph capture.

The state keeps, per row, the hidden state whose logits choose the row's NEXT token. A step
samples from it, records (token, logprob, hidden), then feeds the token to get the next
hidden. So `hidden[j]` returned for response token j is exactly the last-layer (post-norm)
hidden state that produced token j: the (h_t, token_{t+1}) pairs an EAGLE drafter trains on,
with no extra forward pass.

KV memory is paged (models/kv_cache.py's KVCache): a state's caches hold the replica's
page pools and each row's page table. The per-row leaves are batch-major; the pools are not:
re-layout ops (`map_rows`, `take_rows`, `put_rows`) move table rows, never k/v, and a prefill
writes its prompts into the pages its rows were given (by the host allocator, pages.py).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models import KVCache, ModelConfig, Params, compute_logits, forward, pages_for
from tlt_jax.models.kv_cache import NO_PAGE
from tlt_jax.rollout.sampling import SamplingParams, sample_tokens


@flax.struct.dataclass
class DecodeState:
  cache: KVCache  # page pools, table [B, R]; lengths [B] = committed tokens = next position
  hidden: jax.Array  # [B, D] hidden state whose logits choose the next token
  keys: jax.Array  # [B, 2] uint32 raw per-row PRNG keys (folded with num_generated per step)
  num_generated: jax.Array  # [B] int32
  max_new: jax.Array  # [B] int32 per-row budget
  done: jax.Array  # [B] bool (empty slots are done)
  stopped: jax.Array  # [B] bool: finished on a stop token (vs. budget)

  @property
  def batch_size(self) -> int:
    return self.hidden.shape[0]


class ChunkOutput(NamedTuple):
  tokens: jax.Array  # [B, C] int32
  logprobs: jax.Array  # [B, C] float32
  hidden: jax.Array | None  # [B, C, D] (capture_hidden) else None
  valid: jax.Array  # [B, C] bool: a token was produced at this step for this row
  steps: jax.Array  # [] int32 steps actually run (the loop exits early when all rows are done)


def prefill(params: Params, cache: KVCache, tokens: jax.Array, prompt_lens: jax.Array,
            keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig) -> DecodeState:
  """tokens [B, P] right-padded prompts, prompt_lens [B] (0 = empty slot) -> state. cache: the
  pools and these rows' page tables [B, R] (rows without pages write nothing)."""
  return prefill_with_hidden(params, cache, tokens, prompt_lens, keys, max_new, cfg=cfg)[0]


def prefill_with_hidden(params: Params, cache: KVCache, tokens: jax.Array,
                        prompt_lens: jax.Array, keys: jax.Array, max_new: jax.Array, *,
                        cfg: ModelConfig) -> tuple[DecodeState, jax.Array]:
  """`prefill`, also returning every prompt position's hidden state [B, P, D] (the drafter's
  prefill consumes them; under jit an unused output costs nothing)."""
  b, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  out = forward(params, tokens, positions, cfg=cfg, cache=cache, return_logits=False,
                prefill=True, live=positions < prompt_lens[:, None])
  last = jnp.clip(prompt_lens - 1, 0, p - 1)
  hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
  empty = prompt_lens <= 0
  state = DecodeState(
      cache=out.cache.replace(lengths=prompt_lens.astype(jnp.int32)),
      hidden=hidden, keys=keys, num_generated=jnp.zeros((b,), jnp.int32),
      max_new=max_new.astype(jnp.int32), done=empty | (max_new <= 0),
      stopped=jnp.zeros((b,), jnp.bool_))
  return state, out.hidden


def shared_tables(table: jax.Array, src: jax.Array, u: int) -> tuple[jax.Array, jax.Array]:
  """For a prefill of U distinct prompts expanded to B rows (row i answers prompt src[i]):
  the page tables [U, R] the U prompts are prefilled into (those of each prompt's first row)
  and the tables [B, R] the other rows copy their prompt's pages into (NO_PAGE where a row is
  its prompt's first, or empty)."""
  b = table.shape[0]
  rows = jnp.arange(b)
  first = jnp.min(jnp.where(src[None, :] == jnp.arange(u)[:, None], rows[None, :], b), axis=1)
  src_tables = jnp.take(table, jnp.minimum(first, b - 1), axis=0)
  copy = (src >= 0) & (rows != jnp.take(first, jnp.maximum(src, 0)))
  return src_tables, jnp.where(copy[:, None], table, NO_PAGE)


def copy_pages(cache: KVCache, dst: jax.Array, src: jax.Array, n: int) -> KVCache:
  """Pages src[:, :n] copied onto dst[:, :n] (both [B, R] page ids; NO_PAGE dst, or a page
  that is its own source (a group's shared prompt pages, pages.share_prompts): skipped)."""
  d, s_ = dst[:, :n].reshape(-1), src[:, :n].reshape(-1)
  d, s_ = jnp.where(d == s_, NO_PAGE, d), jnp.minimum(s_, cache.num_pages - 1)
  cp = lambda p: p.at[d].set(p[s_], mode="drop")
  return cache.replace(k=tuple(map(cp, cache.k)), v=tuple(map(cp, cache.v)))


def prefill_shared(params: Params, cache: KVCache, tokens: jax.Array, prompt_lens: jax.Array,
                   src: jax.Array, keys: jax.Array, max_new: jax.Array, *,
                   cfg: ModelConfig) -> DecodeState:
  """`prefill` of U distinct prompts (tokens [U, P], prompt_lens [U]) expanded to B rows
  (`expand_rows`; cache: the B rows' tables): a GRPO group's n responses share one prompt,
  whose forward runs once into its first row's pages; the others hold its whole pages (the
  allocator's `share_prompts`) and copy the rest."""
  return prefill_shared_with_hidden(params, cache, tokens, prompt_lens, src, keys, max_new,
                                    cfg=cfg)[0]


def prefill_shared_with_hidden(params: Params, cache: KVCache, tokens: jax.Array,
                               prompt_lens: jax.Array, src: jax.Array, keys: jax.Array,
                               max_new: jax.Array, *, cfg: ModelConfig
                               ) -> tuple[DecodeState, jax.Array]:
  """`prefill_shared`, also returning the U prompts' hidden states [U, P, D]."""
  u = tokens.shape[0]
  src_tables, _ = shared_tables(cache.table, src, u)
  state, hidden = prefill_with_hidden(params, cache.replace(table=src_tables), tokens,
                                      prompt_lens, jnp.zeros((u, 2), jnp.uint32),
                                      jnp.zeros((u,), jnp.int32), cfg=cfg)
  return expand_rows(state, src, keys, max_new, cache.table, tokens.shape[1]), hidden


def expand_cache(cache: KVCache, src: jax.Array, table: jax.Array, prompt_slots: int) -> KVCache:
  """A cache of U freshly prefilled prompts -> B rows (row i: prompt src[i], < 0 empty) with
  page tables `table` [B, R]: each prompt's pages (its first `prompt_slots` slots; a page a
  row shares with the first, pages.share_prompts, is already there) copied from
  its first row to the others, lengths taken from the prompt."""
  src_tables, copy_to = shared_tables(table, src, cache.table.shape[0])
  n = pages_for(prompt_slots, cache.page_size)
  copy_from = jnp.take(src_tables, jnp.maximum(src, 0), axis=0)
  return copy_pages(cache, copy_to, copy_from, n).replace(
      table=table, lengths=jnp.where(src >= 0, jnp.take(cache.lengths, jnp.maximum(src, 0)), 0))


def expand_rows(state, src: jax.Array, keys: jax.Array, max_new: jax.Array, table: jax.Array,
                prompt_slots: int):
  """A freshly prefilled state of U distinct prompts -> B rows: row i takes prompt src[i]'s
  rows (src[i] < 0: an empty slot) with its own key and budget (keys [B, 2], max_new [B]) and
  page table (table [B, R]; its prompt's pages, the first `prompt_slots` slots, are copied
  from the prompt's first row). Nothing is sampled at prefill (each row draws its first token
  from its own key), so the rows are what prefilling the B prompts gives. DecodeState, or a
  state wrapping one (`.base`) whose drafter cache (`.dcache`, same tables) is expanded too."""
  valid = src >= 0
  expand = lambda c: expand_cache(c, src, table, prompt_slots)
  rows = map_rows(lambda x: jnp.take(x, jnp.maximum(src, 0), axis=0), state)
  base = rows if isinstance(rows, DecodeState) else rows.base
  old = state if isinstance(state, DecodeState) else state.base
  max_new = max_new.astype(jnp.int32)
  base = base.replace(
      cache=expand(old.cache), keys=keys, max_new=max_new,
      num_generated=jnp.zeros_like(max_new), done=~valid | (max_new <= 0),
      stopped=jnp.zeros_like(valid))
  if isinstance(rows, DecodeState):
    return base
  return rows.replace(base=base, dcache=expand(state.dcache))


def step_keys(keys: jax.Array, num_generated: jax.Array) -> jax.Array:
  """Per-row key for the row's `num_generated`-th token: independent of batch layout."""
  return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(
      keys, num_generated)


def decode_chunk(params: Params, state: DecodeState, temperature: jax.Array | None = None, *,
                 cfg: ModelConfig, sp: SamplingParams, stop_tokens: tuple[int, ...], chunk: int,
                 capture_hidden: bool, kv_len: int | None = None, early_exit: bool = True,
                 unroll: int = 1) -> tuple[DecodeState, ChunkOutput]:
  """Up to `chunk` plain decode steps; exits early once every row is done (early_exit; else
  exactly `chunk` steps, finished rows masked: a loop of known trip count, whose condition
  the device need not send to the host every step). unroll: steps per loop iteration (it
  divides `chunk`, or is reduced to a divisor). kv_len: the
  attention window (static, None: the whole cache); it must hold every live row's committed
  length + `chunk` (`chunk_reach`), or those rows' tokens change. temperature: a scalar
  argument replacing sp's (the engine passes `sampling.plain_variant(sp)` as `sp`: greedy and
  sampled requests share the executable)."""
  b, d = state.hidden.shape
  stop = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
  bufs = ChunkOutput(
      tokens=jnp.zeros((b, chunk), jnp.int32), logprobs=jnp.zeros((b, chunk), jnp.float32),
      hidden=jnp.zeros((b, chunk, d), state.hidden.dtype) if capture_hidden else None,
      valid=jnp.zeros((b, chunk), jnp.bool_), steps=jnp.int32(0))

  unroll = max(u for u in range(1, max(1, min(unroll, chunk)) + 1) if chunk % u == 0)

  def cond(carry):
    state, _, i = carry
    return (i < chunk) & ~jnp.all(state.done)

  def step(carry):
    state, bufs, i = carry
    active = ~state.done
    logits = compute_logits(params, state.hidden, cfg)
    tok, logp = sample_tokens(step_keys(state.keys, state.num_generated), logits, sp,
                               temperature)
    bufs = bufs._replace(
        tokens=bufs.tokens.at[:, i].set(tok), logprobs=bufs.logprobs.at[:, i].set(logp),
        hidden=None if bufs.hidden is None else bufs.hidden.at[:, i].set(state.hidden),
        valid=bufs.valid.at[:, i].set(active), steps=i + 1)
    num_generated = state.num_generated + active
    is_stop = jnp.isin(tok, stop) & active
    done = state.done | is_stop | (num_generated >= state.max_new)
    lengths = state.cache.lengths
    out = forward(params, tok[:, None], lengths[:, None], cfg=cfg, cache=state.cache,
                  return_logits=False, kv_len=kv_len, live=active)
    state = state.replace(
        cache=out.cache.replace(lengths=lengths + active),
        hidden=jnp.where(active[:, None], out.hidden[:, 0], state.hidden),
        num_generated=num_generated, done=done, stopped=state.stopped | is_stop)
    return state, bufs, i + 1

  def body(carry):
    for _ in range(unroll):
      carry = step(carry)
    return carry

  if early_exit:
    state, bufs, _ = jax.lax.while_loop(cond, body, (state, bufs, jnp.int32(0)))
  else:
    state, bufs, _ = jax.lax.fori_loop(0, chunk // unroll, lambda _, c: body(c),
                                       (state, bufs, jnp.int32(0)))
  return state, bufs


def extend(params: Params, state: DecodeState, tokens: jax.Array, counts: jax.Array,
           generated: jax.Array, *, cfg: ModelConfig) -> tuple[DecodeState, jax.Array, jax.Array]:
  """The target consumes tokens of its rows' text it has not yet (`Replica._resume`: a
  preempted row's response so far after its prompt's prefill; an adopted row's prompt past
  the pages it shares, `adopt`): tokens [B, T], the first counts[b] of row b valid (0: the
  row is left as it is), of which generated[b] are response tokens; one forward over the
  chunk at the rows' next slots, attending to their committed text. Returns (state, hidden
  [B, T, D], valid [B, T]): the state as decoding those tokens would have left it (lengths
  advanced by counts, num_generated by generated, `hidden` the last token's), and the hidden
  state that produced each token ([0] the state's own), the pairs the drafter's `track`
  consumes."""
  t = tokens.shape[1]
  lengths = state.cache.lengths
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  valid = jnp.arange(t)[None, :] < counts[:, None]
  out = forward(params, tokens, positions, cfg=cfg, cache=state.cache, return_logits=False,
                live=valid)
  last = jnp.clip(counts - 1, 0, t - 1)
  at_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
  produced_by = jnp.concatenate([state.hidden[:, None].astype(out.hidden.dtype),
                                 out.hidden[:, :-1]], axis=1)
  state = state.replace(
      cache=out.cache.replace(lengths=lengths + counts),
      hidden=jnp.where((counts > 0)[:, None], at_last, state.hidden),
      num_generated=state.num_generated + generated)
  return state, produced_by, valid


def adopt(cache: KVCache, start: jax.Array, keys: jax.Array, max_new: jax.Array, d: int,
          dtype) -> DecodeState:
  """New rows whose first start[b] slots are pages another row of their prompt holds
  (pages.PageAllocator.share: a GRPO group's prompt, admitted apart from its siblings): the
  state with those slots committed and nothing else (`extend` feeds the rest of the prompt,
  whose last hidden state draws the first token). cache: the pools and these rows' tables."""
  b = start.shape[0]
  return DecodeState(
      cache=cache.replace(lengths=start.astype(jnp.int32)), hidden=jnp.zeros((b, d), dtype),
      keys=keys, num_generated=jnp.zeros((b,), jnp.int32), max_new=max_new.astype(jnp.int32),
      done=(start <= 0) | (max_new <= 0), stopped=jnp.zeros((b,), jnp.bool_))


def chunk_reach(chunk: int) -> int:
  """Cache slots past a row's committed length that a `decode_chunk` of `chunk` steps can
  attend to: step i writes and reads slot n + i."""
  return chunk


# ----------------------------------------------------------------------------- batch re-layout
def map_rows(fn: Callable[[Any], Any], state):
  """fn over every batch-major leaf of a decode state (DecodeState, or a state wrapping one
  as `.base` with a drafter cache `.dcache`): everything but the page pools, which are the
  replica's, not a row's."""
  if isinstance(state, KVCache):
    return state.replace(table=fn(state.table), lengths=fn(state.lengths))
  if isinstance(state, DecodeState):
    return jax.tree.map(fn, state.replace(cache=None)).replace(cache=map_rows(fn, state.cache))
  rest = jax.tree.map(fn, state.replace(base=None, dcache=None))
  return rest.replace(base=map_rows(fn, state.base), dcache=map_rows(fn, state.dcache))


def pools(state) -> tuple[KVCache, KVCache | None]:
  """The state's page pools (as KVCaches without rows): the target's, and the drafter's of a
  speculative state (None for a DecodeState)."""
  strip = lambda c: c.replace(table=c.table[:0], lengths=c.lengths[:0])
  if isinstance(state, DecodeState):
    return strip(state.cache), None
  return strip(state.base.cache), strip(state.dcache)


def with_pools(state, target: KVCache, drafter: KVCache | None = None):
  """The state with these page pools (its rows' tables and lengths kept)."""
  put = lambda c, p: c.replace(k=p.k, v=p.v)
  if isinstance(state, DecodeState):
    return state.replace(cache=put(state.cache, target))
  return state.replace(base=state.base.replace(cache=put(state.base.cache, target)),
                       dcache=put(state.dcache, drafter))


def without_pools(state):
  """The state without its page pools (k/v empty): what a call that receives the pools
  separately (donated) takes, e.g. `put_rows` after a refill's prefill wrote into them."""
  drop = lambda c: c.replace(k=(), v=())
  if isinstance(state, DecodeState):
    return state.replace(cache=drop(state.cache))
  return state.replace(base=state.base.replace(cache=drop(state.base.cache)),
                       dcache=drop(state.dcache))


def set_tables(state, table: jax.Array):
  """The state with page tables `table` [B, R] (the host allocator's, before every chunk:
  a row without pages, empty or finished, writes nothing)."""
  if isinstance(state, DecodeState):
    return state.replace(cache=state.cache.replace(table=table))
  return state.replace(base=state.base.replace(cache=state.base.cache.replace(table=table)),
                       dcache=state.dcache.replace(table=table))


def take_rows(state, idx: jax.Array, valid: jax.Array):
  """Gathers rows idx [B'] into a new state of batch B' (compaction / growth); rows with
  valid=False become empty (done) slots. Page tables move with their rows; k/v stay where
  they are. Works for DecodeState and states wrapping one (`.base`, e.g. the speculative
  state)."""
  new = map_rows(lambda x: jnp.take(x, idx, axis=0), state)
  if isinstance(new, DecodeState):
    return new.replace(done=new.done | ~valid)
  return new.replace(base=new.base.replace(done=new.base.done | ~valid))


def put_rows(state, rows, slots: jax.Array):
  """Writes `rows` (batch R, prefilled into `state`'s pools: its pools are the newer) into
  `state` at slots [R] (refilling finished slots)."""
  new = _zip_rows(lambda x, y: x.at[slots].set(y, mode="drop"), state, rows)
  return with_pools(new, *pools(rows))


def _zip_rows(fn, state, rows):
  """fn(x, y) over the batch-major leaves of two states of the same structure."""
  a, b = state, rows
  if isinstance(a, DecodeState):
    out = jax.tree.map(fn, a.replace(cache=None), b.replace(cache=None))
    return out.replace(cache=a.cache.replace(table=fn(a.cache.table, b.cache.table),
                                             lengths=fn(a.cache.lengths, b.cache.lengths)))
  out = jax.tree.map(fn, a.replace(base=None, dcache=None), b.replace(base=None, dcache=None))
  cache = lambda x, y: x.replace(table=fn(x.table, y.table), lengths=fn(x.lengths, y.lengths))
  return out.replace(base=_zip_rows(fn, a.base, b.base), dcache=cache(a.dcache, b.dcache))
