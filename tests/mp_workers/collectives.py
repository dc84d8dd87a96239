"""Worker of test_distributed: joins the launch, checks the topology, and runs a sharded sum,
an all-gather and a process all-gather over the global 8-device mesh. Prints RESULT lines."""

import json
import sys

import ml_collections
import numpy as np

from tlt_jax import distributed as dist
from tlt_jax.config import distributed_config

ROWS, COLS = 16, 3


def main():
  cfg = ml_collections.ConfigDict({"distributed": {"heartbeat_timeout": 30}})
  launch = dist.initialize(distributed_config(cfg))
  assert dist.initialize(distributed_config(cfg)) is launch  # idempotent

  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  n, pid = jax.process_count(), jax.process_index()
  assert (n, jax.device_count(), jax.local_device_count()) == (2, 8, 4), (
      n, jax.device_count(), jax.local_device_count())
  assert launch.kind == "explicit" and launch.process_id == pid, launch
  assert dist.is_primary() == (pid == 0)

  # Devices in process order, so process i holds rows [i*8, (i+1)*8) of the global array.
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), ("x",))
  full = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) ** 1.5
  local = np.asarray(dist.process_shard(list(full), pid, n))
  arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local,
                                               (ROWS, COLS))
  assert not arr.is_fully_addressable and len(arr.addressable_shards) == 4

  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
  gathered = jax.jit(lambda x: x * 2.0, out_shardings=NamedSharding(mesh, P()))(arr)
  ids = multihost_utils.process_allgather(np.array([pid * 10 + 1]))
  dist.barrier("done")
  print("RESULT " + json.dumps({"process": pid, "sum": float(total),
                                "gathered": np.asarray(gathered).tolist(),
                                "ids": np.asarray(ids).ravel().tolist()}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
