"""The GPU checklist's outputs when a stage is cut off at its limit or fails, as on a lent GPU
(fresh, cold caches: the first run lost four of nine stages to their limits): the headline
(scripts/gpu_headline.py) reads what the stages left, the decode and learner stages
(scripts/gpu_decode.py, scripts/gpu_learner.py) leave what they measured before the cut. The
smoke run (tests/test_gpu_check.py) finishes every stage, so none of this happens there."""

import importlib.util
import io
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
  spec = importlib.util.spec_from_file_location(f"_gpu_{name}",
                                                os.path.join(ROOT, "scripts", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


_STEP = {"step": 1, "time": {"rollout": 3.0, "update": 2.0, "total": 6.0, "compile": 1.5},
         "response_length": {"p50": 40, "max": 512}, "rollout_tail": {"time_share": 0.4}}


def _metrics(out, mode: str, text: str) -> None:
  d = out / "e2e" / mode
  d.mkdir(parents=True)
  (d / "metrics.jsonl").write_text(text)


def test_rl_table_with_a_mode_cut_off_before_its_first_step(tmp_path):
  """The main job opens metrics.jsonl at start-up: TLT on cut off at its half of the stage
  (cold compiles) leaves the file empty; the table has TLT off's column and says so."""
  headline = _script("gpu_headline")
  _metrics(tmp_path, "on", "")
  _metrics(tmp_path, "off", json.dumps(_STEP) + "\n")
  table = headline.rl_table(str(tmp_path))
  assert "| rollout | 3.00 |" in table and "TLT off (1 steps)" in table, table
  assert "TLT on: no step finished" in table and "| response length p50 / max (last step) | " \
      "40 / 512 |" in table, table
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  assert rows["RL steps on one device, TLT on / off"] == \
      "not measured (steps done: on 0, off 1)", rows
  _metrics(tmp_path / "none", "on", "")  # nothing finished at all
  assert headline.rl_table(str(tmp_path / "none")).startswith("no RL step finished")


def test_a_torn_last_record_is_skipped(tmp_path):
  """A run killed mid-write leaves half a line: the steps before it still count."""
  headline = _script("gpu_headline")
  for mode in ("on", "off"):
    _metrics(tmp_path, mode, json.dumps(_STEP) + "\n" + json.dumps(_STEP)[:30])
  assert [len(r) for r in headline.rl_runs(str(tmp_path)).values()] == [1, 1]
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  key = next(f for f in rows if f.startswith("RL steps on one device (1 of"))
  assert rows[key].startswith("speedup 1.00x"), rows


def test_headline_rows_from_cut_off_and_failed_stages(tmp_path):
  """The decode stage cut off before its summary (no "best"), a learner variant that failed
  (its kernel did not compile) and one stage's output missing a field: each gives its row and
  the others' rows stay."""
  headline = _script("gpu_headline")
  cell = {"code": "engine profile", "batch": 1, "step_s": 0.0017, "fraction": 0.47}
  (tmp_path / "decode").mkdir()
  (tmp_path / "decode" / "gpu_decode.json").write_text(json.dumps(
      {"flag_sets": {"default": {"cells": [cell, {"code": "fused", "batch": 8,
                                                  "error": "XlaRuntimeError: x"}]}}}))
  (tmp_path / "learner").mkdir()
  (tmp_path / "learner" / "learner.json").write_text(json.dumps(
      [{"attention": "fused", "error": "XlaRuntimeError: Triton compilation failed"},
       {"attention": "xla", "update_s": 2.0, "logprobs_s": 0.5}]))
  (tmp_path / "cost_model").mkdir()
  (tmp_path / "cost_model" / "cost_model.json").write_text(json.dumps(
      {"ratios": [{"batch": 1, "arm": "4_1_5"}]}))  # predicted / measured missing
  (tmp_path / "learner" / "attention.json").write_text(json.dumps(
      {"rows": 4, "t": 4096, "heads": 28, "kv_heads": 4, "head_dim": 128, "visited_blocks": 300,
       "causal_blocks": 1000, "results": [{"impl": "flash", "error": "XlaRuntimeError: y"},
                                          {"impl": "mha", "ms": 3.0}, {"impl": "xla", "ms": 9.0}]}))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  assert rows["plain decode, batch 1: % of copy bandwidth"] == "engine 47% (1.70 ms)", rows
  assert rows["learner step (packed update), attention fused"].startswith(
      "fails: XlaRuntimeError: Triton"), rows
  assert rows["learner step (packed update), attention xla"].startswith("update 2.000 s")
  assert rows["cost_model figures"].startswith("unreadable (KeyError"), rows
  assert rows["packed attention fwd+bwd (4 x 4096 tokens, 28/4 heads of 128)"] == (
      "mha 3.00 ms, xla 9.00 ms, flash fails; flash visits 300 of 1000 causal blocks"), rows
  assert rows["SD vs plain (batch 1, 8)"] == "not measured"
  assert headline.main([str(tmp_path)]) == 0


class _FakeChild:
  """A decode child that prints `lines`, then dies as a process the stage's timeout killed
  would leave its parent (the parent is killed with it: here, an exception)."""

  def __init__(self, lines, calls):
    self.lines = lines
    calls.append(self)
    self.stdout = self._out()

  def _out(self):
    yield from self.lines
    raise KeyboardInterrupt("the stage's limit")

  def wait(self):
    return 0


def _cell(**kw):
  return "CELL " + json.dumps(kw) + "\n"


_BW = _cell(kind="bandwidth", bytes_per_s=3e12, device="NVIDIA H200", jax="0.11.2", flags="")
_ENGINE = _cell(kind="cell", code="engine profile", batch=1, kv_len=128, step_s=0.0017,
                profile=None, paged_parity=None, bytes=2.3e9, fraction=0.47, compile_s=6.4,
                seconds=9.0, memory_bytes=None, shape_bytes=1)


def test_decode_json_is_written_as_the_cells_come(tmp_path, monkeypatch):
  """gpu_decode.json after every cell: a stage cut off at its limit (a cell started late, a
  slow compile) keeps the cells it measured for the headline, with the fastest so far."""
  decode = _script("gpu_decode")
  calls = []
  monkeypatch.setattr(decode.subprocess, "Popen",
                      lambda *a, **kw: _FakeChild([_BW, _ENGINE], calls))
  monkeypatch.setattr(sys, "stdout", io.StringIO())
  with pytest.raises(KeyboardInterrupt):
    decode.main(["--quick", "--out", str(tmp_path)])
  got = json.load(open(tmp_path / "gpu_decode.json"))
  assert [c["code"] for c in got["flag_sets"]["default"]["cells"]] == ["engine profile"]
  assert got["best"]["1"]["flags"] == "default" and got["flag_sets"]["default"]["bandwidth"]


def test_decode_starts_no_process_whose_first_cell_cannot_end_in_time(tmp_path, monkeypatch):
  """A cell took 9 s: with 5 s of --budget_s, no further flag set's process is started (its
  start-up and first cell would run past the stage's limit)."""
  decode = _script("gpu_decode")
  calls = []

  class Done(_FakeChild):
    def _out(self):
      yield from self.lines

  monkeypatch.setattr(decode.subprocess, "Popen", lambda *a, **kw: Done([_BW, _ENGINE], calls))
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  decode.main(["--quick", "--out", str(tmp_path), "--budget_s", "5"])
  assert len(calls) == 1, out.getvalue()  # --quick has two flag sets: default, cmdbuf
  assert "| cmdbuf | (skipped: out of --budget_s)" in out.getvalue()


def test_learner_variant_that_fails_leaves_the_other(tmp_path_factory, monkeypatch):
  """The fused attention's Triton kernel has never been compiled on a GPU by this project: if
  it fails there, the LoRA and XLA variants still run, and each row is printed and written as
  it finishes (the shipped model, the variants' measurement stubbed); the headline reads the
  LoRA row and its weight sync."""
  tmp_path = tmp_path_factory.mktemp("out") / "learner"  # the stage's folder (the headline's)
  learner = _script("gpu_learner")
  seen = []
  error = "RuntimeError: Triton compilation failed"

  def variant(params, cfg, attention, args, batch, rank=0):
    seen.append((attention, rank))
    if attention == "fused" and not rank:
      raise RuntimeError("Triton compilation failed")
    # the failed variant's row is on disk before the next one starts
    assert json.load(open(tmp_path / "learner.json"))[0] == {"attention": "fused",
                                                              "error": error}
    out = {"attention": attention, "why": "XLA's reference attention", "logprobs_s": 0.5,
           "update_s": 2.0, "shapes": [], "_logp": [], "_masks": [], "remat": "none"}
    if rank:
      out.update(update_s=1.5, adapters=1000, sync_s=0.25, sync_compile_s=3.0,
                 sync_temp_layers=0.6, sync_plan_layers=1.25)
    return out

  monkeypatch.setattr(learner, "run_variant", variant)
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  assert learner.main(["--out", str(tmp_path), "--samples", "4", "--max_len", "128",
                       "--attention", "", "--lora_rank", "8"]) == 0
  assert seen == [("fused", 0), ("fused", 8), ("xla", 0)]
  rows = json.load(open(tmp_path / "learner.json"))
  assert rows[0] == {"attention": "fused", "error": error} and rows[2]["update_s"] == 2.0
  assert rows[1]["lora_rank"] == 8 and rows[1]["sync_s"] == 0.25
  assert f"| fused | fails: {error} ||||" in out.getvalue()
  assert "| fused, LoRA rank 8 | 0.500 | 1.500 |" in out.getvalue()
  assert "| xla | 0.500 | 2.000 |" in out.getvalue()
  assert "LoRA weight sync (merge + the rollout's layout, one program): 0.250 s" in out.getvalue()
  got = {f: v for f, v, _ in _script("gpu_headline").rows(str(tmp_path.parent))}
  assert got["learner step (packed update), attention fused, LoRA rank 8"] == (
      "update 1.500 s, log-probs 0.500 s"), got
  assert got["LoRA weight sync (rank 8): merge + rollout layout"] == (
      "0.250 s; working memory 0.60 layers in float32 (plan 1.25)"), got


def test_decode_flag_sets_parse_on_this_jaxlib():
  """Each XLA flag set the decode stage runs a process with is known to XLA: an unknown flag
  or value in XLA_FLAGS aborts the process at start-up (checked: a misspelled flag exits
  non-zero here too), which on the GPU would cost that set's cells. jaxlib's CPU build
  declares the GPU flags as well, so the CPU checks their spelling."""
  import subprocess
  decode = _script("gpu_decode")
  code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"
  sets = dict(decode.FLAG_SETS, misspelled="--xla_gpu_enable_command_bufer=FUSION")
  for name, flags in sets.items():
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert (got.returncode == 0) == (name != "misspelled"), (name, got.stderr[-500:])


def test_rl_speedup_compares_the_steps_both_modes_finished(tmp_path):
  """TLT on cut off after one step, off finished two: the headline compares step 1 with step
  1 (6.0 s against 6.0 s), not one step with two."""
  headline = _script("gpu_headline")
  slow = dict(_STEP, step=2, time=dict(_STEP["time"], total=30.0, rollout=20.0))
  _metrics(tmp_path, "on", json.dumps(_STEP) + "\n")
  _metrics(tmp_path, "off", json.dumps(_STEP) + "\n" + json.dumps(slow) + "\n")
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  key = next(f for f in rows if f.startswith("RL steps on one device ("))
  assert key.startswith("RL steps on one device (1 of"), key
  assert rows[key].startswith("speedup 1.00x (on 6.0 s, off 6.0 s;"), rows[key]


def test_attention_row_sets_the_simulators_price_beside_ours(tmp_path):
  """The learner stage's attention bench with its price from the simulator: the headline
  names both and their ratio (what attn_eff should be scaled by)."""
  headline = _script("gpu_headline")
  (tmp_path / "learner").mkdir()
  (tmp_path / "learner" / "attention.json").write_text(json.dumps(
      {"rows": 4, "t": 4096, "heads": 28, "kv_heads": 4, "head_dim": 128, "visited_blocks": 3,
       "causal_blocks": 12, "predicted_ms": 1.5,
       "results": [{"impl": "flash", "ms": 2.4}, {"impl": "xla", "ms": 24.0}]}))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  assert rows["packed attention fwd+bwd (4 x 4096 tokens, 28/4 heads of 128)"] == (
      "flash 2.40 ms, xla 24.00 ms, flash 10.00x of xla's speed, the simulator's price of "
      "flash 1.50 ms (predicted / measured 0.62); flash visits 3 of 12 causal blocks"), rows


def test_regime_rows_count_the_near_ties_of_differing_outputs(tmp_path):
  """bench_regime's greedy rows: an arm whose outputs differ carries its per-row divergences
  (tlt_jax/bench/divergence.py); the headline says how many are float32 near-ties. An arm
  with equal outputs, or a summary written before the field existed, reads as before."""
  headline = _script("gpu_headline")
  (tmp_path / "bench_regime").mkdir()
  row = {"speedup": 1.5, "decode_speedup": 1.8, "accept": 2.5}
  why = [{"row": 2, "position": 37, "near_tie": True}, {"row": 3, "position": 5,
                                                        "near_tie": False}]
  (tmp_path / "bench_regime" / "summary.json").write_text(json.dumps(
      {"batch 1, greedy, default task (EOS)": {
          "plain": dict(row, same=True), "SD 6_1_7": dict(row, same=False, divergence=why),
          "SD 3_1_4": dict(row, same=True, divergence=None),
          "SD 4_1_5": dict(row, same=False, divergence=[{"error": "XlaRuntimeError: OOM"}])},
       "batch 8, greedy, default task (EOS)": {"SD 3_1_4": dict(row, same=True)}}))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  assert rows["SD vs plain, batch 1 greedy, SD 6_1_7"].endswith(
      "outputs = plain: False (near-ties: 1 of 2 differing rows)"), rows
  assert rows["SD vs plain, batch 1 greedy, SD 4_1_5"].endswith(
      "outputs = plain: False (divergence check failed)"), rows
  for key in ("SD vs plain, batch 1 greedy, SD 3_1_4", "SD vs plain, batch 8 greedy, SD 3_1_4"):
    assert rows[key] == ("1.50x end to end, 1.80x decode-only, 2.50 tokens/verification, "
                         "outputs = plain: True"), rows


def test_rl_tail_share_is_of_the_steps_compared(tmp_path):
  """The tail's share of TLT off's rollout is averaged over the steps both modes finished
  (0.4 in step 1), not over a step TLT on never reached (0.9)."""
  headline = _script("gpu_headline")
  late = dict(_STEP, step=2, rollout_tail={"time_share": 0.9})
  _metrics(tmp_path, "on", json.dumps(_STEP) + "\n")
  _metrics(tmp_path, "off", json.dumps(_STEP) + "\n" + json.dumps(late) + "\n")
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  value = next(v for f, v in rows.items() if f.startswith("RL steps on one device ("))
  assert value.endswith("the tail's share of the rollout, TLT off: 40%)"), value


def test_rl_mismatch_row_averages_the_steps_both_modes_updated(tmp_path):
  """The rollout's distance from the learner, per mode, over the steps both finished (TLT off's
  third step left out), a step that did not update (no loss metrics) not counted; in the
  per-phase table too, with a mode whose runs never updated as nan."""
  headline = _script("gpu_headline")
  loss = lambda k3, dp: {"loss": {"rollout_k3": k3, "rollout_prob_diff": dp}}  # noqa: E731
  on = [dict(_STEP, **loss(2e-4, 1e-3)), dict(_STEP, step=2, loss={}),
        dict(_STEP, step=3, **loss(4e-4, 3e-3))]
  off = [dict(_STEP, **loss(1e-5, 2e-4)), dict(_STEP, step=2, **loss(3e-5, 4e-4)),
         dict(_STEP, step=3, **loss(5e-5, 6e-4)), dict(_STEP, step=4, **loss(9.0, 9.0))]
  _metrics(tmp_path, "on", "".join(json.dumps(r) + "\n" for r in on))
  _metrics(tmp_path, "off", "".join(json.dumps(r) + "\n" for r in off))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  value = next(v for f, v in rows.items() if f.startswith("the rollout's distribution"))
  assert value == "3.0e-04 / 3.0e-05; 2.0e-03 / 4.0e-04", value
  table = headline.rl_table(str(tmp_path))
  assert "| 3.0e-04 / 2.0e-03 | 2.3e+00 / 2.3e+00 |" in table, table  # (each its own steps)
  _metrics(tmp_path / "old", "on", json.dumps(_STEP) + "\n")
  _metrics(tmp_path / "old", "off", json.dumps(_STEP) + "\n")
  assert "| nan / nan | nan / nan |" in headline.rl_table(str(tmp_path / "old"))


def test_decode_row_sets_the_engines_paged_step_against_the_windows(tmp_path):
  """The engine's cells (fused + paged) against the windows' at the same batch: 2.0 ms
  against 3.0 ms is paged 1.50x faster (> 1: paged faster), with the engine's own parity
  against XLA's attention (the windows' cell has none); a batch without an engine cell
  has no row."""
  headline = _script("gpu_headline")
  (tmp_path / "decode").mkdir()
  cell = lambda code, b, s, parity: {"code": code, "batch": b, "step_s": s, "fraction": 0.5,
                                     "paged_parity": parity}
  (tmp_path / "decode" / "gpu_decode.json").write_text(json.dumps({"flag_sets": {"default": {
      "cells": [cell("engine profile", 1, 0.002, 3e-3), cell("windows", 1, 0.003, None),
                cell("windows", 8, 0.004, None)]}}}))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  assert rows["paged attention (the engine's), batch 1: step vs the windows"] == (
      "1.50x (2.00 vs 3.00 ms; > 1: paged faster), largest difference from XLA's attention "
      "3.0e-03"), rows
  assert not any("batch 8: step vs the windows" in f for f in rows), rows


def test_attention_bench_prices_ours_at_the_query_heads(tmp_path, monkeypatch):
  """gpu_learner's attention bench on an H200 (its profile faked here, the bench's timing too)
  writes the simulator's price of the fused kernel: 3 forwards of 4 FLOPs a causal pair per
  query head and head dim (not per kv head) at attn_eff of the profile's matmul rate."""
  import types

  import numpy as np
  from tlt_jax.bench import packed_attention
  from tlt_jax.plan import cost
  from tlt_jax.plan.learner import Learner
  learner = _script("gpu_learner")
  hw = cost.profile("h200")
  monkeypatch.setattr(learner, "device_profile", lambda: hw)
  fake = {"rows": 2, "t": 256, "heads": 8, "kv_heads": 2, "head_dim": 32,
          "results": [{"impl": "flash", "ms": 1.0}]}
  monkeypatch.setattr(packed_attention, "bench", lambda *a, **k: dict(fake))
  monkeypatch.setattr(packed_attention, "table", lambda res: "")
  learner.attention_bench(types.SimpleNamespace(attention="2,256,8,2,32", dtype="float32",
                                                steps=1, out=str(tmp_path)))
  got = json.load(open(tmp_path / "attention.json"))
  seg = packed_attention.bench_segments(2, 256)
  pairs = sum(int(n) * (int(n) + 1) // 2 for row in seg
              for n in np.unique(row, return_counts=True)[1])
  assert got["pairs"] == pairs
  want = 3 * 4 * pairs * 8 * 32 / (hw.flops * Learner(gpus=1).attn_eff)
  assert got["predicted_ms"] == pytest.approx(1e3 * want, rel=1e-9)


def test_decode_compares_each_untuned_cell_with_its_tuned_twin(monkeypatch):
  """A `noautotune` cell compiles with xla_gpu_autotune_level 0 (with cuBLAS's option where
  asked) and is printed beside the cell of the same code and batch that autotuned, step and
  compile both; a cell with no tuned twin is not."""
  decode = _script("gpu_decode")
  assert decode.compiler_options(decode.parse_code("engine")) is None
  assert decode.compiler_options(decode.parse_code("engine noautotune spec 4_1_5")) == {
      "xla_gpu_autotune_level": 0}
  assert decode.compiler_options(decode.parse_code("engine cublas noautotune")) == {
      "xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
  cell = lambda code, b, step, comp: dict(code=code, batch=b, step_s=step, compile_s=comp)
  results = {"flag_sets": {"default": {"cells": [
      cell("engine profile", 1, 1.0e-3, 9.0), cell("engine spec 4_1_5", 1, 2.0e-3, 15.3),
      cell("engine noautotune", 1, 1.1e-3, 3.0),
      cell("engine noautotune spec 4_1_5", 1, 2.4e-3, 5.5),
      cell("engine noautotune", 8, 1.0, 1.0),  # no tuned cell at batch 8
      {"code": "engine cublas noautotune", "batch": 1, "error": "x"}]}}}
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  decode.autotuning(results)
  rows = [ln for ln in out.getvalue().splitlines() if ln.startswith("| engine")]
  assert rows == ["| engine | 1 | 1.000 / 1.100 | 9.0 / 3.0 |",
                  "| engine spec 4_1_5 | 1 | 2.000 / 2.400 | 15.3 / 5.5 |"], out.getvalue()


def test_the_main_jobs_device_memory_beside_the_plan(tmp_path):
  """The rl_steps stage's first step with memory statistics (a GPU's): a row per mode, each
  phase's peak so far with the memory plan's figure in brackets; a mode with none, no row."""
  headline = _script("gpu_headline")
  step = dict(_STEP, memory={"peak_gib": {"rollout": 61.25, "update": 70.5}, "limit_gib": 79.1,
                             "plan_gib": {"rollout": 58.0, "update": 66.0}})
  _metrics(tmp_path, "on", json.dumps(step) + "\n")
  _metrics(tmp_path, "off", json.dumps(_STEP) + "\n")
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  mem = [f for f in rows if f.startswith("device memory")]
  assert len(mem) == 1 and "TLT on" in mem[0], rows
  assert rows[mem[0]] == "rollout 61.2 (58.0), update 70.5 (66.0) GiB of 79.1"


def test_the_main_jobs_traced_step_says_how_busy_the_device_was(tmp_path):
  """A mode whose last step was traced (config.profile: its summary.json, a GPU's device
  plane here): a row with the busiest stream's busy share of the step's wall time and its top
  kernels; a mode without a trace, no row."""
  headline = _script("gpu_headline")
  _metrics(tmp_path, "on", json.dumps(_STEP) + "\n")
  _metrics(tmp_path, "off", json.dumps(_STEP) + "\n")
  d = tmp_path / "e2e" / "off" / "tb" / "plugins" / "profile" / "2026_12_05_07_00_00"
  d.mkdir(parents=True)
  (d / "summary.json").write_text(json.dumps({
      "wall_s": 0.5, "device_plane": True, "steps": [2, 2], "lines": [
          {"plane": "/device:GPU:0", "line": "XLA Ops", "events_per_step": 900.0,
           "busy_s_per_step": 0.28, "top": [["dot.1", 0.1, 10.0]]},
          {"plane": "/device:GPU:0", "line": "Stream #13(compute)", "events_per_step": 1200.0,
           "busy_s_per_step": 0.3, "top": [["gemm_fusion_1", 0.12, 20.0],
                                           ["loop_fusion", 0.05, 40.0]]}]}))
  rows = {f: v for f, v, _ in headline.rows(str(tmp_path))}
  traced = [f for f in rows if f.startswith("the main job's step")]
  assert traced == ["the main job's step 2 traced, TLT off: the busiest device stream's "
                    "busy / wall"], rows
  assert rows[traced[0]] == ("60% (0.30 of 0.50 s; Stream #13(compute): 1200 events; top: "
                             "gemm_fusion_1 0.12 s, loop_fusion 0.05 s)")
