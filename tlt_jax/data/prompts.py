"""Prompt datasets: local JSONL or Parquet rows -> validated (prompt, answer) records.

Real datasets have broken rows. A malformed row is either skipped and counted (with a
warning naming its row number) or stops the run naming the row, as `on_bad_row` decides;
never a deep traceback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

_log = logging.getLogger(__name__)


class DataError(ValueError):
  """A dataset the user pointed at that cannot be read as configured."""


Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclasses.dataclass
class PromptRow:
  index: int  # row number in the file (0-based)
  prompt: str | list[Message]  # text, or a chat (rendered with the tokenizer's chat template)
  answer: str
  source: str | None = None
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LoadStats:
  rows: int = 0
  bad_rows: int = 0
  first_bad: str | None = None


def _raw_rows(path: str):
  """Yields (row index, parsed row | None, problem | None); JSONL indices are line indices."""
  if not os.path.exists(path):
    raise DataError(f"data file {path!r} does not exist; check config.data paths")
  if path.endswith((".parquet", ".pq")):
    import pyarrow.parquet as pq
    for i, row in enumerate(pq.read_table(path).to_pylist()):
      yield i, row, None
    return
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      try:
        yield i, json.loads(line), None
      except json.JSONDecodeError as e:
        yield i, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _check_messages(messages: list, key: str) -> str | None:
  """A chat prompt (the layout of common RL math sets): a non-empty list of
  {"role", "content"} string pairs. Returns the problem, or None."""
  if not messages:
    return f"'{key}' is an empty list of chat messages"
  for j, m in enumerate(messages):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      return (f"'{key}'[{j}] is not a chat message {{\"role\": str, \"content\": str}}")
  if not any(m["content"].strip() for m in messages):
    return f"'{key}' chat messages are all empty"
  return None


def _source(value: Any) -> str | None:
  """Sources group accuracy metrics, so they must be hashable and printable: any JSON value
  becomes its string form (lists and dicts as compact JSON); missing stays None."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (list, dict)):
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
  return str(value)


def load_prompt_rows(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                     source_key: str | None = None, on_bad_row: str = "skip"
                     ) -> tuple[list[PromptRow], LoadStats]:
  """Reads rows; each needs a prompt (non-empty text, or a list of chat messages) and an
  answer (str/int/float)."""
  if on_bad_row not in ("skip", "error"):
    raise ValueError(f"on_bad_row={on_bad_row!r}: use 'skip' or 'error'")
  rows: list[PromptRow] = []
  stats = LoadStats()
  unit = "row" if path.endswith((".parquet", ".pq")) else "line"
  for i, raw, problem in _raw_rows(path):
    if problem is None:
      if not isinstance(raw, dict):
        problem = "row is not a JSON object"
      elif isinstance(raw.get(prompt_key), list):
        problem = _check_messages(raw[prompt_key], prompt_key)
      elif not isinstance(raw.get(prompt_key), str) or not raw[prompt_key].strip():
        problem = f"missing or empty '{prompt_key}' (set config.data.prompt_key?)"
      elif not isinstance(raw.get(answer_key), (str, int, float)):
        problem = f"missing '{answer_key}' (set config.data.answer_key?)"
    if problem is not None:
      msg = f"{path}: {unit} {i + 1}: {problem}"
      if on_bad_row == "error":
        raise DataError(msg + " (set config.data.on_bad_row='skip' to skip such rows)")
      stats.bad_rows += 1
      stats.first_bad = stats.first_bad or msg
      continue
    extra = {k: v for k, v in raw.items() if k not in (prompt_key, answer_key)}
    prompt = raw[prompt_key]
    if isinstance(prompt, list):
      prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    rows.append(PromptRow(index=i, prompt=prompt, answer=str(raw[answer_key]),
                          source=_source(raw.get(source_key)) if source_key else None,
                          extra=extra))
  stats.rows = len(rows)
  if stats.bad_rows:
    _log.warning("%s: skipped %d malformed rows (first: %s)", path, stats.bad_rows,
                 stats.first_bad)
  if not rows:
    raise DataError(f"{path}: no usable rows (prompt_key={prompt_key!r}, "
                    f"answer_key={answer_key!r})")
  return rows, stats
