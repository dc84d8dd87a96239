"""Ahead-of-time compiled executables, one per (function variant, argument shapes).

The analogue of CUDA-graph capture: each batch-size bucket of each decode function is lowered
and compiled once and reused for the whole run, and its compile time and memory
(`memory_analysis()`) are recorded, so the cost of every executable the engine holds is known.
Keys are frozen and hashable: the function's name, its static variant (sampling params,
strategy, kernel choice) and the shapes/dtypes of its arguments.

Executables are shared by every cache of a process (`_shared_key`): one is a function of its
function and static configuration, its arguments' shapes, dtypes and shardings, what it
donates and JAX's tracing context, so engines of one process with the same configuration on
the same devices (a benchmark's plain and speculative engines, a test file's engines) trace,
lower and compile each once. A function whose behaviour the key cannot see (a closure) is not
shared; `clear_shared` drops them all. An executable is compiled once even when two threads
ask for it together (`_compile_once`): the second waits for the first's compile.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Hashable

import jax

from tlt_jax.metrics import mark_background_compiler
from tlt_jax.models import KVCache


@dataclasses.dataclass(frozen=True)
class ExecKey:
  name: str  # "prefill", "decode", "spec", ...
  variant: Hashable  # static config baked into the executable
  shapes: tuple  # ((shape, dtype), ...) of every argument leaf

  @classmethod
  def of(cls, name: str, variant: Hashable, args: tuple) -> "ExecKey":
    return cls(name, variant, tuple((tuple(x.shape), str(x.dtype))
                                    for x in jax.tree.leaves(args)))


@dataclasses.dataclass
class CompileRecord:
  key: ExecKey
  batch: int  # the batch (bucket) it was compiled for, 0 when it has none
  seconds: float  # spent getting it here: compiling, loading it from JAX's persistent cache
  memory_bytes: int | None  # argument + output + temp bytes from memory_analysis(), if given
  # what its compile took (`seconds`, or the one of the process's caches that compiled it and
  # shared it: what compiling it costs on this machine, the gate's price)
  compile_s: float

  @property
  def name(self) -> str:
    return self.key.name


def batch_of(args: tuple) -> int:
  """The batch (bucket) of an executable's arguments, 0 when it has none: params (plain
  dicts) carry no batch; state leaves and token arrays (concrete or abstract) are batch-major."""
  batched = [a for a in args if not isinstance(a, dict)]
  # a KV cache's page pools are the replica's, not batch-major: its rows are its tables
  rows = jax.tree.map(lambda x: x.table if isinstance(x, KVCache) else x, batched,
                      is_leaf=lambda x: isinstance(x, KVCache))
  return max((x.shape[0] for x in jax.tree.leaves(rows) if getattr(x, "ndim", 0)), default=0)


class ExecutableCache:
  """`get(name, variant, fn, args, donate)` -> the compiled executable for these
  argument shapes, compiling it on first use. Thread-safe (a background thread may
  precompile while the engine decodes)."""

  def __init__(self):
    self._compiled: dict[ExecKey, Any] = {}
    self.records: list[CompileRecord] = []
    self._by_thread: dict[int, int] = {}  # compiles per compiling thread
    self._lock = threading.Lock()

  def __contains__(self, key: ExecKey) -> bool:
    return key in self._compiled

  def __len__(self) -> int:
    return len(self._compiled)

  def get(self, name: str, variant: Hashable, fn: Callable, args: tuple, *,
          donate: tuple[int, ...] = ()):
    """The executable, compiled here on first use (or taken from another cache of the
    process: a record all the same, with the seconds it took here and its compile's)."""
    key = ExecKey.of(name, variant, args)
    exe = self._compiled.get(key)
    if exe is not None:
      return exe
    batch = batch_of(args)
    t0 = time.perf_counter()
    shared = _shared_key(key, fn, args, donate)
    exe, mem, compile_s = _compile_once(
        shared if shared is not None else (id(self), key), shared is not None,
        lambda: _compile(fn, args, donate))
    seconds = time.perf_counter() - t0
    with self._lock:
      if key not in self._compiled:
        self._compiled[key] = exe
        self.records.append(CompileRecord(key, batch, seconds, mem, compile_s))
        me = threading.get_ident()
        self._by_thread[me] = self._by_thread.get(me, 0) + 1
      return self._compiled[key]

  def compiled_here(self) -> int:
    """How many executables the calling thread has compiled (a background compile thread's
    do not count: they did not stall this thread's device calls)."""
    with self._lock:
      return self._by_thread.get(threading.get_ident(), 0)

  def abstract_out(self, name: str, variant: Hashable, fn: Callable, args: tuple, *,
                   donate: tuple[int, ...] = ()):
    """What the executable `get` returns would output, as ShapeDtypeStructs with their
    shardings (compiling ahead for states that are never materialised: no KV pool is
    touched)."""
    exe = self.get(name, variant, fn, args, donate=donate)
    shapes = jax.eval_shape(fn, *args)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, exe.output_shardings)

  def stats(self) -> dict[str, Any]:
    mems = [r.memory_bytes for r in self.records if r.memory_bytes is not None]
    return {"executables": len(self.records),
            "compile_seconds": sum(r.seconds for r in self.records),
            "memory_bytes": sum(mems) if mems else None}


def _compile(fn: Callable, args: tuple, donate: tuple[int, ...]):
  """(executable, its argument + output + temp bytes from memory_analysis() or None)."""
  # A donated state's page pools pass through in place; its per-row leaves often cannot be
  # reused (another batch size, fewer outputs) and are just freed: not worth a warning. The
  # filter (JAX's lowering module, this message) is put first in the filters in force at each
  # compile (filterwarnings replaces an equal one: the list does not grow): a
  # `warnings.catch_warnings()` around the compile is not thread-safe (with background
  # compiles one thread's exit restored the filters under another's compile, and the warning
  # reached a test's output), and one set at import is lost when the import runs inside a
  # catch_warnings (pytest's collection).
  warnings.filterwarnings("ignore", "Some donated buffers were not usable", UserWarning,
                          r"jax\._src\.interpreters\.mlir")
  # Input shardings are committed (params on the replica's mesh); the mesh is also made the
  # trace's abstract mesh, under which a kernel runs per device on a tensor-parallel replica
  # (models.attention.paged_cache_attention).
  with jax.sharding.use_abstract_mesh(_mesh_of(args)):
    exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  try:
    ma = exe.memory_analysis()
    mem = (None if ma is None else
           int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes))
  except Exception:  # noqa: BLE001 - backends without memory analysis
    mem = None
  return exe, mem


def _mesh_of(args: tuple) -> jax.sharding.AbstractMesh:
  """The abstract mesh of the first argument placed by a NamedSharding (an empty mesh if
  none is)."""
  for x in jax.tree.leaves(args):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
      return sh.mesh.abstract_mesh
  return jax.sharding.AbstractMesh((), ())


# _shared_key -> (executable, memory bytes, compile seconds): the process's (module docstring)
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


# the same keys -> a Future of the compile running now (on any thread of the process)
_INFLIGHT: dict = {}


def _compile_once(ident: Hashable, share: bool, compile_fn: Callable[[], tuple]):
  """(executable, memory bytes, compile seconds) for `ident`: the process's if it has it
  (`share`), else compiled here, once: a thread asking for what another thread is compiling
  now waits for that compile instead of running its own beside it (the engine's plain chunk
  that needs the drafter's tracking the compile thread has started: it waits what is left of
  one compile; queued but not started, the chunk compiles it and the queued job finds it
  compiled). A compile that failed in another thread is tried again here."""
  with _SHARED_LOCK:
    hit = _SHARED.get(ident) if share else None
    running = None if hit is not None else _INFLIGHT.get(ident)
    mine = hit is None and running is None
    if mine:
      running = _INFLIGHT[ident] = cf.Future()
  if hit is not None:
    return hit
  if not mine:
    try:
      return running.result()
    except Exception:  # noqa: BLE001 - the other thread's failure: ours decides
      return _compile_once(ident, share, compile_fn)
  t0 = time.perf_counter()
  try:
    exe, mem = compile_fn()
  except BaseException as e:
    with _SHARED_LOCK:
      _INFLIGHT.pop(ident, None)
    running.set_exception(e)
    raise
  hit = (exe, mem, time.perf_counter() - t0)
  with _SHARED_LOCK:
    if share:
      hit = _SHARED.setdefault(ident, hit)
    _INFLIGHT.pop(ident, None)
  running.set_result(hit)
  return hit


def clear_shared() -> None:
  """Drops the executables shared across the process's caches (each cache keeps its own)."""
  with _SHARED_LOCK:
    _SHARED.clear()


def _fn_key(fn: Callable):
  """`fn` as a key: a module-level function itself, a partial by its function, arguments and
  keywords (values compared by value); None for a closure (state the key cannot see)."""
  if isinstance(fn, functools.partial):
    inner = _fn_key(fn.func)
    return None if inner is None else (inner, fn.args, tuple(sorted(fn.keywords.items())))
  return None if getattr(fn, "__closure__", None) else fn


def _shared_key(key: ExecKey, fn: Callable, args: tuple, donate: tuple[int, ...]):
  """What the executable of `fn` on `args` is a function of (None: not shared): the cache
  key, the function, the arguments' tree, shardings and weak types, the donation, and JAX's
  tracing context (its configuration: precision, x64, ...)."""
  f = _fn_key(fn)
  if f is None:
    return None
  try:
    from jax._src import config as jax_config  # (the context jit's own cache keys on)
    context = jax_config.trace_context()
  except (ImportError, AttributeError):
    return None
  leaves, tree = jax.tree.flatten(args)
  placed = tuple((getattr(x, "sharding", None), bool(getattr(x, "weak_type", False)))
                 for x in leaves)
  k = (f, key, tree, placed, tuple(donate), context)
  try:
    hash(k)
  except TypeError:  # (an unhashable static value: compiled per cache)
    return None
  return k


# executables only speculation compiles: an arm's chunk (or a history arm's step), the
# drafter's tracking of a call's prompts and plain chunks, switch-off
SPECULATIVE = ("spec", "track", "track_prompt", "switch_off")


def summary(records: list[CompileRecord]) -> dict[str, Any]:
  """Compile records (one or several engines') as a run's metrics show them: how many, how
  many speculative, the seconds compiling them took (persistent-cache hits: loading)."""
  spec = [r for r in records if r.name in SPECULATIVE]
  return {"count": len(records), "speculative": len(spec),
          "compile_s": round(sum(r.seconds for r in records), 2),
          "speculative_compile_s": round(sum(r.seconds for r in spec), 2)}


# every compile thread of the process (`drain_compilers`), as long as its owner keeps it
_COMPILERS: weakref.WeakSet = weakref.WeakSet()


def drain_compilers(timeout: float = 900.0) -> int:
  """Blocks until every live compile thread of the process has run what is queued on it (and
  what those jobs queue): for code that must not run beside a compile, e.g. the tests'
  `jax.clear_caches()` after each file, while an engine of that file may still be compiling
  ahead. Returns how many threads it waited for."""
  waited = 0
  for ex in list(_COMPILERS):
    try:
      # jobs queue jobs (an arm's windows): until a marker job, run on the thread itself (one
      # thread: nothing else runs then), finds nothing queued behind it
      for _ in range(1000):
        if ex.submit(lambda ex=ex: ex._work_queue.empty()).result(timeout):
          break
    except RuntimeError:  # shut down: nothing runs there
      continue
    waited += 1
  return waited


def background_compiler(name: str) -> cf.ThreadPoolExecutor:
  """One thread for compiling ahead of need, at the lowest CPU priority (Linux: per-thread
  nice 19, inherited by threads XLA starts from it): compiles fill idle cores (a decode tail
  at batch 1, host work) instead of slowing the rollout and the learner. On an accelerator
  host they overlap device work anyway. A run's `CompileClock` counts its compiles as
  `time.compile_background`."""

  def lower_priority():
    mark_background_compiler()  # its compiles counted apart (time.compile_background)
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
      pass

  ex = cf.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lower_priority)
  _COMPILERS.add(ex)
  return ex
