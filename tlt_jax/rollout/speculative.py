"""Speculative decoding steps (EAGLE-style drafter, chain strategy) over a `SpecState`.

State machine, per row (n = target tokens committed, f_t = target hidden after token t):

  * no pending token: the target has processed x_0..x_{n-1}; `base.hidden` = f_{n-1} chooses
    x_n (exactly the plain-decode state).
  * pending token t*: t* was already emitted (sampled from the residual / bonus of the last
    verification) but not yet fed to the target; `base.hidden` produced it.

Drafter pairs (x_{t+1}, f_t) sit at drafter position t (tlt_jax/drafter/model.py). Pairs whose
target hidden states exist but that the drafter has not yet consumed wait in the catch-up
buffer (`catch_*`, at most steps+1 of them: the accepted drafts plus the pending token). One
speculative step:

  1. rows without a pending token sample it from base.hidden (the plain rule) and emit it;
  2. drafter consumes its catch-up pairs (1 forward over [B, steps+1], committed);
  3. drafter proposes `steps` tokens, one drafter forward each (speculative slots, not
     committed: they are overwritten by the true pairs next step);
  4. ONE target forward verifies [pending, d_1..d_K]; `verify_chain` (the Pallas kernel)
     accepts a prefix of a drafts and samples the next token from the residual (or the bonus);
  5. the pending token and the a accepted drafts are committed to the target cache; the new
     pending token is the verifier's next token; the true pairs become the catch-up buffer.

So a step commits a + 1 target tokens and emits up to a + 2 (the new pending one included);
the target is never re-prefilled when speculation switches on, and the drafter is kept warm
during plain decoding by `plain_chunk` (one drafter forward per chunk over its captured pairs).
A strategy with steps=0 is plain decoding inside this state ("SD off" as a bandit arm).
"""

from __future__ import annotations

import dataclasses
import re

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafter.model import drafter_cache, drafter_forward
from tlt_jax.kernels.verify import draw_verify_randomness, verify_chain
from tlt_jax.models import KVCache, ModelConfig, Params, compute_logits, forward
from tlt_jax.rollout import decode
from tlt_jax.rollout.decode import ChunkOutput, DecodeState
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs, sample_tokens

_ARM = re.compile(r"^(\d+)_(\d+)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Strategy:
  """(draft depth, branching, verify tokens); topk=1 is a chain of `steps` drafts."""

  steps: int
  topk: int = 1
  num_verify_tokens: int = 0  # chain: steps + 1

  def __post_init__(self):
    if self.steps < 0 or self.topk < 1:
      raise ValueError(f"strategy {self.name}: steps must be >= 0 and topk >= 1")
    if self.topk > 1:
      raise NotImplementedError(f"strategy {self.name}: tree drafting (topk > 1) is not "
                                "wired into the engine yet; use a chain (topk = 1)")

  @property
  def name(self) -> str:
    return "off" if self.steps == 0 else f"{self.steps}_{self.topk}_{self.verify_tokens}"

  @property
  def verify_tokens(self) -> int:
    return self.num_verify_tokens or self.steps + 1

  @classmethod
  def parse(cls, arm: str) -> "Strategy":
    if arm == "off":
      return cls(steps=0)
    m = _ARM.match(arm)
    if not m:
      raise ValueError(f"strategy {arm!r}: use '<steps>_<topk>_<verify_tokens>' or 'off'")
    return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)))


@flax.struct.dataclass
class SpecState:
  base: DecodeState
  dcache: KVCache  # drafter k/v [1, B, S, K, H]; lengths = drafter pairs committed
  pending: jax.Array  # [B] int32 emitted token not yet fed to the target
  has_pending: jax.Array  # [B] bool
  catch_tokens: jax.Array  # [B, M] int32 (M = max_steps + 1)
  catch_hidden: jax.Array  # [B, M, D]
  catch_count: jax.Array  # [B] int32

  @property
  def batch_size(self) -> int:
    return self.base.batch_size


def _catch_up(dparams, params, state: SpecState, cfg: ModelConfig):
  """Drafter consumes its catch-up pairs; returns (state, g_last [B, D], logits_last [B, V])."""
  dc = state.dcache
  m = state.catch_tokens.shape[1]
  pos = dc.lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]
  g, logits, dc = drafter_forward(dparams, params, state.catch_tokens, state.catch_hidden, pos,
                                  cfg=cfg, cache=dc)
  last = jnp.clip(state.catch_count - 1, 0, m - 1)
  g_last = jnp.take_along_axis(g, last[:, None, None], axis=1)[:, 0]
  lg_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  dc = dc.replace(lengths=dc.lengths + state.catch_count)
  return state.replace(dcache=dc, catch_count=jnp.zeros_like(state.catch_count)), g_last, lg_last


def init_spec_state(params: Params, dparams: Params, base: DecodeState, prompt_tokens: jax.Array,
                    prompt_hidden: jax.Array, prompt_lens: jax.Array, *, cfg: ModelConfig,
                    max_steps: int) -> SpecState:
  """After a target prefill: the drafter consumes the prompt's pairs (x_{t+1}, f_t), t < P-1."""
  b, p = prompt_tokens.shape
  d = base.hidden.shape[-1]
  dc = drafter_cache(cfg, b, base.cache.max_len)
  pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
  if p > 1:
    _, _, dc = drafter_forward(dparams, params, prompt_tokens[:, 1:], prompt_hidden[:, :-1], pos,
                               cfg=cfg, cache=dc, return_logits=False)
  dc = dc.replace(lengths=jnp.maximum(prompt_lens - 1, 0).astype(jnp.int32))
  m = max_steps + 1
  return SpecState(base=base, dcache=dc, pending=jnp.zeros((b,), jnp.int32),
                   has_pending=jnp.zeros((b,), jnp.bool_),
                   catch_tokens=jnp.zeros((b, m), jnp.int32),
                   catch_hidden=jnp.zeros((b, m, d), base.hidden.dtype),
                   catch_count=jnp.zeros((b,), jnp.int32))


def prefill(params: Params, dparams: Params, tokens: jax.Array, prompt_lens: jax.Array,
            keys: jax.Array, max_new: jax.Array, *, cfg: ModelConfig, cache_len: int,
            max_steps: int) -> SpecState:
  """Target prefill + drafter prefill over the prompt (one forward each)."""
  base, hidden = decode.prefill_with_hidden(params, tokens, prompt_lens, keys, max_new, cfg=cfg,
                                           cache_len=cache_len)
  return init_spec_state(params, dparams, base, tokens, hidden, prompt_lens, cfg=cfg,
                         max_steps=max_steps)


def _emit(bufs: ChunkOutput, count: jax.Array, tokens, logprobs, hidden, n_emit):
  """Appends per-row tokens [B, E] (first n_emit[b] valid) at per-row offsets count [B]."""
  b, e = tokens.shape
  width = bufs.tokens.shape[1]
  j = jnp.arange(e)[None, :]
  idx = jnp.where(j < n_emit[:, None], count[:, None] + j, width)  # width -> dropped
  rows = jnp.arange(b)[:, None]
  return bufs._replace(
      tokens=bufs.tokens.at[rows, idx].set(tokens, mode="drop"),
      logprobs=bufs.logprobs.at[rows, idx].set(logprobs, mode="drop"),
      hidden=None if bufs.hidden is None else bufs.hidden.at[rows, idx].set(hidden, mode="drop"),
      valid=bufs.valid.at[rows, idx].set(True, mode="drop"))


def _truncate(tokens, n_cand, stop, room):
  """Emission count: the first n_cand candidates, cut after the first stop token and to the
  row's remaining budget `room`. Returns (n_emit, hit_stop)."""
  e = tokens.shape[1]
  j = jnp.arange(e)[None, :]
  is_stop = jnp.isin(tokens, stop) & (j < n_cand[:, None])
  first_stop = jnp.min(jnp.where(is_stop, j, e), axis=1)
  n = jnp.minimum(jnp.minimum(n_cand, first_stop + 1), room)
  return n, (first_stop < n)


def spec_step(params, dparams, state: SpecState, bufs: ChunkOutput, count, *, cfg: ModelConfig,
              sp: SamplingParams, stop, strategy: Strategy, use_kernel: bool):
  """One draft -> verify -> accept step (see the module docstring). count [B]: tokens emitted
  into bufs so far this chunk."""
  base = state.base
  b = base.batch_size
  k = strategy.steps
  active = ~base.done
  # 1. rows without a pending token sample it from the target's current distribution.
  keys = decode.step_keys(base.keys, base.num_generated)
  tok0, logp0 = sample_tokens(keys, compute_logits(params, base.hidden, cfg), sp)
  need = active & ~state.has_pending
  n0, stop0 = _truncate(tok0[:, None], need.astype(jnp.int32), stop,
                        base.max_new - base.num_generated)
  bufs = _emit(bufs, count, tok0[:, None], logp0[:, None], base.hidden[:, None], n0)
  count = count + n0
  num_gen = base.num_generated + n0
  done = base.done | stop0 | (num_gen >= base.max_new)
  m = state.catch_tokens.shape[1]
  first_pair = jnp.zeros_like(state.catch_tokens).at[:, 0].set(tok0)
  first_hid = jnp.zeros_like(state.catch_hidden).at[:, 0].set(base.hidden)
  state = state.replace(
      pending=jnp.where(need, tok0, state.pending),
      has_pending=state.has_pending | need,
      catch_tokens=jnp.where(need[:, None], first_pair, state.catch_tokens),
      catch_hidden=jnp.where(need[:, None, None], first_hid, state.catch_hidden),
      catch_count=jnp.where(need, 1, state.catch_count))
  live = active & ~done  # rows that still decode this step
  # 2. drafter catch-up (commits the true pairs).
  state, g, dlogits = _catch_up(dparams, params, state, cfg)
  # 3. draft k tokens.
  step_key = jax.vmap(jax.random.key_data)(keys)
  drafts, draft_lps = [], []
  dc = state.dcache
  for i in range(k):
    dlp = processed_logprobs(dlogits, sp)
    dkeys = jax.vmap(lambda kk: jax.random.fold_in(jax.random.wrap_key_data(kk), 1000 + i))(
        step_key)
    d_i, _ = sample_tokens(dkeys, dlogits, sp)
    drafts.append(d_i)
    draft_lps.append(dlp)
    if i + 1 < k:
      pos = (dc.lengths + i)[:, None]
      g3, dl3, dc = drafter_forward(dparams, params, d_i[:, None], g[:, None], pos, cfg=cfg,
                                    cache=dc.replace(lengths=dc.lengths + i))
      dc = dc.replace(lengths=state.dcache.lengths)  # speculative slots stay uncommitted
      g, dlogits = g3[:, 0], dl3[:, 0]
  state = state.replace(dcache=state.dcache.replace(k=dc.k, v=dc.v))
  # 4. one target forward verifies [pending, d_1..d_k].
  n = base.cache.lengths
  vtoks = jnp.concatenate([state.pending[:, None]] + [d[:, None] for d in drafts], axis=1)
  vpos = n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  out = forward(params, vtoks, vpos, cfg=cfg, cache=base.cache, return_logits=False)
  f = out.hidden  # [B, k+1, D]
  tlp = processed_logprobs(compute_logits(params, f, cfg), sp)  # [B, k+1, V]
  if k:
    dtoks = vtoks[:, 1:]
    ukey = jax.vmap(lambda kk: jax.random.fold_in(jax.random.wrap_key_data(kk), 7))(step_key)
    u, noise = jax.vmap(lambda kk: jax.tree.map(
        lambda x: x[0], draw_verify_randomness(kk, 1, k, tlp.shape[-1])))(ukey)
    dlp_all = None if sp.greedy else jnp.stack(draft_lps, axis=1)
    n_acc, nxt = verify_chain(tlp, dtoks, dlp_all, u, noise, greedy=sp.greedy,
                              use_kernel=use_kernel)
  else:
    ukey = jax.vmap(lambda kk: jax.random.fold_in(jax.random.wrap_key_data(kk), 7))(step_key)
    n_acc = jnp.zeros((b,), jnp.int32)
    nxt, _ = sample_tokens(ukey, compute_logits(params, f[:, 0], cfg), sp)
  # 5. emit accepted drafts + next token (cut at stop tokens / budget), commit.
  cand = jnp.concatenate([vtoks[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, k+1]
  cand = cand.at[jnp.arange(b), n_acc].set(nxt)
  cand_lp = jnp.take_along_axis(tlp, cand[..., None], axis=-1)[..., 0]
  room = jnp.where(live, base.max_new - num_gen, 0)
  n_emit, hit_stop = _truncate(cand, jnp.where(live, n_acc + 1, 0), stop, room)
  bufs = _emit(bufs, count, cand, cand_lp, f, n_emit)
  count = count + n_emit
  num_gen = num_gen + n_emit
  done = done | hit_stop | (num_gen >= base.max_new)
  commit = jnp.where(live, n_acc + 1, 0)
  new_hidden = jnp.take_along_axis(f, n_acc[:, None, None], axis=1)[:, 0]
  base = base.replace(
      cache=out.cache.replace(lengths=n + commit),
      hidden=jnp.where(live[:, None], new_hidden, base.hidden),
      num_generated=num_gen, done=done,
      stopped=base.stopped | (stop0 & need) | hit_stop)
  j = jnp.arange(k + 1)[None, :]
  catch_tok = jnp.where(j < n_acc[:, None], cand, jnp.where(j == n_acc[:, None], nxt[:, None], 0))
  pad = m - (k + 1)
  state = state.replace(
      base=base,
      pending=jnp.where(live, nxt, state.pending),
      has_pending=jnp.where(live, True, state.has_pending),
      catch_tokens=jnp.where(live[:, None], jnp.pad(catch_tok, ((0, 0), (0, pad))),
                             state.catch_tokens),
      catch_hidden=jnp.where(live[:, None, None], jnp.pad(f, ((0, 0), (0, pad), (0, 0))),
                             state.catch_hidden),
      catch_count=jnp.where(live, n_acc + 1, 0))
  return state, bufs, count, jnp.sum(jnp.where(live, n_acc, 0))


def spec_chunk(params: Params, dparams: Params, state: SpecState, *, cfg: ModelConfig,
               sp: SamplingParams, stop_tokens: tuple[int, ...], chunk: int, strategy: Strategy,
               capture_hidden: bool, use_kernel: bool = True
               ) -> tuple[SpecState, ChunkOutput, jax.Array]:
  """Up to `chunk` speculative steps (target forwards). Returns (state, outputs [B, W] with
  W = chunk * (steps + 2), accepted draft tokens in the chunk)."""
  b, d = state.base.hidden.shape
  width = chunk * (strategy.steps + 2)
  stop = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
  bufs = ChunkOutput(
      tokens=jnp.zeros((b, width), jnp.int32), logprobs=jnp.zeros((b, width), jnp.float32),
      hidden=jnp.zeros((b, width, d), state.base.hidden.dtype) if capture_hidden else None,
      valid=jnp.zeros((b, width), jnp.bool_), steps=jnp.int32(0))

  def cond(carry):
    state, _, _, i, _ = carry
    return (i < chunk) & ~jnp.all(state.base.done)

  def body(carry):
    state, bufs, count, i, acc = carry
    state, bufs, count, a = spec_step(params, dparams, state, bufs, count, cfg=cfg, sp=sp,
                                      stop=stop, strategy=strategy, use_kernel=use_kernel)
    return state, bufs._replace(steps=i + 1), count, i + 1, acc + a

  state, bufs, _, _, acc = jax.lax.while_loop(
      cond, body, (state, bufs, jnp.zeros((b,), jnp.int32), jnp.int32(0), jnp.int32(0)))
  return state, bufs, acc


def plain_chunk(params: Params, dparams: Params, state: SpecState, *, cfg: ModelConfig,
                sp: SamplingParams, stop_tokens: tuple[int, ...], chunk: int,
                capture_hidden: bool) -> tuple[SpecState, ChunkOutput]:
  """Plain decoding with the drafter kept warm: after the chunk, the drafter consumes the
  chunk's (token, hidden) pairs in one forward. Requires no pending tokens (speculation, once
  on, stays on; its own 'off' arm is `Strategy(steps=0)`)."""
  base, bufs = decode.decode_chunk(params, state.base, cfg=cfg, sp=sp, stop_tokens=stop_tokens,
                                   chunk=chunk, capture_hidden=True)
  dc = state.dcache
  count = jnp.sum(bufs.valid, axis=1).astype(jnp.int32)
  pos = dc.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
  _, _, dc = drafter_forward(dparams, params, bufs.tokens, bufs.hidden, pos, cfg=cfg, cache=dc,
                             return_logits=False)
  state = state.replace(base=base, dcache=dc.replace(lengths=dc.lengths + count))
  if not capture_hidden:
    bufs = bufs._replace(hidden=None)
  return state, bufs
