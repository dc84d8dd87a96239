"""The RL loop end to end: metrics files, checkpoints, exact resume after SIGKILL, baseline flag,
and the real-work configs' path checks."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tlt_jax import config as config_lib
from tlt_jax import memory, runtime
from tlt_jax.errors import ConfigError
from user_env import user_env
import wandb_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A few-second step on the shipped default model: 4 prompts x 4 samples, from two training
# files (the default task's and the long-tail variant's, concatenated: two sources); held out,
# the first 8 prompts of the two test files (one of the latter's longer than max_prompt_len,
# left out)
TEST_FILES = [config_lib.asset_path(name, "data", "test.jsonl") for name in ("default", "longtail")]
TRAIN_FILES = [config_lib.asset_path(n, "data", "train.jsonl") for n in ("default", "longtail")]
SMALL = [f"--config.data.train_path={','.join(TRAIN_FILES)}",
         "--config.grpo.num_prompts=4", "--config.grpo.n=4", "--config.grpo.micro_batch=16",
         "--config.grpo.minibatches=1", "--config.rollout.max_batch=16",
         "--config.rollout.max_new_tokens=96", "--config.eval.num_prompts=8",
         f"--config.data.test_path={','.join(TEST_FILES)}",
         "--config.train.eval_every=2", "--config.train.checkpoint_every=1",
         "--config.reward.num_workers=1"]


def _cmd(workdir, steps, *extra):
  return [sys.executable, "-m", "tlt_jax.train", "--config", "configs/default.py",
          "--workdir", str(workdir), f"--config.train.steps={steps}", *SMALL, *extra]


# Weights & Biases, offline: the run file wandb writes under <workdir>/wandb/ (tests/wandb_file.py
# reads it)
WANDB = ["--config.wandb.project=tlt-test", "--config.wandb.mode=offline"]


def _env():
  return user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu")


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _assert_stderr_as_the_readme_says(stderr):
  """The README's "What the main job prints" block lists the lines a run writes to stderr, in
  order: every line the run wrote opens with one of the block's prefixes ("data:", "step 0:",
  ...), and each prefix's first line comes in the block's order."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  block = readme.split("On stderr, in this order")[1].split("```")[1]
  prefixes = [line.split(":")[0] + ":" for line in block.strip().splitlines()]
  # tqdm redraws its bar with carriage returns, and a line printed under it follows the bar
  lines = [re.sub(r"train:[^\]]*\]", "", seg).strip() for seg in re.split(r"[\r\n]", stderr)]
  lines = [x for x in lines if x]
  assert lines, stderr
  for line in lines:
    assert any(line.startswith(p) for p in prefixes), (line, prefixes)
  firsts = [next(i for i, x in enumerate(lines) if x.startswith(p)) for p in prefixes
            if p != "train:"]
  assert firsts == sorted(firsts), (prefixes, lines)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 4-step run, TLT off (what the interrupted runs below must equal), its
  best evaluated policy kept (train.export_best)."""
  ref_dir = tmp_path_factory.mktemp("ref")
  ref = subprocess.run(_cmd(ref_dir, 4, "--config.tlt.enabled=False",
                            "--config.train.export_best=accuracy", *WANDB), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=900)
  assert ref.returncode == 0, ref.stderr[-3000:]
  return ref_dir, ref.stderr


def _assert_rollout_is_the_learners(rec):
  """The rollout's recorded log-probs (the engine's decode over its paged cache) against the
  learner's recomputation over the packed rows, token by token: in float32 the two
  distributions agree to rounding (one token out of alignment would be ~0.1 apart)."""
  loss = rec["loss"]
  assert loss["rollout_prob_diff"] < 1e-5 and loss["rollout_k3"] < 1e-9, loss
  assert abs(loss["rollout_kl"]) < 1e-5, loss
  assert "rollout_is_weight" not in loss  # (no correction asked for)


def _resume_equals_reference(run_dir, ref_dir, done: int, *extra):
  """Re-running the command resumes from step `done` and finishes; every step equals the
  uninterrupted run's."""
  again = subprocess.run(_cmd(run_dir, 4, "--config.tlt.enabled=False", *extra), cwd=ROOT,
                         env=_env(),
                         capture_output=True, text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {run_dir / 'checkpoints'} at step {done}" in again.stderr
  recs, want = _records(run_dir), _records(ref_dir)
  assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]  # no duplicated or missing step
  for a, b in zip(recs[1:], want[1:]):
    assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"], (a["step"], a, b)
    assert a["loss"]["loss"] == pytest.approx(b["loss"]["loss"], rel=1e-4, abs=1e-6)
  assert recs[-1]["eval"]["accuracy"] == want[-1]["eval"]["accuracy"]


def test_sigkill_during_training_resumes_exactly(tmp_path, reference):
  """Kill the run right after its step-2 checkpoint lands; re-running the same command
  resumes and finishes, and steps 3-4 equal those of a run that was never killed."""
  ref_dir, ref_stderr = reference
  run_dir = tmp_path / "run"
  # (with config.wandb.project, first of all a line saying where the wandb run is)
  (where,) = wandb_file.offline_runs(ref_dir)
  first, ref_stderr = ref_stderr.split("\n", 1)
  assert re.fullmatch(rf"wandb: offline run ref\d* \(\w{{8}}\) in {where} \(`wandb sync` it to "
                      r"upload\)", first), first
  _assert_stderr_as_the_readme_says(ref_stderr)
  assert "curves.png beside it" in ref_stderr and (ref_dir / "curves.png").stat().st_size > 0
  # two test files: each one's accuracy apart, in the records and the lines; the whole the
  # mean over both files' prompts; a prompt too long left out (said), not a crash
  data = next(line for line in ref_stderr.splitlines() if line.startswith("data:"))
  assert ("; 15 held-out prompts (default/data/test 8, longtail/data/test 7, 1 left out, "
          "longer than max_prompt_len or of no token)") in data
  # two training files: concatenated, each one's usable prompts counted, each a source
  n, a, b, long = map(int, re.match(
      r"data: (\d+) training prompts from 2 files \(default/data/train (\d+), "
      r"longtail/data/train (\d+); (\d+) dropped as longer than max_prompt_len=80 tokens\);",
      data).groups())
  assert n == a + b and a + b + long == 8000 and a == 4000, data
  assert set().union(*(r["accuracy_by_source"] for r in _records(ref_dir)[1:])) == {
      "default/data/train", "longtail/data/train"}
  for r in _records(ref_dir)[1:]:  # each step's 4 prompts, by the file they came from
    assert sum(r["prompts_by_source"].values()) == 4
    _assert_rollout_is_the_learners(r)
    assert list(r["prompts_by_source"]) == list(r["accuracy_by_source"])
  evals = [r["eval"] for r in _records(ref_dir) if "eval" in r]
  assert len(evals) == 3  # steps 0, 2, 4
  for ev in evals:
    assert ev["prompts_by_source"] == {"default/data/test": 8, "longtail/data/test": 7}
    assert list(ev["accuracy_by_source"]) == ["default/data/test", "longtail/data/test"]
    a, b = ev["accuracy_by_source"].values()
    assert ev["accuracy"] == pytest.approx((8 * a + 7 * b) / 15)
  a, b = evals[0]["accuracy_by_source"].values()
  assert (f"step 0: held-out accuracy {evals[0]['accuracy']:.3f} "
          f"(default/data/test {a:.3f}, longtail/data/test {b:.3f})") in ref_stderr
  assert f"longtail/data/test {b:.3f} -> " in ref_stderr.split("done: 4 steps")[1]
  # the responses logged: each step's first 2 groups (train.log_rollouts), every held-out
  # response here (eval.log_responses=8 covers both files' 8 and 7): rewards the verifier's of
  # their text, the held-out ones' means the records' accuracies per source
  from tlt_jax.data import arith
  rollouts = _jsonl(ref_dir / "rollouts.jsonl")
  assert [(r["step"], r["prompt_index"], r["sample"]) for r in rollouts] == [
      (step, i, j) for step in range(1, 5) for i in range(2) for j in range(4)]
  held = _jsonl(ref_dir / "eval_responses.jsonl")
  assert len(held) == 3 * 15
  for r in rollouts + held:
    assert r["reward"] == arith.score(r["response"], r["answer"]), r
    assert r["tokens"] > 0 and r["finish_reason"] in ("stop", "length")
  for step, ev in zip((0, 2, 4), evals):
    for src, acc in ev["accuracy_by_source"].items():
      mine = [r["reward"] for r in held if r["step"] == step and r["source"] == src]
      assert len(mine) == ev["prompts_by_source"][src] and np.mean(mine) == pytest.approx(acc)
  # the best policy: the first evaluation that beat the starting policy's, where one did
  accs = [ev["accuracy"] for ev in evals]
  best = ref_dir / "policy_hf" / "best"
  if max(accs[1:]) > accs[0]:
    step = 2 * accs.index(max(accs))
    assert json.loads((best / "best.json").read_text())["step"] == step
    assert (f"; best policy (step {step}, accuracy {max(accs):.3f}) in {best}") in ref_stderr
  else:
    assert "; no step beat the starting policy's accuracy: no best policy" in ref_stderr
    assert not best.exists()

  # wandb's run file: every step's scalars as metrics.jsonl has them, the responses as tables
  wb = wandb_file.read_run(where)
  assert wb["exit_code"] == 0 and wb["config"]["grpo"]["n"] == 4
  _assert_wandb_rows_are_the_records(where, wb["history"], _records(ref_dir), rollouts)

  proc = subprocess.Popen(_cmd(run_dir, 4, "--config.tlt.enabled=False", *WANDB), cwd=ROOT,
                          env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = run_dir / "checkpoints" / "2"
  deadline = time.time() + 600
  while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert ckpt.exists(), "the run never wrote its step-2 checkpoint"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  done = sorted(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
  assert max(done) < 4, "killed too late to test anything"
  _resume_equals_reference(run_dir, ref_dir, max(done), *WANDB)
  for name in ("rollouts.jsonl", "eval_responses.jsonl"):  # (no step twice, none missing)
    assert _jsonl(run_dir / name) == _jsonl(ref_dir / name), name
  # the same wandb run continued (one id, kept in the workdir). The killed run's wandb wrote
  # nothing it still buffered (offline: often nothing at all), so the resumed run sends the
  # steps on disk again before its own: wandb keeps those it lacks (online, the server's; an
  # offline run's every step), its file every step, each row the step's record
  killed, resumed = wandb_file.offline_runs(run_dir)
  run_id = json.loads((run_dir / "wandb.json").read_text())["id"]
  assert killed.endswith(run_id) and resumed.endswith(run_id)
  history = wandb_file.read_run(resumed)["history"]
  assert [h["_step"] for h in history] == [0, 1, 2, 3, 4]
  _assert_wandb_rows_are_the_records(resumed, history, _records(run_dir),
                                     _jsonl(run_dir / "rollouts.jsonl"))


def _assert_wandb_rows_are_the_records(run_dir, rows, records, rollouts):
  """Each wandb history row holds its step's record's every number (flattened as TensorBoard's
  tags) and nothing else but wandb's own (_step, _runtime, ...) and the responses' tables; its
  rollouts table is the step's lines of rollouts.jsonl."""
  from tlt_jax.metrics import flatten
  by_step = {r["step"]: r for r in records}
  for row in rows:
    step = row["_step"]
    want = {k: v for k, v in flatten(by_step[step]).items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    mine = {k: v for k, v in row.items()
            if not k.startswith(("_", "rollouts/", "eval_responses/"))}
    assert mine == want, step
    if step > 0:
      assert wandb_file.table_rows(run_dir, row, "rollouts") == [
          r for r in rollouts if r["step"] == step]


def _jsonl(path):
  return [json.loads(line) for line in open(path)]


def test_sigterm_to_the_whole_job_stops_at_the_step_boundary_with_its_checkpoint(
    tmp_path, reference):
  """A scheduler's SIGTERM reaches every process of the job (here its process group: the run
  and its reward workers) during step 2 (checkpoints every 3 steps): the run
  finishes that step, saves it although it is not a checkpoint step, says so in one line and
  exits 143; its reward workers kept scoring (the step's rewards are the uninterrupted run's);
  the same command resumes from it and every step equals the uninterrupted run's."""
  ref_dir, _ = reference
  run_dir = tmp_path / "run"
  proc = subprocess.Popen(_cmd(run_dir, 4, "--config.tlt.enabled=False",
                               "--config.train.checkpoint_every=3"), cwd=ROOT, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + 600
  while proc.poll() is None and time.time() < deadline and not (
      metrics.exists() and '"step": 1' in metrics.read_text()):
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before step 1's record"
  os.killpg(proc.pid, signal.SIGTERM)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 143, err[-3000:]
  # (Orbax saves a run's first step whatever the interval)
  stopped = max(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
  assert stopped in (2, 3), stopped  # the step under way when the signal came
  assert err.strip().splitlines()[-1] == (
      f"stopped by SIGTERM after step {stopped} of 4: its checkpoint is on disk and the "
      "same command resumes from it"), err[-2000:]
  recs = _records(run_dir)
  assert [r["step"] for r in recs] == list(range(0, stopped + 1))
  assert all(r["reward_stats"]["crashes"] == 0 for r in recs[1:]), recs  # workers lived on
  _resume_equals_reference(run_dir, ref_dir, stopped)


def test_ctrl_c_stops_after_the_saves_in_flight_and_says_where_the_run_resumes(
    tmp_path, monkeypatch, capsys):
  """Ctrl-C during step 2 (KeyboardInterrupt out of the step): step 1's checkpoint is on disk
  when the run stops, the command prints one line naming it and exits 130, no traceback."""
  from tlt_jax import train as train_mod
  spec = _small_cfg(tmp_path, 3, **{"tlt.enabled": False, "train.checkpoint_every": 1})
  real, calls = train_mod.rl_step, []

  def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(*args, **kwargs)
  monkeypatch.setattr(train_mod, "rl_step", step)
  with pytest.raises(KeyboardInterrupt) as e:
    _run(spec)
  assert os.listdir(tmp_path / "checkpoints") == ["1"]
  assert [r["step"] for r in _records(tmp_path)] == [1]

  assert _command_ends(e.value, capsys) == (130, "interrupted during step 2; the same command "
                                             "resumes from the newest checkpoint, step 1\n")


def _command_ends(error, capsys):
  """(exit status, stderr) of a command whose main raised `error` (runtime.exit_on_user_error,
  which every `python -m tlt_jax.*` command runs under)."""
  def main(argv):
    raise error
  capsys.readouterr()
  with pytest.raises(SystemExit) as done:
    runtime.exit_on_user_error(main)([])
  return done.value.code, capsys.readouterr().err


def test_a_phase_out_of_device_memory_ends_the_run_in_one_line_its_checkpoints_kept(
    tmp_path, monkeypatch, capsys):
  """XLA's RESOURCE_EXHAUSTED in step 2's update (the memory plan's estimates short of what
  a GPU's allocator needs) ends the run with one line naming the phase, what the plan put it
  at and the knobs that shrink it, once step 1's checkpoint is on disk; exit status 2."""
  import jax
  from tlt_jax import train as train_mod
  spec = _small_cfg(tmp_path, 3, **{"tlt.enabled": False, "train.checkpoint_every": 1})
  real, calls = train_mod.rl_learner.update, []

  def update(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.\n"
          "BufferAssignment OOM Debugging.")
    return real(*args, **kwargs)
  monkeypatch.setattr(train_mod.rl_learner, "update", update)
  with pytest.raises(ConfigError) as e:
    _run(spec)
  assert os.listdir(tmp_path / "checkpoints") == ["1"]
  assert [r["step"] for r in _records(tmp_path)] == [1]
  planned = spec.memory.total("update") / (1 << 30)
  assert str(e.value) == (
      "memory: the update phase of step 2 ran out of device memory (RESOURCE_EXHAUSTED: Out "
      "of memory while trying to allocate 2147483648 bytes.); the memory plan put this phase "
      f"at {planned:.2f} GiB per device: {memory.KNOBS['update']} (scripts/plan_memory.py "
      "prints the plan); step 1's checkpoint is on disk: the same command, changed so, "
      "resumes from it")

  assert _command_ends(e.value, capsys) == (2, f"error: {e.value}\n")


def test_a_full_disk_ends_the_run_in_one_line_and_the_same_command_resumes_once_there_is_room(
    tmp_path, monkeypatch, capsys):
  """The workdir's disk full (tlt_jax/checkpoint/writes.py): step 3's checkpoint, sized as
  step 2's, finds no room and is refused before it writes anything, and the run ends in one
  line, exit status 2, step 2's checkpoint and metrics kept; with room again the same run
  resumes from step 2. A metrics line the disk cannot take ends it the same way."""
  from tlt_jax import train as train_mod
  from tlt_jax.checkpoint import SaveFailed, writes
  spec = _small_cfg(tmp_path, 4, **{"tlt.enabled": False, "train.checkpoint_every": 1})
  free, ckpts = writes.free_bytes, str(tmp_path / "checkpoints")
  monkeypatch.setattr(writes, "free_bytes", lambda d: 0 if os.path.isdir(os.path.join(
      ckpts, "2")) else free(d))
  with pytest.raises(SaveFailed) as e:
    _run(spec)
  size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(ckpts, "2"))
             for f in fs)
  assert str(e.value) == (
      f"checkpoint step 3 needs {size / 2**20:.1f} MiB in {ckpts} (step 2's size) and its disk "
      "has 0.0 MiB free: free space there, or checkpoint to a disk with room; step 2's "
      "checkpoint is on disk: the same command resumes from it once there is room")
  assert sorted(os.listdir(ckpts)) == ["1", "2"]
  assert [r["step"] for r in _records(tmp_path)] == [1, 2]

  assert _command_ends(e.value, capsys) == (2, f"error: {e.value}\n")

  monkeypatch.setattr(writes, "free_bytes", free)  # room again: the same run goes on
  real = train_mod.MetricsWriter.write

  def write(self, step, *args):
    if step == 4:  # (as a full disk's write to metrics.jsonl raises it)
      raise OSError(28, "No space left on device")
    return real(self, step, *args)
  monkeypatch.setattr(train_mod.MetricsWriter, "write", write)
  with pytest.raises(SaveFailed) as e:
    _run(spec)
  assert str(e.value) == (
      f"{tmp_path}: No space left on device: free space there, or write the run to a disk "
      "with room (--workdir); step 4's checkpoint is on disk: the same command resumes from it "
      "once there is room")
  assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


def test_steps_whose_gradients_are_never_finite_end_the_run_its_policy_unchanged(
    tmp_path, monkeypatch):
  """From step 2 on every advantage is NaN, so every mini-batch's gradients are (the learner
  skips them: its moments and count unchanged, tests/test_grpo.py): the metrics count the
  skips, and after 3 such steps in a row the run ends in one line naming them and the fix,
  their checkpoints on disk, the policy still step 1's."""
  import dataclasses
  import jax
  from tlt_jax import train as train_mod
  from tlt_jax.checkpoint import Checkpointer
  spec = _small_cfg(tmp_path, 6, **{"tlt.enabled": False, "train.checkpoint_every": 1,
                                    "train.keep_checkpoints": 4})
  real, calls = train_mod.learner_samples, []

  def poisoned(*args, **kwargs):
    r, penalty, samples, groups = real(*args, **kwargs)
    calls.append(1)
    if len(calls) >= 2:
      samples = [dataclasses.replace(x, advantage=float("nan")) for x in samples]
    return r, penalty, samples, groups
  monkeypatch.setattr(train_mod, "learner_samples", poisoned)
  with pytest.raises(ConfigError) as e:
    _run(spec)
  assert str(e.value) == (
      "the learner's gradients held a NaN or an inf in every mini-batch of steps 2-4, which "
      f"took no optimizer step: lower optim.lr (now {spec.cfg.optim.lr}), check the rewards, "
      f"or compute in float32 (model.dtype, now {spec.cfg.model.dtype}); step 4's checkpoint "
      "is on disk: the same command, changed so, resumes from it")
  recs = _records(tmp_path)
  assert [r["step"] for r in recs] == [1, 2, 3, 4]
  assert recs[0]["loss"]["skipped"] == 0 and all(
      r["loss"]["skipped"] == spec.cfg.grpo.minibatches for r in recs[1:])
  with Checkpointer(str(tmp_path / "checkpoints")) as ck:
    params = {s: ck.read_subtree("actor", s) for s in (1, 4)}
  assert jax.tree.leaves(params[1])
  for a, b in zip(jax.tree.leaves(params[1]), jax.tree.leaves(params[4])):
    np.testing.assert_array_equal(a, b)


def _small_cfg(workdir, steps, **overrides):
  """The run spec of configs/default.py with SMALL applied (the default training file alone),
  TLT on; overrides: {"section.field": value}."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  for arg in SMALL[1:]:  # (the default task's training file alone: the arms' tests' lengths)
    key, value = arg[len("--config."):].split("=")
    section, field = key.split(".")
    cfg[section][field] = type(cfg[section][field])(value)
  cfg.workdir = str(workdir)
  cfg.compilation_cache = ""  # no gate verdicts kept between tests (the JAX cache: conftest)
  cfg.train.steps = steps
  cfg.train.eval_every = 0
  cfg.tlt.spec.bs_threshold = 16  # speculate from the start of this small batch ...
  cfg.tlt.spec.background_compile = False  # ... with executables compiled on first use
  cfg.tlt.spec.gate.enabled = False  # ... at every bucket (test_gate.py tests the gate)
  # one arm of each kind at every live size (the default buckets' 3-4 arms per bucket would
  # compile twice the executables): drafter, hybrid and history drafts in the RL loop
  cfg.tlt.spec.buckets = "1:4_1_5,hyb_4,hist_4,off"
  cfg.tlt.spec.min_pulls = 1  # then greedy: fewer of the slow history chunks (test_mab.py
  # tests the round robin)
  cfg.mesh.devices = 0  # the learner FSDP over all 8 test devices (sharded state, restored)
  cfg.rollout.num_workers = 2  # two of them roll out (0 would take all 8)
  cfg.tlt.drafter.row_len = 128
  cfg.tlt.drafter.window = 64  # with 64 tokens of context: one packed row
  cfg.tlt.drafter.context = 64
  cfg.tlt.drafter.rows = 4
  cfg.tlt.drafter.serial_steps = 2
  for key, value in overrides.items():
    node = cfg
    *path, field = key.split(".")
    for p in path:
      node = node[p]
    node[field] = value
  return runtime.prepare(config_lib.run_spec(cfg))


def _run(cfg):
  """build + train -> (run, final state)."""
  from tlt_jax.run import build
  from tlt_jax.train import train
  run, state = build(cfg)
  state, _ = train(run, state, progress=False)
  return run, state


def _build_drafter_compiled(cfg):
  """build(cfg), then waits for the spot drafter step, which compiles at low priority beside
  the run (on a loaded machine it can outlast a few short rollouts, whose idle windows then
  wait instead of training: timing, not what a test checks)."""
  from tlt_jax.run import build
  run, state = build(cfg)
  for w in run.coordinator.workers:
    w.trainer.prepare().result()
  return run, state


def _same_tree(a, b):
  import jax
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


def _assert_same_weights(a, b):
  """(run, state) pairs: actor, its optimizer, the drafter with its optimizer, and the
  drafter every worker decodes with."""
  (a, sa), (b, sb) = a, b
  assert _same_tree(sa.learner.params, sb.learner.params)
  assert _same_tree(sa.learner.opt_state, sb.learner.opt_state)
  da, db = a.store.drafter()[1], b.store.drafter()[1]
  assert _same_tree(da, db)
  for e in a.coordinator.engines:
    assert _same_tree(e.drafter_params, db.params)


def test_resume_with_tlt_and_fixed_selector_is_bit_exact_and_exports_the_drafter(tmp_path):
  """TLT on with the fixed selector and the drafter trained a fixed number of steps per RL
  step (serial mode) on that step's rollouts: stop after step 2, resume to step 3, and step 3
  (speculative rollout, rewards, GRPO update, drafter steps) and the final actor, drafter and
  both optimizers equal an uninterrupted run's bit for bit. The uninterrupted run also wrote
  the drafter's EAGLE export with each checkpoint (`_check_drafter_export`)."""
  fixed = {"tlt.spec.selector": "fixed", "tlt.spec.strategy": "3_1_4",
           "tlt.drafter.mode": "serial", "tlt.drafter.keep_steps": 1}
  spec = _small_cfg(tmp_path / "ref", 3, **fixed)
  ref = _run(spec)  # (its config.json written by train, as the export reads it)
  _run(_small_cfg(tmp_path / "run", 2, **fixed))
  resumed = _run(_small_cfg(tmp_path / "run", 3, **fixed))
  recs, want = _records(tmp_path / "run"), _records(tmp_path / "ref")
  assert [r["step"] for r in recs] == [1, 2, 3]
  for a, b in zip(recs, want):
    assert a["spec"]["chunks"] > 0 and a["spec"]["arm_chunks"] == b["spec"]["arm_chunks"]
    assert a["drafter"]["steps"] == 2
    for key in ("reward", "tokens", "response_length", "loss", "drafter"):
      assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert a["spec"]["tokens_per_verify"] == b["spec"]["tokens_per_verify"]
  _assert_same_weights(resumed, ref)
  _check_drafter_export(tmp_path / "ref", ref[0], spec)


def test_a_pool_short_of_pages_preempts_and_resumes_without_changing_the_run(tmp_path):
  """TLT off (plain sampled decoding: per-row keys) with each worker's KV pool holding one
  row at its longest (a few of the task's short rows): rows are preempted for pages and
  resumed from the tokens they had (pages.py), metrics.jsonl counts them (`preempted`), and
  every step's rewards, tokens, response lengths and losses equal those of the same run with
  a pool that never runs out."""
  off = {"tlt.enabled": False}
  roomy = _small_cfg(tmp_path / "roomy", 2, **off)
  tight = _small_cfg(tmp_path / "tight", 2, **off,
                     **{"rollout.kv_pages": roomy.engine.row_pages})
  assert tight.engine.pool_pages < tight.engine.max_batch * tight.engine.row_pages
  _run(roomy)
  _run(tight)
  got, want = _records(tmp_path / "tight"), _records(tmp_path / "roomy")
  assert got[-1]["preempted"]["rows"] > 0 and got[-1]["preempted"]["tokens"] > 0
  assert want[-1]["preempted"] == {"rows": 0, "tokens": 0}
  for a, b in zip(got, want):
    for key in ("reward", "tokens", "response_length"):
      assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # every loss term too, but the rollout's log-probs against the learner's (rollout_kl,
    # rollout_k3, ...): a resumed row's later log-probs attend to k/v its resume computed in
    # one forward, where the roomy run decoded them a token at a time (float32 rounding)
    gap = {k: (a["loss"].pop(k), b["loss"].pop(k)) for k in list(a["loss"])
           if k.startswith("rollout_")}
    assert a["loss"] == b["loss"] and max(max(v) for v in gap.values()) < 1e-5, gap


def _check_drafter_export(workdir, run, spec):
  """A 3-step TLT run (`run` of `spec`, in `workdir`) wrote the drafter's EAGLE export
  with each checkpoint (the newest keep_checkpoints of them), holding the drafter the
  checkpoint holds; export_run (python -m tlt_jax.export) writes the same files from a
  finished run's checkpoint beside the policy, and its user errors are one line each."""
  from safetensors.numpy import load_file

  from tlt_jax.drafter.export import ExportError, export_path
  from tlt_jax.drafter.model import eagle_state_dict
  from tlt_jax.export import export_run
  assert sorted(os.listdir(workdir / "drafter_eagle")) == ["2", "3"]  # keep_checkpoints=2
  final = run.store.drafter()[1].params
  assert int(run.store.drafter()[1].step) > 0  # trained: the export is not the initial one
  want = eagle_state_dict(final, run.model_cfg)
  got = load_file(os.path.join(export_path(str(workdir), 3), "model.safetensors"))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  conf = json.load(open(os.path.join(export_path(str(workdir), 3), "config.json")))
  target = json.load(open(os.path.join(spec.cfg.model.path, "config.json")))
  assert conf["architectures"] == ["Qwen2ForCausalLMEagle"] and conf["num_hidden_layers"] == 1
  assert conf["torch_dtype"] == "float32" and "dtype" not in conf
  for k in ("rope_theta", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "hidden_size"):
    assert conf[k] == target[k], k

  out = export_run(str(workdir), engine="sglang", out=str(workdir / "again")).drafter
  again = load_file(os.path.join(out, "model.safetensors"))
  for k in want:
    np.testing.assert_array_equal(again[k], want[k], err_msg=k)
  assert json.load(open(os.path.join(out, "config.json"))) == conf
  for kwargs, needle in [({"step": 1}, "holds steps [2, 3]"),
                         ({"engine": "vllm"}, "no EAGLE-1 drafter class for qwen2"),
                         ({"engine": "trt"}, "is not one of")]:
    with pytest.raises(ExportError, match=needle.replace("[", r"\[").replace("]", r"\]")):
      export_run(str(workdir), **{"engine": "sglang", **kwargs})
  cli = subprocess.run([sys.executable, "-m", "tlt_jax.export", "--workdir",
                        str(workdir / "nope"), "--engine", "sglang"], cwd=ROOT,
                       env=user_env(_env(), PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=300)
  assert cli.returncode == 2 and cli.stderr.strip().splitlines() == [
      f"error: --workdir {str(workdir / 'nope')!r} does not exist; pass the workdir of a "
      "tlt_jax.train run"]


def test_resume_with_spot_training_and_the_bandit_restores_every_state(tmp_path):
  """With BEG-MAB the arms are chosen from wall-clock rewards, and spot training runs as
  many drafter steps as the idle windows hold, so resumed samples are other draws from the
  same distribution; what must hold is that every state comes back: the bandit's windows and
  RNG, the drafter and its optimizer, the actor, the data position."""
  from tlt_jax.run import build
  from tlt_jax.run_checkpoint import restore
  from tlt_jax.train import train
  first, state = _build_drafter_compiled(_small_cfg(tmp_path, 3))  # chunks that compile reward
  state, _ = train(first, state, progress=False)  # no arm: 3 steps
  assert _pulls(state.bandit) > 0  # the bandit has windows to restore
  assert int(first.store.drafter()[1].step) > 0  # spot training ran
  second, fresh = build(_small_cfg(tmp_path, 5))
  resumed = restore(second, fresh)
  assert resumed.step == 3
  assert resumed.bandit.state_dict() == state.bandit.state_dict()
  assert resumed.data == state.data and resumed.data != fresh.data
  _assert_same_weights((second, resumed), (first, state))


def test_speculation_gate_reports_and_resumes(tmp_path):
  """With the gate on, every step's metrics carry its per-bucket status, the rates it
  measured and the payoff rule's terms; while no probe is funded nothing speculative is
  compiled (a payback so small that no saving repays a compile, however cheap the suite's
  persistent cache makes it: the rule itself is test_payoff.py's); a resumed run continues
  from the saved verdicts and ledger."""
  from tlt_jax.run import build
  from tlt_jax.run_checkpoint import restore
  gate = {"tlt.spec.gate.enabled": True, "tlt.spec.gate.min_chunks": 1,
          "tlt.spec.gate.payback": 1e-9}
  first, last = _run(_small_cfg(tmp_path, 2, **gate))
  recs = _records(tmp_path)
  assert recs[0]["spec_gate"]["status"]["1"] == "unfunded"  # the first probe: the smallest
  status = recs[-1]["spec_gate"]["status"]
  # one bucket on probation (it may have moved where the rollout's time is: placement.py)
  probing = [b for b, v in status.items() if v != "closed"]
  assert set(status) == {str(b) for b in last.gate.buckets} and len(probing) == 1, status
  assert recs[-1]["spec_gate"]["plain_rate"]  # plain chunks measured at some bucket
  p = recs[-1]["spec_gate"]["payoff"][probing[0]]
  assert p["arm"] == "4_1_5" and p["s_per_rollout"] >= 0 and p["compile"] > 0
  for r in recs[1:]:
    assert all(v in ("unfunded", "closed") for v in r["spec_gate"]["status"].values()), r
    assert r["executables"]["speculative"] == 0 and "spec" not in r
  assert recs[-1]["executables"]["count"] > 0
  second, fresh = build(_small_cfg(tmp_path, 3, **gate))
  resumed = restore(second, fresh)
  assert resumed.step == 2 and resumed.gate.state_dict() == last.gate.state_dict()
  second.close()


def test_tlt_switched_on_then_off_between_restarts_continues_the_run(tmp_path, capsys):
  """TLT is lossless, so a run may switch it between restarts: a TLT-off checkpoint resumes
  with TLT on (the learner, optimizer and data position restored, the drafter a new run's,
  the bandit fresh; the step speculates), and that checkpoint, drafter and all, resumes with
  TLT off (its drafter not read)."""
  from tlt_jax.run import build
  from tlt_jax.run_checkpoint import restore
  from tlt_jax.train import train
  off = {"tlt.enabled": False}
  first, one = _run(_small_cfg(tmp_path, 1, **off))
  capsys.readouterr()
  second, fresh = build(_small_cfg(tmp_path, 2))
  assert "resuming with TLT switched on" in capsys.readouterr().err
  new_drafter = second.store.drafter()[1]
  resumed = restore(second, fresh)
  assert resumed.step == 1 and resumed.data == one.data and resumed.data != fresh.data
  assert _same_tree(resumed.learner.params, one.learner.params)
  assert _same_tree(resumed.learner.opt_state, one.learner.opt_state)
  assert _same_tree(second.store.drafter()[1], new_drafter)
  assert _pulls(resumed.bandit) == 0
  two, _ = train(second, resumed, progress=False)
  assert [r["step"] for r in _records(tmp_path)] == [1, 2]
  assert _records(tmp_path)[-1]["spec"]["chunks"] > 0  # step 2 speculated
  third, fresh = build(_small_cfg(tmp_path, 3, **off))
  assert "resuming with TLT switched off" in capsys.readouterr().err
  back = restore(third, fresh)
  assert back.step == 2 and back.bandit is None and back.data == two.data
  assert _same_tree(back.learner.params, two.learner.params)
  third.close()


def _pulls(bandit):
  return sum(n for d in bandit.pulls.values() for n in d.values())


def test_evaluation_keeps_its_own_bandit_and_leaves_the_training_policies(tmp_path):
  """Held-out evaluation decodes through the training workers with its own bandit, threaded
  from one evaluation to the next; the train state's policies are values it reads only."""
  from tlt_jax.rl.reward_pool import RewardPool
  from tlt_jax.run import build
  from tlt_jax.train import evaluate
  run, state = build(_small_cfg(tmp_path, 1, **{"train.eval_every": 1, "eval.speculate": True}))
  policies = state.policies
  with RewardPool("arith", num_workers=1) as pool:
    first, bandit = evaluate(run, pool, state, run.eval_bandit)  # compiles (compiling chunks
    # reward no arm)
    again, bandit2 = evaluate(run, pool, state, bandit)
  run.close()
  assert again["accuracy"] == first["accuracy"]  # greedy: lossless whatever the arms
  assert state.policies == policies and run.eval_bandit == state.bandit  # (both fresh)
  assert _pulls(bandit2) > _pulls(bandit) and _pulls(bandit2) > 0  # evaluation speculated,
  # the second from where the first left its bandit


def _tiny_qwen3(path, arch="qwen3") -> None:
  """A random Qwen3 checkpoint made with transformers (q/k norms, head_dim 32 != 64 / 4, tied
  head; "qwen3_moe": 4 experts of width 48, 2 a token, in every layer) with the default
  task's tokenizer and generation config: the default run's vocabulary, so configs/default.py
  trains it as is."""
  import shutil

  import torch
  import transformers
  src = config_lib.asset_path("default", "model")
  kw = dict(
      vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
      tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=1, pad_token_id=0)
  if arch == "qwen3_moe":
    config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True, **kw)
  else:
    config = transformers.Qwen3Config(**kw)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():  # every tensor away from its init, norms included
    for name, p in model.named_parameters():
      p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
  model.save_pretrained(path)
  for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(src, f), os.path.join(path, f))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_qwen3_trains_with_chain_and_tree_speculation(tmp_path, arch):
  """A tiny Qwen3 (dense, and a mixture of experts) made with transformers trains under
  configs/default.py with TLT on, its rollout speculating with a chain and a tree arm (a
  fresh drafter, trained after the update: a dense layer over the experts' model too); the
  run's policy with its drafter then decodes greedily, speculating with each arm, exactly
  what transformers' greedy generate gives for the same weights."""
  import jax
  import torch
  import transformers

  from tlt_jax.models.hf_io import save_hf_model
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  model_dir = str(tmp_path / "qwen3")
  _tiny_qwen3(model_dir, arch)
  cfg = _small_cfg(tmp_path / "run", 1, **{
      "model.path": model_dir, "tlt.drafter.init": "init:0", "grpo.num_prompts": 2,
      "rollout.max_new_tokens": 64, "tlt.spec.patience": 1,
      "tlt.drafter.mode": "serial",  # drafter steps after the update: surely some, this step
      # one arm per live size: the chain at 1 row, the tree from 2 (a bandit's choice between
      # two arms in so short a run would be a coin toss)
      "tlt.spec.buckets": "1:4_1_5 2:2_2_5"})
  run, state = _run(cfg)
  recs = _records(tmp_path / "run")
  assert run.model_cfg.arch == arch and run.model_cfg.qk_norm
  assert run.model_cfg.moe == (arch == "qwen3_moe")
  arms = {c.mode for e in run.coordinator.engines for c in e.chunk_log}
  assert {"4_1_5", "2_2_5"} <= arms, arms
  assert recs[-1]["drafter"]["steps"] >= 1  # the Qwen3 drafter layer trained
  # the log-probs the speculative verifications recorded are the learner's, token by token
  _assert_rollout_is_the_learners(recs[-1])
  params = jax.device_get(state.learner.params)
  drafter = jax.device_get(run.store.drafter()[1].params)
  out = str(tmp_path / "trained")
  save_hf_model(params, run.model_cfg, out, tokenizer_dir=model_dir)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  from tlt_jax.data.dataset import Position
  prompts = [p.ids for p in run.stream.batch(Position(), 4)[0]]
  ref = []
  for p in prompts:
    ids = torch.tensor([p])
    with torch.no_grad():
      o = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=16, eos_token_id=1, pad_token_id=0)
    ref.append(o[0, len(p):].tolist())
  for arm in ("4_1_5", "2_2_5"):
    ecfg = EngineConfig(max_batch=4, buckets=(1, 2, 4), chunk_size=4, max_prompt_len=80,
                        max_new_tokens=16, stop_tokens=(1,),
                        spec=SpecConfig(strategy=arm, bs_threshold=4, patience=1,
                                        use_kernel=False))
    engine = Engine(params, run.model_cfg, ecfg, drafter_params=drafter)
    res = sorted(engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)],
                                 SamplingParams(temperature=0.0)), key=lambda r: r.request_id)
    assert any(c.mode == arm for c in engine.chunk_log)
    assert [r.response_ids.tolist() for r in res] == ref, arm


def test_tlt_run_on_two_workers_trains_the_drafter_in_idle_windows(tmp_path, monkeypatch):
  """TLT on, spot mode, two rollout workers on devices 0 and 1 of the 8-device test mesh:
  metrics, the per-worker timeline, TensorBoard and checkpoints are written; idle worker
  time is spent training the drafter, and every worker decodes with the merged drafter.
  Where devices keep memory statistics (a GPU's, faked here: the CPU keeps none), each step
  records each phase's peak so far beside the memory plan's figure for it. Step 2 is traced
  (config.profile): its phases and each worker's share named in the profiler's trace."""
  from tlt_jax import device_memory
  # 3 prompts: worker 0 decodes two, worker 1 one (request_id % workers), so one of them idles
  cfg = _small_cfg(tmp_path, 2, **{"train.eval_every": 2, "grpo.num_prompts": 3,
                                   "profile.steps": "2"})
  from tlt_jax.train import train
  run, state = _build_drafter_compiled(cfg)
  assert device_memory.peak_bytes() is None  # (the CPU's devices)
  peaks = iter(range(1, 100))
  monkeypatch.setattr(device_memory, "peak_bytes", lambda: (next(peaks) << 30, 80 << 30))
  _, last = train(run, state, progress=False)
  recs = _records(tmp_path)
  assert [r["step"] for r in recs] == [0, 1, 2]
  assert recs[1]["memory"] == {  # (evaluation's decode, step 0, is not a training phase)
      "peak_gib": {"rollout": 1, "logprobs": 2, "update": 3, "spot": 4, "sync": 5},
      "limit_gib": 80, "plan_gib": {k: cfg.memory.total(k) / (1 << 30)
                                    for k in ("rollout", "logprobs", "update", "spot", "sync")}}
  assert "eval" in recs[0] and "eval" in recs[2]
  for key in ("rollout", "reward_wait", "logprobs", "update", "weight_sync", "drafter", "idle",
              "compile", "compile_background"):
    assert key in last["time"], key
  assert last["spec"]["chunks"] > 0 and last["spec"]["verify_path"] == ["jnp"]
  # read off the step's responses at the rollout's sampling settings (test_acceptance.py: the
  # engine's figure in expectation), each cut to max_prompt_len + acceptance_response_len
  acc = last["drafter_acceptance"]
  assert acc["sequences"] == 8 and 1.0 <= acc["tokens_per_verify"] <= acc["depth"] + 1
  assert acc["length"] == 80 + 48  # configs/default.py
  assert "acceptance" in last["time"]
  spot = last["spot"]
  assert set(spot["per_worker"]) == {"0", "1"}
  # Idle time is spent training: what a worker leaves untrained is its wake-up latency (a
  # thread switch under the GIL beside the decoding worker, a few ms; tens on a loaded CI
  # machine), not a share of the window: the windows here are as short as the two shares'
  # difference in decode time (30 ms in one CI run), so a share threshold is timing luck.
  assert spot["idle_s"] > 0 and spot["training_s"] > 0, spot
  for w in spot["per_worker"].values():
    assert w["idle_s"] - w["training_s"] <= max(0.5 * w["idle_s"], 0.1), spot
  assert last["drafter"]["steps"] >= 1 and last["drafter"]["tokens"] > 0
  assert spot["critical_path_s"] < last["time"]["total"]
  timeline = [json.loads(line) for line in open(tmp_path / "timeline.jsonl")]
  assert [t["step"] for t in timeline] == [1, 2]
  states = {(w, s) for w, s, _, _ in timeline[-1]["intervals"]}
  assert {(0, "generating"), (1, "generating")} <= states and any(s == "training"
                                                                  for _, s in states)
  # (device_set is JAX's cached set, shared by every sharding on that mesh: read, never pop)
  assert sorted(tuple(sorted(d.id for d in e.params["embed"].sharding.device_set))
                for e in run.coordinator.engines) == [(0,), (1,)]
  merged = run.store.drafter()[1].params
  for e in run.coordinator.engines:
    assert _same_tree(e.drafter_params, merged)
  assert os.listdir(tmp_path / "tb")
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  # the trace's host events (XLA's file, read whole: a compiling step's outgrows the 1M events
  # Perfetto's JSON keeps), but the XLA CPU threads' (the "device" work here)
  (trace,) = (tmp_path / "tb" / "plugins" / "profile").glob("*/*.xplane.pb")
  import jax
  names = {e.name for p in jax.profiler.ProfileData.from_file(str(trace)).planes
           for line in p.lines if not line.name.startswith("tf_XLA") for e in line.events}
  assert {"rl_step", "rollout", "logprobs", "update", "spot", "worker 0: generating",
          "worker 1: generating"} <= names


@pytest.mark.parametrize("name", ["qwen2_5_7b_math.py", "qwen3_8b_math.py", "qwen2_5_32b_math.py",
                                  "qwen3_30b_a3b_math.py", "verl_math.py", "dapo_qwen2_5_32b.py"])
def test_real_work_configs_need_paths_and_say_so(name):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
  spec = config_lib.run_spec(cfg)  # shapes and values are consistent as shipped
  with pytest.raises(ConfigError, match="config.model.path"):
    runtime.prepare(spec)  # ... but the checkpoint path must be given on the command line


def test_bad_reward_name_is_one_line(tmp_path):
  p = subprocess.run(_cmd(tmp_path, 1, "--config.reward.name=nope", "--config.tlt.enabled=False"),
                     cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 2, p.stderr[-2000:]
  assert "config.reward.name" in p.stderr and "Traceback" not in p.stderr


def test_learner_samples_shape_the_rewards_and_drop_the_truncated_as_dapo():
  """Two groups of three: the advantages are those of the rewards plus the overlong penalty
  (computed here from its definition), and with drop_truncated the responses cut at the budget
  (finish "length") are not among the learner's samples, their group's statistics unchanged."""
  from tlt_jax.rl.samples import learner_samples
  from tlt_jax.step_rollouts import Response
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.n, cfg.rollout.max_new_tokens = 3, 20
  cfg.reward.overlong_buffer, cfg.reward.overlong_penalty = 5, 0.8
  cfg.grpo.drop_truncated = True
  rows = [(0, 0, 1.0, 10, "stop"), (0, 1, 1.0, 18, "stop"), (0, 2, 0.0, 20, "length"),
          (1, 0, 0.0, 16, "stop"), (1, 1, 0.0, 3, "stop"), (1, 2, 1.0, 20, "length")]
  responses = [Response(p, i, np.array([1, 2]), np.arange(k), k, why, reward=rew)
               for p, i, rew, k, why in rows]
  r, penalty, samples, groups = learner_samples(responses, 2, cfg)
  assert list(groups) == [0, 1]
  shaped = np.array([[1.0, 1.0 - 0.8 * 3 / 5, -0.8], [-0.8 / 5, 0.0, 1.0 - 0.8]])
  np.testing.assert_allclose(r + penalty, shaped, rtol=1e-6)
  adv = (shaped - shaped.mean(1, keepdims=True)) / (shaped.std(1, ddof=1, keepdims=True) + 1e-6)
  kept = [(p, i) for p, i, _, _, why in rows if why == "stop"]
  assert [len(s.response_ids) for s in samples] == [10, 18, 16, 3]
  np.testing.assert_allclose([s.advantage for s in samples], [adv[k] for k in kept], rtol=1e-5)
  cfg.grpo.drop_truncated, cfg.reward.overlong_buffer = False, 0
  r, penalty, samples, _ = learner_samples(responses, 2, cfg)
  assert len(samples) == 6 and not penalty.any()


def test_a_step_whose_responses_are_all_dropped_does_not_update(tmp_path):
  """Every response cut at an 8-token budget, drop_truncated on: the step runs, reports them
  dropped and the full overlong penalty, and leaves the policy and its optimizer as they were."""
  from tlt_jax.run import build
  from tlt_jax.train import train
  cfg = _small_cfg(tmp_path, 1, **{"tlt.enabled": False, "rollout.max_new_tokens": 8,
                                   "grpo.drop_truncated": True, "reward.overlong_buffer": 4})
  run, state = build(cfg)
  before = jax_copy(state.learner)
  state, _ = train(run, state, progress=False)
  rec = _records(tmp_path)[-1]
  assert rec["truncated"] == 1.0
  assert rec["loss"] == {"overlong_penalty": -1.0, "dropped_truncated": 16}
  assert _same_tree(state.learner.params, before.params)
  assert _same_tree(state.learner.opt_state, before.opt_state)


def test_weighted_training_files_are_drawn_by_their_weights(tmp_path, capsys):
  """data.train_weights through the run: the data line names each file's prompts and share,
  and the stream the run draws from gives each file its share of an epoch (tests/test_data.py
  tests the stream)."""
  from tlt_jax.run import build
  cfg = _small_cfg(tmp_path, 1, **{"tlt.enabled": False, "data.train_weights": "1,3",
                                   "data.train_path": ",".join(TRAIN_FILES)})
  run, state = build(cfg)
  try:
    names = [p.row.source for p in run.stream.prompts]
    n = len(names)
    data = [x for x in capsys.readouterr().err.splitlines() if x.startswith("data:")]
    long = run.stream.dropped_long
    assert data == [f"data: {n} training prompts from 2 files weighted (default/data/train "
                    f"{names.count('default/data/train')} at 0.25, longtail/data/train "
                    f"{names.count('longtail/data/train')} at 0.75; {long} dropped as longer "
                    "than max_prompt_len=80 tokens)"], data
    epoch, _ = run.stream.batch(state.data, n)
    drawn = sum(p.row.source == "longtail/data/train" for p in epoch)
    assert abs(drawn - 0.75 * n) <= 1
  finally:
    run.close()


def jax_copy(tree):
  import jax
  return jax.tree.map(lambda x: np.array(x), tree)


# ------------------------------------------------------------------ DAPO's dynamic sampling
def test_filter_groups_rolls_out_again_until_groups_carry_signal(tmp_path, monkeypatch):
  """A reward that scores the first rollout's 16 responses 0 (no group has signal) and every
  later response apart: the first step rolls out twice and learns from the second rollout's 4
  groups (8 prompts drawn), the second step once; the workers' actor released and restored
  around them (memory.release_rollout_weights) and the drafter trained through both."""
  from tlt_jax.run import build
  from tlt_jax.train import train
  from tests.reward_files import counting_reward
  reward = counting_reward(tmp_path, "counting", first=16, later="count")
  cfg = _small_cfg(tmp_path / "run", 2, **{
      "reward.name": reward, "grpo.filter_groups": True, "grpo.max_rollouts": 3,
      "memory.release_rollout_weights": True, "rollout.max_new_tokens": 24})
  run, state = build(cfg)
  before = jax_copy(state.learner.params)
  from tlt_jax.rl import learner as rl_learner
  update, held = rl_learner.update, []

  def spy(*args, **kwargs):  # the rollouts' actor is freed before the learner updates
    held.append(run.coordinator.store.actor()[1] is not None)
    return update(*args, **kwargs)
  monkeypatch.setattr(rl_learner, "update", spy)
  rollout, seeds = run.coordinator.rollout, []

  def seeded(*args, **kwargs):  # (each rollout of a step samples with its own seed)
    seeds.append((kwargs["step"], kwargs["seed"]))
    return rollout(*args, **kwargs)
  monkeypatch.setattr(run.coordinator, "rollout", seeded)
  state, _ = train(run, state, progress=False)
  assert held == [False, False]
  assert [k for k, _ in seeds] == [0, 0, 1] and len({s for _, s in seeds}) == 3
  recs = _records(tmp_path / "run")
  assert [r["filter_groups"] for r in recs] == [
      {"rollouts": 2, "groups": 8, "signal_groups": 4, "trained_groups": 4},
      {"rollouts": 1, "groups": 4, "signal_groups": 4, "trained_groups": 4}]
  assert state.data.index == 12 and state.step == 2
  assert recs[0]["loss"] and not _same_tree(state.learner.params, before)
  with open(tmp_path / "run" / "timeline.jsonl") as f:
    timelines = [json.loads(line) for line in f]
  assert len(timelines[0]["rollouts"]) == 2 and "rollouts" not in timelines[1]
  assert recs[0]["spot"]["generating_s"] > 0


def test_filter_groups_with_no_signal_rolls_out_max_rollouts_and_does_not_update(tmp_path):
  """Every response cut at an 8-token budget (reward 0 for all): max_rollouts rollouts of
  gen_prompts=5 prompts each, no group to learn from, so no update; the data position counts
  every prompt drawn."""
  from tlt_jax.run import build
  from tlt_jax.train import train
  cfg = _small_cfg(tmp_path, 1, **{"tlt.enabled": False, "rollout.max_new_tokens": 8,
                                   "grpo.filter_groups": True, "grpo.max_rollouts": 3,
                                   "grpo.gen_prompts": 5})
  run, state = build(cfg)
  before = jax_copy(state.learner)
  state, _ = train(run, state, progress=False)
  rec = _records(tmp_path)[-1]
  assert rec["filter_groups"] == {"rollouts": 3, "groups": 15, "signal_groups": 0,
                                  "trained_groups": 0}
  assert rec["loss"] == {} and rec["truncated"] == 1.0 and state.data.index == 15
  assert _same_tree(state.learner.params, before.params)
  assert _same_tree(state.learner.opt_state, before.opt_state)


def test_filter_groups_counts_as_dropped_only_the_truncated_of_the_groups_that_train(tmp_path):
  """grpo.drop_truncated with grpo.filter_groups: every response cut at the budget and no group
  with signal, so no group trains and none of its responses is dropped (the 2 x 5 groups
  drawn, all cut, are not the learner's)."""
  from tlt_jax.run import build
  from tlt_jax.train import train
  cfg = _small_cfg(tmp_path, 1, **{"tlt.enabled": False, "rollout.max_new_tokens": 8,
                                   "grpo.filter_groups": True, "grpo.max_rollouts": 2,
                                   "grpo.gen_prompts": 5, "grpo.drop_truncated": True})
  run, state = build(cfg)
  train(run, state, progress=False)
  rec = _records(tmp_path)[-1]
  assert rec["filter_groups"]["trained_groups"] == 0 and rec["truncated"] == 1.0
  assert rec["loss"]["dropped_truncated"] == 0


def test_negative_rewards_carry_signal_as_they_are():
  """A reward function's negative scores are the group's rewards as given: (-1, 0) has
  signal, and its GRPO advantages are (r - mean) / std (ddof 1) = -/+ 0.7071 by hand."""
  from tlt_jax.rl.samples import learner_samples, signal_groups
  from tlt_jax.step_rollouts import Response
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.n, cfg.rollout.max_new_tokens, cfg.grpo.filter_groups = 2, 20, True
  cfg.grpo.num_prompts, cfg.reward.overlong_buffer = 2, 0
  rewards = [[-1.0, 0.0], [-1.0, -1.0]]
  responses = [Response(p, i, np.array([1]), np.arange(5), 5, "stop", reward=rewards[p][i])
               for p in range(2) for i in range(2)]
  assert list(signal_groups(responses, 2, cfg)) == [True, False]
  r, _, samples, groups = learner_samples(responses, 2, cfg)
  np.testing.assert_array_equal(r, rewards)
  assert list(groups) == [0]
  np.testing.assert_allclose([s.advantage for s in samples], [-0.7071, 0.7071], atol=1e-4)


def test_learner_samples_keep_the_first_groups_with_signal():
  """filter_groups: a group whose rewards plus overlong penalty are all equal is left out, and
  of the rest only the first grpo.num_prompts train; a penalty that differs within a group of
  equal rewards is signal."""
  from tlt_jax.rl.samples import learner_samples, signal_groups
  from tlt_jax.step_rollouts import Response
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.n, cfg.rollout.max_new_tokens, cfg.grpo.filter_groups = 2, 20, True
  rewards = [[1, 1], [0, 1], [0, 0], [1, 0], [1, 1]]
  lengths = [[5, 5], [5, 5], [5, 5], [5, 5], [5, 18]]
  responses = [Response(p, i, np.array([1]), np.arange(lengths[p][i]), lengths[p][i], "stop",
                        reward=float(rewards[p][i])) for p in range(5) for i in range(2)]
  cfg.grpo.num_prompts = 2
  assert list(signal_groups(responses, 5, cfg)) == [False, True, False, True, False]
  _, _, samples, groups = learner_samples(responses, 5, cfg)
  assert list(groups) == [1, 3]
  np.testing.assert_allclose([s.advantage for s in samples],
                             [-0.7071, 0.7071, 0.7071, -0.7071], atol=1e-4)
  cfg.grpo.num_prompts = 1
  assert list(learner_samples(responses, 5, cfg)[3]) == [1]
  cfg.reward.overlong_buffer, cfg.grpo.num_prompts = 4, 5  # group 4's 18 tokens: -0.5
  assert list(signal_groups(responses, 5, cfg)) == [False, True, False, True, True]
  assert list(learner_samples(responses, 5, cfg)[3]) == [1, 3, 4]
  cfg.grpo.filter_groups = False
  assert list(learner_samples(responses, 5, cfg)[3]) == [0, 1, 2, 3, 4]


def test_batch_whitened_advantages_count_only_the_groups_that_train():
  """reinforce_plus_plus_baseline with filter_groups: the whitening's statistics are the
  trained groups' tokens only (a dropped group's would move them)."""
  from tlt_jax.rl.advantages import advantages
  from tlt_jax.rl.samples import learner_samples
  from tlt_jax.step_rollouts import Response
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.n, cfg.grpo.num_prompts, cfg.grpo.filter_groups = 2, 2, True
  cfg.grpo.adv_estimator = "reinforce_plus_plus_baseline"
  rewards, lengths = [[1, 1], [0, 1], [1, 0]], [[9, 9], [3, 12], [7, 5]]
  responses = [Response(p, i, np.array([1]), np.arange(lengths[p][i]), lengths[p][i], "stop",
                        reward=float(rewards[p][i])) for p in range(3) for i in range(2)]
  _, _, samples, groups = learner_samples(responses, 3, cfg)
  assert list(groups) == [1, 2]
  want = advantages(np.array(rewards[1:], float), np.array(lengths[1:], float),
                    estimator="reinforce_plus_plus_baseline")
  np.testing.assert_allclose([s.advantage for s in samples], want.ravel(), rtol=1e-6)
  everything = advantages(np.array(rewards, float), np.array(lengths, float),
                          estimator="reinforce_plus_plus_baseline")
  assert not np.allclose(everything[1:].ravel(), want.ravel())
