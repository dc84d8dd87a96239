"""tlt_jax.metrics: JSONL records survive a kill mid-write; the compile clock counts XLA's
compiles per run."""

import json
import threading

import jax
import jax.numpy as jnp
import pytest

from tlt_jax.metrics import CompileClock, MetricsWriter, flatten, keep_steps_upto, read_records


def _write(path, recs, tail=""):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
    f.write(tail)


def test_a_line_cut_short_by_a_kill_is_dropped_and_said(tmp_path, capsys):
  path = tmp_path / "m.jsonl"
  recs = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
  _write(path, recs, '{"step": 3, "lo')
  assert read_records(str(path)) == recs
  err = capsys.readouterr().err
  assert "cut short by a kill" in err and len(err.strip().splitlines()) == 1
  with pytest.raises(ValueError, match="cut short"):
    read_records(str(path), tolerate_partial=False)
  _write(path, recs, json.dumps({"step": 3}))  # whole record, newline missing: kept
  assert read_records(str(path)) == recs + [{"step": 3}]


def test_a_bad_line_before_the_last_is_damage_not_a_kill(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
  with pytest.raises(ValueError, match="line 2"):
    read_records(str(path))


def test_resume_drops_later_steps_and_the_cut_line_then_appends_cleanly(tmp_path):
  """The writer of a resumed run: records after the restored step and a cut-short last line
  go, and the next record starts on its own line."""
  _write(tmp_path / "metrics.jsonl", [{"step": s} for s in (1, 2, 3)], '{"step": 4, "r')
  w = MetricsWriter(str(tmp_path), resume_step=2)
  w.write(3, {"reward": 1.0})
  w.close()
  assert read_records(str(tmp_path / "metrics.jsonl")) == [
      {"step": 1}, {"step": 2}, {"step": 3, "reward": 1.0}]
  keep_steps_upto(str(tmp_path / "missing.jsonl"), 5)  # nothing to trim: no file made
  assert not (tmp_path / "missing.jsonl").exists()


def _tb_events(workdir):
  """Every event of the run's TensorBoard files (TFRecord: length, crc, data, crc)."""
  import glob
  import os
  import struct

  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(os.path.join(workdir, "tb", "*"))):
    data, i = open(path, "rb").read(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  return out


def test_tensorboard_purges_the_steps_after_the_restored_one(tmp_path):
  """TensorBoard drops the earlier run's events at and after a START's step: that is the
  first step the resumed run writes again, the restored step's own scalars stay."""
  MetricsWriter(str(tmp_path), resume_step=4).close()
  starts = [e.step for e in _tb_events(tmp_path)
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert starts == [5]


def test_responses_go_to_their_file_and_tensorboards_text_and_a_resume_drops_later_steps(
    tmp_path):
  """MetricsWriter.responses: each record a JSON line with its step, and the step's records as
  markdown in TensorBoard's Text tab (every response's text, reward and prompt); resumed at
  step 1, step 2's lines go before step 2 is written again."""
  from tlt_jax.metrics import responses_markdown
  recs = [{"prompt_index": i, "sample": 0, "source": None, "prompt": f"Q: {i}+1",
           "answer": str(i + 1), "response": f"{i}+1={i + 1} #### {i + 1}", "reward": 1.0,
           "tokens": 9, "finish_reason": "stop"} for i in range(2)]
  w = MetricsWriter(str(tmp_path), resume_step=0)
  for step in (1, 2):
    w.responses("rollouts", step, [dict(r, reward=float(step)) for r in recs])
  w.responses("eval_responses", 1, [])  # nothing: no file
  w.close()
  lines = read_records(str(tmp_path / "rollouts.jsonl"))
  assert [(x["step"], x["prompt_index"], x["reward"]) for x in lines] == [
      (1, 0, 1.0), (1, 1, 1.0), (2, 0, 2.0), (2, 1, 2.0)]
  assert not (tmp_path / "eval_responses.jsonl").exists()
  texts = {e.step: e.summary.value[0].tensor.string_val[0].decode()
           for e in _tb_events(tmp_path) if e.HasField("summary")
           and e.summary.value[0].tag.startswith("rollouts")}
  assert sorted(texts) == [1, 2]
  for step, text in texts.items():
    assert text == responses_markdown([dict(r, reward=float(step)) for r in recs])
    for r in recs:
      assert r["response"] in text and r["prompt"] in text
    assert f"**prompt 1, sample 0**: reward {step:g}, 9 tokens (stop), answer `2`" in text
  MetricsWriter(str(tmp_path), resume_step=1).close()
  assert [x["step"] for x in read_records(str(tmp_path / "rollouts.jsonl"))] == [1, 1]


def test_flatten_joins_every_level_of_nested_keys():
  nested = {"loss": 0.5, "spot": {"steps": 3, "per_worker": {"0": {"steps": 1}}}}
  assert flatten(nested) == {"loss": 0.5, "spot/steps": 3, "spot/per_worker/0/steps": 1}
  assert flatten(nested, sep=".")["spot.per_worker.0.steps"] == 1


def test_compile_clock_counts_its_own_compiles():
  first = CompileClock()
  jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.ones((7, 5))).block_until_ready()
  lap = first.lap()
  assert lap["compile"] > 0 and lap["compile_background"] == 0.0
  assert first.lap() == {"compile": 0.0, "compile_background": 0.0}  # nothing since the last
  second = CompileClock()  # a second run in the same process starts from zero
  assert second.lap()["compile"] == 0.0
  first.close()
  jax.jit(lambda x: jnp.cos(x) - 2.0)(jnp.ones((3, 11))).block_until_ready()
  assert first.lap()["compile"] == 0.0 and second.lap()["compile"] > 0  # closed: not listening
  second.close()


def test_compile_clock_counts_the_background_compilers_apart():
  """A compile on a thread that compiles ahead of need (the engine's, the drafter's) stalled
  no step: it is counted as `compile_background`, a worker thread's compile as `compile`."""
  from tlt_jax.rollout.executables import background_compiler

  clock = CompileClock()
  compiler = background_compiler("compile-test")
  try:
    compiler.submit(lambda: jax.jit(lambda x: jnp.tanh(x) * 5.0)(jnp.ones((9, 2)))
                    .block_until_ready()).result()
    lap = clock.lap()
    assert lap["compile_background"] > 0 and lap["compile"] == 0.0
    worker = threading.Thread(
        target=lambda: jax.jit(lambda x: jnp.tanh(x) - 4.0)(jnp.ones((2, 9))).block_until_ready())
    worker.start()
    worker.join()
    lap = clock.lap()
    assert lap["compile"] > 0 and lap["compile_background"] == 0.0
  finally:
    compiler.shutdown()
    clock.close()
