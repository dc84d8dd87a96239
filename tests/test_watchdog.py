"""A run alive but making no progress ends (tlt_jax/watchdog.py): the watchdog's clock against
beats from another thread, and the main job stuck in its policy export (a collective whose
peer never comes, as jax 0.12.1's gloo hung there) exiting 75 with the stuck call named,
its checkpoint on disk, and the same command finishing the run."""

import os
import subprocess
import sys
import textwrap
import threading
import time

from tlt_jax import watchdog
from tlt_jax.checkpoint import Checkpointer
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_beats_hold_it_off_and_their_absence_reports_the_phase_and_every_stack(tmp_path):
  hangs = []
  stop_beating = threading.Event()

  def beating():  # a worker thread's loop: a chunk every 20 ms, then nothing
    while not stop_beating.is_set():
      watchdog.beat()
      time.sleep(0.02)

  def waiting_for_a_peer():  # the main thread's stuck call, named in the report
    t = time.monotonic()
    while not hangs and time.monotonic() - t < 10:
      time.sleep(0.01)

  with watchdog.Watchdog(0.4, str(tmp_path), process=3, step=lambda: 7,
                         on_hang=hangs.append):
    watchdog.beat("rollout")
    worker = threading.Thread(target=beating, name="rollout-worker")
    worker.start()
    time.sleep(1.2)  # three timeouts long: beats keep coming, nothing reported
    assert hangs == []
    stop_beating.set()
    worker.join()
    t = time.monotonic()
    waiting_for_a_peer()
    waited = time.monotonic() - t
  assert len(hangs) == 1 and 0.3 < waited < 1.5, (hangs, waited)
  assert "process 3 made no progress for" in hangs[0], hangs
  assert "after step 7; process 3 last in rollout" in hangs[0], hangs
  report = (tmp_path / "hang.3.txt").read_text()
  assert report.startswith(hangs[0])
  # faulthandler's stacks: the main thread's innermost frames are the stuck call
  assert "in waiting_for_a_peer" in report and "Current thread" in report, report


class _Peers:
  """Another process's progress as distributed.ProgressBoard shares it: what this one
  publishes, and the peer's own latest (moving while `moving`)."""

  def __init__(self):
    self.moving, self.peer, self.published = True, time.time(), []

  def publish(self, t):
    self.published.append(t)

  def latest(self):
    if self.moving:
      self.peer = time.time()
    return max([self.peer] + self.published)


def test_a_process_waiting_on_a_progressing_peer_is_not_hung_and_all_stuck_is(tmp_path):
  hangs, peers = [], _Peers()
  with watchdog.Watchdog(0.4, str(tmp_path), process=1, step=lambda: 0, peers=peers,
                         on_hang=hangs.append):
    time.sleep(1.2)  # no beat here: the peer's progress holds it off
    assert hangs == [] and len(peers.published) >= 5
    assert max(peers.published) <= time.time() - 1.0  # (this process's own, unchanged)
    peers.moving = False
    t = time.monotonic()
    while not hangs and time.monotonic() - t < 5:
      time.sleep(0.01)
  assert len(hangs) == 1 and time.monotonic() - t < 1.5, hangs
  assert hangs[0].startswith("hang: no process of the job made progress for ")
  assert "before the first step; process 1 last in start" in hangs[0], hangs


def test_no_timeout_no_thread(tmp_path):
  before = threading.active_count()
  with watchdog.Watchdog(0, str(tmp_path), on_hang=lambda m: None) as w:
    assert w._thread is None and threading.active_count() == before
    time.sleep(0.05)
  assert not (tmp_path / "hang.0.txt").exists()


# the main job with its policy export replaced by a call that never returns (as a gather of a
# tensor whose peer process never joins would), run as `python -m tlt_jax.train` runs it
_STUCK_EXPORT = textwrap.dedent("""
    import time
    from absl import app, flags
    from ml_collections import config_flags
    from tlt_jax import config as config_lib, runtime
    import tlt_jax.train as train

    def gather_that_never_returns(run, state):
      time.sleep(3600)

    train.export_policy = gather_that_never_returns
    train._CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
    train._WORKDIR = flags.DEFINE_string("workdir", None, "")
    app.run(runtime.exit_on_user_error(train.main), flags_parser=config_lib.flags_parser)
""")


def test_a_main_job_stuck_in_its_export_exits_75_and_the_same_command_finishes_it(tmp_path):
  run = tmp_path / "run"
  args = ["--config", "configs/default.py", "--workdir", str(run), "--config.train.steps=1",
          "--config.tlt.enabled=False", "--config.train.eval_every=0",
          "--config.grpo.num_prompts=4", "--config.grpo.n=4", "--config.grpo.micro_batch=16",
          "--config.rollout.max_new_tokens=48", "--config.reward.num_workers=1",
          "--config.train.hang_timeout_s=20"]
  env = user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu")
  script = tmp_path / "stuck_export.py"
  script.write_text(_STUCK_EXPORT)
  t = time.monotonic()
  p = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == watchdog.EXIT_CODE, p.stderr[-3000:]
  assert time.monotonic() - t < 400
  err = p.stderr
  assert "hang: process 0 made no progress for 2" in err, err[-3000:]
  assert ("(train.hang_timeout_s=20) after step 1; process 0 last in the policy's export"
          in err), err[-3000:]
  assert "in gather_that_never_returns" in err, err[-3000:]  # the stuck call, in the stack
  assert "in gather_that_never_returns" in (run / "hang.0.txt").read_text()
  with Checkpointer(str(run / "checkpoints")) as ck:  # the step's checkpoint was not touched
    assert ck.latest_step() == 1
  assert not (run / "policy_hf").exists()
  again = subprocess.run([sys.executable, "-m", "tlt_jax.train", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "already holds a finished run" in again.stderr
  assert (run / "policy_hf" / "1" / "config.json").exists()  # the export the hang cut off
