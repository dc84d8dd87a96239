"""Host-side rollout engine: continuous batching that follows the long tail.

A `RolloutWorker` owns one model replica (one device, or a tensor-parallel sub-mesh) and
decodes its share of requests in chunks of jitted steps. Between chunks (the only host sync)
it collects finished rows, refills free slots from the queue, and, once the queue is empty,
compacts the live rows into the smallest batch-size bucket that holds them, so 3 stragglers
of a 128-batch decode at bucket 4. Every (function, bucket) executable is compiled once,
ahead of time, and its compile time and memory are recorded. Once speculation is on, a
selector (tlt_jax/rollout/mab.py, e.g. BEG-MAB) picks each chunk's strategy and is rewarded
with the chunk's tokens/s; only the (bucket, strategy) pairs it can choose are compiled, on
first use or all at once by `precompile`.

Hooks for the RL loop and the spot-drafter coordinator: per-chunk metrics, per-request
completion, and the worker going idle, all delivered through `WorkerHooks` callbacks on the
worker's thread. `run_workers` drives several workers concurrently from host threads (JAX
releases the GIL while device code runs).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tlt_jax.models import ModelConfig, Params
from tlt_jax.rollout import decode
from tlt_jax.rollout.mab import FixedSelector, parse_arm  # noqa: F401 (FixedSelector re-exported)
from tlt_jax.rollout.sampling import SamplingParams

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Adaptive speculative decoding: on once the live batch stays <= bs_threshold for
  `patience` consecutive chunk checks (then on for the rest of the generate call)."""

  strategy: str = "4_1_5"  # "<steps>_<topk>_<verify_tokens>" or "off"; fixed arm by default
  bs_threshold: int = 32
  patience: int = 2
  use_kernel: bool | None = None  # Pallas verification kernel vs jnp reference; None: GPU only
  max_steps: int = 0  # catch-up capacity (>= every strategy's steps); 0 -> the strategy's

  def __post_init__(self):
    from tlt_jax.rollout.speculative import Strategy
    Strategy.parse(self.strategy)  # validates
    if self.bs_threshold < 1 or self.patience < 1:
      raise ValueError(f"SpecConfig: bs_threshold={self.bs_threshold} and patience="
                       f"{self.patience} must be >= 1")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch: int = 64  # rows decoded at once by one worker
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes compiled for
  chunk_size: int = 16  # decode steps between host checks (compaction / refill / metrics)
  compaction: bool = True  # shrink to the smallest bucket that holds the live rows
  max_prompt_len: int = 128  # cache capacity is max_prompt_len + max_new_tokens
  max_new_tokens: int = 256
  prompt_bucket: int = 16  # prompts are padded to a multiple of this (fewer prefill compiles)
  capture_hidden: bool = False  # return per-token last-layer hidden states (drafter data)
  stop_tokens: tuple[int, ...] = ()
  spec: SpecConfig | None = None  # speculative decoding (needs drafter params on the worker)

  def __post_init__(self):
    if not self.buckets or sorted(set(self.buckets)) != list(self.buckets):
      raise ValueError(f"EngineConfig.buckets={self.buckets} must be strictly increasing")
    if self.buckets[-1] < self.max_batch:
      raise ValueError(f"EngineConfig.buckets={self.buckets}: the largest bucket must be >= "
                       f"max_batch={self.max_batch}")
    for name in ("max_batch", "chunk_size", "max_prompt_len", "max_new_tokens", "prompt_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")

  @property
  def cache_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  def bucket_for(self, n: int) -> int:
    for b in self.buckets:
      if b >= n:
        return b
    return self.buckets[-1]


@dataclasses.dataclass
class Request:
  prompt_ids: Sequence[int]
  request_id: int = 0  # index of the prompt
  sample_index: int = 0  # which of the n samples of that prompt
  max_new_tokens: int | None = None  # per-request cap (<= EngineConfig.max_new_tokens)


@dataclasses.dataclass
class Result:
  request_id: int
  sample_index: int
  prompt_ids: np.ndarray  # [P]
  response_ids: np.ndarray  # [R] int32, including the stop token when stopped
  logprobs: np.ndarray  # [R] float32 under the processed sampling distribution
  hidden: np.ndarray | None  # [R, D]: hidden[j] is the pre-norm hidden that produced token j
  finish_reason: str  # "stop" | "length"
  worker_id: int = 0
  finish_time: float = 0.0  # seconds since the worker's generate() began

  @property
  def num_tokens(self) -> int:
    return int(self.response_ids.shape[0])


@dataclasses.dataclass
class ChunkMetrics:
  worker_id: int
  bucket: int  # compiled batch size the chunk ran at
  live: int  # rows decoding at the start of the chunk
  tokens: int  # tokens produced in the chunk
  steps: int  # decode steps run (target forwards)
  wall_time: float
  mode: str = "plain"  # "plain" | strategy name when speculative
  accepted: int = 0  # draft tokens accepted (speculative chunks)
  verifications: int = 0  # row-steps verified (speculative chunks): live rows x their steps
  t: float = 0.0  # chunk end, seconds since generate() began

  @property
  def accept_len(self) -> float | None:
    """Tokens per verification (accepted drafts + 1), None for plain chunks."""
    return tokens_per_verification([self])


def tokens_per_verification(chunks) -> float | None:
  """Mean acceptance length over chunks: (accepted drafts + verifications) / verifications
  (each verification commits its accepted drafts + 1 target token); None without any."""
  ver = sum(c.verifications for c in chunks)
  return (sum(c.accepted for c in chunks) + ver) / ver if ver else None


@dataclasses.dataclass
class WorkerHooks:
  on_chunk: Callable[[ChunkMetrics], None] | None = None
  on_result: Callable[[Result], None] | None = None  # a request finished (e.g. start its reward)
  on_idle: Callable[[int, float], None] | None = None  # (worker_id, time) when all are done


@dataclasses.dataclass
class CompileRecord:
  name: str
  batch: int
  seconds: float
  memory_bytes: int | None  # argument + output + temp bytes from memory_analysis(), if given


class RolloutWorker:
  """One model replica decoding its share of requests; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               worker_id: int = 0, mesh: Mesh | None = None, drafter_params: Params | None = None,
               selector: Any = None):
    self.cfg = cfg
    self.ecfg = engine_cfg
    self.worker_id = worker_id
    if mesh is None:
      mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    self.mesh = mesh
    from tlt_jax.sharding import tree_shardings
    self.params = jax.device_put(params, tree_shardings(params, mesh))
    self.drafter_params = None
    if drafter_params is not None:
      self.set_drafter_params(drafter_params)
    elif engine_cfg.spec is not None:
      raise ValueError("EngineConfig.spec is set but the worker has no drafter_params")
    spec = engine_cfg.spec
    self.selector = selector or (FixedSelector(spec.strategy) if spec else None)
    # Pallas verification kernel (GPU by default) or its jnp reference; a kernel that fails to
    # compile falls back to the reference once, with a warning (`verify_path` says which ran).
    self.use_kernel = bool(spec and (spec.use_kernel if spec.use_kernel is not None
                                     else jax.default_backend() == "gpu"))
    self.kernel_error: str | None = None
    self._compiled: dict[Any, Any] = {}
    self.compile_log: list[CompileRecord] = []
    self.chunk_log: list[ChunkMetrics] = []
    self._lock = threading.Lock()

  def set_drafter_params(self, dparams: Params) -> None:
    """New drafter weights (after spot training); placed on this worker's mesh."""
    from tlt_jax.sharding import tree_shardings
    self.drafter_params = jax.device_put(dparams, tree_shardings(dparams, self.mesh))

  def _max_steps(self) -> int:
    from tlt_jax.rollout.speculative import Strategy
    spec = self.ecfg.spec
    arms = getattr(self.selector, "arms", None) or []  # catch-up room for every arm's drafts
    return max([spec.max_steps, Strategy.parse(spec.strategy).steps, 1]
               + [parse_arm(a)[0] for a in arms])

  def set_params(self, params: Params) -> None:
    """New actor weights (after an RL update); resharded onto this worker's layout."""
    self.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, self.params))

  # ------------------------------------------------------------------------ compiled functions
  def _exec(self, name: str, fn: Callable, *args, donate: tuple[int, ...] = ()):
    """AOT-compiles fn for these argument shapes once; returns the compiled executable."""
    sig = (name, tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args)))
    exe = self._compiled.get(sig)
    if exe is None:
      t0 = time.perf_counter()
      # Input shardings are committed (params on this worker's mesh), so no mesh context.
      exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
      mem = None
      try:
        ma = exe.memory_analysis()
        if ma is not None:
          mem = int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes)
      except Exception:  # backends without memory analysis
        mem = None
      # Params (plain dicts, e.g. the drafter's) carry no batch; state leaves are batch-major.
      batched = [a for a in args[1:] if not isinstance(a, dict)]
      batch = max((x.shape[0] for x in jax.tree.leaves(batched) if getattr(x, "ndim", 0)),
                  default=0)
      self.compile_log.append(CompileRecord(name, batch, time.perf_counter() - t0, mem))
      self._compiled[sig] = exe
    return exe

  def _prefill(self, tokens, lens, keys, max_new):
    if self.drafter_params is not None:
      from tlt_jax.rollout import speculative
      fn = functools.partial(speculative.prefill, cfg=self.cfg, cache_len=self.ecfg.cache_len,
                             max_steps=self._max_steps())
      args = (self.params, self.drafter_params, tokens, lens, keys, max_new)
      return self._exec("prefill_spec", fn, *args)(*args)
    fn = functools.partial(decode.prefill, cfg=self.cfg, cache_len=self.ecfg.cache_len)
    return self._exec("prefill", fn, self.params, tokens, lens, keys, max_new)(
        self.params, tokens, lens, keys, max_new)

  def _decode(self, state, sp: SamplingParams, arm: str | None = None):
    """One chunk. arm=None: plain decode (drafter kept warm when present); else a strategy.
    Returns (state, ChunkOutput, [accepted draft tokens, verifications])."""
    ecfg = self.ecfg
    if self.drafter_params is None:
      fn = functools.partial(decode.decode_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             capture_hidden=ecfg.capture_hidden)
      state, out = self._exec(("decode", sp), fn, self.params, state, donate=(1,))(
          self.params, state)
      return state, out, (0, 0)
    from tlt_jax.rollout import speculative
    args = (self.params, self.drafter_params, state)
    if arm is None:
      fn = functools.partial(speculative.plain_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             capture_hidden=ecfg.capture_hidden)
      state, out = self._exec(("plain_warm", sp), fn, *args, donate=(2,))(*args)
      return state, out, (0, 0)
    return self._spec_exec(sp, arm, state)(*args)

  @property
  def verify_path(self) -> str:
    """Which verification ran: "pallas" (the kernel) or "jnp" (its reference)."""
    return "pallas" if self.use_kernel else "jnp"

  def _spec_exec(self, sp: SamplingParams, arm: str, state):
    """The (bucket, arm) executable; state may be abstract (ShapeDtypeStructs, `precompile`)."""
    from tlt_jax.rollout import speculative
    ecfg = self.ecfg

    def compiled(use_kernel):
      fn = functools.partial(speculative.spec_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             strategy=speculative.Strategy.parse(arm),
                             capture_hidden=ecfg.capture_hidden, use_kernel=use_kernel)
      return self._exec(("spec", arm, sp, use_kernel), fn, self.params, self.drafter_params,
                        state, donate=(2,))

    if not self.use_kernel:
      return compiled(False)
    try:
      return compiled(True)
    except Exception as e:  # noqa: BLE001 - any lowering/compile failure of the kernel
      # The kernel is an optimisation with a bit-identical reference: a GPU/Triton version
      # it does not compile on must cost speed, not the run.
      self.use_kernel = False
      self.kernel_error = f"{type(e).__name__}: {e}"[:2000]
      _log.warning("worker %d: the Pallas verification kernel failed to compile for arm %s "
                   "(%s); verifying with the jnp reference from now on (same decisions)",
                   self.worker_id, arm, self.kernel_error.splitlines()[0][:300])
      return compiled(False)

  def _take(self, state, idx, valid):
    return self._exec("take_rows", decode.take_rows, state, idx, valid)(state, idx, valid)

  def _put(self, state, rows, slots):
    return self._exec("put_rows", decode.put_rows, state, rows, slots, donate=(0,))(
        state, rows, slots)

  # ---------------------------------------------------------------------------------- generate
  def _row_key(self, base: jax.Array, req: Request) -> np.ndarray:
    k = jax.random.fold_in(jax.random.fold_in(base, req.request_id), req.sample_index)
    return np.asarray(jax.random.key_data(k))

  def _prefill_requests(self, reqs: list[Request], batch: int, base_key) -> decode.DecodeState:
    ecfg = self.ecfg
    longest = max(len(r.prompt_ids) for r in reqs)
    p = min(-(-longest // ecfg.prompt_bucket) * ecfg.prompt_bucket, ecfg.max_prompt_len)
    tokens = np.zeros((batch, p), np.int32)
    lens = np.zeros((batch,), np.int32)
    keys = np.zeros((batch, 2), np.uint32)
    max_new = np.zeros((batch,), np.int32)
    for i, r in enumerate(reqs):
      tokens[i, :len(r.prompt_ids)] = r.prompt_ids
      lens[i] = len(r.prompt_ids)
      keys[i] = self._row_key(base_key, r)
      max_new[i] = min(r.max_new_tokens or ecfg.max_new_tokens, ecfg.max_new_tokens)
    return self._prefill(jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(keys),
                         jnp.asarray(max_new))

  def validate(self, requests: Sequence[Request]) -> None:
    for r in requests:
      n = len(r.prompt_ids)
      if n == 0:
        raise ValueError(f"request {r.request_id}: empty prompt")
      if n > self.ecfg.max_prompt_len:
        raise ValueError(f"request {r.request_id}: prompt has {n} tokens, more than "
                         f"max_prompt_len={self.ecfg.max_prompt_len}; raise max_prompt_len or "
                         "filter long prompts")
      bad = [t for t in r.prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"request {r.request_id}: token id {bad[0]} is outside the vocabulary "
                         f"[0, {self.cfg.vocab_size})")

  def generate(self, requests: Sequence[Request], sp: SamplingParams, *, seed: int = 0,
               hooks: WorkerHooks | None = None, selector: Any = None) -> list[Result]:
    """Decodes all requests; returns results in completion order. `selector` overrides the
    worker's strategy selector for this call (same arms), e.g. so that evaluation chunks
    never feed the training bandit's reward windows."""
    self.validate(requests)
    selector = selector or self.selector
    hooks = hooks or WorkerHooks()
    ecfg = self.ecfg
    t_start = time.perf_counter()
    base_key = jax.random.key(seed)
    pending = collections.deque(requests)
    results: list[Result] = []
    state = None
    spec_on, below = False, 0  # adaptive switch-on: consecutive checks at/below threshold
    slot_req: list[Request | None] = []
    acc: list[dict[str, list]] = []

    def new_acc():
      return {"tokens": [], "logprobs": [], "hidden": []}

    while pending or any(r is not None for r in slot_req):
      live = [i for i, r in enumerate(slot_req) if r is not None]
      # --- refill free slots / grow the batch from the queue
      if pending and len(live) < ecfg.max_batch:
        if state is None:
          n = min(len(pending), ecfg.max_batch)
          bucket = ecfg.bucket_for(n)
          reqs = [pending.popleft() for _ in range(n)]
          state = self._prefill_requests(reqs, bucket, base_key)
          slot_req = reqs + [None] * (bucket - n)
          acc = [new_acc() for _ in range(bucket)]
        else:
          want = min(len(live) + len(pending), ecfg.max_batch)
          bucket = max(ecfg.bucket_for(want), state.batch_size)
          if bucket != state.batch_size:  # grow: keep rows in place, append empty slots
            idx = np.arange(bucket) % state.batch_size
            valid = np.arange(bucket) < state.batch_size
            state = self._take(state, jnp.asarray(idx), jnp.asarray(valid))
            slot_req += [None] * (bucket - len(slot_req))
            acc += [new_acc() for _ in range(bucket - len(acc))]
          free = [i for i, r in enumerate(slot_req) if r is None]
          # The bucket may exceed max_batch (buckets need only cover it): never go past it.
          n = min(len(free), len(pending), ecfg.max_batch - len(live))
          reqs = [pending.popleft() for _ in range(n)]
          rb = ecfg.bucket_for(n)
          rows = self._prefill_requests(reqs, rb, base_key)
          # Padding rows of the prefill go to an out-of-range slot and are dropped.
          slots = np.full((rb,), state.batch_size, np.int32)
          slots[:n] = free[:n]
          state = self._put(state, rows, jnp.asarray(slots))
          for s, r in zip(free[:n], reqs):
            slot_req[s] = r
            acc[s] = new_acc()
      # --- compaction: the queue is empty and the live rows fit a smaller bucket
      live = [i for i, r in enumerate(slot_req) if r is not None]
      if ecfg.compaction and not pending and live:
        bucket = ecfg.bucket_for(len(live))
        if bucket < state.batch_size:
          idx = np.asarray(live + [live[0]] * (bucket - len(live)), np.int32)
          valid = np.arange(bucket) < len(live)
          state = self._take(state, jnp.asarray(idx), jnp.asarray(valid))
          slot_req = [slot_req[i] for i in live] + [None] * (bucket - len(live))
          acc = [acc[i] for i in live] + [new_acc() for _ in range(bucket - len(live))]
      # --- speculation switches on once the live batch stays small
      spec = ecfg.spec
      if spec is not None and not spec_on:
        below = below + 1 if len(live) <= spec.bs_threshold else 0
        spec_on = below >= spec.patience
      arm = selector.select(len(live)) if spec_on else None
      # --- one chunk of decoding
      compiles = len(self.compile_log)
      t0 = time.perf_counter()
      state, out, spec_counts = self._decode(state, sp, arm)
      base = state if isinstance(state, decode.DecodeState) else state.base
      out, done, stopped, spec_counts = jax.device_get((out, base.done, base.stopped,
                                                          spec_counts))
      dt = time.perf_counter() - t0
      steps = int(out.steps)
      produced = 0
      for s, r in enumerate(slot_req):
        if r is None:
          continue
        v = out.valid[s]
        produced += int(v.sum())
        a = acc[s]
        a["tokens"].append(out.tokens[s][v])
        a["logprobs"].append(out.logprobs[s][v])
        if out.hidden is not None:
          a["hidden"].append(out.hidden[s][v])
        if done[s]:
          res = Result(
              request_id=r.request_id, sample_index=r.sample_index,
              prompt_ids=np.asarray(r.prompt_ids, np.int32),
              response_ids=np.concatenate(a["tokens"]).astype(np.int32),
              logprobs=np.concatenate(a["logprobs"]).astype(np.float32),
              hidden=np.concatenate(a["hidden"]) if a["hidden"] else None,
              finish_reason="stop" if stopped[s] else "length",
              worker_id=self.worker_id, finish_time=time.perf_counter() - t_start)
          results.append(res)
          slot_req[s] = None
          acc[s] = new_acc()
          if hooks.on_result:
            hooks.on_result(res)
      m = ChunkMetrics(worker_id=self.worker_id, bucket=state.batch_size, live=len(live),
                       tokens=produced, steps=steps, wall_time=dt, mode=arm or "plain",
                       accepted=int(spec_counts[0]), verifications=int(spec_counts[1]),
                       t=time.perf_counter() - t_start)
      if arm is not None and len(self.compile_log) == compiles:
        # Reward (DESIGN.md 4) = accepted tokens x batch size / wall time of draft + verify:
        # `produced` sums every live row's emitted tokens (accepted drafts + 1 per step), so
        # this is the batch's tokens/s. "off" (steps=0, plain decoding in the spec state) is
        # measured the same way. A chunk that compiled its executable reports nothing: compile
        # time is not the arm's speed (the arm stays untried and is chosen again).
        selector.update(arm, len(live), produced / max(dt, 1e-9))
      self.chunk_log.append(m)
      if hooks.on_chunk:
        hooks.on_chunk(m)
    if hooks.on_idle:
      hooks.on_idle(self.worker_id, time.perf_counter() - t_start)
    return results

  def compile_stats(self) -> dict[str, Any]:
    mems = [r.memory_bytes for r in self.compile_log if r.memory_bytes is not None]
    return {"executables": len(self.compile_log),
            "compile_seconds": sum(r.seconds for r in self.compile_log),
            "memory_bytes": sum(mems) if mems else None}

  # ------------------------------------------------------- speculative (bucket, arm) executables
  def choosable_pairs(self) -> dict[int, list[str]]:
    """Engine bucket -> the arms the selector can return for a chunk decoded at that bucket.

    Speculation runs only at live sizes <= top = min(bs_threshold, max_batch): it switches on
    at a live size <= bs_threshold, which (when max_batch > bs_threshold) needs the queue to be
    empty, and the live batch never grows after that. With compaction, a chunk at bucket b has
    live size in (previous bucket, b]; without, anything in [1, b]. Engine buckets (compiled
    batch sizes) and the selector's bucket bounds are different grids: this intersects them."""
    spec = self.ecfg.spec
    if spec is None:
      return {}
    top = min(spec.bs_threshold, self.ecfg.max_batch)
    pairs, prev = {}, 0
    for b in self.ecfg.buckets:
      lo = prev + 1 if self.ecfg.compaction else 1
      prev = b
      if lo > top:
        break
      arms = self.selector.choosable(lo, min(b, top))
      if arms:
        pairs[b] = arms
    return pairs

  def precompile(self, sp: SamplingParams, *, all_pairs: bool = False) -> int:
    """AOT-compiles the speculative executable of every choosable (bucket, arm) pair now, instead
    of on first use (the default, lazy; it compiles the same pairs, and only those chosen).
    all_pairs=True compiles every selector arm at every engine bucket (what choosable-only
    saves, measured). Returns the number of new executables.

    States are abstract: shapes and shardings come from one real prefill of dummy rows at the
    largest bucket (shardings are the ones generate() will pass), resized on the batch axis."""
    pairs = self.choosable_pairs()
    if all_pairs and pairs:
      pairs = {b: self.selector.arms for b in self.ecfg.buckets}
    if not pairs:
      return 0
    top = max(pairs)
    dummy = [Request([0], i) for i in range(top)]
    state = self._prefill_requests(dummy, top, jax.random.key(0))

    def resized(b):  # state leaves are batch-major
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype, sharding=x.sharding), state)

    before = len(self._compiled)
    for b, arms in pairs.items():
      abstract = resized(b)
      for arm in arms:
        self._spec_exec(sp, arm, abstract)
    return len(self._compiled) - before

  def compile_report(self) -> dict[str, Any]:
    """Speculative executables compiled so far (count, seconds, memory_analysis bytes) against
    compiling every selector arm at every engine bucket. Uncompiled pairs are estimated as
    params + per-row bytes x batch, the per-row bytes read off that arm's compiled records (any
    arm's when it has none): the batch-independent part of an executable's memory is its params
    arguments, the rest scales with the batch."""
    recs = [r for r in self.compile_log if isinstance(r.name, tuple) and r.name[0] == "spec"]
    fixed = sum(x.nbytes for x in jax.tree.leaves((self.params, self.drafter_params)))
    per_row: dict[str, list[float]] = collections.defaultdict(list)
    have: dict[tuple[str, int], int] = {}
    for r in recs:
      if r.memory_bytes is not None and r.batch:
        per_row[r.name[1]].append((r.memory_bytes - fixed) / r.batch)
        have[(r.name[1], r.batch)] = r.memory_bytes
    anyrow = [v for vs in per_row.values() for v in vs]
    arms = self.selector.arms if self.selector is not None else []
    estimate = None
    if anyrow:
      estimate = 0
      for arm in arms:
        rows = per_row.get(arm) or anyrow
        for b in self.ecfg.buckets:
          estimate += have.get((arm, b), fixed + sum(rows) / len(rows) * b)
    mems = [r.memory_bytes for r in recs if r.memory_bytes is not None]
    secs = [r.seconds for r in recs]
    n_all = len(arms) * len(self.ecfg.buckets)
    return {"compiled": len(recs),
            "compiled_bytes": sum(mems) if mems else None,
            "compile_seconds": sum(secs),
            "choosable_pairs": sum(len(a) for a in self.choosable_pairs().values()),
            "all_pairs": n_all,
            "all_pairs_bytes_estimate": int(estimate) if estimate is not None else None,
            "all_pairs_seconds_estimate": sum(secs) / len(secs) * n_all if secs else None}


def run_workers(workers: Sequence[RolloutWorker], requests: Sequence[Request],
                sp: SamplingParams, *, seed: int = 0, hooks: WorkerHooks | None = None
                ) -> list[Result]:
  """Splits requests over workers (whole prompt groups stay together) and decodes them
  concurrently from host threads. Results are sorted by (request_id, sample_index)."""
  shares: list[list[Request]] = [[] for _ in workers]
  for r in requests:
    shares[r.request_id % len(workers)].append(r)
  outs: list[list[Result]] = [[] for _ in workers]
  errors: list[BaseException] = []

  def work(i):
    try:
      outs[i] = workers[i].generate(shares[i], sp, seed=seed, hooks=hooks)
    except BaseException as e:  # surfaced on the caller's thread below
      errors.append(e)

  if len(workers) == 1:
    work(0)
  else:
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  if errors:
    raise errors[0]
  return sorted((r for o in outs for r in o), key=lambda r: (r.request_id, r.sample_index))
