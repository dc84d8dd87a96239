"""Ahead-of-time compiled executables, one per (function variant, argument shapes).

The analogue of CUDA-graph capture: each batch-size bucket of each decode function is lowered
and compiled once and reused for the whole run, and its compile time and memory
(`memory_analysis()`) are recorded, so the cost of every executable the engine holds is known.
Keys are frozen and hashable: the function's name, its static variant (sampling params,
strategy, kernel choice) and the shapes/dtypes of its arguments.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import threading
import time
import warnings
from typing import Any, Callable, Hashable

import jax

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
  seconds: float
  memory_bytes: int | None  # argument + output + temp bytes from memory_analysis(), if given

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
    key = ExecKey.of(name, variant, args)
    exe = self._compiled.get(key)
    if exe is not None:
      return exe
    batch = batch_of(args)
    t0 = time.perf_counter()
    # Input shardings are committed (params on the worker's mesh), so no mesh context.
    with warnings.catch_warnings():
      # A donated state's page pools pass through in place; its per-row leaves often cannot
      # be reused (another batch size, fewer outputs) and are just freed: not worth a warning.
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    seconds = time.perf_counter() - t0
    mem = None
    try:
      ma = exe.memory_analysis()
      if ma is not None:
        mem = int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - backends without memory analysis
      mem = None
    with self._lock:
      if key not in self._compiled:
        self._compiled[key] = exe
        self.records.append(CompileRecord(key, batch, seconds, mem))
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


def background_compiler(name: str) -> cf.ThreadPoolExecutor:
  """One thread for compiling ahead of need, at the lowest CPU priority (Linux: per-thread
  nice 19, inherited by threads XLA starts from it): compiles fill idle cores (a decode tail
  at batch 1, host work) instead of slowing the rollout and the learner. On an accelerator
  host they overlap device work anyway."""

  def lower_priority():
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
      pass

  return cf.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lower_priority)
