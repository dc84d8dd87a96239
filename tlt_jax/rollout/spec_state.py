"""The speculative state: a plainly decoded batch plus the drafter's, and how a batch enters
and leaves it.

`SpecState` wraps the target's DecodeState (`base`) with the drafter's page pools (`dcache`,
read through the target's tables), the pending token a verification emitted but the target
has not consumed yet, and the catch-up buffer of pairs the drafter has yet to consume
(speculative.py's state machine). A call that may speculate (engine.py) holds its batch in
it from the prefill on (`track_prompt`: the drafter consumes the prompts' pairs after the
target's prefill; `prefill` is the two as one function), and decodes plainly on a "tracked"
state (each plain chunk on `base`, then `track`: the drafter consumes the chunk's pairs, the
hidden states the chunk produced anyway), so speculation switches on at any chunk without a
forward over the rows' text, and off where the gate closes the batch's bucket mid-call
(`switch_off`: the drafter's catch-up and the rows' pending tokens consumed, back to a
tracked state).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafter.model import drafter_forward
from tlt_jax.models import KVCache, ModelConfig, Params, forward
from tlt_jax.rollout import decode
from tlt_jax.rollout.decode import DecodeState


@flax.struct.dataclass
class SpecState:
  base: DecodeState
  # drafter k/v (1 layer page pools, the target's tables); lengths = pairs committed
  dcache: KVCache
  pending: jax.Array  # [B] int32 emitted token not yet fed to the target
  has_pending: jax.Array  # [B] bool
  catch_tokens: jax.Array  # [B, M] int32 (M = max_steps + 1)
  catch_hidden: jax.Array  # [B, M, D]
  catch_count: jax.Array  # [B] int32

  @property
  def batch_size(self) -> int:
    return self.base.batch_size


def track_prompt(params: Params, dparams: Params, base: DecodeState, dpool: KVCache,
                 tokens: jax.Array, hidden: jax.Array, prompt_lens: jax.Array,
                 src: jax.Array | None = None, *, cfg: ModelConfig, max_steps: int) -> SpecState:
  """After a target prefill (`decode.prefill_with_hidden` / `prefill_shared_with_hidden`: the
  state `base` and the prompts' hidden states [U, P, D]): the drafter consumes the prompts'
  pairs (x_{t+1}, f_t), t < P - 1, into its page pool `dpool` (`decode.pools`) through the
  rows' page tables; a tracked call's prefill (engine.py). src [B] (row -> its prompt, U < B:
  a group's shared prompt): each prompt once, into its first row's pages, copied to the
  others (`decode.expand_cache`)."""
  u, p = tokens.shape
  b, d = base.hidden.shape
  table = base.cache.table
  if src is not None:
    table, _ = decode.shared_tables(table, src, u)
  dc = dpool.replace(table=table, lengths=jnp.zeros((u,), jnp.int32))
  pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (u, p - 1))
  if p > 1:
    # The cache is empty: attention reads only the window of the P - 1 new pairs.
    _, _, dc = drafter_forward(dparams, params, tokens[:, 1:], hidden[:, :-1], pos,
                               cfg=cfg, cache=dc, return_logits=False, kv_len=p - 1)
  dc = dc.replace(lengths=jnp.maximum(prompt_lens - 1, 0).astype(jnp.int32))
  if src is not None:
    dc = decode.expand_cache(dc, src, base.cache.table, p)
  m = max_steps + 1
  return SpecState(base=base, dcache=dc, pending=jnp.zeros((b,), jnp.int32),
                   has_pending=jnp.zeros((b,), jnp.bool_),
                   catch_tokens=jnp.zeros((b, m), jnp.int32),
                   catch_hidden=jnp.zeros((b, m, d), base.hidden.dtype),
                   catch_count=jnp.zeros((b,), jnp.int32))


def adopt(base: DecodeState, dpool: KVCache, *, max_steps: int) -> SpecState:
  """`decode.adopt`'s rows in a tracked call: the drafter's entries over their first
  base.cache.lengths slots are in the shared pages too (the pair at slot t joins prompt token
  t + 1 with the hidden state at t: the same for every row of the prompt up to its last
  slot), so its cache starts there, one pair ahead of the target's; the first pair `extend`
  makes (the first token fed, with the adopted state's empty hidden) is not the drafter's
  to take (`Replica._resume` drops it)."""
  b, d = base.hidden.shape
  m = max_steps + 1
  return SpecState(base=base, dcache=dpool.replace(table=base.cache.table,
                                                   lengths=base.cache.lengths),
                   pending=jnp.zeros((b,), jnp.int32), has_pending=jnp.zeros((b,), jnp.bool_),
                   catch_tokens=jnp.zeros((b, m), jnp.int32),
                   catch_hidden=jnp.zeros((b, m, d), base.hidden.dtype),
                   catch_count=jnp.zeros((b,), jnp.int32))


def prefill(params: Params, dparams: Params, cache: KVCache, dpool: KVCache, tokens: jax.Array,
            prompt_lens: jax.Array, keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig,
            max_steps: int) -> SpecState:
  """Target prefill + drafter prefill over the prompt (one forward each: the engine's two
  executables as one function); cache: the target's pools with these rows' page tables
  (`decode.prefill`), dpool: the drafter's pools."""
  base, hidden = decode.prefill_with_hidden(params, cache, tokens, prompt_lens, keys, max_new,
                                           cfg=cfg)
  return track_prompt(params, dparams, base, dpool, tokens, hidden, prompt_lens, cfg=cfg,
                      max_steps=max_steps)


def catch_up(dparams: Params, params: Params, state: SpecState, *, cfg: ModelConfig,
             kv_len: int | None = None, logits: bool = True, live: jax.Array | None = None):
  """The drafter consumes its catch-up pairs (one forward over [B, M], committed); returns
  (state, g_last [B, D], logits_last [B, V] | None): its output at each row's last pair.
  live [B] bool: the rows whose outputs are used (None: all; the others read no page)."""
  dc = state.dcache
  m = state.catch_tokens.shape[1]
  pos = dc.lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]
  g, lg, dc = drafter_forward(dparams, params, state.catch_tokens, state.catch_hidden, pos,
                              cfg=cfg, cache=dc, kv_len=kv_len, return_logits=logits,
                              live=live)
  last = jnp.clip(state.catch_count - 1, 0, m - 1)
  at_last = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  dc = dc.replace(lengths=dc.lengths + state.catch_count)
  state = state.replace(dcache=dc, catch_count=jnp.zeros_like(state.catch_count))
  return state, at_last(g), None if lg is None else at_last(lg)


def track(params: Params, dparams: Params, dcache: KVCache, tokens: jax.Array,
          hidden: jax.Array, valid: jax.Array, *, cfg: ModelConfig) -> KVCache:
  """The drafter consumes a plain chunk's pairs (x_{t+1}, f_t): its tokens [B, C] and the
  hidden states that produced them [B, C, D] (`decode.decode_chunk`'s, made anyway), valid
  [B, C] (a row's valid tokens come first), into its cache `dcache` (the state's), in one
  drafter forward over the whole cache's window (one executable per batch bucket). A state
  kept so ("tracked": no pending token, no catch-up) switches on at any chunk without a
  target forward over the rows' text."""
  pos = dcache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  _, _, dc = drafter_forward(dparams, params, tokens, hidden, pos, cfg=cfg, cache=dcache,
                             return_logits=False, live=valid)
  return dc.replace(lengths=dc.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32))


def switch_off(params: Params, dparams: Params, state: SpecState, *, cfg: ModelConfig
               ) -> SpecState:
  """Speculation stops (the gate closed the batch's bucket mid-call): the state goes back to
  a tracked one (`track`'s), which plain decoding would have reached. The drafter
  consumes its catch-up (the pending token's pair among it), then each live row's pending
  token, already emitted and counted, goes through the target, one forward step as plain
  decoding's (every row at its next slot, only those fed committed), so the row's cache
  holds its whole text and `hidden` is the one its next token is sampled from. Rows without
  one (prefilled, not stepped yet) keep theirs."""
  state, _, _ = catch_up(dparams, params, state, cfg=cfg, logits=False,
                         live=state.has_pending & ~state.base.done)
  base = state.base
  feed = state.has_pending & ~base.done
  lengths = base.cache.lengths
  out = forward(params, state.pending[:, None], lengths[:, None], cfg=cfg, cache=base.cache,
                return_logits=False, live=feed)
  base = base.replace(cache=out.cache.replace(lengths=lengths + feed),
                      hidden=jnp.where(feed[:, None], out.hidden[:, 0], base.hidden))
  return state.replace(base=base, has_pending=jnp.zeros_like(state.has_pending))
