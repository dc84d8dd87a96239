"""The paged KV cache's host side (rollout/pages.py: the allocator, the admission and
preemption policy) and the scheduler's admission and preemption, against hand-worked
expectations."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tlt_jax.models.kv_cache import NO_PAGE
from tlt_jax.models import pages_for
from tlt_jax.rollout.pages import PageAllocator, admission, grow_rows, share_prompts
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize, Scheduler


def test_allocator_hands_out_frees_and_tables_pages():
  a = PageAllocator(num_pages=6, page_size=4, row_pages=3)
  assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2
  assert a.grow("x", 5) and a.held("x") == 2 and a.free == 4  # 5 slots: 2 pages
  assert a.grow("y", 4) and a.grow("x", 8) and a.held("x") == 2  # already enough
  assert a.need("x", 100) == 1  # capped at a row's 3 pages
  assert a.grow("z", 12) and a.free == 0  # the last 3 pages
  assert not a.grow("w", 1) and a.held("w") == 0 and "w" not in a.holders  # none left
  assert a.holders == ["x", "y", "z"]  # admission order
  t = a.table(["y", None, "x"])
  assert t.shape == (3, 3) and t.dtype == np.int32
  assert (t[1] == NO_PAGE).all() and (t[0, 1:] == NO_PAGE).all()
  assert len({*t[0, :1], *t[2, :2]}) == 3  # no page held twice
  before = a.free
  a.release("x")
  assert a.free == before + 2 and a.held("x") == 0 and "x" not in a.holders
  full = PageAllocator(3, 4, 3)
  assert full.grow("a", 8) and not full.grow("b", 8) and full.held("b") == 0  # refused: intact
  with pytest.raises(ValueError, match="kv_pages"):
    PageAllocator(2, 4, 3)


def test_a_rows_page_table_lists_its_pages_in_slot_order():
  """Pages are handed out lowest id first; a row's table lists its pages in the order it got
  them (slot order: page j holds slots [j x page_size, (j + 1) x page_size))."""
  a = PageAllocator(num_pages=6, page_size=4, row_pages=3)
  assert a.grow("x", 5) and a.grow("y", 1) and a.grow("x", 9)  # x: 0, 1; y: 2; x: 3
  np.testing.assert_array_equal(a.table(["x", "y"]), [[0, 1, 3], [2, NO_PAGE, NO_PAGE]])


def test_admission_leaves_live_rows_a_chunk_and_growth_preempts_the_youngest():
  req = lambda key, n: types.SimpleNamespace(key=key, prompt_ids=[1] * n)
  a = PageAllocator(num_pages=6, page_size=4, row_pages=3)
  admit = admission(a, reach=4)  # one page of growth per row
  assert admit(req("a", 4)) and a.held("a") == 2  # prompt + reach: 8 slots
  assert admit(req("b", 4)) and a.free == 2  # 2 pages + 1 for a's growth <= 4 free
  assert not admit(req("c", 1)) and "c" not in a.holders  # 2 + 2 rows' growth > 2 free
  b = PageAllocator(num_pages=5, page_size=4, row_pages=3)
  assert b.grow("x", 8) and b.grow("y", 8) and b.grow("z", 4) and b.free == 0
  assert grow_rows(b, {"x": 8, "y": 8, "z": 4}) == []  # all covered already
  # x (oldest) gets z's page; then y finds none and is the youngest left: preempted itself
  assert grow_rows(b, {"x": 12, "y": 12, "z": 8}) == ["z", "y"]
  assert b.holders == ["x"] and b.held("x") == 3 and b.free == 2


def test_admission_takes_the_last_free_page_when_it_exactly_covers_the_rule():
  """A request is admitted while the free pages COVER its prompt + reach and every holder's
  growth: 5 pages of 4 slots, reach 4 (one page a row); a takes 2 (8 slots), b needs 2 + 1
  for a's growth = 3 = the 3 free pages: admitted, 1 page left."""
  req = lambda key, n: types.SimpleNamespace(key=key, prompt_ids=[1] * n)
  a = PageAllocator(num_pages=5, page_size=4, row_pages=3)
  admit = admission(a, reach=4)
  assert admit(req("a", 4)) and a.free == 3
  assert admit(req("b", 4)) and a.free == 1 and a.holders == ["a", "b"]
  assert not admit(req("c", 1))  # 1 page + 2 rows' growth > 1 free


def test_a_groups_rows_hold_their_prompts_whole_pages_once():
  """share_prompts: a group's later rows give back their copies of the pages wholly before the
  prompt's last slot and hold the first row's; a page returns to the free list only when its
  last holder lets it go; growth past the prompt takes a row's own pages."""
  req = lambda key, ids: types.SimpleNamespace(key=key, prompt_ids=ids)  # noqa: E731
  a = PageAllocator(num_pages=14, page_size=4, row_pages=4)
  p9, p5 = [7] * 9, [3] * 5  # 9 tokens: slots 0-7 (2 pages) before its last; 5: 1 page
  reqs = [req("a", p9), req("b", p9), req("c", p5), req("d", p9), req("e", p5)]
  for r in reqs:
    assert a.grow(r.key, len(r.prompt_ids) + 1)  # a, b, d: 3 pages; c, e: 2
  assert a.free == 1
  assert share_prompts(a, reqs) == 2 + 2 + 1 and a.free == 6
  t = a.table(["a", "b", "d", "c", "e"])
  np.testing.assert_array_equal(t[0, :2], t[1, :2])
  np.testing.assert_array_equal(t[0, :2], t[2, :2])
  assert t[3, 0] == t[4, 0] and t[3, 1] != t[4, 1]
  assert len({*t[0, :3], t[1, 2], t[2, 2], *t[3, :2], t[4, 1]}) == 8  # the rest: their own
  assert share_prompts(a, [req("x", [1] * 4)]) == 0  # alone: nothing shared
  with pytest.raises(ValueError, match="cannot share 3 pages"):
    a.share("c", "a", 3)
  assert a.grow("b", 16) and a.held("b") == 4 and a.free == 5  # its own fourth page
  a.release("a")  # its 2 shared pages stay with b and d
  assert a.free == 6 and a.table(["b"])[0, 0] == t[0, 0]
  a.release("b")
  assert a.free == 8
  a.release("d")  # the last holder of the prompt's pages
  assert a.free == 11
  # preempting a row that shares frees its own pages only
  assert grow_rows(a, {"c": 16, "e": 16}) == [] and a.free == 7
  a.release("e")  # its own 3 pages; the shared one stays with c
  assert a.free == 10 and a.held("c") == 4
  a.release("c")
  assert a.free == 14 and sorted(a._free) == list(range(14))  # every page back, once


def test_scheduler_admits_in_order_while_allowed_and_requeues_preempted_rows():
  sched = Scheduler(list("abcde"), max_batch=4, buckets=(1, 2, 4))
  budget = {"n": 2}

  def admit(req):
    if budget["n"] == 0:
      return False
    budget["n"] -= 1
    return True

  ops = sched.plan(admit)
  assert ops == [Prefill(("a", "b"), 2)] and list(sched.pending) == list("cde")
  assert sched.plan(admit) == []  # no pages: nothing admitted, nothing skipped
  op = sched.preempt(1)  # "b" goes back to the head of the queue; its row empties
  assert op == Resize((0, 1), (True, False)) and list(sched.pending) == list("bcde")
  budget["n"] = 3
  ops = sched.plan(admit)
  assert ops[0] == Resize((0, 1, 0, 1), (True, True, False, False))
  assert ops[1] == Refill(("b", "c", "d"), (1, 2, 3), 4)
  assert sched.slots == ["a", "b", "c", "d"] and list(sched.pending) == ["e"]


def test_slot_addresses_follow_each_rows_table_and_drop_what_is_outside_it():
  """slot_addr: slot s of row b is offset s % page of the row's page table[b, s // page];
  slots before 0 or at or past the row's max_len (R pages) go nowhere (NO_PAGE: a write
  there is dropped, never wrapped into the row's last page)."""
  import jax.numpy as jnp

  from tlt_jax.models import ModelConfig, init_cache
  from tlt_jax.models.kv_cache import slot_addr
  cfg = ModelConfig(arch="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=2, num_kv_heads=1)
  cache = init_cache(cfg, 2, 10, page_size=4)  # 3 pages a row: 12 slots
  table = np.asarray(cache.table)
  assert cache.max_len == 12 and table.shape == (2, 3)
  slots = np.array([[-1, 0, 3, 4, 11, 12, 17], [5, 8, 9, 12, 0, -4, 2]], np.int32)
  page, offset = map(np.asarray, slot_addr(cache, jnp.asarray(slots)))
  for b in range(2):
    for t, s in enumerate(slots[b]):
      if 0 <= s < 12:
        assert page[b, t] == table[b, s // 4] and offset[b, t] == s % 4, (b, s)
      else:
        assert page[b, t] == NO_PAGE, (b, s)
