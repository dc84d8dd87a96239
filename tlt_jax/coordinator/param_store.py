"""One owner for the weights every rollout worker needs: the actor and the drafter, versioned.

The learner publishes a new actor after its update; the coordinator publishes the merged
drafter at the rollout barrier (or after serial training). Workers compare versions (an int,
cheap enough to do between decode chunks) and pull what is newer onto their own devices.
Nothing else holds a "current" copy: trainer, workers and checkpoint all read from here.
"""

from __future__ import annotations

import threading
from typing import Any


class ParamStore:
  def __init__(self, actor: Any, drafter: Any = None):
    self._lock = threading.Lock()
    self._actor, self._drafter = actor, drafter
    self.actor_version = 0
    self.drafter_version = 0

  def publish_actor(self, params: Any) -> int:
    with self._lock:
      self._actor = params
      self.actor_version += 1
      return self.actor_version

  def release_actor(self) -> None:
    """Drops the actor (the workers have released theirs: its memory goes back to the
    learner's phases); the next `publish_actor` brings the updated one."""
    with self._lock:
      self._actor = None

  def publish_drafter(self, state: Any) -> int:
    """state: a DrafterState (params + optimizer state + step)."""
    with self._lock:
      self._drafter = state
      self.drafter_version += 1
      return self.drafter_version

  def actor(self) -> tuple[int, Any]:
    with self._lock:
      return self.actor_version, self._actor

  def drafter(self) -> tuple[int, Any]:
    with self._lock:
      return self.drafter_version, self._drafter
