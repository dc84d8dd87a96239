"""The drafter's training data: windows of finished responses, within a token budget.

What a window holds (the drafter's pair convention, tlt_jax/drafter/loss.py): for response
tokens y_0..y_{R-1} and the rollout's captured hidden states h_0..h_{R-1} (h_j is the target's
post-norm last-layer state that PRODUCED y_j; tlt_jax/rollout/decode.py), a window [s, e) is

    tokens    x_t = y_{s+t}                            [L] int32
    hidden    f_t = h_{s+t+1}  (0 after the last token) [L, D]
    loss_mask 1 where f_t produced a response token     [L]

so no target forward is ever run for drafter data: the rollout already computed every h_j.
`align` builds exactly this for a response (and, with a prompt and its hidden states, for a
whole prompt + response sequence, as the offline trainer uses); it is the one place the
hidden/target alignment is written.

Why context: the drafter drafts attending to every earlier pair of the sequence (the prompt's
included). Trained on bare response windows it learns to draft without that context and
drafts worse with it: 30 steps on the shipped policy's own rollouts took the shipped drafter
from 3.88 to 3.65 tokens per verification (lr 3e-5; 3.52 at 3e-4), while the same steps on
prompt + response took it to 3.95 (3.85 at 3e-4). So a window is stored with up to `context`
tokens before it (the prompt's, with its hidden states, when `add` is given them), attended
to with no loss on them.

Why windows and a token budget: at 7B a 32k-token response's hidden states are ~230 MB in
bf16. The buffer keeps at most `windows_per_response` windows of `window` tokens per
response and `buffer_tokens` tokens in all (oldest first out), from the last `keep_steps` RL
steps ("one-step-off": the drafter trains during step k on data of steps k and k-1, and is
used in step k+1).

Why weighted toward the tail: speculation runs only when the live batch is small, i.e. in the
late positions of the long responses (the rollout's long tail). The reference implementation
trains on the first 512 tokens of every response, exactly where drafts are never used. Here
tokens decoded once speculation was on (`spec_start`, from the engine) weigh `tail_weight`
times more, windows are tiled back from the end of the response (the tail is always whole),
and both the windows kept per response and the windows drawn for a batch are chosen in
proportion to their summed token weights.

Thread-safe: rollout threads `add` while idle workers `sample`.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Sequence

import numpy as np

from tlt_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BufferConfig:
  buffer_tokens: int = 1 << 20  # tokens of all windows kept
  window: int = 256  # tokens per window whose pairs are trained on
  # tokens before a window that it attends to without a loss on them (the prompt, earlier
  # response): the drafter drafts with that context, and trained without it, it unlearns to
  # use it (docs/drafter.md: the drift benchmark). A packed row is >= window + context.
  context: int = 0
  windows_per_response: int = 4
  keep_steps: int = 2  # sample from the windows of the last N RL steps
  tail_weight: float = 4.0  # weight of a token decoded while speculation was on (others: 1)

  def __post_init__(self):
    for name in ("buffer_tokens", "window", "windows_per_response", "keep_steps"):
      if int(getattr(self, name)) < 1:
        raise ConfigError("must be >= 1", name, getattr(self, name))
    if int(self.context) < 0:
      raise ConfigError("must be >= 0", "context", self.context)
    if not self.tail_weight >= 1.0:
      raise ConfigError("must be >= 1 (1 = no tail bias)", "tail_weight", self.tail_weight)
    if self.buffer_tokens < self.window:
      raise ConfigError(f"must hold at least one window ({self.window} tokens)",
                        "buffer_tokens", self.buffer_tokens)


@dataclasses.dataclass(frozen=True)
class Window:
  step: int  # RL step whose rollout produced it
  tokens: np.ndarray  # [L] int32
  hidden: np.ndarray | None  # [L, D] (None: a plain token sequence, packed without states)
  loss_mask: np.ndarray  # [L] float32
  weight: float  # summed token weights: its share of the sampling

  @property
  def length(self) -> int:
    return int(self.tokens.shape[0])


def align(response_ids: np.ndarray, response_hidden: np.ndarray, prompt_ids: Sequence[int] = (),
          prompt_hidden: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """-> (tokens [T], hidden [T, D], loss_mask [T]) of prompt + response, T = P + R.

  f_t for t < P-1 is the prompt's hidden state (0 without `prompt_hidden`: a response alone
  has P = 0); f_{P-1+j} = h_j for j < R; f_{T-1} (after the last token) was never computed
  and is 0. loss_mask[t] = 1 iff f_t produced a response token, t in [P-1, T-2]."""
  response_ids = np.asarray(response_ids, np.int32)
  h = np.asarray(response_hidden)
  p, r = len(prompt_ids), len(response_ids)
  if h.ndim != 2 or h.shape[0] != r:
    raise ValueError(f"response_hidden {h.shape} must be [R={r}, D]")
  t, d = p + r, h.shape[1]
  tokens = np.concatenate([np.asarray(prompt_ids, np.int32), response_ids])
  hidden = np.zeros((t, d), h.dtype)
  if p > 1 and prompt_hidden is not None:
    hidden[:p - 1] = np.asarray(prompt_hidden)[:p - 1]
  # f_{P-1+j} = h_j; with P = 0 the first one (f_{-1} = h_0) has no position and is dropped.
  lo = max(p - 1, 0)
  hidden[lo:t - 1] = h[lo - (p - 1):]
  mask = np.zeros((t,), np.float32)
  mask[lo:t - 1] = 1.0
  return tokens, hidden, mask


def tiles(length: int, window: int) -> list[tuple[int, int]]:
  """[start, end) windows tiling [0, length) backwards from the end: the tail is whole, the
  first window may be short."""
  out, end = [], length
  while end > 0:
    out.append((max(end - window, 0), end))
    end -= window
  return out


class DrafterBuffer:
  """See the module docstring. `add` per finished response, `sample` per drafter batch."""

  def __init__(self, cfg: BufferConfig = BufferConfig(), *, seed: int = 0):
    self.cfg = cfg
    self._seed = seed  # which windows `add` keeps: a function of (seed, step, key), no state
    self._windows: list[Window] = []  # sorted by `_order`
    self._order: list[tuple] = []  # (step, response key, start) of each window
    self._tokens = 0
    self._latest_step = -1
    self._lock = threading.Lock()
    self.added_responses = 0
    self.evicted_tokens = 0

  # ------------------------------------------------------------------------------ writing
  def add(self, step: int, response_ids: np.ndarray, response_hidden: np.ndarray,
          spec_start: int | None = None, key: tuple[int, ...] = (0,),
          prompt_ids: Sequence[int] = (), prompt_hidden: np.ndarray | None = None) -> int:
    """Keeps up to `windows_per_response` windows of one finished response; returns the
    tokens kept. spec_start: the first response position decoded with speculation on (None:
    never), whose tokens weigh `tail_weight`. key: the response's identity (request id,
    sample index): which windows are kept is a function of (seed, step, key) and the buffer
    is ordered by (step, key, position), so its contents and draws do not depend on the order
    in which concurrent workers finish responses (resume can be exact). prompt_ids /
    prompt_hidden [P, D]: the prompt and its hidden states, the context of the first window
    (`align`); without them a response's first pair has no context. Each window carries up
    to `context` tokens before it, with no loss on them."""
    p = len(prompt_ids) if prompt_hidden is not None else 0
    tokens, hidden, mask = align(response_ids, response_hidden,
                                 prompt_ids if p else (), prompt_hidden if p else None)
    t, lo = len(tokens), max(p - 1, 0)  # pairs from lo on produce response tokens
    if t - lo < 2:  # no pair whose target is a response token
      return 0
    w = np.ones((t,), np.float64)
    if spec_start is not None and spec_start < len(response_ids):
      # pair i's target is token i + 1: response token i + 1 - p (with no prompt, the first
      # response token is no pair's target)
      w[max(p - 1 + spec_start, 0):] = self.cfg.tail_weight
    w *= mask  # positions that are never a target carry no weight
    cands = [(s + lo, e + lo, float(w[s + lo:e + lo].sum()))
             for s, e in tiles(t - lo, self.cfg.window)]
    cands = [c for c in cands if c[2] > 0]
    if len(cands) > self.cfg.windows_per_response:
      p = np.asarray([c[2] for c in cands])
      rng = np.random.default_rng([self._seed, 73, step, *map(int, key)])
      pick = rng.choice(len(cands), self.cfg.windows_per_response, replace=False,
                        p=p / p.sum())
      cands = [cands[i] for i in sorted(pick)]
    with self._lock:
      kept = 0
      for s, e, weight in cands:
        order = (step, tuple(map(int, key)), s)
        i = bisect.bisect(self._order, order)
        self._order.insert(i, order)
        c = max(s - self.cfg.context, 0)  # the context: attended to, not trained on
        m = mask[c:e].copy()
        m[:s - c] = 0.0
        self._windows.insert(i, Window(step, tokens[c:e], hidden[c:e], m, weight))
        kept += e - c
      self._tokens += kept
      self._latest_step = max(self._latest_step, step)
      self.added_responses += 1
      self._evict()
    return kept

  def _evict(self) -> None:
    """Windows of steps before the last keep_steps go; then, over the budget, the oldest
    (lowest step, then key) first."""
    oldest_kept = self._latest_step - self.cfg.keep_steps + 1
    first = bisect.bisect_left(self._order, (oldest_kept,))
    dropped = sum(w.length for w in self._windows[:first])
    while first < len(self._windows) and self._tokens - dropped > self.cfg.buffer_tokens:
      dropped += self._windows[first].length
      first += 1
    del self._windows[:first], self._order[:first]
    self._tokens -= dropped
    self.evicted_tokens += dropped

  # ------------------------------------------------------------------------------ reading
  @property
  def tokens(self) -> int:
    with self._lock:
      return self._tokens

  def __len__(self) -> int:
    with self._lock:
      return len(self._windows)

  def sample(self, n: int, rng: np.random.Generator) -> list[Window]:
    """n windows drawn with replacement, with probability proportional to their weights
    ([] when empty), by the caller's generator (each training worker has its own)."""
    with self._lock:
      if not self._windows:
        return []
      p = np.asarray([w.weight for w in self._windows])
      idx = rng.choice(len(self._windows), n, p=p / p.sum())
      return [self._windows[i] for i in idx]

  def clear(self) -> None:
    with self._lock:
      self._windows, self._order, self._tokens = [], [], 0
