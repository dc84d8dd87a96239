"""What the speculation gate keeps across runs (gate.py): hardware verdicts and compile costs,
one JSON file beside JAX's persistent compilation cache, keyed by everything they depend on."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from typing import Any, Mapping

import jax
import numpy as np

_log = logging.getLogger(__name__)


class VerdictCache:
  """What the gate keeps across runs: one JSON file, one entry per `fingerprint` (a dict of
  everything it depends on: device kind, JAX version, model and drafter shapes, dtype, cache
  length, chunk, sampling; the caller builds it), with each bucket -> the decision that
  declined it for hardware, and the compile costs measured (`payoff.Ledger.costs`: a later run
  loads its executables from JAX's persistent cache in milliseconds, and must still price a
  compile at what it costs cold). Acceptance verdicts are not kept: whether drafts are
  accepted depends on the drafter and the policy, which move during a run.

  Reads and writes never fail a run: an unreadable file is a cache miss (logged), a write
  goes to a temporary file renamed over the old one (processes that write at once leave one
  of their files whole)."""

  def __init__(self, path: str, fingerprint: Mapping[str, Any]):
    self.path = os.path.expanduser(path)
    self.fingerprint = dict(fingerprint)
    blob = json.dumps(self.fingerprint, sort_keys=True, default=str)
    self.key = hashlib.sha256(blob.encode()).hexdigest()[:24]

  def _read(self) -> dict[str, Any]:
    try:
      with open(self.path) as f:
        data = json.load(f)
      return data if isinstance(data, dict) else {}
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:
      _log.warning("speculation gate: ignoring the verdict cache %s (%s)", self.path, e)
      return {}

  def _entry(self) -> dict[str, Any]:
    entry = self._read().get(self.key, {})
    return entry if isinstance(entry, dict) else {}

  def load(self) -> dict[int, dict[str, Any]]:
    """bucket -> the cached hardware decision, for this fingerprint."""
    try:
      return {int(b): dict(d) for b, d in self._entry().get("declined", {}).items()}
    except (AttributeError, TypeError, ValueError):
      return {}

  def load_costs(self) -> dict[str, Any]:
    """The compile costs kept for this fingerprint ({} if none)."""
    costs = self._entry().get("costs", {})
    return costs if isinstance(costs, dict) else {}

  def update(self, declined: Mapping[int, Mapping[str, Any]] | None = None,
             costs: Mapping[str, Any] | None = None) -> None:
    """Replaces this fingerprint's verdicts with `declined` (bucket -> decision) and/or its
    compile costs with `costs` (None: kept as they are)."""
    data = self._read()
    old = data.get(self.key, {}) if isinstance(data.get(self.key), dict) else {}
    entry = dict(old)
    if declined is not None:
      entry["declined"] = {str(b): dict(d) for b, d in declined.items()}
    if costs is not None:
      entry["costs"] = dict(costs)
    if not entry.get("declined"):
      entry.pop("declined", None)
    if not entry.get("costs"):
      entry.pop("costs", None)
    if entry:
      data[self.key] = {**entry, "fingerprint": self.fingerprint}
    elif data.pop(self.key, None) is None:
      return
    if data.get(self.key) == old:
      return
    try:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
      os.replace(tmp, self.path)
    except OSError as e:
      _log.warning("speculation gate: could not write the verdict cache %s (%s)", self.path, e)


def for_run(cache: str, model_cfg, ecfg, sampling, dparams, devices) -> VerdictCache | None:
  """Where the speculation gate keeps its hardware verdicts across runs: beside the run's
  persistent compilation cache (config `compilation_cache`), keyed by what a verdict depends
  on. None when the config names no cache: a cold compilation cache is a cold gate (whatever
  cache this process was given another way, e.g. the test suite's, keeps no verdicts)."""
  if not cache:
    return None
  cache = os.path.expanduser(cache)
  devices = list(devices)
  fingerprint = {
      "jax": jax.__version__, "platform": devices[0].platform,
      "device_kind": devices[0].device_kind, "replica_devices": len(devices),
      "host": [platform.machine(), os.cpu_count()],  # (a CPU's "device kind" is just cpu)
      "model": repr(model_cfg), "drafter": repr(jax.tree.map(np.shape, dparams)),
      "engine": repr(ecfg), "sampling": repr(sampling)}
  return VerdictCache(os.path.join(cache, "tlt_gate", "verdicts.json"), fingerprint)
