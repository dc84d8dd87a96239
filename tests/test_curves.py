"""A run's curves (tlt_jax/curves.py, scripts/plot_curves.py): the rolling mean against a
direct window average, each panel's points against the records they come from, the figure
written and readable, the command's user errors."""

import json
import os
import sys

import numpy as np
import pytest

from tlt_jax.curves import rolling_mean, series

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_rolling_mean_is_the_trailing_window_average():
  y = np.random.RandomState(0).randn(23)
  for size in (1, 3, 5, 30):
    want = [np.mean(y[max(0, i - size + 1):i + 1]) for i in range(len(y))]
    np.testing.assert_allclose(rolling_mean(y, size), want, rtol=1e-12)


def _records(n=12, resumed_at=None, seed=0):
  rng = np.random.RandomState(seed)
  recs = [{"step": 0, "eval": {"accuracy": 0.4}}]
  for s in range(1, n + 1):
    r = {"step": s, "reward": float(rng.rand()), "response_length": {"mean": 30.0 + s},
         "time": {"total": 5.0 + s % 3, "rollout": 2.0}}
    if s % 5 == 0:  # two held-out files; the second not yet listed at step 5
      r["eval"] = {"accuracy": 0.4 + 0.01 * s,
                   "accuracy_by_source": {"aime": 0.1 * s, "math": 0.05 * s}}
      if s == 5:
        del r["eval"]["accuracy_by_source"]["math"]
    recs.append(r)
  if resumed_at is not None:  # a resumed run: no time for the step it restarted at
    del recs[resumed_at]["time"]
  return recs


def test_each_panel_holds_the_records_values():
  recs = _records(resumed_at=4)
  got = series(recs, smooth=3)
  steps = [r["step"] for r in recs if "reward" in r]
  rewards = [r["reward"] for r in recs if "reward" in r]
  assert got["reward"]["per step"][0].tolist() == steps
  np.testing.assert_allclose(got["reward"]["per step"][1], rewards)
  np.testing.assert_allclose(got["reward"]["mean"][1][2], np.mean(rewards[:3]))
  lengths = [r["response_length"]["mean"] for r in recs if "response_length" in r]
  np.testing.assert_allclose(got["length"]["mean"][1][:3],  # a trailing mean of up to 3
                             [lengths[0], np.mean(lengths[:2]), np.mean(lengths[:3])])
  np.testing.assert_allclose(got["length"]["mean"][1][-1], np.mean(lengths[-3:]))
  assert got["accuracy"]["eval"][0].tolist() == [0, 5, 10]
  np.testing.assert_allclose(got["accuracy"]["eval"][1], [0.4, 0.45, 0.5])
  assert list(got["accuracy"]) == ["eval", "source aime", "source math"]  # each file's curve
  assert got["accuracy"]["source aime"][0].tolist() == [5, 10]
  np.testing.assert_allclose(got["accuracy"]["source aime"][1], [0.5, 1.0])
  assert got["accuracy"]["source math"][0].tolist() == [10]  # where the records have it
  assert 4 not in got["seconds"]["total"][0].tolist()  # the step without a time is left out
  assert len(got["seconds"]["total"][0]) == 11 and set(got["seconds"]["rollout"][1]) == {2.0}
  assert series([{"step": 0, "eval": {"accuracy": 0.5}}]).keys() == {"accuracy"}


def test_plot_curves_command(tmp_path, capsys):
  import matplotlib.image
  import plot_curves
  for name, seed in (("on", 0), ("off", 1)):
    (tmp_path / name).mkdir()
    with open(tmp_path / name / "metrics.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in _records(seed=seed))
  out = tmp_path / "both.png"
  plot_curves.main(["--workdir", str(tmp_path / "on"), "--workdir", str(tmp_path / "off"),
                    "--label", "TLT on", "--label", "TLT off", "--out", str(out)])
  img = matplotlib.image.imread(str(out))
  assert img.shape[:2] == (825, 1320)  # 12 x 7.5 inches at 110 dpi
  plot_curves.main(["--workdir", str(tmp_path / "on")])  # one run: beside its metrics
  assert (tmp_path / "on" / "curves.png").stat().st_size > 0
  capsys.readouterr()
  with pytest.raises(SystemExit):
    plot_curves.main(["--workdir", str(tmp_path / "on"), "--workdir", str(tmp_path / "off"),
                      "--label", "x"])
  assert "1 --label for 2 --workdir: give one per run" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    plot_curves.main(["--workdir", str(tmp_path / "nowhere")])
  assert "nowhere: no metrics.jsonl" in capsys.readouterr().err
  assert not (tmp_path / "nowhere").exists()


def test_bench_e2e_draws_trl_in_every_panel():
  """TRL's records (scripts/bench_trl_grpo.py's form) reach every panel: its step's seconds are
  its `total` less `other` (TRL's own accounting: total = the phases + other, and in lockstep
  `other` runs on into the other runs' turns), its rollout its `generate`."""
  import bench_e2e
  trl = [{"step": 0, "eval": {"accuracy": 0.47}, "time": {"eval": 10.7}}]
  for s in range(1, 6):
    t = {"generate": 3.0 + s, "reward": 0.01, "logprobs": 2.0, "rollout_other": 0.05,
         "update_fwd_bwd": 8.0, "optimizer": 0.1, "update": 8.1, "other": 20.0 * s}
    t["total"] = (t["generate"] + t["reward"] + t["logprobs"] + t["rollout_other"]
                  + t["update"] + t["other"])
    trl.append({"step": s, "reward": 0.3, "response_length": {"mean": 30.0}, "time": t})
  got = series(bench_e2e.trl_curve_records(trl))
  assert got.keys() == {"reward", "accuracy", "length", "seconds"}
  np.testing.assert_allclose(got["seconds"]["total"][1],
                             [r["time"]["total"] - r["time"]["other"] for r in trl[1:]])
  np.testing.assert_allclose(got["seconds"]["rollout"][1], [4.0, 5.0, 6.0, 7.0, 8.0])
  assert got["accuracy"]["eval"][1].tolist() == [0.47]


def test_bench_e2e_plot_reads_every_run(tmp_path, monkeypatch):
  import bench_e2e
  import tlt_jax.curves
  (tmp_path / "on").mkdir()
  (tmp_path / "trl").mkdir()
  with open(tmp_path / "on" / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in _records())
  with open(tmp_path / "trl" / "trl_metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 1, "reward": 0.5, "time": {"generate": 1.0, "update": 2.0}})
            + "\n")
  seen = {}
  monkeypatch.setattr(tlt_jax.curves, "plot_runs", lambda runs, path: seen.update(runs))
  bench_e2e.plot(str(tmp_path), ["on", "trl"], str(tmp_path / "c.png"))
  assert seen["on"] == _records()
  assert seen["trl"] == [{"step": 1, "reward": 0.5, "time": {"total": 3.0, "rollout": 1.0}}]
