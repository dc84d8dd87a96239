"""One model replica on its devices: its weights (in the replica layout: the compute dtype,
layers unstacked, projections fused where that pays, `to_replica_layout`), its paged KV pools
(`KVPages`, pages.py), its executables (`ExecutableCache`, executables.py: each (function,
bucket) compiled once, ahead of time, with its compile time and memory recorded; which
speculative ones exist and when they compile is the `CompilePlan`'s, compile_plan.py), and
the device calls a chunk makes: a prefill, the scheduler's layout operations (resize, refill),
speculation's switch-off, one chunk of decoding and its host sync.

`Replica` is the device seam of the engine (engine.py's `Engine` is a Replica with the chunk
loop on top): the loop touches devices and time only through `_call`, `_apply`, `_switch_off`,
`_decode`, `_sync`, `kv`, `exes`, `compiles` and `clock`, and the cluster simulator
(tlt_jax/plan/sim_engine.py) runs the same loop on a simulated device and clock by replacing
them. The calls take the engine's record of the `generate` call they serve (engine.py's
`Call`: its sampling, key, scheduler, the rows' outputs, the compile plan's view).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.models import KVCache, ModelConfig, Params, replica_layout
from tlt_jax.rollout import decode
from tlt_jax.rollout.compile_plan import CompilePlan
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.executables import CompileRecord, ExecutableCache
from tlt_jax.rollout.history_chunk import history_chunk
from tlt_jax.rollout.pages import KVPages, share_prompts
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.rollout.prefill import prefill_arrays, resume_chunks, run_prefill, to_feed
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import plain_variant
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize
from tlt_jax.sharding import make_mesh, tree_shardings

# the replica layout of params in any layout (a learner's `rollout_policy`: LoRA adapters
# merged in), in the compute dtype, computed where the params live
_to_replica = jax.jit(replica_layout, static_argnames=("cfg", "fused", "dtype"))


def replica_shardings(params: Params, cfg: ModelConfig, fused: bool, mesh: Mesh) -> Any:
  """The replica layout's shardings on `mesh` (params: any layout, or its shapes)."""
  return tree_shardings(jax.eval_shape(functools.partial(replica_layout, cfg=cfg, fused=fused),
                                       params), mesh)


def to_replica_layout(params: Params, cfg: ModelConfig, fused: bool, shardings: Any) -> Params:
  """Params in any layout (the learner's) -> the replica layout on `shardings`: cast and
  unstacked (fused) where they live (a bf16 replica of f32 master weights moves half the
  bytes), then resharded. Always a copy: the learner donates its params to its next update."""
  return jax.device_put(_to_replica(params, cfg=cfg, fused=fused, dtype=cfg.compute_dtype),
                        shardings, may_alias=False)


def to_replica_program(cfg: ModelConfig, fused: bool, shardings: Any
                       ) -> Callable[[Params], Params]:
  """params on the devices `shardings` spans -> the replica layout on `shardings` in ONE
  program (new buffers, an input passed through unchanged too: tests/test_sharding.py). For
  the learner's params to the store's rollout layout across processes (run.py): a device_put
  of the tree reshards leaf by leaf, a cross-process program each, and two CPU processes
  (gloo) hung in one of those in 6 of 7 runs with jax 0.11.2 (none in 7 with the one
  program). run.py syncs with it wherever the learner and the rollouts span the same devices:
  no intermediate copy in the learner's layout (the memory plan's sync phase)."""
  return jax.jit(functools.partial(replica_layout, cfg=cfg, fused=fused, dtype=cfg.compute_dtype),
                 out_shardings=shardings)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prompt_forward(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
  from tlt_jax.models import forward
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return forward(params, tokens, pos, cfg=cfg, return_logits=False).hidden


class Replica:
  """One model replica on its devices; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               mesh: Mesh | None = None, drafter_params: Params | None = None):
    self.mesh = mesh if mesh is not None else make_mesh((1, 1, 1), jax.devices()[:1])
    # paged attention resolved for this backend and replica, once (EngineConfig.
    # resolve_attention: on a GPU the kernel's start-up check); `attention` says which
    engine_cfg, self.attention = engine_cfg.resolve_attention(
        cfg, self.mesh.shape.get("tensor", 1))
    if engine_cfg.paged_attention:  # the target's and the drafter's (its cfg is the target's)
      cfg = cfg.replace(cache_attention="paged")
    self.cfg, self.ecfg = cfg, engine_cfg
    self.fused = engine_cfg.fuses()  # the replica's projections fused (EngineConfig)
    self._param_shardings = replica_shardings(params, cfg, self.fused, self.mesh)
    self._replicated = NamedSharding(self.mesh, PartitionSpec())
    self.params = self.drafter_params = None
    self.set_params(params)
    if drafter_params is not None:
      self.set_drafter_params(drafter_params)
    elif engine_cfg.spec is not None:
      raise ValueError("EngineConfig.spec is set but the engine has no drafter_params")
    self._ran: set[int] = set()  # ids of the arm executables run so far (first runs)
    self.kv = KVPages(cfg, self.mesh, self._replicated, num_pages=engine_cfg.pool_pages,
                      page_size=engine_cfg.page_size, row_pages=engine_cfg.row_pages)
    self.exes = ExecutableCache()
    self.compiles = CompilePlan(cfg, engine_cfg, self.exes, self._replicated)

  # ---------------------------------------------------------------------------------- weights
  def set_params(self, params: Params) -> None:
    """New actor weights (after an RL update). Params already in the rollout layout (the
    coordinator's `to_rollout`: compute dtype, layers unstacked, this engine's devices hold
    its slices) are taken as they are, without a copy; others are cast to the compute dtype
    and unstacked where they are (a bf16 replica of f32 master weights moves and keeps half
    the bytes), then copied onto this engine's layout (a copy: the learner donates its params
    to its next update, which must not delete these; on a learner device the two layouts can
    coincide)."""
    from tlt_jax.sharding import local_view
    dt = self.cfg.compute_dtype
    layers = params["layers"]
    if isinstance(layers, (tuple, list)) and ("qkv" in layers[0]) == self.fused:
      view = local_view(params, self._param_shardings)
      if view is not None and all(x.dtype == dt for x in jax.tree.leaves(view)):
        self.params = view
        return
    self.params = to_replica_layout(params, self.cfg, self.fused, self._param_shardings)

  def release_params(self) -> None:
    """Drops this engine's copy of the actor and its page pools (after its rollout: the
    learner's phases get the memory back; the next `set_params` brings the updated weights).
    Background compiles go on meanwhile: they compile from the weights' shapes (`PlanCall`),
    never read them."""
    self.params = None
    self.kv.drop()

  def set_drafter_params(self, dparams: Params) -> None:
    """New drafter weights (after spot training) on this engine's mesh: a view of the
    store's rollout layout where this engine's devices hold its slices, else a copy."""
    from tlt_jax.sharding import local_view
    shardings = tree_shardings(dparams, self.mesh)
    view = local_view(dparams, shardings)
    self.drafter_params = view if view is not None else jax.device_put(dparams, shardings)

  @property
  def compile_log(self) -> list[CompileRecord]:
    return self.exes.records

  def compile_stats(self) -> dict[str, Any]:
    return self.exes.stats()

  # ------------------------------------------------------------------------- device calls
  # (the device seam: the module docstring)
  clock = staticmethod(time.perf_counter)

  def _sync(self, state):
    """Waits for what was dispatched before the next chunk (its time is the chunk's own)."""
    return jax.block_until_ready(state)

  def _call(self, name: str, variant, fn: Callable, args: tuple, donate=()):
    return self.exes.get(name, variant, fn, args, donate=donate)(*args)

  def prompt_hidden(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The post-norm hidden state of every position of each prompt ([P_i, D], host), by one
    forward of this engine's params over the distinct prompts on its devices (rows padded to
    a power of two, columns to max_prompt_len: a few executables). The drafter's training
    context (tlt_jax/drafter/buffer.py); the prefill does not keep them."""
    keys = list(dict.fromkeys(tuple(int(t) for t in p) for p in prompts))
    tok = np.zeros((1 << (len(keys) - 1).bit_length(), self.ecfg.max_prompt_len), np.int32)
    for i, k in enumerate(keys):
      tok[i, :len(k)] = k
    h = np.asarray(jax.device_get(_prompt_forward(
        self.params, jax.device_put(tok, self._replicated), cfg=self.cfg)))
    by_key = {k: h[i, :len(k)] for i, k in enumerate(keys)}
    return [by_key[tuple(int(t) for t in p)] for p in prompts]

  def _prefill(self, reqs: Sequence[Request], batch: int, c, warm: bool,
               kv: KVCache, dkv: KVCache | None):
    """Prefill of `reqs` into a new state of `batch` rows whose k/v go to the pages the call's
    allocator holds for them in the pools kv (and the drafter's, dkv: warm, a tracked call's,
    whose drafter then consumes the prompts: a SpecState); both pools are donated and come
    back in the state."""
    tokens, lens, src, keys, max_new = prefill_arrays(reqs, batch, c.base_key, self.ecfg)
    if self.ecfg.spec is not None and not warm:  # (its shapes: `CompilePlan.next_call`)
      c.untracked_prefills.setdefault((batch, tokens.shape, src is None),
                                      (batch, tokens, lens, src, keys, max_new))
    if src is not None:  # each prompt prefilled once: its group's rows hold its pages
      share_prompts(c.pages, reqs)
    table = self.kv.table(c.pages, [r.key for r in reqs] + [None] * (batch - len(reqs)))
    cache = kv.replace(table=table, lengths=jnp.zeros((batch,), jnp.int32))
    run = lambda name, variant, fn, args, donate: self._call(  # noqa: E731
        name, variant, fn, args, donate=donate)
    return run_prefill(run, self.cfg, self.ecfg.spec is not None,
                       self.compiles.max_steps(c.plan) if warm else 0, self.params,
                       self.drafter_params, cache,
                       dkv if warm else None, tokens, lens, src, keys, max_new)

  def _apply(self, op, state, c, warm: bool):
    """A scheduler layout operation on the device state (None before the first prefill);
    warm: the state carries the drafter's (a SpecState). Every op donates the state: its
    page pools pass through in place."""
    if isinstance(op, Prefill):
      rows = self._prefill(op.requests, op.bucket, c, warm, self.kv.take(False),
                           self.kv.take(True) if warm else None)
      return self._resume(rows, *to_feed(op.requests, c.outputs), c)
    if isinstance(op, Resize):
      idx, valid = jnp.asarray(op.idx, jnp.int32), jnp.asarray(op.valid)
      return self._call("take_rows", None, decode.take_rows, (state, idx, valid), donate=(0,))
    if isinstance(op, Refill):
      kv, dkv = decode.pools(state)
      if any(r.key in c.adopting for r in op.requests):  # (rows_apart: all of them)
        rows, starts = self._adopt(op.requests, op.bucket, c, warm, kv, dkv)
        rows = self._resume(rows, *to_feed(op.requests, c.outputs, starts), c, adopted=True)
      else:
        rows = self._prefill(op.requests, op.bucket, c, warm, kv, dkv)
        rows = self._resume(rows, *to_feed(op.requests, c.outputs), c)
      # Padding rows of the prefill go to an out-of-range slot and are dropped.
      slots = np.full((op.bucket,), state.batch_size, np.int32)
      slots[:len(op.slots)] = op.slots
      return self._call("put_rows", None, decode.put_rows,
                        (decode.without_pools(state), rows, jnp.asarray(slots)), donate=(0, 1))
    raise TypeError(f"unknown layout operation {op!r}")

  def _adopt(self, reqs: Sequence[Request], batch: int, c, warm: bool, kv: KVCache,
             dkv: KVCache | None):
    """New rows for `reqs`, each of which a live row of its prompt leads (`c.adopting`, the
    call's `rows_apart`): each shares that row's pages wholly before its prompt's last slot
    (pages.PageAllocator.share) and starts with them committed (`decode.adopt`; warm: a
    tracked call's SpecState, `spec_state.adopt`), with nothing prefilled: `_resume` feeds
    the rest of the prompt. Returns (rows, each row's shared slots)."""
    from tlt_jax.rollout import spec_state
    starts = c.adopt(reqs)
    _, _, _, keys, max_new = prefill_arrays(reqs, batch, c.base_key, self.ecfg)
    table = self.kv.table(c.pages, [r.key for r in reqs] + [None] * (batch - len(reqs)))
    start = np.zeros((batch,), np.int32)
    start[:len(starts)] = starts
    cache = kv.replace(table=table, lengths=jnp.zeros((batch,), jnp.int32))
    fn = functools.partial(decode.adopt, d=self.cfg.hidden_size,
                           dtype=jnp.dtype(self.cfg.compute_dtype))
    rows = self._call("adopt", None, fn, (cache, start, keys, max_new), donate=(0,))
    if warm:
      fn = functools.partial(spec_state.adopt, max_steps=self.compiles.max_steps(c.plan))
      rows = self._call("adopt_track", None, fn, (rows, dkv), donate=(0, 1))
    return rows, starts

  def _resume(self, rows, texts: Sequence[np.ndarray], prompt: Sequence[int], c,
              adopted: bool = False):
    """New rows take the text their prefill did not give them (`texts`, prefill.py's
    `to_feed`: the first prompt[i] of row i the rest of an adopted row's prompt, then a
    preempted row's tokens so far): the target consumes them a prefill's width at a time
    (`resume_chunks`, `decode.extend`), and in a tracked call (a SpecState) the drafter their
    pairs after it (`spec_state.track`; an adopted row's first pair is in its shared pages
    already), so each row is where decoding had left it (a resumed one goes on from its next
    token, its randomness keyed by the token's index) or where a prefill would have."""
    from tlt_jax.rollout import spec_state
    for j, (tokens, counts, generated) in enumerate(
        resume_chunks(texts, prompt, rows.batch_size, self.ecfg)):
      tracked = not isinstance(rows, decode.DecodeState)
      base = rows.base if tracked else rows
      fn = functools.partial(decode.extend, cfg=self.cfg)
      base, hidden, valid = self._call("extend", None, fn,
                                       (self.params, base, tokens, counts, generated),
                                       donate=(1,))
      if tracked:
        if adopted and j == 0:  # (the pairs one to the left: spec_state.adopt)
          shift = lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)  # noqa: E731
          tokens = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
          hidden, valid = shift(hidden), shift(valid)
        args = (self.params, self.drafter_params, rows.dcache, tokens, hidden, valid)
        dc = self._call("resume_track", None, functools.partial(spec_state.track,
                                                                cfg=self.cfg), args,
                        donate=(2,))
        rows = rows.replace(base=base, dcache=dc)
      else:
        rows = base
    return rows

  def _switch_off(self, state, c):
    """Speculation stops (the gate closed this batch's bucket mid-call): back to the tracked
    state plain decoding would have reached (spec_state.switch_off)."""
    exe = self.compiles.switch_off(c.plan, state)
    return exe(self.params, self.drafter_params, state)

  def _decode(self, state, c, arm: Strategy | None, kv_len: int):
    """One chunk, and its one host sync. arm=None: plain decoding (a DecodeState, or a
    tracked call's SpecState: the same executable on its `base`, then the drafter's
    `track`), returning hidden states to the host if the call captures them; else a strategy
    on the SpecState (whose executables return them if the engine captures at all).
    kv_len: the attention window (CompilePlan.window; the state's caches hold at least that).
    Returns (state, host copies of (ChunkOutput, done [B], stopped [B], [accepted drafts,
    verifications]), whether the arm's executable ran for the first time). A tracked call's
    plain chunk (on a SpecState) also keeps the drafter's cache current (`spec_state.track`)."""
    sp = c.sp
    if arm is not None:
      exe = self.compiles.spec(c.plan, sp, arm, state, kv_len)
      first = self._first_run(exe)
      if arm.history:  # a host loop of steps, the index drafting before each
        rows = {s: c.sched.slots[s].key for s in c.sched.live}
        state, host = history_chunk(exe, self.params, self.drafter_params, state, arm,
                                    c.history, rows, self.ecfg.chunk_size, self._replicated)
        return state, host, first
      state, out, counts = exe(self.params, self.drafter_params, state)
    else:
      # one executable for every temperature (greedy evaluation included): an argument
      static = plain_variant(sp)
      # a speculating engine's chunks keep the hidden states on the device (the drafter's
      # pairs, `track`): one executable for tracked calls and the others
      hidden = c.capture or self.ecfg.spec is not None
      tracked = not isinstance(state, decode.DecodeState)
      base = state.base if tracked else state
      exe = self.compiles.plain(c.plan, static, hidden, kv_len, base)
      self.compiles.plain_ahead(c.plan, static, hidden, kv_len, base)  # (the tail's buckets)
      base, out = exe(self.params, base, np.float32(sp.temperature))
      if tracked:  # the drafter consumes the chunk's pairs
        dc = self.compiles.track(c.plan, state.dcache, out.tokens, out.hidden, out.valid)(
            self.params, self.drafter_params, state.dcache, out.tokens, out.hidden, out.valid)
        state = state.replace(base=base, dcache=dc)
      else:
        state = base
      if not c.capture:  # (the drafter's data: only then to the host)
        out = out._replace(hidden=None)
      counts, first = (0, 0), False
    base = state if isinstance(state, decode.DecodeState) else state.base
    return state, jax.device_get((out, base.done, base.stopped, counts)), first

  def _first_run(self, exe) -> bool:
    """Whether `exe` (an arm's executable) runs for the first time on this engine."""
    first = id(exe) not in self._ran
    self._ran.add(id(exe))
    return first
