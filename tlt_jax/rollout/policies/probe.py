"""What the speculation gate measures (gate.py): a measured `Chunk`, per-row rates, one batch
bucket's record (`Bucket`), and an arm's measured ratio to plain decoding with its hardware
ceiling. Pure host-side values and functions."""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Sequence

from tlt_jax.rollout.policies.strategy import Strategy

PROBING, PAYS, DECLINED, CLOSED = "probing", "pays", "declined", "closed"
HARDWARE, ACCEPTANCE = "hardware", "acceptance"  # why a bucket was declined


class Chunk(NamedTuple):
  """One measured chunk, the event the gate learns from (the fields of `ChunkMetrics`)."""
  bucket: int
  arm: Strategy | None  # None: plain decoding
  wall: float  # seconds, the queued work included
  steps: int  # target forwards
  accepted: int = 0  # drafts accepted over the chunk's rows
  verifications: int = 0  # (row, step) verifications


def accept_len(chunks: Sequence[Chunk]) -> float:
  """Tokens per row per step: 1 for plain chunks, tokens per verification for speculative."""
  ver = sum(c.verifications for c in chunks)
  return (sum(c.accepted for c in chunks) + ver) / ver if ver else 1.0


def rate(chunks: Sequence[Chunk]) -> float:
  """Per-row throughput: (tokens per row per step) x (steps per second)."""
  wall = sum(c.wall for c in chunks)
  return accept_len(chunks) * sum(c.steps for c in chunks) / wall if wall > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Bucket:
  """What the gate knows about one batch bucket. Rates keep the last `window` counted chunks;
  `warm` the arms (None: plain) whose first, uncounted chunk ran here; `funded` the arms whose
  compile the payoff rule has paid for in the bucket's current status (probed arms on
  probation, the arms to compile where it pays): once funded an arm stays so until the status
  changes (its compile is sunk)."""
  status: str = CLOSED
  reason: str | None = None  # DECLINED: HARDWARE | ACCEPTANCE
  declined_at: int | None = None  # rollout of the last decline (None: never declined)
  since: int = 0  # rollout its last probation began
  seen: int = -1  # last rollout a chunk ran here
  wide: bool = False  # on probation, every drafting arm is probed (not the lead alone)
  plain: tuple[Chunk, ...] = ()  # counted plain chunks
  spec: Mapping[str, tuple[Chunk, ...]] = dataclasses.field(default_factory=dict)  # by arm
  warm: frozenset = frozenset()
  funded: frozenset = frozenset()


def measured(r: Bucket) -> dict[str, tuple[float, float]]:
  """arm -> (ratio to plain decoding, hardware ceiling) of the arms measured in `r` (counted
  chunks in its window and a plain rate to compare with). With every draft accepted an arm
  delivers depth + 1 tokens per verification: its ceiling is ratio x (depth + 1) / the
  measured tokens per verification."""
  plain = rate(r.plain) if r.plain else 0.0
  if plain <= 0:
    return {}
  out = {}
  for a, chunks in r.spec.items():
    if chunks:
      ratio = rate(chunks) / plain
      out[a] = (ratio, ratio * (a.steps + 1) / accept_len(chunks))
  return out
