"""Worker of test_distributed: joins the launch (initialization timeout argv[1] s), then exits;
for the tests where some processes never start."""

import sys

from tlt_jax import distributed as dist
from tlt_jax import launch

if __name__ == "__main__":
  dist.initialize(launch.DistributedConfig(initialization_timeout=int(sys.argv[1])))
  print("JOINED", flush=True)
