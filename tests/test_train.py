"""The RL loop end to end: metrics files, checkpoints, exact resume after SIGKILL, baseline flag,
and the real-work configs' path checks."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tlt_jax import config as config_lib
from tlt_jax import runtime
from tlt_jax.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A few-second step on the shipped default model: 4 prompts x 4 samples.
SMALL = ["--config.grpo.num_prompts=4", "--config.grpo.n=4", "--config.grpo.micro_batch=16",
         "--config.grpo.minibatches=1", "--config.rollout.max_batch=16",
         "--config.rollout.max_new_tokens=96", "--config.eval.num_prompts=16",
         "--config.train.eval_every=2", "--config.train.checkpoint_every=1",
         "--config.reward.num_workers=1"]


def _cmd(workdir, steps, *extra):
  return [sys.executable, "-m", "tlt_jax.train", "--config", "configs/default.py",
          "--workdir", str(workdir), f"--config.train.steps={steps}", *SMALL, *extra]


def _env():
  return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_sigkill_during_training_resumes_exactly(tmp_path):
  """Kill the run right after its step-2 checkpoint lands; re-running the same command
  resumes and finishes, and steps 3-4 equal those of a run that was never killed."""
  ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
  extra = ["--config.tlt.enabled=False"]
  ref = subprocess.run(_cmd(ref_dir, 4, *extra), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
  assert ref.returncode == 0, ref.stderr[-3000:]

  proc = subprocess.Popen(_cmd(run_dir, 4, *extra), cwd=ROOT, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = run_dir / "checkpoints" / "2"
  deadline = time.time() + 600
  while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert ckpt.exists(), "the run never wrote its step-2 checkpoint"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  done = sorted(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
  assert max(done) < 4, "killed too late to test anything"

  again = subprocess.run(_cmd(run_dir, 4, *extra), cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {run_dir / 'checkpoints'} at step {max(done)}" in again.stderr
  recs, want = _records(run_dir), _records(ref_dir)
  assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]  # no duplicated or missing step
  for a, b in zip(recs[1:], want[1:]):
    assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"], (a["step"], a, b)
    assert a["loss"]["loss"] == pytest.approx(b["loss"]["loss"], rel=1e-4, abs=1e-6)
  assert recs[-1]["eval"]["accuracy"] == want[-1]["eval"]["accuracy"]


def test_tlt_run_in_process_writes_metrics_tb_and_checkpoints(tmp_path):
  """TLT on (speculative rollout + online drafter steps) on the 8-device test mesh."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  for arg in SMALL:
    key, value = arg[len("--config."):].split("=")
    section, field = key.split(".")
    cfg[section][field] = type(cfg[section][field])(value)
  cfg.workdir = str(tmp_path)
  cfg.train.steps = 2
  cfg.tlt.spec.bs_threshold = 16  # speculate from the start of this small batch
  cfg.tlt.drafter_steps = 2
  cfg.rollout.num_workers = 2  # two replicas on devices 0 and 1, driven from host threads
  runtime.validate(cfg)
  from tlt_jax.train import Trainer
  trainer = Trainer(cfg, progress=False)
  before = np.array(trainer.drafter.params["fc"])
  last = trainer.run()
  recs = _records(tmp_path)
  assert [r["step"] for r in recs] == [0, 1, 2]
  assert "eval" in recs[0] and "eval" in recs[2]
  for key in ("rollout", "reward_wait", "logprobs", "update", "weight_sync", "drafter", "idle"):
    assert key in last["time"], key
  assert last["spec"]["chunks"] > 0 and last["spec"]["tokens_per_verify"] >= 1.0
  assert last["drafter"]["steps"] == 2
  assert len(trainer.workers) == 2
  assert {w.params["embed"].sharding.device_set.pop().id for w in trainer.workers} == {0, 1}
  assert not np.array_equal(np.asarray(trainer.drafter.params["fc"]), before)  # the drafter trained
  assert os.listdir(tmp_path / "tb")
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]


@pytest.mark.parametrize("name", ["qwen2_5_7b_math.py", "qwen2_5_32b_math.py"])
def test_real_work_configs_need_paths_and_say_so(name):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
  config_lib.validate(cfg)  # shapes and values are consistent as shipped
  with pytest.raises(ConfigError, match="config.model.path"):
    runtime.validate(cfg)  # ... but the checkpoint path must be given on the command line


def test_bad_reward_name_is_one_line(tmp_path):
  p = subprocess.run(_cmd(tmp_path, 1, "--config.reward.name=nope", "--config.tlt.enabled=False"),
                     cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 2, p.stderr[-2000:]
  assert "config.reward.name" in p.stderr and "Traceback" not in p.stderr
