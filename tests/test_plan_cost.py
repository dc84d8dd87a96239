"""The cost model (tlt_jax/plan/cost.py) against independent counts: the parameter layout
(`param_shapes`) and the memory plan's sharding rules for the bytes a forward reads, XLA's own
cost analysis of the project's forward for its FLOPs, and a profile recovered by `fit` from
timings that profile generated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import memory_phases
from tlt_jax.models import forward as model_forward
from tlt_jax.models import init_cache
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import param_shapes
from tlt_jax.plan import cost

CFGS = {
    "qwen2": ModelConfig(arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=352,
                         num_layers=3, num_heads=8, num_kv_heads=4, qkv_bias=True),
    "qwen3_tied": ModelConfig(arch="qwen3", vocab_size=512, hidden_size=128,
                              intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=64, qk_norm=True, tie_word_embeddings=True),
    "llama_bias": ModelConfig(arch="llama", vocab_size=384, hidden_size=96,
                              intermediate_size=256, num_layers=2, num_heads=6, num_kv_heads=3,
                              qkv_bias=True, o_bias=True),
    # a mixture of experts (models/moe.py): 16 experts, 2 a token; its decode steps gather the
    # experts a token uses, its wider forwards group the tokens per expert (ragged_dot)
    "qwen3_moe": ModelConfig(arch="qwen3_moe", vocab_size=512, hidden_size=128,
                             intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                             qk_norm=True, num_experts=16, experts_per_token=2,
                             moe_intermediate_size=64),
}


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_weights_read_are_the_layouts_per_device_params(name, tp):
  """Every parameter but the embedding table (gathered, unless it is the tied head) and the
  final norm, per device of a tp-way replica as the sharding rules split them."""
  cfg = CFGS[name]
  shapes = param_shapes(cfg)
  mesh = memory_phases.stand_in_mesh(tensor=tp)
  want = memory_phases.sharded_bytes({"layers": shapes["layers"]}, mesh, 1)
  want += memory_phases.sharded_bytes({"lm_head": (cfg.hidden_size, cfg.vocab_size)}, mesh, 1)
  got = cfg.num_layers * cost.layer_weights(cfg, tp) + cost.head_weights(cfg, tp)
  assert got == want


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("batch,tokens,kv_len",
                         [(1, 1, 256), (4, 5, 128), (8, 1, 512), (16, 9, 64)])
def test_flops_are_xlas(name, batch, tokens, kv_len):
  """The FLOPs of a decode/verification forward with a cache against XLA's cost analysis of
  the project's forward (which also counts elementwise work, norms, softmax, RoPE: within
  15%)."""
  cfg = CFGS[name]
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, kv_len))
  toks = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
  lowered = jax.jit(lambda p, t, c: model_forward(
      p, t, jnp.zeros(t.shape, jnp.int32), cfg=cfg, cache=c).logits).lower(params, toks, cache)
  analysis = lowered.compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  xla = float(analysis["flops"])
  ours = cost.forward(cfg, batch, tokens, kv_len).flops
  if cfg.moe:
    from tlt_jax.models import moe
    r, e, k = batch * tokens, cfg.num_experts, cfg.experts_per_token
    pair = 2.0 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_layers
    way = moe.path(r, cfg)
    # the cost model counts k experts a token (a GPU's grouped-matmul kernel); XLA:CPU's ways
    # run every expert on every token (a step of up to DENSE_TOKENS), or ragged_dot, lowered
    # densely (each pair masked into every expert's product: E x the pairs' FLOPs)
    ours += {moe._gathered: 0, moe._dense: r * (e - k) * pair,
             moe._grouped: r * k * (e - 1) * pair}[way]
  assert ours == pytest.approx(xla, rel=0.15), (ours, xla)


def test_a_7b_decode_step_on_h100_is_its_weights_over_bandwidth():
  """Batch 1, 1 token: bound by reading the weights (all but the gathered embedding table:
  14.1 GB in bf16 for Qwen2.5-7B) at the profile's bandwidth, plus its launches; a prefill
  of 8 x 1024 tokens is FLOP-bound."""
  from tlt_jax.models.config import num_params
  import json
  from tlt_jax.config import asset_path
  with open(asset_path("architectures", "qwen2.5-7b.json")) as f:
    cfg = ModelConfig.from_hf_dict(json.load(f), dtype="bfloat16")
  h100 = cost.PROFILES["h100"]
  step = cost.forward(cfg, 1, 1, 1024)
  weights = 2 * (num_params(cfg) - cfg.vocab_size * cfg.hidden_size)
  assert weights < step.bytes < 1.01 * weights  # + 59 MB of KV window
  bound = step.bytes / h100.mem_bw
  assert h100.seconds(step) == pytest.approx(bound + h100.fixed_s + 28 * h100.layer_s)
  pre = cost.prefill(cfg, 8, 1024)
  assert pre.flops / h100.flops > pre.bytes / h100.mem_bw


def test_fit_recovers_the_profile_that_made_the_timings():
  true = cost.Hardware("x", mem_bw=20e9, flops=300e9, link_bw=float("inf"), fixed_s=2e-4,
                       layer_s=3e-5)
  cfg = CFGS["qwen2"]
  costs = [cost.forward(cfg, b, t, kv, layers=layers)
           for b in (1, 4, 16, 64) for t in (1, 5, 64) for kv in (128, 1024)
           for layers in (1, 3)]
  rng = np.random.default_rng(0)
  seconds = [true.seconds(c) * (1 + 0.01 * rng.standard_normal()) for c in costs]
  got = cost.fit(costs, seconds)
  assert got.mem_bw == pytest.approx(true.mem_bw, rel=0.05)
  assert got.flops == pytest.approx(true.flops, rel=0.05)
  predicted = np.asarray([got.seconds(c) for c in costs])
  assert np.max(np.abs(predicted / np.asarray(seconds) - 1)) < 0.05


def test_shape_factors_price_what_one_rate_cannot(tmp_path):
  """A machine whose 1-token forwards lose efficiency with rows (XLA:CPU's: 0.6-0.7x at 4+
  rows) cannot be fitted by one rate and bandwidth; the factors calibrate keeps reproduce each
  measured forward, interpolate in log rows between them, price a speculative step as its
  parts, survive the profile's JSON, and leave a profile without them as it was."""
  import dataclasses
  import json
  from tlt_jax.plan.calibrate import shape_factors
  from tlt_jax.rollout.policies.strategy import Strategy
  cfg = CFGS["qwen2"]
  base = cost.Hardware("x", mem_bw=20e9, flops=300e9, link_bw=float("inf"), fixed_s=2e-4,
                       layer_s=3e-5)

  def efficiency(kind, rows, tokens):  # the "true" machine: slower 1-token forwards at 4+ rows
    return 1.0 if tokens > 1 or rows < 4 else 0.6 + 0.1 * (rows >= 16)

  def true_seconds(c):  # each forward's roofline at its own efficiency
    return sum(base.roofline(b, f) / efficiency(k, r, t) for k, r, t, b, f, _ in c.shapes) + (
        base.fixed_s + base.layer_s * c.layers)

  shapes = [("verify", b, t) for b in (1, 4, 16) for t in (1, 5)] + [
      ("drafter", b, t) for b in (1, 4, 16) for t in (1, 5)]
  comps = {}
  for kind, b, t in shapes:
    c = (cost.forward(cfg, b, t, 256) if kind == "verify" else cost.draft(cfg, b, t, 256))
    comps[(b, f"{kind} fwd T={t}")] = (c, true_seconds(c))
  fitted = cost.fit([c for c, _ in comps.values()], [s for _, s in comps.values()])
  plain = np.asarray([fitted.seconds(c) / s for c, s in comps.values()])
  assert np.max(np.abs(plain - 1)) > 0.15  # one rate cannot fit them all
  hw = dataclasses.replace(fitted, shape_factors=shape_factors(fitted, comps))
  for c, s in comps.values():
    assert hw.seconds(c) == pytest.approx(s, rel=1e-6)
  # between measured rows: the factor interpolated in log rows (8 rows: halfway from 4 to 16)
  f4, f16 = hw.factor("target", 4, 1), hw.factor("target", 16, 1)
  assert hw.factor("target", 8, 1) == pytest.approx((f4 + f16) / 2)
  assert hw.factor("target", 64, 1) == pytest.approx(f16)  # clamped past the last row count
  assert hw.factor("target", 1, 64) == 1.0 and hw.factor("prefill", 4, 1) == 1.0
  # a speculative step (verification + drafter forwards) at measured shapes: its parts' times
  step = cost.spec_step(cfg, Strategy("4_1_5"), 4, 256)
  terms = [hw.roofline(b, f) + hw.layer_s * n for _, _, _, b, f, n in step.shapes]
  parts = sum(w * hw.factor(k, r, t) for w, (k, r, t, *_) in zip(terms, step.shapes))
  whole = hw.roofline(step.bytes, step.flops) + hw.layer_s * step.layers
  assert hw.seconds(step) == pytest.approx(parts * whole / sum(terms) + hw.fixed_s, rel=1e-9)
  # the profile's JSON (bench_cost_model's cost_model.json) keeps them
  path = tmp_path / "cost_model.json"
  path.write_text(json.dumps({"hardware": dataclasses.asdict(hw)}))
  again = cost.profile(str(path))
  assert again.shape_factors == hw.shape_factors
  assert again.seconds(step) == pytest.approx(hw.seconds(step), rel=1e-12)
  # a profile without factors prices as the formula says
  c = cost.forward(cfg, 8, 1, 256)
  assert fitted.seconds(c) == pytest.approx(
      max(c.bytes / fitted.mem_bw, c.flops / fitted.flops) + fitted.fixed_s
      + fitted.layer_s * c.layers)


@pytest.mark.parametrize("name", ["qwen2", "qwen3_tied"])
@pytest.mark.parametrize("rows,t", [(8, 32), (2, 256)])
def test_learner_flops_are_xlas(name, rows, t):
  """One micro-batch of the learner's log-prob pass (grpo.token_logprobs: the forward over
  rows x t tokens, padding included, and the LM head's log-softmax) against XLA's cost
  analysis: learner.micro_flops within 15%. One layer: the learner's forward scans its layers, and
  XLA's analysis counts a loop's body once."""
  import dataclasses

  from tlt_jax.plan.learner import Micro, micro_flops
  from tlt_jax.rl import grpo
  cfg = dataclasses.replace(CFGS[name], num_layers=1)
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))
  toks = jax.ShapeDtypeStruct((rows, t), jnp.int32)
  lowered = jax.jit(lambda p, x: grpo.token_logprobs(p, x, cfg=cfg, temperature=1.0,
                                                     chunk=1024)[0]).lower(params, toks)
  analysis = lowered.compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  assert micro_flops(cfg, Micro.whole(rows, t)) == pytest.approx(float(analysis["flops"]),
                                                                 rel=0.15)
