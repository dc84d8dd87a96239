"""The history index as the engine holds it: `HistoryIndex`, the suffix index
(suffix_index.py: what a draft is, how it is found, its costs) with its updates off the
engine's critical path.

On an accelerator's host, `HistoryIndex` queues begin/extend/end for one worker thread and
returns; drafts and stats wait for what was queued before them (identical results). The
engine's chunk loop thus ingests chunk k's tokens while chunk k+1 runs on the device; a
history arm's draft after each step still waits for that step's extend (inherent).

Measured: the engine with the index (bench_history --overlap: default model, 8 prompts x 8
samples at temperature 1, arm 4_1_5, 256 tokens a row, SYNTHETIC load: each row's tokens also
fed to 63 shadow rows; 3 interleaved rounds): replaying one run's 11 chunks with their decode
times (10.8 s) as sleeps, i.e. a device that needs no host core as on a GPU host, per token
over no index: synchronous 1.062x, background 1.006x. On the CPU backend itself the "device"
is the same 2 loaded cores, and the worker loses: none 522, sync 472, background 609
us/token (the worker's updates took 6.1 s of wall time there vs 0.7 s inline: it waits for
the GIL and a core). So the worker runs only where the model runs on an accelerator
(`HistoryIndex(background=None)`, the default); on the CPU backend updates apply inline, same
results. Untested on a GPU host.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import numpy as np

from tlt_jax.rollout.sources.suffix_index import Draft, SuffixIndex, checked_ids


class HistoryIndex:
  """The history index (`SuffixIndex`, suffix_index.py) with its updates off the caller's
  thread (module docstring).

  begin/extend/end queue the update and return; one worker thread applies them in order and,
  whenever its queue runs dry, settles the new positions (registers or sorts them), so the
  engine's device chunk runs while the previous chunk's tokens are ingested (XLA and numpy's
  sorts release the GIL). draft/stats first wait until everything queued before them is
  applied, then run on the caller's thread: a draft sees exactly the text a synchronous index
  would, so results are identical. An update that raises in the worker (an unknown seq_key, a
  token id out of range) raises on the caller's next call; the updates queued after it are
  skipped, as a synchronous caller would never have made them. close() stops the worker and
  raises a pending error too. Updates come from one thread (the engine's: their order is
  the text); draft/stats may come from any (the train loop's stats: a lock keeps the worker
  out while they read). Updates copy their arguments (the caller may reuse its buffers);
  begin checks the prompt's ids at once."""

  def __init__(self, *, background: bool | None = None, **index_kw):
    """background: apply updates on the worker thread (None: where the model runs on an
    accelerator, so host cores are free while it decodes; on the CPU backend XLA's compute
    needs the cores and the worker only competes with it: measured slower there, module
    docstring). Without it updates apply on the caller's thread, same results."""
    if background is None:
      import jax  # only to ask where the model runs
      background = jax.default_backend() != "cpu"
    self.background = bool(background)
    self._index = SuffixIndex(**index_kw)
    self._q: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args) | Event (barrier) | None
    self._error: list = []  # the worker's exception, until raised on the caller's thread
    self._wait_s = 0.0      # caller time spent waiting for the worker (draft, stats)
    self._closed = False
    self._lock = threading.Lock()  # held by the worker while it applies, by readers
    self._thread = None
    if self.background:
      self._thread = threading.Thread(target=_work,
                                      args=(self._q, self._index, self._error, self._lock),
                                      name="history-index", daemon=True)
      self._thread.start()
      # an index dropped without close() stops its worker (which holds no reference to it)
      self._stop = weakref.finalize(self, self._q.put, None)

  def begin(self, prompt_key, seq_key, prompt_ids) -> None:
    self._put(self._index.begin, prompt_key, seq_key, checked_ids(np.array(prompt_ids, np.int64)))

  def extend(self, seq_key, tokens) -> None:
    self._put(self._index.extend, seq_key, np.array(tokens))

  def end(self, seq_key, keep: bool = True) -> None:
    self._put(self._index.end, seq_key, keep)

  def draft(self, seq_key, max_tokens: int, *, topk: int = 1,
            max_nodes: int | None = None) -> Draft:
    self._sync()
    with self._lock:
      return self._index.draft(seq_key, max_tokens, topk=topk, max_nodes=max_nodes)

  def stats(self) -> dict:
    self._sync()
    with self._lock:
      return {**self._index.stats(), "wait_s": self._wait_s}

  def close(self) -> None:
    """Stops the worker once the queue is applied; raises the worker's pending exception."""
    if not self._closed:
      self._closed = True
      if self._thread is not None:
        self._stop()
        self._thread.join()
    self._raise()

  def _put(self, fn, *args):
    if self._error:
      self._raise()
    if self._closed:
      raise RuntimeError("HistoryIndex: closed")
    if self._thread is None:
      with self._lock:
        fn(*args)
      return
    self._q.put((fn, args))

  def _sync(self):
    """Waits until the worker has applied everything queued so far."""
    if self._closed:
      self._raise()
      raise RuntimeError("HistoryIndex: closed")
    if self._thread is None:
      return
    t0 = time.perf_counter()
    done = threading.Event()
    self._q.put(done)
    done.wait()
    self._wait_s += time.perf_counter() - t0
    self._raise()

  def _raise(self):
    if self._error:
      if not self._closed and self._thread is not None:  # queued updates after it: skipped
        done = threading.Event()
        self._q.put(done)
        done.wait()
      raise self._error.pop()


def _work(q: queue.SimpleQueue, index: SuffixIndex, error: list, lock: threading.Lock):
  """The worker thread: applies queued updates in order (none after a failed one until the
  caller has raised it), releases barriers, settles the index whenever the queue is empty."""
  while True:
    item = q.get()
    if item is None:
      return
    if isinstance(item, threading.Event):
      item.set()
      continue
    if error:
      continue
    try:
      fn, args = item
      with lock:
        fn(*args)
        if q.empty():
          index.settle()
    except Exception as e:  # noqa: BLE001 (raised again on the caller's thread)
      error.append(e)
