"""The compile plan's plain decoding executables: one per (bucket, variant), compiled where the
batch first decodes plainly at a bucket, or with `EngineConfig.compile_ahead` ahead of need.

A rollout starts at its largest bucket and compacts down as rows finish, so the tail meets
every bucket below the first one, each a plain executable compiled in the chunk's own time
the first time a run reaches it: on a GPU cluster a target's decode compiles in ~30 s (the
simulator's price), and a worker whose tail stops for it holds every other worker at the
barrier (the 7B recipe's first step: 5 such compiles per worker, 150 s of a 264-s rollout).
With `compile_ahead`, the first plain chunk of a batch queues the buckets below it on the
engine's compile thread, largest first (the order the batch reaches them), from that chunk's
own state resized (`plan_call.resized`: the shapes and shardings the compacted batch will
have): the tail finds them compiled. Only with paged attention, whose one window (the whole
cache) is known ahead; with the windows' attention a bucket's window is the one its rows
reach then. TLT on and off run the same rule (the baseline's engine is the same engine).

`PlainAhead` is a part of `CompilePlan` (compile_plan.py), which owns what it reads: the model
and engine configs (`cfg`, `ecfg`), the executable cache (`exes`), the compile thread
(`_thread`, `_submit`, `_run_urgent`), the lock, `_abstract`.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from tlt_jax.rollout import decode
from tlt_jax.rollout.sharing import compile_each
from tlt_jax.rollout.plan_call import PlanCall, resized
from tlt_jax.rollout.sampling import SamplingParams

_log = logging.getLogger(__name__)


class PlainAhead:
  """The plain decoding executables (module docstring)."""

  def plain(self, call: PlanCall, static: SamplingParams, hidden: bool, kv_len: int, base):
    """The plain chunk's executable at the base state's bucket (decode.decode_chunk; `static`:
    sampling.plain_variant's, the temperature an argument; `hidden`: it keeps the hidden
    states, a speculating engine's or a capturing call's). `base` may be abstract. It donates
    the state."""
    ecfg = self.ecfg
    fn = functools.partial(decode.decode_chunk, cfg=self.cfg, sp=static,
                           stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                           capture_hidden=hidden, kv_len=kv_len)
    # (an abstract temperature without a sharding: the same executable, shared alike, as
    # the numpy scalar the chunk passes)
    temperature = jax.ShapeDtypeStruct((), jnp.float32)
    return self.exes.get("decode", (static, hidden, kv_len), fn,
                         (call.params, base, temperature), donate=(1,))

  def plain_ahead(self, call: PlanCall, static: SamplingParams, hidden: bool, kv_len: int,
                  base) -> None:
    """Queues on the compile thread the plain executables of the buckets below the base
    state's (a batch decoding plainly at its bucket), each (bucket, variant) once, largest
    first; nothing without `compile_ahead`, compaction, or paged attention (module
    docstring)."""
    ecfg = self.ecfg
    if not (ecfg.compile_ahead and ecfg.compaction and ecfg.reads_pages()):
      return
    variant = (static, hidden, kv_len)
    with self._lock:
      below = [b for b in ecfg.buckets if b < base.batch_size
               and (b, variant) not in self._plain_queued]
      if not below:
        return
      self._plain_queued.update((b, variant) for b in below)
      self._thread(call)
    top = self._abstract(base)

    def job():
      def one(b):
        self._run_urgent()  # (a window or a tracking a running chunk needs goes first)
        self._plain_at(call, static, hidden, kv_len, top, b)

      try:  # (what another worker compiles now: after the rest, loaded from it)
        for _ in compile_each(sorted(below, reverse=True), one, True):
          pass
      except Exception:  # noqa: BLE001 - the chunk compiles what it needs instead
        _log.exception("worker %d: compiling plain decoding ahead failed; each bucket "
                       "compiles on first use", call.worker_id)

    self._submit(job)

  def _plain_at(self, call: PlanCall, static: SamplingParams, hidden: bool, kv_len: int,
                top, bucket: int) -> None:
    """Compiles the plain executable at `bucket` from the abstract state `top` (the compile
    thread)."""
    self.plain(call, static, hidden, kv_len, resized(top, bucket))
