"""The cluster simulator (tlt_jax/plan): it runs the engine's own loop (a test fails if a
policy method is overridden), it schedules, pages, preempts and speculates chunk for chunk as
the real engine does on the same response lengths (and acceptance), its workloads draw what
they say, and the command plans the shipped recipes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tlt_jax.errors import ConfigError
from tlt_jax.plan import sim, sim_device, sim_engine, workload
from tlt_jax.plan.cost import PROFILES
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.policies.strategy import Strategy
from spec_helpers import SMALL, TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_simulator_runs_the_engines_loop():
  """Only the device seam is replaced: generate/_chunk/_page/_collect/_report/_reach (the
  Scheduler, the page policy, the gate, the selector, the window rule) are the engine's."""
  sim_engine._check_seam()
  from tlt_jax.rollout.compile_plan import CompilePlan
  for name in ("window", "_window_pays", "fits", "runs_wide", "choosable_pairs",
               "_wanted_pairs", "plain_ahead"):
    assert getattr(sim_device.SimCompilePlan, name) is getattr(CompilePlan, name), name


def _requests(n, seed=0):
  rng = np.random.RandomState(seed)
  return [Request(list(rng.randint(1, TINY.vocab_size, rng.randint(2, 12))), i // 2, i % 2)
          for i in range(n)]


def _key(r):
  return (r.request_id, r.sample_index)


def _trace(log):
  return [(m.bucket, m.live, m.tokens, m.steps, str(m.mode), m.accepted, m.verifications)
          for m in log]


class WrongIndex:
  """A history index whose drafts are always wrong (the true continuation shifted by one id):
  every verification accepts none and emits the target's token, as the simulator's
  acceptance of 1 token per verification."""

  def __init__(self, oracle):
    self.oracle, self.seqs = oracle, {}

  def begin(self, prompt_key, seq_key, prompt_ids):
    self.seqs[seq_key] = [int(t) for t in prompt_ids]

  def extend(self, seq_key, tokens):
    self.seqs[seq_key].extend(int(t) for t in tokens)

  def end(self, seq_key, keep):
    self.seqs.pop(seq_key)

  def stats(self):
    return {}

  def draft(self, seq_key, max_tokens, topk=1, max_nodes=None):
    from tlt_jax.rollout.sources.suffix_index import Draft
    seq, true = self.seqs[seq_key], self.oracle[seq_key]
    cont = list(true[len(seq):len(seq) + max_tokens])
    cont = [(int(t) + 1) % TINY.vocab_size for t in cont] + [0] * (max_tokens - len(cont))
    n = len(cont)
    return Draft(np.asarray(cont, np.int32), np.arange(-1, n - 1, dtype=np.int32),
                 np.ones((n,), np.float32))


@pytest.mark.parametrize("spec", [None, "hist_3", "2_1_3"],
                         ids=["plain", "history_arm", "drafter_arm"])
def test_the_simulator_decodes_chunk_for_chunk_as_the_engine(tiny, spec):
  """The real engine decodes 9 requests greedily (refill, compaction, a pool small enough to
  preempt rows; speculating from live <= 2 after 2 checks, with a history arm whose drafts are
  all wrong or the tiny random drafter, which gets none accepted either); the simulator, told
  each response's length (and no acceptance), runs the same
  chunks (bucket, live rows, tokens, steps, arm, accepted drafts, verifications), preempts as
  often and finishes the responses in the same order."""
  params, dparams = tiny
  reqs = _requests(9)
  sp = SamplingParams(temperature=0.0)
  base = EngineConfig(**SMALL)
  oracle = {_key(r): np.concatenate([r.prompt_ids, r.response_ids])
            for r in Engine(params, TINY, base).generate(reqs, sp)}
  stop = int(np.bincount(np.concatenate([o[-20:] for o in oracle.values()])).argmax())
  kw = dict(SMALL, stop_tokens=(stop,), page_size=4, kv_pages=13)
  if spec is None:
    ecfg = EngineConfig(**kw)
    real = Engine(params, TINY, ecfg)
  else:
    ecfg = EngineConfig(**kw, spec=SpecConfig(strategy=spec, bs_threshold=2, patience=2,
                                              use_kernel=False, background_compile=False))
    real = Engine(params, TINY, ecfg, drafter_params=dparams, history=WrongIndex(oracle))
  results = real.generate(reqs, sp)
  assert any(r.finish_reason == "stop" for r in results)
  assert any(r.finish_reason == "length" for r in results)
  assert real.preemptions > 0
  s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"],
                               acceptance=workload.Acceptance(default=1.0, history=1.0))
  s.lengths = {_key(r): len(r.response_ids) for r in results}
  got = s.generate(reqs, sp)
  if spec is not None:  # (the premise: speculation ran, nothing was accepted)
    assert sum(m.arm is not None for m in real.chunk_log) > 3
    assert sum(m.accepted for m in real.chunk_log) == 0
  assert _trace(s.chunk_log) == _trace(real.chunk_log)
  assert s.preemptions == real.preemptions
  assert [_key(r) for r in got] == [_key(r) for r in results]
  assert [r.finish_reason for r in got] == [r.finish_reason for r in results]
  assert s.now > 0 and s.busy["decode"] > 0


def test_paged_attention_compiles_one_window_and_reads_the_live_slots():
  """With EngineConfig.paged_attention the simulated engine, as the real one
  (tests/test_rollout.py), compiles one decode window per bucket, the whole cache, where the
  window grid compiles several; and a step is priced on the rows' live slots, so the same
  ragged responses decode in less simulated time than over their windows."""
  reqs = _requests(9)
  lengths = {_key(r): 3 + 7 * (i % 4) for i, r in enumerate(reqs)}  # 3 .. 24 tokens
  runs = {}
  for paged in (False, True):
    ecfg = EngineConfig(**dict(SMALL, prompt_bucket=4, paged_attention=paged))
    s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], acceptance=workload.Acceptance())
    s.lengths = dict(lengths)
    s.generate(reqs, SamplingParams(temperature=0.0))
    windows = {}
    for r in s.exes.records:
      if r.name == "decode":
        windows.setdefault(r.key.shapes[0], set()).add(r.key.variant[0])
    runs[paged] = (windows, s.busy["decode"], ecfg.cache_len)
  (grid, grid_s, cap), (one, paged_s, _) = runs[False], runs[True]
  assert all(w == {cap} for w in one.values()), one
  assert any(len(w) > 1 for w in grid.values()), grid
  assert 0 < paged_s < grid_s


def test_jitter_varies_each_chunks_time_around_its_price_and_not_what_it_decodes():
  """`jitter` (python -m tlt_jax.plan --jitter): each chunk's device time x a log-normal
  factor of mean 1 and that sigma, drawn apart from the acceptance's draws; the same requests
  decode in the same chunks, their decode time near the noiseless one."""
  reqs = _requests(9)
  lengths = {_key(r): 3 + 7 * (i % 4) for i, r in enumerate(reqs)}
  ecfg = EngineConfig(**dict(SMALL, prompt_bucket=4, paged_attention=True))
  runs = {}
  for sigma in (0.0, 0.3):
    s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], acceptance=workload.Acceptance(),
                             jitter=sigma)
    s.lengths = dict(lengths)
    s.generate(reqs, SamplingParams(temperature=0.0))
    runs[sigma] = s
  quiet, noisy = runs[0.0], runs[0.3]
  assert len(quiet.chunk_log) == len(noisy.chunk_log) > 3
  assert noisy.busy["decode"] != quiet.busy["decode"]
  assert noisy.busy["decode"] == pytest.approx(quiet.busy["decode"], rel=0.5)
  assert noisy.rng.random() == quiet.rng.random()  # (the acceptance's generator untouched)
  f = np.array([noisy._noise() for _ in range(40000)])
  assert f.mean() == pytest.approx(1.0, abs=0.01)
  assert np.log(f).std() == pytest.approx(0.3, abs=0.01)
  assert all(quiet._noise() == 1.0 for _ in range(3))


def test_acceptance_rate_and_draws():
  acc = workload.Acceptance(tpv=(("4_1_5", 3.1),), default=2.0, history=1.5)
  for arm, want in (("4_1_5", 3.1), ("2_1_3", 2.0), ("hist_4", 1.5), ("hyb_4", 2.0)):
    a, k = acc.rate_of(Strategy(arm)), Strategy(arm).steps
    assert sum(a ** j for j in range(k + 1)) == pytest.approx(want, rel=1e-6)
    draws = acc.draw(Strategy(arm), np.random.default_rng(0), (20000,)) + 1
    assert abs(draws.mean() - want) < 4 * draws.std() / np.sqrt(len(draws)), arm
    assert draws.min() >= 1 and draws.max() <= k + 1
  assert acc.tokens_per_verification(Strategy("off")) == 1.0
  assert workload.Acceptance(default=9.0).tokens_per_verification(Strategy("2_1_3")) == 3.0
  assert workload.acceptance("2.5").default == 2.5
  parsed = workload.acceptance("4_1_5=3.2,history=1.2")
  assert parsed.tokens_per_verification(Strategy("4_1_5")) == 3.2 and parsed.history == 1.2
  with pytest.raises(Exception, match="--acceptance"):
    workload.acceptance("4_x_5=3")


def _geometric_tpv(a: float, k: int) -> float:
  """A depth-k chain's expected tokens per verification, in float64 from the distribution of
  accepted drafts: P(j accepted) = a^j (1 - a) for j < k, a^k for k; plus the target's token."""
  a = np.float64(a)
  probs = np.array([a ** j * (1 - a) for j in range(k)] + [a ** k])
  assert probs.sum() == pytest.approx(1.0)
  return float((probs * (np.arange(k + 1) + 1)).sum())


def test_acceptance_from_one_per_draft_rate():
  # Not named, drafter arms share one per-draft rate: deeper chains deliver more tokens per
  # verification, shallower fewer, and the draws average to it.
  acc = workload.acceptance("rate=0.6,history=1.4")
  for arm in ("2_1_3", "3_1_4", "4_1_5", "6_1_7", "hyb_4", "4_2_8"):
    s = Strategy(arm)
    want = _geometric_tpv(0.6, s.steps)  # a tree priced as the chain of its depth
    assert acc.tokens_per_verification(s) == pytest.approx(want, rel=1e-9), arm
    draws = acc.draw(s, np.random.default_rng(1), (20000,)) + 1
    assert abs(draws.mean() - want) < 4 * draws.std() / np.sqrt(len(draws)), arm
  assert acc.tokens_per_verification(Strategy("hist_4")) == 1.4
  # A measured arm sets the rate of the ones not named; the default (nothing given) is a depth-4
  # chain at 3.0 tokens per verification.
  measured = workload.acceptance("4_1_5=3.4")
  a = measured.draft_rate()
  assert _geometric_tpv(a, 4) == pytest.approx(3.4, rel=1e-6)
  assert measured.tokens_per_verification(Strategy("2_1_3")) == pytest.approx(
      _geometric_tpv(a, 2), rel=1e-6)
  assert measured.tokens_per_verification(Strategy("2_1_3")) < 3.4 < (
      measured.tokens_per_verification(Strategy("6_1_7")))
  assert workload.acceptance("").tokens_per_verification(Strategy("4_1_5")) == pytest.approx(
      3.0, abs=0.01)
  assert workload.acceptance("").tokens_per_verification(Strategy("hist_4")) == 1.8
  # a flat default= keeps every drafter arm at the same tokens per verification
  flat = workload.acceptance("default=3.0")
  assert {flat.tokens_per_verification(Strategy(a)) for a in ("3_1_4", "6_1_7")} == {3.0}
  for bad in ("rate=0.7,default=3", "rate=1.5"):
    with pytest.raises(Exception, match="--acceptance"):
      workload.acceptance(bad)
  # a verification keeps at least the target's own token: less (or NaN) is one error, not a
  # value clamped to 1 without a word
  for bad, name in (("0.5", "default"), ("nan", "default"), ("4_1_5=0.9", "4_1_5"),
                    ("history=0", "history"), ("default=nan", "default")):
    with pytest.raises(ConfigError, match=rf"^--acceptance='{bad}': {name}=.*: tokens per "
                       r"verification are >= 1"):
      workload.acceptance(bad)


def test_acceptance_from_a_runs_metrics(tmp_path):
  # the drafter's chain at the mean of the last 5 steps that measured it; the other drafter arms
  # at its per-draft rate
  tpvs = [3.9, 3.5, 3.4, 3.3, 3.2, 3.1, 3.0]
  path = tmp_path / "metrics.jsonl"
  with open(path, "w") as f:
    f.write(json.dumps({"step": 0, "response_length": {"p50": 30}}) + "\n")
    for i, v in enumerate(tpvs, 1):
      f.write(json.dumps({"step": i, "drafter_acceptance": {
          "tokens_per_verify": v, "stderr": 0.05, "depth": 4, "length": 128}}) + "\n")
  acc = workload.acceptance(str(path))
  want = float(np.mean(tpvs[-5:]))
  assert acc.tokens_per_verification(Strategy("4_1_5")) == pytest.approx(want)
  a = acc.draft_rate()
  assert acc.tokens_per_verification(Strategy("6_1_7")) == pytest.approx(
      _geometric_tpv(a, 6), rel=1e-6)
  empty = tmp_path / "plain.jsonl"
  empty.write_text(json.dumps({"step": 0, "reward": 0.5}) + "\n")
  with pytest.raises(Exception, match="drafter_acceptance"):
    workload.acceptance(str(empty))
  with pytest.raises(Exception, match=r"^--acceptance='.*missing\.jsonl': no such file"):
    workload.acceptance(str(tmp_path / "missing.jsonl"))


def test_lengths_draw_what_they_say(tmp_path):
  rng = np.random.default_rng(0)
  body = workload.lengths("lognormal:median=1000,sigma=0.5")
  x = body.draw(20000, 100000, rng)
  assert abs(np.median(x) / 1000 - 1) < 0.03
  assert abs(np.log(x).std() - 0.5) < 0.02
  tail = workload.lengths("lognormal:median=1000,sigma=0.5,tail=0.1,alpha=1.5,tail_from=3000")
  y = tail.draw(20000, 8192, rng)
  assert y.max() == 8192 and 0.02 < (y == 8192).mean() < 0.06  # P(Pareto > 8192) x 0.1
  f = tmp_path / "lens.jsonl"
  f.write_text("\n".join(json.dumps({"length": n}) for n in (5, 7, 9)) + "\n")
  assert set(workload.lengths(str(f)).draw(100, 8, rng)) == {5, 7, 8}  # capped
  m = tmp_path / "metrics.jsonl"
  m.write_text(json.dumps({"step": 1, "reward": 0.5, "response_length": {
      "mean": 40, "p50": 30, "p90": 80, "max": 150}}) + "\n")
  z = workload.lengths(str(m)).draw(20000, 1000, rng)
  assert abs(np.median(z) - 30) < 2 and abs(np.quantile(z, 0.9) - 80) < 5 and z.max() <= 150
  for bad in ("lognormal:median=-1,sigma=1", "lognormal:mu=3", str(tmp_path / "nope")):
    with pytest.raises(Exception, match="--lengths"):
      workload.lengths(bad)


def test_spot_window_is_the_coordinators_rule():
  # 10 s idle, 3 s steps: 3 whole steps; the 4th in flight at the barrier is finished (2 s
  # past it) or dropped
  assert sim.spot_window(10.0, 3.0, "finish") == (4, 10.0, 2.0)
  assert sim.spot_window(10.0, 3.0, "drop") == (3, 10.0, 0.0)
  assert sim.spot_window(9.0, 3.0, "finish") == (3, 9.0, 0.0)
  assert sim.spot_window(0.0, 3.0, "finish") == (0, 0.0, 0.0)
  reqs = [Request([1], i) for i in range(7)]
  assert [[r.request_id for r in s] for s in sim.split(reqs, 3)] == [[0, 3, 6], [1, 4], [2, 5]]


def _plan(*args):
  return subprocess.run([sys.executable, "-m", "tlt_jax.plan", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_the_learner_is_priced_on_its_own_packing():
  """learner.Layout.shapes (what learner_phases prices) are the micro-batch shapes the learner's
  grpo.minibatches makes of the same samples with the same seed: partition, length buckets,
  rows per bucket under a token budget or a row count, padding rows included."""
  from types import SimpleNamespace

  from tlt_jax.plan.learner import Layout, Micro
  from tlt_jax.rl import batching
  from tlt_jax.rl.grpo import GRPOConfig
  lens = [int(n) for n in np.random.default_rng(0).integers(5, 368, 256)]
  samples = [batching.Sample(np.ones(3, np.int32), np.ones(n - 3, np.int32), 0.0) for n in lens]
  for tokens, rows, mult, one in ((2048, 64, 1, False), (0, 16, 1, False), (4096, 8, 4, False),
                                  (4096, 8, 4, True)):
    spec = SimpleNamespace(micro_batch=rows, pad_multiple=32, max_len=368,
                           micro_batch_tokens=tokens, row_multiple=mult, max_rows=one,
                           gcfg=GRPOConfig())
    real = batching.minibatches(samples, spec, 2, seed=7)
    got = Layout(rows, tokens, 32, 368, 2, row_multiple=mult, max_rows=one).shapes(lens, 7)
    assert [[(m.rows, m.t) for m in g] for g in got] == [[mb.tokens.shape for mb in g]
                                                          for g in real]
    assert [[Micro.of(mb.segment_ids) for mb in g] for g in real] == got
    # the pairs the fused attention computes: per row, l (l + 1) / 2 over each run of equal
    # segment ids in the real batch (its padding tail one run)
    runs = lambda row: np.diff(np.flatnonzero(np.diff(np.r_[-1, row, -2]))).tolist()
    assert [[m.pairs for m in g] for g in got] == [
        [sum(n * (n + 1) // 2 for row in mb.segment_ids for n in runs(row)) for mb in g]
        for g in real]


def test_a_whole_row_is_one_segment_of_causal_pairs():
  """Micro.whole (calibrate's rows): every (query, key <= query) pair of each row, counted."""
  from tlt_jax.plan.learner import Micro
  for rows, t in ((1, 1), (3, 32), (2, 368)):
    assert Micro.whole(rows, t) == (rows, t, rows * int(np.tril(np.ones((t, t))).sum()))


def test_the_attention_benchs_price_is_the_learners():
  """gpu_check sets `fused_attention_s` beside the kernel's measured time to calibrate
  attn_eff: it must be what learner_phases charges an update for those pairs. Two one-layer
  micro-batches that differ only in their causal pairs differ in the update by exactly it."""
  from tlt_jax.models import ModelConfig
  from tlt_jax.plan.learner import Learner, Micro, fused_attention_s, learner_phases
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=256, intermediate_size=512,
                    num_layers=1, num_heads=8, num_kv_heads=2, head_dim=32, dtype="bfloat16")
  hw, learner = PROFILES["h200"], Learner(gpus=1, remat="none")
  update = lambda pairs: learner_phases(cfg, hw, learner, [[Micro(2, 512, pairs)]],
                                        reference=False)["update"]
  got = update(300_000) - update(100_000)
  assert got == pytest.approx(fused_attention_s(8, 32, 200_000, hw, learner), rel=1e-9)
  assert got == pytest.approx(3 * 4 * 200_000 * 8 * 32 / (hw.flops * learner.attn_eff))


def test_ppo_epochs_are_priced_as_passes_and_the_first_minibatchs_old_log_probs():
  """grpo.ppo_epochs = E: the update is E passes (each micro-batch's forward and backward, each
  mini-batch's optimizer step and gathers: E x one pass); the old log-prob pass covers the
  first mini-batch too (on policy only when it steps once), by exactly its micro-batches'
  forward; the weight sync unchanged. The layout reads it from the config."""
  from tlt_jax import config as config_lib
  from tlt_jax.models import ModelConfig
  from tlt_jax.plan.learner import Layout, Learner, Micro, learner_phases
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=256, intermediate_size=512,
                    num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, dtype="bfloat16")
  hw, learner = PROFILES["h100"], Learner(gpus=8, remat="dots")
  shapes = [[Micro(2, 512, 60_000), Micro(4, 256, 50_000)], [Micro(3, 512, 70_000)]]
  phases = lambda e, s=shapes: learner_phases(cfg, hw, learner, s, reference=False,  # noqa
                                              epochs=e)
  one, three = phases(1), phases(3)
  assert three["update"] == pytest.approx(3 * one["update"], rel=1e-12)
  assert three["weight_sync"] == one["weight_sync"]
  first = phases(1, [[], *shapes])["logprobs"]  # an empty first: every real one's pass
  assert three["logprobs"] == pytest.approx(first, rel=1e-12) and first > one["logprobs"]
  c = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  assert Layout.of(c).epochs == 1
  c.grpo.ppo_epochs = 3
  assert Layout.of(c).epochs == 3


def test_lora_is_priced_without_the_weights_gradient():
  """LoRA (adapters > 0): the update's weight matmuls one pass fewer of the forward's (no
  weight gradient), two FSDP gathers a mini-batch instead of three (no gradient
  reduce-scatter), the optimizer over the adapters; the log-prob pass as before; the sync
  merges first. Worked out by hand from the same terms; the simulator reads model.lora."""
  from tlt_jax import config as config_lib
  from tlt_jax.models import ModelConfig
  from tlt_jax.plan import cost
  from tlt_jax.plan.learner import Learner, Micro, learner_phases, weight_flops
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=256, intermediate_size=512,
                    num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, dtype="bfloat16")
  hw, learner = PROFILES["h100"], Learner(gpus=8, remat="full")
  shapes = [[Micro(2, 512, 60_000), Micro(4, 256, 50_000)], [Micro(3, 512, 70_000)]]
  full = learner_phases(cfg, hw, learner, shapes, reference=True)
  lo = learner_phases(cfg, hw, learner, shapes, reference=True, adapters=1000)
  n = cost.forward(cfg, 1, 1, 0).flops / 2
  w = sum(weight_flops(cfg, m.rows, m.t) for mb in shapes for m in mb)
  gather = n * 2 * 7 / 8 / hw.link_bw
  saved = (w / (hw.flops * 8 * learner.train_eff) + 2 * gather
           + 2 * 16 * 2 * (n - 1000) / 8 / hw.mem_bw)
  assert full["update"] - lo["update"] == pytest.approx(saved, rel=1e-9)
  assert lo["logprobs"] == full["logprobs"]
  assert lo["weight_sync"] == pytest.approx(full["weight_sync"] + 2 * n * 2 / 8 / hw.mem_bw)
  from tlt_jax.models.lora import num_adapter_params
  from tlt_jax.plan.sim import Simulation
  from tlt_jax.plan.workload import Acceptance, Lengths
  from tlt_jax.runtime import model_config
  c = config_lib.load_config_file(os.path.join(ROOT, "configs", "qwen2_5_7b_math.py"))
  c.model.lora.rank = 8
  spec, m = config_lib.run_spec(c), model_config(c)
  sim = Simulation(spec.with_max_batch(16), m, hw, workers=1, tp=1, gpus=8,
                   lengths=Lengths("lognormal", 100.0, 0.5), acceptance=Acceptance(),
                   compile_s=0.0)
  assert sim.adapters == num_adapter_params(m, spec.lora) > 0


def test_plan_command_on_the_7b_recipe(tmp_path):
  """The 7B recipe on 8 simulated H100s: its memory plan's max_batch, both modes' phases,
  the files; speculation runs (gate open) and spends the idle windows training."""
  out = tmp_path / "plan"
  r = _plan("--config", "configs/qwen2_5_7b_math.py", "--hardware", "h100", "--steps", "2",
            "--out", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  # the recipe's memory plan as a run derives it (its correctness: test_memory.py)
  from tlt_jax import config as config_lib
  from tlt_jax import memory
  from tlt_jax.runtime import model_config
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "qwen2_5_7b_math.py"))
  mb, pages = memory.derive_max_batch(config_lib.run_spec(cfg), model_config(cfg))
  assert f"8 x h100, 8 rollout workers x tp 1, max_batch {mb}, {pages} KV pages" in r.stdout
  assert "| **step** |" in r.stdout and "TLT on vs off:" in r.stdout
  p = json.loads((out / "plan.json").read_text())
  on, off = p["on"][-1], p["off"][-1]
  assert on["phases"]["verification"] > 0 and off["phases"]["verification"] == 0
  assert on["spot"]["training_s"] > 0 and off["spot"]["training_s"] == 0
  assert on["phases"]["update"] == off["phases"]["update"]  # same lengths, same learner
  # executables by kind add up to the totals; TLT off compiles none of speculation's
  from tlt_jax.rollout.executables import SPECULATIVE
  per = p["executables"]["per_worker"]
  for m in ("on", "off"):
    kinds = per[m]["by_kind"]
    assert sum(k["executables"] for k in kinds.values()) == pytest.approx(per[m]["executables"],
                                                                          abs=0.1 * len(kinds))
    assert f"per worker by kind, TLT {m}: " in r.stdout
  assert "spec" in per["on"]["by_kind"] and not set(per["off"]["by_kind"]) & set(SPECULATIVE)
  assert (out / "timeline.png").stat().st_size > 0 and (out / "live_batch.png").exists()


def test_plan_command_takes_a_measured_profile(tmp_path):
  """--hardware FILE: a profile fitted by scripts/bench_cost_model.py (its cost_model.json)
  prices the default recipe on 2 simulated devices; a file that is not one is a one-line
  error."""
  import dataclasses
  fitted = dataclasses.replace(PROFILES["a100"], name="fitted", mem_bw=20e9, flops=40e9,
                               chunk_s=2e-3)
  f = tmp_path / "cost_model.json"
  f.write_text(json.dumps({"hardware": dataclasses.asdict(fitted), "rows": []}))
  r = _plan("--config", "configs/default.py", "--gpus", "2", "--steps", "1", "--hardware",
            str(f), "--out", str(tmp_path / "p"))
  assert r.returncode == 0, r.stderr[-2000:]
  p = json.loads((tmp_path / "p" / "plan.json").read_text())
  assert p["hardware"]["name"] == "fitted" and p["hardware"]["chunk_s"] == 2e-3
  assert p["on"][0]["phases"]["host"] > 0 and p["on"][0]["seconds"] > 0
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2]")
  r = _plan("--config", "configs/default.py", "--gpus", "2", "--hardware", str(bad))
  assert r.returncode == 2 and "is not a profile JSON" in r.stderr
  assert "Traceback" not in r.stderr


def test_plan_command_errors_are_one_line(tmp_path):
  (tmp_path / "a_file").write_text("")
  for args, needle in ((["--hardware", "tpu9"], "--hardware='tpu9': use one of"),
                       (["--lengths", "lognormal:mu=1"], "--lengths"),
                       (["--steps", "0"], "--steps=0"),
                       (["--signal", "1.5"], "--signal=1.5: must be in (0, 1]"),
                       (["--compile_s", "nan"], "--compile_s=nan: must be a finite number"),
                       (["--jitter", "-0.1"], "--jitter=-0.1: must be a finite number >= 0"),
                       (["--acceptance", "0.5"], "--acceptance='0.5': default=0.5: tokens per"),
                       (["--out", str(tmp_path / "a_file" / "p")],  # before the simulation
                        f"--out='{tmp_path / 'a_file' / 'p'}': cannot be made "
                        f"({tmp_path / 'a_file'} is a file)")):
    r = _plan("--config", "configs/default.py", "--gpus", "2", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr


class Prefers:
  """A selector whose bandit has learnt: it picks `prefer[live]` (for that many live rows,
  else `prefer[0]`) where it may, else the first arm it may pick."""

  def __init__(self, arms, prefer):
    self.arms = [Strategy(a) for a in arms]
    self.prefer = {b: Strategy(a) for b, a in prefer.items()}

  def select(self, batch_size, arms=None):
    arms = list(arms or self.arms)
    want = self.prefer.get(batch_size, self.prefer[0])
    return want if want in arms else arms[0]

  def learns(self, arm, batch_size):
    return True

  def update(self, arm, batch_size, reward):
    pass

  def values(self, batch_size):  # (nothing measured: the compile plan keeps the listed order)
    return {}


def test_with_a_gate_only_the_arms_chunks_ask_for_compile():
  """A worker with a gate (open: every bucket pays, every arm funded) and background
  compilation compiles each bucket's first arm ahead, and another only once a chunk's bandit
  asks for it, at the window its rows need; an arm no chunk asks for is never compiled, and
  the drafter's tracking compiles only where a tracked plain chunk ran (and the bucket under
  it). The arm asked for runs once compiled: no chunk waited for it."""
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  arms = ["3_1_4", "2_1_3", "4_1_5", "off"]
  kw = dict(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
            max_new_tokens=400, prompt_bucket=16)
  ecfg = EngineConfig(**kw, spec=SpecConfig(strategy="3_1_4", bs_threshold=8, patience=1,
                                            use_kernel=False, background_compile=True))
  bandit = bandit_config("eg", {1: arms})
  s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], bandit=bandit, compile_s=5e-4,
                           acceptance=workload.Acceptance(default=2.0, history=1.0))
  reqs = _requests(8)  # six short answers, two long ones: the batch spends its time at 2 rows
  s.lengths = {_key(r): 40 + 10 * i if i < 6 else 300 + 60 * (i - 6)
               for i, r in enumerate(reqs)}
  gate = SpecGate(GateConfig(gating=False))
  s.generate(reqs, SamplingParams(temperature=1.0),
             policies=PolicyCells(Prefers(arms, {0: "3_1_4", 2: "2_1_3"}), gate))
  spec = {(r.key.shapes[0], str(r.key.variant[0])) for r in s.exes.records
          if r.key.name == "spec"}
  assert {a for _, a in spec} == {"3_1_4", "2_1_3"}  # 4_1_5 and off: nobody asked
  assert {b for b, a in spec if a == "2_1_3"} == {2}
  ran = [(m.bucket, str(m.mode)) for m in s.chunk_log]
  assert (2, "2_1_3") in ran
  assert all(not m.compiled for m in s.chunk_log if m.mode != "plain")
  tracked = {r.key.shapes[0] for r in s.exes.records if r.key.name == "track"}
  plain = {m.bucket for m in s.chunk_log if m.mode == "plain"}
  assert plain and tracked == plain | {max([b for b in ecfg.buckets if b < p], default=p)
                                       for p in plain}


def _background_sim(compile_s, max_new_tokens=400, **ecfg):
  """A simulated worker of 8 rows in buckets 1-8, 3_1_4 compiled in the background at
  `compile_s` a compile (`ecfg`: more EngineConfig fields)."""
  ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=max_new_tokens, prompt_bucket=16, **ecfg,
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=8, patience=1,
                                      use_kernel=False, background_compile=True))
  return sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], compile_s=compile_s,
                              acceptance=workload.Acceptance(default=2.0))


def test_what_the_next_call_compiles_as_it_starts_compiles_on_the_compile_clock():
  """The simulator as the engine (CompilePlan.next_call): a call ending untracked whose next
  rollout's gate opens every bucket queues that call's arms, the drafter's prefill at its
  prefills' shapes and its tracking where it decoded plainly on the compile clock, so the
  next call, after the learner's phases, waits for none of them (each compile 2 s here, the
  drafter's 0.1 s) and speculates; where the next rollout opens nothing, that call compiles
  its `track_prompt` in its own time and decodes plainly while its arms compile (2 s: longer
  than the call)."""
  import dataclasses
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig

  def every(state, status, arms=()):
    return dataclasses.replace(state, at={
        b: dataclasses.replace(r, status=status, funded=frozenset(map(Strategy, arms)))
        for b, r in state.at.items()})
  paying = lambda state: every(state, "pays", ["3_1_4"])  # noqa: E731

  class Untracked(SpecGate):  # (this call may not speculate; the next rollout's gate set here)
    opens = False

    def may_speculate(self):
      return False

    def next_rollout(self):
      return SpecGate(paying(self.state) if self.opens else every(self.state, "declined"))

  def second_call_waits(opens):
    s = _background_sim(2.0)
    s.drafter_compile = 0.05
    reqs = _requests(8)
    s.lengths = {_key(r): 40 + 30 * i for i, r in enumerate(reqs)}
    gate = Untracked(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
    gate.opens = opens
    s.generate(reqs, SamplingParams(temperature=1.0), policies=PolicyCells(gate=gate))
    s.now += 600.0  # the learner's phases: the compile clock runs on
    waited, real = [], s._compile

    def compile_(key, scale=1.0):
      t = s.busy["compile"]
      real(key, scale)
      if s.busy["compile"] > t:
        waited.append(key.name)
    s._compile = compile_
    n = len(s.chunk_log)
    s.generate(reqs, SamplingParams(temperature=1.0),
               policies=PolicyCells(gate=SpecGate(paying(gate.state))))
    return waited, {str(c.mode) for c in s.chunk_log[n:]}
  waited, modes = second_call_waits(False)
  assert "track_prompt" in waited and modes == {"plain"}  # (its arms compiling all along)
  waited, modes = second_call_waits(True)
  assert not {"track", "track_prompt", "spec"} & set(waited) and "3_1_4" in modes


def test_a_probes_arm_compiles_between_rollouts_and_runs_once_its_first_rows_finish():
  """As a call ends, its worker, the next rollout's prober, queues the probe's arm (at 8
  rows) on the compile clock (`CompilePlan.next_call`), so the next call, after the
  learner's phases, waits for no compile; its batch at 8 decodes plainly while every row is
  live and probes once the first has finished (`placement.defers`: right after a prefill a
  verification over every row is nearer compute-bound than where the bucket's time is
  spent; measured from there, the 7B's bulk at a per-draft 0.5 was judged four rollouts
  late). Compiled only as the next call starts, the probe's arm (2 s here) would come after
  that call's end."""
  import dataclasses
  from tlt_jax.rollout.policies import probe
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig, GateState
  s = _background_sim(2.0)
  s.drafter_compile = 0.05
  reqs = _requests(8)
  s.lengths = {_key(r): 60 + 40 * i for i, r in enumerate(reqs)}
  g = GateState(GateConfig(min_chunks=2, lead="3_1_4", reprobe_every=0)).begin_rollout(
      0, {b: ["3_1_4"] for b in s.ecfg.buckets})
  g = g.put(1, dataclasses.replace(g.at[1], status="closed", funded=frozenset()))
  g = g.start_probe(8)._fund()
  for _ in range(3):  # plain decoding at 8 measured
    g = g.record(probe.Chunk(8, None, 0.01, 4, live=8))

  class Untracked(SpecGate):  # (this call compiles nothing speculative; the next probes 8)
    def begin_rollout(self, worker_id, choosable):
      pass

    def may_speculate(self):
      return False

    def arms(self, worker_id, bucket):
      return []

    def next_rollout(self):
      return SpecGate(g)

  sp = SamplingParams(temperature=1.0)
  s.generate(reqs, sp, policies=PolicyCells(gate=Untracked(g)))
  assert (sp, 8, "3_1_4") in s.compiles._due  # (queued as the call ended: nothing before)
  s.now += 600.0  # the learner's phases: the compile clock runs on
  n, compiling = len(s.chunk_log), s.busy["compile"]
  s.generate(reqs, sp, policies=PolicyCells(gate=SpecGate(g)))
  assert s.busy["compile"] == compiling
  at_8 = [m for m in s.chunk_log[n:] if m.bucket == 8]
  assert {str(m.mode) for m in at_8 if m.live == 8} == {"plain"}
  assert any(str(m.mode) == "3_1_4" for m in at_8)


def _tail_never_reached(compile_s):
  """A simulated worker (buckets 1-8, 3_1_4 compiled in the background, plain executables
  compiled ahead: `compile_ahead`) after a call whose 8 rows all ended at once: the plain
  executables it queued for its tail (buckets 4, 2, 1) still queued. -> (the engine, its
  sampling, its gate, each of those buckets' due time)."""
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  s = _background_sim(compile_s, 2000, compile_ahead=True, paged_attention=True)
  s.drafter_compile = compile_s / 10
  reqs = _requests(8)
  s.lengths = {_key(r): 8 for r in reqs}
  gate = SpecGate(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
  sp = SamplingParams(temperature=1.0)
  s.generate(reqs, sp, policies=PolicyCells(gate=gate))
  plain = {k.shapes[0]: t for k, t in s.exes.due.items() if k.name == "decode" and t > s.now}
  assert set(plain) == {1, 2, 4}, plain  # (queued for the tail; the call never compacted)
  return s, sp, gate, plain


def test_the_arms_a_call_starts_with_compile_before_the_plain_executables_queued_before():
  """The simulator as the engine (`CompilePlan.submit`): the plain executables a call queued
  ahead for its tail's buckets and never reached are still queued as the next call starts; a
  bucket that pays by then (another worker's probe) has its arm compiled right after the
  compile running, before them, and the batch speculates there. (Queued behind them, the
  simulator's 30B-A3B held its batch at 256 rows the whole rollout.)"""
  import dataclasses
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  compile_s = 0.01  # (a chunk here: ~0.5 ms)
  s, sp, gate, plain = _tail_never_reached(compile_s)
  paying = dataclasses.replace(gate.state, at={
      b: dataclasses.replace(r, status="pays", funded=frozenset({Strategy("3_1_4")}))
      for b, r in gate.state.at.items()})
  s.lengths = {k: 2000 for k in s.lengths}
  n = len(s.chunk_log)
  s.generate(_requests(8), sp, policies=PolicyCells(gate=SpecGate(paying)))
  assert s.compiles.arm_due(sp, 8, "3_1_4") == pytest.approx(min(plain.values()) + compile_s)
  assert "3_1_4" in {str(c.mode) for c in s.chunk_log[n:]}


def test_a_probes_arm_compiles_before_the_plain_executables_queued_and_those_under_it_after():
  """`CompilePlan.submit` with a bucket on probation on this worker: its arm (and switch-off
  there) right after the compile running, before the plain executables queued for a tail;
  the probe's arm at the closed buckets under it after them (queued before them, the 7B's
  prober at a per-draft 0.2 reached its tail's 2 rows with their plain executable not
  compiled: 30 s in the foreground)."""
  from tlt_jax.rollout.policies.cells import SpecGate

  class Probing(SpecGate):  # 8 on probation here, its arm at the closed buckets under it
    def arms(self, worker_id, bucket):
      return [Strategy("3_1_4")]

    def closes(self, bucket):
      return True

    def probes(self, bucket):
      return bucket == 8

  compile_s = 0.01
  s, sp, gate, plain = _tail_never_reached(compile_s)
  s.compiles.submit(s._plan(Probing(gate.state)), sp, 8)
  due = {b: s.compiles.arm_due(sp, b, "3_1_4") for b in (1, 2, 4, 8)}
  assert due[8] == pytest.approx(min(plain.values()) + compile_s)
  later = {k.shapes[0]: t for k, t in s.exes.due.items() if k.name == "decode"}
  assert min(due[b] for b in (1, 2, 4)) > max(later[b] for b in plain)


def test_a_bucket_opened_mid_call_compiles_from_the_batchs_bucket_down():
  """A tracked call whose gate opens every bucket mid-call (another worker's probe paid)
  once its batch has compacted to 2 rows' bucket, every request admitted: its compile thread
  takes the arms from that bucket down (`CompilePlan.submit(paying=True)` up to the batch's
  bucket: a batch only shrinks from there), not from the call's top (8: 30 s a compile the
  batch could not use in this call, the simulator's price), and the batch speculates."""
  import dataclasses
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  from tlt_jax.rollout.records import EngineHooks

  class Tracked(SpecGate):  # (a probe funded elsewhere: the call keeps the drafter's cache)
    def may_speculate(self):
      return True

  s = _background_sim(0.002, 2000, paged_attention=True)
  s.drafter_compile = 0.0002
  reqs = _requests(8)
  s.lengths = {_key(r): (2000 if i < 2 else 40) for i, r in enumerate(reqs)}
  gate = Tracked(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
  gate.begin_rollout(1, {b: ["3_1_4"] for b in s.ecfg.buckets})  # (worker 1 probes)
  opened = []

  def before_chunk():
    if not opened and s.chunk_log and s.chunk_log[-1].bucket == 2:
      opened.append(len(s.chunk_log))
      gate.state = dataclasses.replace(gate.state, at={
          b: dataclasses.replace(r, status="pays", funded=frozenset({Strategy("3_1_4")}))
          for b, r in gate.state.at.items()})
  during, next_call = [], s.compiles.next_call

  def ends(*args):  # (what the call queued; then what the next call starts with: next_call)
    during.extend(b for (_, b, _) in s.compiles._due)
    next_call(*args)
  s.compiles.next_call = ends
  s.generate(reqs, SamplingParams(temperature=1.0), policies=PolicyCells(gate=gate),
             hooks=EngineHooks(before_chunk=before_chunk))
  assert opened and set(during) == {1, 2}
  assert "3_1_4" in {str(c.mode) for c in s.chunk_log[opened[0]:]}


def _eight_rows_3_1_4():
  """A simulated worker of 8 rows in buckets 1-8, one arm (3_1_4) compiled in the background
  (0.02 s a compile), 2 tokens per verification."""
  from tlt_jax.rollout.policies.mab import bandit_config
  ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=400, prompt_bucket=16,
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=8, patience=1,
                                      use_kernel=False, background_compile=True))
  return sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"],
                              bandit=bandit_config("eg", {1: ["3_1_4"]}), compile_s=0.02,
                              acceptance=workload.Acceptance(default=2.0))


def test_a_probe_is_judged_in_the_rollout_it_is_placed_though_its_rows_finish_first():
  """The prober's batch at the bucket on probation does not compact below it before the
  probe there is judged, even where most of its rows finish before the probe's executable
  has compiled (the 7B recipe's 128-row bulk with paged attention compacted to 64 rows 3 s
  before its probe's executable was ready, and was judged a rollout later): the probe runs
  at 8 with the 3 rows left and pays within the call, and only then does the batch compact
  (once the arms under it are compiled: they follow the probe's switch-off)."""
  import dataclasses
  from tlt_jax.rollout.policies import probe
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, Selector, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig, GateState
  arms, buckets = ["3_1_4"], (1, 2, 4, 8)
  s = _eight_rows_3_1_4()
  reqs = _requests(8)
  s.lengths = {_key(r): 20 if i < 5 else 300 for i, r in enumerate(reqs)}  # 3 rows go on
  g = GateState(GateConfig(min_chunks=2)).begin_rollout(0, {b: arms for b in buckets})
  g = g.put(1, dataclasses.replace(g.at[1], status="closed", funded=frozenset()))
  g = g.start_probe(8)._fund()
  for _ in range(3):  # plain decoding at 8 measured (the first chunk a warm-up)
    g = g.record(probe.Chunk(8, None, 0.01, 4, live=8))
  gate = SpecGate(g)
  s.generate(reqs, SamplingParams(temperature=1.0),
             policies=PolicyCells(Selector(bandit_config("eg", {1: arms})), gate))
  assert [(d["bucket"], d["verdict"]) for d in gate.state.decisions] == [(8, "pays")]
  first_below = next(i for i, m in enumerate(s.chunk_log) if m.bucket < 8)
  at_8 = [m for m in s.chunk_log[:first_below] if m.mode != "plain"]
  assert len(at_8) >= 3 and all(m.live == 3 for m in at_8)  # a warm-up and min_chunks, ...


def _probe_at_8_nothing_accepted(arms, compile_s=0.4, queued=None):
  """A simulated 7B worker of 8 rows (300 tokens each but one of 20, which a probe waits for:
  `placement.defers`; buckets 1-8, compiles of `compile_s` in the background, no draft ever
  accepted) whose call runs a probe at 8 with `arms` (the lead 3_1_4 first; plain decoding
  there measured, 1 closed). queued: a list that gets
  (bucket, arm, time queued, due) of each speculative compile queued. -> (engine, gate)."""
  import dataclasses
  from tlt_jax.config import load_config_file
  from tlt_jax.rollout.policies import probe
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, Selector, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig, GateState
  from tlt_jax.runtime import model_config
  here = os.path.dirname(os.path.abspath(__file__))
  m7 = model_config(load_config_file(os.path.join(here, "..", "configs",
                                                  "qwen2_5_7b_math.py")))
  buckets = (1, 2, 4, 8)
  ecfg = EngineConfig(max_batch=8, buckets=buckets, chunk_size=4, max_prompt_len=16,
                      max_new_tokens=400, prompt_bucket=16,
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=8, patience=1,
                                      use_kernel=False, background_compile=True))
  s = sim_engine.SimEngine(m7, ecfg, PROFILES["h100"], bandit=bandit_config("eg", {1: arms}),
                           compile_s=compile_s, acceptance=workload.Acceptance(default=1.0))
  if queued is not None:
    queue = s.compiles._queue

    def record(key, scale=1.0, urgent=False):
      new = key not in s.exes and key not in s.exes.due
      due = queue(key, scale, urgent)
      if new and key.name == "spec":
        queued.append((key.shapes[0], str(key.variant[0]), s.now, due))
      return due
    s.compiles._queue = record
  reqs = _requests(8)
  s.lengths = {_key(r): 20 if i == 0 else 300 for i, r in enumerate(reqs)}
  g = GateState(GateConfig(min_chunks=2, lead="3_1_4")).begin_rollout(
      0, {b: arms for b in buckets})
  g = g.put(1, dataclasses.replace(g.at[1], status="closed", funded=frozenset()))
  g = g.start_probe(8)._fund()
  for _ in range(3):  # plain decoding at 8 measured: the simulator's 4-step chunk there
    g = g.record(probe.Chunk(8, None, 0.0245, 4, live=8))
  gate = SpecGate(g)
  s.generate(reqs, SamplingParams(temperature=1.0),
             policies=PolicyCells(Selector(bandit_config("eg", {1: arms})), gate))
  return s, gate


def test_a_probe_whose_lead_loses_decodes_plainly_while_the_widened_arm_compiles():
  """A probe at 8 rows on a 7B model where no draft is accepted: its lead (3_1_4) loses to
  plain decoding, its ceiling says the drafts fall short, so the probe widens to 2_1_3, which
  compiles only now. Switch-off was compiled right after the lead (before the lead at the
  buckets under the probe: `CompilePlan.leaves_at`), so once the lead is measured (a warm-up
  and min_chunks chunks) it gives way (gate.gives_way) and the batch decodes plainly until
  2_1_3 is compiled, then measures it, and the probe declines. (Before: the lead ran on until
  2_1_3 compiled, the 7B recipe's prober for 100 s at 0.65x of plain decoding.)"""
  s, gate = _probe_at_8_nothing_accepted(["3_1_4", "2_1_3"])
  spec = [(r.key.name, r.key.shapes[0], r.key.variant[:1]) for r in s.exes.records
          if r.key.name in ("spec", "switch_off")]
  assert spec[:3] == [("spec", 8, ("3_1_4",)), ("switch_off", 8, ()), ("spec", 4, ("3_1_4",))]
  runs = []  # (mode, chunks) in the order they ran
  for m in s.chunk_log:
    if runs and runs[-1][0] == str(m.mode):
      runs[-1][1] += 1
    else:
      runs.append([str(m.mode), 1])
  assert [r[0] for r in runs] == ["plain", "3_1_4", "plain", "2_1_3", "plain"], runs
  assert runs[1][1] == runs[3][1] == 3  # a warm-up and min_chunks each
  (d,) = gate.state.decisions
  assert (d["verdict"], d["reason"], d["best_arm"]) == ("declined", "acceptance", "2_1_3")


def test_a_probes_next_arm_compiles_before_the_arms_queued_under_the_probe():
  """A probe at 8 rows (a 7B, no draft accepted) widened to three arms: while the second
  (2_1_3) runs its chunks, the third (4_1_5) is wanted; what its verdict waits on is queued
  right after the compile running, before the lead's arms queued under the probe (4, 2, 1:
  `placement.below_probe`, not started), so the probe is judged within the call. (Queued
  behind them, the 7B recipe's probe at a per-draft 0.3 waited three rollouts for its third
  arm: the engine's `want(urgent=...)` on a bucket on probation.)"""
  arms, compile_s, queued = ["3_1_4", "2_1_3", "4_1_5"], 0.4, []
  s, gate = _probe_at_8_nothing_accepted(arms, compile_s, queued)
  when = {(b, a): (t, due) for b, a, t, due in queued}
  wanted, due = when[(8, "4_1_5")]
  under = [when[(b, "3_1_4")][1] for b in (1, 2, 4)]
  assert max(under) > wanted + compile_s  # (some of them not started when it was wanted)
  running = min(d for d in [*under, when[(8, "2_1_3")][1]] if d - compile_s <= wanted < d)
  assert due == pytest.approx(running + compile_s)
  (d,) = gate.state.decisions
  assert (d["verdict"], d["reason"]) == ("declined", "acceptance")
  assert {str(m.mode) for m in s.chunk_log if m.bucket == 8} >= set(arms)


def test_a_tracked_batch_waits_at_its_bucket_for_the_arm_queued_there():
  """A tracked batch that wants to speculate where its bucket's arm is queued but not
  compiled yet compacts only to buckets where it can speculate (`CompilePlan.coming`): the
  smaller buckets' arms compile after its own (largest first), so compacting would chase the
  compiles down (the 32B recipe's worker 2, rollout 2: each bucket's arm was ready 0.3-24 s
  after its batch had compacted below it, 128 rows down to 2, and the whole call ran plain).
  Here 5 of 8 rows finish before bucket 8's arm compiles: the batch stays at 8, switches on
  there, and decodes no plain chunk below it."""
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, Selector, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  arms = ["3_1_4"]
  s = _eight_rows_3_1_4()

  def call(seed, **kw):
    reqs = _requests(8, seed=seed)
    s.lengths = {_key(r): 20 if i < 5 else 300 for i, r in enumerate(reqs)}  # 3 rows go on
    n = len(s.chunk_log)
    s.generate(reqs, SamplingParams(temperature=1.0), **kw)
    return s.chunk_log[n:]

  call(1, speculate=False)  # (plain decoding's executables compiled: a warm worker)
  log = call(0, policies=PolicyCells(Selector(bandit_config("eg", {1: arms})),
                                     SpecGate(GateConfig(gating=False))))
  assert any(m.bucket == 8 and m.live == 3 and m.mode == "plain" for m in log)  # (it waited)
  first_spec = next(m for m in log if m.mode != "plain")  # (none before the fix)
  assert first_spec.bucket == 8 and first_spec.live == 3
  assert all(m.mode != "plain" for m in log if m.bucket < 8)


def test_a_chunk_waits_only_for_a_compile_that_has_started():
  """A chunk needing an executable the compile thread has queued behind a long compile (a
  tracked plain chunk's drafter tracking behind a 30 s arm: a 10 s stall in the 32B
  recipe's trace) compiles it itself, as the engine's executable cache does, and what was
  queued after it moves up; one whose compile has started waits for what is left of it."""
  from tlt_jax.rollout.policies.strategy import Strategy
  s = _eight_rows_3_1_4()
  s.compile_s = 30.0
  plan, d = s.compiles, 30.0 * s.drafter_compile  # (a drafter-only executable's seconds)
  arm = lambda b: sim_device.exe_key("spec", b, Strategy("3_1_4"), 400)  # noqa: E731
  track = lambda b: sim_device.exe_key("track", b)  # noqa: E731
  assert plan._queue(arm(8)) == 30.0  # (running from 0 s)
  assert plan._queue(track(8), s.drafter_compile, urgent=True) == pytest.approx(30 + d)
  assert plan._queue(arm(4)) == pytest.approx(60 + d)
  s._compile(track(8), s.drafter_compile)  # not started: compiled here
  assert s.now == pytest.approx(d) and s.busy["compile"] == pytest.approx(d)
  assert track(8) in s.exes and s.exes.due == {arm(8): 30.0, arm(4): pytest.approx(60.0)}
  assert [r.key for r in s.exes.records].count(track(8)) == 1
  assert plan._queue(track(4), s.drafter_compile, urgent=True) == pytest.approx(30 + d)
  s.now = 30 + d / 4  # its compile started at 30 s: the chunk waits for the rest
  s._compile(track(4), s.drafter_compile)
  assert s.now == pytest.approx(30 + d) and s.busy["compile"] == pytest.approx(d + 3 * d / 4)


def test_a_jobs_workers_compile_a_program_once_and_load_it_from_each_other():
  """Workers of one job (sim_device.SimShare; sharing.compile_once within a process,
  exchange.py across processes): a program another worker has
  started compiling is loaded once that compile ends (load_s later) and takes nothing of this
  worker's compile clock, so what it queues next starts at once; a worker that starts a
  program before the worker that queued it earlier reaches it takes it over (that worker's
  queue moves up by a compile and it loads); a chunk needing a program another worker is
  compiling waits for that compile and the load, not for a compile of its own. Times by hand
  on the simulated clock (30-s compiles, 1-s loads); a worker outside the job compiles."""
  arm = lambda b: sim_device.exe_key("spec", b, Strategy("3_1_4"), 400)  # noqa: E731
  a, b, c = (_eight_rows_3_1_4() for _ in range(3))
  host = sim_device.SimShare(load_s=1.0)
  for w in (a, b):
    w.compile_s = 30.0
    w.compiles.share = host
    host.plans.append(w.compiles)
  c.compile_s = 30.0
  assert a.compiles._queue(arm(8)) == 30.0
  b.now = 5.0
  assert b.compiles._queue(arm(8)) == 31.0  # (a's compile, then the load)
  assert b.compiles._queue(arm(4)) == 35.0  # (b's thread was free)
  assert [r.ported for r in b.exes.records] == [True, False]
  assert c.compiles._queue(arm(8)) == 30.0  # (another job: its own compile)
  assert b.compiles._queue(arm(2)) == 65.0  # (queued behind arm 4: starts at 35)
  assert b.compiles._queue(arm(1)) == 95.0
  a.now = 10.0
  assert a.compiles._queue(arm(2)) == 60.0  # (a starts it at 30, before b would at 35)
  assert b.exes.due[arm(2)] == 61.0 and b.exes.due[arm(1)] == 65.0  # (b's queue moved up)
  b.now = 40.0
  b._compile(arm(2))  # a's compile started at 30: the chunk waits for it and the load
  assert b.now == 61.0 and b.busy["compile"] == 21.0
  b._compile(arm(16))  # nobody has it: compiled here
  assert b.now == 91.0


def test_workers_on_different_hosts_load_each_others_compiles():
  """The 70B recipe's layout, one worker of tp 8 a host: the simulation puts every worker of
  the job in one share (exchange.py loads across processes), so the second host's worker
  loads the program the first compiles (its compile, then the load: 1/30 of a compile)."""
  from tlt_jax import config as config_lib
  from tlt_jax.plan.sim import LOAD_SHARE, Simulation
  from tlt_jax.plan.workload import Acceptance, Lengths
  from tlt_jax.runtime import model_config
  c = config_lib.load_config_file(os.path.join(ROOT, "configs", "llama3_3_70b_math.py"))
  spec, m = config_lib.run_spec(c), model_config(c)
  sim = Simulation(spec.with_max_batch(16), m, PROFILES["h100"], workers=2, tp=8, gpus=16,
                   lengths=Lengths("lognormal", 100.0, 0.5), acceptance=Acceptance(),
                   compile_s=30.0)
  key = sim_device.exe_key("spec", 8, Strategy("3_1_4"), 400)
  first, second = (e.compiles for e in sim.engines)
  assert first._queue(key) == 30.0
  assert second._queue(key) == pytest.approx(30.0 * (1 + LOAD_SHARE))
  assert [r.ported for r in sim.engines[1].exes.records] == [True]


def test_plain_executables_compiled_ahead_on_the_compile_clock():
  """rollout.compile_ahead (rollout/plain_ahead.py, the engine's own `plain_ahead`): the
  first plain chunk queues the buckets below it on the compile clock, largest first, and a
  tail that outlasts their compiles finds them compiled: the same chunks, each bucket's
  executable compiled once, the chunks' own compiles down from 5 (the prefill and a decode
  per bucket reached) to 2 (the prefill, the first bucket's decode). 8 rows of a 7B model,
  compiles 0.5 s: 4 rows end at 300 tokens (~1.7 s of decoding at 8 rows), 3 more by 400."""
  from tlt_jax.config import load_config_file
  from tlt_jax.runtime import model_config
  m7 = model_config(load_config_file(os.path.join(ROOT, "configs", "qwen2_5_7b_math.py")))

  def run(ahead):
    ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
                        max_new_tokens=400, prompt_bucket=16, compile_ahead=ahead)
    s = sim_engine.SimEngine(m7, ecfg, PROFILES["h100"], compile_s=0.5)
    reqs = _requests(8)
    s.lengths = {_key(r): n for r, n in zip(reqs, [300] * 4 + [340] * 2 + [380, 400])}
    s.generate(reqs, SamplingParams(temperature=1.0))
    return s

  ahead, each = run(True), run(False)
  assert _trace(ahead.chunk_log) == _trace(each.chunk_log)
  assert {m.bucket for m in each.chunk_log} == {1, 2, 4, 8}
  decodes = lambda s: sorted(r.key.shapes[0] for r in s.exes.records  # noqa: E731
                             if r.key.name == "decode")
  assert decodes(ahead) == decodes(each) == [1, 2, 4, 8]
  assert each.busy["compile"] == pytest.approx(5 * 0.5)
  assert ahead.busy["compile"] == pytest.approx(2 * 0.5)
  assert each.now - ahead.now == pytest.approx(3 * 0.5)


def test_arms_compile_ahead_only_at_buckets_the_call_can_reach():
  """No batch of a call needs a bucket above its request count's (at most max_batch): its
  compile-ahead stops at that bucket (the compile thread's first 30 s went to an arm at 216
  rows for a worker holding 128, `python -m tlt_jax.plan`); a later call with more rows
  compiles the larger buckets then."""
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  arms = ["3_1_4", "2_1_3"]
  ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=40, prompt_bucket=16,
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=8, patience=1,
                                      use_kernel=False, background_compile=True))
  s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], bandit=bandit_config("eg", {1: arms}),
                           compile_s=5e-4, acceptance=workload.Acceptance(default=2.0))
  gate = SpecGate(GateConfig(gating=False))

  def buckets(reqs):
    s.lengths = {_key(r): 20 for r in reqs}
    s.generate(reqs, SamplingParams(temperature=1.0),
               policies=PolicyCells(Prefers(arms, {0: "3_1_4"}), gate))
    return {r.key.shapes[0] for r in s.exes.records if r.key.name == "spec"}

  assert buckets(_requests(3)) == {1, 2, 4}  # 3 rows: bucket 4 at most
  assert buckets(_requests(8, seed=1)) == {1, 2, 4, 8}


def test_a_buckets_first_arm_is_one_the_bandit_picks_at_its_size():
  """An engine bucket spans the bandit's size bounds (bucket 4 of buckets 1, 4 holds 2-4 live
  rows; the bandit lists 4_1_5 for 1-2 rows, 3_1_4 from 3). Its arm compiled ahead is one
  the bandit lists at the bucket's own size, so a batch of 3-4 rows there runs it and not
  "off" (the 7B plan, paged attention: 363 chunks of plain decoding in the speculative state,
  waiting for its listed arm's compile)."""
  from tlt_jax.rollout.policies.mab import bandit_config
  from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  ecfg = EngineConfig(max_batch=4, buckets=(1, 4), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=60, prompt_bucket=16,
                      spec=SpecConfig(strategy="2_1_3", bs_threshold=4, patience=1,
                                      use_kernel=False, background_compile=True))
  bandit = bandit_config("beg", {1: ["4_1_5", "off"], 3: ["3_1_4", "off"]})
  s = sim_engine.SimEngine(TINY, ecfg, PROFILES["h100"], bandit=bandit, compile_s=5e-4,
                           acceptance=workload.Acceptance(default=2.0))
  reqs = _requests(4)
  s.lengths = {_key(r): 60 for r in reqs}
  s.generate(reqs, SamplingParams(temperature=1.0),
             policies=PolicyCells(Prefers(["3_1_4", "4_1_5", "off"], {0: "3_1_4"}),
                                  SpecGate(GateConfig(gating=False))))
  first = next(r.key.variant[0] for r in s.exes.records
               if r.key.name == "spec" and r.key.shapes[0] == 4)
  assert str(first) == "3_1_4"
  # (plainly while it compiles, then speculating with it)
  ran = {str(m.mode) for m in s.chunk_log if m.bucket == 4 and m.live >= 3} - {"plain"}
  assert ran == {"3_1_4"}, ran


def _compile_plan(background=True):
  """A compile plan (engine buckets 1-8, speculation up to 4 live rows, the lead 2_1_3,
  attention windows of 16, 32 and the whole cache, 56 slots) and a bandit listing 4_1_5 /
  2_1_3 for 1-2 live rows, 3_1_4 for 3-4 and 4_1_5 from 5."""
  from tlt_jax.rollout.compile_plan import CompilePlan
  from tlt_jax.rollout.policies.mab import bandit_config
  ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=40, prompt_bucket=16, paged_attention=False,
                      spec=SpecConfig(strategy="2_1_3", bs_threshold=4, patience=1,
                                      use_kernel=False, background_compile=background))
  bandit = bandit_config("beg", {1: ["4_1_5", "2_1_3", "off"], 3: ["3_1_4", "off"],
                                 5: ["4_1_5", "off"]})
  return CompilePlan(TINY, ecfg, None, None), bandit


def test_compile_order_is_each_buckets_lead_then_its_listed_arms_largest_bucket_first():
  """compile_order by hand: round by round (each bucket's first arm, then second, ...),
  largest bucket first; within a bucket the lead (2_1_3) first, then the arms the bandit lists
  at the bucket's largest live size (speculation stops at 4 rows: bucket 8 holds at most 4,
  where 3_1_4 is listed, not 4_1_5)."""
  plan, bandit = _compile_plan()
  pairs = {1: [Strategy("off"), Strategy("2_1_3")], 4: [Strategy("3_1_4"), Strategy("2_1_3")],
           8: [Strategy("4_1_5"), Strategy("3_1_4")]}
  assert plan.compile_order(pairs, bandit) == [(8, "3_1_4"), (4, "2_1_3"), (1, "2_1_3"),
                                               (8, "4_1_5"), (4, "3_1_4"), (1, "off")]
  # the speculative state's catch-up room holds the deepest arm the bandit may run (4_1_5),
  # not only the lead's 2 drafts
  import types
  assert plan.max_steps(types.SimpleNamespace(bandit=bandit)) == 4


def test_a_buckets_arms_compile_fastest_measured_first():
  """What the call's bandit measured ranks a bucket's arms (`_ranked`): at the bucket's
  largest live size, measured arms fastest first (tokens/s per row: the median of each
  one's rewards), then the unmeasured ones as before (the lead first), "off" last; a bucket
  whose size nothing measured keeps the lead first. (Lead first whatever was measured, the
  7B recipe at a per-draft 0.3 compiled at 128 rows the one arm measured losing to plain
  decoding there, and ran it alone: the rollout 0.97x of TLT off's.)"""
  from tlt_jax.rollout.policies.cells import Selector
  plan, bandit = _compile_plan()
  sel = Selector(bandit)
  for reward in (50.0, 52.0, 48.0):  # at 1-2 live rows: 4_1_5 measured, slower than 2_1_3
    sel.update(Strategy("4_1_5"), 2, reward)
    sel.update(Strategy("2_1_3"), 2, reward + 30.0)
  sel.update(Strategy("3_1_4"), 4, 60.0)  # at 3-4 rows: 3_1_4 (the lead 2_1_3 not listed)
  pairs = {1: [Strategy(a) for a in ("off", "4_1_5", "2_1_3")],
           2: [Strategy(a) for a in ("4_1_5", "2_1_3")],
           4: [Strategy(a) for a in ("2_1_3", "3_1_4")]}
  assert plan.compile_order(pairs, bandit) == [(4, "2_1_3"), (2, "2_1_3"), (1, "2_1_3"),
                                               (4, "3_1_4"), (2, "4_1_5"), (1, "4_1_5"),
                                               (1, "off")]
  assert plan.compile_order(pairs, bandit, sel)[:3] == [(4, "3_1_4"), (2, "2_1_3"),
                                                         (1, "2_1_3")]
  for reward in (90.0, 95.0, 99.0, 100.0):  # 4_1_5 now the faster: its median 50 -> 90
    sel.update(Strategy("4_1_5"), 1, reward)  # (2_1_3's 80)
  order = plan.compile_order(pairs, bandit, sel)
  assert order == [(4, "3_1_4"), (2, "4_1_5"), (1, "4_1_5"), (4, "2_1_3"), (2, "2_1_3"),
                   (1, "2_1_3"), (1, "off")]


def test_a_buckets_first_arm_reranked_by_measurement_waits_behind_the_others_first():
  """`CompilePlan.submit`: the buckets that pay compile their first arm urgent (right after
  the compile running) as a call starts; once the bandit has measured another arm faster at
  a bucket whose first arm is queued, that one is queued too, but after what is queued (the
  7B recipe at a per-draft 0.5: a re-ranked arm at 16 rows went before the bulk's arm at 128
  and held that batch a compile longer)."""
  import dataclasses
  from tlt_jax.rollout.policies.cells import Selector, SpecGate
  from tlt_jax.rollout.policies.mab import bandit_config
  compile_s = 0.01
  s, sp, gate, plain = _tail_never_reached(compile_s)
  arms = frozenset({Strategy("3_1_4"), Strategy("2_1_3")})
  paying = SpecGate(dataclasses.replace(gate.state, at={
      b: dataclasses.replace(r, status="pays", funded=arms) for b, r in gate.state.at.items()},
      arms_at={b: [Strategy("3_1_4"), Strategy("2_1_3")] for b in gate.state.at}))
  s.bandit = bandit_config("eg", {1: ["3_1_4", "2_1_3"]})
  sel = Selector(s.bandit)
  s.compiles.submit(s._plan(paying, sel), sp, 8, paying=True)
  first = {b: s.compiles.arm_due(sp, b, "3_1_4") for b in (1, 2, 4, 8)}
  # urgent: right after the compile running (a plain one), before the plain ones queued
  assert first[8] == pytest.approx(min(plain.values()) + compile_s)
  queued = [t for k, t in s.exes.due.items() if k.name == "decode" and t > first[8]]
  assert len(queued) == 2 and min(queued) > max(first.values())
  for _ in range(3):
    sel.update(Strategy("3_1_4"), 8, 50.0)
    sel.update(Strategy("2_1_3"), 8, 70.0)
  s.compiles.submit(s._plan(paying, sel), sp, 8, paying=True)
  later = {k.shapes[0]: t for k, t in s.exes.due.items() if k.name == "decode"}
  assert s.compiles.arm_due(sp, 8, "2_1_3") > max(later.values())
  assert {b: s.compiles.arm_due(sp, b, "3_1_4") for b in (1, 2, 4, 8)} == first


def test_a_bucket_is_ready_to_speculate_once_an_arm_wanted_there_is_compiled():
  """ready / compacts_to with background compilation: a bucket whose bandit arms are wanted
  is not ready (nor may a speculating batch compact to it) until one is compiled; one where
  none is wanted (8: above the 4 rows speculation runs at) is; without background
  compilation every bucket the gate allows is, and none it does not (probation at 1, its
  plain decoding not measured yet; 2 closed)."""
  import types
  from tlt_jax.rollout.policies.cells import SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  plan, bandit = _compile_plan()
  call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=None)
  sp = SamplingParams(temperature=1.0)
  assert not plan.ready(call, sp, 4) and not plan.compacts_to(call, sp, 4)
  assert plan.ready(call, sp, 8)
  # a batch at 4 waits there for an arm queued there (`coming`), not for one never queued
  assert not plan.coming(call, sp, 4)
  plan._submitted[sp] = {(4, Strategy("3_1_4"))}
  assert plan.coming(call, sp, 4) and not plan.coming(call, sp, 8)
  plan._ready[sp] = {(4, Strategy("3_1_4"))}
  assert plan.ready(call, sp, 4) and plan.compacts_to(call, sp, 4)
  plan, _ = _compile_plan(background=False)
  gate = SpecGate(GateConfig(lead="2_1_3"))
  gate.begin_rollout(0, plan.choosable_pairs(call))
  call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=gate)
  assert gate.state.status == {1: "probing", 2: "closed", 4: "closed"}
  assert not any(plan.compacts_to(call, sp, b) or plan.ready(call, sp, b) for b in (1, 2, 4))
  assert plan.compacts_to(types.SimpleNamespace(worker_id=0, bandit=bandit, gate=None), sp, 2)


def test_the_prober_holds_its_batch_only_for_a_probe_queued_there():
  """The prober's tracked batch at the bucket on probation stays there until the probe is
  judged (`compaction`: no bucket) only while the probe's executable there is queued or
  compiled: a probe placed during the call is compiled from the next call's start, and held
  for it the batch would decode the call out at that size for nothing."""
  import types
  plan, bandit = _compile_plan()
  sp = SamplingParams(temperature=1.0)

  class Prober:  # bucket 4 on probation (3_1_4), its probe not judged yet
    holds = staticmethod(lambda worker_id, b, ready=None: b == 4)
    gives_way = staticmethod(lambda b, arm: False)
    allows = staticmethod(lambda worker_id, b: True)
    arms = staticmethod(lambda worker_id, b: [Strategy("3_1_4")] if b == 4 else [])

  call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=Prober())
  rule = lambda **kw: plan.compaction(call, sp, 4, started=False, **kw)  # noqa: E731
  assert rule(tracked=True, wants=True) is None  # nothing queued at 4: compacts freely
  plan._submitted[sp] = {(4, Strategy("3_1_4"))}
  held = rule(tracked=True, wants=False)
  assert held is not None and not any(map(held, (1, 2)))
  assert rule(tracked=False, wants=False) is None  # (an untracked call cannot speculate)


def test_a_probe_defers_while_an_eighth_of_its_buckets_rows_are_still_to_finish():
  """`placement.defers`: at a bucket on probation the batch decodes plainly while more than
  7/8 of the bucket's rows are live (8 rows: all; 128: over 112), never below 8 rows (a
  bucket of 1-4 rows probes at once), nor where the bucket pays or without gating."""
  import dataclasses
  from tlt_jax.rollout.policies import placement
  from tlt_jax.rollout.policies.gate import GateConfig, GateState
  buckets = (1, 2, 4, 8, 128)
  g = GateState(GateConfig()).begin_rollout(0, {b: ["3_1_4"] for b in buckets})
  for b in buckets:
    g = g.start_probe(b)
  assert [placement.defers(g, 1, 1), placement.defers(g, 4, 4)] == [False, False]
  assert [placement.defers(g, 8, 8), placement.defers(g, 8, 7)] == [True, False]
  assert [placement.defers(g, 128, 113), placement.defers(g, 128, 112)] == [True, False]
  paid = g.put(128, dataclasses.replace(g.at[128], status="pays"))
  assert not placement.defers(paid, 128, 128)
  off = GateState(GateConfig(gating=False)).begin_rollout(0, {128: ["3_1_4"]})
  assert not placement.defers(off, 128, 128)


def test_a_speculating_batch_leaves_only_where_it_cannot_compact_speculating():
  """Readiness.leaves: a batch speculating at 4 whose rows fit bucket 1 switches off to
  compact when the gate says plain decoding there beats it (`gate.leaves`) and nothing lets
  it compact speculating (an arm compiled at 1 or 2, `compacts_to`, or queued there,
  `coming`), not while a probe holds it, not where its rows need its own bucket, not without
  a gate; once switched off, its tracked batch waiting on an arm queued at 4 compacts freely
  (`compaction`: any)."""
  import types
  plan, bandit = _compile_plan()
  sp = SamplingParams(temperature=1.0)
  asked = []

  class Gate:  # every bucket open, with the bandit's arms there
    holding = False
    holds = lambda self, worker_id, b, ready=None: self.holding  # noqa: E731
    gives_way = staticmethod(lambda b, arm: False)
    allows = staticmethod(lambda worker_id, b: True)
    arms = staticmethod(lambda worker_id, b: [Strategy("3_1_4"), Strategy("2_1_3")])
    leaves = lambda self, b, to: asked.append((b, to)) or True  # noqa: E731

  gate = Gate()
  call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=gate)
  assert plan.leaves(call, sp, 4, 1) and asked == [(4, 1)]
  assert not plan.leaves(call, sp, 4, 3) and not plan.leaves(call, sp, 2, 2)  # (their own)
  gate.holding = True
  assert not plan.leaves(call, sp, 4, 1)
  gate.holding = False
  plan._submitted[sp] = {(4, Strategy("3_1_4"))}
  assert plan.leaves(call, sp, 4, 1)
  rule = plan.compaction(call, sp, 4, started=False, tracked=True, wants=True, live=1)
  assert rule is None  # (switched off: any bucket)
  kept = plan.compaction(call, sp, 4, started=False, tracked=True, wants=True, live=3)
  assert kept is not None and not kept(1)  # (rows at their own bucket: waits on 4's arm)
  plan._submitted[sp].add((2, Strategy("2_1_3")))
  assert not plan.leaves(call, sp, 4, 1)  # an arm queued at 2: it waits for that one
  plan._ready[sp] = {(2, Strategy("2_1_3"))}
  assert not plan.leaves(call, sp, 4, 1)  # it compacts to 2 speculating instead
  assert not plan.leaves(types.SimpleNamespace(worker_id=0, bandit=bandit, gate=None), sp, 4, 1)


def test_the_window_rule_prices_the_bytes_a_narrower_window_saves_per_rollout():
  """A decode step reads the weights and, per row, its window's KV slots of the target's
  layers and the drafter's one (K and V). _window_pays asks the gate with the chunks that
  needed the window per generate call (6 over 3 calls) and the share of a step's bytes at the
  wider window the narrower one does not read; a chunk at its rows' own window runs whatever
  the arm's tokens per verification."""
  import types
  import jax.numpy as jnp
  plan, bandit = _compile_plan()
  arm = Strategy("3_1_4")
  asked = []
  gate = types.SimpleNamespace(
      repays_window=lambda *a: asked.append(a) or True,
      runs_wide=lambda b, a, extra: False)  # (an arm whose drafts are all rejected)
  call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=gate, drafter_params=None,
                               params={"w": np.zeros((10, 3), np.float32)})
  slot = (TINY.num_layers + 1) * 2 * TINY.num_kv_heads * TINY.head_dim_ \
      * jnp.dtype(TINY.compute_dtype).itemsize
  assert plan.step_bytes(call, 4, 32) == 120 + 4 * 32 * slot
  plan._needs[(4, arm, 32)] = 6
  plan.rollouts = 3
  assert plan._window_pays(call, 4, arm, 32, 64)
  (b, a, per_rollout, share), = asked
  assert (b, a, per_rollout) == (4, arm, 2.0)
  assert share == pytest.approx(4 * 32 * slot / (120 + 4 * 64 * slot))
  assert plan.runs_wide(call, 4, arm, 32, 32) and not plan.runs_wide(call, 4, arm, 64, 32)


def test_a_narrower_window_is_run_only_where_the_gate_says_it_repays():
  """window(): rows needing 20 slots want the 32-slot window; only the whole cache's is
  compiled for the arm. With a gate whose payoff rule says the narrower window does not repay
  its compile, the chunk runs at the whole cache; where it repays, at 32 (compiled as it
  runs: no background compilation here)."""
  import types
  plan, bandit = _compile_plan()
  top, arm = plan.ecfg.cache_len, Strategy("3_1_4")
  assert plan.ecfg.window_for(20) == 32 < top
  plan._abstract = lambda state: state
  plan._compiled_window = lambda call, sp, arm, abstract, want: top
  plan._bytes = (1000, 10)
  state = types.SimpleNamespace(batch_size=4)
  for repays, want in ((False, top), (True, 32)):
    gate = types.SimpleNamespace(repays_window=lambda *a, r=repays: r)
    call = types.SimpleNamespace(worker_id=0, bandit=bandit, gate=gate)
    assert plan.window(call, SamplingParams(temperature=1.0), arm, state, 20) == want


def test_dynamic_sampling_rolls_out_until_enough_groups_carry_signal(tmp_path):
  """grpo.filter_groups in the simulator (train.py's rule), TLT off, every response 40 tokens:
  with every group carrying signal one rollout and the step as without the filter; with 30%
  of them (drawn per group) more rollouts, each as long as the first (the step's rollout phase
  their sum), the learner priced as without the filter where num_prompts groups train, and at
  most max_rollouts."""
  from tlt_jax import config as config_lib
  from tlt_jax.plan import report
  f = tmp_path / "lens.jsonl"
  f.write_text(json.dumps({"length": 40}) + "\n")
  lengths, acc = workload.lengths(str(f)), workload.acceptance("")

  def plan(steps, signal=1.0, **grpo):
    cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
    cfg.grpo.num_prompts = 8
    cfg.grpo.update(grpo)
    return report.plan(cfg, hardware="h100", gpus=2, lengths=lengths, acceptance=acc,
                       steps=steps, signal=signal).off

  base = plan(1)[0]
  every = plan(1, filter_groups=True)[0]
  assert (every.rollouts, every.groups) == (1, 8) and every.phases == base.phases
  few = plan(4, signal=0.3, filter_groups=True, max_rollouts=4)
  assert max(s.rollouts for s in few) > 1 and all(1 <= s.rollouts <= 4 for s in few)
  for s in few:
    assert s.phases["rollout"] == pytest.approx(s.rollouts * base.phases["rollout"], rel=1e-9)
    assert len(s.lengths) == s.rollouts * 8 * 8
    assert s.groups <= 8 and (s.groups == 8 or s.rollouts == 4)
    if s.groups == 8:
      assert s.phases["update"] == pytest.approx(base.phases["update"], rel=1e-9)
    assert len(s.timeline.get("rollouts", [0.0])) == s.rollouts  # (concatenated)
    # each rollout begins where the one before it ended (one after another on the step's clock)
    assert s.timeline.get("rollouts", [0.0]) == pytest.approx(
        [i * base.phases["rollout"] for i in range(s.rollouts)], rel=1e-9, abs=1e-9)
  wide = plan(2, signal=0.3, filter_groups=True, max_rollouts=4, gen_prompts=16)
  for s in wide:  # (a rollout draws grpo.gen_prompts prompts)
    assert len(s.lengths) == s.rollouts * 16 * 8 and s.groups <= 8


def test_dynamic_sampling_with_tlt_prices_every_rollouts_drafter_wait(tmp_path):
  """grpo.filter_groups with TLT on: the step's drafter phase (its wait past each rollout's
  barrier) is the sum over its rollouts, as the concatenated timeline's critical path is."""
  from tlt_jax import config as config_lib
  from tlt_jax.plan import report
  f = tmp_path / "lens.jsonl"
  f.write_text("".join(json.dumps({"length": n}) + "\n" for n in (40, 200, 900)))
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.num_prompts = 8
  cfg.grpo.update({"filter_groups": True, "max_rollouts": 4})
  steps = report.plan(cfg, hardware="h100", gpus=2, lengths=workload.lengths(str(f)),
                      acceptance=workload.acceptance(""), steps=4, signal=0.3).on
  assert any(s.rollouts > 1 and s.spot["critical_path_s"] > 0 for s in steps)
  for s in steps:
    assert s.phases["drafter"] == pytest.approx(s.spot["critical_path_s"], rel=1e-6, abs=1e-12)


def test_the_fused_attention_price_matches_the_h200_measurement():
  """attn_eff is calibrated: the attention bench's case (Qwen2.5-7B's 28 heads of 128, 4 rows
  of 4096 tokens of long-tailed responses, one layer's forward + backward) measured 2.42 ms
  for our kernel on one H200 (docs/gpu.md, 2026-12-04); the simulator's price of it is within
  5% of that."""
  from tlt_jax.bench.packed_attention import bench_segments
  from tlt_jax.plan.learner import Learner, Micro, fused_attention_s
  pairs = Micro.of(bench_segments(4, 4096)).pairs
  got = fused_attention_s(28, 128, pairs, PROFILES["h200"], Learner(gpus=1))
  assert got == pytest.approx(2.42e-3, rel=0.05)


def test_simulated_workers_take_their_chunks_in_the_order_of_their_clocks():
  """`turns.run`: workers whose chunks take different simulated times run them in one global
  time order (the earliest clock first, the lower worker on a tie), as a run's workers
  decode side by side, each call starting in worker order; a worker that raises ends the
  run with its error once the others are done, and nobody waits forever."""
  import threading
  from tlt_jax.plan import turns
  steps = {0: [3.0, 3.0, 3.0], 1: [1.0, 5.0, 0.5, 0.5], 2: [2.0, 2.0, 2.0, 2.0, 2.0]}
  now = {i: 10.0 for i in steps}
  log, starts = [], []

  def call(i):
    def body(before_chunk):
      starts.append(i)
      for dt in steps[i]:
        before_chunk()
        log.append((now[i], i, threading.current_thread().name))
        now[i] += dt
    return body
  turns.run([call(i) for i in steps], [lambda i=i: now[i] for i in steps], 10.0)
  assert starts == [0, 1, 2]
  expected = sorted((t, i) for i, dts in steps.items()
                    for t in 10.0 + np.concatenate([[0.0], np.cumsum(dts)[:-1]]))
  assert [(t, i) for t, i, _ in log] == expected
  assert {n for _, _, n in log} == {f"simulated-worker-{i}" for i in steps}

  def fails(before_chunk):
    before_chunk()
    raise ValueError("worker 1 fails")
  done = []
  with pytest.raises(ValueError, match="worker 1 fails"):
    turns.run([lambda b: (b(), done.append(0)), fails, lambda b: (b(), b(), done.append(2))],
              [lambda: 0.0] * 3, 0.0)
  assert sorted(done) == [0, 2]
