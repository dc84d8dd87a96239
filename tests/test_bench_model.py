"""tlt_jax/bench/bench_model.py (scripts/make_bench_model.py's build): the widened, deepened
target and its drafter compute the shipped model's function. References: transformers on the
shipped checkpoint (logits, greedy generation), the shipped model and drafter through the
project's rollout engine (greedy tokens and accepted drafts), and the shipped drafter's
logits on the same inputs."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tlt_jax.bench import bench_model
from tlt_jax.bench import regime, roofline
from tlt_jax.drafter.model import drafter_forward, load_drafter
from tlt_jax.models import forward
from tlt_jax.models.hf_io import load_hf_model
from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "tlt_jax", "assets", "default")
SMALL = dict(hidden=256, heads=8, kv_heads=4, intermediate=1024, layers=6)
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench"))
  return out, bench_model.build(out, **SMALL)


@pytest.fixture(scope="module")
def prompts():
  tok = load_tokenizer(os.path.join(SHIPPED, "model"))
  with open(os.path.join(SHIPPED, "data", "test.jsonl")) as f:
    return [tok.encode(json.loads(line)["prompt"]) for line in f][:NUM_PROMPTS]


def test_layout_and_param_counts(bench):
  out, summary = bench
  assert sorted(os.listdir(out)) == ["bench_model.json", "drafter", "model"]
  for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
    assert os.path.exists(os.path.join(out, "model", f)), f
  cfg, params = load_hf_model(os.path.join(out, "model"))
  assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_,
          cfg.intermediate_size, cfg.num_layers) == (256, 8, 4, 32, 1024, 6)
  assert summary["target_params"] == sum(x.size for x in jax.tree.leaves(params))
  # Added layers compute (random q, gate) but add nothing (zero o, down).
  added = sorted(set(range(6)) - set(summary["bench"]["original_layer_slots"]))
  assert added
  for i in added:
    assert float(jnp.abs(params["layers"]["q"][i]).max()) > 0
    assert float(jnp.abs(params["layers"]["gate"][i]).max()) > 0
    assert not jnp.any(params["layers"]["o"][i]) and not jnp.any(params["layers"]["down"][i])


def test_transformers_logits_and_greedy_equal_shipped(bench, prompts):
  """transformers runs the bench checkpoint: logits within float rounding of the shipped
  model's, greedy generation identical token for token."""
  out, _ = bench
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32, attn_implementation="eager").eval()
  ref, wide = load(os.path.join(SHIPPED, "model")), load(os.path.join(out, "model"))
  worst = 0.0
  for ids in prompts:
    t = torch.tensor([ids])
    with torch.no_grad():
      lr, lw = ref(t).logits, wide(t).logits
      worst = max(worst, float((lr - lw).abs().max()))
      gen = [m.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                        max_new_tokens=40, pad_token_id=0)[0, len(ids):].tolist()
             for m in (ref, wide)]
    assert gen[0] == gen[1]
  print(f"\nmax |logit diff| bench vs shipped (transformers): {worst:.2e}")
  assert worst < 1e-4  # logits are O(10): ~1e-6 relative, summation order only


def _generate(model_dir, drafter_dir, prompts):
  cfg, params = load_hf_model(model_dir)
  dparams = load_drafter(drafter_dir, cfg)
  ecfg = EngineConfig(max_batch=4, buckets=(4,), chunk_size=8, max_prompt_len=48,
                      max_new_tokens=64, stop_tokens=stop_token_ids(model_dir),
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1,
                                      use_kernel=False))
  w = Engine(params, cfg, ecfg, drafter_params=dparams)
  results = w.generate([Request(ids, i) for i, ids in enumerate(prompts)],
                       SamplingParams(temperature=0.0))
  by_id = {r.request_id: r.response_ids.tolist() for r in results}
  return by_id, sum(m.accepted for m in w.chunk_log)


def test_engine_speculative_greedy_equals_shipped(bench, prompts):
  """The rollout engine with speculation: the same tokens and the same number of accepted
  drafts (the widened drafter drafts exactly what the shipped one does)."""
  out, _ = bench
  ref = _generate(os.path.join(SHIPPED, "model"), os.path.join(SHIPPED, "drafter"), prompts)
  wide = _generate(os.path.join(out, "model"), os.path.join(out, "drafter"), prompts)
  assert ref[1] > 0
  assert wide == ref


def test_drafter_logits_equal_shipped(bench, prompts):
  """On the same tokens and the shipped target's hidden states (zero-padded), the widened
  drafter's logits are the shipped drafter's and its output is theirs, zero-padded."""
  out, _ = bench
  cfg0, p0 = load_hf_model(os.path.join(SHIPPED, "model"))
  d0 = load_drafter(os.path.join(SHIPPED, "drafter"), cfg0)
  cfg, p = load_hf_model(os.path.join(out, "model"))
  d = load_drafter(os.path.join(out, "drafter"), cfg)
  ids = jnp.asarray([prompts[0]], jnp.int32)
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  hidden = forward(p0, ids, pos, cfg=cfg0, return_logits=False).hidden
  # EAGLE pairs: (x_{t+1}, f_t) at the position of x_t.
  g0, l0, _ = drafter_forward(d0, p0, ids[:, 1:], hidden[:, :-1], pos[:, :-1], cfg=cfg0)
  padded = jnp.pad(hidden[:, :-1], ((0, 0), (0, 0), (0, cfg.hidden_size - cfg0.hidden_size)))
  g, lg, _ = drafter_forward(d, p, ids[:, 1:], padded, pos[:, :-1], cfg=cfg)
  np.testing.assert_allclose(np.asarray(lg), np.asarray(l0), atol=1e-4, rtol=0)
  np.testing.assert_array_equal(np.argmax(lg, -1), np.argmax(l0, -1))
  np.testing.assert_allclose(np.asarray(g[..., :cfg0.hidden_size]), np.asarray(g0), atol=1e-5)
  assert not jnp.any(g[..., cfg0.hidden_size:])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2), (16, 8)])
def test_head_grouping_preserved(prompts, heads, kv_heads):
  """Any grouping with at least the shipped 2 query heads per kv head keeps the function
  (in memory: widen heads only, then the project's forward vs the shipped model)."""
  cfg0, p0 = load_hf_model(os.path.join(SHIPPED, "model"))
  cfg = bench_model.bench_config(cfg0, hidden=128, heads=heads, kv_heads=kv_heads,
                            intermediate=512, layers=4)
  p0_np = jax.tree.map(np.asarray, p0)
  p = jax.tree.map(jnp.asarray, bench_model.widen_target(p0_np, cfg0, cfg, 0))
  ids = jnp.asarray([prompts[1]], jnp.int32)
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  np.testing.assert_allclose(np.asarray(forward(p, ids, pos, cfg=cfg).logits),
                             np.asarray(forward(p0, ids, pos, cfg=cfg0).logits), atol=1e-5)


def test_deterministic(bench, tmp_path):
  out, _ = bench
  bench_model.build(str(tmp_path), **SMALL)
  for f in ("model/model.safetensors", "drafter/drafter.safetensors", "model/config.json"):
    assert filecmp.cmp(os.path.join(out, f), str(tmp_path / f), shallow=False), f


def test_user_errors(bench, tmp_path):
  out, _ = bench
  with pytest.raises(bench_model.BuildError, match="--overwrite"):
    bench_model.build(out, **SMALL)
  with pytest.raises(bench_model.BuildError, match="--heads 2 is smaller"):
    bench_model.build(str(tmp_path / "a"), heads=2)
  with pytest.raises(bench_model.BuildError, match="multiple of kv_heads"):
    bench_model.build(str(tmp_path / "b"), heads=6, kv_heads=4)
  with pytest.raises(bench_model.BuildError, match="no model/ directory"):
    bench_model.build(str(tmp_path / "c"), source=os.path.join(out, "model"))


def test_bench_regime_without_a_target_says_how_to_build_one(tmp_path):
  """tlt_jax/bench/regime.py on a missing target: one error naming the build command (its
  smoke run end to end is scripts/gpu_check.sh --smoke's regime stage: tests/test_gpu_check.py)."""
  with pytest.raises(regime.BenchMissing, match="make_bench_model.py --out"):
    regime.run(regime.RegimeArgs(bench=str(tmp_path / "missing")))


def test_roofline_byte_accounting(bench, prompts, tmp_path, capsys):
  """tlt_jax/bench/regime.py's roofline section (--only_roofline) on the small build: bytes a
  step moves counted independently (weights from the loaded param tree, KV from the config and
  the window the engine's doubling grid gives for the longest prompt + 32 decoded tokens)."""
  out, _ = bench
  n_prompts, tail_prompts, max_new = 3, 6, 40
  summary = regime.run(regime.RegimeArgs(bench=out, prompts=n_prompts, tail_prompts=tail_prompts,
                                         max_new_tokens=max_new, only_roofline=True,
                                         out=str(tmp_path)))
  assert "### roofline" in capsys.readouterr().out
  assert json.load(open(tmp_path / "summary.json"))["roofline"]["workloads"].keys() == {
      "batch 1, greedy", "batch 8, greedy", "batch 8, sampled", "long tail, sampled"}
  cfg, params = load_hf_model(os.path.join(out, "model"))
  assert cfg.tie_word_embeddings  # the LM head is the embedding table: read whole each step
  weights = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))  # float32
  kv_token = 2 * 6 * SMALL["kv_heads"] * (SMALL["hidden"] // SMALL["heads"]) * 4
  tok = load_tokenizer(os.path.join(SHIPPED, "model"))
  with open(os.path.join(SHIPPED, "data", "test.jsonl")) as f:
    lens = [len(tok.encode(json.loads(line)["prompt"])) for line in f]
  cache_len = -(-max(lens) // 16) * 16 + max_new
  bw = summary["roofline"]["copy_bandwidth"]
  assert bw > 1e8  # bytes/s: any memory system moves more than 100 MB/s
  for name, r in summary["roofline"]["workloads"].items():
    batch = 1 if name.startswith(("batch 1", "long tail")) else 8
    reach = max(lens[:tail_prompts if name.startswith("long") else n_prompts]) + 32
    window = next((16 * 2 ** k for k in range(20) if 16 * 2 ** k >= reach), None)
    window = cache_len if window >= cache_len else window
    assert (r["batch"], r["kv_len"]) == (batch, window), name
    assert r["weight_bytes"] == weights, name
    assert r["kv_bytes"] == batch * window * kv_token, name
    assert r["step_s"] > 0
    assert r["fraction"] == pytest.approx((weights + r["kv_bytes"]) / r["step_s"] / bw)
  # An untied model's embedding table is a gather of B rows, not a read of the table.
  untied = dict(params, lm_head=params["embed"].T)
  cfg_untied = dataclasses.replace(cfg, tie_word_embeddings=False)
  assert roofline.weight_bytes(untied, cfg_untied) == weights
