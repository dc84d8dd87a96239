"""Weights & Biases logging (tlt_jax/wandb_log.py) read back from the run file wandb writes,
by a reader of its format of our own (tests/wandb_file.py), not by wandb's or our writer's
code: every scalar the writer gets, the responses as tables, the config, the exit code, the
same wandb run on resume; config mistakes and wandb's own failures."""

import importlib.util
import io
import math
import os

import pytest

from tlt_jax import config as config_lib
from tlt_jax.errors import ConfigError
from tlt_jax.metrics import MetricsWriter, flatten
from tlt_jax.wandb_log import RUN_FILE, WandbConfig, WandbRun
import wandb_file

pytest.importorskip("wandb")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
  """wandb's own settings, caches and logs in the test's folder, no key, no network."""
  for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var))
  for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # (no ~/.netrc key either)


def _config(**wandb):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  for k, v in wandb.items():
    cfg.wandb[k] = v
  return cfg


def test_config_mistakes_are_one_line_each(monkeypatch):
  with pytest.raises(ConfigError, match=r"config\.wandb\.mode='cloud': use 'online', "):
    config_lib.run_spec(_config(project="p", mode="cloud"))
  cfg = _config()
  with cfg.unlocked():  # (a config file's own section: ml_collections checks overrides' types)
    cfg.wandb = {"project": "p", "tags": ["a", 3]}
  with pytest.raises(ConfigError, match=r"config\.wandb\.tags=\['a', 3\]: a string "
                     r"\(comma-separated\) or a list of strings"):
    config_lib.run_spec(cfg)
  with cfg.unlocked():
    cfg.wandb = {"project": "p", "tags": ["a", " b "]}
  assert config_lib.run_spec(cfg).wandb.tag_list == ["a", "b"]
  assert config_lib.run_spec(_config()).wandb == WandbConfig()  # off by default
  real = importlib.util.find_spec
  monkeypatch.setattr("importlib.util.find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(ConfigError, match=r"config\.wandb\.project='p': wandb is not installed: "
                     r"`pip install wandb`"):
    config_lib.run_spec(_config(project="p"))
  config_lib.run_spec(_config())  # (not asked for: not needed)


def _metrics(step):
  """A step's record as the trainer writes it: nested, with ints, floats, a bool, a string, a
  list and a NaN."""
  return {"reward": 0.25 * step, "tokens": 100 + step, "eval": {"accuracy": 0.5, "n": 8},
          "loss": {"loss": -0.01 * step, "grad_norm": float("nan") if step == 2 else 1.5},
          "spec": {"enabled": step % 2 == 0, "arm": "4_1_5", "lengths": [1, 2]}}


def _responses(step):
  return [{"prompt_index": i, "sample": 0, "source": None if i else "math500",
           "prompt": f"Q{i}", "answer": "3", "response": f" {step}+{i}", "reward": float(i),
           "tokens": 5 + i, "finish_reason": "stop", "reward_extra": {"acc": bool(i)}}
          for i in range(3)]


def _equal(a, b):
  return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and math.isnan(a) else a == b


def test_every_scalar_and_response_table_reaches_the_run_file_and_a_restart_continues_it(
    tmp_path):
  workdir = str(tmp_path / "run")
  cfg = WandbConfig(project="tlt-test", mode="offline", tags="a, b", group="g")
  out = io.StringIO()
  board = WandbRun.start(cfg, workdir, {"grpo": {"n": 8}, "seed": 3}, out=out)
  writer = MetricsWriter(workdir, -1, board)
  for step in range(3):
    writer.responses("rollouts", step, _responses(step))
    writer.write(step, _metrics(step))
  writer.close()
  board.close()
  (first,) = wandb_file.offline_runs(workdir)
  assert out.getvalue() == (f"wandb: offline run run ({board.id}) in {first} "
                            "(`wandb sync` it to upload)\n")
  got = wandb_file.read_run(first)
  assert got["id"] == board.id and got["exit_code"] == 0
  assert got["config"]["grpo"] == {"n": 8} and got["config"]["seed"] == 3
  assert [h["_step"] for h in got["history"]] == [0, 1, 2]
  for step, row in enumerate(got["history"]):
    want = {k: v for k, v in flatten(_metrics(step)).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    mine = {k: v for k, v in row.items() if not k.startswith(("_", "rollouts/"))}
    assert mine.keys() == want.keys() and all(_equal(mine[k], want[k]) for k in want), step
    cells = [{**r, "reward_extra": '{"acc": ' + ("true" if r["prompt_index"] else "false")
              + "}", "step": step} for r in _responses(step)]
    assert wandb_file.table_rows(first, row, "rollouts") == cells
  # the same command again, resumed at step 2: the same wandb run (the id kept in the
  # workdir), a new folder that holds (offline, wandb has no step of it) the steps on disk and
  # then the new one
  again = WandbRun.start(cfg, workdir, {"grpo": {"n": 8}, "seed": 3}, out=io.StringIO())
  writer = MetricsWriter(workdir, 2, again)
  writer.write(3, _metrics(3))
  writer.close()
  again.close(exit_code=143)
  later = wandb_file.offline_runs(workdir)[1]
  got = wandb_file.read_run(later)
  assert got["id"] == board.id and got["exit_code"] == 143
  assert [h["_step"] for h in got["history"]] == [0, 1, 2, 3]
  # another project in that workdir: another wandb run
  other = WandbRun.start(WandbConfig(project="elsewhere", mode="offline"), workdir, {},
                         out=io.StringIO())
  other.close()
  assert other.id != board.id
  assert open(os.path.join(workdir, RUN_FILE)).read().count(other.id) == 1


class _Run:
  """wandb's run as WandbRun uses it: `step` (the step wandb holds: a resumed run's next),
  `log`, `finish`; `fail` makes log raise as a dead wandb service does."""

  def __init__(self, step=0, fail=False):
    self.step, self.fail, self.logged, self.finished = step, fail, [], []

  def log(self, row, step):
    if self.fail:
      raise BrokenPipeError("wandb-core is gone")
    self.logged.append(step)
    self.rows = getattr(self, "rows", {})
    self.rows[step] = row
    self.step = step

  def finish(self, exit_code=0):
    self.finished.append(exit_code)


def test_a_resumed_run_sends_no_step_before_the_one_wandb_holds():
  run = _Run(step=5)  # online, wandb resumed the run at step 5 (the killed run logged 0..4)
  board = WandbRun(run, None)
  for step in (3, 4, 5, 6):
    board.log(step, {"x": 1.0})
  assert run.logged == [5, 6]


def test_a_failure_inside_wandb_stops_its_logging_not_the_run(capsys):
  run = _Run(fail=True)
  board = WandbRun(run, None)
  board.log(1, {"x": 1.0})
  board.log(2, {"x": 1.0})  # (not tried again)
  board.close()
  assert run.finished == [1]
  assert capsys.readouterr().err == ("wandb: logging stopped (BrokenPipeError: wandb-core is "
                                     "gone); metrics.jsonl and TensorBoard go on\n")


def test_wandb_that_cannot_start_is_one_config_error_naming_the_fixes(tmp_path):
  with pytest.raises(ConfigError) as e:  # online, and no API key anywhere
    WandbRun.start(WandbConfig(project="tlt-test", mode="online"), str(tmp_path / "run"), {})
  text = str(e.value)
  assert text.startswith("config.wandb.project='tlt-test': wandb could not start the run ("), text
  assert "`wandb login`" in text and "wandb.mode=offline" in text and "\n" not in text


def test_a_resumed_run_sends_the_steps_on_disk_its_wandb_run_lacks(tmp_path):
  """A run killed after its step-2 checkpoint (its metrics and responses written to step 3),
  its wandb run holding steps 0 and 1 only (the rest was in wandb's buffers): the resumed
  writer sends step 2 from the files before anything new, step 3 not (recomputed)."""
  import wandb
  workdir = str(tmp_path)
  writer = MetricsWriter(workdir, -1)
  for step in range(4):
    writer.responses("rollouts", step, _responses(step))
    writer.write(step, _metrics(step))
  writer.close()
  run = _Run(step=2)  # (wandb's next step: 0 and 1 logged)
  writer = MetricsWriter(workdir, 2, WandbRun(run, wandb))
  assert run.logged == [2]
  row = run.rows[2]
  want = {k: v for k, v in flatten(_metrics(2)).items()
          if isinstance(v, (int, float)) and not isinstance(v, bool)}
  assert {k: v for k, v in row.items() if k != "rollouts"}.keys() == want.keys()
  table = row["rollouts"]
  assert [dict(zip(table.columns, r)) for r in table.data] == [
      {"step": 2, **r, "reward_extra": '{"acc": ' + ("true" if r["prompt_index"] else "false")
       + "}"} for r in _responses(2)]
  writer.write(3, _metrics(3))
  assert run.logged == [2, 3]
  writer.close()


def test_the_main_job_stops_on_a_wandb_login_problem_before_loading_anything(tmp_path):
  """`python -m tlt_jax.train` with wandb online and no API key: exit 2 and one error line
  naming the fixes, before the data and the model load (no `data:` line), the workdir's
  checkpoints untouched (none made)."""
  import subprocess
  import sys
  from user_env import user_env
  env = user_env(JAX_PLATFORMS="cpu", XLA_FLAGS="")
  for var in ("WANDB_API_KEY", "WANDB_MODE"):
    env.pop(var, None)
  proc = subprocess.run(
      [sys.executable, "-m", "tlt_jax.train", "--config", "configs/default.py", "--workdir",
       str(tmp_path / "run"), "--config.wandb.project=tlt-test", "--config.wandb.mode=online"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith("error: config.wandb.project='tlt-test': wandb could not start "
                              "the run ("), proc.stderr[-2000:]
  assert "`wandb login`" in lines[-1] and "wandb.mode=offline" in lines[-1]
  assert not any(line.startswith("data:") for line in lines)
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_eval_command_logs_its_numbers_and_responses_to_a_run_of_its_own(tmp_path):
  """`python -m tlt_jax.eval` with wandb offline: a new wandb run (job type eval, grouped by
  the workdir's name) whose one row holds every number of eval.json under training's names
  (`eval/...`) and eval_responses.jsonl as its table; the training run's id in wandb.json is
  left as it is."""
  import json
  import subprocess
  import sys
  from user_env import user_env
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / RUN_FILE).write_text('{"id": "trainid1", "project": "tlt-test", "entity": ""}')
  proc = subprocess.run(
      [sys.executable, "-m", "tlt_jax.eval", "--config", "configs/default.py",
       f"--config.workdir={workdir}", "--config.eval.num_prompts=6",
       "--config.wandb.project=tlt-test", "--config.wandb.mode=offline"],
      cwd=ROOT, env=user_env(JAX_PLATFORMS="cpu", XLA_FLAGS=""), capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (folder,) = wandb_file.offline_runs(str(workdir))
  got = wandb_file.read_run(folder)
  assert got["job_type"] == "eval" and got["group"] == "run" and got["exit_code"] == 0
  assert got["id"] != "trainid1"
  assert proc.stderr.count("wandb: offline run run-eval (") == 1
  assert json.loads((workdir / RUN_FILE).read_text())["id"] == "trainid1"
  (row,) = got["history"]
  with open(workdir / "eval.json") as f:
    want = {k: v for k, v in flatten({"eval": json.load(f)}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
  mine = {k: v for k, v in row.items() if not k.startswith(("_", "eval_responses/"))}
  assert mine == want and want["eval/num_prompts"] == 6
  with open(workdir / "eval_responses.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == 6 and wandb_file.table_rows(folder, row, "eval_responses") == lines
