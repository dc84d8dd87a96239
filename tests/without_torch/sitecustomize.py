"""Hides torch from a process that has this folder on its PYTHONPATH (tests/user_env.py): it
runs as the main job's install has it (scripts/setup.sh without --dev installs no torch). The
import system's path finder is wrapped to find no `torch` package: `import torch` fails and
`importlib.util.find_spec("torch")` is None (how transformers decides torch is absent), and
importlib.metadata lists no torch distribution, as where it is not installed."""

import sys
from importlib.machinery import PathFinder


class _PathFinderWithoutTorch:
  """PathFinder, except that it finds no torch."""

  @staticmethod
  def find_spec(name, path=None, target=None):
    if name == "torch" or name.startswith("torch."):
      return None
    return PathFinder.find_spec(name, path, target)

  @staticmethod
  def find_distributions(*args, **kwargs):  # importlib.metadata's: no torch there either
    return (d for d in PathFinder.find_distributions(*args, **kwargs)
            if (d.metadata["Name"] or "").lower() != "torch")

  @staticmethod
  def invalidate_caches():
    PathFinder.invalidate_caches()


sys.meta_path[:] = [_PathFinderWithoutTorch if f is PathFinder else f for f in sys.meta_path]
