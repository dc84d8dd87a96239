"""Mixture-of-experts targets (Qwen3-MoE, models/moe.py) against transformers'
Qwen3MoeForCausalLM: logits, gradients, the cache path, the checkpoint both ways; both ways of
computing the experts against a float64 numpy reference; the experts sharded over 8 devices;
the rollout engine's greedy decoding (plain and speculative, a dense drafter) against
transformers' generate."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from tlt_jax.drafter.model import drafter_param_shapes, export_eagle, init_drafter
from tlt_jax.models import forward, init_cache, lora, moe, param_shapes
from tlt_jax.models.config import DTYPE_BYTES
from tlt_jax.models.hf_io import CheckpointFormatError, load_hf_model, save_hf_model
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import make_mesh, tree_shardings
from jax.sharding import PartitionSpec as P

VOCAB = 96
TOL = 1e-4  # float32 against float32: a mapping or routing bug is O(1)
_fwd = jax.jit(forward, static_argnames=("cfg", "return_logits", "prefill", "kv_len"))


def build(path, seed=0, **overrides):
  """A tiny random Qwen3-MoE (8 experts, 2 a token, 2 layers) saved to `path`."""
  kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            max_position_embeddings=256)
  kw.update(overrides)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kw))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
      else:
        p.normal_(0.0, 0.15)
  model.eval()
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def ck(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("moe"))
  model = build(path, norm_topk_prob=request.param)
  cfg, params = load_hf_model(path)
  return model, cfg, params, path


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(np.atleast_2d(tokens), dtype=torch.long)).logits.numpy()


def rel_diff(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))


def positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


def test_logits_match_transformers(ck):
  model, cfg, params, _ = ck
  assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == \
      ("qwen3_moe", 8, 2, 24)
  assert cfg.norm_topk_prob == model.config.norm_topk_prob and cfg.qk_norm
  assert {"router", "expert_gate", "expert_up", "expert_down"} <= set(params["layers"])
  assert not {"gate", "up", "down"} & set(params["layers"])
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 33)).astype(np.int32)
  ref = hf_logits(model, tokens)
  # each way of computing the experts (models/moe.py), by the forward's tokens
  for b, t, way in ((1, 3, moe._gathered), (2, 33, moe._dense), (2, 33, moe._grouped)):
    old = moe.DENSE_TOKENS
    moe.DENSE_TOKENS = 128 if way is moe._dense else 16
    jax.clear_caches()  # (the path is decided at trace time: no trace of another setting)
    try:
      assert moe.path(b * t, cfg) is way
      out = jax.jit(forward, static_argnames="cfg")(
          params, jnp.asarray(tokens[:b, :t]), positions(b, t), cfg=cfg).logits
    finally:
      moe.DENSE_TOKENS = old
    assert rel_diff(out, ref[:b, :t]) < TOL, way.__name__


def _reference_mlp(x, lp, k, norm):
  """float64 numpy: each token's top-k experts, one at a time."""
  x = np.asarray(x, np.float64)
  router, wg, wu, wd = (np.asarray(lp[n], np.float64)
                        for n in ("router", "expert_gate", "expert_up", "expert_down"))
  logits = x @ router
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for r in range(x.shape[0]):
    top = np.argsort(-p[r])[:k]
    w = p[r, top] / (p[r, top].sum() if norm else 1.0)
    for e, we in zip(top, w):
      g, u = x[r] @ wg[e], x[r] @ wu[e]
      out[r] += we * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  return out


@pytest.mark.parametrize("path", ["_gathered", "_dense", "_grouped", "_grouped_kernel"])
def test_each_way_of_computing_the_experts_matches_a_float64_reference(ck, path):
  """The gathered experts, every expert on every token, ragged_dot, and the Pallas grouped
  matmul (kernels/grouped_matmul.py, interpreted here)."""
  _, cfg, params, _ = ck
  lp = jax.tree.map(lambda a: a[0], params["layers"])
  x = jax.random.normal(jax.random.key(2), (13, cfg.hidden_size), jnp.float32)
  weights, experts = moe.route(x, lp["router"], cfg, jnp.float32)
  y = getattr(moe, path)(x, weights, experts, lp, jnp.float32)
  ref = _reference_mlp(x, lp, cfg.experts_per_token, cfg.norm_topk_prob)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)


def _loss(params, cfg, tokens):
  logits = forward(params, tokens[:, :-1], positions(*tokens[:, :-1].shape), cfg=cfg).logits
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_gradients_match_transformers(ck, impl, monkeypatch):
  """The grouped experts' backward (ragged_dot's; the Pallas grouped matmul's: its rows'
  gradient and each expert's weight gradient) and the router's, against torch autograd
  through transformers' own forward."""
  model, cfg, params, _ = ck
  cfg = cfg.replace(experts=impl)
  monkeypatch.setattr(moe, "DENSE_TOKENS", 16)  # (40 tokens: grouped)
  jax.clear_caches()
  tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 21)).astype(np.int64)
  grads = jax.jit(jax.grad(_loss), static_argnums=1)(params, cfg, jnp.asarray(tokens, jnp.int32))
  model.zero_grad()
  ids = torch.as_tensor(tokens)
  logits = model(ids[:, :-1]).logits
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
  loss.backward()
  named = dict(model.named_parameters())
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}.mlp."
    ref_router = named[pre + "gate.weight"].grad.numpy().T  # [D, E]
    assert rel_diff(grads["layers"]["router"][i], ref_router) < 1e-3
    for ours, hf in (("expert_gate", "gate_proj"), ("expert_up", "up_proj"),
                     ("expert_down", "down_proj")):
      g = grads["layers"][ours][i]
      fused = getattr(named.get(pre + "experts.gate_up_proj"), "grad", None)
      if fused is not None:  # transformers 5: experts' weights stacked, gate/up fused
        f = g.shape[-1] if ours != "expert_down" else g.shape[-2]
        ref = {"expert_gate": lambda: fused.numpy()[:, :f].transpose(0, 2, 1),
               "expert_up": lambda: fused.numpy()[:, f:].transpose(0, 2, 1),
               "expert_down": lambda: named[pre + "experts.down_proj"].grad.numpy()
               .transpose(0, 2, 1)}[ours]()
      else:
        ref = np.stack([named[f"{pre}experts.{e}.{hf}.weight"].grad.numpy().T
                        for e in range(cfg.num_experts)])
      assert np.abs(np.asarray(g)).max() > 0
      assert rel_diff(g, ref) < 1e-3, ours


def test_prefill_then_decode_equals_the_full_forward(ck):
  model, cfg, params, _ = ck
  tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 12)).astype(np.int32)
  ref = hf_logits(model, tokens)
  cache = init_cache(cfg, 2, 32)
  out = _fwd(params, jnp.asarray(tokens[:, :8]), positions(2, 8), cfg=cfg, cache=cache,
             prefill=True)
  cache = out.cache.replace(lengths=out.cache.lengths + 8)
  got = [out.logits]
  for t in range(8, 12):  # 2 rows x 2 experts <= 8: a decode step gathers its experts
    step = _fwd(params, jnp.asarray(tokens[:, t:t + 1]), positions(2, 1, t), cfg=cfg,
                cache=cache)
    cache = step.cache.replace(lengths=step.cache.lengths + 1)
    got.append(step.logits)
  assert rel_diff(jnp.concatenate(got, 1), ref) < TOL


def test_save_round_trip_through_transformers(ck, tmp_path):
  model, cfg, params, _ = ck
  out = str(tmp_path / "saved")
  save_hf_model(params, cfg, out)
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  assert saved["model_type"] == "qwen3_moe" and saved["num_experts"] == 8
  again = AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.random.default_rng(5).integers(0, VOCAB, (1, 17)).astype(np.int32)
  np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(model, tokens))
  cfg2, params2 = load_hf_model(out)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_a_layout_without_experts_everywhere_is_one_clear_error(tmp_path):
  path = str(tmp_path / "mixed")
  build(path, mlp_only_layers=[1])
  with pytest.raises(CheckpointFormatError, match="mlp_only_layers"):
    load_hf_model(path)
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg.update(mlp_only_layers=[])
  cfg.pop("num_local_experts", None)
  cfg.pop("num_experts", None)
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(CheckpointFormatError, match="num_experts"):
    load_hf_model(path)


@pytest.mark.parametrize("way", ["dense", "ragged_dot", "kernel"])
def test_experts_sharded_over_8_devices_compute_the_same(ck, way, monkeypatch):
  """The experts split over fsdp (whole experts per device) and their width over tensor, as
  the learner and a tensor-parallel replica hold them: logits and gradients as on one, every
  expert on every token (the 72 tokens' way) and grouped by expert (ragged_dot, and the
  Pallas grouped matmul per shard: the tokens over the data axes, the width over tensor)."""
  _, cfg, params, _ = ck
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  monkeypatch.setattr(moe, "DENSE_TOKENS", 128 if way == "dense" else 16)
  jax.clear_caches()  # (the way is decided at trace time)
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, VOCAB, (8, 10)), jnp.int32)
  assert moe.path(8 * 9, cfg) is (moe._dense if way == "dense" else moe._grouped)
  one = jax.jit(jax.value_and_grad(_loss), static_argnums=1)(params, cfg, tokens)
  cfg = cfg.replace(experts="kernel" if way == "kernel" else "xla")
  for shape in ((1, 8, 1), (1, 4, 2), (2, 2, 2)):
    mesh = make_mesh(shape)
    sharded = jax.device_put(params, tree_shardings(params, mesh))
    spec = sharded["layers"]["expert_gate"].sharding.spec
    assert tuple(spec)[1:] == ("fsdp", None, "tensor")
    batch = jax.sharding.NamedSharding(mesh, P(("data", "fsdp")))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # (as the learner traces)
      got = jax.jit(jax.value_and_grad(_loss), static_argnums=1)(
          sharded, cfg, jax.device_put(tokens, batch))
    got = jax.device_get(got)
    np.testing.assert_allclose(got[0], one[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(one[1])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def _hf_greedy(model, prompt, n):
  with torch.no_grad():
    out = model.generate(torch.as_tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("ck", [True], ids=["norm_topk"], indirect=True)  # (one routing)
@pytest.mark.parametrize("arm,tp,experts", [(None, 1, "auto"), ("3_1_4", 1, "auto"),
                                             ("3_1_4", 2, "auto"), ("3_1_4", 1, "kernel")])
def test_engine_greedy_matches_transformers(ck, arm, tp, experts):
  """The rollout engine on an MoE target, plainly and speculating with a dense drafter (the
  drafter's layer has no experts), on a replica of 2 devices with paged attention (the
  experts' width and the kv heads split over them), and through the grouped-matmul kernel at
  every step (16-row tiles, as a GPU runs it; interpreted here): greedy tokens ==
  transformers' generate."""
  model, cfg, params, _ = ck
  cfg = cfg.replace(experts=experts)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(1, VOCAB, rng.integers(3, 9)).tolist() for _ in range(3)]
  n = 12
  dparams = init_drafter(cfg, jax.random.key(1))
  assert "gate" in dparams["layers"] and "router" not in dparams["layers"]
  spec = None if arm is None else SpecConfig(strategy=arm, bs_threshold=4, patience=1,
                                             use_kernel=False)
  ecfg = EngineConfig(max_batch=4, buckets=(1, 2, 4), chunk_size=4, max_prompt_len=16,
                      max_new_tokens=n, spec=spec, page_size=4, paged_attention=tp > 1)
  mesh = make_mesh((1, 1, tp), jax.devices()[:tp]) if tp > 1 else None
  engine = Engine(params, cfg, ecfg, mesh=mesh, drafter_params=dparams if arm else None)
  results = engine.generate([Request(p, i) for i, p in enumerate(prompts)],
                            SamplingParams(temperature=0.0))
  if arm:
    assert any(m.mode == arm for m in engine.chunk_log)
  for r in results:
    assert list(r.response_ids) == _hf_greedy(model, prompts[r.request_id], n)


def test_lora_adapts_the_attention_of_an_moe_model(ck):
  _, cfg, _, _ = ck
  shapes = lora.adapter_shapes(cfg, lora.LoraConfig(4, targets=lora.parse_targets("all-linear")))
  assert set(shapes["layers"]) == {"q", "k", "v", "o"}
  with pytest.raises(ValueError, match="no such projection"):
    lora.adapter_shapes(cfg, lora.LoraConfig(4, targets=("q", "gate")))


def test_the_drafter_of_an_moe_target_exports_as_a_dense_qwen3_layer(ck, tmp_path):
  model, cfg, _, path = ck
  dshapes = drafter_param_shapes(cfg)["layers"]
  assert dshapes["gate"] == (1, cfg.hidden_size, cfg.intermediate_size)
  dparams = init_drafter(cfg, jax.random.key(3))
  hf = json.load(open(os.path.join(path, "config.json")))
  config = export_eagle(str(tmp_path / "eagle"), dparams, cfg, target_hf_config=hf)
  assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLMEagle"]
  assert "num_experts" not in config and "num_local_experts" not in config
  assert config["intermediate_size"] == cfg.intermediate_size
  assert param_shapes(cfg.dense())["layers"]["gate"][1:] == dshapes["gate"][1:]


def test_the_grouped_matmul_tiles_each_experts_rows_and_falls_back_where_it_cannot_run(
    ck, monkeypatch):
  """kernels/grouped_matmul.py's layout: every tile of rows one expert's, each expert's group
  from a tile boundary in pair order, an expert no pair chose no tile; and on a GPU whose
  Triton cannot compile the kernel (here: a CPU taken for one), `grouped_impl` falls back to
  ragged_dot with the reason, where "kernel" forces it."""
  from tlt_jax.kernels import grouped_matmul as gm
  experts = np.array([3, 0, 3, 3, 1, 0, 3] * 30, np.int32)  # 210 pairs; 2 chosen by none
  lay = gm.layout(jnp.asarray(experts), 5, bm=16)
  dest, tile_group = np.asarray(lay.dest), np.asarray(lay.tile_group)
  tiles, first = np.asarray(lay.tiles), np.asarray(lay.first_tile)
  assert len(set(dest.tolist())) == len(dest) and dest.max() < lay.rows
  assert (tile_group[dest // 16] == experts).all()  # each pair in a tile of its expert
  assert tiles.tolist() == [4, 2, 0, 8, 0] and first.tolist() == [0, 4, 6, 6, 14]
  for e in range(5):  # pair order kept within an expert
    assert (np.diff(dest[experts == e]) > 0).all()
  _, cfg, _, _ = ck
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  impl, why = moe.grouped_impl(cfg.replace(hidden_size=64, moe_intermediate_size=32))
  assert impl == "xla" and "does not compile here" in why, why
  impl, why = moe.grouped_impl(cfg)  # (48 x 24: no Triton blocks)
  assert impl == "xla" and "multiples of 16" in why
  assert moe.grouped_impl(cfg.replace(experts="kernel"))[0] == "kernel"
  assert moe.grouped_impl(cfg.replace(experts="xla"))[0] == "xla"


@pytest.mark.parametrize("k,n,bm,pairs", [(2048, 768, 16, 64), (768, 2048, 64, 4096)],
                         ids=["gate_up_decode", "down_learner"])
def test_the_grouped_matmul_lowers_to_triton_for_a_gpu(k, n, bm, pairs):
  """The kernel has not yet run on a GPU: its forward and backward (the weight gradient's
  device-read trip counts included) lower to Triton IR for an H100 at Qwen3-30B-A3B's shapes
  (128 experts), in bf16, with both tiles a run uses. Pallas' own lowering rejects what Triton
  cannot express (block shapes, dynamic loops, dtypes); only the PTX step needs a GPU."""
  import warnings
  from tlt_jax.kernels import grouped_matmul as gm
  try:
    from jax._src.lib import triton  # noqa: F401  (the TTIR dialect bindings)
  except ImportError as e:
    pytest.skip(f"jaxlib without Triton bindings: {e}")
  S, g = jax.ShapeDtypeStruct, 128
  rows = gm.num_tiles(pairs, g, bm) * bm
  args = (S((rows, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((rows // bm,), jnp.int32),
          S((g,), jnp.int32), S((g,), jnp.int32), S((rows, n), jnp.bfloat16))

  def step(x, w, tile_group, first, tiles, dy):
    y, pull = jax.vjp(lambda x, w: gm.gmm(x, w, tile_group, first, tiles, bm, False), x, w)
    return (y,) + pull(dy)
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")
  with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device)):
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3  # y, dx (gmm by the transposed weights), dw
  assert 'name = "grouped_matmul"' in text and 'name = "grouped_matmul_wgrad"' in text


@pytest.mark.parametrize("experts,shape", [("xla", (1, 4)), ("xla", (3, 13)), ("xla", (3, 50)),
                                           ("kernel", (3, 13))],
                         ids=["gathered", "dense", "ragged_dot", "kernel"])
def test_tokens_not_live_route_to_no_expert(ck, experts, shape):
  """models/moe.py's live mask (an empty or finished row's tokens, padding): the live tokens'
  outputs are the float64 reference's, the others' zero, through each way; with the kernel,
  the weights' gradients equal those of the live tokens alone (the padding contributes
  nothing); and the kernel's tiles hold the live pairs only, so an expert only dead tokens
  chose is not read."""
  from tlt_jax.kernels import grouped_matmul as gm
  _, cfg, params, _ = ck
  cfg = cfg.replace(experts=experts)
  lp = jax.tree.map(lambda a: a[0], params["layers"])
  b, t = shape
  h = jax.random.normal(jax.random.key(5), (b, t, cfg.hidden_size), jnp.float32)
  live = np.array(jax.random.bernoulli(jax.random.key(6), 0.4, shape))
  live[0, 0] = True
  y = np.asarray(moe.moe_mlp(h, lp, cfg, jnp.float32, jnp.asarray(live)))
  ref = _reference_mlp(np.asarray(h)[live], lp, cfg.experts_per_token, cfg.norm_topk_prob)
  np.testing.assert_allclose(y[live], ref, rtol=1e-4, atol=1e-5)
  assert not np.any(y[~live])
  if experts != "kernel":
    return
  ct = jax.random.normal(jax.random.key(7), h.shape, jnp.float32)
  names = ("expert_gate", "expert_up", "expert_down")

  w = {n: lp[n] for n in names}
  masked = jax.grad(lambda w: jnp.sum(
      moe.moe_mlp(h, {**lp, **w}, cfg, jnp.float32, jnp.asarray(live)) * ct))(w)
  alone = jax.grad(lambda w: jnp.sum(
      moe.moe_mlp(h[live][None], {**lp, **w}, cfg.replace(experts="xla"), jnp.float32)
      * ct[live][None]))(w)
  for n in names:
    np.testing.assert_allclose(masked[n], alone[n], rtol=1e-4, atol=1e-5)
  x = h.reshape(b * t, -1)
  _, chosen = moe.route(x, lp["router"], cfg, jnp.float32)
  k, flat = cfg.experts_per_token, live.reshape(-1)
  lay = gm.layout(chosen.reshape(-1), cfg.num_experts, 16, jnp.asarray(np.repeat(flat, k)))
  used = set(np.asarray(lay.tile_group)[np.asarray(lay.tile_group) >= 0].tolist())
  assert used == set(np.asarray(chosen)[flat].reshape(-1).tolist())
  assert (np.asarray(lay.dest)[~np.repeat(flat, k)] == lay.rows).all()


def test_the_experts_a_step_reads_are_its_live_tokens(ck):
  """The cost model's price of an MoE step (plan/cost.py: `experts_read` of its live tokens)
  against what the kernel's layout reads: the distinct experts with a tile, averaged over
  random routings of 3 live rows in a batch of 64 (the simulator's waiting batches)."""
  from tlt_jax.kernels import grouped_matmul as gm
  from tlt_jax.plan import cost
  _, cfg, _, _ = ck
  e, k = cfg.num_experts, cfg.experts_per_token
  rng = np.random.default_rng(0)
  live = np.zeros(64, bool)
  live[:3] = True
  reads = []
  for _ in range(200):
    chosen = np.stack([rng.choice(e, k, replace=False) for _ in range(64)]).astype(np.int32)
    lay = gm.layout(jnp.asarray(chosen.reshape(-1)), e, 16, jnp.asarray(np.repeat(live, k)))
    reads.append(int(np.sum(np.asarray(lay.tiles) > 0)))
  # each token draws k distinct experts: an expert is missed by one with probability 1 - k/E
  assert np.mean(reads) == pytest.approx(moe.experts_read(cfg, 3), rel=0.03)
  assert moe.experts_read(cfg, 3) < 0.6 * moe.experts_read(cfg, 64)
  _, expert = cost._layer_parts(cfg, 1)
  saved = cost.forward(cfg, 64, 1, 32).bytes - cost.forward(cfg, 64, 1, 32, live=3).bytes
  assert saved / (cfg.num_layers * expert * DTYPE_BYTES[cfg.dtype]) == pytest.approx(
      moe.experts_read(cfg, 64) - moe.experts_read(cfg, 3))
  flops = cost.forward(cfg, 64, 1, 32).flops - cost.forward(cfg, 64, 1, 32, live=3).flops
  assert flops == pytest.approx(2.0 * 61 * k * expert * cfg.num_layers)
