"""verl's preprocessed files read as they are (#37): Parquet rows with chat-message prompts,
reward_model.ground_truth, data_source and extra_info, written here with pyarrow in the layout
verl's examples/data_preprocess/gsm8k.py writes, from the default task's rows; a short run on
them equals the run on the same rows as the default JSONL."""

import json
import os
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax import runtime
from tlt_jax.config import asset_path, load_config_file
from tlt_jax.data.prompts import DataError, load_prompt_rows
from tlt_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERL_KEYS = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth",
             "source_key": "data_source"}


def default_rows(n, split="train"):
  """The first n rows of the default task's JSONL."""
  with open(asset_path("default", "data", f"{split}.jsonl")) as f:
    return [json.loads(next(f)) for _ in range(n)]


def source_of(index):
  """Two sources, so that a response's reward must get its own row's."""
  return "arith/odd" if index % 2 else "arith/even"


def verl_row(row, index, split="train"):
  """A default-task row as verl's gsm8k.py lays out a GSM8K one (extra_info's answer: the
  worked solution, where the row has one)."""
  return {"data_source": source_of(index),
          "prompt": [{"role": "user", "content": row["prompt"]}],
          "ability": "math",
          "reward_model": {"style": "rule", "ground_truth": row["answer"]},
          "extra_info": {"split": split, "index": index,
                         "answer": row.get("response", row["answer"]),
                         "question": row["prompt"]}}


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_verl_parquet_loads_as_the_default_rows(tmp_path):
  src = default_rows(24)
  path = write_parquet(tmp_path / "train.parquet", [verl_row(r, i) for i, r in enumerate(src)])
  schema = pq.read_schema(path)  # verl's layout: nested columns, not JSON strings
  assert pa.types.is_struct(schema.field("reward_model").type)
  assert pa.types.is_list(schema.field("prompt").type)
  rows, stats = load_prompt_rows(path, **VERL_KEYS, on_bad_row="error")
  assert stats.rows == 24 and stats.bad_rows == 0
  assert [r.prompt for r in rows] == [[{"role": "user", "content": s["prompt"]}] for s in src]
  assert [r.answer for r in rows] == [s["answer"] for s in src]
  assert [r.source for r in rows] == [source_of(i) for i in range(24)]
  assert [r.extra_info for r in rows] == [verl_row(s, i)["extra_info"] for i, s in enumerate(src)]


def test_a_ground_truth_stored_as_a_list_of_one(tmp_path):
  src = default_rows(4)
  rows = [verl_row(r, i) for i, r in enumerate(src)]
  for r in rows:
    r["reward_model"]["ground_truth"] = [r["reward_model"]["ground_truth"]]
  got, _ = load_prompt_rows(write_parquet(tmp_path / "d.parquet", rows), **VERL_KEYS)
  assert [r.answer for r in got] == [s["answer"] for s in src]


def _drop_reward_model(r):
  del r["reward_model"]


def _drop_ground_truth(r):
  del r["reward_model"]["ground_truth"]


def _one_message_not_a_list(r):
  r["prompt"] = r["prompt"][0]


def _two_ground_truths(r):
  r["reward_model"]["ground_truth"] = ["1", "2"]


# (Parquet keeps one type per column: a dropped field is a null there, a retyped one only fits
# in JSONL.)
@pytest.mark.parametrize("fmt,breaks,needle", [
    ("parquet", _drop_reward_model, "row 2: missing 'reward_model.ground_truth' (the row has "
     "no 'reward_model'; set config.data.answer_key?)"),
    ("jsonl", _drop_reward_model, "line 2: missing 'reward_model.ground_truth' (the row has "
     "no 'reward_model'; set config.data.answer_key?)"),
    ("parquet", _drop_ground_truth, "row 2: missing 'reward_model.ground_truth' (set "
     "config.data.answer_key?)"),
    ("jsonl", _drop_ground_truth, "line 2: missing 'reward_model.ground_truth' (set "
     "config.data.answer_key?)"),
    ("jsonl", _one_message_not_a_list, "line 2: 'prompt' is a dict, not text or a list of chat "
     "messages"),
    ("jsonl", _two_ground_truths, "line 2: 'reward_model.ground_truth' is a list of 2 values, "
     "not one answer"),
])
def test_bad_verl_rows_name_row_and_key_or_are_skipped(tmp_path, fmt, breaks, needle):
  rows = [verl_row(r, i) for i, r in enumerate(default_rows(3))]
  breaks(rows[1])
  path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"d.{fmt}", rows)
  with pytest.raises(DataError) as e:
    load_prompt_rows(path, **VERL_KEYS, on_bad_row="error")
  msg = str(e.value)
  assert msg.startswith(f"{path}: {needle}") and "on_bad_row='skip'" in msg, msg
  assert "\n" not in msg
  got, stats = load_prompt_rows(path, **VERL_KEYS, on_bad_row="skip")
  assert [r.index for r in got] == [0, 2] and stats.bad_rows == 1
  assert needle in stats.first_bad


def test_the_run_reads_dotted_keys_from_the_config(tmp_path):
  """runtime.load_train_rows: the config's keys; several files concatenated in order, each
  row's own source kept (verl's data_source); a bad row as one ConfigError line."""
  cfg = load_config_file(os.path.join(ROOT, "configs", "verl_math.py"))
  rows = [verl_row(r, i) for i, r in enumerate(default_rows(3))]
  cfg.data.train_path = write_parquet(tmp_path / "a.parquet", rows)
  got = runtime.load_train_rows(cfg)
  assert [r.answer for r in got] == [r["reward_model"]["ground_truth"] for r in rows]
  more = [dict(verl_row(r, i), data_source="other") for i, r in enumerate(default_rows(2))]
  cfg.data.train_path += "," + write_parquet(tmp_path / "more.parquet", more)
  got = runtime.load_train_rows(cfg)
  assert [(r.answer, r.source) for r in got] == [
      (r["reward_model"]["ground_truth"], r["data_source"]) for r in rows + more]
  _drop_reward_model(rows[2])
  cfg.data.on_bad_row = "error"
  cfg.data.train_path = write_parquet(tmp_path / "b.parquet", rows)
  with pytest.raises(ConfigError, match=r"b\.parquet: row 3: missing 'reward_model\."
                     r"ground_truth' \(the row has no 'reward_model'; set config\.data\."
                     r"answer_key\?\)"):
    runtime.load_train_rows(cfg)


# --------------------------------------------------------------------- a run on a verl file
# A verl user's reward file, unchanged: verl's signature, called by keyword. It scores with the
# default task's verifier only when data_source is its row's (told apart by extra_info), and
# logs what it was given.
VERL_REWARD = textwrap.dedent("""
    import json, os
    from tlt_jax.data import arith
    _LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl")

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with open(_LOG, "a") as f:
            f.write(json.dumps([data_source, ground_truth, extra_info]) + "\\n")
        if data_source != ("arith/odd" if extra_info["index"] % 2 else "arith/even"):
            return -1.0
        score = arith.score(solution_str, ground_truth)
        return {"score": score, "acc": score >= 1.0, "pred": solution_str.split("####")[-1]}
""")


def model_with_chat_template(path):
  """The default model whose tokenizer renders a chat as its messages' text: a one-message
  chat has the ids of the text prompt, so the verl file is the same data as the JSONL."""
  src = asset_path("default", "model")
  os.makedirs(path)
  for name in os.listdir(src):
    if name != "tokenizer_config.json":
      os.symlink(os.path.join(src, name), os.path.join(path, name))
  with open(os.path.join(src, "tokenizer_config.json")) as f:
    tok = json.load(f)
  tok["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(tok, f)
  return str(path)


def test_a_run_on_verl_parquet_equals_the_run_on_the_default_jsonl(tmp_path):
  """A step and held-out evaluation before and after it, on the same rows as JSONL with
  the `arith` reward and as verl Parquet with a verl reward file: the same prompt ids,
  responses, rewards and updates; the verl function got each response's own row's values. The
  rest of its dict: "acc" averaged in the step's and the evaluation's records (the accuracy),
  each logged response's own "acc" and "pred" (its text after ####)."""
  from test_train import _records, _run, _small_cfg
  data = {split: default_rows(n, split) for split, n in (("train", 16), ("test", 8))}
  verl = {split: [verl_row(r, i, split) for i, r in enumerate(rows)]
          for split, rows in data.items()}
  (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
  common = {"tlt.enabled": False, "train.eval_every": 1, "eval.num_prompts": 8,
            "train.log_rollouts": 4}
  run_a, _ = _run(_small_cfg(tmp_path / "jsonl", 1, **common, **{
      f"data.{split}_path": write_jsonl(tmp_path / f"{split}.jsonl", rows)
      for split, rows in data.items()}))
  run_b, _ = _run(_small_cfg(tmp_path / "verl", 1, **common, **{
      f"data.{split}_path": write_parquet(tmp_path / f"{split}.parquet", rows)
      for split, rows in verl.items()}, **{f"data.{k}": v for k, v in VERL_KEYS.items()},
      **{"model.path": model_with_chat_template(tmp_path / "model"),
         "reward.name": f"{tmp_path / 'verl_reward.py'}:compute_score"}))
  assert [p.ids for p in run_b.stream.prompts] == [p.ids for p in run_a.stream.prompts]

  a, b = _records(tmp_path / "jsonl"), _records(tmp_path / "verl")
  assert [r["step"] for r in b] == [0, 1]
  assert any(r.get("reward", 0) > 0 for r in a)  # (not vacuous: some responses are right)
  for ra, rb in zip(a, b):
    if "eval" in ra:
      assert rb["eval"]["accuracy"] == ra["eval"]["accuracy"]
    if ra["step"] > 0:  # the same responses, rewards and so updates
      assert rb["tokens"] == ra["tokens"]
      assert rb["reward"] == ra["reward"] and rb["accuracy"] == ra["accuracy"]
      assert rb["loss"]["loss"] == ra["loss"]["loss"]
      assert rb["reward_stats"]["errors"] == 0
      assert set(rb["accuracy_by_source"]) <= {"arith/even", "arith/odd"}
      assert rb["reward_extra"] == {"acc": pytest.approx(rb["accuracy"])}
      assert "reward_extra" not in ra
    if "eval" in rb:
      assert rb["eval"]["reward_extra"] == {"acc": pytest.approx(rb["eval"]["accuracy"])}
  logged = [json.loads(line) for line in open(tmp_path / "verl" / "rollouts.jsonl")]
  assert len(logged) == 4 * 4
  for rec in logged:
    assert rec["reward_extra"] == {"acc": rec["reward"] >= 1.0,
                                   "pred": rec["response"].split("####")[-1]}
  calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
  splits = [extra["split"] for _, _, extra in calls]
  assert splits.count("train") == 4 * 4 and splits.count("test") == 2 * 8  # (prompts x n)
  for source, truth, extra in calls:  # each response's own row's, as the file has it
    split, i = extra["split"], extra["index"]
    assert [source, truth, extra] == [source_of(i), data[split][i]["answer"],
                                      verl[split][i]["extra_info"]]
