"""The RL prompt stream: tokenised, length-filtered prompts in a deterministic per-epoch order
with a position that is checkpointed, so a resumed run sees exactly the prompts it would have.

Order: epoch e is `default_rng([seed, e]).permutation(N)`; the state is a `Position` (epoch,
index in that permutation), a value the caller holds (the train state): `batch(position, n)`
returns the prompts and the next position. A batch may straddle an epoch boundary. Nothing
depends on how many batches were drawn before, only on the position, which is what makes
resume exact.

Weighted files (config.data.train_weights, a mixture in OpenRLHF's `prompt_data_probs` sense):
an epoch is still N draws, file i's share of them fixed at q_i = w_i N (rounded by largest
remainder, at least 1), their slots shuffled per epoch (`default_rng([seed, e])`). File i's
draws run through its own shuffled orders one after another (`default_rng([seed, 1 + i, k])`
for its k-th pass), so a file weighted above its size repeats its prompts, each as often as
the others (within one), and one weighted below is sampled without repetition across epochs.
Draw j of file i in epoch e is its (e q_i + j)-th: again a function of the position alone.

`shuffle=False` (config.data.shuffle, verl's `data.shuffle`; a curriculum the file's order
holds): every order above is the identity, the files' rows in file order epoch after epoch,
and weighted files' slots spread evenly (file i's j-th at (j + 1/2) / q_i of the epoch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, NamedTuple, Sequence

import numpy as np

from tlt_jax.data.prompts import DataError, PromptRow

_log = logging.getLogger(__name__)


class Position(NamedTuple):
  """Where the stream is: the epoch and the index in its permutation."""
  epoch: int = 0
  index: int = 0


@dataclasses.dataclass
class Prompt:
  row: PromptRow
  ids: list[int]


def encode_prompt(tokenizer, prompt, *, chat_template: bool, system_prompt: str = ""
                  ) -> list[int]:
  """Token ids of a prompt: plain `encode` of text, or the tokenizer's chat template with a
  generation prompt (for text when `chat_template`, and always for a list of chat messages,
  which has no other faithful rendering). `system_prompt` is prepended unless the chat
  already starts with a system message."""
  if isinstance(prompt, str) and not chat_template:
    return list(tokenizer.encode(prompt))
  if not getattr(tokenizer, "chat_template", None):
    what = ("config.data.chat_template=True" if isinstance(prompt, str)
            else "the prompts are chat messages (rendered with a chat template)")
    raise DataError(f"{what} but the tokenizer of config.model.path has no chat template; "
                    "use a model directory "
                    "whose tokenizer has one" + (" or set config.data.chat_template=False"
                                                 if isinstance(prompt, str) else ""))
  messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
  if system_prompt and messages[0]["role"] != "system":
    messages.insert(0, {"role": "system", "content": system_prompt})
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def encode_rows(rows: Sequence[PromptRow], tokenizer, *, max_prompt_len: int,
                chat_template: bool = False, system_prompt: str = ""
                ) -> tuple[list[Prompt], int, list[int]]:
  """The rows a rollout can take, encoded: (prompts, how many rows were longer than
  max_prompt_len tokens, the file indices of rows that encode to no token: whitespace, say,
  nothing to condition on). Training's stream and held-out evaluation both keep only these."""
  prompts, long, empty = [], 0, []
  for r in rows:
    ids = encode_prompt(tokenizer, r.prompt, chat_template=chat_template,
                        system_prompt=system_prompt)
    if not ids:
      empty.append(r.index)
    elif len(ids) > max_prompt_len:
      long += 1
    else:
      prompts.append(Prompt(r, ids))
  return prompts, long, empty


class PromptStream:
  """Deterministically shuffled epochs over the usable prompts; see the module docstring."""

  def __init__(self, rows: Sequence[PromptRow], tokenizer, *, max_prompt_len: int,
               seed: int = 0, chat_template: bool = False, system_prompt: str = "",
               name: str = "train", weights: Sequence[float] | None = None,
               files: Sequence[str] = (), shuffle: bool = True):
    self.prompts, self.dropped_long, empty = encode_rows(
        rows, tokenizer, max_prompt_len=max_prompt_len, chat_template=chat_template,
        system_prompt=system_prompt)
    self.dropped_empty = len(empty)
    if empty:
      _log.warning("%s: dropped %d of %d prompts that encode to no tokens (rows %s)", name,
                   len(empty), len(rows), ", ".join(str(i + 1) for i in empty[:5])
                   + (", ..." if len(empty) > 5 else ""))
    # (how many were longer than max_prompt_len: the run's `data:` line says it)
    if not self.prompts:
      if not self.dropped_long:
        raise DataError(f"{name}: every prompt encodes to no tokens; check data.prompt_key and "
                        "the tokenizer")
      raise DataError(f"{name}: every prompt is longer than config.data.max_prompt_len="
                      f"{max_prompt_len} tokens; raise it")
    self.seed, self.shuffle = seed, shuffle
    self.digest = _digest(self.prompts)
    self._perm_epoch = -1  # (a memo of the last epoch's permutation)
    self._perm = None
    self.quotas = None  # weighted: each file's draws an epoch
    if weights is not None:
      file = np.array([p.row.file for p in self.prompts])
      self._by_file = [np.flatnonzero(file == i) for i in range(len(weights))]
      for i, idx in enumerate(self._by_file):
        if not len(idx):  # (its rows all too long or of no token)
          raise DataError(f"{name}: {files[i] if i < len(files) else f'file {i + 1}'} has no "
                          "usable prompt (longer than max_prompt_len, or of no token) but a "
                          "weight in config.data.train_weights; raise max_prompt_len or leave "
                          "the file out")
      self.quotas = _quotas(weights, len(self.prompts))

  def __len__(self) -> int:
    return len(self.prompts)

  def _order(self, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s N prompts, as indices into self.prompts (module docstring)."""
    if epoch != self._perm_epoch:
      shuffled = self._shuffled([self.seed, epoch])
      if self.quotas is None:
        self._perm = shuffled(np.arange(len(self.prompts)))
      else:
        slots = np.repeat(np.arange(len(self.quotas)), self.quotas)
        if self.shuffle:
          slots = shuffled(slots)
        else:  # spread evenly: file i's j-th slot at (j + 1/2) / q_i of the epoch
          slots = slots[np.argsort(np.concatenate([(np.arange(q) + 0.5) / q for q in
                                                   self.quotas]), kind="stable")]
        self._perm = np.empty(len(slots), np.int64)
        for i, (q, idx) in enumerate(zip(self.quotas, self._by_file)):
          at = np.flatnonzero(slots == i)
          draw = epoch * q + np.arange(q)  # file i's draws, counted from the run's start
          for k in np.unique(draw // len(idx)):  # its passes: a shuffled order each
            sel = draw // len(idx) == k
            order = self._shuffled([self.seed, 1 + i, int(k)])(np.arange(len(idx)))
            self._perm[at[sel]] = idx[order[draw[sel] % len(idx)]]
      self._perm_epoch = epoch
    return self._perm

  def _shuffled(self, entropy: list[int]):
    """x -> x in the order default_rng(entropy) permutes it (shuffle=False: as it is)."""
    if not self.shuffle:
      return lambda x: x
    return np.random.default_rng(entropy).permutation

  def batch(self, position: Position, n: int) -> tuple[list[Prompt], Position]:
    """The n prompts from `position` on, and the position after them."""
    epoch, index = position
    out = []
    while len(out) < n:
      order = self._order(epoch)
      take = order[index:index + n - len(out)]
      out += [self.prompts[i] for i in take]
      index += len(take)
      if index >= len(order):
        epoch, index = epoch + 1, 0
    return out, Position(epoch, index)

  def saved(self, position: Position) -> dict[str, Any]:
    """`position` as the checkpoint keeps it (JSON), with what it indexes: the prompts' count
    and digest."""
    return {"epoch": position.epoch, "position": position.index, "size": len(self.prompts),
            "digest": self.digest}

  def resume(self, saved: dict[str, Any]) -> Position:
    """The position `saved` holds; DataError if it was saved over other data: other usable
    prompts in number, or as many but not the same (the file edited or rebuilt: a position is
    an index into a permutation of the prompts, so it would name other prompts)."""
    if int(saved["size"]) != len(self.prompts):
      raise DataError(f"the checkpoint's data position is for {saved['size']} prompts but the "
                      f"configured data has {len(self.prompts)} usable prompts; resume with the "
                      "same data and max_prompt_len, or start a new workdir")
    if saved.get("digest", self.digest) != self.digest:  # (checkpoints before the digest: none)
      raise DataError(f"the checkpoint's data position is for other prompts than the configured "
                      f"data's (as many, {len(self.prompts)}, but not the same prompts, answers "
                      "or order: the data file changed since the run checkpointed); resume with "
                      "the data it trained on, or start a new workdir")
    return Position(int(saved["epoch"]), int(saved["position"]))


def _quotas(weights: Sequence[float], n: int) -> list[int]:
  """Each file's draws in an epoch of n: w_i n rounded by largest remainder (ties to the
  earlier file), then at least 1 each (taken from the largest), so every file is drawn."""
  raw = [w / sum(weights) * n for w in weights]
  q = [int(r) for r in raw]
  for i in sorted(range(len(q)), key=lambda i: (q[i] - raw[i], i))[:n - sum(q)]:
    q[i] += 1
  while 0 in q:
    q[q.index(max(q))] -= 1
    q[q.index(0)] = 1
  return q


def _digest(prompts: Sequence[Prompt]) -> str:
  """What a checkpointed position indexes, in 16 hex digits: each usable prompt's token ids
  and answer, in file order (~0.03 s per million prompt tokens on this CPU)."""
  h = hashlib.blake2b(digest_size=8)
  for p in prompts:
    h.update(np.asarray([len(p.ids), *p.ids], np.int64).tobytes())
    h.update(b"\0" + str(p.row.answer).encode() + b"\1")
  return h.hexdigest()
