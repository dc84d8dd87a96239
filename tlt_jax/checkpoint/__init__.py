"""Checkpoints of an arbitrary train-state pytree: asynchronous, crash-safe, Orbax underneath.

`Checkpointer` (checkpointer.py) is the one writer and reader of a checkpoint directory for
the whole project (the RL loop, the drafter trainer, the exports read it); `CheckpointError`
the one-line, user-fixable error of every problem with one. leaves.py matches a template's
leaves with what Orbax stored; damage.py is a damaged step's one-line error and the noise its
failed read makes, dropped; writes.py a save that cannot be written (`SaveFailed`: no room on
its disk, checked before it starts, or its write failed), likewise. It imports nothing of the
project outside checkpoint/ (tests/test_tree.py).
"""

from tlt_jax.checkpoint.checkpointer import Checkpointer
from tlt_jax.checkpoint.leaves import CheckpointError
from tlt_jax.checkpoint.writes import SaveFailed

__all__ = ["Checkpointer", "CheckpointError", "SaveFailed"]
