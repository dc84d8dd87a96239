"""Per-worker state over one RL step, and the spot-training figures read off it.

A worker is GENERATING its share of the rollout, then IDLE (its share is done, others still
decode), TRAINING the drafter during that idle window, and at the global rollout barrier (the
last worker finished) it stops: an in-flight drafter step finishes or is dropped. Intervals
are wall-clock seconds since the step began. Pure host code: the coordinator records, the
metrics and the Gantt plot (scripts/plot_timeline.py) read.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from typing import Any


class WorkerState(str, enum.Enum):
  GENERATING = "generating"
  IDLE = "idle"
  TRAINING = "training"
  DONE = "done"  # released at the barrier (an in-flight step may still be finishing)


@dataclasses.dataclass
class Interval:
  worker: int
  state: WorkerState
  start: float
  end: float


class Timeline:
  """Thread-safe state log of every worker for one step (`enter` from worker threads)."""

  def __init__(self, num_workers: int, clock=time.perf_counter):
    self.num_workers = num_workers
    self._clock = clock
    self.t0 = clock()
    self._open: dict[int, tuple[WorkerState, float]] = {}
    self.intervals: list[Interval] = []
    self.barrier: float | None = None  # the last worker finished generating
    self.returned: float | None = None  # the rollout handed its results back
    self.released: float | None = None  # merged drafter on every worker
    self.waited = 0.0  # seconds the step waited for a drafter settling beside it
    self._lock = threading.Lock()

  def now(self) -> float:
    return self._clock() - self.t0

  def enter(self, worker: int, state: WorkerState) -> float:
    t = self.now()
    with self._lock:
      prev = self._open.get(worker)
      if prev is not None:
        self.intervals.append(Interval(worker, prev[0], prev[1], t))
      if state is WorkerState.DONE:
        self._open.pop(worker, None)
      else:
        self._open[worker] = (state, t)
    return t

  def state(self, worker: int) -> WorkerState:
    with self._lock:
      s = self._open.get(worker)
      return s[0] if s else WorkerState.DONE

  def mark_barrier(self) -> float:
    self.barrier = self.now()
    return self.barrier

  def mark_returned(self) -> float:
    self.returned = self.now()
    return self.returned

  def mark_released(self) -> float:
    self.released = self.now()
    return self.released

  def add_wait(self, seconds: float) -> None:
    with self._lock:
      self.waited += seconds

  def close(self) -> None:
    """Ends every open interval now (DONE)."""
    for w in list(self._open):
      self.enter(w, WorkerState.DONE)

  # ------------------------------------------------------------------------------- figures
  def seconds(self, worker: int, state: WorkerState, until: float | None = None) -> float:
    """Time `worker` spent in `state`, counting only up to `until` (e.g. the barrier)."""
    total = 0.0
    for iv in self.intervals:
      if iv.worker == worker and iv.state is state:
        end = iv.end if until is None else min(iv.end, until)
        total += max(end - iv.start, 0.0)
    return total

  def summary(self) -> dict[str, Any]:
    """The `spot` metrics of a step (sums over workers):
      generating_s  time decoding
      idle_s        time between a worker's share finishing and the barrier (the straggler
                    wait: capacity that would be wasted)
      training_s    the part of idle_s spent training the drafter
      idle_share_trained  training_s / idle_s (the figure of merit)
      critical_path_s  drafter time after the barrier that the step waited for: until the
                    rollout handed its results back (in-flight steps finishing, merge, push,
                    when it settles the drafter first), plus, with `overlap_settle`, what the
                    caller's settle() took (the in-flight steps' end, merge, push): what
                    training costs the step
    """
    barrier = self.barrier if self.barrier is not None else self.now()
    per = []
    for w in range(self.num_workers):
      gen = self.seconds(w, WorkerState.GENERATING)
      train = self.seconds(w, WorkerState.TRAINING, until=barrier)
      idle = train + self.seconds(w, WorkerState.IDLE, until=barrier)
      per.append({"worker": w, "generating_s": gen, "idle_s": idle, "training_s": train})
    idle = sum(p["idle_s"] for p in per)
    train = sum(p["training_s"] for p in per)
    handed = next((t for t in (self.returned, self.released) if t is not None), barrier)
    return {"generating_s": sum(p["generating_s"] for p in per), "idle_s": idle,
            "training_s": train, "idle_share_trained": train / idle if idle > 0 else None,
            "critical_path_s": max(handed - barrier, 0.0) + self.waited,
            "barrier_s": barrier, "per_worker": per}

  def to_json(self) -> dict[str, Any]:
    return {"barrier": self.barrier, "returned": self.returned, "released": self.released,
            "waited": self.waited,
            "intervals": [[iv.worker, iv.state.value, iv.start, iv.end]
                          for iv in self.intervals]}


def concat_rollouts(timelines: list[Timeline]) -> tuple[dict[str, Any], dict[str, Any]]:
  """The timelines of one step's rollouts (several with grpo.filter_groups), in order, each
  settled -> the step's (`summary`, `to_json`) on the first one's clock: seconds summed per
  worker, the barrier and the drafter's arrival the last rollout's, the critical path the
  sum; the JSON's `rollouts` holds when each began (only with several)."""
  if len(timelines) == 1:
    return timelines[0].summary(), timelines[0].to_json()
  parts = [(tl.t0 - timelines[0].t0, tl.summary(), tl.to_json()) for tl in timelines]
  per = [{"worker": w, **{k: sum(s["per_worker"][w][k] for _, s, _ in parts)
                          for k in ("generating_s", "idle_s", "training_s")}}
         for w in range(timelines[0].num_workers)]
  idle, train = sum(p["idle_s"] for p in per), sum(p["training_s"] for p in per)
  last_offset, last, last_js = parts[-1]
  summary = {"generating_s": sum(p["generating_s"] for p in per), "idle_s": idle,
             "training_s": train, "idle_share_trained": train / idle if idle > 0 else None,
             "critical_path_s": sum(s["critical_path_s"] for _, s, _ in parts),
             "barrier_s": last["barrier_s"] + last_offset, "per_worker": per}
  js = {k: None if last_js[k] is None else last_js[k] + last_offset
        for k in ("barrier", "returned", "released")}
  js["waited"] = sum(j["waited"] for _, _, j in parts)
  js["intervals"] = [[w, state, a + off, b + off] for off, _, j in parts
                     for w, state, a, b in j["intervals"]]
  js["rollouts"] = [off for off, _, _ in parts]
  return summary, js


def merge_processes(parts: list[tuple[dict[str, Any], dict[str, Any]]]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Every process's (`summary`, `to_json`) of one step, in process order -> the job's: the
  workers numbered process after process, each process's times on its own rollout clock (the
  processes start a rollout together, after the step's collectives, so the clocks agree to
  within that skew), seconds summed over the workers, the barrier the last process's, the
  critical path the longest."""
  per, intervals, offset = [], [], 0
  for summary, js in parts:
    per += [{**p, "worker": p["worker"] + offset} for p in summary["per_worker"]]
    intervals += [[w + offset, *rest] for w, *rest in js["intervals"]]
    offset += len(summary["per_worker"])

  def last(key, items):
    return max((x[key] for x in items if x[key] is not None), default=None)
  idle, train = sum(p["idle_s"] for p in per), sum(p["training_s"] for p in per)
  summaries, jsons = [s for s, _ in parts], [j for _, j in parts]
  summary = {"generating_s": sum(p["generating_s"] for p in per), "idle_s": idle,
             "training_s": train, "idle_share_trained": train / idle if idle > 0 else None,
             "critical_path_s": last("critical_path_s", summaries),
             "barrier_s": last("barrier_s", summaries), "per_worker": per}
  js = {k: last(k, jsons) for k in ("barrier", "returned", "released", "waited")}
  if "rollouts" in jsons[0]:  # (every process rolls out as often: the first one's starts)
    js["rollouts"] = jsons[0]["rollouts"]
  return summary, {**js, "intervals": intervals}


# ------------------------------------------------------------------------------- the plot
PLOT_COLORS = {"generating": "#4C72B0", "idle": "#DD8452", "training": "#55A868"}


def plot(timelines: dict[int, dict], metrics: dict[int, dict], steps: list[int], out: str,
         *, time_label: str = "seconds since the rollout began",
         labels: dict[int, str] | None = None) -> None:
  """One PNG, a panel per step: each worker's intervals (`Timeline.to_json`), the barrier and
  the merged drafter's arrival; `metrics[step]["spot"]` (`Timeline.summary`) titles a panel,
  after `labels[step]` (default "step N").
  scripts/plot_timeline.py draws a run's; the cluster simulator its predicted ones."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch
  fig, axes = plt.subplots(len(steps), 1, figsize=(11, 1.0 + 1.1 * len(steps) * max(
      1 + max((iv[0] for t in timelines.values() for iv in t["intervals"]), default=0), 2) / 2),
                           squeeze=False)
  for ax, step in zip(axes[:, 0], steps):
    tl = timelines[step]
    workers = sorted({iv[0] for iv in tl["intervals"]})
    for w, state, start, end in tl["intervals"]:
      if state in PLOT_COLORS and end > start:
        ax.barh(w, end - start, left=start, height=0.6, color=PLOT_COLORS[state])
    for start in tl.get("rollouts", [])[1:]:  # (grpo.filter_groups: the step's next rollouts)
      ax.axvline(start, color="0.5", lw=1, ls="--")
    if tl.get("barrier") is not None:
      ax.axvline(tl["barrier"], color="k", lw=1)
    if tl.get("released") is not None:
      ax.axvline(tl["released"], color="k", lw=1, ls=":")
    spot = metrics.get(step, {}).get("spot", {})
    share = spot.get("idle_share_trained")
    title = (labels or {}).get(step, f"step {step}")
    if share is not None:
      title += (f": {spot['idle_s']:.1f} s idle worker time, {share:.0%} of it training the "
                f"drafter; {spot['critical_path_s'] * 1000:.0f} ms of drafter time after the "
                "barrier")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_yticks(workers)
    ax.set_yticklabels([f"worker {w}" for w in workers])
    ax.invert_yaxis()
  dashed = ("; dashed: the step's next rollout"
            if any(len(timelines[s].get("rollouts", ())) > 1 for s in steps) else "")
  axes[-1, 0].set_xlabel(f"{time_label} (solid line: barrier, the last worker done; "
                         f"dotted: merged drafter on every worker{dashed})")
  fig.legend(handles=[Patch(color=c, label=s) for s, c in PLOT_COLORS.items()], loc="upper right",
             ncol=3, fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.96))
  fig.savefig(out, dpi=120)
  plt.close(fig)
