"""Reward files (`config.reward.name='path/to/file.py:fn'`) whose scores the tests know in
advance: 0 for the job's first calls, then scores that differ from response to response, so
a test knows which groups carry signal (DAPO's dynamic sampling). The reward pool's processes
(every training process's) count their calls in one file under a lock. Not a test module."""

from __future__ import annotations

import pathlib

_TEMPLATE = '''
import fcntl
import zlib


def fn(response, answer):
  """0 for the first {first} calls, then {later}."""
  with open({calls!r}, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    calls = len(f.read())
    f.write("x")
  return 0.0 if calls < {first} else {later}
'''

# a score per call: the call's number (every response apart, whatever it says), or a
# function of the response's text (the same text scores the same, whichever process scores it)
LATER = {"count": "float(calls)", "text": "(zlib.crc32(response.encode()) % 1000) / 1000"}


def counting_reward(directory: pathlib.Path, name: str, *, first: int, later: str) -> str:
  """Writes directory/<name>.py (its calls counted in directory/<name>.calls) -> the
  config.reward.name that names its function."""
  path = directory / f"{name}.py"
  path.write_text(_TEMPLATE.format(first=first, later=LATER[later],
                                   calls=str(directory / f"{name}.calls")))
  return f"{path}:fn"
