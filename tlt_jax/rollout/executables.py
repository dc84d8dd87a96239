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
lower and compile each once. On other devices of the same kind (a run's rollout workers, one
per GPU or tensor-parallel group) the program is the same, compiled once and loaded onto each
worker's devices (port.py: milliseconds, not a compile). A function whose behaviour the key
cannot see (a closure) is not shared; `clear_shared` drops them all. A program is compiled
once even when two threads ask for it together (`_compile_once`): the second waits for the
first's compile (its compile thread, inside `deferring()`, compiles what it has queued next
first).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Hashable

import jax

from tlt_jax.metrics import mark_background_compiler
from tlt_jax.models import KVCache
from tlt_jax.rollout import port

_log = logging.getLogger(__name__)


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
  # loaded from another worker's executable of the same program on other devices (port.py):
  # `seconds` is the load's
  ported: bool = False

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
    program, devices = shared if shared is not None else ((id(self), key), ())
    exe, mem, compile_s, ported = _compile_once(program, devices, shared is not None,
                                                lambda: _compile(fn, args, donate))
    seconds = time.perf_counter() - t0
    with self._lock:
      if key not in self._compiled:
        self._compiled[key] = exe
        self.records.append(CompileRecord(key, batch, seconds, mem, compile_s, ported))
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
  """(executable, its argument + output + temp bytes from memory_analysis() or None, whether
  it was loaded from JAX's persistent compilation cache)."""
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
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    _CACHE_HIT.hit = False  # (after the lowering: eager ops it ran compile too)
    exe = lowered.compile()
  try:
    ma = exe.memory_analysis()
    mem = (None if ma is None else
           int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes))
  except Exception:  # noqa: BLE001 - backends without memory analysis
    mem = None
  return exe, mem, _CACHE_HIT.hit


# whether the calling thread's last compile was loaded from JAX's persistent cache (JAX
# reports a hit on the thread that compiles)
_CACHE_HIT = threading.local()
jax.monitoring.register_event_listener(
    lambda event, **_: setattr(_CACHE_HIT, "hit", True)
    if event == "/jax/compilation_cache/cache_hits" else None)


def _mesh_of(args: tuple) -> jax.sharding.AbstractMesh:
  """The abstract mesh of the first argument placed by a NamedSharding (an empty mesh if
  none is)."""
  for x in jax.tree.leaves(args):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
      return sh.mesh.abstract_mesh
  return jax.sharding.AbstractMesh((), ())


# a program (`_shared_key`'s, without devices) -> {its devices: (executable, memory bytes,
# compile seconds)}: the process's (module docstring)
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


# a program -> (the devices it is compiled for, a Future of that compile running now, the
# thread running it): on any thread of the process
_INFLIGHT: dict = {}

# a program -> the devices its executable was compiled for here (not loaded from JAX's
# persistent cache, nor ported: XLA:CPU's executables loaded from the cache, serialized again,
# lost their kernels: "NOT_FOUND: Function ... not found" as they ran, jaxlib 0.12.0.1), and
# that executable serialized (`port.serialize`, once): what the other devices load
_SOURCES: dict = {}
_SERIALIZED: dict = {}

_LOCAL = threading.local()  # .defer: raise `Elsewhere` rather than wait (`deferring`)


class Elsewhere(Exception):
  """The executable asked for is being compiled by another thread of the process (for other
  devices, or these): raised only inside `deferring()`, for a queue of compiles that can
  take the next one first and come back to this one (`compile_each`)."""


@contextlib.contextmanager
def deferring(on: bool = True):
  """Within it, an executable another thread is compiling now raises `Elsewhere` instead of
  waiting for that compile (on=False: waits, as outside it)."""
  before = getattr(_LOCAL, "defer", False)
  _LOCAL.defer = on
  try:
    yield
  finally:
    _LOCAL.defer = before


def compile_each(items, compile_one: Callable, defer: bool):
  """Yields each of `items` once `compile_one(item)` has compiled it, in order, except
  (defer: a compile thread's queue) those another thread of the process is compiling now
  (another worker's compile thread, for its devices: `deferring`): they go last,
  and are then loaded from that compile (port.py) instead of compiled beside it. So the
  workers' threads, queueing the same arms at once, compile different ones first."""
  later = []
  for item in items:
    if not defer:
      compile_one(item)
      yield item
      continue
    try:
      with deferring():
        compile_one(item)
    except Elsewhere:
      later.append(item)
      continue
    yield item
  for item in later:
    compile_one(item)
    yield item


def _compile_once(program: Hashable, devices: tuple, share: bool,
                  compile_fn: Callable[[], tuple]):
  """(executable, memory bytes, compile seconds, ported) for `program` on `devices`: the
  process's if it has it (`share`), else loaded from its executable on other devices of the
  process where there is one (port.py: ported), else compiled here, once. A thread asking
  for a program another thread is compiling now (for any devices) waits for that compile
  instead of running its own beside it (the engine's plain chunk that needs the drafter's
  tracking the compile thread has started; every worker's compile thread asking for the
  arm one of them compiles) and ports it where the devices differ; inside `deferring()` it
  raises `Elsewhere` instead. A compile that failed in another thread is tried again here;
  a port that fails compiles here."""
  with _SHARED_LOCK:
    have = _SHARED.get(program, {}) if share else {}
    hit = have.get(devices)
    src = _SOURCES.get(program) if hit is None and devices else None
    source = (src, have[src]) if src is not None else None
    # (another worker took it from JAX's persistent cache: each takes its own, side by side)
    cached = hit is None and source is None and bool(have)
    running = None if hit is not None or source is not None or cached else _INFLIGHT.get(
        program)
    mine = hit is None and source is None and running is None and not cached
    if mine:
      running = _INFLIGHT[program] = (devices, cf.Future(), threading.get_ident())
  if hit is not None:
    return hit + (False,)
  if source is not None:
    ported = _port(program, source, devices)
    if ported is not None:
      return ported
  if source is not None or cached:
    return _compile_here(program, devices, share, compile_fn, running=None)
  if not mine:
    if getattr(_LOCAL, "defer", False) and running[2] != threading.get_ident():
      raise Elsewhere(program)
    try:
      running[1].result()
    except Exception:  # noqa: BLE001 - the other thread's failure: ours decides
      pass
    return _compile_once(program, devices, share, compile_fn)
  return _compile_here(program, devices, share, compile_fn, running)


def _compile_here(program, devices, share, compile_fn, running):
  """Compiles `program` on this thread (`running`: its entry in _INFLIGHT, None: none)."""
  t0 = time.perf_counter()
  try:
    exe, mem, loaded = compile_fn()
  except BaseException as e:
    if running is not None:
      with _SHARED_LOCK:
        _INFLIGHT.pop(program, None)
      running[1].set_exception(e)
    raise
  hit = (exe, mem, time.perf_counter() - t0)
  with _SHARED_LOCK:
    if share:
      hit = _SHARED.setdefault(program, {}).setdefault(devices, hit)
      if devices and not loaded and hit[0] is exe:
        _SOURCES.setdefault(program, devices)
    if running is not None:
      _INFLIGHT.pop(program, None)
  if running is not None:
    running[1].set_result(hit)
  return hit + (False,)


def _port(program, source: tuple, devices: tuple):
  """`program`'s executable on `source` = (devices, hit) loaded for `devices` (port.py), kept
  for them; None where it cannot be (logged once: the caller compiles)."""
  (src, (exe, mem, compile_s)) = source
  try:
    with _SHARED_LOCK:
      serial = _SERIALIZED.get(program)
    if serial is None:
      serial = port.serialize(exe)
      with _SHARED_LOCK:
        _SERIALIZED[program] = serial
    loaded = port.port(serial, exe, src, devices)
  except Exception as e:  # noqa: BLE001 - a backend that cannot serialize or load this one
    global _PORT_FAILED
    if not _PORT_FAILED:
      _PORT_FAILED = True
      _log.info("an executable could not be loaded onto other devices (%s: %s); each "
                "worker compiles its own", type(e).__name__, str(e)[:200])
    return None
  with _SHARED_LOCK:
    hit = _SHARED.setdefault(program, {}).setdefault(devices, (loaded, mem, compile_s))
  return hit + (hit[0] is loaded,)


_PORT_FAILED = False


def clear_shared() -> None:
  """Drops the executables shared across the process's caches (each cache keeps its own)."""
  with _SHARED_LOCK:
    _SHARED.clear()
    _SOURCES.clear()
    _SERIALIZED.clear()


def _fn_key(fn: Callable):
  """`fn` as a key: a module-level function itself, a partial by its function, arguments and
  keywords (values compared by value); None for a closure (state the key cannot see)."""
  if isinstance(fn, functools.partial):
    inner = _fn_key(fn.func)
    return None if inner is None else (inner, fn.args, tuple(sorted(fn.keywords.items())))
  return None if getattr(fn, "__closure__", None) else fn


def _shared_key(key: ExecKey, fn: Callable, args: tuple, donate: tuple[int, ...]):
  """(What the executable of `fn` on `args` is a function of, the devices it runs on), None
  where it is not shared: the cache key, the function, the arguments' tree, shardings (their
  devices by position: port.placement) and weak types, the donation, and JAX's tracing
  context (its configuration: precision, x64, ...)."""
  f = _fn_key(fn)
  if f is None:
    return None
  try:
    from jax._src import config as jax_config  # (the context jit's own cache keys on)
    context = jax_config.trace_context()
  except (ImportError, AttributeError):
    return None
  leaves, tree = jax.tree.flatten(args)
  placed = port.placement(leaves)
  # (shardings port.py does not describe: the program keeps its devices, none to port to)
  where, devices = placed if placed is not None else (
      tuple((getattr(x, "sharding", None), bool(getattr(x, "weak_type", False)))
            for x in leaves), ())
  k = (f, key, tree, where, tuple(donate), context)
  try:
    hash(k)
  except TypeError:  # (an unhashable static value: compiled per cache)
    return None
  return k, devices


# executables only speculation compiles: an arm's chunk (or a history arm's step), the
# drafter's tracking of a call's prompts and plain chunks, switch-off
SPECULATIVE = ("spec", "track", "track_prompt", "switch_off")


def summary(records: list[CompileRecord]) -> dict[str, Any]:
  """Compile records (one or several engines') as a run's metrics show them: how many, how
  many speculative, how many loaded from another worker's compile (port.py), the seconds
  getting them took (persistent-cache hits and ports: loading)."""
  spec = [r for r in records if r.name in SPECULATIVE]
  return {"count": len(records), "speculative": len(spec),
          "ported": sum(r.ported for r in records),
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
