"""scripts/gpu_check.sh --smoke: the GPU checklist's stages run end to end on the CPU.

The checklist is only worth something if it runs the day a GPU is lent, so CI runs it with tiny
settings: every stage must finish with exit 0, and what the report says must hold up against
independent facts (greedy SD equals greedy plain decoding, the bench target computes the shipped
model's function). Its regime stage is also the smoke run of tlt_jax/bench/regime.py (every
table, the long-tail time split, the speculation gate's rollouts).
"""

import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_writes_a_complete_report(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--smoke", "--out",
                  str(tmp_path)], check=True, env=env, timeout=1500, capture_output=True)
  report = (tmp_path / "report.md").read_text()
  stages = re.findall(r"^## (\w+)$", report, re.M)
  assert stages == ["env", "kernels", "kernel_bench", "speculative", "bench_model", "probe",
                    "cost_model", "bench_regime", "rl_steps"], report
  assert re.findall(r"^exit (\d+) after", report, re.M) == ["0"] * len(stages), report
  # the kernels and speculative stages ran tests, all passed
  for n_passed in re.findall(r"=+ (\d+) passed", report):
    assert int(n_passed) > 0
  assert "failed" not in report.split("## bench_model")[0]
  # the kernel timing table: every case, a number from the reference and both kernels
  bench = report.split("## kernel_bench")[1].split("## speculative")[0]
  for case in ("chain greedy", "chain sample one-hot", "chain sample q", "tree greedy",
               "tree sample"):
    assert re.search(rf"^\| {case} \| 1 \| 4 \| [\d.n/a]+ \| [\d.]+ \| [\d.]+ \|", bench,
                     re.M), bench
  # greedy SD through the Pallas kernel (interpret mode here) == greedy plain, every response
  rows = re.findall(r"^\| (plain|SD \S+) \| (\d+)/(\d+) \|", report, re.M)
  assert [r[0] for r in rows] == ["plain", "SD 4_1_5", "SD 4_2_8"], report
  assert all(same == total for _, same, total in rows), rows
  assert "greedy argmax identical" in report  # widened target == the shipped model's function
  # the cost model fitted on the bench target, its predictions beside the measured steps
  fitted = json.load(open(tmp_path / "cost_model" / "cost_model.json"))
  assert fitted["hardware"]["mem_bw"] > 0 and len(fitted["ratios"]) == 2  # 3_1_4 at 2 batches
  assert {r["label"] for r in fitted["rows"]} >= {"plain step", "spec step 3_1_4"}
  assert re.search(r"\*\*s per RL step\*\*.*\| \*\*[\d.]+\*\* \| \*\*[\d.]+\*\* \|", report)
  # the regime stage (scripts/bench_regime.py on the smoke target): every table printed, greedy
  # speculative outputs equal plain decoding's, the summary's time split adds up
  regime = (tmp_path / "bench_regime.log").read_text()
  for head in ("batch 1, greedy", "batch 8, sampled", "long tail", "where the time goes",
               "cost model", "speculation gate"):
    assert head in regime, head
  summary = json.load(open(tmp_path / "bench_regime" / "summary.json"))
  split = summary["long tail split"]  # chunk walls fit inside the run's
  plain = split["parts"]["plain"]
  assert plain["small"] + plain["big"] > 0 and plain["other"] >= -1e-6
  assert 0 < split["prefill_s"] < plain["total"] and split["amdahl_bound"] >= 1.0
  assert len(summary["gate"]["times"]["gated BEG"]) == 2
  assert summary["batch 1, greedy, default task (EOS)"]["SD 3_1_4"]["same"] is True
  assert summary["batch 8, greedy, default task (EOS)"]["SD 4_1_5"]["same"] is True
