"""Rollout workers on their own devices, the weights they read, and spot drafter training in
their idle windows: `Coordinator` (coordinator.py) runs a rollout across `Worker`s, tracks
each worker's GENERATING / IDLE / TRAINING state (timeline.py), trains the drafter on idle
workers until the rollout barrier and merges the copies (spot.py), and syncs weights through
the versioned `ParamStore` (param_store.py)."""

from tlt_jax.coordinator.coordinator import Coordinator, RolloutOutcome, Worker
from tlt_jax.coordinator.param_store import ParamStore
from tlt_jax.coordinator.spot import SpotConfig, SpotReport, train_until
from tlt_jax.coordinator.timeline import Timeline, WorkerState

__all__ = ["Coordinator", "ParamStore", "RolloutOutcome", "SpotConfig", "SpotReport",
           "Timeline", "Worker", "WorkerState", "train_until"]
