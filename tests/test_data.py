"""Prompt data: JSONL / Parquet loading, malformed rows (skip and count, or stop naming the
row), length filtering, and the resumable per-epoch order."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.data.dataset import Position, PromptStream
from tlt_jax.data.prompts import (DataError, PromptRow, load_files, load_prompt_rows,
                                  source_names, split_paths)


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
  # every other field of the row rides along; the prompt and the answer are not repeated
  assert [r.extra for r in rows] == [{"src": "s%d" % (i % 2)} for i in range(6)]
  assert stats.rows == 6 and stats.bad_rows == 0


def test_a_column_named_with_dots_wins_over_the_nested_path(tmp_path):
  """`_field`: a column named exactly the key is read as it is (a flattened file's
  "reward_model.ground_truth" column), before the key is read as a path into nested fields."""
  lines = [json.dumps({"q": "x", "reward_model.ground_truth": 5}),
           json.dumps({"q": "y", "reward_model.ground_truth": 6,
                       "reward_model": {"ground_truth": 7}}),
           json.dumps({"q": "z", "reward_model": {"ground_truth": 8}})]
  rows, stats = load_prompt_rows(write_jsonl(tmp_path / "d.jsonl", lines), prompt_key="q",
                                 answer_key="reward_model.ground_truth", on_bad_row="error")
  assert [r.answer for r in rows] == ["5", "6", "8"] and stats.bad_rows == 0


def test_blank_prompts_are_bad_rows_but_a_chat_needs_only_one_nonblank_message(tmp_path):
  chat = [{"role": "system", "content": ""}, {"role": "user", "content": "2+2?"}]
  lines = [json.dumps({"q": "   ", "a": 1}),  # whitespace only: no prompt
           json.dumps({"q": [{"role": "user", "content": " \n"}], "a": 2}),  # all blank
           json.dumps({"q": chat, "a": 3}),
           json.dumps({"q": [{"role": "user", "content": "hi", "name": "x"}], "a": 4})]
  rows, stats = load_prompt_rows(write_jsonl(tmp_path / "d.jsonl", lines), prompt_key="q",
                                 answer_key="a")
  assert [r.answer for r in rows] == ["3", "4"] and stats.bad_rows == 2
  assert "line 1: missing or empty 'q'" in stats.first_bad
  assert rows[0].prompt == chat
  # a chat message is kept as {"role", "content"}: other keys of the row's messages are dropped
  assert rows[1].prompt == [{"role": "user", "content": "hi"}]


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
  # the error says why the first row was unusable (the key to set), not only that none was
  with pytest.raises(DataError, match=r"no usable rows .*first: line 1: missing or empty "
                     r"'prompt' \(set config\.data\.prompt_key"):
    load_prompt_rows(path)


def test_held_out_files_one_or_several(tmp_path):
  """config.data.test_path: a path, several comma-separated or a list; each file's rows named by
  its file (with the folders that tell two apart) unless a row has its own source; each
  file's first num_prompts rows; a file named twice refused."""
  assert split_paths("a.jsonl") == ["a.jsonl"] and split_paths("") == []
  assert split_paths(" a.jsonl, b.parquet ,") == ["a.jsonl", "b.parquet"]
  assert split_paths(("a.jsonl", "b.jsonl")) == ["a.jsonl", "b.jsonl"]
  assert source_names(["/d/aime24.jsonl", "/e/math500.parquet"]) == ["aime24", "math500"]
  assert source_names(["/d/x/test.parquet", "/d/y/test.parquet", "/d/y/t.jsonl"]) == [
      "x/test", "y/test", "y/t"]
  assert source_names(["/d/a/x/test.jsonl", "/d/b/x/test.jsonl"]) == ["a/x/test", "b/x/test"]
  with pytest.raises(DataError, match="names '/d/a.jsonl' twice"):
    source_names(["/d/a.jsonl", "/d/b.jsonl", "/d/../d/a.jsonl"])
  with pytest.raises(DataError, match=r"^config.data.train_path names '/d/a.jsonl' twice; list "
                     "each file once"):
    source_names(["/d/a.jsonl", "/d/a.jsonl"], "data.train_path")
  (tmp_path / "x").mkdir()
  a = write_jsonl(tmp_path / "x" / "aime.jsonl", [json.dumps({"q": f"a{i}", "a": i})
                                                  for i in range(5)])
  b = write_jsonl(tmp_path / "math.jsonl", GOOD)  # GOOD rows carry sources s0 / s1
  rows = load_files([a, b], num_prompts=3, prompt_key="q", answer_key="a")
  assert [(r.prompt, r.source) for r in rows] == [
      ("a0", "aime"), ("a1", "aime"), ("a2", "aime"), ("p0", "math"), ("p1", "math"),
      ("p2", "math")]
  rows = load_files([a, b], prompt_key="q", answer_key="a", source_key="src")
  assert [r.source for r in rows] == ["aime"] * 5 + ["s0", "s1"] * 3  # a row's own wins
  rows = load_files([b], prompt_key="q", answer_key="a")  # one file: no source
  assert len(rows) == 6 and {r.source for r in rows} == {None}


def test_a_source_key_no_row_has_is_said(tmp_path, caplog):
  a = write_jsonl(tmp_path / "aime.jsonl", [json.dumps({"q": f"a{i}", "a": i}) for i in range(3)])
  b = write_jsonl(tmp_path / "math.jsonl", GOOD)  # GOOD rows carry sources s0 / s1
  load_files([a, b], prompt_key="q", answer_key="a", source_key="src")
  assert caplog.text.count("no row has") == 1  # aime's rows, not math's
  assert f"{a}: no row has config.data.source_key='src', the field accuracy is reported by: " \
         "its rows take the file's name, 'aime'" in caplog.text
  caplog.clear()
  rows = load_files([b], prompt_key="q", answer_key="a", source_key="scr")  # a typo
  assert {r.source for r in rows} == {None}
  assert f"{b}: no row has config.data.source_key='scr', the field accuracy is reported by: " \
         "no accuracy per source" in caplog.text


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


class _NoXTokenizer(CharTokenizer):
  """Has no token for "x" (as a tokenizer may lack one for text it was not built on)."""

  def encode(self, text):
    return [ord(c) for c in text if c != "x"]


def test_a_prompt_of_no_tokens_is_not_counted_as_too_long(tmp_path, caplog):
  lines = [json.dumps({"prompt": p, "answer": 0}) for p in ("ab", "xxx", "abcdef", "x")]
  rows, _ = load_prompt_rows(write_jsonl(tmp_path / "e.jsonl", lines))
  s = PromptStream(rows, _NoXTokenizer(), max_prompt_len=3)
  assert len(s) == 1 and s.dropped_long == 1 and s.dropped_empty == 2
  assert "2 of 4 prompts that encode to no tokens (rows 2, 4)" in caplog.text
  with pytest.raises(DataError, match="every prompt encodes to no tokens"):
    PromptStream(rows[1::2], _NoXTokenizer(), max_prompt_len=3)


def _draw(stream, pos, sizes):
  """The prompt indices of successive batches of `sizes` from `pos`, and the position after."""
  out = []
  for n in sizes:
    got, pos = stream.batch(pos, n)
    out.append([p.row.index for p in got])
  return out, pos


def test_epochs_are_permutations_and_resume_is_exact(tmp_path):
  s = _stream(tmp_path, n=10, max_len=5, seed=3)
  n = len(s)
  (seen, second), _ = _draw(s, Position(), [n, n])
  assert sorted(seen) == list(range(n))  # one epoch visits every prompt once
  assert sorted(second) == list(range(n)) and second != seen  # a fresh shuffle per epoch

  # Batches straddle epoch boundaries; a position restored from its saved form continues
  # identically, in another stream over the same data.
  a = _stream(tmp_path, n=10, max_len=5, seed=3)
  _, pos = _draw(a, Position(), [7])
  saved = json.loads(json.dumps(a.saved(pos)))  # checkpointed as JSON
  want, _ = _draw(a, pos, [4] * 5)
  b = _stream(tmp_path, n=10, max_len=5, seed=3)
  got, _ = _draw(b, b.resume(saved), [4] * 5)
  assert got == want
  # The order is a function of (seed, epoch): independent of how batches were drawn.
  c = _stream(tmp_path, n=10, max_len=5, seed=3)
  (flat,), _ = _draw(c, Position(), [27])
  assert flat[:2 * n] == seen + second
  d = _stream(tmp_path, n=10, max_len=5, seed=3)
  parts, _ = _draw(d, Position(), [3] * 9)
  assert [i for part in parts for i in part] == flat
  (other,), _ = _draw(_stream(tmp_path, n=10, max_len=5, seed=4), Position(), [10])
  assert not np.array_equal(flat[:10], other)


def test_each_epoch_is_the_seeded_permutation_from_its_first_prompt(tmp_path):
  """The module docstring's order, computed independently: epoch e visits
  default_rng([seed, e]).permutation(N), whole and from its first entry, however the draws
  are cut (batches that end exactly at an epoch's end, straddle it, or span several)."""
  s = _stream(tmp_path, n=10, max_len=5, seed=3)
  n = len(s)
  want = [s.prompts[i].row.index for e in range(5)
          for i in np.random.default_rng([3, e]).permutation(n)]
  for sizes in ([n] * 5, [3] * (5 * n // 3), [1, n - 1, n + 2, 2 * n - 2], [4 * n + 7]):
    got, pos = _draw(s, Position(), sizes)
    flat = [i for part in got for i in part]
    assert flat == want[:len(flat)], sizes
    assert pos == Position(*divmod(len(flat), n))


def _files_stream(sizes, weights, seed=5, shuffle=True):
  """A stream over len(sizes) files of sizes[i] prompts ("f<i>-<j>"), mixed by `weights`."""
  rows = [PromptRow(index=j, prompt=f"f{i}-{j}", answer="0", file=i)
          for i, n in enumerate(sizes) for j in range(n)]
  return PromptStream(rows, CharTokenizer(), max_prompt_len=16, seed=seed, weights=weights,
                      shuffle=shuffle)


def test_unshuffled_streams_keep_the_files_order():
  """data.shuffle=False (a curriculum the file's order holds): every epoch in file order; with
  weights, each file's rows in its order, its slots spread evenly over the epoch (worked out
  by hand: quotas 7 / 6, file 0's j-th slot at (j + 1/2) / 7, file 1's at (j + 1/2) / 6)."""
  rows = [PromptRow(index=j, prompt=f"p{j}", answer="0") for j in range(5)]
  s = PromptStream(rows, CharTokenizer(), max_prompt_len=4, seed=3, shuffle=False)
  got, pos = s.batch(Position(), 12)
  assert [p.row.index for p in got] == [0, 1, 2, 3, 4] * 2 + [0, 1] and pos == Position(2, 2)
  got, _ = _files_stream((10, 3), (0.5, 0.5), shuffle=False).batch(Position(), 26)
  assert [p.row.prompt for p in got] == [
      "f0-0", "f1-0", "f0-1", "f1-1", "f0-2", "f1-2", "f0-3", "f1-0", "f0-4", "f1-1", "f0-5",
      "f1-2", "f0-6",  # epoch 1; epoch 2 goes on with file 0's 8th row, file 1 from its first
      "f0-7", "f1-0", "f0-8", "f1-1", "f0-9", "f1-2", "f0-0", "f1-0", "f0-1", "f1-1", "f0-2",
      "f1-2", "f0-3"]


@pytest.mark.parametrize("sizes, weights, quotas", [
    ((10, 3), (0.5, 0.5), (7, 6)),  # 6.5 / 6.5: the tie to the first file
    ((10, 3), (0.7, 0.3), (9, 4)),  # 9.1 / 3.9: the larger remainder
    ((12, 1), (0.999, 0.001), (12, 1)),  # 12.99 / 0.01: every file drawn at least once
    ((4, 4, 4), (1, 1, 2), (3, 3, 6)),  # weights normalised
])
def test_weighted_files_draw_their_share_each_epoch(sizes, weights, quotas):
  """data.train_weights: an epoch is N draws (all files' prompts), file i's share of them
  w_i N by largest remainder (the quotas worked out by hand above); file i's draws pass over
  its prompts in shuffled orders one after another, so over its first k passes every prompt
  of it is drawn exactly k times (repeated where weighted above its size, spread over epochs
  where below)."""
  s = _files_stream(sizes, [w / sum(weights) for w in weights])
  n = sum(sizes)
  epochs = 12
  got, pos = s.batch(Position(), n * epochs)
  assert pos == Position(epochs, 0)
  drawn = [p.row for p in got]
  for e in range(epochs):
    epoch = drawn[e * n:(e + 1) * n]
    assert [sum(r.file == i for r in epoch) for i in range(len(sizes))] == list(quotas)
  for i, size in enumerate(sizes):
    mine = [r.index for r in drawn if r.file == i]
    passes = len(mine) // size
    for k in range(passes):  # pass k: a permutation of the file's prompts
      assert sorted(mine[k * size:(k + 1) * size]) == list(range(size)), (i, k)
    assert passes >= 2 and (size == 1 or mine[:size] != mine[size:2 * size])  # shuffled anew


def test_a_weighted_stream_is_a_function_of_its_position():
  """As the unweighted one: however the draws are cut, and from a saved position in another
  stream over the same data, the same prompts; another seed, another order."""
  def draw(stream, pos, sizes):
    got = []
    for n in sizes:
      part, pos = stream.batch(pos, n)
      got += [p.row.prompt for p in part]
    return got

  a = _files_stream((10, 3), (0.2, 0.8))
  flat = draw(a, Position(), [13 * 5 + 4])
  for sizes in ([13] * 5 + [4], [3] * 23, [1, 12, 15, 41]):
    assert draw(_files_stream((10, 3), (0.2, 0.8)), Position(), sizes) == flat, sizes
  _, pos = a.batch(Position(), 20)
  saved = json.loads(json.dumps(a.saved(pos)))
  b = _files_stream((10, 3), (0.2, 0.8))
  assert draw(b, b.resume(saved), [len(flat) - 20]) == flat[20:]
  assert draw(_files_stream((10, 3), (0.2, 0.8), seed=6), Position(), [len(flat)]) != flat


def test_a_weighted_file_with_no_usable_prompt_is_one_clear_error():
  rows = [PromptRow(index=0, prompt="ab", answer="0", file=0),
          PromptRow(index=0, prompt="abcdefgh", answer="0", file=1)]
  with pytest.raises(DataError, match="^train: /d/b.jsonl has no usable prompt .* weight in "
                     "config.data.train_weights; raise max_prompt_len or leave the file out"):
    PromptStream(rows, CharTokenizer(), max_prompt_len=4, weights=[0.5, 0.5],
                 files=["/d/a.jsonl", "/d/b.jsonl"])


def test_resume_with_different_data_is_one_clear_error(tmp_path):
  a = _stream(tmp_path, n=10, max_len=5)
  saved = a.saved(Position(1, 3))
  b = _stream(tmp_path, n=10, max_len=3)  # fewer usable prompts
  with pytest.raises(DataError, match="same data and max_prompt_len"):
    b.resume(saved)
  c = _stream(tmp_path, n=10, max_len=3)
  more = _stream(tmp_path, n=10, max_len=5)  # more usable prompts than the checkpoint's
  with pytest.raises(DataError, match="same data and max_prompt_len"):
    more.resume(c.saved(Position(1, 3)))


@pytest.mark.parametrize("edit", ["prompt", "answer", "order"])
def test_resume_over_as_many_prompts_but_not_the_same_is_one_clear_error(tmp_path, edit):
  """The data file edited or rebuilt with as many usable prompts: a position would name other
  prompts, so the resume stops (the file unchanged, it resumes)."""
  rows = [{"prompt": "x" * (1 + i % 5), "answer": i} for i in range(10)]
  path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(r) for r in rows])
  stream = lambda p: PromptStream(load_prompt_rows(p)[0], CharTokenizer(),  # noqa: E731
                                  max_prompt_len=5)
  saved = stream(path).saved(Position(1, 3))
  assert stream(path).resume(saved) == Position(1, 3)
  if edit == "prompt":
    rows[4]["prompt"] = "y" * 5
  elif edit == "answer":
    rows[4]["answer"] = 40
  else:
    rows[3], rows[4] = rows[4], rows[3]
  other = write_jsonl(tmp_path / "b.jsonl", [json.dumps(r) for r in rows])
  with pytest.raises(DataError) as e:
    stream(other).resume(saved)
  assert str(e.value) == (
      "the checkpoint's data position is for other prompts than the configured data's (as "
      "many, 10, but not the same prompts, answers or order: the data file changed since the "
      "run checkpointed); resume with the data it trained on, or start a new workdir")


# ------------------------------------------------------- chat prompts, stop tokens, sources
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def make_chat_model_dir(path, style):
  """A local tokenizer + generation_config laid out like a base Qwen2.5 (EOS <|endoftext|>,
  turns closed by <|im_end|>) or a base Llama-3 (EOS <|end_of_text|>, turns by <|eot_id|>)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  if style == "qwen2.5":
    specials, eos, template, bos = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                    "<|endoftext|>", QWEN25_TEMPLATE, None)
  else:
    specials, eos, template, bos = (["<|begin_of_text|>", "<|end_of_text|>",
                                     "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                                    "<|end_of_text|>", LLAMA3_TEMPLATE, "<|begin_of_text|>")
  # A byte-level BPE (as Qwen's and Llama-3's) so decode(encode(text)) == text exactly.
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["system user assistant You are Qwen, created by Alibaba Cloud.",
                           "What is 2+2? Be brief. hi tltmarker"] * 4, trainer=trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                 additional_special_tokens=specials)
  fast.chat_template = template
  os.makedirs(path, exist_ok=True)
  fast.save_pretrained(path)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": fast.convert_tokens_to_ids(eos)}, f)
  return fast


@pytest.mark.parametrize("style,end_of_turn", [("qwen2.5", "<|im_end|>"),
                                                ("llama3", "<|eot_id|>")])
def test_chat_template_end_of_turn_joins_the_stop_tokens(tmp_path, style, end_of_turn):
  from transformers import AutoTokenizer

  from tlt_jax.models.tokenizer import stop_token_ids
  make_chat_model_dir(str(tmp_path), style)
  tok = AutoTokenizer.from_pretrained(str(tmp_path))  # as the run loads it
  eos = tok.eos_token_id
  eot = tok.convert_tokens_to_ids(end_of_turn)
  assert eot != eos
  assert stop_token_ids(str(tmp_path), tok) == (eos,)  # plain prompts: EOS only
  assert stop_token_ids(str(tmp_path), tok, chat_template=True) == (eos, eot)


def test_chat_message_prompts_stop_at_the_end_of_turn(tmp_path):
  """Chat-message rows are rendered with the template whatever data.chat_template says, so
  the template's end-of-turn token stops their responses too (a base model's EOS is
  <|endoftext|>, its turns end with <|im_end|>); plain-text rows keep EOS alone."""
  import ml_collections
  from transformers import AutoTokenizer

  from tlt_jax import runtime
  from tlt_jax.models.tokenizer import stop_token_ids
  make_chat_model_dir(str(tmp_path), "qwen2.5")
  tok = AutoTokenizer.from_pretrained(str(tmp_path))
  eos, eot = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
  stop = stop_token_ids(str(tmp_path), tok)
  assert stop == (eos,)
  chats = write_jsonl(tmp_path / "c.jsonl", [json.dumps(
      {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"})])
  cfg = ml_collections.ConfigDict({"data": {"chat_template": False},
                                  "model": {"path": str(tmp_path)}})
  assert runtime.stop_tokens(cfg, tok, load_prompt_rows(chats)[0]) == (eos, eot)
  texts = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"prompt": "2+2?", "answer": "4"})])
  assert runtime.stop_tokens(cfg, tok, load_prompt_rows(texts)[0]) == (eos,)


def test_chat_message_prompts_are_rendered_with_the_template(tmp_path):
  """Parquet rows whose prompt is a list of chat messages (the layout of common RL math sets)
  load as chats, not as malformed rows, and encode through the tokenizer's template."""
  from transformers import AutoTokenizer
  make_chat_model_dir(str(tmp_path / "model"), "qwen2.5")
  tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
  path = str(tmp_path / "d.parquet")
  chats = [[{"role": "user", "content": "What is 2+2?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
           [{"role": "user"}],  # malformed: no content
           []]  # malformed: empty
  pq.write_table(pa.table({"prompt": chats, "answer": ["4", "x", "y", "z"]}), path)
  rows, stats = load_prompt_rows(path)
  assert stats.bad_rows == 2 and "row 3" in stats.first_bad
  assert rows[0].prompt == chats[0] and rows[1].prompt == chats[1]
  stream = PromptStream(rows, tok, max_prompt_len=64, system_prompt="Be brief.")
  texts = [tok.decode(p.ids) for p in stream.prompts]
  assert texts[0] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                      "<|im_end|>\n<|im_start|>assistant\n")  # system_prompt prepended
  assert texts[1] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi"
                      "<|im_end|>\n<|im_start|>assistant\n")  # the row's own system message
  with pytest.raises(DataError, match="chat messages.*no chat template"):
    PromptStream(rows, CharTokenizer(), max_prompt_len=64)


def test_source_values_of_any_json_type_become_strings(tmp_path):
  lines = [json.dumps({"q": "a", "a": 1, "src": ["gsm8k", "train"]}),
           json.dumps({"q": "b", "a": 2, "src": {"name": "math", "level": 3}}),
           json.dumps({"q": "c", "a": 3, "src": 7}), json.dumps({"q": "d", "a": 4})]
  rows, _ = load_prompt_rows(write_jsonl(tmp_path / "d.jsonl", lines), prompt_key="q",
                             answer_key="a", source_key="src")
  assert [r.source for r in rows] == ['["gsm8k","train"]', '{"level":3,"name":"math"}', "7",
                                      None]
  assert len({r.source for r in rows}) == 4  # hashable: they group accuracy metrics
