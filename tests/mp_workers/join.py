"""Worker of test_distributed: joins the launch (initialization timeout argv[1] s; heartbeat
timeout argv[2] s where given), then exits; for the tests where some processes never start or
join with another process count."""

import sys

from tlt_jax import distributed as dist
from tlt_jax import launch

if __name__ == "__main__":
  timeouts = {"initialization_timeout": int(sys.argv[1])}
  if len(sys.argv) > 2:
    timeouts["heartbeat_timeout"] = int(sys.argv[2])
  dist.initialize(launch.DistributedConfig(**timeouts))
  print("JOINED", flush=True)
