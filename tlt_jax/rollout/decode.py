"""Jittable decode primitives: prefill, a chunk of decode steps, and batch re-layout.

Everything here is a pure function over a `DecodeState` pytree; the host-side engine
(engine.py) decides when to call what. Shapes are fixed per batch-size bucket, so each
(bucket, function) is compiled once and reused: the JAX analogue of CUDA-graph capture.

The state keeps, per row, the hidden state whose logits choose the row's NEXT token. A step
samples from it, records (token, logprob, hidden), then feeds the token to get the next
hidden. So `hidden[j]` returned for response token j is exactly the last-layer (post-norm)
hidden state that produced token j: the (h_t, token_{t+1}) pairs an EAGLE drafter trains on,
with no extra forward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models import KVCache, ModelConfig, Params, compute_logits, forward, init_cache
from tlt_jax.rollout.sampling import SamplingParams, sample_tokens


@flax.struct.dataclass
class DecodeState:
  cache: KVCache  # k/v L x [B, S, K, H]; lengths [B] = committed tokens = next position
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


def prefill(params: Params, tokens: jax.Array, prompt_lens: jax.Array, keys: jax.Array,
            max_new: jax.Array, *, cfg: ModelConfig, cache_len: int) -> DecodeState:
  """tokens [B, P] right-padded prompts, prompt_lens [B] (0 = empty slot) -> state."""
  return prefill_with_hidden(params, tokens, prompt_lens, keys, max_new, cfg=cfg,
                             cache_len=cache_len)[0]


def prefill_with_hidden(params: Params, tokens: jax.Array, prompt_lens: jax.Array,
                        keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig,
                        cache_len: int) -> tuple[DecodeState, jax.Array]:
  """`prefill`, also returning every prompt position's hidden state [B, P, D] (the drafter's
  prefill consumes them; under jit an unused output costs nothing)."""
  b, p = tokens.shape
  cache = init_cache(cfg, b, cache_len)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  out = forward(params, tokens, positions, cfg=cfg, cache=cache, return_logits=False,
                prefill=True)
  last = jnp.clip(prompt_lens - 1, 0, p - 1)
  hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
  empty = prompt_lens <= 0
  state = DecodeState(
      cache=out.cache.replace(lengths=prompt_lens.astype(jnp.int32)),
      hidden=hidden, keys=keys, num_generated=jnp.zeros((b,), jnp.int32),
      max_new=max_new.astype(jnp.int32), done=empty | (max_new <= 0),
      stopped=jnp.zeros((b,), jnp.bool_))
  return state, out.hidden


def prefill_shared(params: Params, tokens: jax.Array, prompt_lens: jax.Array, src: jax.Array,
                   keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig,
                   cache_len: int) -> DecodeState:
  """`prefill` of U distinct prompts (tokens [U, P], prompt_lens [U]) expanded to B rows
  (`expand_rows`): a GRPO group's n responses share one prompt, whose forward runs once."""
  u = tokens.shape[0]
  state = prefill(params, tokens, prompt_lens, jnp.zeros((u, 2), jnp.uint32),
                  jnp.zeros((u,), jnp.int32), cfg=cfg, cache_len=cache_len)
  return expand_rows(state, src, keys, max_new)


def expand_rows(state, src: jax.Array, keys: jax.Array, max_new: jax.Array):
  """A freshly prefilled state of U distinct prompts -> B rows: row i takes prompt src[i]'s
  rows (src[i] < 0: an empty slot) with its own key and budget (keys [B, 2], max_new [B]).
  Nothing is sampled at prefill (each row draws its first token from its own key), so the
  rows are what prefilling the B prompts gives. DecodeState, or a state wrapping one
  (`.base`) whose drafter cache (`.dcache`) is emptied for empty slots."""
  valid = src >= 0
  rows = jax.tree.map(lambda x: jnp.take(x, jnp.maximum(src, 0), axis=0), state)
  base = rows if isinstance(rows, DecodeState) else rows.base
  max_new = max_new.astype(jnp.int32)
  base = base.replace(
      cache=base.cache.replace(lengths=jnp.where(valid, base.cache.lengths, 0)),
      keys=keys, max_new=max_new, num_generated=jnp.zeros_like(max_new),
      done=~valid | (max_new <= 0), stopped=jnp.zeros_like(valid))
  if isinstance(rows, DecodeState):
    return base
  return rows.replace(base=base, dcache=rows.dcache.replace(
      lengths=jnp.where(valid, rows.dcache.lengths, 0)))


def step_keys(keys: jax.Array, num_generated: jax.Array) -> jax.Array:
  """Per-row key for the row's `num_generated`-th token: independent of batch layout."""
  return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(
      keys, num_generated)


def decode_chunk(params: Params, state: DecodeState, *, cfg: ModelConfig, sp: SamplingParams,
                 stop_tokens: tuple[int, ...], chunk: int, capture_hidden: bool,
                 kv_len: int | None = None) -> tuple[DecodeState, ChunkOutput]:
  """Up to `chunk` plain decode steps; exits early once every row is done. kv_len: the
  attention window (static, None: the whole cache); it must hold every live row's committed
  length + `chunk` (`chunk_reach`), or those rows' tokens change."""
  b, d = state.hidden.shape
  stop = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
  bufs = ChunkOutput(
      tokens=jnp.zeros((b, chunk), jnp.int32), logprobs=jnp.zeros((b, chunk), jnp.float32),
      hidden=jnp.zeros((b, chunk, d), state.hidden.dtype) if capture_hidden else None,
      valid=jnp.zeros((b, chunk), jnp.bool_), steps=jnp.int32(0))

  def cond(carry):
    state, _, i = carry
    return (i < chunk) & ~jnp.all(state.done)

  def body(carry):
    state, bufs, i = carry
    active = ~state.done
    logits = compute_logits(params, state.hidden, cfg)
    tok, logp = sample_tokens(step_keys(state.keys, state.num_generated), logits, sp)
    bufs = bufs._replace(
        tokens=bufs.tokens.at[:, i].set(tok), logprobs=bufs.logprobs.at[:, i].set(logp),
        hidden=None if bufs.hidden is None else bufs.hidden.at[:, i].set(state.hidden),
        valid=bufs.valid.at[:, i].set(active), steps=i + 1)
    num_generated = state.num_generated + active
    is_stop = jnp.isin(tok, stop) & active
    done = state.done | is_stop | (num_generated >= state.max_new)
    lengths = state.cache.lengths
    out = forward(params, tok[:, None], lengths[:, None], cfg=cfg, cache=state.cache,
                  return_logits=False, kv_len=kv_len)
    state = state.replace(
        cache=out.cache.replace(lengths=lengths + active),
        hidden=jnp.where(active[:, None], out.hidden[:, 0], state.hidden),
        num_generated=num_generated, done=done, stopped=state.stopped | is_stop)
    return state, bufs, i + 1

  state, bufs, _ = jax.lax.while_loop(cond, body, (state, bufs, jnp.int32(0)))
  return state, bufs


def chunk_reach(chunk: int) -> int:
  """Cache slots past a row's committed length that a `decode_chunk` of `chunk` steps can
  attend to: step i writes and reads slot n + i."""
  return chunk


# ----------------------------------------------------------------------------- batch re-layout
# Every leaf of a decode state (KV caches included: per-layer [B, S, K, H]) is batch-major.
def take_rows(state, idx: jax.Array, valid: jax.Array):
  """Gathers rows idx [B'] into a new state of batch B' (compaction / growth); rows with
  valid=False become empty (done) slots. Works for DecodeState and states wrapping one
  (`.base`, e.g. the speculative state)."""
  new = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), state)
  if isinstance(new, DecodeState):
    return new.replace(done=new.done | ~valid)
  return new.replace(base=new.base.replace(done=new.base.done | ~valid))


def cache_length(state) -> int:
  """Slots of a decode state's KV caches (DecodeState, or a state wrapping one)."""
  return (state if isinstance(state, DecodeState) else state.base).cache.max_len


def grow_cache(state, length: int):
  """The state with its KV caches (a speculative state's drafter cache too) extended to
  `length` slots. The engine allocates a cache as long as its rows reach (`kv_bucket`) and
  grows it when they reach further: a cache allocated at its full capacity costs its first
  touch (1.6 s for 2.3 GB at 8 x 4128 slots of a 189M model on CPU, 0.05 s at 288), more than
  decoding a batch of short responses. The new slots are past every row's length: masked."""
  pad = lambda x: jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
  grow = lambda c: c.replace(k=tuple(map(pad, c.k)), v=tuple(map(pad, c.v)))
  if isinstance(state, DecodeState):
    return state.replace(cache=grow(state.cache))
  return state.replace(base=state.base.replace(cache=grow(state.base.cache)),
                       dcache=grow(state.dcache))


def put_rows(state, rows, slots: jax.Array):
  """Writes `rows` (batch R) into `state` at slots [R] (refilling finished slots)."""
  return jax.tree.map(lambda x, y: x.at[slots].set(y), state, rows)
