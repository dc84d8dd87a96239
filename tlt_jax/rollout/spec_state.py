"""The speculative state: a plainly decoded batch plus the drafter's, and how a batch enters
and leaves it.

`SpecState` wraps the target's DecodeState (`base`) with the drafter's page pools (`dcache`,
read through the target's tables), the pending token a verification emitted but the target
has not consumed yet, and the catch-up buffer of pairs the drafter has yet to consume
(speculative.py's state machine). A batch enters it from its prompts (`prefill`: a target and
a drafter prefill, `prefill_shared` for a GRPO group's shared prompt) or after plain decoding
(`switch_on`: one target forward over each row's sequence so far recomputes the hidden states
the drafter consumes; the target's cache, hidden state and sampling stream are untouched), and
leaves it where the gate closes its bucket mid-call (`switch_off`: the rows' pending tokens go
through the target in one forward step, leaving the DecodeState plain decoding would have
reached).
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
  dcache: KVCache  # drafter k/v (1 layer page pools, the target's tables); lengths = pairs committed
  pending: jax.Array  # [B] int32 emitted token not yet fed to the target
  has_pending: jax.Array  # [B] bool
  catch_tokens: jax.Array  # [B, M] int32 (M = max_steps + 1)
  catch_hidden: jax.Array  # [B, M, D]
  catch_count: jax.Array  # [B] int32

  @property
  def batch_size(self) -> int:
    return self.base.batch_size


def init_spec_state(params: Params, dparams: Params, base: DecodeState, dpool: KVCache,
                    prompt_tokens: jax.Array, prompt_hidden: jax.Array, prompt_lens: jax.Array, *,
                    cfg: ModelConfig, max_steps: int) -> SpecState:
  """After a target prefill: the drafter consumes the prompt's pairs (x_{t+1}, f_t), t < P-1,
  into its page pool `dpool` (`decode.pools`) through the target's page tables."""
  b, p = prompt_tokens.shape
  d = base.hidden.shape[-1]
  dc = dpool.replace(table=base.cache.table, lengths=jnp.zeros((b,), jnp.int32))
  pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
  if p > 1:
    # The cache is empty: attention reads only the window of the P - 1 new pairs.
    _, _, dc = drafter_forward(dparams, params, prompt_tokens[:, 1:], prompt_hidden[:, :-1], pos,
                               cfg=cfg, cache=dc, return_logits=False, kv_len=p - 1)
  dc = dc.replace(lengths=jnp.maximum(prompt_lens - 1, 0).astype(jnp.int32))
  m = max_steps + 1
  return SpecState(base=base, dcache=dc, pending=jnp.zeros((b,), jnp.int32),
                   has_pending=jnp.zeros((b,), jnp.bool_),
                   catch_tokens=jnp.zeros((b, m), jnp.int32),
                   catch_hidden=jnp.zeros((b, m, d), base.hidden.dtype),
                   catch_count=jnp.zeros((b,), jnp.int32))


def prefill(params: Params, dparams: Params, cache: KVCache, dpool: KVCache, tokens: jax.Array,
            prompt_lens: jax.Array, keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig,
            max_steps: int) -> SpecState:
  """Target prefill + drafter prefill over the prompt (one forward each); cache: the target's
  pools with these rows' page tables (`decode.prefill`), dpool: the drafter's pools."""
  base, hidden = decode.prefill_with_hidden(params, cache, tokens, prompt_lens, keys, max_new,
                                           cfg=cfg)
  return init_spec_state(params, dparams, base, dpool, tokens, hidden, prompt_lens, cfg=cfg,
                         max_steps=max_steps)


def prefill_shared(params: Params, dparams: Params, cache: KVCache, dpool: KVCache,
                   tokens: jax.Array, prompt_lens: jax.Array, src: jax.Array, keys: jax.Array,
                   max_new: jax.Array, *, cfg: ModelConfig, max_steps: int) -> SpecState:
  """`prefill` of U distinct prompts expanded to B rows (decode.expand_rows)."""
  u = tokens.shape[0]
  src_tables, _ = decode.shared_tables(cache.table, src, u)
  state = prefill(params, dparams, cache.replace(table=src_tables), dpool, tokens, prompt_lens,
                  jnp.zeros((u, 2), jnp.uint32), jnp.zeros((u,), jnp.int32), cfg=cfg,
                  max_steps=max_steps)
  return decode.expand_rows(state, src, keys, max_new, cache.table, tokens.shape[1])


def switch_on(params: Params, dparams: Params, base: DecodeState, dpool: KVCache,
              tokens: jax.Array, *, cfg: ModelConfig, max_steps: int) -> SpecState:
  """Speculation starts on a batch decoded plainly so far (dpool: the drafter's page pools,
  read through the target's tables). tokens [B, S]: each row's prompt and
  response so far, right-padded (S >= every row's committed length `base.cache.lengths`). One
  causal target forward over them recomputes f_t, then the drafter prefills over the pairs
  (x_{t+1}, f_t), t < n - 1, exactly as after a prompt prefill; the target's own state (cache,
  base.hidden = f_{n-1}, keys) is kept, so what the target samples is unchanged."""
  b, s = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  hidden = forward(params, tokens, positions, cfg=cfg, return_logits=False).hidden
  return init_spec_state(params, dparams, base, dpool, tokens, hidden, base.cache.lengths,
                         cfg=cfg, max_steps=max_steps)


def switch_off(params: Params, base: DecodeState, pending: jax.Array, has_pending: jax.Array, *,
               cfg: ModelConfig) -> DecodeState:
  """Speculation stops on a speculating batch (a SpecState's `base`, `pending`,
  `has_pending`; its drafter state is dropped, its pools kept by the caller): each live row's
  pending token, already emitted and counted, goes through the target, one forward step as
  plain decoding's (every row at its next slot, only those fed committed), so the row's
  cache holds its whole text and `hidden` is the one its next token is sampled from: the
  state plain decoding would have reached. Rows without one (prefilled into the speculative
  state, not stepped yet) keep theirs."""
  feed = has_pending & ~base.done
  lengths = base.cache.lengths
  out = forward(params, pending[:, None], lengths[:, None], cfg=cfg, cache=base.cache,
                return_logits=False)
  return base.replace(cache=out.cache.replace(lengths=lengths + feed),
                      hidden=jnp.where(feed[:, None], out.hidden[:, 0], base.hidden))
