"""Ahead-of-time compiled executables, one per (function variant, argument shapes).

The analogue of CUDA-graph capture: each batch-size bucket of each decode function is lowered
and compiled once and reused for the whole run, and its compile time and memory
(`memory_analysis()`) are recorded, so the cost of every executable the engine holds is known.
Keys are frozen and hashable: the function's name, its static variant (sampling params,
strategy, kernel choice) and the shapes/dtypes of its arguments.

Executables are shared by every cache of the process; one compiled for a worker's devices is
loaded onto the other workers' devices, and in a multi-host run by the other processes,
instead of compiled again (sharing.py, port.py, exchange.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Hashable, NamedTuple

import jax

from tlt_jax.metrics import mark_background_compiler
from tlt_jax.models import KVCache
from tlt_jax.rollout import exchange, port, sharing
from tlt_jax.rollout.sharing import Elsewhere

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
    shared = sharing.shared_key(key, fn, args, donate)
    program, devices = shared if shared is not None else ((id(self), key), ())
    exe, mem, compile_s, ported = sharing.compile_once(program, devices, shared is not None,
                                                lambda: _compile(fn, args, donate, devices))
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


class _Made(NamedTuple):
  exe: Any
  memory_bytes: int | None  # argument + output + temp bytes from memory_analysis(), if given
  cached: bool  # loaded from JAX's persistent compilation cache
  portable: port.Portable | None  # serialized (for another process, or from one)
  compile_s: float | None  # where loaded from another process (exchange.py): its compile's


def compile_shared(program: Hashable | None, lower: Callable[[], jax.stages.Lowered],
                   args: tuple) -> tuple[jax.stages.Compiled, bool]:
  """(`lower()`'s executable, whether it was loaded from another worker's compile), shared as
  the engine's are (sharing.py): compiled once for the process's workers, or the job's, and
  loaded onto the others' devices. `program`: what it is a function of besides its arguments'
  (`args`, concrete or abstract) tree, shapes, shardings by position and JAX's context; None:
  not shared (compiled here). For programs outside an engine's cache (the spot drafter's
  train step)."""
  shared = sharing.shared_key(program, None, args, ()) if program is not None else None
  key, devices = shared if shared is not None else ((object(), program), ())
  exe, _, _, ported = sharing.compile_once(key, devices, shared is not None,
                                           lambda: _compile_lowered(lower, devices))
  return exe, ported


def _compile(fn: Callable, args: tuple, donate: tuple[int, ...], devices: tuple = ()) -> _Made:
  """`fn` on `args` compiled (`_compile_lowered`). Input shardings are committed (params on
  the replica's mesh); the mesh is also made the trace's abstract mesh, under which a kernel
  runs per device on a tensor-parallel replica (models.attention.paged_cache_attention)."""
  return _compile_lowered(lambda: jax.jit(fn, donate_argnums=donate).lower(*args), devices,
                          _mesh_of(args))


def _compile_lowered(lower: Callable[[], jax.stages.Lowered], devices: tuple = (),
                     mesh: jax.sharding.AbstractMesh | None = None) -> _Made:
  """`lower()` (traced under abstract `mesh` if given) compiled, or in a multi-process run
  (`devices`: the program's, all this process's) loaded from another process's compile of
  it (exchange.py): one claims it, compiles and publishes it, the others wait for it and
  load it (inside `deferring()`, raise `Elsewhere` rather than wait)."""
  t0 = time.perf_counter()
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
  with (jax.sharding.use_abstract_mesh(mesh) if mesh is not None
        else contextlib.nullcontext()):
    lowered = lower()
    xp = exchange.active() if exchange.local(devices) else None
    name = exchange.name_of(lowered, devices) if xp is not None else ""
    if xp is not None:
      got = xp.take(name, lowered, wait=not sharing.deferring_now())
      if got is exchange.BUSY:
        raise Elsewhere(name)
      if got is not None:
        portable, compile_s, mem = got
        try:
          return _Made(port.port(portable, devices), mem, False, portable, compile_s)
        except Exception as e:  # noqa: BLE001 - compiled here instead
          sharing.port_failed(e)
    _CACHE_HIT.hit = False  # (after the lowering: eager ops it ran compile too)
    try:
      exe = lowered.compile()
    except BaseException:
      if xp is not None and xp.claimed(name):
        xp.publish(name, None, 0.0, None, "its compile failed")
      raise
  try:
    ma = exe.memory_analysis()
    mem = (None if ma is None else
           int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes))
  except Exception:  # noqa: BLE001 - backends without memory analysis
    mem = None
  cached, portable = _taken_from_cache(exe), None
  if xp is not None and xp.claimed(name):
    why = ""
    if not cached:  # (one taken from the persistent cache is not serialized again: _SOURCES)
      try:
        portable = port.portable(exe, devices)
      except Exception as e:  # noqa: BLE001 - a backend that cannot serialize it
        why = f"not serializable: {type(e).__name__}"
    xp.publish(name, portable, time.perf_counter() - t0, mem, why, cached=cached)
  return _Made(exe, mem, cached, portable, None)


# whether the calling thread's last compile was loaded from JAX's persistent cache (JAX
# reports a hit on the thread that compiles)
_CACHE_HIT = threading.local()
jax.monitoring.register_event_listener(
    lambda event, **_: setattr(_CACHE_HIT, "hit", True)
    if event == "/jax/compilation_cache/cache_hits" else None)


# (id, fingerprint) of the XLA executables this process took from JAX's persistent cache:
# JAX's in-memory cache hands the same one back to a later compile of the same lowering (a
# compile of milliseconds that reports no cache hit), and it is no port source either (see
# sharing.py's _SOURCES). Not held: holding them, two CI runs of the suite crashed (SIGSEGV
# in XLA:CPU's deserialization of a persistent-cache entry), none without; an id freed and
# taken over by a fresh compile of the same program only costs that one its ports
_FROM_CACHE: set = set()


def forget_cache_loaded() -> None:
  """Forgets which executables came from JAX's persistent cache: after `jax.clear_caches()`,
  which frees them (a fresh compile of the same program may then take one's id over)."""
  _FROM_CACHE.clear()


def _taken_from_cache(exe) -> bool:
  """Whether `exe`'s XLA executable came from JAX's persistent cache: this compile's hit
  (`_CACHE_HIT`), or an earlier one's that JAX's in-memory cache returned again."""
  xla = getattr(getattr(exe, "_executable", None), "xla_executable", None)
  if xla is None:
    return _CACHE_HIT.hit
  mark = (id(xla), getattr(xla, "fingerprint", None))
  if _CACHE_HIT.hit:
    _FROM_CACHE.add(mark)
  return mark in _FROM_CACHE


def _mesh_of(args: tuple) -> jax.sharding.AbstractMesh:
  """The abstract mesh of the first argument placed by a NamedSharding (an empty mesh if
  none is)."""
  for x in jax.tree.leaves(args):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
      return sh.mesh.abstract_mesh
  return jax.sharding.AbstractMesh((), ())


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
