"""Host-side rollout engine: one model replica decoding its share of requests in chunks.

A `RolloutWorker` owns one model replica (one device, or a tensor-parallel sub-mesh). Its
`generate` is a thin loop: the pure host `Scheduler` (scheduler.py) says which rows to
prefill, refill or compact before each chunk and when speculation switches on; the worker
turns that into device calls through its `ExecutableCache` (executables.py: each
(function, bucket) compiled once, ahead of time, with its compile time and memory recorded),
decodes one chunk of jitted steps (the only host sync), and assembles finished responses.

Reads and memory follow the rows' live lengths, not the cache's capacity
(max_prompt_len + max_new_tokens): each chunk attends over a window of the cache (`kv_len`,
models/transformer.py) picked from the longest live row the host knows of plus what the
chunk can add (`chunk_reach`), on the `length_grid` (prompt_bucket x 2^k); a prefill
allocates its prompts' length and the caches grow as the rows reach further. Executables are
keyed by window and cache length, compiled lazily like batch buckets.

Until speculation switches on, a worker decodes with the executables of a worker without a
drafter; at switch-on `speculative.switch_on` builds the drafter's state from the live rows'
sequences (one target forward over them). Once speculation is on, a selector (mab.py, e.g.
BEG-MAB) picks each chunk's strategy and is rewarded with the chunk's tokens/s; only the
(bucket, strategy) pairs it can choose are compiled, on first use or all at once by
`precompile`. A verification kernel that fails to
compile falls back to its jnp reference (same decisions) once, with a warning.

Hooks (`WorkerHooks`, called on the worker's thread): each chunk's metrics, each finished
response (rewards start at once; the drafter buffer takes its hidden states), and a call
before every chunk (the coordinator pulls newer weights there). Several workers run
concurrently under the coordinator (tlt_jax/coordinator/).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.errors import ConfigError
from tlt_jax.models import ModelConfig, Params, unstack_layers
from tlt_jax.rollout import decode
from tlt_jax.rollout.executables import (CompileRecord, ExecKey, ExecutableCache,  # noqa: F401
                                         background_compiler)
from tlt_jax.rollout.mab import FixedSelector
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import (Prefill, Refill, Resize, Scheduler, bucket_for,
                                       kv_bucket, length_grid)
from tlt_jax.rollout.strategy import Strategy
from tlt_jax.sharding import make_mesh, tree_shardings

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Adaptive speculative decoding: on once the live batch stays <= bs_threshold for
  `patience` consecutive chunk checks (then on for the rest of the generate call)."""

  strategy: str = "4_1_5"  # "<steps>_<topk>_<verify_tokens>" or "off"; fixed arm by default
  bs_threshold: int = 32
  patience: int = 2
  use_kernel: bool | None = None  # Pallas verification kernel vs jnp reference; None: GPU only
  # Compile the speculative executables in a background thread from the first generate on;
  # speculation starts at a bucket only once every arm choosable there is compiled (until
  # then the rows decode plainly): no chunk waits for a compile, the bandit sees no compile
  # time, and on an accelerator host the compiles overlap decoding for free. Off: each
  # executable compiles on first use (speculation from the first generate call).
  background_compile: bool = False
  max_steps: int = 0  # catch-up capacity (>= every strategy's steps); 0 -> the strategies'

  def __post_init__(self):
    try:
      Strategy.parse(self.strategy)
    except ValueError as e:
      raise ConfigError(str(e), "strategy", self.strategy) from None
    if self.bs_threshold < 1:
      raise ConfigError("must be >= 1", "bs_threshold", self.bs_threshold)
    if self.patience < 1:
      raise ConfigError("must be >= 1", "patience", self.patience)
    if self.max_steps < 0:
      raise ConfigError("must be >= 0", "max_steps", self.max_steps)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch: int = 64  # rows decoded at once by one worker
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes compiled for
  chunk_size: int = 16  # decode steps between host checks (compaction / refill / metrics)
  compaction: bool = True  # shrink to the smallest bucket that holds the live rows
  max_prompt_len: int = 128  # cache capacity is max_prompt_len + max_new_tokens
  max_new_tokens: int = 256
  prompt_bucket: int = 16  # prompts are padded to a multiple of this (fewer prefill compiles)
  # return per-token last-layer hidden states (drafter data); with a speculation gate, only
  # while it wants the drafter trained (none on hardware where drafts cannot pay)
  capture_hidden: bool = False
  hidden_keep: int = 0  # > 0: keep only each response's last hidden_keep states (host memory)
  stop_tokens: tuple[int, ...] = ()
  spec: SpecConfig | None = None  # speculative decoding (needs drafter params on the worker)

  def __post_init__(self):
    if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) \
        or self.buckets[0] < 1:
      raise ConfigError("a strictly increasing tuple of batch sizes, e.g. (1, 2, 4, 8)",
                        "buckets", self.buckets)
    if self.max_batch < 1:
      raise ConfigError("must be >= 1", "max_batch", self.max_batch)
    if self.buckets[-1] < self.max_batch:
      raise ConfigError(f"the largest bucket must be >= max_batch ({self.max_batch})",
                        "buckets", self.buckets)
    for name in ("chunk_size", "max_prompt_len", "max_new_tokens", "prompt_bucket"):
      if getattr(self, name) <= 0:
        raise ConfigError("must be > 0", name, getattr(self, name))
    if self.hidden_keep < 0:
      raise ConfigError("must be >= 0 (0 = all)", "hidden_keep", self.hidden_keep)

  @property
  def cache_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  def bucket_for(self, n: int) -> int:
    return bucket_for(self.buckets, n)


@dataclasses.dataclass
class Request:
  prompt_ids: Sequence[int]
  request_id: int = 0  # index of the prompt
  sample_index: int = 0  # which of the n samples of that prompt
  max_new_tokens: int | None = None  # per-request cap (<= EngineConfig.max_new_tokens)

  @property
  def key(self) -> tuple[int, int]:
    return self.request_id, self.sample_index


@dataclasses.dataclass
class Result:
  request_id: int
  sample_index: int
  prompt_ids: np.ndarray  # [P]
  response_ids: np.ndarray  # [R] int32, including the stop token when stopped
  logprobs: np.ndarray  # [R] float32 under the processed sampling distribution
  # [R - hidden_offset, D]: hidden[j - hidden_offset] is the pre-norm hidden that produced
  # response token j (capture_hidden; the first hidden_offset were not kept: hidden_keep)
  hidden: np.ndarray | None
  finish_reason: str  # "stop" | "length"
  worker_id: int = 0
  finish_time: float = 0.0  # seconds since the worker's generate() began
  hidden_offset: int = 0
  spec_start: int | None = None  # first response token decoded with speculation on

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
  compiled: bool = False  # the chunk compiled its executable (its time is not the arm's)

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
  before_chunk: Callable[[], Any] | None = None  # e.g. pull newer weights from the store


class _Output:
  """One request's response so far (host side), hidden states trimmed to `keep`."""

  def __init__(self, keep: int):
    self.tokens: list[np.ndarray] = []
    self.logprobs: list[np.ndarray] = []
    self.hidden: collections.deque = collections.deque()
    self.kept = 0  # hidden states held
    self.length = 0
    self.spec_start: int | None = None
    self._keep = keep

  def append(self, tokens, logprobs, hidden) -> None:
    self.tokens.append(tokens)
    self.logprobs.append(logprobs)
    self.length += len(tokens)
    if hidden is not None:
      self.hidden.append(hidden)
      self.kept += len(hidden)
      while self._keep and self.kept - len(self.hidden[0]) >= self._keep:
        self.kept -= len(self.hidden.popleft())


@functools.partial(jax.jit, static_argnums=1)
def _to_replica(params: Params, dtype) -> Params:
  """The replica layout where the params live: the compute dtype, layers unstacked
  (models.unstack_layers); new buffers (each output keeps its input's sharding)."""
  return unstack_layers(jax.tree.map(lambda x: x.astype(dtype), params))


def to_replica_layout(params: Params, dtype, shardings: Any) -> Params:
  """Params in any layout (the learner's) -> the replica layout on `shardings`: cast and
  unstacked where they live (a bf16 replica of f32 master weights moves half the bytes), then
  resharded. Always a copy: the learner donates its params to its next update."""
  return jax.device_put(_to_replica(params, dtype), shardings, may_alias=False)


def longest_row(sched: Scheduler, outputs: dict) -> int:
  """The longest row in the batch: prompt + response so far, host-side (>= its committed
  cache length: a speculative row's pending token is emitted but not yet committed)."""
  return max((len(req.prompt_ids) + outputs[req.key].length
              for req in sched.slots if req is not None), default=1)


def chunk_reach(arm: str | None, chunk: int) -> int:
  """Cache slots past the longest row's length that a chunk of plain decoding (arm None) or
  of a speculative arm can read."""
  from tlt_jax.rollout import speculative
  return (decode.chunk_reach(chunk) if arm is None
          else speculative.chunk_reach(Strategy.parse(arm), chunk))


def _abstract(tree, length: int | None = None):
  """ShapeDtypeStructs of a pytree of arrays (compiling for it later, on another thread);
  length: of a decode state grown to caches of that many slots (`decode.grow_cache`)."""
  shapes = tree if length is None else jax.eval_shape(
      functools.partial(decode.grow_cache, length=length), tree)
  return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x.sharding),
                      shapes, tree)


class RolloutWorker:
  """One model replica decoding its share of requests; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               worker_id: int = 0, mesh: Mesh | None = None, drafter_params: Params | None = None,
               selector: Any = None, gate: Any = None):
    self.cfg = cfg
    self.ecfg = engine_cfg
    self.worker_id = worker_id
    if mesh is None:
      mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    self.mesh = mesh
    self._param_shardings = tree_shardings(jax.eval_shape(unstack_layers, params), mesh)
    self.params = None
    self.set_params(params)
    self.drafter_params = None
    if drafter_params is not None:
      self.set_drafter_params(drafter_params)
    elif engine_cfg.spec is not None:
      raise ValueError("EngineConfig.spec is set but the worker has no drafter_params")
    spec = engine_cfg.spec
    self.selector = selector or (FixedSelector(spec.strategy) if spec else None)
    # gate.py: which buckets speculation is measured to pay at (None: every choosable one)
    self.gate = gate
    # Pallas verification kernel (GPU by default) or its jnp reference; a kernel that fails to
    # compile falls back to the reference once, with a warning (`verify_path` says which ran).
    self.use_kernel = bool(spec and (spec.use_kernel if spec.use_kernel is not None
                                     else jax.default_backend() == "gpu"))
    self.kernel_error: str | None = None
    self.exes = ExecutableCache()
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self.chunk_log: list[ChunkMetrics] = []
    # background compilation (SpecConfig.background_compile): sampling params -> the
    # (bucket, arm) pairs compiled so far; one compile thread per worker
    self._ready: dict[SamplingParams, set[tuple[int, str]]] = {}
    # (bucket, arm) pairs handed to the compile thread
    self._submitted: dict[SamplingParams, set[tuple[int, str]]] = {}
    self._compiler = None
    self._ready_lock = threading.Lock()
    self._compiling = 0  # background compile jobs pending or running (they use self.params)
    self._switch_submitted: set[tuple[int, int]] = set()  # (bucket, length) queued switch-ons
    self._window_submitted: set[tuple[int, str, int]] = set()  # (bucket, arm, kv_len) queued

  # ---------------------------------------------------------------------------------- weights
  def set_params(self, params: Params) -> None:
    """New actor weights (after an RL update). Params already in the rollout layout (the
    coordinator's `to_rollout`: compute dtype, layers unstacked, this worker's devices hold
    its slices) are taken as they are, without a copy; others are cast to the compute dtype
    and unstacked where they are (a bf16 replica of f32 master weights moves and keeps half
    the bytes), then copied onto this worker's layout (a copy: the learner donates its params
    to its next update, which must not delete these; on a learner device the two layouts can
    coincide)."""
    from tlt_jax.sharding import local_view
    dt = self.cfg.compute_dtype
    if isinstance(params["layers"], (tuple, list)):
      view = local_view(params, self._param_shardings)
      if view is not None and all(x.dtype == dt for x in jax.tree.leaves(view)):
        self.params = view
        return
    self.params = to_replica_layout(params, dt, self._param_shardings)

  def release_params(self) -> bool:
    """Drops this worker's copy of the actor (after its rollout: the learner's phases get the
    memory back; the next `set_params` brings the updated weights). Not while background
    compilation still runs real prefills with them (the first steps): False then."""
    with self._ready_lock:
      if self._compiling:
        return False
      self.params = None
      return True

  def set_drafter_params(self, dparams: Params) -> None:
    """New drafter weights (after spot training) on this worker's mesh: a view of the
    store's rollout layout where this worker's devices hold its slices, else a copy."""
    from tlt_jax.sharding import local_view, tree_shardings
    shardings = tree_shardings(dparams, self.mesh)
    view = local_view(dparams, shardings)
    self.drafter_params = view if view is not None else jax.device_put(dparams, shardings)

  @property
  def compile_log(self) -> list[CompileRecord]:
    return self.exes.records

  def compile_stats(self) -> dict[str, Any]:
    return self.exes.stats()

  @property
  def verify_path(self) -> str:
    """Which verification ran: "pallas" (the kernel) or "jnp" (its reference)."""
    return "pallas" if self.use_kernel else "jnp"

  def _max_steps(self) -> int:
    """Catch-up capacity of the speculative state: room for every arm's drafts."""
    spec = self.ecfg.spec
    arms = getattr(self.selector, "arms", None) or []
    return max([spec.max_steps, Strategy.parse(spec.strategy).steps, 1]
               + [Strategy.parse(a).steps for a in arms])

  # ------------------------------------------------------------------------ compiled functions
  @staticmethod
  def _batch(args) -> int:
    # Params (plain dicts) carry no batch; state leaves and token arrays are batch-major.
    batched = [a for a in args if not isinstance(a, dict)]
    return max((x.shape[0] for x in jax.tree.leaves(batched) if getattr(x, "ndim", 0)),
               default=0)

  def _call(self, name: str, variant, fn: Callable, args: tuple, donate=()):
    exe = self.exes.get(name, variant, fn, args, donate=donate, batch=self._batch(args))
    return exe(*args)

  def _prefill(self, tokens, lens, src, keys, max_new, warm: bool, length: int):
    """Prefill of `tokens` [U, P] into caches of `length` slots; src [B] (row -> its prompt,
    `decode.expand_rows`) when rows share prompts, None when row i is prompt i. warm: with the
    drafter's prefill."""
    from tlt_jax.rollout import speculative
    mod = speculative if warm else decode
    kw = dict(cfg=self.cfg, cache_len=length)
    if warm:
      kw["max_steps"] = self._max_steps()
    params = (self.params, self.drafter_params) if warm else (self.params,)
    name = "prefill_spec" if warm else "prefill"
    if src is None:
      return self._call(name, (None, length), functools.partial(mod.prefill, **kw),
                        params + (tokens, lens, keys, max_new))
    return self._call(name, ("shared", length), functools.partial(mod.prefill_shared, **kw),
                      params + (tokens, lens, src, keys, max_new))

  def _decode(self, state, sp: SamplingParams, arm: str | None = None, capture: bool = False,
              kv_len: int | None = None):
    """One chunk. arm=None: plain decoding (before speculation starts: a DecodeState, the
    executables of a worker without a drafter), returning hidden states if `capture`; else a
    strategy on the SpecState (whose executables return them if the engine captures at all:
    speculative chunks run only where the gate opens). kv_len: the attention window
    (`_kv_window`; None: the state's whole cache). Returns (state, ChunkOutput, [accepted
    draft tokens, verifications])."""
    ecfg = self.ecfg
    kv_len = kv_len or decode.cache_length(state)
    if arm is None:
      fn = functools.partial(decode.decode_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             capture_hidden=capture, kv_len=kv_len)
      state, out = self._call("decode", (sp, capture, kv_len), fn, (self.params, state),
                              donate=(1,))
      return state, out, (0, 0)
    return self._spec_exec(sp, arm, state, kv_len)(self.params, self.drafter_params, state)

  def _kv_window(self, sp: SamplingParams, arm: str | None, longest: int, state) -> int:
    """The attention window of a chunk (plain: arm None) whose longest live row has `longest`
    tokens: the `kv_bucket` holding every slot the chunk can read (`chunk_reach`); the state's
    cache is grown to it first (`_grow`). With background compilation a speculative window
    not compiled yet is queued on the compile thread and the smallest compiled one that holds
    the rows runs instead (the whole cache's is compiled with each bucket's arms): no chunk
    waits for a compile."""
    ecfg = self.ecfg
    kv_len = kv_bucket(longest + chunk_reach(arm, ecfg.chunk_size), ecfg.prompt_bucket,
                       ecfg.cache_len)
    if arm is None or not ecfg.spec.background_compile or self._compiler is None:
      return kv_len
    grown = lambda n: _abstract(state, max(n, decode.cache_length(state)))
    compiled = lambda n: self._spec_key(sp, arm, grown(n), n) in self.exes
    if compiled(kv_len):
      return kv_len
    with self._ready_lock:
      queue = (state.batch_size, arm, kv_len) not in self._window_submitted
      self._window_submitted.add((state.batch_size, arm, kv_len))
    if queue:
      args = (sp, arm, grown(kv_len), kv_len)
      self._compiler.submit(lambda: self._spec_exec(*args))
    return next(n for n in length_grid(ecfg.prompt_bucket, ecfg.cache_len)
                if n >= kv_len and (n == ecfg.cache_len or compiled(n)))

  def _switch_lengths(self) -> list[int]:
    """Sequence lengths switch-on is compiled for: prompt_bucket x 2^k, capped at the cache.
    Its target forward runs over the shortest that holds every row, not the whole cache (a
    forward over the cache's 368 slots cost a 189M model on CPU more than the speculative
    decoding after it)."""
    return list(length_grid(self.ecfg.prompt_bucket, self.ecfg.cache_len))

  def _switch_on_args(self, base, length: int, params=None, dparams=None) -> tuple:
    tokens = jax.ShapeDtypeStruct((base.hidden.shape[0], length), jnp.int32,
                                  sharding=self._replicated)
    return (self.params if params is None else params,
            self.drafter_params if dparams is None else dparams, base, tokens)

  def _switch_on_exec(self, base, length: int, params=None, dparams=None):
    """The executable that turns a plainly decoded batch into a speculative one, over rows
    of up to `length` tokens (base, params may be abstract, for compiling ahead)."""
    from tlt_jax.rollout import speculative
    fn = functools.partial(speculative.switch_on, cfg=self.cfg, max_steps=self._max_steps())
    return self.exes.get("switch_on", None, fn, self._switch_on_args(base, length, params,
                                                                     dparams),
                         batch=base.hidden.shape[0])

  def _switch_length(self, state, sched: Scheduler, outputs: dict) -> int | None:
    """The length switch-on runs at now: the shortest of `_switch_lengths` holding every
    row. With background compilation, if that one is not compiled yet it is queued on the
    compile thread and the shortest compiled one that holds the rows runs instead (the
    cache's length is compiled with each bucket's arms); None if there is none yet."""
    need = min(longest_row(sched, outputs), self.ecfg.cache_len)
    fits = [n for n in self._switch_lengths() if n >= need]
    if not self.ecfg.spec.background_compile:
      return fits[0]
    compiled = [n for n in fits
                if ExecKey.of("switch_on", None, self._switch_on_args(state, n)) in self.exes]
    if compiled and compiled[0] == fits[0]:
      return fits[0]
    with self._ready_lock:
      queue = (state.batch_size, fits[0]) not in self._switch_submitted
      self._switch_submitted.add((state.batch_size, fits[0]))
    if queue and self._compiler is not None:
      args = (_abstract(state), fits[0], _abstract(self.params), _abstract(self.drafter_params))
      self._compiler.submit(lambda: self._switch_on_exec(*args))
    return compiled[0] if compiled else None

  def _switch_on(self, state, sched: Scheduler, outputs: dict, length: int) -> Any:
    """Speculation starts: each row's prompt and response so far -> the SpecState, over
    rows of `length` tokens (`_switch_length`)."""
    seqs = {}
    for row, req in enumerate(sched.slots[:state.batch_size]):
      if req is not None:
        seqs[row] = np.concatenate([np.asarray(req.prompt_ids, np.int32)]
                                   + outputs[req.key].tokens)[:self.ecfg.cache_len]
    tokens = np.zeros((state.batch_size, length), np.int32)
    for row, seq in seqs.items():
      tokens[row, :len(seq)] = seq
    tokens = jax.device_put(tokens, self._replicated)
    return self._switch_on_exec(state, length)(self.params, self.drafter_params, state, tokens)

  def _spec_key(self, sp: SamplingParams, arm: str, state, kv_len: int) -> ExecKey:
    return ExecKey.of("spec", (arm, sp, self.use_kernel, kv_len),
                      (self.params, self.drafter_params, state))

  def _spec_exec(self, sp: SamplingParams, arm: str, state, kv_len: int | None = None):
    """The (bucket, arm, attention window) executable (kv_len None: the whole cache); state
    may be abstract (ShapeDtypeStructs, `precompile`)."""
    from tlt_jax.rollout import speculative
    ecfg = self.ecfg
    kv_len = kv_len or ecfg.cache_len
    args = (self.params, self.drafter_params, state)

    def compiled(use_kernel: bool):
      fn = functools.partial(speculative.spec_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             strategy=Strategy.parse(arm), capture_hidden=ecfg.capture_hidden,
                             use_kernel=use_kernel, kv_len=kv_len)
      return self.exes.get("spec", (arm, sp, use_kernel, kv_len), fn, args, donate=(2,),
                           batch=self._batch(args))

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

  # -------------------------------------------------------------------------------- layout
  def _row_key(self, base: jax.Array, req: Request) -> np.ndarray:
    k = jax.random.fold_in(jax.random.fold_in(base, req.request_id), req.sample_index)
    return np.asarray(jax.random.key_data(k))

  def _prompt_len(self, reqs: Sequence[Request]) -> int:
    """The padded length of these prompts' prefill."""
    ecfg = self.ecfg
    longest = max(len(r.prompt_ids) for r in reqs)
    return min(-(-longest // ecfg.prompt_bucket) * ecfg.prompt_bucket, ecfg.max_prompt_len)

  def _grow(self, state, length: int):
    """The state with caches of at least `length` slots (`decode.grow_cache`)."""
    if decode.cache_length(state) >= length:
      return state
    return self._call("grow", length, functools.partial(decode.grow_cache, length=length),
                      (state,))

  def _prefill_requests(self, reqs: Sequence[Request], batch: int, base_key, warm: bool,
                        length: int | None = None):
    """Prefill into caches of `length` slots (None: the shortest grid length holding the
    padded prompts; `decode.grow_cache` extends them as the rows grow)."""
    ecfg = self.ecfg
    p = self._prompt_len(reqs)
    length = length or kv_bucket(p, ecfg.prompt_bucket, ecfg.cache_len)
    keys = np.zeros((batch, 2), np.uint32)
    max_new = np.zeros((batch,), np.int32)
    src = np.full((batch,), -1, np.int32)  # row -> its distinct prompt
    distinct: dict[tuple[int, ...], int] = {}
    for i, r in enumerate(reqs):
      src[i] = distinct.setdefault(tuple(int(t) for t in r.prompt_ids), len(distinct))
      keys[i] = self._row_key(base_key, r)
      max_new[i] = min(r.max_new_tokens or ecfg.max_new_tokens, ecfg.max_new_tokens)
    # a group's responses share their prompt: prefill each distinct prompt once when that
    # makes a smaller batch
    u = ecfg.bucket_for(len(distinct))
    shared = u < batch
    rows = u if shared else batch
    tokens = np.zeros((rows, p), np.int32)
    lens = np.zeros((rows,), np.int32)
    for ids, j in distinct.items() if shared else ((r.prompt_ids, i) for i, r in
                                                   enumerate(reqs)):
      tokens[j, :len(ids)] = ids
      lens[j] = len(ids)
    return self._prefill(jnp.asarray(tokens), jnp.asarray(lens),
                         jnp.asarray(src) if shared else None, jnp.asarray(keys),
                         jnp.asarray(max_new), warm, length)

  def _apply(self, op, state, base_key, warm: bool):
    """A scheduler layout operation on the device state; warm: the state carries the
    drafter's (a SpecState)."""
    if isinstance(op, Prefill):
      return self._prefill_requests(op.requests, op.bucket, base_key, warm)
    if isinstance(op, Resize):
      idx, valid = jnp.asarray(op.idx, jnp.int32), jnp.asarray(op.valid)
      return self._call("take_rows", None, decode.take_rows, (state, idx, valid))
    if isinstance(op, Refill):
      ecfg = self.ecfg
      length = max(decode.cache_length(state),
                   kv_bucket(self._prompt_len(op.requests), ecfg.prompt_bucket, ecfg.cache_len))
      state = self._grow(state, length)
      rows = self._prefill_requests(op.requests, op.bucket, base_key, warm, length)
      # Padding rows of the prefill go to an out-of-range slot and are dropped.
      slots = np.full((op.bucket,), state.batch_size, np.int32)
      slots[:len(op.slots)] = op.slots
      return self._call("put_rows", None, decode.put_rows, (state, rows, jnp.asarray(slots)),
                        donate=(0,))
    raise TypeError(f"unknown layout operation {op!r}")

  # ---------------------------------------------------------------------------------- generate
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
               hooks: WorkerHooks | None = None, selector: Any = None,
               speculate: bool = True) -> list[Result]:
    """Decodes all requests; returns results in completion order. `selector` overrides the
    worker's strategy selector for this call (same arms), e.g. so that evaluation chunks
    never feed the training bandit's reward windows; speculate=False decodes plainly, without
    the drafter."""
    self.validate(requests)
    hooks = hooks or WorkerHooks()
    selector = selector or self.selector
    ecfg = self.ecfg
    spec = ecfg.spec if speculate else None
    t_start = time.perf_counter()
    base_key = jax.random.key(seed)
    sched = Scheduler(requests, max_batch=ecfg.max_batch, buckets=ecfg.buckets,
                      compaction=ecfg.compaction,
                      bs_threshold=spec.bs_threshold if spec else None,
                      patience=spec.patience if spec else 1)
    outputs: dict[tuple[int, int], _Output] = {}
    results: list[Result] = []
    state = None
    started = False  # a speculative chunk ran: from here on every chunk is one
    # only the training bandit's chunks measure the gate (evaluation samples greedily)
    gate = self.gate if spec is not None and selector is self.selector else None
    choosable = self.choosable_pairs() if gate is not None else {}
    if gate is not None:
      gate.begin_rollout(self.worker_id, choosable)
    # drafter data only while the drafter is to be trained: with a gate, once a probe has
    # shown that drafts can pay on this hardware (where they cannot, the hidden states'
    # transfer and host bookkeeping are pure overhead on every chunk)
    capture = ecfg.capture_hidden and (self.gate is None or self.gate.drafter_wanted())
    if spec is not None and spec.background_compile:
      self._compile_in_background(sp)
    if (spec is not None and spec.patience == 1
        and len(requests) <= min(spec.bs_threshold, ecfg.max_batch)
        and self._spec_ready(sp, ecfg.bucket_for(len(requests)))):
      # One batch at or under the threshold from the start (speculation would switch on at
      # the first check): speculate from the first chunk, the drafter prefilled with the
      # prompts (no switch-on forward after a plain prefill)
      sched.speculating = started = True
    while not sched.done:
      if hooks.before_chunk:
        hooks.before_chunk()
      for op in sched.plan():
        # refills once speculation runs carry the drafter's prefill
        state = self._apply(op, state, base_key, warm=started)
        for r in getattr(op, "requests", ()):
          outputs[r.key] = _Output(ecfg.hidden_keep)
      live = sched.live
      speculating = sched.check_speculation()
      if speculating and not started:
        length = (self._switch_length(state, sched, outputs)
                  if self._spec_ready(sp, state.batch_size) else None)
        if length is not None:
          state = self._switch_on(state, sched, outputs, length)
        else:
          speculating = False  # this bucket's executables are still compiling: decode plainly
      started = started or speculating
      arm = selector.select(len(live)) if speculating else None
      if arm is not None and gate is not None:  # a bucket on probation runs the probed arms
        arm = gate.probe_arm(state.batch_size, arm)
      if speculating:
        for s in live:
          o = outputs[sched.slots[s].key]
          if o.spec_start is None:
            o.spec_start = o.length
      # the attention window the rows reach this chunk; the cache grows to hold it
      kv_len = self._kv_window(sp, arm, longest_row(sched, outputs), state)
      state = self._grow(state, kv_len)
      # --- one chunk of decoding (the only host sync)
      compiles = len(self.exes.records)
      t0 = time.perf_counter()
      state, out, spec_counts = self._decode(state, sp, arm, capture, kv_len)
      base = state if isinstance(state, decode.DecodeState) else state.base
      out, done, stopped, spec_counts = jax.device_get((out, base.done, base.stopped,
                                                          spec_counts))
      dt = time.perf_counter() - t0
      produced = 0
      for s in live:
        req = sched.slots[s]
        o = outputs[req.key]
        v = out.valid[s]
        produced += int(v.sum())
        o.append(out.tokens[s][v], out.logprobs[s][v],
                 out.hidden[s][v] if capture and out.hidden is not None else None)
        if done[s]:
          sched.finish(s)
          res = self._result(req, outputs.pop(req.key), bool(stopped[s]), t_start)
          results.append(res)
          if hooks.on_result:
            hooks.on_result(res)
      compiled = len(self.exes.records) != compiles
      m = ChunkMetrics(worker_id=self.worker_id, bucket=state.batch_size, live=len(live),
                       tokens=produced, steps=int(out.steps), wall_time=dt, mode=arm or "plain",
                       accepted=int(spec_counts[0]), verifications=int(spec_counts[1]),
                       t=time.perf_counter() - t_start, compiled=compiled)
      if gate is not None and not compiled:
        gate.record(state.batch_size, arm, dt, m.steps, m.accepted, m.verifications)
      if arm is not None and not compiled:
        # Reward (DESIGN.md 4) = accepted tokens x batch size / wall time of draft + verify:
        # `produced` sums every live row's emitted tokens (accepted drafts + 1 per step), so
        # this is the batch's tokens/s. "off" (steps=0, plain decoding in the spec state) is
        # measured the same way. A chunk that compiled its executable reports nothing: compile
        # time is not the arm's speed (the arm stays untried and is chosen again).
        selector.update(arm, len(live), produced / max(dt, 1e-9))
      self.chunk_log.append(m)
      if hooks.on_chunk:
        hooks.on_chunk(m)
    return results

  def _result(self, req: Request, o: _Output, stopped: bool, t_start: float) -> Result:
    response = np.concatenate(o.tokens).astype(np.int32)
    hidden = np.concatenate(list(o.hidden)) if o.hidden else None
    if hidden is not None and self.ecfg.hidden_keep:
      hidden = hidden[-self.ecfg.hidden_keep:]
    return Result(request_id=req.request_id, sample_index=req.sample_index,
                  prompt_ids=np.asarray(req.prompt_ids, np.int32), response_ids=response,
                  logprobs=np.concatenate(o.logprobs).astype(np.float32), hidden=hidden,
                  finish_reason="stop" if stopped else "length", worker_id=self.worker_id,
                  finish_time=time.perf_counter() - t_start,
                  hidden_offset=0 if hidden is None else len(response) - len(hidden),
                  spec_start=o.spec_start)
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

  def _wanted_pairs(self) -> dict[int, list[str]]:
    """Bucket -> the arms to compile there: the choosable ones, or with a gate those it
    opens to this worker now (all where speculation pays, the probed ones on probation)."""
    pairs = self.choosable_pairs()
    if self.gate is None:
      return pairs
    return {b: arms for b in pairs if (arms := self.gate.arms(self.worker_id, b))}

  def _spec_ready(self, sp: SamplingParams, bucket: int) -> bool:
    """Whether every arm wanted at `bucket` is compiled (always, without background
    compilation: then a chunk compiles what it needs)."""
    spec = self.ecfg.spec
    if self.gate is not None and not self.gate.allows(self.worker_id, bucket):
      return False
    if not spec.background_compile:
      return True
    want = {(bucket, a) for a in self._wanted_pairs().get(bucket, ())}
    with self._ready_lock:
      return want <= self._ready.get(sp, set())

  def _compile_in_background(self, sp: SamplingParams) -> None:
    """Starts compiling the choosable (bucket, arm) pairs for `sp` that are not compiled or
    queued yet on this worker's compile thread, largest bucket first (speculation switches on
    at the largest and shrinks). With a gate, only the arms it opens to this worker (called
    again at every generate: what it opens later is compiled then)."""
    pairs = self._wanted_pairs()
    with self._ready_lock:
      self._ready.setdefault(sp, set())
      submitted = self._submitted.setdefault(sp, set())
      pairs = {b: new for b, arms in pairs.items()
               if (new := [a for a in arms if (b, a) not in submitted])}
      if not pairs:
        return
      submitted.update((b, a) for b, arms in pairs.items() for a in arms)
      if self._compiler is None:
        self._compiler = background_compiler(f"compile-worker-{self.worker_id}")
      self._compiling += 1

    def mark(pair):
      with self._ready_lock:
        self._ready[sp].add(pair)

    def job():
      try:
        self._compile_pairs(sp, pairs, on_compiled=mark)
      except Exception:  # noqa: BLE001 - the foreground compiles what it needs instead
        _log.exception("worker %d: background compilation failed; speculation compiles its "
                       "executables on first use", self.worker_id)
        with self._ready_lock:
          self._ready[sp].update((b, a) for b, arms in pairs.items() for a in arms)
      finally:
        with self._ready_lock:
          self._compiling -= 1

    self._compiler.submit(job)

  def wait_compiled(self, timeout: float | None = None) -> None:
    """Blocks until background compilation started so far is done (tests, benchmarks)."""
    if self._compiler is not None:
      self._compiler.submit(lambda: None).result(timeout)

  def precompile(self, sp: SamplingParams, *, all_pairs: bool = False) -> int:
    """AOT-compiles the speculative executable of every choosable (bucket, arm) pair now, instead
    of on first use (the default, lazy; it compiles the same pairs, and only those chosen).
    all_pairs=True compiles every selector arm at every engine bucket (what choosable-only
    saves, measured). Returns the number of new speculative executables.

    States are abstract: shapes and shardings come from one real prefill of dummy rows at the
    largest bucket (shardings are the ones generate() will pass), resized on the batch axis."""
    pairs = self.choosable_pairs()
    if all_pairs and pairs:
      pairs = {b: self.selector.arms for b in self.ecfg.buckets}
    before = sum(r.name == "spec" for r in self.exes.records)
    self._compile_pairs(sp, pairs, all_lengths=True)
    if self.ecfg.spec.background_compile:
      with self._ready_lock:
        self._ready.setdefault(sp, set()).update((b, a) for b, arms in pairs.items()
                                                 for a in arms)
        self._submitted.setdefault(sp, set()).update((b, a) for b, arms in pairs.items()
                                                     for a in arms)
    return sum(r.name == "spec" for r in self.exes.records) - before

  def _compile_pairs(self, sp: SamplingParams, pairs: dict[int, list[str]],
                     on_compiled: Callable | None = None, all_lengths: bool = False) -> None:
    """The spec executables of `pairs` and, per bucket, switch-on over the whole cache
    (every other length: all_lengths=True, else compiled when first needed)."""
    if not pairs:
      return
    top = max(pairs)
    dummy = [Request([i % self.cfg.vocab_size], i) for i in range(top)]  # distinct: no sharing
    base = self._prefill_requests(dummy, top, jax.random.key(0), warm=False,
                                  length=self.ecfg.cache_len)
    lengths = self._switch_lengths()
    tokens = jax.device_put(np.zeros((top, lengths[-1]), np.int32), self._replicated)
    state = self._switch_on_exec(base, lengths[-1])(self.params, self.drafter_params, base,
                                                    tokens)

    def resized(tree, b):  # state leaves are batch-major
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype, sharding=x.sharding), tree)

    for b in sorted(pairs, reverse=True):
      for n in lengths if all_lengths else lengths[-1:]:
        self._switch_on_exec(resized(base, b), n)
      abstract = resized(state, b)
      for arm in pairs[b]:
        self._spec_exec(sp, arm, abstract)
        if on_compiled is not None:
          on_compiled((b, arm))

  def compile_report(self) -> dict[str, Any]:
    """Speculative executables compiled so far (count, seconds, memory_analysis bytes) against
    compiling every selector arm at every engine bucket. Uncompiled pairs are estimated as
    params + per-row bytes x batch, the per-row bytes read off that arm's compiled records (any
    arm's when it has none): the batch-independent part of an executable's memory is its params
    arguments, the rest scales with the batch."""
    recs = [r for r in self.compile_log if r.name == "spec"]
    fixed = sum(x.nbytes for x in jax.tree.leaves((self.params, self.drafter_params)))
    per_row: dict[str, list[float]] = collections.defaultdict(list)
    have: dict[tuple[str, int], int] = {}
    for r in recs:
      if r.memory_bytes is not None and r.batch:
        per_row[r.key.variant[0]].append((r.memory_bytes - fixed) / r.batch)
        have[(r.key.variant[0], r.batch)] = r.memory_bytes
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


