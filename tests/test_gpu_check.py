"""scripts/gpu_check.sh --smoke: the GPU checklist's stages run end to end on the CPU.

The checklist is only worth something if it runs the day a GPU is lent, so CI runs it with tiny
settings: every stage must finish with exit 0, and what the report says must hold up against
independent facts (greedy SD equals greedy plain decoding, the bench target computes the shipped
model's function, the headline table is filled in). Its regime stage is also the smoke run of
tlt_jax/bench/regime.py (every table, the long-tail time split, the speculation gate's
rollouts), its decode stage the smoke run of scripts/gpu_decode.py.
"""

import json
import os
import re
import subprocess
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_writes_a_complete_report(tmp_path):
  env = user_env({k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")})
  subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--smoke", "--out",
                  str(tmp_path)], check=True, env=env, timeout=1500, capture_output=True)
  report = (tmp_path / "report.md").read_text()
  stages = re.findall(r"^## (\w+)$", report, re.M)
  assert stages == ["env", "decode", "bench_model", "rl_steps", "bench_regime", "learner",
                    "experts", "kernel_bench", "cost_model", "kernels", "speculative"], report
  assert re.findall(r"^exit (\d+) after", report, re.M) == ["0"] * len(stages), report
  # the headline table opens the report, every figure filled in but the learner's
  head = report.split("## env")[0]
  assert "| plain decode, batch 1: % of copy bandwidth | engine " in head, head
  assert re.search(r"\| RL steps on one device \(1 of configs/longtail.py .*, TLT on / off \| "
                   r"speedup [\d.]+x \(on .*tail's share of the rollout, TLT off: \d+%", head), head
  assert re.search(r"\| SD vs plain, batch 1 greedy, SD 3_1_4 \| .*outputs = plain: True", head)
  assert "cost model: spec / plain step, batch 1, 3_1_4 | predicted" in head, head
  assert re.search(r"\| paged attention \(the engine's\), batch 1: step vs the windows \| "
                   r"[\d.]+x .*largest difference from XLA's attention [\d.e+-]+ \|", head), head
  # the decode variants: every kind of cell measured, with a fraction of copy bandwidth and
  # compiled memory at least the weights + KV from shapes
  dec = json.load(open(tmp_path / "decode" / "gpu_decode.json"))
  cells = [c for g in dec["flag_sets"].values() for c in g["cells"]]
  assert {c["code"] for c in cells} == {"engine profile", "engine fixed u4", "engine spec 3_1_4",
                                        "windows", "engine unfused cublas noautotune"}
  # the engine's cells read the pages (its attention against XLA's, float32 here), the
  # windows' do not
  assert [c["paged_parity"] is not None and c["paged_parity"] < 1e-5 for c in cells] == [
      "windows" not in c["code"] for c in cells]
  prof = [c["profile"] for c in cells if c["code"] == "engine profile"]
  assert len(prof) == 2 and all(p["lines"] and p["wall_s"] > 0 for p in prof), prof
  for c in cells:
    assert "error" not in c, c
    assert 0 < c["fraction"] and c["memory_bytes"] >= c["shape_bytes"] * 0.9, c
  assert set(dec["best"]) == {"1", "2"}
  # the kernels and speculative stages ran tests, all passed
  for n_passed in re.findall(r"(\d+) passed", report):
    assert int(n_passed) > 0
  for name in ("kernels", "speculative"):
    assert "failed" not in report.split(f"## {name}")[1].split("exit ")[0], report
  # the kernel timing table: every case, a number from the reference and both kernels
  bench = report.split("## kernel_bench")[1].split("## cost_model")[0]
  for case in ("chain greedy", "chain sample one-hot", "chain sample q", "tree greedy",
               "tree sample"):
    assert re.search(rf"^\| {case} \| 1 \| 4 \| [\d.n/a]+ \| [\d.]+ \| [\d.]+ \|", bench,
                     re.M), bench
  assert "greedy argmax identical" in report  # widened target == the shipped model's function
  # the cost model fitted on the bench target, its predictions beside the measured steps
  fitted = json.load(open(tmp_path / "cost_model" / "cost_model.json"))
  assert fitted["hardware"]["mem_bw"] > 0 and len(fitted["ratios"]) == 2  # 3_1_4 at 2 batches
  assert {r["label"] for r in fitted["rows"]} >= {"plain step", "spec step 3_1_4"}
  # the main job ran the long-tail workload on the bench target TLT on and off (one device
  # here, as on one GPU), each step's phases read
  rl = report.split("## rl_steps")[1].split("## bench_regime")[0]
  assert "TLT on: exit 0" in rl and "TLT off: exit 0" in rl, rl
  assert re.search(r"^\| rollout \| [\d.]+ \| [\d.]+ \|$", rl, re.M), rl
  # the learner stage: a packed step with the fused kernel (interpreted here), with LoRA
  # adapters over the frozen model (B = 0: the same old log-probs) and with XLA's attention,
  # equal old log-probs, all in the headline; LoRA's weight sync within the plan's memory
  learner = json.load(open(tmp_path / "learner" / "learner.json"))
  assert [(r["attention"], r.get("lora_rank")) for r in learner] == [
      ("fused", None), ("fused", 64), ("xla", None)], learner
  assert all(r["update_s"] > 0 and r["parity_max_abs"] < 1e-3 for r in learner), learner
  assert 0 < learner[1]["sync_temp_layers"] <= learner[1]["sync_plan_layers"], learner[1]
  assert "learner step (packed update), attention fused |" in report
  assert "learner step (packed update), attention fused, LoRA rank 64 |" in report
  assert "LoRA weight sync (rank 64): merge + rollout layout" in report
  # the packed attention alone: our kernel, JAX's mha and XLA's agree on the tokens that count
  attention = json.load(open(tmp_path / "learner" / "attention.json"))
  assert [r["impl"] for r in attention["results"]] == ["flash", "mha", "xla"], attention
  assert all(r["ms"] > 0 and r["max_abs_vs_first"] < 1e-4 for r in attention["results"])
  assert 0 < attention["visited_blocks"] <= attention["causal_blocks"], attention
  assert re.search(r"\| packed attention fwd\+bwd \(1 x 128 tokens, 4/2 heads of 16\) \| "
                   r"flash [\d.]+ ms, mha [\d.]+ ms, xla [\d.]+ ms, flash [\d.]+x of mha's", head)
  # the experts stage: the kernel's check, a micro-batch through it and ragged_dot (their
  # weight gradients' sums agree: the same function), decode steps by the engine's ways
  experts = json.load(open(tmp_path / "experts" / "experts.json"))["cells"]
  assert [c["cell"] for c in experts] == [
      "check", "learner kernel", "learner xla", "decode 1 kernel", "decode 1 xla",
      "decode 16 kernel", "decode 16 xla"], experts
  assert all(c["ms"] > 0 for c in experts[1:]), experts
  assert [c["way"] for c in experts[3:]] == ["grouped_kernel", "gathered", "grouped_kernel",
                                             "dense"], experts
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
  # (not prefill_s < plain's total: two timings of a smoke model's 0.1-s runs, which a loaded
  # CI machine flipped, 0.17 against 0.11 s)
  assert split["prefill_s"] > 0 and split["amdahl_bound"] >= 1.0
  assert len(summary["gate"]["times"]["gated BEG"]) == 2
  assert summary["batch 1, greedy, default task (EOS)"]["SD 3_1_4"]["same"] is True
  assert summary["batch 8, greedy, default task (EOS)"]["SD 3_1_4"]["same"] is True


def test_the_gpu_settings_parse(tmp_path):
  """Every command the checklist runs on a GPU (`gpu_check.sh --plan`: the GPU settings,
  printed, not run) parses here: each script's arguments, the main job's config overrides and
  its config's checks (tests/gpu_plan_args.py), each pytest stage's -k selects tests. A
  mistyped argument in the GPU branch, which the smoke run never takes, would otherwise cost a
  stage of the next lent GPU's few minutes."""
  import shlex
  import sys
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  plan = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--plan",
                         "--out", str(tmp_path)], cwd=ROOT, env=env, check=True,
                        capture_output=True, text=True, timeout=60).stdout
  rows = [line.split("\t") for line in plan.splitlines()]
  assert [r[0] for r in rows] == ["env", "decode", "bench_model", "rl_steps:train", "rl_steps",
                                  "bench_regime", "learner", "experts", "kernel_bench",
                                  "cost_model", "kernels", "speculative"], plan
  limits = {name: int(limit) for name, limit, _ in rows if name != "rl_steps:train"}
  assert sum(limits.values()) <= 540, limits  # 9 minutes in all
  assert not list(tmp_path.glob("*.log")) and not (tmp_path / "report.md").exists()  # none ran
  scripts, selections = [], []
  for name, _, cmd in rows:
    if name in ("env", "rl_steps"):  # shell scripts: the command rl_steps runs is its own row
      continue
    argv = shlex.split(cmd)[1:]  # less the interpreter
    (selections if argv[:2] == ["-m", "pytest"] else scripts).append((name, argv))
  assert {n for n, _ in selections} == {"kernels", "speculative"}
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_plan_args.py")],
                       input=json.dumps(scripts), cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(env, JAX_PLATFORMS="cpu"))
  results = [json.loads(line) for line in out.stdout.splitlines()]
  assert [r["stage"] for r in results] == [n for n, _ in scripts], out.stderr[-2000:]
  assert all(r["ok"] for r in results), results
  for name, argv in selections:
    got = subprocess.run([sys.executable, *argv, "--collect-only"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, (name, got.stdout[-2000:])
    assert re.search(r"^(\d+)/\d+ tests collected", got.stdout, re.M), (name, got.stdout[-500:])


def test_a_second_call_runs_the_stages_named_with_longer_limits(tmp_path):
  """A warm machine's second call (`--only ... --scale N`): only the stages named (and the
  bench target they need, unless an earlier run in DIR made it), every limit and the budgets
  inside the stages N times the GPU's; a stage name or scale that is wrong is one error
  naming the fix."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  run = lambda *a: subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"),
                                   "--plan", "--out", str(tmp_path), *a], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=60)
  full = {r.split("\t")[0]: r.split("\t") for r in run().stdout.splitlines()}
  got = run("--only", "rl_steps,learner", "--scale", "2")
  rows = {r.split("\t")[0]: r.split("\t") for r in got.stdout.splitlines()}
  assert got.returncode == 0 and list(rows) == ["bench_model", "rl_steps:train", "rl_steps",
                                                "learner"], got.stdout
  assert all(int(rows[n][1]) == 2 * int(full[n][1]) for n in rows if ":" not in n), (rows, full)
  assert abs(int(rows["rl_steps:train"][1]) - 2 * int(full["rl_steps:train"][1])) <= 1  # 4/7
  budget = lambda row: int(re.search(r"--budget_s (\d+)", row[2]).group(1))
  assert budget(rows["learner"]) == int(rows["learner"][1]) - 20 > budget(full["learner"])
  (tmp_path / "bench_model" / "model").mkdir(parents=True)  # an earlier run's target
  (tmp_path / "bench_model" / "model" / "config.json").write_text("{}")
  again = run("--only", "learner")
  assert [r.split("\t")[0] for r in again.stdout.splitlines()] == ["learner"], again.stdout
  bad = run("--only", "rl_step")
  assert bad.returncode == 2 and "--only rl_step: no stage 'rl_step'; the stages: env, " \
      "decode, bench_model, rl_steps" in bad.stderr, bad.stderr
  assert "--scale 1.5: a whole number >= 1" in run("--scale", "1.5").stderr


def test_every_limit_and_budget_fits_the_nine_minutes(tmp_path):
  """The GPU stages' limits sum to the 540 s the script promises (its header: 9 minutes);
  the budgets inside a stage end before its limit (decode's cells, the learner's xla variant,
  TLT off's run after TLT on's) and scale with it under --scale; any stage that needs the
  bench target brings it when DIR has none; --scale takes no zero or leading zeros."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  run = lambda *a: subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"),
                                   "--plan", "--out", str(tmp_path), *a], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=60)
  rows = lambda got: {r.split("\t")[0]: r.split("\t") for r in got.stdout.splitlines()}
  budget = lambda row: int(re.search(r"--budget_s (\d+)", row[2]).group(1))
  for scale in (1, 3):
    got = rows(run("--scale", str(scale)))
    limits = {n: int(r[1]) for n, r in got.items() if ":" not in n}
    assert sum(limits.values()) == 540 * scale, limits
    for name in ("decode", "learner"):
      assert 0 < budget(got[name]) < limits[name], (name, got[name])
    # decode's and the learner's spare seconds past the budget do not scale
    assert limits["decode"] - budget(got["decode"]) == 7
    assert limits["learner"] - budget(got["learner"]) == 20
    # TLT on's run under the stage's limit; TLT off gets what is left of the stage's own
    assert int(got["rl_steps:train"][1]) < limits["rl_steps"]
    assert f"limit=$(( {limits['rl_steps']} - 12 " in got["rl_steps"][2], got["rl_steps"][2]
  for stage in ("rl_steps", "bench_regime", "learner", "cost_model"):
    assert list(rows(run("--only", stage))) in (["bench_model", stage],
                                                ["bench_model", "rl_steps:train", stage]), stage
  for stage in ("decode", "kernels", "env"):
    assert list(rows(run("--only", stage))) == [stage]
  assert list(rows(run("--only", "decode, kernels"))) == ["decode", "kernels"]
  for bad in ("0", "00", "02", "-1", "x"):
    got = run("--scale", bad)
    assert got.returncode == 2 and "a whole number >= 1" in got.stderr, (bad, got.stderr)
