"""LoRA (tlt_jax/models/lora.py) against Hugging Face PEFT on transformers, and through a run.

The adapters' forward against PEFT's LoRA on the same tiny Hugging Face model (the adapters
written in PEFT's format by `save_peft_adapter` and loaded by `PeftModel.from_pretrained`: the
layout and the scale both checked), the merged weights against both; the learner's gradient in
the adapters against the chain rule through the whole model's gradient; a LoRA run on 8
devices: only the adapters train, the rollout decodes the policy the learner scores, the
checkpoint holds the adapters, a resume continues, the export writes the merged policy and a
PEFT adapter that transformers loads to the same logits.
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from tlt_jax import config as config_lib
from tlt_jax import runtime
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.config import asset_path
from tlt_jax.errors import ConfigError
from tlt_jax.models import forward, lora, replica_layout
from tlt_jax.models import hf_io
from tlt_jax.models.hf_io import hf_state_dict, load_hf_model
from tlt_jax.rl import grpo
from tlt_jax.rl import learner as rl_learner
from tlt_jax.sharding import make_mesh, tree_shardings
from user_env import user_env

peft = pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = asset_path("default", "model")
F32_TOL = 1e-4  # max|ours - reference| / max(1, max|reference|), as tests/test_models.py
ARCHS = {
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "llama": (transformers.LlamaConfig, dict(attention_bias=True, rope_theta=500.0)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)),
}


def _hf_model(path: str, arch: str, seed: int = 0):
  """A tiny random `arch` checkpoint (every tensor randomised) with the default task's
  tokenizer, saved to `path`; returns the torch model."""
  cls, kw = ARCHS[arch]
  config = cls(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               eos_token_id=1, pad_token_id=0, **kw)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
  model.save_pretrained(path)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(TOKENIZER, name), path)
  return model.eval()


def _random_adapters(cfg, lo, seed):
  """Adapters with B away from zero (a fresh B is 0: the base, which hides a wrong layout)."""
  ad = lora.init_adapters(cfg, lo, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), ad)


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want))))


TOKENS = np.array([[3, 7, 1, 30, 12, 5, 9, 22, 2, 17, 4, 11]], np.int32)


@pytest.mark.parametrize("arch,targets", [("qwen2", "all-linear"), ("llama", "all-linear"),
                                          ("qwen3", "q_proj,v_proj,down_proj")])
def test_adapters_are_pefts_lora_on_transformers(tmp_path, arch, targets):
  """Our forward with the adapters attached, and with them merged into the weights, against
  PEFT's LoRA loaded from our adapter files onto the same transformers model (Qwen2's q/k/v
  biases, Llama's attention biases, Qwen3's q/k norms and head_dim 32 != 64 / 4); fresh
  adapters are the base exactly."""
  hf = _hf_model(str(tmp_path / "model"), arch)
  cfg, base = load_hf_model(str(tmp_path / "model"))
  lo = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.parse_targets(targets))
  ad = _random_adapters(cfg, lo, seed=3)
  lora.save_peft_adapter(str(tmp_path / "adapter"), jax.device_get(ad), lo,
                         base_model=str(tmp_path / "model"))
  with open(tmp_path / "adapter" / "adapter_config.json") as f:
    assert json.load(f)["target_modules"] == sorted(n for n, t in lora.HF_NAMES.items()
                                                    if t in lo.targets)
  with torch.no_grad():
    plain = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    want = peft_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  assert _rel(want, plain) > 1e-2  # the adapters change the model: the test can fail
  pos = jnp.arange(TOKENS.shape[1])[None]
  attached = forward(lora.attach(base, ad, lo.scale), jnp.asarray(TOKENS), pos, cfg=cfg).logits
  merged = forward(lora.merge(base, ad, lo.scale), jnp.asarray(TOKENS), pos, cfg=cfg).logits
  assert _rel(attached, want) <= F32_TOL
  assert _rel(merged, want) <= F32_TOL
  # the exports' writer merges the attached tree a layer at a time: the merged tree's tensors
  got = dict(hf_state_dict(lora.attach(base, ad, lo.scale), cfg))
  expected = dict(hf_state_dict(lora.merge(base, ad, lo.scale), cfg))
  assert got.keys() == expected.keys()
  for name, x in expected.items():
    np.testing.assert_array_equal(got[name], x, err_msg=name)
  fresh = lora.init_adapters(cfg, lo, jax.random.key(0))
  start = forward(lora.attach(base, fresh, lo.scale), jnp.asarray(TOKENS), pos, cfg=cfg).logits
  np.testing.assert_array_equal(np.asarray(start),
                                np.asarray(forward(base, jnp.asarray(TOKENS), pos,
                                                   cfg=cfg).logits))


def test_adapter_gradient_is_the_chain_rule_of_the_weights_gradient(tmp_path):
  """dL/dA = s G B^T and dL/dB = s A^T G, G = dL/dW' the whole model's gradient at the merged
  weights W' = W + s A B (computed by the full-parameter loss, not through the adapters),
  for GRPO's loss on a packed micro-batch with clipping on both sides."""
  _hf_model(str(tmp_path / "model"), "qwen2")
  cfg, base = load_hf_model(str(tmp_path / "model"))
  lo = lora.LoraConfig(rank=4, alpha=8.0)
  ad = _random_adapters(cfg, lo, seed=5)
  rng = np.random.default_rng(0)
  b, t = 2, 16
  tokens = jnp.asarray(rng.integers(0, 32, (b, t)), jnp.int32)
  segments = jnp.asarray([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4], jnp.int32)
  positions = jnp.asarray([list(range(9)) + list(range(7)), list(range(12)) + [0] * 4],
                          jnp.int32)
  mask = jnp.asarray((np.asarray(segments) > 0) & (rng.random((b, t)) < 0.7), jnp.float32)
  old = jnp.asarray(rng.normal(-3.0, 1.0, (b, t)), jnp.float32)
  mb = grpo.Batch(tokens, positions, segments, mask, mask / jnp.sum(mask),
                  jnp.asarray(rng.normal(0, 1, (b, t)), jnp.float32), old)
  loss = functools.partial(grpo.grpo_loss, mb=mb, cfg=cfg, gcfg=grpo.GRPOConfig(),
                           num_tokens=jnp.sum(mask))
  g_ad = jax.grad(lambda a: loss(lora.attach(base, a, lo.scale))[0])(ad)
  g_w = jax.grad(lambda p: loss(p)[0])(lora.merge(base, ad, lo.scale))
  assert float(loss(lora.merge(base, ad, lo.scale))[1]["clip_frac"]) > 0.05
  for tname, pair in ad["layers"].items():
    a, bm = (np.asarray(pair[k], np.float64) for k in ("a", "b"))
    L, r = a.shape[0], a.shape[-1]
    g = np.asarray(g_w["layers"][tname], np.float64).reshape(L, a[0].size // r, -1)
    a2, b2 = a.reshape(L, -1, r), bm.reshape(L, r, -1)
    want_a = lo.scale * np.einsum("lio,lro->lir", g, b2).reshape(a.shape)
    want_b = lo.scale * np.einsum("lir,lio->lro", a2, g).reshape(bm.shape)
    for got, want in ((g_ad["layers"][tname]["a"], want_a), (g_ad["layers"][tname]["b"],
                                                               want_b)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3,
                                 atol=2e-4 * np.max(np.abs(want)))


def test_learner_trains_the_adapters_alone_and_the_base_is_the_reference(tmp_path):
  """On 8 devices (the learner FSDP): an update moves the adapters, not the base (bit for
  bit), its Adam state is the adapters'; with a KL term the reference log-probs are the
  base's, so at the fresh state (B = 0) the KL is 0 and the policy's log-probs the base's."""
  _hf_model(str(tmp_path / "model"), "llama")
  mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  cfg, params = load_hf_model(str(tmp_path / "model"), mesh=mesh)
  lo = lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "o", "down"))
  spec = rl_learner.LearnerSpec(cfg, grpo.GRPOConfig(kl_coef=0.1), optax.adam(1e-2), mesh,
                                micro_batch=8, pad_multiple=16, lora=lo)
  state = rl_learner.init_learner(params, spec, seed=1)
  assert state.ref_params is None
  assert jax.tree.structure(state.params) == jax.tree.structure(
      lora.init_adapters(cfg, lo, jax.random.key(0)))
  base_before = jax.device_get(state.base)
  from tlt_jax.rl.batching import MicroBatch
  rng = np.random.default_rng(1)
  tokens = rng.integers(2, 32, (8, 16)).astype(np.int32)
  segs = np.ones((8, 16), np.int32)
  pos = np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)).copy()
  mask = np.zeros((8, 16), np.float32)
  mask[:, 6:] = 1
  mb = MicroBatch(tokens, pos, segs, mask, mask / mask.sum(),
                  rng.normal(0, 1, (8, 16)).astype(np.float32),
                  np.repeat(np.arange(8)[:, None], 16, axis=1))
  prepared = rl_learner.prepare(state, [[mb], [mb]], spec)
  ref = np.asarray(prepared[1][0].ref_logp)
  want = np.asarray(rl_learner.logprobs(params, *(jnp.asarray(x) for x in (tokens, pos, segs)),
                                        spec=spec))
  np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)  # the base in its dtype
  np.testing.assert_allclose(np.asarray(prepared[1][0].old_logp), ref, rtol=1e-5, atol=1e-6)
  state, metrics = rl_learner.update(state, prepared, spec)
  assert metrics["skipped"] == 0
  for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.device_get(state.base))):
    np.testing.assert_array_equal(x, y)
  moved = [float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(
      {t: p["b"] for t, p in state.params["layers"].items()})]
  assert min(moved) > 0  # every target's B left zero
  merged = lora.merge(state.base, state.params, spec.lora.scale)
  assert jax.tree.structure(merged) == jax.tree.structure(params)


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason=(
    "jax 0.10.2's XLA:CPU holds every layer's product of lax.map's merge at once (18.2 MB of "
    "temp for one layer's 1.0 MB, 2026-12-08); checked against jax >= 0.11's XLA"))
def test_the_merge_holds_one_layers_product_at_a_time():
  """The merged weights are W + s A B (a float64 numpy reference, bf16 W), the rollout's
  layout conversion of the attached adapters gives them bit for bit, and the compiled
  merge (XLA's own memory analysis) holds one layer's float32 product at a time, on one device
  and per device on the 8-device FSDP mesh: a whole target's at once is L = 8 times it (at 7B
  an MLP target's 7.6 GB beside the merged copy the weight sync makes)."""
  L, D, F, r, s = 8, 256, 1024, 8, 2.0
  rng = np.random.default_rng(0)
  base = {"embed": jnp.zeros((16, D), jnp.bfloat16),
          "layers": {"gate": jnp.asarray(rng.normal(0, 1, (L, D, F)), jnp.bfloat16),
                     "down": jnp.asarray(rng.normal(0, 1, (L, F, D)), jnp.bfloat16)}}
  ad = {"layers": {t: {"a": jnp.asarray(rng.normal(0, 0.1, (L, w.shape[1], r)), jnp.float32),
                       "b": jnp.asarray(rng.normal(0, 0.1, (L, r, w.shape[2])), jnp.float32)}
                   for t, w in base["layers"].items()}}
  merged = jax.jit(lambda b, a: lora.merge(b, a, s))(base, ad)
  for t, w in base["layers"].items():
    a, b = (np.asarray(ad["layers"][t][k], np.float64) for k in ("a", "b"))
    want = np.asarray(w, np.float64) + s * np.einsum("lir,lro->lio", a, b)
    got = merged["layers"][t]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=1e-6)
  # the rollout's conversion (the weight sync: models.replica_layout of the attached tree,
  # layer by layer into the unstacked layout) gives the same weights bit for bit
  replica = jax.jit(lambda t: replica_layout(t, None, fused=False))(lora.attach(base, ad, s))
  for t in base["layers"]:
    for i in range(L):
      np.testing.assert_array_equal(np.asarray(replica["layers"][i][t], np.float32),
                                    np.asarray(merged["layers"][t][i], np.float32))
  assert not any("lora" in k for lp in replica["layers"] for k in lp)
  layer_f32 = D * F * 4
  scaled_b = sum(ab["b"].nbytes for ab in ad["layers"].values())  # attach's s B (r rows)
  one = jax.jit(lambda b, a: lora.merge(b, a, s)).lower(base, ad).compile()
  assert one.memory_analysis().temp_size_in_bytes <= 1.25 * layer_f32 + scaled_b
  # the exports' merge (hf_io.hf_state_dict of the attached tree): one layer's target a call
  ab = lora.attach(base, ad, s)["layers"]["gate_lora"]
  export = hf_io._merged_layer.lower(base["layers"]["gate"], ab["a"], ab["b"],
                                     np.int32(0)).compile().memory_analysis()
  assert export.temp_size_in_bytes <= 1.25 * layer_f32

  mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  sh = tree_shardings(lora.attach(base, ad, s), mesh)
  b_sh = {"embed": sh["embed"], "layers": {t: sh["layers"][t] for t in base["layers"]}}
  a_sh = {"layers": {t: sh["layers"][t + "_lora"] for t in ad["layers"]}}
  eight = jax.jit(lambda b, a: lora.merge(b, a, s), out_shardings=b_sh).lower(
      jax.device_put(base, b_sh), jax.device_put(ad, a_sh)).compile()
  assert eight.memory_analysis().temp_size_in_bytes <= (1.25 * layer_f32 + scaled_b) / 8 + 2 ** 16


def _peft_saved(model_dir: str, out: str, r: int, alpha: float, modules: list[str], seed: int):
  """A LoRA adapter made and saved by PEFT itself (its B randomised: PEFT starts it at 0) on
  the model in `model_dir`; returns the PEFT model (eval mode)."""
  base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
  model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                    target_modules=modules))
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.3)
  model.save_pretrained(out)
  return model.eval()


def test_a_peft_adapter_is_read_as_peft_wrote_it(tmp_path):
  """`load_peft_adapter` on adapters PEFT saved (Llama, attention biases, three of the seven
  projections): our forward with them is PEFT's; one of ours saved and read back is itself;
  an adapter of another rank, alpha or target set, or of options we lack, is one line."""
  model_dir = str(tmp_path / "model")
  _hf_model(model_dir, "llama", seed=4)
  want_model = _peft_saved(model_dir, str(tmp_path / "adapter"), 4, 8.0,
                           ["q_proj", "o_proj", "up_proj"], seed=1)
  cfg, base = load_hf_model(model_dir)
  lo = lora.LoraConfig(4, 8.0, ("q", "o", "up"))
  ad = lora.load_peft_adapter(str(tmp_path / "adapter"), cfg, lo)
  with torch.no_grad():
    want = want_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  got = forward(lora.attach(base, ad, lo.scale), jnp.asarray(TOKENS),
                jnp.arange(TOKENS.shape[1])[None], cfg=cfg).logits
  assert _rel(got, want) <= F32_TOL
  lora.save_peft_adapter(str(tmp_path / "ours"), ad, lo, base_model=model_dir)
  again = lora.load_peft_adapter(str(tmp_path / "ours"), cfg, lo)
  for x, y in zip(jax.tree.leaves(ad), jax.tree.leaves(again)):
    np.testing.assert_array_equal(x, y)
  for other, words in ((lora.LoraConfig(8, 8.0, ("q", "o", "up")), "r=4, lora_alpha=8"),
                       (lora.LoraConfig(4, 16.0, ("q", "o", "up")), "model.lora.alpha=8"),
                       (lora.LoraConfig(4, 8.0), "model.lora.targets=q,o,up")):
    with pytest.raises(ValueError, match=words):
      lora.load_peft_adapter(str(tmp_path / "adapter"), cfg, other)
  conf = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
  (tmp_path / "ours" / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
  with pytest.raises(ValueError, match="uses use_dora, which tlt_jax's LoRA does not"):
    lora.load_peft_adapter(str(tmp_path / "ours"), cfg, lo)
  with pytest.raises(ValueError, match="is not a PEFT adapter directory"):
    lora.load_peft_adapter(model_dir, cfg, lo)


# ------------------------------------------------------------------------------ through a run
# a reward of the text alone, which differs between a random model's samples (the task's
# own reward is 0 for all of them: no advantage, nothing learned)
REWARD = "def digits(response, answer):\n  return sum(c.isdigit() for c in response) / " \
         "(1.0 + len(response))\n"


def _spec(workdir, model_dir, **overrides):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.workdir = str(workdir)
  cfg.compilation_cache = ""
  cfg.model.path = model_dir
  cfg.tlt.enabled = False
  reward = os.path.join(os.path.dirname(model_dir), "reward.py")
  with open(reward, "w") as f:
    f.write(REWARD)
  cfg.reward.name = f"{reward}:digits"
  cfg.update_from_flattened_dict({
      "train.steps": 2, "train.eval_every": 0, "train.checkpoint_every": 1,
      "grpo.num_prompts": 2, "grpo.n": 4, "grpo.micro_batch": 8, "grpo.minibatches": 2,
      "rollout.max_batch": 8, "rollout.max_new_tokens": 16, "rollout.num_workers": 1,
      "reward.num_workers": 1, "mesh.devices": 0, "optim.lr": 1e-2, "optim.warmup_steps": 0,
      "model.lora.rank": 4, "model.lora.alpha": 8.0, **overrides})
  return runtime.prepare(config_lib.run_spec(cfg))


def _train(spec):
  from tlt_jax.run import build
  from tlt_jax.train import train
  run, state = build(spec)
  return train(run, state, progress=False)


def test_a_lora_run_trains_resumes_and_exports_what_peft_loads(tmp_path):
  """Two steps of the default task on a tiny Qwen2 with rank-4 adapters, the learner over 8
  devices: the rollout's recorded log-probs are the learner's (the merged weights it decodes
  are the attached adapters' policy, step 2 after an update too); the checkpoint's actor is
  the adapters; a third step resumes from it; the export writes the merged policy, which
  transformers loads to our logits, and a PEFT adapter, which on the starting model gives
  the same."""
  model_dir = str(tmp_path / "model")
  _hf_model(model_dir, "qwen2", seed=2)
  workdir = tmp_path / "run"
  state, _ = _train(_spec(workdir, model_dir))
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert r["loss"]["rollout_prob_diff"] < 1e-5 and r["loss"]["rollout_k3"] < 1e-9, r["loss"]
  assert records[1]["loss"]["approx_kl_old"] != 0  # the policy moved between mini-batches
  with Checkpointer(str(workdir / "checkpoints")) as ck:
    actor = ck.read_subtree("actor", 2)
  assert set(actor["layers"]) == set(lora.TARGETS)
  assert set(actor["layers"]["q"]) == {"a", "b"}
  # a third step from the checkpoint; a change of rank is refused in one line
  with pytest.raises(ConfigError, match="model.lora.rank 4 -> 8"):
    _spec(workdir, model_dir, **{"train.steps": 3, "model.lora.rank": 8})
  state, _ = _train(_spec(workdir, model_dir, **{"train.steps": 3}))
  assert state.step == 3
  p = subprocess.run([sys.executable, "-m", "tlt_jax.export", "--workdir", str(workdir),
                      "--step", "3"], cwd=ROOT, env=user_env(PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  out = workdir / "export" / "3"
  assert f"wrote {out}/adapter" in p.stdout, p.stdout
  with Checkpointer(str(workdir / "checkpoints")) as ck:
    adapters = ck.read_subtree("actor", 3)
  cfg, base = load_hf_model(model_dir)
  ours = forward(lora.attach(base, adapters, 8.0 / 4), jnp.asarray(TOKENS),
                 jnp.arange(TOKENS.shape[1])[None], cfg=cfg).logits
  with torch.no_grad():
    ids = torch.tensor(TOKENS, dtype=torch.long)
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(out / "policy")).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    before = start(ids).logits.numpy()
    with_adapter = peft.PeftModel.from_pretrained(start, str(out / "adapter")).eval()
    assert _rel(policy(ids).logits.numpy(), ours) <= F32_TOL
    assert _rel(with_adapter(ids).logits.numpy(), ours) <= F32_TOL
  assert _rel(ours, before) > 1e-4  # trained


@pytest.mark.parametrize("key,value,words", [
    ("model.lora.rank", -1, "a positive integer"),
    ("model.lora.alpha", 0.0, "must be > 0"),
    ("model.lora.targets", "q,qq", "is not a projection"),
])
def test_invalid_lora_values_are_one_line(key, value, words):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.model.lora.rank = 8
  section = cfg.model.lora
  section[key.rsplit(".", 1)[1]] = value
  with pytest.raises(ConfigError, match=words) as e:
    config_lib.run_spec(cfg)
  assert str(e.value).startswith(f"config.{key}=")


def test_a_resume_names_a_lora_change_and_ignores_its_settings_while_off(tmp_path):
  """workdir.LEARNING_KEYS: rank, alpha and targets are what a LoRA run learns with; with
  rank 0 in both configs alpha and targets change nothing (ACTIVE_WHEN)."""
  from tlt_jax import workdir

  def cfg_of(**lo):
    cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
    cfg.workdir = str(tmp_path)
    cfg.model.lora.update(lo)
    return cfg
  workdir.write_config(cfg_of())
  (tmp_path / "checkpoints" / "3").mkdir(parents=True)
  assert workdir.config_changes(cfg_of(alpha=16.0, targets="q,v")) == []
  assert workdir.config_changes(cfg_of(rank=8, alpha=16.0)) == [
      ("model.lora.rank", 0, 8), ("model.lora.alpha", 32.0, 16.0)]


def test_a_run_starts_from_a_peft_adapter(tmp_path):
  """model.lora.init: the run's first policy is the base with the adapter (the rollout's
  merged weights: PEFT's logits), and one that does not fit is one line naming the key."""
  from tlt_jax.run import build
  model_dir = str(tmp_path / "model")
  _hf_model(model_dir, "qwen2", seed=6)
  want_model = _peft_saved(model_dir, str(tmp_path / "sft"), 4, 8.0, ["q_proj", "k_proj",
                                                                     "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj",
                                                                     "down_proj"], seed=2)
  run, state = build(_spec(tmp_path / "run", model_dir,
                           **{"model.lora.init": str(tmp_path / "sft")}))
  try:
    cfg, _ = load_hf_model(model_dir)
    first = forward(rl_learner.rollout_policy(state.learner, run.learner), jnp.asarray(TOKENS),
                    jnp.arange(TOKENS.shape[1])[None], cfg=cfg).logits
    with torch.no_grad():
      want = want_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    assert _rel(first, want) <= F32_TOL
  finally:
    run.close()
  with pytest.raises(ConfigError, match=r"^config.model.lora.init=.* set model.lora.rank=4, "):
    build(_spec(tmp_path / "run2", model_dir, **{"model.lora.init": str(tmp_path / "sft"),
                                                 "model.lora.rank": 8}))
  with pytest.raises(ConfigError, match="an adapter to start from needs LoRA"):
    _spec(tmp_path / "run3", model_dir, **{"model.lora.init": str(tmp_path / "sft"),
                                           "model.lora.rank": 0})
