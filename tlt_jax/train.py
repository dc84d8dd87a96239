"""GRPO training with TLT's adaptive rollout: `python -m tlt_jax.train --config configs/X.py`.

  python -m tlt_jax.train --config configs/default.py [--workdir DIR] [--config.key=value ...]
  python -m tlt_jax.train --config configs/default.py --config.tlt.enabled=False   # baseline
  python -m tlt_jax.train --config configs/default.py --config.tlt.drafter.mode=serial

The script, top to bottom: `build` (tlt_jax/run.py: mesh, model, data, learner, drafter,
rollout workers, checkpoints) -> `restore` the TrainState if the workdir holds a checkpoint
(run.py) -> `rl_step(state) -> (state, metrics)` until config.train.steps -> `save(state)`
after every step (run.py). The step's rollouts are tlt_jax/step_rollouts.py's, its metrics
record tlt_jax/step_metrics.py's.

One RL step (`rl_step`; README: architecture):
  prompts (PromptStream, resumable position)
  -> coordinator.rollout: each rollout worker decodes its share (continuous batching; plain
     decoding while the batch is large, speculative decoding with the drafter in the long
     tail); each finished response goes to the reward pool and, windowed, with the hidden
     states the rollout already computed, to the drafter buffer; a worker whose share is done
     trains its drafter copy from the buffer ("spot" training) until the last worker
     finishes; there the copies are merged and pushed to every worker
  -> rewards (process pool, scored while the tail still decodes); with grpo.filter_groups
     (DAPO's dynamic sampling) more prompts roll out while too few groups carry signal
  -> group advantages (tlt_jax/rl/samples.py)
  -> learner: old/ref log-probs recomputed in micro-batches, clipped-ratio update with
     gradient accumulation (FSDP over the mesh, donated state)
  -> coordinator.sync_actor: the new params into every worker's layout, on device.

Output in the workdir: metrics.jsonl (one JSON object per step: time breakdown, reward,
accuracy, lengths, tokens/s, speculation, spot training, eval), timeline.jsonl (per step,
every worker's GENERATING / IDLE / TRAINING intervals: scripts/plot_timeline.py draws them),
tb/ (TensorBoard, the same scalars), checkpoints/ (async Orbax: actor, optimizer, drafter and
its optimizer, step, data position, the bandit's and the gate's states), drafter_eagle/<step>/
beside each checkpoint of a TLT run (the drafter's EAGLE export for vLLM / SGLang,
tlt_jax/drafter/export.py; config.train.export_drafter), policy_hf/<step>/ (the policy as a
Hugging Face folder: the last checkpoint's at the end of the run, or every checkpoint's;
tlt_jax/export.py, config.train.export_policy). Re-running the same command resumes from the
latest checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

from tlt_jax import config as config_lib
from tlt_jax import checkpoint, device_memory, distributed, optim, runtime, watchdog, workdir
from tlt_jax import export as policy_export
from tlt_jax.coordinator.coordinator import merge_spot_metrics
from tlt_jax.coordinator.timeline import concat_rollouts
from tlt_jax.eval import accuracy_text, sampling_of
from tlt_jax.eval import evaluate as evaluate_rows
from tlt_jax.curves import plot_runs
from tlt_jax.metrics import MetricsWriter, read_records
from tlt_jax.profiling import StepProfiler
from tlt_jax.rl import batching
from tlt_jax.rl import learner as rl_learner
from tlt_jax.rl.samples import learner_samples, signal_groups
from tlt_jax.rl.reward_pool import RewardPool
from tlt_jax.rollout.policies.cells import Policies, PolicyCells
from tlt_jax.rollout.policies.mab import BanditState
from tlt_jax.run import Run, TrainState, build
from tlt_jax.run_checkpoint import best_policy, export_best, export_policy, restore, save
from tlt_jax.step_metrics import job_views, local_compiles, progress_fields, step_metrics
from tlt_jax.step_rollouts import logged_responses, rollouts, seed_for
from tlt_jax.wandb_log import WandbRun


# ================================================================================ RL step
def rl_step(run: Run, state: TrainState, pool: RewardPool
            ) -> tuple[TrainState, dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
  """One RL step (the module docstring) -> (state, metrics, timeline of the workers, the
  responses config.train.log_rollouts logs)."""
  cfg, step = run.cfg, state.step
  seed = seed_for(cfg.seed, step)
  times: dict[str, float] = {}
  peaks: dict[str, int] = {}  # each phase's device peak so far at its end (GPUs: memory_stats)
  t_step = time.perf_counter()

  # ---- rollout(s) (from the train state's policies, to the next), rewards as responses finish
  drafting = run.store.drafter()[1] if run.tlt else None  # the drafter of this rollout
  # its acceptance is measured while speculation's data is wanted (the gate's drafter_wanted:
  # where no draft can pay, the drafter is neither trained nor used, and the metric would be a
  # cost of TLT on every step); the executable compiles while the rollout runs
  measure = run.acceptance is not None and (state.gate is None or state.gate.drafter_wanted())
  # the policy as the forward takes it (with LoRA: the adapters beside the base, unmerged)
  actor = rl_learner.policy_tree(state.learner.params, state.learner.base, run.learner)
  if measure:
    run.acceptance.prepare(actor, drafting.params)
  with device_memory.phase("rollout", run, step + 1, peaks):
    ro = rollouts(run, state, pool, seed)
  prompts, responses = ro.prompts, ro.responses
  times["rollout"] = sum(ro.walls)
  times["reward_wait"] = ro.reward_wait

  # ---- advantages
  r, penalty, samples, groups = learner_samples(responses, len(prompts), cfg)

  # ---- learner: old log-probs, then the update (none when every response was dropped)
  t = time.perf_counter()
  batches = batching.minibatches(samples, run.learner, cfg.grpo.minibatches, seed=seed)
  with device_memory.phase("logprobs", run, step + 1, peaks):
    prepared = rl_learner.prepare(state.learner, batches, run.learner) if samples else []
    jax.block_until_ready(prepared)
  times["logprobs"] = time.perf_counter() - t
  acceptance = None
  if measure:
    # the drafter this rollout drafted with against the policy that wrote it (before the
    # update), on a sample of its responses: staleness as it happens, speculating or not
    t = time.perf_counter()
    acceptance = run.acceptance(actor, drafting.params, responses, seed=seed)
    times["acceptance"] = time.perf_counter() - t
  t = time.perf_counter()
  with device_memory.phase("update", run, step + 1, peaks):
    learner, upd = rl_learner.update(state.learner, prepared, run.learner)
  times["update"] = time.perf_counter() - t
  if cfg.reward.overlong_buffer:
    upd["overlong_penalty"] = float(penalty.mean())
  if cfg.grpo.drop_truncated:
    upd["dropped_truncated"] = cfg.grpo.n * len(groups) - len(samples)

  # ---- the drafter settled (merged, on every worker: with one process it settles while the
  # learner runs), then the new weights to the workers; the serial drafter ablation
  with device_memory.phase("spot", run, step + 1, peaks):
    drafter = merge_spot_metrics([settle() for settle in ro.settles])
  spot, timeline_json = concat_rollouts(ro.timelines)
  chunks, reward_stats, compiles = ro.chunks, pool.stats, local_compiles(run)
  if jax.process_count() > 1:  # the job's view: every process's workers, chunks, rewards, compiles
    chunks, spot, timeline_json, reward_stats, compiles = job_views(
        chunks, spot, timeline_json, reward_stats, compiles)
  times["idle"] = spot["idle_s"] / max(len(run.coordinator.workers), 1)
  times["drafter"] = spot["critical_path_s"]
  with device_memory.phase("sync", run, step + 1, peaks):
    times["weight_sync"] = run.coordinator.sync_actor(rl_learner.rollout_policy(learner,
                                                                                run.learner))
  if run.coordinator.spot.mode == "serial":
    t = time.perf_counter()
    drafter = run.coordinator.train_serial(run.coordinator.spot.serial_steps, seed=seed)
    times["drafter"] = time.perf_counter() - t

  # ---- metrics
  m = step_metrics(run, prompts, responses, r, chunks, ro.walls, upd, reward_stats, spot,
                   drafter, epoch=ro.data.epoch, gate=ro.policies.gate, compiles=compiles)
  if cfg.grpo.filter_groups:
    m["filter_groups"] = {"rollouts": len(ro.walls), "groups": len(prompts),
                          "signal_groups": int(signal_groups(responses, len(prompts),
                                                             cfg).sum()),
                          "trained_groups": len(groups)}
  if acceptance is not None:
    m["drafter_acceptance"] = acceptance
  if peaks:
    m["memory"] = device_memory.measured(peaks, run.memory)
  times["total"] = time.perf_counter() - t_step
  times.update(run.compile_clock.lap())
  m["time"] = times
  logged = logged_responses(prompts, responses, run.tokenizer, cfg.train.log_rollouts)
  return (TrainState(step + 1, learner, ro.data, ro.policies.bandit, ro.policies.gate), m,
          timeline_json, logged)


def evaluate(run: Run, pool: RewardPool, state: TrainState, bandit: BanditState | None
             ) -> tuple[dict[str, Any], BanditState | None]:
  """Held-out accuracy (config.eval's responses per prompt and sampling), decoded by worker 0
  with evaluation's own bandit (`bandit`, returned updated) and the train state's gate, read
  but not moved; with config.eval.log_responses, `responses` (eval_responses.jsonl's)."""
  d, w = run.cfg.data, run.coordinator.workers[0]
  cells = PolicyCells.of(Policies(bandit, state.gate), measure=False)
  n, sampling = sampling_of(run.cfg)
  with device_memory.phase("rollout", run, state.step):  # (evaluation decodes)
    m = w.submit(evaluate_rows, w.engine, run.tokenizer, run.test_rows, pool,
                 seed=run.cfg.seed, progress=False, chat_template=d.chat_template,
                 system_prompt=d.system_prompt, policies=cells,
                 speculate=run.cfg.eval.speculate, n=n, sampling=sampling,
                 keep=run.cfg.eval.log_responses).result()
  return ({k: v for k, v in m.items() if k in (
      "accuracy", "accuracy_by_terms", "pass_at", "accuracy_by_source", "prompts_by_source",
      "pass_at_by_source", "response_length", "tokens_per_second", "reward_extra",
      "responses")},
          cells.states().bandit)


# =================================================================================== loop
def train(run: Run, state: TrainState, *, progress: bool = True, board: WandbRun | None = None
          ) -> tuple[TrainState, dict[str, Any]]:
  """Resumes if the workdir holds a checkpoint, then runs to config.train.steps (each step's
  metrics also to `board`, process 0's wandb run, where given). Returns the last state and
  the last step's metrics."""
  cfg = run.cfg
  state = restore(run, state)
  start = state.step
  primary = distributed.is_primary()  # process 0 writes metrics and shows progress
  if primary:
    workdir.write_config(cfg)  # (once the checkpoint restored: config.json is what ran)
  if start >= cfg.train.steps and primary:
    print(f"{cfg.workdir} already holds a finished run ({start} of {cfg.train.steps} steps); "
          "raise --config.train.steps to continue it or pass a new --workdir", file=sys.stderr)
  writer = MetricsWriter(cfg.workdir, start if start > 0 else -1, board) if primary else None
  evaluating = run.test_rows is not None and primary  # worker 0 is process 0's
  eval_bandit = run.eval_bandit  # evaluation's (not checkpointed: a resume starts it afresh)
  pool = runtime.reward_pool(cfg)
  bar = None
  if progress and primary:
    bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", file=sys.stderr,
               dynamic_ncols=True)
  last: dict[str, Any] = {}
  interrupted = stuck = 0  # stuck: steps in a row whose every mini-batch was skipped
  halted = None  # out of device memory or disk, or stuck: said once the saves in flight end
  stopped = None  # (step, signal) where a stop request (SIGTERM) ended the run
  profiler = StepProfiler(run.profile, cfg.workdir, jax.process_index(),
                          sys.stderr if primary else None)
  best = best_policy(run, start)  # None unless config.train.export_best
  # a run alive but making no progress (a collective whose peer never comes) ends with every
  # thread's stack instead of holding its devices forever (tlt_jax/watchdog.py)
  # (with several processes, on the job's progress: a process waiting on another's is not stuck)
  hang = watchdog.Watchdog(cfg.train.hang_timeout_s, cfg.workdir, jax.process_index(),
                           step=lambda: state.step,
                           peers=distributed.ProgressBoard() if jax.process_count() > 1 else None
                           ).start()
  try:
    with pool, distributed.StopRequest() as stop:
      if start == 0 and evaluating:
        t = time.perf_counter()
        ev, eval_bandit = evaluate(run, pool, state, eval_bandit)
        writer.responses("eval_responses", 0, ev.pop("responses", ()))
        writer.write(0, {"eval": ev, "time": {"eval": time.perf_counter() - t}})
        print(f"step 0: held-out accuracy {accuracy_text(ev)}", file=sys.stderr)
      if start == 0 and best is not None:  # (the starting policy's score: the first bar)
        export_best(run, best, state, ev if evaluating else None)
      while state.step < cfg.train.steps:
        with profiler.step(state.step + 1):  # (a trace only of the steps config.profile names)
          state, m, timeline, logged = rl_step(run, state, pool)
        due = run.test_rows is not None and (state.step % cfg.train.eval_every == 0
                                             or state.step == cfg.train.steps)
        if evaluating and due:
          t = time.perf_counter()
          m["eval"], eval_bandit = evaluate(run, pool, state, eval_bandit)
          m["time"]["eval"] = time.perf_counter() - t
        if best is not None and due:  # (before the save: a resume redoes a step cut here)
          t = time.perf_counter()
          if export_best(run, best, state, m.get("eval")):
            m["time"]["export_best"] = time.perf_counter() - t
        watchdog.beat("the step's end (stop agreement, checkpoint)")
        signum = stop.agreed()  # (every process stops at the same step)
        t = time.perf_counter()
        save(run, state, force=state.step == cfg.train.steps or signum is not None)
        m["time"]["checkpoint"] = time.perf_counter() - t
        if writer is not None:  # (the responses apart from the metrics: their own files)
          writer.responses("eval_responses", state.step, m.get("eval", {}).pop("responses", ()))
          writer.responses("rollouts", state.step, logged)
          writer.write(state.step, m, timeline)
        profiler.after(state.step)  # (the step on disk: a trace that ends here is written)
        last = m
        if bar is not None:
          bar.set_postfix(progress_fields(m, state.gate))
          bar.update(1)
        # (its metrics and checkpoint written: steps whose every mini-batch was skipped)
        stuck = optim.stuck(stuck, m["loss"].get("grad_norm", 0.0), state.step, cfg)
        if signum is not None and state.step < cfg.train.steps:
          stopped = (state.step, signum)
          break
    watchdog.beat("the last checkpoint's save")
    run.ckpt.wait_until_finished()
    watchdog.beat("the policy's export")
    # the last checkpoint's policy, once the checkpoint is on disk, unless it is there already
    # (export_policy="every", or the run this one resumed wrote it: process 0's view counts)
    final = policy_export.policy_path(cfg.workdir, state.step)
    if (stopped is None and cfg.train.export_policy != "none"
        and not distributed.all_gather_objects(os.path.isdir(final))[0]):
      export_policy(run, state)
  except KeyboardInterrupt:  # (Ctrl-C) said once the saves in flight are on disk, below
    interrupted = state.step + 1
  except (device_memory.DeviceOutOfMemory, optim.NonFiniteUpdates, checkpoint.SaveFailed) as e:
    halted = e
  except OSError as e:  # the workdir's disk full under a metrics line or an export
    halted = checkpoint.writes.out_of_room(e, cfg.workdir)
    if halted is None:
      raise
  finally:
    if bar is not None:
      bar.close()
    profiler.close()  # (a run that ended inside the traced steps: the trace up to there)
    if writer is not None:
      writer.close()
    try:
      run.ckpt.close()
    except checkpoint.SaveFailed as e:  # (the last save in flight: said as the run's end)
      halted = halted or e
    run.close()
    hang.stop()
  if halted is not None:
    saved = workdir.saved_step(cfg.workdir)
    resume = getattr(halted, "resume", "the same command, changed so, resumes from it")
    raise type(halted)(f"{halted}; " + (
        f"step {saved}'s checkpoint is on disk: {resume}" if saved else "no checkpoint yet")
    ) from halted.__cause__
  if interrupted:
    saved = workdir.saved_step(cfg.workdir)
    raise KeyboardInterrupt(f"during step {interrupted}; " + (
        f"the same command resumes from the newest checkpoint, step {saved}" if saved else
        "no checkpoint yet: the same command starts again"))
  if stopped is not None:
    import signal
    raise distributed.Stopped(f"by {signal.Signals(stopped[1]).name} after step {stopped[0]} "
                              "of {}: its checkpoint is on disk and the same command resumes "
                              "from it".format(cfg.train.steps))
  return state, last


def main(argv):
  del argv
  cfg = _CONFIG.value
  if _WORKDIR.value:
    with cfg.unlocked():
      cfg.workdir = _WORKDIR.value
  runtime.setup_jax(cfg)  # before anything initialises JAX
  spec = config_lib.run_spec(cfg)
  distributed.initialize(spec.distributed)  # several processes: join them first
  spec = runtime.prepare(spec)
  # (the workdir held: before the model loads, so a wandb login problem costs nothing)
  board = WandbRun.start(spec.wandb, cfg.workdir, cfg.to_dict()) if (
      distributed.is_primary()) else None
  code = 1  # the wandb run's exit code: a failure's, a stop's (130, 143), or 0
  try:
    run, state = build(spec)
    state, last = train(run, state, board=board)
    distributed.barrier("tlt_jax.train.done")  # no process exits while another still saves
    code = 0
  except KeyboardInterrupt as e:  # (Ctrl-C; SIGTERM's stop: distributed.Stopped)
    code = getattr(e, "exit_code", 130)
    raise
  finally:
    if board is not None:
      board.close(code)
  if not distributed.is_primary():
    return
  path = os.path.join(cfg.workdir, "metrics.jsonl")
  records = read_records(path)
  evals = [rec["eval"] for rec in records if "eval" in rec]
  msg = f"done: {state.step} steps"
  if evals:
    msg += f"; held-out accuracy {accuracy_text(evals[0], evals[-1])}"
  if last:
    msg += f"; last step reward {last['reward']:.3f}"
  if cfg.train.export_best:
    best = policy_export.read_best(cfg.workdir)
    if best is not None and best.get("metric") == cfg.train.export_best:
      msg += (f"; best policy (step {best['step']}, {best['metric']} {best['value']:.3f}) in "
              f"{policy_export.best_path(cfg.workdir)}")
    else:
      msg += f"; no step beat the starting policy's {cfg.train.export_best}: no best policy"
  msg += f"; metrics in {path}"
  try:  # a figure is a convenience: it never fails a finished run
    plot_runs({os.path.basename(os.path.normpath(cfg.workdir)): records},
              os.path.join(cfg.workdir, "curves.png"))
    msg += ", curves.png beside it"
  except Exception as e:  # noqa: BLE001
    msg += f" (curves.png not drawn: {type(e).__name__}: {e})"
  print(msg, file=sys.stderr)


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
  _WORKDIR = flags.DEFINE_string("workdir", None, "overrides config.workdir")
  app.run(runtime.exit_on_user_error(main), flags_parser=config_lib.flags_parser)
