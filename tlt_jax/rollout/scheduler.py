"""Slot bookkeeping of one generate call: which request decodes in which row, when the batch
grows, refills or shrinks, and when speculation switches on. Pure host code (no JAX): the
engine (engine.py) turns the plan into device calls, and tests drive it with fake "done"
flags.

Per chunk the engine asks `plan()` for the layout operations to apply before decoding:

  Prefill(requests, bucket)     first batch: prefill `requests` into a new state of `bucket`
                                rows (rows past the requests are empty)
  Resize(idx, valid)            new state = rows `idx` of the old one (rows with valid=False
                                become empty slots): growing for a refill, or compaction
  Refill(requests, slots, bucket)  prefill `requests` at batch `bucket` and write them into
                                free `slots` (continuous batching)

Admission: `plan(admit)` starts queued requests (in order) only while the engine's KV pages
admit them; `preempt(slot)` puts a running request back at the head of the queue (pages.py
has the policy).

Compaction: once the queue is empty, the live rows move into the smallest bucket that holds
them, so 3 stragglers of a 128-batch decode at bucket 4; with `compacts_to` set (the engine
while it speculates, or while the gate's probe at its bucket is not judged yet), the smallest
such bucket it allows, else they stay where they are.

Speculation switches on once the live batch has been <= bs_threshold for `patience`
consecutive checks, and stays on for the rest of the call (the strategy selector can still
choose "off"; the engine switches a batch off where the gate closes its bucket).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Prefill:
  requests: tuple[Any, ...]
  bucket: int


@dataclasses.dataclass(frozen=True)
class Resize:
  idx: tuple[int, ...]  # [new batch] rows of the old state
  valid: tuple[bool, ...]  # [new batch] False: an empty slot


@dataclasses.dataclass(frozen=True)
class Refill:
  requests: tuple[Any, ...]
  slots: tuple[int, ...]  # free rows they go to (len(requests))
  bucket: int  # batch size of their prefill (>= len(requests))


# The compiled batch sizes a worker picks from when the user names none: each bucket is an
# executable (a compile), and doubling keeps a compacted batch at most half empty.
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def buckets_upto(max_batch: int, buckets: Sequence[int] = POWERS_OF_TWO) -> tuple[int, ...]:
  """The compiled batch sizes of a worker of `max_batch` rows: the buckets below it, then
  max_batch itself (a bucket above it would never be used). A tuple that is not strictly
  increasing comes back as given, for EngineConfig to refuse with the user's own value."""
  b = tuple(buckets)
  if not b or list(b) != sorted(set(b)):
    return b
  return tuple(x for x in b if x < max_batch) + (max_batch,)


def bucket_for(buckets: Sequence[int], n: int) -> int:
  """The smallest bucket >= n (the largest when none is)."""
  for b in buckets:
    if b >= n:
      return b
  return buckets[-1]


def length_grid(base: int, cap: int) -> tuple[int, ...]:
  """Sequence lengths compiled for: base x 2^k below `cap`, then `cap` (a cache's length).
  The grid of attention windows (`kv_bucket`): an executable per
  doubling keeps the compiles logarithmic while a window wastes at most half its reads."""
  out, n = [], base
  while n < cap:
    out.append(n)
    n *= 2
  return tuple(out) + (cap,)


def kv_bucket(need: int, base: int, cap: int) -> int:
  """The attention window (`kv_len`) of a chunk whose rows reach `need` cache slots: the
  smallest `length_grid` length holding them (`cap`, the whole cache, at most)."""
  return bucket_for(length_grid(base, cap), need)


class Scheduler:
  """See the module docstring. `requests` are any objects (the engine's Request)."""

  def __init__(self, requests: Sequence[Any], *, max_batch: int, buckets: Sequence[int],
               compaction: bool = True, bs_threshold: int | None = None, patience: int = 1):
    if max_batch < 1 or not buckets or buckets[-1] < max_batch:
      raise ValueError(f"Scheduler: buckets {tuple(buckets)} must reach max_batch={max_batch}")
    if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
      raise ValueError(f"Scheduler: buckets {tuple(buckets)} must be strictly increasing")
    self.max_batch, self.buckets, self.compaction = max_batch, tuple(buckets), compaction
    self.bs_threshold, self.patience = bs_threshold, patience
    self.pending = collections.deque(requests)
    self.slots: list[Any | None] = []  # row -> request (None: empty)
    self.speculating = False
    self._below = 0
    # bucket -> whether the batch may compact to it (None: any); the engine's, while it
    # speculates: only buckets whose speculative executables are ready (none while the
    # gate holds the batch for a probe: gate.holds)
    self.compacts_to: Callable[[int], bool] | None = None

  @property
  def batch(self) -> int:
    return len(self.slots)

  @property
  def live(self) -> list[int]:
    return [i for i, r in enumerate(self.slots) if r is not None]

  @property
  def done(self) -> bool:
    return not self.pending and not any(r is not None for r in self.slots)

  def plan(self, admit: Callable[[Any], bool] | None = None
           ) -> list[Prefill | Resize | Refill]:
    """Layout operations before the next chunk; the slot table reflects them on return.
    admit(request): whether the next queued request may start now (the engine's KV pages;
    None: always); the queue is served in order, so admission stops at the first refusal."""
    ops: list[Prefill | Resize | Refill] = []
    live = self.live
    reqs = self._admit(self.max_batch - len(live), admit)
    if reqs and not self.slots:
      bucket = bucket_for(self.buckets, len(reqs))
      ops.append(Prefill(reqs, bucket))
      self.slots = list(reqs) + [None] * (bucket - len(reqs))
    elif reqs:
      bucket = max(bucket_for(self.buckets, len(live) + len(reqs)), self.batch)
      if bucket != self.batch:  # grow: rows stay in place, empty slots appended
        ops.append(Resize(tuple(i % self.batch for i in range(bucket)),
                          tuple(i < self.batch for i in range(bucket))))
        self.slots += [None] * (bucket - self.batch)
      free = [i for i, r in enumerate(self.slots) if r is None]
      ops.append(Refill(reqs, tuple(free[:len(reqs)]), bucket_for(self.buckets, len(reqs))))
      for s, r in zip(free, reqs):
        self.slots[s] = r
    live = self.live
    if self.compaction and not self.pending and live:
      bucket = next((b for b in self.buckets if len(live) <= b < self.batch
                     and (self.compacts_to is None or self.compacts_to(b))), self.batch)
      if bucket < self.batch:
        pad = bucket - len(live)
        ops.append(Resize(tuple(live + [live[0]] * pad),
                          tuple([True] * len(live) + [False] * pad)))
        self.slots = [self.slots[i] for i in live] + [None] * pad
    return ops

  def _admit(self, room: int, admit: Callable[[Any], bool] | None) -> tuple[Any, ...]:
    """Up to `room` requests from the head of the queue, while `admit` lets them in."""
    out = []
    while self.pending and len(out) < room and (admit is None or admit(self.pending[0])):
      out.append(self.pending.popleft())
    return tuple(out)

  def preempt(self, slot: int) -> Resize:
    """The request in `slot` goes back to the head of the queue (recomputed when it is
    admitted again); returns the layout op that empties its row."""
    req = self.finish(slot)
    self.pending.appendleft(req)
    return Resize(tuple(range(self.batch)), tuple(r is not None for r in self.slots))

  def check_speculation(self) -> bool:
    """Once per chunk, after `plan`: whether this chunk speculates (see the docstring)."""
    if self.bs_threshold is not None and not self.speculating:
      self._below = self._below + 1 if len(self.live) <= self.bs_threshold else 0
      self.speculating = self._below >= self.patience
    return self.speculating

  def finish(self, slot: int) -> Any:
    """The request in `slot` is done; its row becomes free. Returns the request."""
    req = self.slots[slot]
    if req is None:
      raise ValueError(f"slot {slot} holds no request")
    self.slots[slot] = None
    return req
