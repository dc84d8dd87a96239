"""The RL prompt stream: tokenised, length-filtered prompts in a deterministic per-epoch order
with a position that is checkpointed, so a resumed run sees exactly the prompts it would have.

Order: epoch e is `default_rng([seed, e]).permutation(N)`; the state is a `Position` (epoch,
index in that permutation), a value the caller holds (the train state): `batch(position, n)`
returns the prompts and the next position. A batch may straddle an epoch boundary. Nothing
depends on how many batches were drawn before, only on the position, which is what makes
resume exact.
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
               name: str = "train"):
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
    self.seed = seed
    self.digest = _digest(self.prompts)
    self._perm_epoch = -1  # (a memo of the last epoch's permutation)
    self._perm = None

  def __len__(self) -> int:
    return len(self.prompts)

  def _order(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
      self._perm_epoch = epoch
    return self._perm

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


def _digest(prompts: Sequence[Prompt]) -> str:
  """What a checkpointed position indexes, in 16 hex digits: each usable prompt's token ids
  and answer, in file order (~0.03 s per million prompt tokens on this CPU)."""
  h = hashlib.blake2b(digest_size=8)
  for p in prompts:
    h.update(np.asarray([len(p.ids), *p.ids], np.int64).tobytes())
    h.update(b"\0" + str(p.row.answer).encode() + b"\1")
  return h.hexdigest()
