"""Speculative decoding steps (EAGLE-style drafter; chains and EAGLE-2 trees) over a `SpecState`.

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
  2. drafter consumes its catch-up pairs (1 forward over [B, steps+1], committed); its last
     output is the distribution of the first draft;
  3. drafts, at speculative drafter slots (not committed: overwritten by the true pairs next
     step). Chain (topk=1): `steps` tokens, one drafter forward each after the first (sampled
     from q when sampling: the chain rule needs q; the argmax when greedy). Tree (topk>1,
     drafts.py's `draft_tree`): an EAGLE-2 expansion, one drafter forward per depth over the topk
     frontier nodes, pruned to the best `verify_tokens` nodes (deterministic drafts);
  4. ONE target forward verifies [pending, drafts] (a tree mask for trees): `verify_chain` /
     `verify_tree` (Pallas kernel or its jnp reference) accepts a path of a drafts and samples
     the next token from the residual (or the bonus);
  5. the pending token and the a accepted drafts are committed to the target cache (a tree's
     accepted nodes sit at scattered chunk slots: their k/v move to n+1..n+a); the new pending
     token is the verifier's next token; the path's true pairs become the catch-up buffer.

So a step commits a + 1 target tokens and emits up to a + 2 (the new pending one included).
How a batch enters the state (the drafter's prefill, `track_prompt`), decodes plainly in it
with the drafter kept current (`track`) and leaves speculation (`switch_off`) is
spec_state.py. A strategy with steps=0 is plain decoding inside
this state ("SD off" as a bandit arm).

External drafts (history arms, `history_step`): steps 2-3 shrink to the drafter's catch-up
(kept, so a later drafter arm drafts from a coherent cache) and the drafts come in as arrays,
a padded tree per row with parent indices (drafts.py's `external_tree`; a chain has one child
per node).
Steps 1, 4 and 5 are the shared `_start` and `_verify_commit`: one target forward with a tree
mask, `verify_tree`'s target-only rule (exact for deterministic drafts: greedy = the longest
matching path; sampling = accept c with probability p(c), else remove c and renormalise), and
the accepted path committed as a drafter tree's is.

Costs (scripts/profile_spec.py): per step, 1 target forward over the verified tokens + 1
drafter catch-up + (steps - 1) drafter forwards. Greedy steps draw no randomness at all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.kernels.verify import kernel_pays, verify_chain, verify_tree
from tlt_jax.kernels.verify.reference import draw_tree_randomness, draw_verify_randomness
from tlt_jax.models import ModelConfig, Params, compute_logits, forward
from tlt_jax.models.kv_cache import move_slots
from tlt_jax.rollout import decode
from tlt_jax.rollout.decode import ChunkOutput
from tlt_jax.rollout.drafts import Tree, draft_chain, draft_tree, external_tree, hybrid_draft
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs, sample_tokens
from tlt_jax.rollout.spec_state import SpecState, catch_up
from tlt_jax.rollout.policies.strategy import Strategy


def _catch_up(dparams, params, state: SpecState, cfg: ModelConfig, kv_len: int | None,
              live=None):
  """Drafter consumes its catch-up pairs; returns (state, g_last [B, D], logits_last [B, V])."""
  return catch_up(dparams, params, state, cfg=cfg, kv_len=kv_len, live=live)


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


class _Start(NamedTuple):
  """What step 1 leaves for the rest of a step."""

  keys: jax.Array  # [B] the rows' keys for this step (verification randomness folds from them)
  need: jax.Array  # [B] bool: the row had no pending token (sampled and emitted in step 1)
  stop0: jax.Array  # [B] bool: that token was a stop token
  num_gen: jax.Array  # [B] int32 tokens generated after step 1
  done: jax.Array  # [B] bool done after step 1
  live: jax.Array  # [B] bool: rows that still decode this step


def _start(params, state: SpecState, bufs: ChunkOutput, count, *, cfg: ModelConfig,
           sp: SamplingParams, stop):
  """Step 1: rows without a pending token sample it from the target's current distribution
  (the plain rule), emit it, and put its pair first in the catch-up buffer."""
  base = state.base
  active = ~base.done
  keys = decode.step_keys(base.keys, base.num_generated)
  tok0, logp0 = sample_tokens(keys, compute_logits(params, base.hidden, cfg), sp)
  need = active & ~state.has_pending
  n0, stop0 = _truncate(tok0[:, None], need.astype(jnp.int32), stop,
                        base.max_new - base.num_generated)
  bufs = _emit(bufs, count, tok0[:, None], logp0[:, None], base.hidden[:, None], n0)
  count = count + n0
  num_gen = base.num_generated + n0
  done = base.done | stop0 | (num_gen >= base.max_new)
  first_pair = jnp.zeros_like(state.catch_tokens).at[:, 0].set(tok0)
  first_hid = jnp.zeros_like(state.catch_hidden).at[:, 0].set(base.hidden)
  state = state.replace(
      pending=jnp.where(need, tok0, state.pending),
      has_pending=state.has_pending | need,
      catch_tokens=jnp.where(need[:, None], first_pair, state.catch_tokens),
      catch_hidden=jnp.where(need[:, None, None], first_hid, state.catch_hidden),
      catch_count=jnp.where(need, 1, state.catch_count))
  return state, bufs, count, _Start(keys, need, stop0, num_gen, done, active & ~done)


def _verify_keys(st: _Start, sp: SamplingParams, k: int):
  """One split per row (drafts 0..k-1, verification k) of a stream apart from step 1's;
  greedy needs none."""
  return None if sp.greedy else jax.vmap(
      lambda kk: jax.random.split(jax.random.fold_in(kk, 1), k + 1))(st.keys)


def _verify_commit(params, state: SpecState, bufs: ChunkOutput, count, st: _Start, vtoks, vpos,
                   *, tree: Tree | None, q, vkey, depth: int, cfg: ModelConfig,
                   sp: SamplingParams, stop, use_kernel: bool | None, kv_len: int | None):
  """Steps 4-5: ONE target forward over the verified tokens vtoks [B, N] (pending first) at
  positions vpos [B, N], verification, emission and commit. tree None: a chain of `depth`
  drafts (N = depth + 1; q [B, depth, V] their drafter distribution when sampling; depth 0 is
  plain decoding); else a tree of depth <= `depth` (deterministic drafts, the target-only
  rule). vkey [B]: the verification's key (None: greedy)."""
  base = state.base
  b = base.batch_size
  k = depth
  n = base.cache.lengths
  rows = jnp.arange(b)
  live, num_gen, done = st.live, st.num_gen, st.done
  m = state.catch_tokens.shape[1]
  path = None  # [B, k+1]: node ids of the verified sequence (0 = pending; None: a chain)
  out = forward(params, vtoks, vpos, cfg=cfg, cache=base.cache,
                attn_mask=None if tree is None else tree.visible, return_logits=False,
                kv_len=kv_len, live=live)
  f = out.hidden  # [B, N, D]
  tlp = processed_logprobs(compute_logits(params, f, cfg), sp)  # [B, N, V]
  if use_kernel is None:  # the engine's GPU default: the kernel where it measured faster
    use_kernel = kernel_pays(tree=tree is not None, greedy=sp.greedy, rows=b)
  if k == 0:
    n_acc = jnp.zeros((b,), jnp.int32)
    nxt = jnp.argmax(tlp[:, 0], axis=-1).astype(jnp.int32) if sp.greedy else (
        jax.vmap(jax.random.categorical)(vkey, tlp[:, 0]).astype(jnp.int32))
  elif tree is None:
    u, noise = (None, None) if sp.greedy else jax.vmap(lambda kk: jax.tree.map(
        lambda x: x[0], draw_verify_randomness(kk, 1, k, tlp.shape[-1])))(vkey)
    n_acc, nxt = verify_chain(tlp, vtoks[:, 1:], q, u, noise, greedy=sp.greedy,
                              use_kernel=use_kernel)
  else:
    u, noise = (None, None) if sp.greedy else jax.vmap(lambda kk: jax.tree.map(
        lambda x: x[0], draw_tree_randomness(kk, 1, vtoks.shape[1], tlp.shape[-1])))(vkey)
    path, n_acc, nxt = verify_tree(tlp, vtoks, tree.children, u, noise, greedy=sp.greedy,
                                   max_depth=k, use_kernel=use_kernel)
    # An accepted node whose chunk slot fell off the end of the cache has no k/v to commit:
    # stop the path before it and make its (accepted, so exactly distributed) token the next
    # one. A prefix of an exact sample, continued from the exact conditional, stays exact.
    j = jnp.arange(k + 1)[None, :]
    fits = (n[:, None] + path < base.cache.max_len) | (j > n_acc[:, None])
    n_fit = jnp.maximum(jnp.argmin(jnp.concatenate([fits, jnp.zeros((b, 1), bool)], axis=1),
                                   axis=1) - 1, 0)  # (the root always fits a live row)
    nxt = jnp.where(n_fit < n_acc, vtoks[rows, path[rows, jnp.minimum(n_fit + 1, k)]], nxt)
    n_acc = jnp.minimum(n_acc, n_fit).astype(jnp.int32)
    path = jnp.where(j <= n_acc[:, None], path, 0)
  # 5. emit accepted drafts + next token (cut at stop tokens / budget), commit.
  on_path = (lambda x: x[:, :k + 1]) if path is None else (
      lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1))
  cand = jnp.concatenate([on_path(vtoks)[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  cand = cand.at[rows, n_acc].set(nxt)  # [B, k+1]
  f_path, tlp_path = on_path(f), on_path(tlp)  # [B, k+1, D], [B, k+1, V]
  cand_lp = jnp.take_along_axis(tlp_path, cand[..., None], axis=-1)[..., 0]
  room = jnp.where(live, base.max_new - num_gen, 0)
  n_emit, hit_stop = _truncate(cand, jnp.where(live, n_acc + 1, 0), stop, room)
  bufs = _emit(bufs, count, cand, cand_lp, f_path, n_emit)
  count = count + n_emit
  num_gen = num_gen + n_emit
  done = done | hit_stop | (num_gen >= base.max_new)
  commit = jnp.where(live, n_acc + 1, 0)
  cache = out.cache
  if path is not None:  # move the accepted nodes' k/v to slots n+1..n+a (src >= dst)
    src, dst = n[:, None] + path[:, 1:], n[:, None] + 1 + jnp.arange(k)[None, :]
    src = jnp.where(jnp.arange(k)[None, :] < n_acc[:, None], src, dst)
    cache = move_slots(cache, src, dst)
  new_hidden = f_path[rows, n_acc]
  base = base.replace(
      cache=cache.replace(lengths=n + commit),
      hidden=jnp.where(live[:, None], new_hidden, base.hidden),
      num_generated=num_gen, done=done,
      stopped=base.stopped | (st.stop0 & st.need) | hit_stop)
  j = jnp.arange(k + 1)[None, :]
  catch_tok = jnp.where(j <= n_acc[:, None], cand, 0)
  pad = m - (k + 1)
  state = state.replace(
      base=base,
      pending=jnp.where(live, nxt, state.pending),
      has_pending=jnp.where(live, True, state.has_pending),
      catch_tokens=jnp.where(live[:, None], jnp.pad(catch_tok, ((0, 0), (0, pad))),
                             state.catch_tokens),
      catch_hidden=jnp.where(live[:, None, None], jnp.pad(f_path, ((0, 0), (0, pad), (0, 0))),
                             state.catch_hidden),
      catch_count=jnp.where(live, n_acc + 1, 0))
  # (accepted drafts, verifications) of the rows that decoded: the acceptance length is
  # (accepted + verifications) / verifications, whatever a stop token cut from the emission.
  return state, bufs, count, jnp.stack([jnp.sum(jnp.where(live, n_acc, 0)), jnp.sum(live)])


def spec_step(params, dparams, state: SpecState, bufs: ChunkOutput, count, *, cfg: ModelConfig,
              sp: SamplingParams, stop, strategy: Strategy, use_kernel: bool | None,
              kv_len: int | None = None):
  """One draft -> verify -> accept step (see the module docstring). count [B]: tokens emitted
  into bufs so far this chunk. kv_len: the attention window of both caches (`spec_chunk`)."""
  k = strategy.steps
  state, bufs, count, st = _start(params, state, bufs, count, cfg=cfg, sp=sp, stop=stop)
  sub = _verify_keys(st, sp, k)
  n = state.base.cache.lengths
  # 2.-3. drafter catch-up and drafts. The catch-up runs for "off" (k = 0) too: it keeps the
  # drafter warm for the other arms.
  state, g, dlogits = _catch_up(dparams, params, state, cfg, kv_len, st.live)
  tree, q = None, None
  if k == 0:
    vtoks, vpos = state.pending[:, None], n[:, None]
  elif strategy.topk == 1:
    drafts, q, dc = draft_chain(dparams, params, state.dcache, g, dlogits, sub, cfg=cfg,
                                 sp=sp, steps=k, kv_len=kv_len, live=st.live)
    vtoks = jnp.concatenate([state.pending[:, None], drafts], axis=1)
    vpos = n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  else:
    tree, dc = draft_tree(dparams, params, state.dcache, g, dlogits, cfg=cfg,
                           strategy=strategy, kv_len=kv_len)
    vtoks = tree.tokens.at[:, 0].set(state.pending)
    vpos = n[:, None] + tree.depth
  if k:
    state = state.replace(dcache=dc)
  # 4.-5. one target forward over [pending, drafts], verification, commit.
  return _verify_commit(params, state, bufs, count, st, vtoks, vpos, tree=tree, q=q,
                        vkey=None if sp.greedy else sub[:, k], depth=k, cfg=cfg, sp=sp,
                        stop=stop, use_kernel=use_kernel, kv_len=kv_len)


_GREEDY = SamplingParams(temperature=0.0)


def history_step(params, dparams, state: SpecState, tokens, parents, *, cfg: ModelConfig,
                 sp: SamplingParams, stop_tokens: tuple[int, ...], strategy: Strategy,
                 capture_hidden: bool, use_kernel: bool | None = None,
                 kv_len: int | None = None) -> tuple[SpecState, ChunkOutput, jax.Array]:
  """One speculative step over EXTERNAL drafts (a history arm: the engine's host loop asks
  its index for every row's draft before each step): tokens, parents [B, verify_tokens - 1]
  (`external_tree`; a row without a match sends only padding and takes a one-token step).
  As `spec_step`, with the drafter's part reduced to its catch-up, which keeps the drafter's
  cache coherent for a later drafter arm. A row that had no pending token drafted from the
  text before the token step 1 samples: its draft is dropped (it takes a one-token step).
  A hybrid arm (`Strategy.hybrid`) also drafts the drafter's argmax chain and verifies both
  chains as one tree (`hybrid_draft`): the drafter extends a history draft that runs out
  and replaces one that is missing or wrong, at the cost of its forwards and a wider
  verification. Returns (state, outputs [B, steps + 2], [accepted drafts, verifications])."""
  if use_kernel is None and jax.default_backend() != "gpu":
    use_kernel = False
  k = strategy.steps
  b, d = state.base.hidden.shape
  stop = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
  width = k + 2
  bufs = ChunkOutput(
      tokens=jnp.zeros((b, width), jnp.int32), logprobs=jnp.zeros((b, width), jnp.float32),
      hidden=jnp.zeros((b, width, d), state.base.hidden.dtype) if capture_hidden else None,
      valid=jnp.zeros((b, width), jnp.bool_), steps=jnp.int32(1))
  count = jnp.zeros((b,), jnp.int32)
  state, bufs, count, st = _start(params, state, bufs, count, cfg=cfg, sp=sp, stop=stop)
  state, g, dlogits = _catch_up(dparams, params, state, cfg, kv_len, st.live)
  use = st.live & ~st.need
  if strategy.hybrid:
    drafts, _, dc = draft_chain(dparams, params, state.dcache, g, dlogits, None, cfg=cfg,
                                 sp=_GREEDY, steps=k, kv_len=kv_len, live=st.live)
    state = state.replace(dcache=dc)
    tokens, parents = hybrid_draft(tokens[:, :k], parents[:, :k], drafts, use)
    use = st.live  # a row whose history draft is stale still has the drafter's
  tree = external_tree(state.pending, tokens, parents, use, depth=k, topk=strategy.topk)
  vkey = None if sp.greedy else _verify_keys(st, sp, k)[:, k]
  state, bufs, _, acc = _verify_commit(
      params, state, bufs, count, st, tree.tokens, state.base.cache.lengths[:, None] + tree.depth,
      tree=tree, q=None, vkey=vkey, depth=k, cfg=cfg, sp=sp, stop=stop, use_kernel=use_kernel,
      kv_len=kv_len)
  return state, bufs, acc


def spec_chunk(params: Params, dparams: Params, state: SpecState, *, cfg: ModelConfig,
               sp: SamplingParams, stop_tokens: tuple[int, ...], chunk: int, strategy: Strategy,
               capture_hidden: bool, use_kernel: bool | None = None, kv_len: int | None = None
               ) -> tuple[SpecState, ChunkOutput, jax.Array]:
  """Up to `chunk` speculative steps (target forwards). Returns (state, outputs [B, W] with
  W = chunk * (steps + 2), [accepted draft tokens, verifications] of the chunk's live rows
  as int32 [2]). use_kernel: the Pallas
  verification kernel, or its jnp reference (same decisions); None: on a GPU the kernel where
  it measured faster (`kernels.verify.kernel_pays`), elsewhere the reference (off-GPU Pallas
  runs in interpret mode, a debugging interpreter slower than the reference).
  kv_len: the attention window of the target's and the drafter's caches (static, None: the
  whole cache); it must hold every live row's committed length + `chunk_reach`."""
  if use_kernel is None and jax.default_backend() != "gpu":
    use_kernel = False
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
                                      stop=stop, strategy=strategy, use_kernel=use_kernel,
                                      kv_len=kv_len)
    return state, bufs._replace(steps=i + 1), count, i + 1, acc + a

  state, bufs, _, _, acc = jax.lax.while_loop(
      cond, body, (state, bufs, jnp.zeros((b,), jnp.int32), jnp.int32(0),
                   jnp.zeros((2,), jnp.int32)))
  return state, bufs, acc


def chunk_reach(strategy: Strategy, chunk: int) -> int:
  """Cache slots past a row's committed length n0 (target and drafter: the drafter's pairs
  never outnumber the target's tokens) that a `spec_chunk` of `chunk` steps can attend to.
  Step i starts at n_i <= n0 + i (steps + 1) committed tokens (a step commits at most its
  drafts + 1); its target forward reads up to slot n_i + N - 1 (N = verify_tokens), the
  drafter's catch-up up to n_i - 1, its chain drafts up to n_i + steps - 2 and its tree levels
  up to n_i + max(steps - 1, 1) topk - 1. A history arm's chunk (the engine's host loop of
  `chunk` `history_step`s) drafts nothing on the drafter (a hybrid's drafter chain stays
  below its verified window): only the target forward reaches past n_i."""
  k = strategy.steps
  width = (strategy.verify_tokens if strategy.history else
           max(strategy.verify_tokens, k, max(k - 1, 1) * strategy.topk if k else 0, 1))
  return (chunk - 1) * (k + 1) + width
