"""Worker of test_distributed: publishes a progress time on the job's ProgressBoard (process
i: 1000 + i), waits for every process's, and prints what `latest()` sees."""

import json
import sys

import ml_collections

from tlt_jax import distributed as dist
from tlt_jax.config import distributed_config


def main():
  dist.initialize(distributed_config(ml_collections.ConfigDict(
      {"distributed": {"heartbeat_timeout": 30}})))
  import jax
  board = dist.ProgressBoard()
  pid = jax.process_index()
  board.publish(1000.0 + pid)
  dist.barrier("published")
  seen = board.latest()
  dist.barrier("read")  # (a peer's republication must not land before this process reads)
  board.publish(5.0)  # a later, older time replaces this process's (allow_overwrite)
  dist.barrier("republished")
  print("RESULT " + json.dumps({"process": pid, "seen": seen, "after": board.latest()}),
        flush=True)
  dist.barrier("done")


if __name__ == "__main__":
  sys.exit(main())
