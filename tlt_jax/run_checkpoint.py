"""A run's state in a checkpoint and back, and the policy's exports beside it: train.py saves
after every step (`save`: the learner, the drafter, the data position and the bandit's and
the gate's states; the drafter's EAGLE export and, asked for, the policy's Hugging Face
folder), exports the best policy by held-out accuracy (`best_policy`, `export_best`) and
restores once at start-up (`restore`: the workers' weights follow it)."""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import ml_collections

from tlt_jax import distributed
from tlt_jax import export as policy_export
from tlt_jax.checkpoint import CheckpointError
from tlt_jax.drafter import export as drafter_export
from tlt_jax.drafter import train_step as dts
from tlt_jax.errors import ConfigError
from tlt_jax.models import Params
from tlt_jax.rl import learner as rl_learner
from tlt_jax.rollout.policies.gate import GateState
from tlt_jax.rollout.policies.mab import BanditState
from tlt_jax.run import Run, TrainState


def _checkpoint_tree(run: Run, state: TrainState) -> dict[str, Any]:
  """What a checkpoint holds: the actor and its optimizer, the drafter and its optimizer,
  the step, and (as JSON) the data position, the bandit's and the gate's states."""
  meta = {"data": run.stream.saved(state.data),
          "selector": state.bandit.state_dict() if state.bandit is not None else None,
          "gate": state.gate.state_dict() if state.gate is not None else None}
  tree = {"actor": state.learner.params, "opt": state.learner.opt_state, "step": state.step,
          "meta": json.dumps(meta)}
  if run.tlt:
    _, d = run.store.drafter()
    tree["drafter"] = {"params": d.params, "opt_state": d.opt_state, "step": d.step}
  return tree


def save(run: Run, state: TrainState, *, force: bool = False) -> None:
  """An async checkpoint of `state` (every config.train.checkpoint_every steps, or `force`),
  and with it the drafter's EAGLE export (config.train.export_drafter), written at once: a
  drafter is a few MB, and the export must not wait for the checkpoint's bytes; with
  config.train.export_policy="every", the policy's Hugging Face folder too."""
  if not run.ckpt.save(state.step, _checkpoint_tree(run, state), force=force):
    return
  if run.cfg.train.export_policy == "every":
    export_policy(run, state)
  if run.export_engine is None:
    return
  _, d = run.store.drafter()
  params = d.params
  if jax.process_count() > 1:  # slices on other processes: every process takes part
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if distributed.is_primary():
    drafter_export.export_step(run.cfg.workdir, state.step, params, run.model_cfg,
                               engine=run.export_engine,
                               target_hf_config=run.target_hf_config,
                               keep=run.cfg.train.keep_checkpoints)


def export_policy(run: Run, state: TrainState) -> None:
  """The policy of checkpoint `state.step` as <workdir>/policy_hf/<step>/ (tlt_jax/export.py),
  the newest train.keep_checkpoints of them kept. Every process calls it: the gather of each
  tensor is a collective."""
  cfg = run.cfg
  policy_export.export_step(cfg.workdir, state.step, policy(run, state), run.model_cfg,
                            model_dir=cfg.model.path, dtype=_export_dtype(cfg),
                            keep=cfg.train.keep_checkpoints)


def best_policy(run: Run, start: int) -> policy_export.BestPolicy | None:
  """config.train.export_best's choice of the best policy (None: not asked for), its bar
  what the workdir holds up to step `start` (`BestPolicy.resume`: process 0's view, every
  process's bar)."""
  metric = run.cfg.train.export_best
  if not metric or run.test_rows is None:
    return None
  primary = distributed.is_primary()
  bar = policy_export.BestPolicy.resume(run.cfg.workdir, metric, start).bar if primary else None
  return policy_export.BestPolicy(run.cfg.workdir, metric,
                                  distributed.all_gather_objects(bar)[0])


def export_best(run: Run, best: policy_export.BestPolicy, state: TrainState,
                ev: dict[str, Any] | None) -> bool:
  """config.train.export_best after step `state.step`'s held-out evaluation `ev` (process
  0's; None elsewhere): its policy as <workdir>/policy_hf/best/ where it scored best so far
  (`BestPolicy`). Every process calls it: process 0's score decides, and the gathers are
  collectives."""
  value = distributed.all_gather_objects(best.value(ev) if ev is not None else None)[0]
  cfg = run.cfg
  return best.offer(state.step, value, lambda out, notes: policy_export.write_policy(
      out, policy(run, state), run.model_cfg, model_dir=cfg.model.path,
      dtype=_export_dtype(cfg), notes=notes))


def policy(run: Run, state: TrainState) -> Params:
  """The policy for the exports: the params, or with LoRA the base with the adapters attached,
  which the writer merges a layer at a time (hf_io.hf_state_dict)."""
  return rl_learner.rollout_policy(state.learner, run.learner)


def _export_dtype(cfg: ml_collections.ConfigDict) -> str:
  return policy_export.policy_dtype(cfg.train.export_dtype, cfg.model.path,
                                    cfg.model.param_dtype)


def restore(run: Run, state: TrainState) -> TrainState:
  """The latest checkpoint in the workdir as the state (the given one, fresh, if there is
  none): the learner, the data position and the policies rebuilt from what it saved; the
  workers' weights follow it."""
  if run.ckpt.latest_step() is None:
    return state
  try:  # (the drafter: a run may switch TLT on or off between restarts, workdir.check_resume)
    saved = run.ckpt.restore(_checkpoint_tree(run, state), optional=("drafter",))
  except CheckpointError as e:
    raise ConfigError(f"--workdir {run.cfg.workdir}: {e}") from None  # e says the fix
  meta = json.loads(saved["meta"])  # (an older run's "buffer" entry: nothing to restore)
  bandit, gate = state.bandit, state.gate
  if meta.get("selector") and bandit is not None:
    try:
      bandit = BanditState.restore(bandit.cfg, meta["selector"])
    except ValueError as e:  # another bandit (or an older layout): it measures afresh
      print(f"the checkpoint's bandit state is not this run's ({e}); the bandit starts fresh",
            file=sys.stderr)
  if meta.get("gate") and gate is not None:
    gate = GateState.restore(gate.cfg, meta["gate"])
  state = TrainState(step=int(saved["step"]),
                     learner=state.learner.replace(params=saved["actor"],
                                                   opt_state=saved["opt"]),
                     data=run.stream.resume(meta["data"]), bandit=bandit, gate=gate)
  run.store.publish_actor(run.coordinator.to_rollout(
      rl_learner.rollout_policy(state.learner, run.learner)))
  if "drafter" in saved:  # (else TLT was off: the drafter starts as a fresh run's does)
    run.store.publish_drafter(dts.DrafterState(**saved["drafter"]))
  run.coordinator.push()
  print(f"resumed from {run.ckpt.directory} at step {state.step}", file=sys.stderr)
  return state
