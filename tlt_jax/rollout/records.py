"""The rollout engine's records: what goes in (Request), what comes out (Result, ChunkMetrics),
the hooks it calls, and the per-request output accumulator. Plain host data, no device code:
the coordinator, train.py and the benchmarks read these without touching the engine.

Results and chunk metrics are frozen: whoever wants a changed one (a reward attached, a
window cut) builds its own record (step_rollouts.py's `Response`), so a Result handed to one
hook is the same Result the engine returns.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from tlt_jax.rollout.policies.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Request:
  prompt_ids: Sequence[int]
  request_id: int = 0  # index of the prompt
  sample_index: int = 0  # which of the n samples of that prompt
  max_new_tokens: int | None = None  # per-request cap (<= EngineConfig.max_new_tokens)

  @property
  def key(self) -> tuple[int, int]:
    return self.request_id, self.sample_index


@dataclasses.dataclass(frozen=True)
class Result:
  request_id: int
  sample_index: int
  prompt_ids: np.ndarray  # [P]
  response_ids: np.ndarray  # [R] int32, including the stop token when stopped
  logprobs: np.ndarray  # [R] float32 under the processed sampling distribution
  # [R - hidden_offset, D]: hidden[j - hidden_offset] is the post-norm hidden that produced
  # response token j (capture_hidden; the first hidden_offset were not kept: hidden_keep)
  hidden: np.ndarray | None
  finish_reason: str  # "stop" | "length"
  worker_id: int = 0
  finish_time: float = 0.0  # seconds since the engine's generate() began
  hidden_offset: int = 0
  spec_start: int | None = None  # first response token decoded with speculation on

  @property
  def num_tokens(self) -> int:
    return int(self.response_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class ChunkMetrics:
  worker_id: int
  bucket: int  # compiled batch size the chunk ran at
  live: int  # rows decoding at the start of the chunk
  tokens: int  # tokens produced in the chunk
  steps: int  # decode steps run (target forwards)
  wall_time: float
  mode: Strategy | str = "plain"  # "plain" | the strategy when speculative
  accepted: int = 0  # draft tokens accepted (speculative chunks)
  verifications: int = 0  # row-steps verified (speculative chunks): live rows x their steps
  t: float = 0.0  # chunk end, seconds since generate() began
  compiled: bool = False  # the chunk compiled its executable (its time is not the arm's)
  first_run: bool = False  # its executable's first run (on CPU 10-50x a later one's time)
  read: float = 0.0  # bytes one step reads: the weights and every row's attention window
  wide: bool = False  # ran at a wider window than its rows need (a compiled one, theirs not)

  @property
  def arm(self) -> Strategy | None:
    """The strategy the chunk ran (None: plain decoding, before speculation started)."""
    return None if self.mode == "plain" else self.mode

  @property
  def accept_len(self) -> float | None:
    """Tokens per verification (accepted drafts + 1), None for plain chunks."""
    return tokens_per_verification([self])

  @property
  def row_speed(self) -> float:
    """The chunk's arm's speed in tokens/s per live row, the bandit's reward: tokens per
    verification x steps / wall time, the rate its rows decoded at had none ended mid-chunk.
    - Per row, where TLT's reference implementation multiplies by the live rows: at one size both
      rank arms alike, but a bucket spans sizes (the reference's top one 21-32 rows, where its
      speculation stops; ours go to max_batch) and the batch's tokens/s grows with its rows,
      so an arm's median said where it happened to be measured (the simulator's 7B plan: "off"
      measured at 118 rows came within 12% of 3_1_4 measured at 58, at half its rate a row).
      A bandwidth-bound step, the regime speculation is for, takes about as long at 60 rows
      as at 120: per row, arms compare at any size of the bucket.
    - Not emitted tokens / wall time, which charges the arm for rows that ended mid-chunk
      (their remaining steps emit nothing, whichever arm runs): with answers a few chunks long
      that was most of a reward's spread (bench_history_arms at batch 8).
    Chunks without verifications (plain decoding) fall back to tokens / wall / live rows."""
    tpv = self.accept_len
    if tpv is None or self.steps <= 0:
      return self.tokens / max(self.wall_time, 1e-9) / max(self.live, 1)
    return tpv * self.steps / max(self.wall_time, 1e-9)


def tokens_per_verification(chunks) -> float | None:
  """Mean acceptance length over chunks: (accepted drafts + verifications) / verifications
  (each verification commits its accepted drafts + 1 target token); None without any."""
  ver = sum(c.verifications for c in chunks)
  return (sum(c.accepted for c in chunks) + ver) / ver if ver else None


def by_kind(chunks, tokens: int) -> dict[str, dict[str, float]]:
  """Speculative chunks by arm kind (history, drafter, hybrid, off): tokens per
  verification, share of `tokens` (e.g. the step's), tokens/s while that kind ran."""
  out: dict[str, list] = {}
  for c in chunks:
    if c.arm is not None:
      out.setdefault(c.arm.kind, []).append(c)
  return {kind: {"tokens_per_verify": tokens_per_verification(cs) or 0.0,
                 "share_of_tokens": sum(c.tokens for c in cs) / max(tokens, 1),
                 "tokens_per_s": sum(c.tokens for c in cs)
                 / max(sum(c.wall_time for c in cs), 1e-9)}
          for kind, cs in out.items()}


@dataclasses.dataclass
class EngineHooks:
  """Called on the engine's thread (the coordinator's worker thread)."""
  on_chunk: Callable[[ChunkMetrics], None] | None = None
  on_result: Callable[[Result], None] | None = None  # a request finished (e.g. start its reward)
  before_chunk: Callable[[], Any] | None = None  # e.g. pull newer weights from the store


class Output:
  """One request's response so far (host side), hidden states trimmed to the last `keep`
  (0: all) as they arrive, so a long response never holds more than it will return."""

  def __init__(self, keep: int):
    self.tokens: list[np.ndarray] = []
    self.logprobs: list[np.ndarray] = []
    self.hidden: collections.deque = collections.deque()
    self.kept = 0  # hidden states held
    self.length = 0
    self.spec_start: int | None = None
    self._keep = keep

  def append(self, tokens, logprobs, hidden) -> None:
    self.tokens.append(tokens)
    self.logprobs.append(logprobs)
    self.length += len(tokens)
    if hidden is not None:
      self.hidden.append(hidden)
      self.kept += len(hidden)
      while self._keep and self.kept - len(self.hidden[0]) >= self._keep:
        self.kept -= len(self.hidden.popleft())

  def speculating(self) -> None:
    """The next token is decoded with speculation on (first call only counts)."""
    if self.spec_start is None:
      self.spec_start = self.length

  def result(self, req: Request, *, stopped: bool, worker_id: int, t: float) -> Result:
    response = np.concatenate(self.tokens).astype(np.int32)
    hidden = np.concatenate(list(self.hidden)) if self.hidden else None
    if hidden is not None and self._keep:
      hidden = hidden[-self._keep:]
    return Result(request_id=req.request_id, sample_index=req.sample_index,
                  prompt_ids=np.asarray(req.prompt_ids, np.int32), response_ids=response,
                  logprobs=np.concatenate(self.logprobs).astype(np.float32), hidden=hidden,
                  finish_reason="stop" if stopped else "length", worker_id=worker_id,
                  finish_time=t, hidden_offset=0 if hidden is None else len(response) - len(hidden),
                  spec_start=self.spec_start)
