"""Prompt datasets: local JSONL or Parquet rows -> validated (prompt, answer) records.

Keys are column names or dotted paths into nested fields, so verl's preprocessed files
(`reward_model.ground_truth`, chat-message `prompt`, `data_source`, `extra_info`) load as
they are.

Real datasets have broken rows. A malformed row is either skipped and counted (with a
warning naming its row number) or stops the run naming the row, as `on_bad_row` decides;
never a deep traceback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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
  file: int = 0  # which of the config's files (0-based: data.train_path's order)

  @property
  def extra_info(self) -> Any:
    """The row's `extra_info` field (verl's per-row record a verl-style reward function is
    given), or None."""
    return self.extra.get("extra_info")


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


def _field(row: dict, key: str) -> tuple[Any, str | None]:
  """The value at `key`: a column, or a dotted path into nested fields ("reward_model.
  ground_truth"; Parquet struct columns arrive as dicts). A column named exactly `key` wins.
  -> (value, None), or (None, the shortest prefix of `key` the row lacks)."""
  if row.get(key) is not None:
    return row[key], None
  value, parts = row, key.split(".")
  for j, part in enumerate(parts):
    if not isinstance(value, dict) or value.get(part) is None:
      return None, ".".join(parts[:j + 1])
    value = value[part]
  return value, None


def _missing(key: str, lacks: str, config_key: str, what: str = "missing") -> str:
  """The problem of a row without `key` (`lacks`: the prefix _field found missing)."""
  why = f"the row has no '{lacks}'; " if lacks != key else ""
  return f"{what} '{key}' ({why}set config.data.{config_key}?)"


def _prompt_problem(value: Any, key: str, lacks: str | None) -> str | None:
  """A prompt is non-empty text or a list of chat messages; -> the problem, or None."""
  if isinstance(value, list):
    return _check_messages(value, key)
  if isinstance(value, str) and value.strip():
    return None
  if value is None or isinstance(value, str):
    return _missing(key, lacks or key, "prompt_key", "missing or empty")
  return f"'{key}' is a {type(value).__name__}, not text or a list of chat messages"


_ANSWER = (str, int, float)


def _answer(value: Any, key: str) -> tuple[str | None, str | None]:
  """An answer: a str/int/float, or a one-element list of one (some verl files store the
  ground truth so); -> (its text, None) or (None, the problem)."""
  if isinstance(value, list) and len(value) == 1 and isinstance(value[0], _ANSWER):
    value = value[0]
  if isinstance(value, _ANSWER):
    return str(value), None
  what = (f"a list of {len(value)} values" if isinstance(value, list)
          else f"a {type(value).__name__}")
  return None, f"'{key}' is {what}, not one answer (a str, int or float, or a list of one)"


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
  answer (str/int/float, or a list of one). Keys: see `_field`."""
  if on_bad_row not in ("skip", "error"):
    raise ValueError(f"on_bad_row={on_bad_row!r}: use 'skip' or 'error'")
  rows: list[PromptRow] = []
  stats = LoadStats()
  unit = "row" if path.endswith((".parquet", ".pq")) else "line"
  for i, raw, problem in _raw_rows(path):
    if problem is None and not isinstance(raw, dict):
      problem = "row is not a JSON object"
    if problem is None:
      prompt, lacks = _field(raw, prompt_key)
      problem = _prompt_problem(prompt, prompt_key, lacks)
    if problem is None:
      answer, lacks = _field(raw, answer_key)
      answer, problem = (_answer(answer, answer_key) if lacks is None
                         else (None, _missing(answer_key, lacks, "answer_key")))
    if problem is not None:
      msg = f"{path}: {unit} {i + 1}: {problem}"
      if on_bad_row == "error":
        raise DataError(msg + " (set config.data.on_bad_row='skip' to skip such rows)")
      stats.bad_rows += 1
      stats.first_bad = stats.first_bad or msg
      continue
    extra = {k: v for k, v in raw.items() if k not in (prompt_key, answer_key)}
    if isinstance(prompt, list):
      prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    rows.append(PromptRow(index=i, prompt=prompt, answer=answer,
                          source=_source(_field(raw, source_key)[0]) if source_key else None,
                          extra=extra))
  stats.rows = len(rows)
  if stats.bad_rows:
    _log.warning("%s: skipped %d malformed rows (first: %s)", path, stats.bad_rows,
                 stats.first_bad)
  if not rows:
    first = f"; first: {stats.first_bad.split(': ', 1)[-1]}" if stats.first_bad else ""
    raise DataError(f"{path}: no usable rows (prompt_key={prompt_key!r}, "
                    f"answer_key={answer_key!r}{first})")
  return rows, stats


# ------------------------------------------------------------- held-out sets, several files
def split_paths(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
  """A config's file list (config.data.train_path, test_path): one path, several separated by
  commas (the command line's form), or a list / tuple of them (a config file's); blanks
  dropped."""
  if not value:
    return []
  parts = value.split(",") if isinstance(value, str) else list(value)
  return [os.path.expanduser(str(p).strip()) for p in parts if str(p).strip()]


def source_names(paths: list[str], key: str = "data.test_path") -> list[str]:
  """Each file's name in per-source metrics: its name without the extension (aime24.jsonl ->
  aime24), with as many of its folders as set it apart from the others' (a/test.parquet,
  b/test.parquet -> a/test, b/test). A file named twice is a DataError (naming config `key`)."""
  norm = [os.path.normpath(os.path.abspath(p)) for p in paths]
  twice = [p for p, n in zip(paths, norm) if norm.count(n) > 1]
  if twice:
    raise DataError(f"config.{key} names {twice[0]!r} twice; list each file once")
  parts = [os.path.splitext(p)[0].split(os.sep) for p in norm]
  for k in range(1, max(map(len, parts)) + 1):
    names = ["/".join(p[-k:]) for p in parts]
    if len(set(names)) == len(names):
      return names
  return norm  # (unreachable: distinct absolute paths differ in some suffix)


def load_files(paths: list[str], *, num_prompts: int = 0, key: str = "data.test_path",
               **keys: Any) -> list[PromptRow]:
  """The rows of one file or several (`split_paths`: config `key`'s), in the files' order,
  each file's first `num_prompts` usable rows (0: all). With several files, a row without a
  source of its own (the `source_key` field: verl's data_source) takes its file's name
  (`source_names`), so evaluation reports each benchmark apart, and training its accuracy on
  each data set; each row's `file` is its file's place in `paths`. `keys`: load_prompt_rows's.
  """
  rows: list[PromptRow] = []
  names = source_names(paths, key) if len(paths) > 1 else [None] * len(paths)
  for f, (path, name) in enumerate(zip(paths, names)):
    got, _ = load_prompt_rows(path, **keys)
    got = got[:num_prompts] if num_prompts else got
    if keys.get("source_key") and all(r.source is None for r in got):  # (a typo?)
      _log.warning("%s: no row has config.data.source_key=%r, the field accuracy is reported "
                   "by: %s", path, keys["source_key"], f"its rows take the file's name, {name!r}"
                   if name else "no accuracy per source")
    rows += [dataclasses.replace(r, file=f, source=name if r.source is None else r.source)
             for r in got]
  return rows


def train_weights(value: str, train_path: Any) -> tuple[list[float] | None, str]:
  """config.data.train_weights: one weight per file of `train_path` ("0.7,0.3": each file's
  share of the prompts an epoch draws, normalised), or None for "" (the files concatenated,
  each prompt once an epoch); and what is wrong with `value` ("" if nothing: config.py says
  it, naming the key)."""
  if not value:
    return None, ""
  n = len(split_paths(train_path))
  try:
    weights = [float(w) for w in str(value).split(",")]
  except ValueError:
    return None, ("comma-separated numbers, one per file of data.train_path, e.g. 0.7,0.3 "
                  "('': the files concatenated)")
  if len(weights) != n:
    return None, (f"{len(weights)} weights for the {n} file{'s' * (n > 1)} of "
                  "data.train_path; give one per file, in its order")
  if not all(math.isfinite(w) and w > 0 for w in weights):
    return None, ("every weight must be a finite number > 0 (leave a file out of "
                  "data.train_path to train without it)")
  return [w / sum(weights) for w in weights], ""
