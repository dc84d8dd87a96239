"""Worker of test_distributed's executable exchange (rollout/exchange.py): 3 processes x 2 CPU
devices, each with an executable cache asking for programs on a mesh of its own two devices.

1. Process 0 compiles program a and holds its compile until process 1 says go; process 1's
   compile thread (`compile_each`, deferring) queues [a, b]: it puts a off (process 0 is
   compiling it), compiles b, says go, then loads a from process 0's compile. Process 0 then
   asks for b: loaded from process 1's; process 2 asks for both: loaded.
2. A program whose module differs between the processes (a constant per process): each
   compiles its own.
3. All ask for program c at once (no deferring): compiled once in the job, loaded by the
   others.
4. Program d, which process 0 takes from JAX's persistent cache (made to look so): it
   publishes nothing to load, and processes 1 and 2 claim it again: one compiles it, the
   other loads it.
Prints one RESULT line: which programs this process compiled, loaded, in what order, and
whether each computed numpy's answer on its own devices; then the data keys the store still
holds."""

import json
import sys
from functools import partial

import ml_collections
import numpy as np

from tlt_jax import distributed as dist
from tlt_jax.config import distributed_config

A, B, C, D = 2.0, 5.0, 7.0, 9.0
OWN = (10.0, 11.0, 12.0)  # (2.: per process)


def _matmul(w, x, *, k):
  import jax.numpy as jnp
  return jnp.tanh(jnp.einsum("bi,io->bo", x, w)) * k


def main():
  dist.initialize(distributed_config(ml_collections.ConfigDict(
      {"distributed": {"heartbeat_timeout": 30}})))
  import jax
  from jax._src import distributed as _dist
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from tlt_jax.rollout import exchange, executables, sharing
  jax.config.update("jax_enable_compilation_cache", False)  # (compiled, not loaded from disk)
  client = _dist.global_state.client
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.local_devices()[:2]), ("t",))
  rng = np.random.default_rng(0)
  w, x = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(3, 8)).astype(np.float32)
  args = (jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, "t"))),
          jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())))
  on_mine = (jax.device_put(w, args[0].sharding), jax.device_put(x, args[1].sharding))

  compiled, real = [], jax.stages.Lowered.compile

  def counting(self, *a, **kw):  # every XLA compile of this process, by its program's k
    text = self.as_text()
    k = next(k for k in (A, B, C, D) + OWN if f"dense<{k:e}>" in text)
    compiled.append(k)
    if pid == 0 and k == A:  # (held until process 1 has compiled b)
      client.key_value_set("test/a_compiling", "1")
      client.blocking_key_value_get("test/go", 60_000)
    out = real(self, *a, **kw)
    if pid == 0 and k == D:  # (as if JAX's persistent cache had served it)
      executables._CACHE_HIT.hit = True
    return out

  jax.stages.Lowered.compile = counting
  cache, order, checks = executables.ExecutableCache(), [], {}

  def get(k):
    exe = cache.get("mm", k, partial(_matmul, k=k), args)
    y = exe(*on_mine)
    checks[str(k)] = bool(np.allclose(np.asarray(y), np.tanh(x @ w) * k, rtol=1e-5, atol=1e-5)
                          and y.sharding.device_set == set(mesh.devices.flat))
    return k

  # 1. a put off and loaded; b loaded the other way
  if pid == 0:
    get(A)
    client.blocking_key_value_get("test/b_done", 60_000)
    get(B)
  elif pid == 1:
    client.blocking_key_value_get("test/a_compiling", 60_000)
    for k in sharing.compile_each([A, B], get, True):
      order.append(k)
      if k == B:
        client.key_value_set("test/go", "1")
    client.key_value_set("test/b_done", "1")
  dist.barrier("one")
  if pid == 2:
    get(A), get(B)
  # 2. a module that differs per process
  get(OWN[pid])
  dist.barrier("two")
  # 3. all at once
  get(C)
  dist.barrier("three")
  # 4. one the claimer took from its persistent cache
  if pid == 0:
    get(D)
    client.key_value_set("test/d", "1")
  else:
    client.blocking_key_value_get("test/d", 60_000)
    get(D)
  dist.barrier("four")
  left = [k for k, _ in client.key_value_dir_get_bytes(exchange.PREFIX) if "/data/" in k]
  ported = {str(r.key.variant): r.ported for r in cache.records}
  print("RESULT " + json.dumps({"process": pid, "compiled": compiled, "order": order,
                                "ported": ported, "checks": checks, "data_keys": len(left)}),
        flush=True)
  dist.barrier("done")


if __name__ == "__main__":
  sys.exit(main())
