"""The RL prompt stream: tokenised, length-filtered prompts in a deterministic per-epoch order
with a position that is checkpointed, so a resumed run sees exactly the prompts it would have.

Order: epoch e is `default_rng([seed, e]).permutation(N)`; the state is (epoch, position in
that permutation). A batch may straddle an epoch boundary. Nothing depends on how many
batches were drawn before, only on the state, which is what makes resume exact.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from tlt_jax.data.prompts import DataError, PromptRow

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
  row: PromptRow
  ids: list[int]


def encode_prompt(tokenizer, text: str, *, chat_template: bool, system_prompt: str = ""
                  ) -> list[int]:
  """Plain `encode`, or the tokenizer's chat template with a generation prompt."""
  if not chat_template:
    return list(tokenizer.encode(text))
  messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
  messages.append({"role": "user", "content": text})
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class PromptStream:
  """Deterministically shuffled epochs over the usable prompts; see the module docstring."""

  def __init__(self, rows: Sequence[PromptRow], tokenizer, *, max_prompt_len: int,
               seed: int = 0, chat_template: bool = False, system_prompt: str = "",
               name: str = "train"):
    if chat_template and not getattr(tokenizer, "chat_template", None):
      raise DataError("config.data.chat_template=True but the tokenizer has no chat template; "
                      "set it to False or use a model directory with one")
    self.prompts: list[Prompt] = []
    self.dropped_long = 0
    for r in rows:
      ids = encode_prompt(tokenizer, r.prompt, chat_template=chat_template,
                          system_prompt=system_prompt)
      if not ids or len(ids) > max_prompt_len:
        self.dropped_long += 1
        continue
      self.prompts.append(Prompt(r, ids))
    if self.dropped_long:
      _log.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens", name,
                   self.dropped_long, len(rows), max_prompt_len)
    if not self.prompts:
      raise DataError(f"{name}: every prompt is longer than config.data.max_prompt_len="
                      f"{max_prompt_len} tokens; raise it")
    self.seed = seed
    self.epoch = 0
    self.position = 0
    self._perm_epoch = -1
    self._perm = None

  def __len__(self) -> int:
    return len(self.prompts)

  def _order(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
      self._perm_epoch = epoch
    return self._perm

  def next_batch(self, n: int) -> list[Prompt]:
    out = []
    while len(out) < n:
      order = self._order(self.epoch)
      take = order[self.position:self.position + n - len(out)]
      out += [self.prompts[i] for i in take]
      self.position += len(take)
      if self.position >= len(order):
        self.epoch, self.position = self.epoch + 1, 0
    return out

  def state_dict(self) -> dict[str, int]:
    return {"epoch": self.epoch, "position": self.position, "size": len(self.prompts)}

  def load_state_dict(self, state: dict[str, int]) -> None:
    if int(state["size"]) != len(self.prompts):
      raise DataError(f"the checkpoint's data position is for {state['size']} prompts but the "
                      f"configured data has {len(self.prompts)} usable prompts; resume with the "
                      "same data and max_prompt_len, or start a new workdir")
    self.epoch, self.position = int(state["epoch"]), int(state["position"])
