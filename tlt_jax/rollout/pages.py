"""The host side of the paged KV cache: which pages of a replica's pool each request holds.

A replica's KV memory is one pool of `num_pages` pages of `page_size` slots (models/
transformer.py's KVCache: the target's layers and the drafter's layer share the page ids).
A request holds the pages its row has reached (prompt + response so far + what the next
chunk can add, `chunk_reach`); its row's page table lists them in slot order. Pages come back
when the request finishes, is preempted, or the generate call ends, so a replica admits rows
by the tokens they hold, not max_batch x max_len (vLLM's block manager, without prefix
sharing: a GRPO group's rows each copy their prompt's pages).

Policy when pages run out (`Engine.generate`): a new request is admitted only while the free
pages cover its prompt and one chunk's reach and leave every live row one chunk's growth
(`admit`); a live row that cannot get the pages its next chunk needs takes them from the
youngest rows (the last admitted: the least work lost), which are preempted: their pages
freed, their requests put back at the head of the queue, recomputed from their prompts
later. A row's randomness is keyed by (request, sample, token index), so a recomputed row
repeats its tokens exactly in plain decoding (greedy or sampled), and greedily under
speculation; sampled under speculation it is a fresh exact sample. Nothing is lost or
changed but time. Pure host code (numpy), tested with fake requests.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from tlt_jax.models.transformer import NO_PAGE


def pages_for(slots: int, page_size: int) -> int:
  return -(-max(slots, 0) // page_size)


class PageAllocator:
  """Pages of one pool: a free list, and each holder's pages in slot order."""

  def __init__(self, num_pages: int, page_size: int, row_pages: int):
    if num_pages < row_pages:
      raise ValueError(f"a KV pool of {num_pages} pages cannot hold one row of {row_pages} "
                       "pages (max_prompt_len + max_new_tokens): raise rollout.kv_pages")
    self.num_pages, self.page_size, self.row_pages = num_pages, page_size, row_pages
    self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
    self._held: dict[Hashable, list[int]] = {}  # in admission order (dicts keep it)

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
    pages = self._held.setdefault(key, [])
    pages.extend(self._free.pop() for _ in range(n))
    return True

  def release(self, key: Hashable) -> None:
    """All of `key`'s pages back to the free list."""
    self._free.extend(reversed(self._held.pop(key, [])))

  def release_all(self) -> None:
    for key in list(self._held):
      self.release(key)

  def table(self, keys: Iterable[Hashable | None]) -> np.ndarray:
    """[len(keys), row_pages] int32 page tables, a row per key (None or a key without pages:
    NO_PAGE throughout, so that row writes nothing)."""
    keys = list(keys)
    out = np.full((len(keys), self.row_pages), NO_PAGE, np.int32)
    for i, key in enumerate(keys):
      pages = self._held.get(key, ()) if key is not None else ()
      out[i, :len(pages)] = pages
    return out
