"""tlt_jax.rollout.scheduler: slot bookkeeping of one generate call (pure host code).

Tested against an independent simulation of the engine's device state: the test keeps its own
list of row contents and applies every planned op exactly as the module docstring documents
it (Prefill -> `bucket` rows, requests first; Resize(idx, valid) -> [old[i] if valid else
None]; Refill -> requests written into `slots`), then checks that this simulated state equals
the scheduler's slot table after every plan (the invariant the engine relies on). Request
bookkeeping (each request decoded for exactly its own number of chunks, queue order, batch
bounds, compaction targets, speculation switching) is checked against brute-force or
hand-computed expectations from the docstrings, never against the scheduler's own output.
"""

import dataclasses
import random

import pytest

from tlt_jax.rollout.scheduler import (POWERS_OF_TWO, Prefill, Refill, Resize, Scheduler,
                                       bucket_for, buckets_upto, kv_bucket, length_grid)


@dataclasses.dataclass(frozen=True)
class Req:
  """A fake request: `chunks` is how many decode chunks it needs before it is done."""
  rid: int
  chunks: int


def apply_op(rows, op):
  """The documented effect of one op on the (simulated) device rows."""
  if isinstance(op, Prefill):
    assert len(op.requests) <= op.bucket
    return list(op.requests) + [None] * (op.bucket - len(op.requests))
  if isinstance(op, Resize):
    assert len(op.idx) == len(op.valid)
    assert all(0 <= i < len(rows) for i in op.idx), (op.idx, len(rows))
    return [rows[i] if ok else None for i, ok in zip(op.idx, op.valid)]
  if isinstance(op, Refill):
    assert len(op.requests) == len(op.slots) >= 1
    assert op.bucket >= len(op.requests)
    assert len(set(op.slots)) == len(op.slots)
    new = list(rows)
    for slot, req in zip(op.slots, op.requests):
      assert new[slot] is None, f"refill overwrites live row {slot}"
      new[slot] = req
    return new
  raise AssertionError(f"unknown op {op!r}")


def brute_bucket(buckets, n):
  """Smallest bucket >= n, else the largest (the docstring), by exhaustive search."""
  fits = [b for b in buckets if b >= n]
  return min(fits) if fits else max(buckets)


def brute_speculation(lives, threshold, patience):
  """on[i]: some run of `patience` consecutive checks with live <= threshold ends at <= i."""
  on, seen = [], False
  for i in range(len(lives)):
    lo = i - patience + 1
    if threshold is not None and lo >= 0 and all(x <= threshold for x in lives[lo:i + 1]):
      seen = True
    on.append(seen)
  return on


def simulate(requests, *, max_batch, buckets, compaction=True, bs_threshold=None, patience=1,
             rng=None):
  """Drives a Scheduler the way the engine does and checks every invariant on the way.

  Each chunk: plan -> apply ops to the simulated rows -> check_speculation -> every live row
  decodes one chunk -> rows whose request has had its `chunks` finish (in random order).
  Returns a trace for scenario-specific checks."""
  rng = rng or random.Random(0)
  s = Scheduler(requests, max_batch=max_batch, buckets=buckets, compaction=compaction,
                bs_threshold=bs_threshold, patience=patience)
  rows = []
  queue = list(requests)  # our own model of the pending queue
  entered = []  # requests in the order they reached the device
  decoded = {r.rid: 0 for r in requests}
  finished = []
  trace = {"ops": [], "batches": [], "lives": [], "queued": [], "spec": []}
  max_bucket = max(buckets)
  for _ in range(10 * sum(r.chunks for r in requests) + 10):
    if s.done:
      break
    live_before = sum(r is not None for r in rows)
    batch_before = len(rows)
    queued_before = len(queue)
    ops = s.plan()
    for op in ops:
      if isinstance(op, (Prefill, Refill)):
        n = len(op.requests)
        assert list(op.requests) == queue[:n], "requests leave the queue in order"
        del queue[:n]
        entered.extend(op.requests)
      rows = apply_op(rows, op)
    trace["ops"].append(ops)
    # The engine's invariant: the simulated device rows are the scheduler's slot table.
    assert rows == s.slots
    assert s.batch == len(rows)
    live = [i for i, r in enumerate(rows) if r is not None]
    assert s.live == live
    assert len(rows) <= max_bucket and len(rows) in buckets
    assert len(live) <= max_batch
    # No request sits in two rows.
    assert len({rows[i].rid for i in live}) == len(live)
    # Continuous batching: free capacity is filled from the queue right away.
    assert len(live) == min(max_batch, live_before + queued_before)
    # Nothing is lost: requests that entered and are not finished are exactly the live rows.
    assert {rows[i].rid for i in live} == ({r.rid for r in entered} - set(finished))
    if not queue and live:
      if compaction:
        assert len(rows) == brute_bucket(buckets, len(live))
      elif queued_before == 0:
        assert len(rows) == batch_before and ops == [], "compaction=False: the batch stays"
    if not compaction:
      assert len(rows) >= batch_before, "compaction=False never shrinks the batch"
    spec = s.check_speculation()
    trace["batches"].append(len(rows))
    trace["lives"].append(len(live))
    trace["queued"].append(len(queue))
    trace["spec"].append(spec)
    for i in live:
      decoded[rows[i].rid] += 1
    done_rows = [i for i in live if decoded[rows[i].rid] >= rows[i].chunks]
    rng.shuffle(done_rows)
    for i in done_rows:
      got = s.finish(i)
      assert got is rows[i]
      finished.append(got.rid)
      rows[i] = None
      with pytest.raises(ValueError):
        s.finish(i)  # a row can finish only once
  assert s.done, "scheduler never finished"
  assert not queue
  assert entered == list(requests), "every request enters once, in queue order"
  assert sorted(finished) == sorted(r.rid for r in requests)
  assert all(decoded[r.rid] == r.chunks for r in requests), "each decoded exactly once"
  trace["finished"] = finished
  return s, trace


def random_buckets(rng):
  pool = [1, 2, 3, 4, 6, 8, 12, 16]
  k = rng.randint(1, 5)
  return tuple(sorted(rng.sample(pool, k)))


# ---------------------------------------------------------------------------- bucket_for
def test_bucket_for_is_the_smallest_fitting_bucket_else_the_largest():
  assert bucket_for((1, 2, 4), 0) == 1
  assert bucket_for((1, 2, 4), 1) == 1
  assert bucket_for((1, 2, 4), 3) == 4
  assert bucket_for((1, 2, 4), 4) == 4
  assert bucket_for((1, 2, 4), 9) == 4
  assert bucket_for((8,), 1) == 8
  rng = random.Random(1)
  for _ in range(300):
    buckets = random_buckets(rng)
    n = rng.randint(0, 20)
    assert bucket_for(buckets, n) == brute_bucket(buckets, n)


# -------------------------------------------------------------------------- buckets_upto
def test_buckets_upto_is_the_buckets_below_max_batch_then_max_batch():
  assert buckets_upto(1) == (1,)
  assert buckets_upto(8) == (1, 2, 4, 8)
  assert buckets_upto(48) == (1, 2, 4, 8, 16, 32, 48)
  assert buckets_upto(1000)[-2:] == (512, 1000)
  assert buckets_upto(6, (2, 8)) == (2, 6)
  assert buckets_upto(2, (2, 8)) == (2,)
  assert buckets_upto(4, (8, 2)) == (8, 2)  # not increasing: as given, for EngineConfig to refuse
  assert buckets_upto(4, ()) == ()
  assert POWERS_OF_TWO == tuple(2 ** i for i in range(10))
  rng = random.Random(2)
  for _ in range(200):
    buckets, m = random_buckets(rng), rng.randint(1, 20)
    out = buckets_upto(m, buckets)
    # every bucket a worker of m rows can use, plus m itself, and nothing above it
    assert out == tuple(sorted({b for b in buckets if b < m} | {m}))
    assert all(bucket_for(out, n) >= n for n in range(1, m + 1))


# ----------------------------------------------------------------------- hand-checked cases
def test_kv_bucket_is_the_smallest_doubling_of_base_that_holds_need_capped_at_the_cache():
  assert length_grid(16, 100) == (16, 32, 64, 100)
  assert length_grid(16, 64) == (16, 32, 64)
  assert length_grid(128, 100) == (100,)
  for base in (1, 3, 16):
    for cap in (1, 5, 64, 100):
      for need in range(0, cap + 3):
        fits = [base * 2 ** k for k in range(12) if need <= base * 2 ** k < cap]
        assert kv_bucket(need, base, cap) == (fits[0] if fits else cap), (need, base, cap)


def test_hand_checked_refill_into_lowest_free_slot_then_compaction():
  """5 requests, max_batch 4, buckets (1, 2, 4), worked out from the docstring."""
  r = [Req(i, 1) for i in range(5)]
  s = Scheduler(r, max_batch=4, buckets=(1, 2, 4))
  assert s.plan() == [Prefill((r[0], r[1], r[2], r[3]), 4)]
  assert s.slots == [r[0], r[1], r[2], r[3]]
  assert s.finish(1) is r[1] and s.finish(2) is r[2]
  # 2 live + 1 pending -> no growth (bucket 4 already), r4 into the lowest free slot at a
  # prefill batch of 1; 3 live still need bucket 4: no compaction.
  assert s.plan() == [Refill((r[4],), (1,), 1)]
  assert s.slots == [r[0], r[4], None, r[3]]
  s.finish(0)
  # Queue empty, live rows 1 and 3 -> bucket 2.
  assert s.plan() == [Resize((1, 3), (True, True))]
  assert s.slots == [r[4], r[3]]
  assert s.plan() == []  # nothing changed: nothing to do
  s.finish(1)
  assert s.plan() == [Resize((0,), (True,))]
  assert s.slots == [r[4]]
  assert not s.done
  s.finish(0)
  assert s.done
  assert s.plan() == []


def test_hand_checked_compaction_pads_with_empty_rows():
  r = [Req(i, 1) for i in range(7)]
  s = Scheduler(r, max_batch=8, buckets=(4, 8))
  assert s.plan() == [Prefill(tuple(r), 8)]
  assert s.slots == r + [None]
  for i in (0, 1, 2, 3, 4):
    s.finish(i)
  # live rows 5, 6 -> bucket 4: rows 5, 6 then two empty slots.
  ops = s.plan()
  assert len(ops) == 1 and isinstance(ops[0], Resize)
  assert ops[0].idx[:2] == (5, 6) and ops[0].valid == (True, True, False, False)
  assert s.slots == [r[5], r[6], None, None]


def test_no_compaction_while_requests_wait_for_admission():
  """Compaction waits for the queue to empty: 5 requests at max_batch 4, the fifth not
  admitted (the KV pages refuse it), 3 rows finished: the batch stays at 4 (the refused
  request refills it once admitted), and compacts once it is in."""
  r = [Req(i, 1) for i in range(5)]
  s = Scheduler(r, max_batch=4, buckets=(1, 2, 4))
  assert s.plan() == [Prefill(tuple(r[:4]), 4)]
  for i in (0, 1, 2):
    s.finish(i)
  assert s.plan(admit=lambda req: False) == [] and s.batch == 4 and list(s.pending) == [r[4]]
  # admitted into the lowest free slot; the queue is empty: 2 live rows compact to 2
  assert s.plan() == [Refill((r[4],), (0,), 1), Resize((0, 3), (True, True))]
  assert s.slots == [r[4], r[3]]


def test_a_prefill_starts_only_the_first_batch():
  """Once the call has a batch, requests admitted after every row has finished (or been
  preempted) refill it: the state and its rows stay, only the first batch is a Prefill."""
  r = [Req(i, 1) for i in range(3)]
  s = Scheduler(r, max_batch=2, buckets=(1, 2), compaction=False)
  assert s.plan() == [Prefill((r[0], r[1]), 2)]
  s.finish(0)
  s.finish(1)
  assert s.plan() == [Refill((r[2],), (0,), 1)] and s.slots == [r[2], None]


def test_compaction_goes_only_where_the_engine_allows():
  """A speculating batch compacts only to buckets whose executables are ready (the engine's
  `compacts_to`): the smallest allowed one that holds the live rows, else it stays."""
  r = [Req(i, 1) for i in range(16)]
  s = Scheduler(r, max_batch=16, buckets=(1, 2, 4, 8, 16))
  s.plan()
  for i in range(13):
    s.finish(i)
  s.compacts_to = lambda b: b == 16  # nothing smaller compiled: 3 rows stay at 16
  assert s.plan() == [] and s.batch == 16
  s.compacts_to = lambda b: b in (8, 16)  # 4 would hold them, 8 is the smallest allowed
  ops = s.plan()
  assert len(ops) == 1 and isinstance(ops[0], Resize) and s.batch == 8
  assert s.slots[:3] == r[13:] and s.slots[3:] == [None] * 5
  s.compacts_to = None  # plain decoding: any bucket
  s.plan()
  assert s.batch == 4


def test_hand_checked_small_batch_prefill_and_max_batch_below_bucket():
  # 3 requests, buckets (1, 2, 4): one prefill at bucket 4, one empty row.
  r = [Req(i, 1) for i in range(3)]
  s = Scheduler(r, max_batch=4, buckets=(1, 2, 4))
  assert s.plan() == [Prefill(tuple(r), 4)]
  assert s.slots == r + [None]
  # max_batch 5 with buckets (2, 8): prefill 5 at bucket 8; live never exceeds 5.
  r = [Req(i, 1) for i in range(9)]
  s = Scheduler(r, max_batch=5, buckets=(2, 8))
  assert s.plan() == [Prefill(tuple(r[:5]), 8)]
  s.finish(0)
  assert s.plan() == [Refill((r[5],), (0,), 2)]  # one free live seat, not three
  assert len(s.live) == 5 and s.batch == 8


def test_hand_checked_speculation_after_patience_checks():
  r = [Req(i, 1) for i in range(5)]
  s = Scheduler(r, max_batch=4, buckets=(1, 2, 4), bs_threshold=2, patience=2)
  s.plan()
  assert s.check_speculation() is False  # live 4
  s.finish(1)
  s.finish(2)
  s.plan()
  assert s.check_speculation() is False  # live 3 (r4 refilled)
  s.finish(0)
  s.plan()
  assert s.check_speculation() is False  # live 2: first check below, patience 2
  s.finish(0)
  s.plan()
  assert s.check_speculation() is True  # live 1: second consecutive check
  assert s.speculating


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("max_batch,buckets", [(5, (1, 2, 4)), (0, (1, 2)), (1, ()),
                                               (16, (8,))])
def test_max_batch_beyond_the_buckets_reach_raises(max_batch, buckets):
  with pytest.raises(ValueError):
    Scheduler([Req(0, 1)], max_batch=max_batch, buckets=buckets)


def test_finish_on_an_empty_slot_raises():
  r = [Req(i, 1) for i in range(3)]
  s = Scheduler(r, max_batch=4, buckets=(4,))
  s.plan()
  with pytest.raises(ValueError):
    s.finish(3)  # padding row of the prefill
  s.finish(0)
  with pytest.raises(ValueError):
    s.finish(0)
  assert s.slots == [None, r[1], r[2], None]  # the failed calls changed nothing


def test_no_requests_is_done_at_once():
  s = Scheduler([], max_batch=2, buckets=(2,))
  assert s.done and s.plan() == [] and s.slots == []


# ------------------------------------------------------------------------- randomized
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("compaction", [True, False])
def test_random_scenarios_keep_device_state_equal_to_slot_table(seed, compaction):
  """Random buckets, max_batch, request counts and done patterns; all invariants checked in
  `simulate` after every plan."""
  rng = random.Random(1000 * seed + compaction)
  buckets = random_buckets(rng)
  max_batch = rng.randint(1, buckets[-1])
  n = rng.randint(0, 40)
  requests = [Req(i, rng.choice([1, 1, 2, 3, 5, 9, 20])) for i in range(n)]
  simulate(requests, max_batch=max_batch, buckets=buckets, compaction=compaction, rng=rng)


@pytest.mark.parametrize("seed", range(6))
def test_compaction_false_keeps_the_batch_once_the_queue_is_empty(seed):
  rng = random.Random(seed)
  requests = [Req(i, rng.randint(1, 12)) for i in range(rng.randint(5, 30))]
  _, tr = simulate(requests, max_batch=8, buckets=(1, 2, 4, 8), compaction=False, rng=rng)
  assert set(tr["batches"]) == {bucket_for((1, 2, 4, 8), min(len(requests), 8))}
  assert all(not any(isinstance(o, Resize) for o in ops) for ops in tr["ops"])


@pytest.mark.parametrize("seed", range(6))
def test_compaction_true_shrinks_straggler_batches(seed):
  """A long tail (one request much longer than the rest) ends at the smallest bucket."""
  rng = random.Random(seed)
  requests = [Req(i, rng.randint(1, 4)) for i in range(20)] + [Req(20, 40)]
  _, tr = simulate(requests, max_batch=8, buckets=(1, 2, 4, 8), compaction=True, rng=rng)
  assert tr["batches"][0] == 8
  assert tr["batches"][-1] == 1 and tr["lives"][-1] == 1
  # Never more rows than the bucket of the live count once the queue has drained.
  drained = [i for i, q in enumerate(tr["queued"]) if q == 0]
  assert drained
  for i in drained:
    assert tr["batches"][i] == brute_bucket((1, 2, 4, 8), tr["lives"][i])
  # and the batch only ever shrinks from then on
  tail = [tr["batches"][i] for i in drained]
  assert tail == sorted(tail, reverse=True)


@pytest.mark.parametrize("seed", range(8))
def test_speculation_switches_on_after_patience_consecutive_small_batches(seed):
  rng = random.Random(seed)
  buckets = (1, 2, 4, 8)
  threshold = rng.randint(1, 4)
  patience = rng.randint(1, 4)
  requests = [Req(i, rng.randint(1, 15)) for i in range(rng.randint(3, 25))]
  _, tr = simulate(requests, max_batch=8, buckets=buckets, bs_threshold=threshold,
                   patience=patience, rng=rng)
  assert tr["spec"] == brute_speculation(tr["lives"], threshold, patience)
  # stays on once on
  first = tr["spec"].index(True) if True in tr["spec"] else len(tr["spec"])
  assert all(tr["spec"][first:])


@pytest.mark.parametrize("seed", range(4))
def test_speculation_never_switches_on_without_threshold(seed):
  rng = random.Random(seed)
  requests = [Req(i, rng.randint(1, 15)) for i in range(rng.randint(1, 20))]
  s, tr = simulate(requests, max_batch=4, buckets=(1, 2, 4), bs_threshold=None, patience=1,
                   rng=rng)
  assert not any(tr["spec"]) and not s.speculating


def test_speculation_counter_resets_on_a_large_batch():
  """live sizes 2, 2, 5, 2, 2, 2 with threshold 2, patience 3: on only at the last check."""
  lives = [2, 2, 5, 2, 2, 2]
  s = Scheduler([], max_batch=8, buckets=(8,), bs_threshold=2, patience=3)
  got = []
  for n in lives:
    s.slots = [Req(i, 1) for i in range(n)] + [None] * (8 - n)  # fake a live batch of n
    got.append(s.check_speculation())
  assert got == [False, False, False, False, False, True]
  s.slots = [Req(i, 1) for i in range(8)]
  assert s.check_speculation() is True  # stays on
