"""Padding-free packing of drafter windows into fixed [rows, row_len] batches.

Several windows share a row, told apart by segment ids (1, 2, ... per window, 0 = padding).
Attention never crosses segments (`segment_ids` into the drafter loss's forward) and positions
restart at 0 in every segment (RoPE sees relative positions only, so a window attends exactly
as it would alone). The reference implementation concatenates windows under ONE causal mask
with running positions, so packed samples attend to each other; tests/test_packing.py shows
ours gives the loss and gradients of the windows run one by one.

Shapes are fixed (one compiled train step), so a batch is filled first-fit until a drawn
window no longer fits anywhere.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tlt_jax.drafter.buffer import Window


def pack(windows: Sequence[Window], rows: int | None, row_len: int, *, hidden_dtype=None
         ) -> tuple[dict[str, np.ndarray], int]:
  """First-fit windows (in order) into [rows, row_len] (rows=None: as many rows as it takes);
  a window longer than row_len keeps its last row_len tokens (the tail, where drafts are
  used). Windows that fit nowhere are left out. Returns (batch, number of windows packed);
  batch = tokens, positions, segment_ids [rows, row_len] int32, loss_mask float32,
  hidden [rows, row_len, D] (no "hidden" when the windows carry none: plain token sequences,
  e.g. the SFT examples scripts/make_default_assets.py trains the default model on)."""
  if not windows:
    raise ValueError("pack: no windows")
  placed: list[list[Window]] = [] if rows is None else [[] for _ in range(rows)]
  used: list[int] = [0] * len(placed)
  packed = 0
  for w in windows:
    n = min(w.length, row_len)
    r = next((i for i in range(len(placed)) if used[i] + n <= row_len), None)
    if r is None:
      if rows is not None:
        continue
      placed.append([])
      used.append(0)
      r = len(placed) - 1
    placed[r].append(w)
    used[r] += n
    packed += 1
  nrows = len(placed)
  out = {"tokens": np.zeros((nrows, row_len), np.int32),
         "positions": np.zeros((nrows, row_len), np.int32),
         "segment_ids": np.zeros((nrows, row_len), np.int32),
         "loss_mask": np.zeros((nrows, row_len), np.float32)}
  h0 = windows[0].hidden
  if h0 is not None:
    out["hidden"] = np.zeros((nrows, row_len, h0.shape[-1]), hidden_dtype or h0.dtype)
  for r, members in enumerate(placed):
    pos = 0
    for seg, w in enumerate(members, 1):
      n = min(w.length, row_len)
      sl = slice(pos, pos + n)
      out["tokens"][r, sl] = w.tokens[-n:]
      if h0 is not None:
        out["hidden"][r, sl] = w.hidden[-n:]
      out["loss_mask"][r, sl] = w.loss_mask[-n:]
      out["positions"][r, sl] = np.arange(n, dtype=np.int32)
      out["segment_ids"][r, sl] = seg
      pos += n
  return out, packed


def fill_batch(draw, rows: int, row_len: int, *, draws: int = 0, hidden_dtype=None
               ) -> tuple[dict[str, np.ndarray], int] | None:
  """Packs windows from `draw(n) -> list[Window]` until the batch is full: draws enough
  windows to cover the batch's tokens (x1.5, at least `draws`), packs what fits. None when
  `draw` returns nothing (an empty buffer)."""
  windows = draw(max(draws, 1))
  if not windows:
    return None
  mean = max(np.mean([w.length for w in windows]), 1.0)
  want = int(np.ceil(1.5 * rows * row_len / mean))
  if want > len(windows):
    windows = windows + draw(want - len(windows))
  return pack(windows, rows, row_len, hidden_dtype=hidden_dtype)
