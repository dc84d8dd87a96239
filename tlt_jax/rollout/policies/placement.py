"""Where the speculation gate probes (gate.py): each batch bucket's worth (what a probe there
could earn per rollout at best: its own time's saving and, since a bucket that pays opens
every smaller one, theirs), the move of probation to where the rollout's time is, and
the closed buckets under a probe the prober's batch compacts through, the prober's batch
held at the bucket on probation until its probe is judged, its first chunks there waiting
for the bucket's first rows to finish, a probed arm measured losing giving way there to plain
decoding while the probe waits on the others, and a speculating batch leaving for plain
decoding where that beats it at its rows' bucket.
Functions of a `GateState`, like funding.py's."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tlt_jax.rollout.policies import funding
from tlt_jax.rollout.policies.probe import CLOSED, DECLINED, PAYS, PROBING, measured, rate


def earns(s, b: int) -> float:
  """What speculating at `b` could save per rollout at best, its own time's (a probe's `worth`
  adds the smaller buckets its verdict would open): the seconds a rollout spends there x
  the share its lead arm could save (1 - 1/ceiling, funding.ceiling: measured, or bounded
  by plain decoding's measured costs); 0 where that ceiling would not clear the bar."""
  lead = s.candidates(b)
  if not lead:
    return 0.0
  best = funding.ceiling(s, b, lead[0])
  if best < 1.0 + s.cfg.margin:  # (its best case would not clear the bar)
    return 0.0
  return s.ledger.per_rollout(b) * (1.0 - 1.0 / best)


def worth(s, b: int) -> float:
  """What a probe at `b` could earn per rollout at best: a bucket that pays makes every
  smaller one pay (gate.py), so its own `earns` and every smaller bucket's not paying yet; 0
  where its own best case would not clear the bar (the probe would decline it)."""
  return worths(s, [b])[b]


def worths(s, buckets: Sequence[int]) -> dict[int, float]:
  """`worth` of each of `buckets`, each bucket's `earns` computed once."""
  top = max(buckets, default=0)
  own = {q: earns(s, q) for q in s.buckets if q <= top and s.at[q].status != PAYS}
  out = {}
  for b in buckets:
    mine = own.get(b, earns(s, b))  # (a paying bucket is not in `own`)
    out[b] = 0.0 if mine <= 0.0 else mine + sum(v for q, v in own.items() if q < b)
  return out


def next_probe(s, b: int) -> int | None:
  """Where probation goes once bucket `b` pays (and every smaller one with it): to the larger
  bucket not paying whose probe could earn the most (`worth`: where the rollout's time is,
  e.g. the bulk of a 70B rollout rather than the next bucket up), the next one up where none
  could earn anything; closed, or declined and due a re-probe (`reprobe_due`: a smaller
  bucket paying since does not make a decline two rollouts old worth probing again; the 32B
  recipe at a per-draft 0.1 declined 128 and 64, paid at 32, and probed 128 again at once).
  None while a larger one is on probation already, or none is left."""
  above = [q for q in s.buckets if q > b and (s.at[q].status in (CLOSED, PROBING) or (
      s.at[q].status == DECLINED and s.reprobe_due(q)))]
  if not above or any(s.at[q].status == PROBING for q in above):
    return None
  w = worths(s, above)
  return max(above, key=lambda q: (w[q], -q)) if max(w.values()) > 0 else above[0]


def follow_time(s):
  """Probation goes where the time is: to the closed bucket whose probe could earn the most
  (`worth`), once the buckets on probation are stale (their probe unfunded, no chunk there
  for `follow_traffic` rollouts, or none of their speculative chunks measured yet while it
  could earn twice what they could) and it could earn more than they. A stale bucket goes
  back to closed (its compiles, if any, are kept)."""
  probing = [b for b in s.buckets if s.at[b].status == PROBING]
  closed = [b for b in s.buckets if s.at[b].status == CLOSED]
  if not closed:
    return s
  w = worths(s, probing + closed)
  best = max(closed, key=lambda b: (w[b], -b))
  if w[best] <= max([0.0] + [w[b] for b in probing]):
    return s

  def stale(b: int) -> bool:
    r, quiet = s.at[b], s.cfg.follow_traffic
    return (not s.probe_arms(b)
            or bool(quiet and s.rollouts - max(r.since, r.seen + 1) >= quiet)
            or (not any(r.spec.values()) and w[best] >= 2 * w[b]))
  if not all(stale(b) for b in probing):
    return s
  for b in probing:
    s = s.put(b, dataclasses.replace(s.at[b], status=CLOSED, funded=frozenset()))
  return s.start_probe(best).logged({"bucket": best, "verdict": "moved", "from": probing,
                                    "worth": round(w[best], 4),
                                    "rollout": s.rollouts})


def below_probe(s, worker_id: int, bucket: int) -> list:
  """On the prober, at a closed bucket under the one on probation (whose plain decoding is
  half measured): the probe's arms that run there too. The prober's speculating batch
  compacts through it as its rows finish (compile_plan: only where they are compiled, in
  the background), instead of running its tail at the probed bucket's size."""
  r = s.at.get(bucket)
  if worker_id != s.prober or r is None or r.status != CLOSED:
    return []
  half = (s.cfg.min_chunks + 1) // 2
  above = next((q for q in s.buckets if q > bucket and s.at[q].status == PROBING
                and len(s.at[q].plain) >= half), None)
  if above is None:
    return []
  return [a for a in s.probe_arms(above) if a in s.arms_at.get(bucket, ())
          and not gives_way(s, above, a)]


def gives_way(s, bucket: int, arm) -> bool:
  """Whether a chunk at `bucket` decodes plainly rather than run `arm`: on probation, an
  arm measured there (`min_chunks` counted chunks) slower than plain decoding, while the
  probe waits on others (the arms it widened to, compiling): more of its chunks measure
  nothing and lose time (the 7B recipe with drafts rarely accepted: the prober's batch,
  held at the 128-row bulk, ran 167 chunks of a lead measured at 0.65x while they
  compiled, its rollout 136 s against the other workers' 83-94 s)."""
  r = s.at.get(bucket)
  if arm is None or r is None or r.status != PROBING:
    return False
  if len(r.spec.get(arm, ())) < s.cfg.min_chunks:
    return False
  got = measured(r).get(arm)
  return got is not None and got[0] < 1.0


def defers(s, bucket: int, live: int) -> bool:
  """Whether a batch at `bucket` on probation, `live` of its rows decoding, decodes plainly
  before its probe runs: until an eighth of the bucket's rows have finished (none below 8
  rows). Right after a prefill every row is live and a verification over them
  nearer compute-bound than where the bucket's time is spent (its rows from full to half):
  the 7B recipe at a per-draft 0.5, its probe's arm compiled before the rollout and measured
  from the prefill's 128 rows on, had its bulk judged to pay four rollouts late."""
  r = s.at.get(bucket)
  return (s.cfg.gating and r is not None and r.status == PROBING
          and live > bucket - bucket // 8)


def leaves(s, bucket: int, to: int) -> bool:
  """Whether a batch speculating at `bucket` whose rows now fit the smaller bucket `to`, where
  it cannot speculate without a compile (nothing of it compiled there yet), decodes faster
  switching speculation off and compacting to `to`: every arm measured at `bucket` with as
  few rows (`min_chunks` chunks of at most `to` live rows, at their rows' window; those not
  giving way there) delivers fewer tokens per row per second (`probe.rate`) than plain
  decoding's chunks at `to`, by `margin`. A speculative step at `bucket` costs more than
  its live rows' share (it verifies every row's drafts, empty or not), so an arm that pays
  at `bucket` full may lose to plain decoding at `to` with a few rows left: the 32B recipe
  at a per-draft 0.1, the prober's batch held at 32 rows by `2_1_3` (1.07x there) while its
  probe waited on another arm's compile, decoded 3-17 rows at 32 for 137 s, its rollout
  217 s against TLT off's 186 s. Compared at the live rows, not by the buckets' plain step
  times (under paged attention an empty row reads nothing). Not measured so: False (it
  stays). Without gating: never."""
  r, q = s.at.get(bucket), s.at.get(to)
  if not s.cfg.gating or r is None or q is None or to >= bucket or not q.plain:
    return False
  few = {a: tuple(c for c in chunks if not c.wide and 0 < c.live <= to)
         for a, chunks in r.spec.items() if not gives_way(s, bucket, a)}
  rates = [rate(c) for c in few.values() if len(c) >= s.cfg.min_chunks]
  return bool(rates) and max(rates) * (1.0 + s.cfg.margin) < rate(q.plain)


def holds(s, worker_id: int, bucket: int, ready: Sequence | None = None) -> bool:
  """Whether this worker's batch at `bucket` stays there rather than compacting to a smaller
  bucket as its rows finish: on the prober, at a bucket on probation whose probe may run
  (`allows`) until it is judged (`min_chunks` counted chunks of each probed arm). A batch
  that compacted below it first (its probe's executable still compiling, or a smaller
  bucket's under it compiled first) would leave the probe nothing to measure until the next
  rollout, and the payoff's compiles to the one after (the 7B recipe's 128-row bulk, paged
  attention: its rows reached 64 31 s into the rollout, the probe's executable was ready at
  34 s; judged a rollout later). `ready`: the arms compiled there (None: not known). Once
  one probed arm is measured, the batch waits only for one that is compiled: a probe that
  widened after its lead lost waits on compiles queued behind others, and a batch held for
  them decodes its whole tail at the probed size (the 7B recipe with drafts rarely
  accepted: the prober's rollout 121 s against the other workers' 83-98 s); it compacts
  meanwhile, and a widened arm compiled while it is still there holds it again. Without
  gating: never."""
  if not s.cfg.gating or worker_id != s.prober:
    return False
  r = s.at.get(bucket)
  if r is None or r.status != PROBING or not s.allows(worker_id, bucket):
    return False
  n, probed = s.cfg.min_chunks, s.probe_arms(bucket)
  left = [a for a in probed if len(r.spec.get(a, ())) < n]
  if ready is None or len(left) == len(probed):
    return bool(left)
  return any(a in ready for a in left)
