"""Reward worker process: `python -m tlt_jax.rl.reward_worker NAME`.

Writes {"ready": true} (or {"fatal": str} and exits) once the reward function is loaded, then
reads one JSON task per line ({"response", "answer", "source", "extra_info"}) and writes one
JSON line per task ({"reward": float}, with "extra": the rest of a verl-style reward's dict
where it has more, or {"error": str}). Runs the function in its main
thread, so libraries that time themselves out with SIGALRM (math-verify does) work. The parent
kills and replaces this process when a call exceeds its timeout; see reward_pool.py.

Why the protocol runs on private file descriptors: the reward is user code, and whatever it, a C
extension or a child process writes to fd 1 would land on the protocol pipe as a line the
parent cannot parse, and whatever reads fd 0 would swallow tasks. Swapping `sys.stdout` covers
none of those. So before any user code is imported, the worker keeps private, non-inheritable
duplicates of the two pipes and points fd 1 at stderr and fd 0 at /dev/null: a reward's output
goes to the log, never onto the protocol.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from typing import BinaryIO


def _take_protocol_pipes() -> tuple[BinaryIO, BinaryIO]:
  """-> (tasks, results): private files on the parent's pipes; fd 0/1 no longer reach them."""
  sys.stdout.flush()
  # os.dup gives a non-inheritable fd (PEP 446): a child process of the reward never holds the
  # protocol pipe, so it can neither write to it nor keep it open after this worker is killed.
  results_fd, tasks_fd = os.dup(1), os.dup(0)
  os.set_inheritable(results_fd, False)
  os.set_inheritable(tasks_fd, False)
  os.dup2(2, 1)  # fd 1 stays inheritable: children of the reward print to the log too
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  # sys.stdout still wraps fd 1, which is now stderr; line-buffered so that a print shows up
  # even when the worker is killed right after it (timeout).
  sys.stdout.reconfigure(line_buffering=True)
  return os.fdopen(tasks_fd, "rb"), os.fdopen(results_fd, "wb")


def main() -> None:
  # A scheduler's SIGTERM (Slurm's time limit, a preemption) reaches every process of the job:
  # the run stops at its next step boundary (distributed.StopRequest), and this worker keeps
  # scoring that step until then; it exits when the run closes its pipe (or kills it).
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  tasks, results = _take_protocol_pipes()  # before anything imports user code

  def send(msg: dict) -> None:
    results.write(json.dumps(msg).encode() + b"\n")
    results.flush()

  name = sys.argv[1]
  try:
    from tlt_jax.rl.rewards import get_reward_fn
    fn = get_reward_fn(name, extras=True)
  except ValueError as e:
    send({"fatal": str(e)[:1000]})
    return
  except Exception as e:  # noqa: BLE001 - a user module that raises at import: say why, in one line
    send({"fatal": f"reward {name!r}: cannot load ({type(e).__name__}: {e})"[:1000]})
    return
  send({"ready": True})
  for line in tasks:
    task = json.loads(line)
    try:
      r, extra = fn(task["response"], task["answer"], task.get("source"),
                    task.get("extra_info"))
      r = float(r)
      msg = {"reward": r} if math.isfinite(r) else {"error": f"non-finite reward {r}"}
      if extra and "reward" in msg:  # (numpy scalars as numbers, anything else as text)
        msg["extra"] = json.loads(json.dumps(extra, default=lambda v: (
            v.item() if hasattr(v, "item") else str(v))))
    except Exception as e:  # noqa: BLE001 - any failure of user code is one zero reward
      msg = {"error": f"{type(e).__name__}: {e}"[:500]}
    send(msg)


if __name__ == "__main__":
  main()
