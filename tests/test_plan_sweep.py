"""`python -m tlt_jax.plan --rates ...` (tlt_jax/plan/sweep.py): TLT's predicted speedup against
the drafter's per-draft acceptance, TLT off simulated once."""

import json
import os
import subprocess
import sys

import pytest

from tlt_jax.plan import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(*args):
  return subprocess.run([sys.executable, "-m", "tlt_jax.plan", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_a_sweep_over_the_drafters_acceptance_on_the_7b_recipe(tmp_path):
  """The 7B recipe on 8 simulated H100s, speculation open, at per-draft acceptance 0.2 and
  0.9: each rate's chains deliver the geometric series' tokens per verification
  (1 + r + ... + r^depth), the rollout gains more where more drafts are accepted, the files
  and the table are written."""
  out = tmp_path / "sweep"
  r = _plan("--config", "configs/qwen2_5_7b_math.py", "--hardware", "h100", "--steps", "1",
            "--rates", "0.9,0.2", "--out", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  s = json.loads((out / "sweep.json").read_text())
  assert [row["rate"] for row in s["rows"]] == [0.2, 0.9]  # sorted
  for row in s["rows"]:
    rate = row["rate"]
    for arm, depth in (("2_1_3", 2), ("4_1_5", 4), ("6_1_7", 6)):
      want = sum(rate ** k for k in range(depth + 1))
      assert row["tokens_per_verification"][arm] == pytest.approx(want, abs=0.006), (arm, row)
    assert len(row["per_step"]) == 1
    assert row["step_run"] == pytest.approx(row["per_step"][0], abs=1e-4)
  low, high = s["rows"]
  assert high["rollout"] > low["rollout"] and high["step"] > low["step"]
  assert s["off"]["step_s"] > 0 and s["gate"] == "open" and s["steps"] == 1
  assert "| per-draft acceptance |" in r.stdout and "break-even" in r.stdout
  assert (out / "sweep.png").stat().st_size > 0
  # scripts/plot_plan_sweep.py overlays sweeps (here the same one twice, labelled)
  png = tmp_path / "both.png"
  r = subprocess.run([sys.executable, "scripts/plot_plan_sweep.py", "--sweep", str(out),
                      "--sweep", str(out / "sweep.json"), "--label", "a", "--label", "b",
                      "--out", str(png)], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  assert png.stat().st_size > 0 and r.stdout.count("| per-draft acceptance |") == 2
  r = subprocess.run([sys.executable, "scripts/plot_plan_sweep.py", "--sweep",
                      str(tmp_path / "none"), "--out", str(png)], cwd=ROOT,
                     capture_output=True, text=True)
  assert r.returncode == 2 and "no sweep.json there" in r.stderr


def test_break_even_is_where_the_run_reaches_one():
  rows = [{"rate": 0.2, "step_run": 0.9}, {"rate": 0.6, "step_run": 1.1},
          {"rate": 0.4, "step_run": 0.95}]
  assert sweep.break_even(rows) == pytest.approx(0.4 + 0.05 / 0.15 * 0.2)
  assert sweep.break_even([{"rate": 0.3, "step_run": 1.2}]) == 0.3  # at the first rate already
  assert sweep.break_even([{"rate": 0.3, "step_run": 0.8}]) is None


def test_sweep_errors_are_one_line(tmp_path):
  for args, needle in ((["--rates", "0.5,1.5"], "--rates='0.5,1.5': '1.5' is not a per-draft "
                                                "acceptance in [0, 1]"),
                       (["--rates", "0.5", "--acceptance", "rate=0.8"],
                        "--acceptance='rate=0.8': --rates sweeps the per-draft rate")):
    r = _plan("--config", "configs/default.py", "--gpus", "2", "--out", str(tmp_path / "p"),
              *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
