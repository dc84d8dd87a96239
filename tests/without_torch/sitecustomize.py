"""Hides torch from a process that has this folder on its PYTHONPATH (tests/user_env.py): it
runs as the main job's install has it (scripts/setup.sh without --dev installs no torch).
`import torch` fails and `importlib.util.find_spec("torch")` is None, which is how transformers
decides that torch is absent."""

import sys

sys.modules.setdefault("torch", None)
