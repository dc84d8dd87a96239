"""Prompt data: JSONL / Parquet loading, malformed rows (skip and count, or stop naming the
row), length filtering, and the resumable per-epoch order."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.data.dataset import PromptStream
from tlt_jax.data.prompts import DataError, load_prompt_rows


class CharTokenizer:
  """One id per character: lengths are obvious in the test."""

  chat_template = None

  def encode(self, text):
    return [ord(c) for c in text]


def write_jsonl(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


GOOD = [json.dumps({"q": f"p{i}", "a": i, "src": "s%d" % (i % 2)}) for i in range(6)]


def test_jsonl_fields_sources_and_extra(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", GOOD)
  rows, stats = load_prompt_rows(path, prompt_key="q", answer_key="a", source_key="src")
  assert [r.prompt for r in rows] == [f"p{i}" for i in range(6)]
  assert [r.answer for r in rows] == [str(i) for i in range(6)]  # numbers become strings
  assert [r.source for r in rows] == ["s0", "s1"] * 3
  assert stats.rows == 6 and stats.bad_rows == 0


def test_malformed_rows_skipped_and_counted(tmp_path, caplog):
  lines = [GOOD[0], "{not json", json.dumps({"q": "", "a": 1}), json.dumps({"q": "x"}),
           json.dumps([1, 2]), "", GOOD[1]]
  path = write_jsonl(tmp_path / "d.jsonl", lines)
  rows, stats = load_prompt_rows(path, prompt_key="q", answer_key="a", on_bad_row="skip")
  assert [r.prompt for r in rows] == ["p0", "p1"]
  assert [r.index for r in rows] == [0, 6]  # file line numbers (0-based), blank line counted
  assert stats.bad_rows == 4
  assert "line 2: invalid JSON" in stats.first_bad
  assert "skipped 4 malformed rows" in caplog.text


@pytest.mark.parametrize("bad_line, needle", [
    ("{not json", "line 2: invalid JSON"),
    (json.dumps({"q": "x"}), "line 2: missing 'a' (set config.data.answer_key?)"),
    (json.dumps({"question": "x", "a": 1}), "line 2: missing or empty 'q'"),
])
def test_on_bad_row_error_names_the_line_and_the_fix(tmp_path, bad_line, needle):
  path = write_jsonl(tmp_path / "d.jsonl", [GOOD[0], bad_line, GOOD[1]])
  with pytest.raises(DataError) as e:
    load_prompt_rows(path, prompt_key="q", answer_key="a", on_bad_row="error")
  assert needle in str(e.value) and "on_bad_row='skip'" in str(e.value)
  assert str(e.value).count("\n") == 0


def test_parquet_rows_and_bad_row(tmp_path):
  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.table({"q": ["a", None, "c"], "a": ["1", "2", "3"]}), path)
  rows, stats = load_prompt_rows(path, prompt_key="q", answer_key="a")
  assert [r.prompt for r in rows] == ["a", "c"] and stats.bad_rows == 1
  assert "d.parquet: row 2: missing or empty 'q'" in stats.first_bad


def test_missing_file_and_empty_data(tmp_path):
  with pytest.raises(DataError, match="does not exist"):
    load_prompt_rows(str(tmp_path / "nope.jsonl"))
  path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"x": 1})])
  with pytest.raises(DataError, match="no usable rows"):
    load_prompt_rows(path)


def _stream(tmp_path, n=10, max_len=3, seed=0):
  lines = [json.dumps({"prompt": "x" * (1 + i % 5), "answer": i}) for i in range(n)]
  rows, _ = load_prompt_rows(write_jsonl(tmp_path / "s.jsonl", lines))
  return PromptStream(rows, CharTokenizer(), max_prompt_len=max_len, seed=seed)


def test_length_filter_counts_dropped(tmp_path):
  s = _stream(tmp_path, n=10, max_len=3)
  assert len(s) == 6 and s.dropped_long == 4  # lengths 1..5 cycling: 4s and 5s dropped
  assert all(len(p.ids) <= 3 for p in s.prompts)
  with pytest.raises(DataError, match="raise it"):
    _stream(tmp_path, n=3, max_len=0)


def test_epochs_are_permutations_and_resume_is_exact(tmp_path):
  s = _stream(tmp_path, n=10, max_len=5, seed=3)
  n = len(s)
  seen = [p.row.index for p in s.next_batch(n)]
  assert sorted(seen) == list(range(n))  # one epoch visits every prompt once
  second = [p.row.index for p in s.next_batch(n)]
  assert sorted(second) == list(range(n)) and second != seen  # a fresh shuffle per epoch

  # Batches straddle epoch boundaries; a stream restored from a state continues identically.
  a = _stream(tmp_path, n=10, max_len=5, seed=3)
  a.next_batch(7)
  state = json.loads(json.dumps(a.state_dict()))  # checkpointed as JSON
  want = [[p.row.index for p in a.next_batch(4)] for _ in range(5)]
  b = _stream(tmp_path, n=10, max_len=5, seed=3)
  b.load_state_dict(state)
  got = [[p.row.index for p in b.next_batch(4)] for _ in range(5)]
  assert got == want
  # The order is a function of (seed, epoch): independent of how batches were drawn.
  c = _stream(tmp_path, n=10, max_len=5, seed=3)
  flat = [p.row.index for p in c.next_batch(27)]
  assert flat[:2 * n] == seen + second
  d = _stream(tmp_path, n=10, max_len=5, seed=3)
  assert [p.row.index for _ in range(9) for p in d.next_batch(3)] == flat
  assert not np.array_equal(flat[:10], [p.row.index for p in _stream(
      tmp_path, n=10, max_len=5, seed=4).next_batch(10)])


def test_resume_with_different_data_is_one_clear_error(tmp_path):
  a = _stream(tmp_path, n=10, max_len=5)
  state = a.state_dict()
  b = _stream(tmp_path, n=10, max_len=3)  # fewer usable prompts
  with pytest.raises(DataError, match="same data and max_prompt_len"):
    b.load_state_dict(state)
