"""tlt_jax.sharding on 8 fake CPU devices (tests/conftest.py): meshes, partition rules, loading
a HF checkpoint straight onto a mesh, and sharded forwards equal to the single-device one."""

import functools
import os
import re

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P
from transformers import AutoModelForCausalLM, Qwen2Config

from tlt_jax.models import ModelOutput, forward, init_cache
from tlt_jax.models.hf_io import load_hf_model
from tlt_jax.sharding import (AXES, batch_sharding, cache_sharding, make_mesh, mesh_sizes,
                              replicated, tree_shardings)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake CPU) devices")

TOL = 1e-5  # sharded vs single device: same math, only the reduction order differs
BATCH = 8  # divisible by data * fsdp of every mesh below


# -------------------------------------------------------------------------------------- mesh
def test_make_mesh_shapes():
  assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}  # default: all fsdp
  m = make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
  assert m.axis_names == AXES and dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(make_mesh((2, 2, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(make_mesh({"tensor": -1}).shape) == {"data": 1, "fsdp": 1, "tensor": 8}
  assert dict(make_mesh([1, -1, 4]).shape) == {"data": 1, "fsdp": 2, "tensor": 4}
  m = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
  assert dict(m.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  assert m.devices.flatten().tolist() == jax.devices()[:4]
  assert sorted(d.id for d in make_mesh((2, 2, 2)).devices.flatten()) == list(range(8))


def test_unstacked_layers_take_the_stacked_rule_without_the_layer_axis():
  """The rollout layout (`layers/3/q`, no L axis) shards each layer as the stacked rule
  shards every layer: the same spec with the leading layer entry dropped."""
  from tlt_jax.models import ModelConfig, abstract_params, unstack_layers
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, qkv_bias=True,
                    tie_word_embeddings=True)
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  stacked = tree_shardings(abstract_params(cfg), mesh)
  unstacked = tree_shardings(jax.eval_shape(unstack_layers, abstract_params(cfg)), mesh)
  assert unstacked["embed"].spec == stacked["embed"].spec
  for i in range(3):
    for k, sh in stacked["layers"].items():
      assert unstacked["layers"][i][k].spec == P(*tuple(sh.spec)[1:]), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # float32: leaves pass through
def test_learner_params_to_the_replica_layout_are_a_copy_on_any_devices(dtype):
  """The learner's FSDP params -> the rollout layout (cast, layers unstacked) on the same 8
  devices and on 4 of them, and in the one program that several processes use (the same 8
  devices): each layer's tensors are the learner's slice cast (numpy), every leaf
  on its target sharding, every way equal, and the learner donating its params to an update
  deletes nothing of any."""
  from tlt_jax.models import ModelConfig, init_params
  from tlt_jax.rollout.replica import (replica_shardings, to_replica_layout,
                                       to_replica_program)
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, qkv_bias=True,
                    tie_word_embeddings=True, dtype=dtype)
  learner = make_mesh({"fsdp": 8})
  params = jax.device_put(init_params(cfg, jax.random.key(0)),
                          tree_shardings(init_params(cfg, jax.random.key(0)), learner))
  host = jax.tree.map(lambda x: np.asarray(jax.numpy.copy(x)), params)  # (a view: no donation)
  outs = []
  whole = make_mesh({"fsdp": 2, "tensor": 4})

  def one_program(params, cfg, fused, shardings):
    return to_replica_program(cfg, fused, shardings)(params)
  for mesh, move in ((whole, to_replica_layout),
                     (make_mesh({"tensor": 4}, devices=jax.devices()[4:]), to_replica_layout),
                     (whole, one_program)):
    shardings = replica_shardings(params, cfg, False, mesh)
    out = move(params, cfg, False, shardings)
    for x, sh in zip(jax.tree.leaves(out), jax.tree.leaves(shardings)):
      assert x.sharding == sh and x.dtype == cfg.compute_dtype
    for i in range(cfg.num_layers):
      for k, v in host["layers"].items():
        want = v[i].astype(cfg.compute_dtype).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(out["layers"][i][k], np.float32), want, k)
    outs.append(out)
  for other in outs[1:]:
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(other)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)(params)
  assert all(x.is_deleted() for x in jax.tree.leaves(params))
  assert not any(x.is_deleted() for out in outs for x in jax.tree.leaves(out))


@pytest.mark.parametrize("shape,needle", [
    ({"data": 2}, "needs 2 devices, but 8 are available"),
    ((2, 2, 4), "needs 16 devices, but 8 are available"),
    ({"data": 3, "fsdp": -1}, "does not divide 8 devices"),
    ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
    ({"model": 8}, "mesh axes ['model'] are unknown"),
])
def test_make_mesh_errors(shape, needle):
  with pytest.raises(ValueError) as e:
    make_mesh(shape)
  assert needle in str(e.value)


# ------------------------------------------------------------------------------ checkpoint
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
  """Tiny Qwen2 (qkv biases) with 4 q heads / 2 kv heads; every tensor randomised."""
  path = str(tmp_path_factory.mktemp("qwen2_shard"))
  config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rope_theta=1e6)
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
  model.save_pretrained(path)
  return path


LENGTHS = np.array([24, 17, 5, 12, 24, 1, 9, 20], np.int32)  # ragged committed lengths
MAX_LEN = 32


def _run_cache(fwd, params, cache, tokens, put=lambda x: x):
  """Ragged prefill (commit LENGTHS[b] tokens per row), then one decode step per row."""
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  pre = fwd(params, put(tokens), put(positions), cache)
  cache = pre.cache.replace(lengths=put(LENGTHS))
  nxt = tokens[::-1, :1].copy()
  dec = fwd(params, put(nxt), put(LENGTHS[:, None]), cache)
  return pre, dec


@pytest.fixture(scope="module")
def single(ckpt_dir):
  """Single-device params and reference outputs (computed once)."""
  cfg, params = load_hf_model(ckpt_dir)  # default: first device only
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(params))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, 24)).astype(np.int32)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  ref = jax.jit(functools.partial(forward, cfg=cfg))(params, tokens, positions)
  f1 = jax.jit(lambda p, x, pos, c: forward(p, x, pos, cfg=cfg, cache=c))
  ref_cache = _run_cache(f1, params, init_cache(cfg, BATCH, MAX_LEN), tokens)
  return cfg, params, tokens, ref, ref_cache


MESHES = {
    "d2f2t2": (2, 2, 2),
    "f8": (1, 8, 1),
    "f2t4": (1, 2, 4),
}

# Expected specs (param shapes: q [2,64,4,16], k/v [2,64,2,16], o [2,4,16,64], gate/up
# [2,64,96], down [2,96,64], embed [128,64], lm_head [64,128], q_bias [2,4,16], k_bias [2,2,16]).
# On f2t4 the 2 kv heads do not divide tensor=4: that dim falls back to replicated.
EXPECTED_SPECS = {
    "d2f2t2": {"q": P(None, "fsdp", "tensor", None), "k": P(None, "fsdp", "tensor", None),
               "k_bias": P(None, "tensor", None)},
    "f8": {"q": P(None, "fsdp", "tensor", None), "k": P(None, "fsdp", "tensor", None),
           "k_bias": P(None, "tensor", None)},
    "f2t4": {"q": P(None, "fsdp", "tensor", None), "k": P(None, "fsdp", None, None),
             "k_bias": P(None, None, None)},
}


def _shard_shape(shape, spec, mesh):
  out = []
  for dim, entry in zip(shape, list(spec) + [None] * (len(shape) - len(spec))):
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    out.append(dim // int(np.prod([mesh.shape[a] for a in axes])))
  return tuple(out)


@pytest.fixture(scope="module", params=list(MESHES))
def sharded(request, ckpt_dir, single):
  mesh = make_mesh(MESHES[request.param])
  cfg, params = load_hf_model(ckpt_dir, mesh=mesh)
  return request.param, mesh, cfg, params


def test_load_onto_mesh_is_really_sharded(sharded, single):
  name, mesh, cfg, params = sharded
  cfg1, params1 = single[:2]
  assert cfg == cfg1
  layers = params["layers"]
  for key, spec in EXPECTED_SPECS[name].items():
    assert layers[key].sharding.spec == spec, (name, key, layers[key].sharding.spec)
  assert params["embed"].sharding.spec == P("tensor", "fsdp")
  assert params["lm_head"].sharding.spec == P("fsdp", "tensor")
  assert layers["o"].sharding.spec == P(None, "tensor", None, "fsdp")
  assert layers["down"].sharding.spec == P(None, "tensor", "fsdp")
  for norm in (params["final_norm"], layers["attn_norm"], layers["mlp_norm"]):
    assert norm.sharding.is_fully_replicated

  flat1 = dict(jax.tree_util.tree_flatten_with_path(params1)[0])
  for path, arr in jax.tree_util.tree_flatten_with_path(params)[0]:
    assert isinstance(arr.sharding, NamedSharding) and arr.sharding.mesh == mesh
    shards = arr.addressable_shards
    assert len(shards) == 8 and {s.device for s in shards} == set(jax.devices())
    want = _shard_shape(arr.shape, arr.sharding.spec, mesh)
    full = np.asarray(flat1[path])
    for s in shards:
      assert s.data.shape == want, (path, s.data.shape, want)
      # Each device holds exactly its slice of the checkpoint.
      np.testing.assert_array_equal(np.asarray(s.data), full[s.index])

  # Sharded dims really are split: the q shard is smaller than q on every mesh ...
  q = layers["q"]
  assert int(np.prod(q.addressable_shards[0].data.shape)) * 8 // mesh.shape["data"] \
      == int(np.prod(q.shape))
  # ... and the kv-head fallback keeps the full kv dim where tensor does not divide it.
  k_shard = layers["k"].addressable_shards[0].data.shape
  assert k_shard[2] == (2 if name == "f2t4" else 2 // mesh.shape["tensor"])
  assert k_shard[1] == 64 // mesh.shape["fsdp"]


def test_explicit_shardings_argument(ckpt_dir, single):
  mesh = make_mesh((2, 2, 2))
  params1 = single[1]
  shardings = jax.tree.map(lambda _: replicated(mesh), params1)
  _, params = load_hf_model(ckpt_dir, shardings=shardings)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params1)):
    assert x.sharding.is_fully_replicated and len(x.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------- sharded forward
def test_sharded_forward_equals_single_device(sharded, single):
  name, mesh, cfg, params = sharded
  _, _, tokens, ref, _ = single
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

  p_sh = tree_shardings(params, mesh)
  for s, x in zip(jax.tree.leaves(p_sh), jax.tree.leaves(params)):
    assert s == x.sharding  # the loader placed params with exactly the rule shardings
  b2, b3 = batch_sharding(mesh, 2), batch_sharding(mesh, 3)
  assert b2.spec == P(("data", "fsdp"), None)
  fwd = jax.jit(functools.partial(forward, cfg=cfg), in_shardings=(p_sh, b2, b2),
                out_shardings=ModelOutput(logits=b3, hidden=b3, cache=None))
  out = fwd(params, jax.device_put(tokens, b2), jax.device_put(positions, b2))
  assert out.logits.sharding.spec == b3.spec and len(out.logits.addressable_shards) == 8
  assert out.logits.addressable_shards[0].data.shape[0] == \
      BATCH // (mesh.shape["data"] * mesh.shape["fsdp"])
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=0, atol=TOL)
  np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(ref.hidden), rtol=0, atol=TOL)


def test_sharded_cache_forward_equals_single_device(sharded, single):
  """Ragged prefill (per-row committed lengths) then a decode step, with the paged KV cache
  sharded by `cache_sharding` (page pools: kv heads over tensor when they divide; tables and
  lengths: batch over data+fsdp)."""
  name, mesh, cfg, params = sharded
  _, _, tokens, _, (ref_pre, ref_dec) = single
  b = tokens.shape[0]
  c_sh = cache_sharding(mesh, b, cfg.num_kv_heads, cfg.num_layers)
  kv_spec = P(None, None, None if cfg.num_kv_heads % mesh.shape["tensor"] else "tensor", None)
  assert len(c_sh.k) == cfg.num_layers
  assert c_sh.k[0].spec == kv_spec and c_sh.lengths.spec == P(("data", "fsdp"))
  assert c_sh.table.spec == P(("data", "fsdp"), None)
  p_sh, b2, b3 = tree_shardings(params, mesh), batch_sharding(mesh, 2), batch_sharding(mesh, 3)
  fs = jax.jit(lambda p, x, pos, c: forward(p, x, pos, cfg=cfg, cache=c),
               in_shardings=(p_sh, b2, b2, c_sh),
               out_shardings=ModelOutput(logits=b3, hidden=b3, cache=c_sh))
  cache = jax.device_put(init_cache(cfg, b, MAX_LEN), c_sh)
  put = lambda x: jax.device_put(np.asarray(x), b2 if np.ndim(x) == 2 else c_sh.lengths)
  pre, dec = _run_cache(fs, params, cache, tokens, put)
  assert all(k.sharding.spec == kv_spec for k in pre.cache.k + pre.cache.v)

  assert all(k.sharding.spec == kv_spec and len(k.addressable_shards) == 8
             for k in dec.cache.k + dec.cache.v)
  for got, want in ((pre, ref_pre), (dec, ref_dec)):
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=0, atol=TOL)
    np.testing.assert_allclose(np.asarray(got.cache.k), np.asarray(want.cache.k), rtol=0,
                               atol=TOL)
    np.testing.assert_allclose(np.asarray(got.cache.v), np.asarray(want.cache.v), rtol=0,
                               atol=TOL)


def test_mesh_sizes_resolve_minus_one_without_devices():
  # memory plans a 64-GPU learner mesh on this 8-device machine: sizes only, no devices
  assert mesh_sizes({"data": 2, "fsdp": -1, "tensor": 4}, 64) == {"data": 2, "fsdp": 8,
                                                                  "tensor": 4}
  assert mesh_sizes((1, 1, 2), 2) == {"data": 1, "fsdp": 1, "tensor": 2}
  with pytest.raises(ValueError, match="does not divide 6 devices"):
    mesh_sizes({"fsdp": -1, "tensor": 4}, 6)


def test_make_mesh_is_the_only_mesh_builder():
  """Every Mesh of the package and its scripts comes from make_mesh (axis names in one place)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  found = []
  for folder in ("tlt_jax", "scripts"):
    for dirpath, _, files in os.walk(os.path.join(root, folder)):
      for f in files:
        path = os.path.join(dirpath, f)
        if f.endswith(".py") and not path.endswith(os.path.join("tlt_jax", "sharding.py")):
          with open(path) as fh:
            text = fh.read()
          if re.search(r"\bMesh\(", text) or '"data", "fsdp", "tensor"' in text:
            found.append(os.path.relpath(path, root))
  assert found == []
