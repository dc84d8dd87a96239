"""The training loop across processes: 2 processes x 4 CPU devices (gloo collectives) against
1 process x 8 devices, same config, same seeds.

Both runs have the same learner mesh (FSDP over 8 devices) and the same two rollout replicas
(4-way tensor parallel: devices 0-3 and 4-7), so with two processes each process owns one
replica and decodes its prompts, scores its own responses, and the learner's batch is
assembled from both. The per-step losses, rewards, response lengths and the checkpointed
params after the steps must equal the single-process run's: tokens exactly (sampling is per
request and does not depend on which process decodes it), floats to 1e-5 (the FSDP gradient
reductions run over gloo instead of in one process, a different summation order). Then the
2-process run's checkpoint resumes in one process.
"""

import json
import os
import subprocess
import sys

import numpy as np

from tests.mp_launch import ROOT, describe, launch
from tests.reward_files import counting_reward
from tests.user_env import user_env

ARGS = ["--config", "configs/default.py", "--config.train.steps=2", "--config.train.eval_every=0",
        "--config.tlt.enabled=False", "--config.mesh.devices=0", "--config.cpu_devices=0",
        "--config.rollout.num_workers=2", "--config.rollout.tensor_parallel=4",
        "--config.grpo.num_prompts=4", "--config.grpo.n=4", "--config.grpo.micro_batch=8",
        "--config.rollout.max_new_tokens=64", "--config.train.checkpoint_every=2",
        "--config.reward.num_workers=1", "--config.compilation_cache="]


# JAX's persistent cache off (the suite's, conftest.py): what a run compiles and what it loads
# from another worker's compile do not depend on what earlier runs left there
UNCACHED = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def _single(workdir, *extra, env_extra=None):
  env = user_env({k: v for k, v in os.environ.items()
                  if not k.startswith(("SLURM_", "OMPI_", "TLT_", "JAX_COORDINATOR"))})
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  env.update(env_extra or {})
  return subprocess.run([sys.executable, "-m", "tlt_jax.train", *ARGS, "--workdir", workdir,
                         *extra],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _params(workdir):
  """The checkpointed actor of the last step, as numpy, read without a template."""
  from tlt_jax.checkpoint import Checkpointer
  with Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
    return {k: v for k, v in ck.read().items() if k.startswith("actor/")}


def test_two_processes_train_like_one(tmp_path):
  """Also DAPO's dynamic sampling across processes: every process decides, on the job's
  rewards, to roll out again at step 1."""
  def extra(run):  # 0 for the first rollout's 16 responses (the job's), then by the text
    return ["--config.grpo.filter_groups=True", "--config.grpo.max_rollouts=2",
            "--config.reward.name=" + counting_reward(tmp_path, run, first=16, later="text")]
  one = str(tmp_path / "one")
  ref = _single(one, *extra("one"), env_extra=UNCACHED)
  assert ref.returncode == 0, ref.stderr[-3000:]
  two = str(tmp_path / "two")
  results = launch("tlt_jax.train", 2, devices_per_process=4,
                   args=[*ARGS, *extra("two"), "--workdir", two], timeout=900, env=UNCACHED)
  assert all(r.returncode == 0 for r in results), describe(results)
  assert "process 1/2" in results[1].stderr
  # process 0 alone writes the metrics; both wrote the checkpoint
  a, b = _metrics(one), _metrics(two)
  assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
  assert a[0]["filter_groups"]["rollouts"] == 2
  for ma, mb in zip(a, b):
    assert ma["filter_groups"] == mb["filter_groups"]
    assert ma["tokens"] == mb["tokens"]
    assert ma["response_length"] == mb["response_length"]
    assert ma["reward"] == mb["reward"]
    # what process 0 writes is the job's: every process's reward calls and workers
    assert ma["reward_stats"]["calls"] == mb["reward_stats"]["calls"] > 0
  # the job's compiles: each program compiled once, the other worker loading it, in one
  # process (sharing.py) as across two (exchange.py)
  assert a[-1]["executables"]["count"] == b[-1]["executables"]["count"]
  assert a[-1]["executables"]["ported"] == b[-1]["executables"]["ported"] > 0, (a[-1], b[-1])
  for run in (one, two):  # both workers' intervals, one per process in the 2-process run
    with open(os.path.join(run, "timeline.jsonl")) as f:
      steps = [json.loads(line) for line in f]
    assert [t["step"] for t in steps] == [1, 2]
    assert all({iv[0] for iv in t["intervals"]} == {0, 1} for t in steps), run
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
      np.testing.assert_allclose(mb["loss"][k], ma["loss"][k], rtol=1e-5, atol=1e-7,
                                 err_msg=f"step {ma['step']} {k}")
  pa, pb = _params(one), _params(two)
  assert pa.keys() == pb.keys()
  for k in pa:
    np.testing.assert_allclose(pb[k], pa[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # the 2-process checkpoint resumes in 1 process (each array read onto the current mesh)
  more = _single(two, *extra("two"), "--config.train.steps=3")
  assert more.returncode == 0, more.stderr[-3000:]
  assert "resumed from" in more.stderr and "at step 2" in more.stderr
  assert [m["step"] for m in _metrics(two)] == [1, 2, 3]


def test_replica_merge_on_devices_equals_the_weighted_average():
  """drafter.merge.average_replicas (the multi-process drafter merge: copies stacked over the
  rollout mesh's replica axis, reduced on the devices) against average_states, on
  2 tensor-parallel replicas of 4 devices in this process."""
  import jax
  from jax.sharding import Mesh

  from tlt_jax.config import asset_path
  from tlt_jax.drafter import train_step as dts
  from tlt_jax.drafter.merge import average_replicas, average_states
  from tlt_jax.drafter.model import init_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.optim import make_optimizer
  cfg, _ = load_hf_model(asset_path("default", "model"))
  tx = make_optimizer(1e-3, warmup_steps=0)
  grid = np.asarray(jax.devices()[:8]).reshape(2, 1, 4)
  rollout = Mesh(grid, ("data", "fsdp", "tensor"))
  store_sh = dts.state_shardings(jax.tree.map(np.asarray, init_drafter(cfg, jax.random.key(0))),
                                 tx, rollout)
  states = []
  for r in range(2):
    params = jax.tree.map(np.asarray, init_drafter(cfg, jax.random.key(r + 1)))
    wmesh = Mesh(grid[r].reshape(1, 1, 4), ("data", "fsdp", "tensor"))
    st = dts.init_state(params, tx, dts.state_shardings(params, tx, wmesh))
    states.append(dts.DrafterState(st.params, st.opt_state, st.step + 3 * r))
  got = average_replicas(states, [3.0, 1.0], [0, 1], rollout, store_sh)
  want = average_states([jax.device_put(s, store_sh) for s in states], [3.0, 1.0])
  # both against numpy: 0.75 x the first copy + 0.25 x the second, the larger step count
  leaves = [[np.asarray(x) for x in jax.tree.leaves(s)] for s in states]
  ref = [np.maximum(x0, x1) if np.issubdtype(x0.dtype, np.integer)
         else 0.75 * x0.astype(np.float64) + 0.25 * x1.astype(np.float64)
         for x0, x1 in zip(*leaves)]
  assert any(np.issubdtype(x.dtype, np.integer) for x in ref)  # the step counts are checked
  for a, b, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), ref):
    np.testing.assert_allclose(np.asarray(a), r, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(b), r, rtol=1e-6, atol=1e-7)
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(store_sh)))
  assert average_replicas(states, [0.0, 0.0], [0, 1], rollout, store_sh) is None


_TERM_ON_STEP_2 = '''
import os
import signal


def fn(response, answer):
  """Process 1's reward worker sends its training process SIGTERM on its first call of
  step 2 (each process scores its own 8 responses a step), as a scheduler would."""
  path = {calls!r} + os.environ["TLT_PROCESS_ID"]
  with open(path, "a+") as f:
    f.seek(0)
    calls = len(f.read())
    f.write("x")
  if os.environ["TLT_PROCESS_ID"] == "1" and calls == 8:
    os.kill(os.getppid(), signal.SIGTERM)
  return 0.5
'''


def test_sigterm_to_one_process_stops_every_process_after_the_same_step(tmp_path):
  """Only process 1 is asked to stop (SIGTERM during step 2); at the step's end both agree
  (a collective), save step 2 together (not a checkpoint step) and exit 143 saying so;
  process 0 wrote steps 1-2."""
  reward = tmp_path / "term.py"
  reward.write_text(_TERM_ON_STEP_2.format(calls=str(tmp_path / "calls")))
  run = str(tmp_path / "run")
  results = launch("tlt_jax.train", 2, devices_per_process=4, timeout=900, args=[
      *ARGS, "--config.train.steps=3", "--config.train.checkpoint_every=3",
      f"--config.reward.name={reward}:fn", "--workdir", run])
  assert [r.returncode for r in results] == [143, 143], describe(results)
  for r in results:
    assert r.stderr.strip().splitlines()[-1] == (
        "stopped by SIGTERM after step 2 of 3: its checkpoint is on disk and the same "
        "command resumes from it"), describe(results)
  assert [m["step"] for m in _metrics(run)] == [1, 2]
  assert max(int(p) for p in os.listdir(os.path.join(run, "checkpoints")) if p.isdigit()) == 2


def test_two_processes_train_lora_like_one(tmp_path):
  """LoRA across processes (models/lora.py): the adapters initialised, stepped and
  checkpointed on the 8-device learner mesh from two processes, the merged weights synced to
  the two 4-way tensor-parallel replicas, one per process: the same losses, rewards and
  checkpointed adapters as one process."""
  lora = ["--config.model.lora.rank=4", "--config.model.lora.alpha=8.0",
          "--config.optim.lr=1e-3"]

  def reward(run):  # by the text from the first call: the groups have signal, the policy moves
    return "--config.reward.name=" + counting_reward(tmp_path, run, first=0, later="text")
  one = str(tmp_path / "one")
  ref = _single(one, *lora, reward("one"))
  assert ref.returncode == 0, ref.stderr[-3000:]
  two = str(tmp_path / "two")
  results = launch("tlt_jax.train", 2, devices_per_process=4,
                   args=[*ARGS, *lora, reward("two"), "--workdir", two], timeout=900)
  assert all(r.returncode == 0 for r in results), describe(results)
  a, b = _metrics(one), _metrics(two)
  assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
  for ma, mb in zip(a, b):
    assert ma["tokens"] == mb["tokens"] and ma["reward"] == mb["reward"]
    for k in ("loss", "pg_loss", "grad_norm", "rollout_prob_diff"):
      np.testing.assert_allclose(mb["loss"][k], ma["loss"][k], rtol=1e-5, atol=1e-7,
                                 err_msg=f"step {ma['step']} {k}")
  assert a[1]["loss"]["rollout_prob_diff"] < 1e-5  # the rollout decoded the learner's policy
  pa, pb = _params(one), _params(two)
  assert pa.keys() == pb.keys() and any(k.endswith("/b") for k in pa)
  for k in pa:
    np.testing.assert_allclose(pb[k], pa[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert max(float(np.max(np.abs(v))) for k, v in pa.items() if k.endswith("/b")) > 0


# the main job whose process 1 never returns from its policy export: process 0 then waits in
# the export's first gather for a peer that never comes (a job alive but stuck)
_STUCK_PEER = '''
import os, time
from absl import app, flags
from ml_collections import config_flags
from tlt_jax import config as config_lib, runtime
import tlt_jax.train as train

real = train.export_policy

def export_never_returning_on_process_1(run, state):
  if os.environ["TLT_PROCESS_ID"] == "1":
    time.sleep(3600)
  real(run, state)

train.export_policy = export_never_returning_on_process_1
train._CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
train._WORKDIR = flags.DEFINE_string("workdir", None, "")
app.run(runtime.exit_on_user_error(train.main), flags_parser=config_lib.flags_parser)
'''


def test_a_job_stuck_in_a_collective_ends_with_every_processs_stack(tmp_path):
  """tlt_jax/watchdog.py across processes: neither process makes progress (process 1 never
  leaves its export, process 0 waits in the export's gather for it), so after
  train.hang_timeout_s of the job's clock (distributed.ProgressBoard) the job ends: a process
  exits 75 with its report (process 1's naming the call it is stuck in), the other with it
  or ended by the coordination service; the steps' checkpoints stay on disk."""
  script = tmp_path / "stuck_peer.py"
  script.write_text(_STUCK_PEER)
  run = tmp_path / "run"
  results = launch(str(script), 2, devices_per_process=4, timeout=600, args=[
      *ARGS, "--config.train.hang_timeout_s=20", "--workdir", str(run)])
  codes = [r.returncode for r in results]
  assert 75 in codes and not any(r.timed_out for r in results), describe(results)
  reports = {int(f.split(".")[1]) for f in os.listdir(run) if f.startswith("hang.")}
  assert reports and all(codes[p] == 75 for p in reports), (reports, describe(results))
  for p in reports:
    text = (run / f"hang.{p}.txt").read_text()
    assert text.startswith("hang: no process of the job made progress for 2"), text[:300]
    assert "after step 2; process" in text and "the policy's export" in text, text[:300]
    if p == 1:
      assert "in export_never_returning_on_process_1" in text
  assert max(int(s) for s in os.listdir(run / "checkpoints") if s.isdigit()) == 2
