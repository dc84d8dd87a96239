"""Reward functions and the reward worker pool (crash / hang / death of user code)."""

import textwrap
import time

import pytest

from tlt_jax.rl.reward_pool import RewardError, RewardPool
from tlt_jax.rl.rewards import get_reward_fn

USER_MODULE = textwrap.dedent("""
    import os, time

    def good(response, answer):
        return float(response.strip() == answer)

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
""")


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


def test_arith_reward_and_bad_names():
  assert get_reward_fn("arith")(" 2+3=5 #### 5", "5") == 1.0
  assert get_reward_fn("arith")(" 2+3=5 #### 6", "5") == 0.0
  with pytest.raises(ValueError, match="unknown"):
    get_reward_fn("nope")
  with pytest.raises(ValueError, match="cannot import"):
    get_reward_fn("no_such_module_xyz:fn")


def test_pool_survives_crash_hang_and_death(user_module):
  for fn, bad, counter in (("crash", "boom", "errors"), ("hang", "hang", "timeouts"),
                           ("die", "die", "crashes")):
    with RewardPool(f"{user_module}:{fn}", num_workers=2, timeout=1.0) as pool:
      t0 = time.perf_counter()
      for i in range(6):
        pool.submit(i, bad if i in (1, 4) else "ok", "ok")
      out = pool.gather(list(range(6)))
      assert out == {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 0.0, 5: 1.0}, fn
      assert getattr(pool.stats, counter) == 2, (fn, pool.stats)
      assert pool.stats.calls == 6
      # the pool goes on after the failures: later calls are served by fresh workers
      pool.submit("after", "ok", "ok")
      assert pool.gather(["after"]) == {"after": 1.0}
      assert time.perf_counter() - t0 < 20


def test_pool_scores_user_function_and_rejects_nonfinite(user_module):
  with RewardPool(f"{user_module}:chatty", num_workers=1, timeout=5.0) as pool:
    pool.submit("a", "x", "")
    pool.submit("b", "nan", "")
    assert pool.gather(["a", "b"]) == {"a": 0.5, "b": 0.0}
    assert pool.stats.errors == 1


def test_pool_bad_name_fails_fast(user_module):
  with pytest.raises(RewardError, match="config.reward.name"):
    RewardPool(f"{user_module}:missing", num_workers=1)
