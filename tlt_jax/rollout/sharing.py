"""One compile per program: what the rollout's executable caches share.

Executables are shared by every cache of a process (`shared_key`): one is a function of its
function and static configuration, its arguments' shapes, dtypes and shardings, what it
donates and JAX's tracing context, so engines of one process with the same configuration on
the same devices (a benchmark's plain and speculative engines, a test file's engines) trace,
lower and compile each once. On other devices of the same kind (a run's rollout workers, one
per GPU or tensor-parallel group) the program is the same, compiled once and loaded onto each
worker's devices (port.py: milliseconds, not a compile); in a multi-host run once for the
job, each other process loading it (exchange.py, inside the compile: executables._compile).
A function whose behaviour the key cannot see (a closure) is not shared; `clear_shared` drops
them all. A program is compiled once even when two threads ask for it together
(`compile_once`): the second waits for the first's compile (its compile thread, inside
`deferring()`, compiles what it has queued next first: `compile_each`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Hashable

import jax

from tlt_jax.rollout import port

_log = logging.getLogger(__name__)


# a program (`shared_key`'s, without devices) -> {its devices: (executable, memory bytes,
# compile seconds)}: the process's (module docstring)
_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


# a program -> (the devices it is compiled for, a Future of that compile running now, the
# thread running it): on any thread of the process
_INFLIGHT: dict = {}

# a program -> the devices its executable was compiled for here (not loaded from JAX's
# persistent cache, nor ported: XLA:CPU's executables loaded from the cache, serialized again,
# lost their kernels: "NOT_FOUND: Function ... not found" as they ran, jaxlib 0.12.0.1), and
# that executable made portable (`port.portable`, once, or as another process published it:
# exchange.py): what the other devices load
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


def deferring_now() -> bool:
  """Whether the calling thread is inside `deferring()` (on)."""
  return getattr(_LOCAL, "defer", False)


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


def compile_once(program: Hashable, devices: tuple, share: bool,
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
    return compile_once(program, devices, share, compile_fn)
  return _compile_here(program, devices, share, compile_fn, running)


def _compile_here(program, devices, share, compile_fn, running):
  """Compiles `program` on this thread (`running`: its entry in _INFLIGHT, None: none)."""
  t0 = time.perf_counter()
  try:
    made = compile_fn()
  except BaseException as e:
    if running is not None:
      with _SHARED_LOCK:
        _INFLIGHT.pop(program, None)
      running[1].set_exception(e)
    raise
  remote = made.compile_s is not None  # (loaded from another process's compile)
  hit = (made.exe, made.memory_bytes,
         made.compile_s if remote else time.perf_counter() - t0)
  with _SHARED_LOCK:
    if share:
      hit = _SHARED.setdefault(program, {}).setdefault(devices, hit)
      if devices and not made.cached and hit[0] is made.exe:
        _SOURCES.setdefault(program, devices)
        if made.portable is not None:
          _SERIALIZED.setdefault(program, made.portable)
    if running is not None:
      _INFLIGHT.pop(program, None)
  if running is not None:
    running[1].set_result(hit)
  return hit + (remote and hit[0] is made.exe,)


def _port(program, source: tuple, devices: tuple):
  """`program`'s executable on `source` = (devices, hit) loaded for `devices` (port.py), kept
  for them; None where it cannot be (logged once: the caller compiles)."""
  (src, (exe, mem, compile_s)) = source
  try:
    with _SHARED_LOCK:
      portable = _SERIALIZED.get(program)
    if portable is None:
      portable = port.portable(exe, src)
      with _SHARED_LOCK:
        _SERIALIZED[program] = portable
    loaded = port.port(portable, devices)
  except Exception as e:  # noqa: BLE001 - a backend that cannot serialize or load this one
    port_failed(e)
    return None
  with _SHARED_LOCK:
    hit = _SHARED.setdefault(program, {}).setdefault(devices, (loaded, mem, compile_s))
  return hit + (hit[0] is loaded,)


_PORT_FAILED = False


def port_failed(e: Exception) -> None:
  global _PORT_FAILED
  if not _PORT_FAILED:
    _PORT_FAILED = True
    _log.info("an executable could not be loaded onto other devices (%s: %s); compiled "
              "here instead", type(e).__name__, str(e)[:200])


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


def shared_key(key: Hashable, fn: Callable | None, args: tuple, donate: tuple[int, ...]):
  """(What the executable of `fn` on `args` is a function of, the devices it runs on), None
  where it is not shared: the cache key, the function (None: the key says which), the
  arguments' tree, shardings (their devices by position: port.placement) and weak types, the
  donation, and JAX's tracing context (its configuration: precision, x64, ...)."""
  f = () if fn is None else _fn_key(fn)
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


