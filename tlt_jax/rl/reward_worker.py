"""Reward worker process: `python -m tlt_jax.rl.reward_worker NAME`.

Reads one JSON task per stdin line ({"response", "answer"}) and writes one JSON line per task
({"reward": float} or {"error": str}). Runs the function in its main thread, so libraries that
time themselves out with SIGALRM (math-verify does) work. The parent kills and replaces this
process when a call exceeds its timeout; see reward_pool.py.
"""

from __future__ import annotations

import json
import math
import sys


def main() -> None:
  out = sys.stdout
  sys.stdout = sys.stderr  # a reward fn that prints must not corrupt the protocol
  from tlt_jax.rl.rewards import get_reward_fn
  try:
    fn = get_reward_fn(sys.argv[1])
  except ValueError as e:
    out.write(json.dumps({"fatal": str(e)}) + "\n")
    out.flush()
    return
  out.write(json.dumps({"ready": True}) + "\n")
  out.flush()
  for line in sys.stdin:
    task = json.loads(line)
    try:
      r = float(fn(task["response"], task["answer"]))
      msg = {"reward": r} if math.isfinite(r) else {"error": f"non-finite reward {r}"}
    except Exception as e:  # noqa: BLE001 - any failure of user code is one zero reward
      msg = {"error": f"{type(e).__name__}: {e}"[:500]}
    out.write(json.dumps(msg) + "\n")
    out.flush()


if __name__ == "__main__":
  main()
