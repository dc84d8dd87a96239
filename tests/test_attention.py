"""Packed attention (tlt_jax/models/attention.py): the Pallas flash-attention kernel (run in
interpret mode on this CPU) against XLA's masked reference, values and gradients, on one
device and per shard of an 8-device mesh; and which implementation a run gets, and why."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import ModelConfig, packed_impl
from tlt_jax.models.attention import packed_attention
from tlt_jax.sharding import batch_sharding, make_mesh

CFG = ModelConfig(arch="qwen2", vocab_size=23, hidden_size=32, intermediate_size=64,
                  num_layers=1, num_heads=4, num_kv_heads=2)


def _inputs(t, seed=0):
  """q [2, t, 4, 8], k/v [2, t, 2, 8] (grouped), ragged segments with padding at the end of
  one row and none in the other."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k1, (2, t, 4, 8))
  k = jax.random.normal(k2, (2, t, 2, 8))
  v = jax.random.normal(k3, (2, t, 2, 8))
  a = [1] * (t // 3) + [2] * (t // 4) + [3] * 5
  seg = np.array([a + [0] * (t - len(a)), [1] * (t - 7) + [2] * 7], np.int32)
  return q, k, v, jnp.asarray(seg)


def _loss(cfg, seg):
  valid = (seg > 0)[:, :, None, None]  # padding outputs are unspecified: nothing reads them
  w = jnp.cos(jnp.arange(8.0))  # a loss that weighs every feature differently
  return lambda q, k, v: jnp.sum(jnp.where(valid, packed_attention(q, k, v, seg, cfg), 0) * w)


@pytest.mark.parametrize("t", [48, 64])
def test_fused_kernel_equals_the_masked_reference(t):
  q, k, v, seg = _inputs(t)
  fused, xla = (dataclasses.replace(CFG, attention=a) for a in ("fused", "xla"))
  valid = np.asarray(seg > 0)
  out_f = np.asarray(packed_attention(q, k, v, seg, fused))[valid]
  out_x = np.asarray(packed_attention(q, k, v, seg, xla))[valid]
  np.testing.assert_allclose(out_f, out_x, rtol=1e-5, atol=1e-5)
  g_f = jax.grad(_loss(fused, seg), argnums=(0, 1, 2))(q, k, v)
  g_x = jax.grad(_loss(xla, seg), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_f, g_x):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # the reference itself: a token of segment 2 is unmoved by segment 1's values
  v2 = v.at[0, : t // 3].set(100.0)
  moved = packed_attention(q, k, v2, seg, fused) - packed_attention(q, k, v, seg, fused)
  assert float(jnp.max(jnp.abs(moved[0, t // 3:][valid[0, t // 3:]]))) == 0.0
  assert float(jnp.max(jnp.abs(moved[0, : t // 3]))) > 1.0


def test_fused_kernel_runs_per_shard_under_a_learner_mesh():
  """Batch over 8 devices ("fsdp"): the kernel runs in a shard_map per shard, equal to the
  reference computed without a mesh."""
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  q, k, v, seg = _inputs(32, seed=1)
  q, k, v = (jnp.concatenate([x] * 4) for x in (q, k, v))
  seg = jnp.concatenate([seg] * 4)
  fused, xla = (dataclasses.replace(CFG, attention=a) for a in ("fused", "xla"))

  def run(q, k, v, seg):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return packed_attention(q, k, v, seg, fused)

  assert "shard_map" in str(jax.make_jaxpr(run)(q, k, v, seg))
  got = jax.jit(run)(*(jax.device_put(x, batch_sharding(mesh, x.ndim)) for x in (q, k, v, seg)))
  valid = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(got)[valid],
                             np.asarray(packed_attention(q, k, v, seg, xla))[valid],
                             rtol=1e-5, atol=1e-5)


def test_which_implementation_and_why():
  impl, why = packed_impl(CFG, 512)  # auto on this CPU
  assert impl == "xla" and "cpu" in why
  assert packed_impl(dataclasses.replace(CFG, attention="fused"), 512)[0] == "fused"
  assert packed_impl(dataclasses.replace(CFG, attention="xla", dtype="bfloat16"), 512)[0] == "xla"
  with pytest.raises(ValueError, match="multiple of 16"):
    packed_impl(dataclasses.replace(CFG, attention="fused"), 40)
  with pytest.raises(ValueError, match="attention"):
    dataclasses.replace(CFG, attention="flash")


def test_auto_on_a_gpu_uses_the_kernel_only_where_it_compiles_and_agrees(monkeypatch):
  """"auto" on a GPU in bf16 compiles and runs the kernel first: where it does not compile
  (here the real failure: the Triton lowering on this CPU, the backend only named a GPU) or
  disagrees with XLA's reference (a kernel 10% off on one head: a miscompile), the reference
  runs and the reason says why; where it compiles and agrees (the kernel interpreted here), the
  kernel runs, also where a trace asks first."""
  from tlt_jax.kernels import flash_attention
  from tlt_jax.models import attention
  bf16 = dataclasses.replace(CFG, dtype="bfloat16")
  probe = attention._fused_check
  real = flash_attention.packed_flash_attention
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  probe.cache_clear()
  try:
    impl, why = packed_impl(bf16, 512)
    assert impl == "xla" and "the fused kernel does not compile here (" in why, why
    assert "\n" not in why and probe.cache_info().currsize == 1
    probe.cache_clear()
    off = lambda q, k, v, s: real(q, k, v, s, interpret=True).at[:, :, 1].multiply(1.1)
    monkeypatch.setattr(flash_attention, "packed_flash_attention", off)
    impl, why = packed_impl(bf16, 512)
    assert impl == "xla" and "disagrees with XLA's reference here (max relative" in why, why
    probe.cache_clear()
    monkeypatch.setattr(flash_attention, "packed_flash_attention",
                        lambda q, k, v, s: real(q, k, v, s, interpret=True))
    assert packed_impl(bf16, 512)[0] == "fused"
    # asked first inside a trace (the drafter's step is jitted): the check still runs its
    # executables on concrete arrays, and agrees
    probe.cache_clear()
    seen = []
    jax.jit(lambda x: seen.append(packed_impl(bf16, 512)[0]) or x + 1)(1.0)
    assert seen == ["fused"]
  finally:
    probe.cache_clear()
