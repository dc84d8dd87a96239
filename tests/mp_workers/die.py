"""Worker of test_distributed's failure tests. Both processes join and pass a barrier; then
the victim dies (os._exit, or an uncaught exception) while the survivor blocks, either in a
collective the victim never joins or in plain Python (a wait that cannot notice the death
itself, like a collective on a GPU peer that is gone). The survivor must not hang.

  die.py MODE VICTIM WAIT HEARTBEAT_S    MODE: kill | raise, WAIT: collective | sleep
"""

import os
import sys
import time

from tlt_jax import distributed as dist
from tlt_jax import launch


def main():
  mode, victim, wait, heartbeat = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
  dist.initialize(launch.DistributedConfig(heartbeat_timeout=heartbeat,
                                         initialization_timeout=60))
  import jax
  dist.barrier("ready")
  if jax.process_index() == victim:
    time.sleep(1.0)  # the survivor is blocked by now
    print(f"DYING {time.time():.3f}", flush=True)
    if mode == "kill":
      os._exit(7)
    raise RuntimeError("boom: a bug in the victim")
  print(f"BLOCKING {time.time():.3f}", flush=True)
  if wait == "collective":
    dist.barrier("never")  # the victim never arrives
  else:
    time.sleep(600)
  print("UNEXPECTED: the wait returned", flush=True)
  return 3


if __name__ == "__main__":
  sys.exit(main())
