"""Reward functions and the reward worker pool (crash / hang / death of user code).

Every wait on the pool goes through `within`, a watchdog: a regression that makes the pool
hang fails its test instead of hanging the suite.
"""

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tlt_jax.rl import reward_pool
from tlt_jax.rl.reward_pool import RewardError, RewardPool
from tlt_jax.rl.rewards import extra_means, get_reward_fn

USER_MODULE = textwrap.dedent("""
    import ctypes, os, subprocess, sys, time

    def good(response, answer):
        return float(response.strip() == answer)

    def echo(response, answer):
        return float(response)

    def slow(response, answer):
        time.sleep(0.4)
        return 1.0

    def crash(response, answer):
        if response == "boom":
            raise ZeroDivisionError("user bug")
        return 1.0

    def hang(response, answer):
        if response == "hang":
            while True:
                time.sleep(1)
        return 1.0

    def die(response, answer):
        if response == "die":
            os._exit(3)   # the process vanishes (segfault-like)
        return 1.0

    def chatty(response, answer):
        print("debug output that must not break the protocol")
        return float("nan") if response == "nan" else 0.5

    # Output that bypasses sys.stdout: it reaches fd 1 directly.
    def fd1_line(response, answer):
        os.write(1, b"marker-fd1-line\\n")
        return good(response, answer)

    def fd1_partial(response, answer):
        os.write(1, b"marker-fd1-partial")   # no newline: glued onto the next protocol line
        return good(response, answer)

    def child_print(response, answer):
        subprocess.run([sys.executable, "-c", "print('marker-child' + 'x' * 100)"], check=True)
        return good(response, answer)

    def c_puts(response, answer):
        libc = ctypes.CDLL(None)
        libc.puts(b"marker-c-puts")
        libc.fflush(None)
        return good(response, answer)
""")

# Imports fine until its reward function has run once: then the function leaves a marker and
# kills its worker, and every replacement worker fails at import (a dependency that broke
# mid-run), so the pool cannot be refilled.
FRAGILE_MODULE = textwrap.dedent("""
    import os
    _MARKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fragile.broken")
    if os.path.exists(_MARKER):
        raise RuntimeError("simulated: a dependency broke mid-run")

    def fn(response, answer):
        if response == "die":
            open(_MARKER, "w").close()
            os._exit(3)
        return 1.0
""")

# Hangs at import (e.g. a module-level network call), after leaving its pid for the test.
SLOW_IMPORT_MODULE = textwrap.dedent("""
    import os, time
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

    def fn(response, answer):
        return 1.0
""")


# verl's reward-function signature (called by keyword), as a verl user's file has it;
# compute_score appends what it was given to calls.jsonl beside the file.
VERL_MODULE = textwrap.dedent("""
    import json, os, time
    _LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl")

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with open(_LOG, "a") as f:
            f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
        if solution_str == "boom":
            raise ZeroDivisionError("user bug")
        if solution_str == "hang":
            time.sleep(600)
        right = solution_str.strip() == ground_truth
        return {"score": float(right) + (0.5 if data_source == "lighteval/MATH" else 0.0),
                "acc": right, "pred": solution_str.strip()}

    def no_extra_info(data_source, solution_str, ground_truth):
        return float(solution_str == ground_truth) + len(data_source)

    def verl_gsm8k_style(solution_str, ground_truth, method="strict"):   # positional
        return float(solution_str.split("#### ")[-1] == ground_truth)

    def takes_kwargs(data_source, solution_str, ground_truth, **kwargs):   # extra_info in them
        return float(solution_str == ground_truth) + kwargs["extra_info"]["bonus"]
""")


def within(seconds, fn, *args, **kwargs):
  """fn(*args, **kwargs) in a thread; fails the test if it has not returned in `seconds`."""
  box = {}

  def run():
    try:
      box["value"] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
      box["error"] = e

  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(seconds)
  if t.is_alive():
    pytest.fail(f"{getattr(fn, '__name__', fn)} still waiting after {seconds} s")
  if "error" in box:
    raise box["error"]
  return box["value"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(USER_MODULE)
  monkeypatch.chdir(tmp_path)  # the pool puts the launch directory on the workers' path
  return "my_rewards"


def test_math_reward_equivalence():
  fn = get_reward_fn("math")
  assert fn("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
  assert fn("The final answer is $\\boxed{42}$.", "42") == 1.0
  assert fn("The final answer is \\boxed{41}", "42") == 0.0
  assert fn("x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
  assert fn("no answer at all", "7") == 0.0


def test_math_reward_fails_at_startup_without_math_verify(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
  with pytest.raises(ValueError, match=r"config\.reward\.name='math'.*import of math_verify "
                     r"halted.*pip install 'math-verify>=0\.9,<0\.10'"):
    get_reward_fn("math")
  assert get_reward_fn("arith")(" 1+1=2 #### 2", "2") == 1.0  # other rewards do not need it


def test_rewards_module_does_not_import_math_verify():
  code = "import sys, tlt_jax.rl.rewards; assert 'math_verify' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_pool_with_broken_math_verify_fails_at_construction(tmp_path, monkeypatch):
  # A math_verify on the workers' path (the launch directory comes first) that cannot import.
  (tmp_path / "math_verify.py").write_text("raise ImportError('simulated broken install')\n")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RewardError, match=r"^config\.reward\.name='math' needs math-verify.*"
                     r"simulated broken install.*pip install"):
    within(30, RewardPool, "math", num_workers=1, timeout=2.0)


def test_arith_reward_and_bad_names():
  assert get_reward_fn("arith")(" 2+3=5 #### 5", "5") == 1.0
  assert get_reward_fn("arith")(" 2+3=5 #### 6", "5") == 0.0
  with pytest.raises(ValueError, match="unknown"):
    get_reward_fn("nope")
  with pytest.raises(ValueError, match="cannot import"):
    get_reward_fn("no_such_module_xyz:fn")


def test_pool_survives_crash_hang_and_death(user_module, caplog):
  """Each failed call scores 0 and is counted; the first of each kind is said once, with
  what happened (a reward that fails on every call must not train on zeros unnoticed)."""
  for fn, bad, counter, said in (("crash", "boom", "errors", "ZeroDivisionError: user bug"),
                                 ("hang", "hang", "timeouts", "ran past reward.timeout=1 s"),
                                 ("die", "die", "crashes", "killed its worker process")):
    caplog.clear()
    with RewardPool(f"{user_module}:{fn}", num_workers=2, timeout=1.0) as pool:
      t0 = time.perf_counter()
      for i in range(6):
        pool.submit(i, bad if i in (1, 4) else "ok", "ok")
      out = within(30, pool.gather, list(range(6)))
      assert out == {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 0.0, 5: 1.0}, fn
      assert getattr(pool.stats, counter) == 2, (fn, pool.stats)
      assert pool.stats.calls == 6
      warned = [r.getMessage() for r in caplog.records if "scored 0" in r.getMessage()]
      assert len(warned) == 1 and said in warned[0] and f":{fn}'" in warned[0], warned
      # the pool goes on after the failures: later calls are served by fresh workers
      pool.submit("after", "ok", "ok")
      assert within(30, pool.gather, ["after"]) == {"after": 1.0}
      assert time.perf_counter() - t0 < 20


def test_pool_scores_user_function_and_rejects_nonfinite(user_module):
  with RewardPool(f"{user_module}:chatty", num_workers=1, timeout=5.0) as pool:
    pool.submit("a", "x", "")
    pool.submit("b", "nan", "")
    pool.submit("c", "y" * 300_000, "")  # larger than a pipe's buffer: written in pieces
    assert within(30, pool.gather, ["a", "b", "c"]) == {"a": 0.5, "b": 0.0, "c": 0.5}
    assert pool.stats.errors == 1


@pytest.mark.parametrize("fn,marker", [
    ("fd1_line", "marker-fd1-line"),
    ("fd1_partial", "marker-fd1-partial"),
    ("child_print", "marker-child" + "x" * 100),
    pytest.param("c_puts", "marker-c-puts",
                 marks=pytest.mark.skipif(sys.platform != "linux", reason="libc via CDLL(None)")),
])
def test_output_on_fd1_goes_to_stderr_not_the_protocol(user_module, capfd, fn, marker):
  # The reported bug: a reward writing to fd 1 (os.write, a child process, C code) put a
  # non-JSON line on the protocol pipe and `gather` waited forever. Now fd 1 is stderr in the
  # worker, so these calls score as normal.
  with RewardPool(f"{user_module}:{fn}", num_workers=2, timeout=5.0) as pool:
    for i in range(4):
      pool.submit(i, "ok" if i != 2 else "wrong", "ok")
    assert within(30, pool.gather, list(range(4))) == {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}
    pool.submit("after", "ok", "ok")
    assert within(30, pool.gather, ["after"]) == {"after": 1.0}
    s = pool.stats
    assert (s.calls, s.errors, s.timeouts, s.crashes, s.respawn_failures) == (5, 0, 0, 0, 0), s
  assert marker in capfd.readouterr().err  # the output is not lost: it is in the log


def test_pool_thread_survives_unreadable_replies(user_module, monkeypatch):
  # Whatever goes wrong inside a serving thread is one crashed call: a non-JSON line (what fd 1
  # writes used to cause) or any other exception, e.g. a broken pipe while reading.
  read_line = reward_pool._Worker._read_line

  def faulty_read_line(self, deadline):
    line = read_line(self, deadline)
    if line == b'{"reward": 7.0}\n':
      return b"hello\n"
    if line == b'{"reward": 8.0}\n':
      raise OSError("simulated broken pipe")
    return line

  monkeypatch.setattr(reward_pool._Worker, "_read_line", faulty_read_line)
  with RewardPool(f"{user_module}:echo", num_workers=2, timeout=5.0) as pool:
    for k in (1, 7, 2, 8, 3):
      pool.submit(k, str(k), "")
    assert within(30, pool.gather, [1, 7, 2, 8, 3]) == {1: 1.0, 7: 0.0, 2: 2.0, 8: 0.0, 3: 3.0}
    assert (pool.stats.calls, pool.stats.crashes) == (5, 2), pool.stats
    pool.submit("after", "4", "")  # both threads still serve, on fresh workers
    pool.submit("after2", "5", "")
    assert within(30, pool.gather, ["after", "after2"]) == {"after": 4.0, "after2": 5.0}


def test_pool_stops_when_workers_cannot_be_restarted(tmp_path, monkeypatch):
  (tmp_path / "fragile_rewards.py").write_text(FRAGILE_MODULE)
  monkeypatch.chdir(tmp_path)
  with RewardPool("fragile_rewards:fn", num_workers=1, timeout=2.0, startup_timeout=5.0,
                  max_start_failures=3) as pool:
    pool.submit(0, "ok", "")
    pool.submit(1, "die", "")  # kills its worker; no replacement can import the module now
    assert within(30, pool.gather, [0, 1]) == {0: 1.0, 1: 0.0}
    assert pool.stats.crashes == 1
    for i in (1, 2):  # the calls that needed a replacement score 0 and are counted
      pool.submit(("later", i), "ok", "")
      assert within(30, pool.gather, [("later", i)]) == {("later", i): 0.0}
      assert pool.stats.respawn_failures == i
    t0 = time.monotonic()
    pool.submit("last", "ok", "")
    with pytest.raises(RewardError) as e:  # third failed start in a row: the pool stops
      within(30, pool.gather, ["last"])
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("config.reward.name='fragile_rewards:fn': ")
    assert "RuntimeError: simulated: a dependency broke mid-run" in msg
    assert "3 worker starts failed in a row" in msg
    assert pool.stats.respawn_failures == 3
    pool.submit("more", "ok", "")  # stays stopped: no waiting on start-ups that will fail
    with pytest.raises(RewardError, match="failed in a row"):
      within(30, pool.gather, ["more"])


def test_pool_counts_start_failures_of_any_kind(user_module, monkeypatch):
  with RewardPool(f"{user_module}:die", num_workers=1, timeout=2.0,
                  max_start_failures=2) as pool:
    def no_fork(*args, **kwargs):
      raise OSError(24, "Too many open files (simulated)")

    monkeypatch.setattr(reward_pool.subprocess, "Popen", no_fork)
    pool.submit("a", "die", "")
    pool.submit("b", "ok", "")
    assert within(30, pool.gather, ["a", "b"]) == {"a": 0.0, "b": 0.0}
    assert (pool.stats.crashes, pool.stats.respawn_failures) == (1, 1), pool.stats
    pool.submit("c", "ok", "")
    with pytest.raises(RewardError, match=r"cannot start a reward worker \(OSError: .*simulated"):
      within(30, pool.gather, ["c"])


def test_pool_stops_only_on_start_failures_in_a_row(user_module, monkeypatch):
  """A successful start clears the count: failed starts with a good one between them never
  add up to `max_start_failures`."""
  real_popen, calls = reward_pool.subprocess.Popen, []

  def every_other_fails(*args, **kwargs):  # replacement starts: fail, work, fail, work
    calls.append(1)
    if len(calls) % 2:
      raise OSError(24, "Too many open files (simulated)")
    return real_popen(*args, **kwargs)

  with RewardPool(f"{user_module}:die", num_workers=1, timeout=5.0,
                  max_start_failures=2) as pool:
    monkeypatch.setattr(reward_pool.subprocess, "Popen", every_other_fails)
    got = {}
    for i, response in enumerate(["die", "ok", "ok", "die", "ok", "ok"]):
      pool.submit(i, response, "")
      got.update(within(30, pool.gather, [i]))
    # each crash needs a replacement: its first start fails (0), the next one works (1)
    assert got == {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0, 5: 1.0}
    assert (pool.stats.crashes, pool.stats.respawn_failures) == (2, 2), pool.stats


def test_pool_start_up_has_a_deadline(tmp_path, monkeypatch):
  (tmp_path / "slow_import.py").write_text(SLOW_IMPORT_MODULE)
  monkeypatch.chdir(tmp_path)
  t0 = time.monotonic()
  with pytest.raises(RewardError, match=r"config\.reward\.name='slow_import:fn': .*did not "
                     r"start within 1\.5 s"):
    within(30, RewardPool, "slow_import:fn", num_workers=1, timeout=1.0, startup_timeout=1.5)
  assert time.monotonic() - t0 < 10
  pid = int((tmp_path / "slow.pid").read_text())
  with pytest.raises(ProcessLookupError):  # the hung worker was killed and reaped
    os.kill(pid, 0)


def test_check_reward_loads_the_module_in_a_worker_with_a_deadline(tmp_path, monkeypatch):
  """check_reward (the run's start-up check) never imports a user module in the calling
  process: a module that fails at import is one RewardError naming the key and the error, one
  that hangs at import costs the deadline, its process killed."""
  (tmp_path / "records_pid.py").write_text(
      "import os\nopen(os.path.join(os.path.dirname(__file__), 'import.pid'), 'w')"
      ".write(str(os.getpid()))\nraise RuntimeError('boom at import')\n")
  (tmp_path / "bad_syntax.py").write_text("def fn(response, answer:\n")
  (tmp_path / "slow_import.py").write_text(SLOW_IMPORT_MODULE)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RewardError, match=r"^config\.reward\.name='records_pid\.py:fn': .*cannot "
                     r"load \(RuntimeError: boom at import\)$"):
    within(30, reward_pool.check_reward, "records_pid.py:fn")
  assert int((tmp_path / "import.pid").read_text()) != os.getpid()
  with pytest.raises(RewardError, match=r"^config\.reward\.name='bad_syntax\.py:fn': .*"
                     r"SyntaxError"):
    within(30, reward_pool.check_reward, "bad_syntax.py:fn")
  t0 = time.monotonic()
  with pytest.raises(RewardError, match=r"did not start within 1\.5 s"):
    within(30, reward_pool.check_reward, "slow_import:fn", 1.5)
  assert time.monotonic() - t0 < 10
  with pytest.raises(ProcessLookupError):
    os.kill(int((tmp_path / "slow.pid").read_text()), 0)
  reward_pool.check_reward("arith")  # a good name passes


def test_gather_raises_when_the_pool_makes_no_progress(user_module, monkeypatch):
  monkeypatch.setattr(reward_pool, "_STALL_MARGIN_S", 0.5)
  with RewardPool(f"{user_module}:good", num_workers=1, timeout=1.0,
                  startup_timeout=1.0) as pool:
    assert pool.stall_limit == 2.5
    served = pool._tasks
    pool._tasks = queue.Queue()  # a queue no thread serves: a pool that cannot progress
    pool.submit("k", "ok", "ok")
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"no reward call finished in \d+ s .*1 of 1 rewards "
                       "missing"):
      within(30, pool.gather, ["k"])
    assert 2.0 < time.monotonic() - t0 < 8
    pool._tasks = served  # so that close() reaches the serving thread


def test_gather_deadline_is_progress_not_total_time(user_module, monkeypatch):
  monkeypatch.setattr(reward_pool, "_STALL_MARGIN_S", 0.5)
  with RewardPool(f"{user_module}:slow", num_workers=1, timeout=1.0,
                  startup_timeout=1.0) as pool:
    # A long idle spell before the batch (generation) does not count against it either.
    pool._last_progress -= 100
    t0 = time.monotonic()
    for i in range(8):  # 8 x 0.4 s behind one worker: longer than stall_limit in total
      pool.submit(i, "x", "")
    assert within(30, pool.gather, list(range(8))) == {i: 1.0 for i in range(8)}
    assert time.monotonic() - t0 > pool.stall_limit


def test_closed_pool_refuses_work(user_module):
  with RewardPool(f"{user_module}:good", num_workers=1, timeout=1.0) as pool:
    pass
  with pytest.raises(RewardError, match="closed; 1 of 1 rewards missing"):
    within(30, pool.gather, ["never-submitted"])
  with pytest.raises(RewardError, match="closed"):
    pool.submit("late", "ok", "ok")


def test_pool_bad_name_fails_fast(user_module, tmp_path):
  with pytest.raises(RewardError, match="config.reward.name"):
    within(30, RewardPool, f"{user_module}:missing", num_workers=1)
  (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(5)\n")
  with pytest.raises(RewardError, match=r"^config\.reward\.name='exits_at_import:fn': the reward "
                     r"worker exited at start-up \(exit code 5"):
    within(30, RewardPool, "exits_at_import:fn", num_workers=1)


# ------------------------------------------------------------- verl-signature reward functions
@pytest.fixture
def verl_file(tmp_path, monkeypatch):
  (tmp_path / "verl_reward.py").write_text(VERL_MODULE)
  monkeypatch.chdir(tmp_path)
  return tmp_path


def _calls(tmp_path):
  return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["verl_reward.py:compute_score", "verl_reward:compute_score"])
def test_verl_signature_gets_source_truth_and_extra_info_in_the_pool(verl_file, name):
  """verl's compute_score(data_source, solution_str, ground_truth, extra_info) named by file
  path (as verl's custom_reward_function.path) or module, scored in the worker processes."""
  tasks = [("a", "72", "72", "openai/gsm8k", {"split": "train", "index": 0}),
           ("b", "7", "72", "openai/gsm8k", {"split": "train", "index": 1}),
           ("c", "\\frac{1}{2}", "\\frac{1}{2}", "lighteval/MATH", None)]
  with RewardPool(name, num_workers=1, timeout=5.0) as pool:
    for key, response, answer, source, extra in tasks:
      pool.submit(key, response, answer, source, extra)
    # the dict's "score" (verl's convention), which here depends on data_source; the rest of
    # the dict as each key's extras, the numbers among them averaged
    extras = {}
    assert within(30, pool.gather, ["a", "b", "c"], extras) == {"a": 1.0, "b": 0.0, "c": 1.5}
  assert _calls(verl_file) == [[src, resp, ans, extra] for _, resp, ans, src, extra in tasks]
  assert extras == {"a": {"acc": True, "pred": "72"}, "b": {"acc": False, "pred": "7"},
                    "c": {"acc": True, "pred": "\\frac{1}{2}"}}
  assert extra_means(extras.values()) == {"acc": pytest.approx(2 / 3)}
  assert extra_means([{"n": 1, "x": float("nan")}, None, {"n": 2.0}]) == {"n": 1.5}


def test_verl_signature_crash_and_hang_cost_one_reward(verl_file):
  with RewardPool("verl_reward.py:compute_score", num_workers=1, timeout=1.0) as pool:
    for key in ("boom", "hang", "72"):
      pool.submit(key, key, "72", "openai/gsm8k", {})
    assert within(30, pool.gather, ["boom", "hang", "72"]) == {"boom": 0.0, "hang": 0.0,
                                                               "72": 1.0}
    assert (pool.stats.errors, pool.stats.timeouts) == (1, 1), pool.stats


def test_which_functions_are_called_the_verl_way(verl_file):
  # data_source and extra_info only where the function names them; otherwise (response,
  # answer) positionally, as verl's per-dataset scorers (gsm8k.compute_score) take them
  assert get_reward_fn("verl_reward.py:no_extra_info")("4", "4", "abc", {"x": 1}) == 4.0
  assert get_reward_fn("verl_reward.py:no_extra_info", extras=True)("4", "4", "abc") == (4.0,
                                                                                        None)
  assert get_reward_fn("verl_reward.py:compute_score", extras=True)("7", "7", "s") == (
      1.0, {"acc": True, "pred": "7"})
  assert get_reward_fn("verl_reward.py:verl_gsm8k_style")("so #### 72", "72", "s", {}) == 1.0
  # a function taking **kwargs takes extra_info too, by keyword
  assert get_reward_fn("verl_reward.py:takes_kwargs")("4", "4", "s", {"bonus": 2.0}) == 3.0
  with pytest.raises(ValueError, match=r"cannot import \(no file 'nope\.py'\).*file\.py"):
    get_reward_fn("nope.py:compute_score")
