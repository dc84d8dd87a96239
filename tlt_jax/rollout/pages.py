"""The host side of the paged KV cache: which pages of a replica's pool each request holds.

A replica's KV memory is one pool of `num_pages` pages of `page_size` slots (models/
kv_cache.py's KVCache: the target's layers and the drafter's layer share the page ids).
A request holds the pages its row has reached (prompt + response so far + what the next
chunk can add, `chunk_reach`); its row's page table lists them in slot order. Pages come back
when the request finishes, is preempted, or the generate call ends, so a replica admits rows
by the tokens they hold, not max_batch x max_len (vLLM's block manager).

A GRPO group's rows share their prompt's pages (`share_prompts`): a prefill that runs each
distinct prompt once (prefill.py's shared prefill: decode.prefill_shared) writes it into the
first row's pages, and the group's other rows hold those same pages instead of copies of
them, as far as the pages lie wholly before the prompt's last slot (that slot's drafter entry
pairs it with the row's own first token; nothing else ever writes a slot below a row's
length). A row admitted apart from its group holds a live sibling's pages the same way
(call.py's `Call.leader`, `Replica._adopt`). A page goes back to the free list when its last
holder lets it go (a count per page).

Policy when pages run out (`Engine.generate`): a new request is admitted only while the free
pages cover its prompt and one chunk's reach and leave every live row one chunk's growth
(`admission`); a live row that cannot get the pages its next chunk needs takes them from the
youngest rows (the last admitted: the least work lost), which are preempted (`grow_rows`):
their pages freed, their requests put back at the head of the queue with the tokens they had
decoded. A preempted request is resumed, not decoded again: admitted again once the pages
cover its prompt and those tokens (`admission`'s `text_len`), its prompt is prefilled and its
tokens fed back through the target (and a tracked call's drafter) in a few wide forwards
(`Replica._resume`), and it goes on from its next token, whose randomness is keyed by
(request, sample, token index) as before. So a preempted row's response is the one it was
decoding, under speculation too: decoding it again from the prompt would draw a fresh sample
there, and a response that is long is the likelier to be preempted before it ends, so the
responses kept would lean short. Nothing is lost or changed but time. The allocator and the
policy are pure host code (numpy), tested with fake requests; `KVPages` holds the pools
themselves on the replica's devices.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from tlt_jax.models import KVCache, ModelConfig, init_pools, pages_for
from tlt_jax.models.kv_cache import NO_PAGE
from tlt_jax.rollout import decode
from tlt_jax.sharding import cache_sharding


class PageAllocator:
  """Pages of one pool: a free list, each holder's pages in slot order, and how many holders
  each page has (a group's shared prompt pages: more than one)."""

  def __init__(self, num_pages: int, page_size: int, row_pages: int):
    if num_pages < row_pages:
      raise ValueError(f"a KV pool of {num_pages} pages cannot hold one row of {row_pages} "
                       "pages (max_prompt_len + max_new_tokens): raise rollout.kv_pages")
    self.num_pages, self.page_size, self.row_pages = num_pages, page_size, row_pages
    self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
    self._held: dict[Hashable, list[int]] = {}  # in admission order (dicts keep it)
    self._holders = np.zeros((num_pages,), np.int32)  # holders of each page

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def holders(self) -> list[Hashable]:
    """Holders, oldest first."""
    return list(self._held)

  def held(self, key: Hashable) -> int:
    return len(self._held.get(key, ()))

  def need(self, key: Hashable, slots: int) -> int:
    """Pages `key` lacks to hold `slots` slots (capped at a row's pages)."""
    return max(min(pages_for(slots, self.page_size), self.row_pages) - self.held(key), 0)

  def grow(self, key: Hashable, slots: int) -> bool:
    """Gives `key` (a new holder joins at the young end) the pages it lacks to hold `slots`
    slots; False, changing nothing, if there are not enough free."""
    n = self.need(key, slots)
    if n > len(self._free):
      return False
    new = [self._free.pop() for _ in range(n)]
    self._holders[new] = 1
    self._held.setdefault(key, []).extend(new)
    return True

  def share(self, key: Hashable, leader: Hashable, n: int) -> int:
    """`key`'s first n pages become `leader`'s first n (both hold at least n; the pages key
    held there are let go). Returns the pages that went back to the free list."""
    own, lead = self._held[key], self._held[leader]
    if n > min(len(own), len(lead)):
      raise ValueError(f"cannot share {n} pages: {key!r} holds {len(own)}, {leader!r} "
                       f"{len(lead)}")
    freed = self._let_go(own[:n])
    own[:n] = lead[:n]
    self._holders[lead[:n]] += 1
    return freed

  def release(self, key: Hashable) -> None:
    """All of `key`'s pages let go (each back to the free list once no one holds it)."""
    self._let_go(self._held.pop(key, []))

  def _let_go(self, pages: list[int]) -> int:
    self._holders[pages] -= 1
    back = [p for p in reversed(pages) if self._holders[p] == 0]
    self._free.extend(back)
    return len(back)

  def table(self, keys: Iterable[Hashable | None]) -> np.ndarray:
    """[len(keys), row_pages] int32 page tables, a row per key (None or a key without pages:
    NO_PAGE throughout, so that row writes nothing)."""
    keys = list(keys)
    out = np.full((len(keys), self.row_pages), NO_PAGE, np.int32)
    for i, key in enumerate(keys):
      pages = self._held.get(key, ()) if key is not None else ()
      out[i, :len(pages)] = pages
    return out


def share_prompts(pages: PageAllocator, reqs: Sequence[Any]) -> int:
  """After admitting `reqs` (each holding its pages) for a shared prefill (prefill.py's
  `prefill_rows` < the batch: each distinct prompt prefilled once into its first row's
  pages): every later request of a prompt holds the first one's pages wholly before the
  prompt's last slot instead of its own (module docstring). Returns the pages freed."""
  first: dict[tuple[int, ...], Hashable] = {}
  freed = 0
  for r in reqs:
    ids = tuple(int(t) for t in r.prompt_ids)
    leader = first.setdefault(ids, r.key)
    if leader != r.key:
      freed += pages.share(r.key, leader, (len(ids) - 1) // pages.page_size)
  return freed


def admission(pages: PageAllocator, reach: int,
              text_len: Callable[[Any], int] = lambda req: len(req.prompt_ids)
              ) -> Callable[[Any], bool]:
  """The admission rule (module docstring) for the scheduler's `plan`: a request starts if the
  free pages cover its text (`text_len`: its prompt, and a preempted request's tokens so far)
  and one chunk's reach and leave every row already holding pages one chunk's growth; its
  pages are taken at once."""
  def admit(req) -> bool:
    need = pages.need(req.key, text_len(req) + reach)
    if need + len(pages.holders) * pages_for(reach, pages.page_size) > pages.free:
      return False
    return pages.grow(req.key, text_len(req) + reach)
  return admit


def grow_rows(pages: PageAllocator, slots: dict[Hashable, int]) -> list[Hashable]:
  """Before a chunk: every live row (`slots`: its key -> the slots its next chunk can reach)
  gets the pages for them, oldest first; where the pool has too few, the youngest live rows
  are preempted (module docstring) and their pages freed. Returns the preempted keys in the
  order they were chosen: the caller takes their rows out."""
  live, preempted = dict(slots), []
  for key in [k for k in pages.holders if k in live]:
    if key not in live:  # preempted below for an older row
      continue
    while not pages.grow(key, live[key]):
      victim = next(k for k in reversed(pages.holders) if k in live)
      del live[victim]
      pages.release(victim)
      preempted.append(victim)
      if victim == key:
        break
  return preempted


class KVPages:
  """One replica's page pools on its devices (the target's, and the drafter's one layer over
  the same page ids), allocated on first use and kept between generate calls: a generate takes
  them, donates them through its state, and gives the final state's back (`keep`). Page ids
  come from a `PageAllocator` per generate call (`allocator`)."""

  def __init__(self, cfg: ModelConfig, mesh: Mesh, replicated: Sharding, *, num_pages: int,
               page_size: int, row_pages: int):
    self.cfg, self.mesh, self._replicated = cfg, mesh, replicated
    self.num_pages, self.page_size, self.row_pages = num_pages, page_size, row_pages
    self._kept: dict[bool, KVCache] = {}  # the idle pools (target: False, drafter: True)

  def allocator(self) -> PageAllocator:
    return PageAllocator(self.num_pages, self.page_size, self.row_pages)

  def _cfg(self, drafter: bool) -> ModelConfig:
    return self.cfg.replace(num_layers=1) if drafter else self.cfg

  def _init(self, drafter: bool) -> Callable[[], KVCache]:
    return functools.partial(init_pools, self._cfg(drafter), self.num_pages, self.page_size,
                             None, self.row_pages)

  def abstract(self, drafter: bool) -> KVCache:
    """The pools' shapes and shardings (compiling ahead; no memory touched)."""
    cfg = self._cfg(drafter)
    sh = cache_sharding(self.mesh, 0, cfg.num_kv_heads, cfg.num_layers)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(self._init(drafter)), sh)

  def take(self, drafter: bool) -> KVCache:
    """The pools, handed to a generate call (which donates them through its state and gives
    the final state's back, `keep`); allocated on first use."""
    kv = self._kept.pop(drafter, None)
    if kv is not None:
      return kv
    shardings = jax.tree.map(lambda x: x.sharding, self.abstract(drafter))
    return jax.jit(self._init(drafter), out_shardings=shardings)()

  def keep(self, state) -> None:
    """The pools of a generate call's final state (None: nothing to keep) back for the next."""
    if state is not None:
      kv, dkv = decode.pools(state)
      self._kept[False] = kv
      if dkv is not None:
        self._kept[True] = dkv

  def drop(self) -> None:
    """Frees the kept pools (the weights are released; the next generate allocates anew)."""
    self._kept.clear()

  def table(self, pages: PageAllocator, keys: Sequence[Any]) -> jax.Array:
    """The rows' page tables (`PageAllocator.table`) on the replica's devices."""
    return jax.device_put(pages.table(keys), self._replicated)
