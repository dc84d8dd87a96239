"""A training run's parts, built once from a validated config (`build`): the mesh and the
model, the prompts, the learner, the drafter and its data, the rollout workers and their
coordinator (with the speculation gate's verdict cache), the checkpointer; the state an RL
step takes and returns (`TrainState`: the learner, the data position, the bandit's and the
gate's states). That state in a checkpoint and back, with the exports: run_checkpoint.py.
tlt_jax/train.py runs the loop over them."""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np

from tlt_jax import config as config_lib
from tlt_jax import export as policy_export
from tlt_jax import runtime
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.coordinator import Coordinator, ParamStore, SpotConfig, Worker
from tlt_jax.data.dataset import Position, PromptStream
from tlt_jax.data.prompts import PromptRow, source_names, split_paths, train_weights
from tlt_jax.drafter import export as drafter_export
from tlt_jax.drafter import train_step as dts
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.loss import LossConfig
from tlt_jax.drafter.merge import make_merge
from tlt_jax.drafter.trainer import DrafterTrainer
from tlt_jax import distributed
from tlt_jax.errors import ConfigError
from tlt_jax.eval import held_out
from tlt_jax.metrics import CompileClock
from tlt_jax.models import ModelConfig, Params, lora, num_params, packed_impl
from tlt_jax.models.hf_io import read_hf_config
from tlt_jax.optim import make_optimizer
from tlt_jax.profiling import ProfileConfig
from tlt_jax.rl import learner as rl_learner
from tlt_jax.rollout.policies.verdicts import for_run as gate_verdicts
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.replica import (replica_shardings, to_replica_layout,
                                     to_replica_program)
from tlt_jax.rollout.executables import background_compiler
from tlt_jax.rollout.policies.cells import Policies, PolicyCells
from tlt_jax.rollout.policies.gate import GateState
from tlt_jax.rollout.sources.history import HistoryIndex
from tlt_jax.rollout.policies.mab import BanditState
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.step_metrics import DrafterAcceptance


@dataclasses.dataclass(frozen=True)
class Run:
  """What one training run is built from, once, by `build` from a validated config; what
  changes step to step is the TrainState (the rollout policies' states among it: a rollout
  takes them and returns the next, policies/cells.py). The buffer is the coordinator's store
  of drafter data (its contents are not checkpointed: a resumed run refills it)."""

  cfg: ml_collections.ConfigDict
  learner: rl_learner.LearnerSpec  # what the learner's jitted functions are specialised on
  model_cfg: ModelConfig
  tokenizer: Any  # transformers tokenizer of config.model.path
  stream: PromptStream  # the training prompts
  test_rows: list[PromptRow] | None  # held-out prompts (None: no evaluation)
  sampling: SamplingParams  # of the rollout
  store: ParamStore  # the actor and drafter versions the workers read
  coordinator: Coordinator  # the rollout workers
  tlt: bool  # speculation on (config.tlt.enabled)
  # evaluation's bandit at the start of a run (its own: never trains the training bandit)
  eval_bandit: BanditState | None
  buffer: DrafterBuffer | None  # the drafter's training data (None: drafter not trained)
  ckpt: Checkpointer
  compile_clock: CompileClock  # seconds compiling, per step
  # the serving engine of the drafter's EAGLE export written with every checkpoint, and the
  # target's config.json it carries (None: no export; config.train.export_drafter)
  export_engine: str | None = None
  target_hf_config: dict[str, Any] | None = None
  # the drafter's acceptance on each step's responses (None: TLT off or
  # tlt.drafter.acceptance_sample=0)
  acceptance: DrafterAcceptance | None = None
  memory: Any = None  # the memory plan it was started on (memory.Plan; device_memory.py)
  profile: ProfileConfig = ProfileConfig()  # the RL steps to trace (profiling.py)

  def close(self) -> None:
    """Stops the run's threads: the rollout workers', the compile clock's, the history
    indices' (the checkpointer is closed apart: its last save may fail)."""
    self.coordinator.close()
    self.compile_clock.close()
    for e in self.coordinator.engines:
      if e.history is not None:
        e.history.close()


class TrainState(NamedTuple):
  """What an RL step takes and returns: the steps done, the learner, where the prompts are
  and the host policies' states (pure values: rollout/policies/mab.py,
  rollout/policies/gate.py), which a checkpoint saves and a resume rebuilds. (The drafter's
  state is the store's: spot training merges into it during the rollout.)"""

  step: int
  learner: rl_learner.LearnerState
  data: Position = Position()
  bandit: BanditState | None = None  # the training bandit's (None: TLT off)
  gate: GateState | None = None  # the speculation gate's (None: no gate)

  @property
  def policies(self) -> Policies:
    return Policies(self.bandit, self.gate)


def learner_spec(spec: config_lib.RunSpec, model_cfg, mesh) -> rl_learner.LearnerSpec:
  """The learner's layout and optimizer of a run (config.grpo, config.optim); grpo.row_layout
  "auto": max-length rows where the packed attention is the fused kernel."""
  cfg = spec.cfg
  g, o = cfg.grpo, cfg.optim
  max_rows = g.row_layout == "max_len" or (
      g.row_layout == "auto" and packed_impl(model_cfg, g.pad_multiple)[0] == "fused")
  tx = make_optimizer(o.lr, warmup_steps=o.warmup_steps,  # (every optimizer step counted)
                      total_steps=cfg.train.steps * g.minibatches * g.ppo_epochs,
                      schedule=o.schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                      grad_clip=o.grad_clip)
  return rl_learner.LearnerSpec(model_cfg, spec.grpo, tx, mesh,
                          micro_batch=g.micro_batch, pad_multiple=g.pad_multiple,
                          micro_batch_tokens=g.micro_batch_tokens, max_rows=max_rows,
                          max_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                          lora=spec.lora)


def data_line(n: int, dropped: int, cfg: ml_collections.ConfigDict, empty: int = 0,
              test_rows=None, left_out: int = 0, train_sources=None, mixture=None) -> str:
  """The run's first line: how many training prompts it holds (from several files, each
  one's: `train_sources`, a Counter of the usable prompts' sources; with data.train_weights,
  `mixture`: (file name, usable prompts, weight) per file), and whether a step repeats them
  (a file smaller than one step's draw is most often the wrong file); then the held-out
  prompts evaluation takes (`test_rows`), each source's count where there are several, and
  how many it left out (`left_out`: too long, or of no token)."""
  g = cfg.grpo  # (a rollout's draw: grpo.gen_prompts with grpo.filter_groups)
  key, draw = (("grpo.gen_prompts", g.gen_prompts) if g.get("filter_groups") and
               g.get("gen_prompts") else ("grpo.num_prompts", g.num_prompts))
  few = (f"; fewer than the {draw} a rollout draws ({key}): every step repeats prompts"
         if n < draw else "")
  none = f", {empty} as encoding to no tokens" if empty else ""
  files = split_paths(cfg.data.train_path)
  where = (f"{len(files)} files ({', '.join(f'{s} {k}' for s, k in train_sources.items())}; "
           if len(files) > 1 and train_sources else f"{cfg.data.train_path} (")
  if mixture:  # (each file's share of an epoch's draws)
    each = ", ".join(f"{s} {k} at {w:.3g}" for s, k, w in mixture)
    where = f"{len(files)} file{'s' * (len(files) > 1)} weighted ({each}; "
  line = (f"data: {n} training prompts from {where}{dropped} dropped as longer "
          f"than max_prompt_len={cfg.data.max_prompt_len} tokens{none}){few}")
  if test_rows:
    sources = collections.Counter(r.source for r in test_rows)
    parts = ([f"{name} {k}" for name, k in sources.items()] if len(sources) > 1 else [])
    if left_out:
      parts.append(f"{left_out} left out, longer than max_prompt_len or of no token")
    line += f"; {len(test_rows)} held-out prompts" + (f" ({', '.join(parts)})" if parts else "")
  return line


def build(spec: config_lib.RunSpec) -> tuple[Run, TrainState]:
  """Everything the run of `spec` needs (runtime.prepare's: max_batch resolved, the workdir
  made), and its state at step 0."""
  cfg = spec.cfg
  compile_clock = CompileClock()
  # ------------------------------------------------------------------- mesh and model
  mesh = runtime.learner_mesh(cfg)
  # (the prompts first: chat-message prompts add the template's end of turn to the stop ids)
  train_rows = runtime.load_train_rows(cfg)
  test_rows = None
  if cfg.data.test_path and cfg.train.eval_every > 0:
    test_rows = runtime.load_test_rows(cfg)
  best = policy_export.best_source(cfg.train.export_best)
  sources = {r.source for r in test_rows or ()}
  if best is not None and best not in sources:  # (config.py checked the rest)
    raise ConfigError("names no held-out source: use " + ", ".join(
        f"accuracy:{s}" for s in sorted(sources)) + " or accuracy", "train.export_best",
        cfg.train.export_best, in_config=True)
  model_cfg, params, tokenizer, stop = runtime.load_model(
      cfg, mesh=mesh, rows=train_rows + (test_rows or []))
  left_out = 0
  if test_rows:  # (as the training stream below leaves them out)
    test_rows, left_out = held_out(test_rows, tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                                   chat_template=cfg.data.chat_template,
                                   system_prompt=cfg.data.system_prompt)

  # ----------------------------------------------------------------------------- data
  files = split_paths(cfg.data.train_path)
  weights, _ = train_weights(cfg.data.get("train_weights", ""), files)  # (run_spec checked)
  stream = PromptStream(train_rows, tokenizer,
                        max_prompt_len=cfg.data.max_prompt_len, seed=cfg.seed,
                        chat_template=cfg.data.chat_template,
                        system_prompt=cfg.data.system_prompt, name="config.data.train_path",
                        weights=weights, files=files, shuffle=cfg.data.get("shuffle", True))
  per_file = collections.Counter(p.row.file for p in stream.prompts)
  names = source_names(files, "data.train_path") if len(files) > 1 else files
  mixture = weights and [(s, per_file[i], w) for i, (s, w) in enumerate(zip(names, weights))]
  print(data_line(len(stream), stream.dropped_long, cfg, stream.dropped_empty, test_rows,
                  left_out, collections.Counter(p.row.source for p in stream.prompts), mixture),
        file=sys.stderr)

  # -------------------------------------------------------------------------- learner
  lspec = learner_spec(spec, model_cfg, mesh)
  _, why = packed_impl(model_cfg, lspec.pad_multiple)
  rows = f"rows of {lspec.pad_multiple} x 2^k tokens"
  if lspec.max_rows:
    rows = (f"rows of {-(-lspec.max_len // lspec.pad_multiple) * lspec.pad_multiple} tokens, "
            f"the shortest samples' {lspec.pad_multiple} x 2^k")
  print(f"learner: packed micro-batches (grpo.micro_batch_tokens="
        f"{cfg.grpo.micro_batch_tokens}, {rows}: grpo.row_layout={cfg.grpo.row_layout}), "
        f"attention: {why}", file=sys.stderr)
  if model_cfg.moe:  # (its prefill and its micro-batches group their tokens by expert)
    from tlt_jax.models.moe import grouped_impl
    print(f"learner: {model_cfg.num_experts} experts, {model_cfg.experts_per_token} a token: "
          f"{grouped_impl(model_cfg)[1]}", file=sys.stderr)
  adapters = start = None
  if lspec.lora is not None and cfg.model.lora.get("init", ""):  # a PEFT adapter to go on from
    start = os.path.expanduser(cfg.model.lora.init)
    try:
      adapters = lora.load_peft_adapter(start, model_cfg, lspec.lora)
    except ValueError as e:
      raise ConfigError(str(e), "model.lora.init", start, in_config=True) from None
  learner = rl_learner.init_learner(params, lspec, seed=cfg.seed, adapters=adapters)
  del params, adapters
  if lspec.lora is not None:
    lo = lspec.lora
    adapted = [t for t in lo.targets if t in lora.adapter_shapes(model_cfg, lo)["layers"]]
    print(f"learner: LoRA rank {lo.rank} (alpha {lo.alpha:g}) on {', '.join(adapted)}: "
          f"{lora.num_adapter_params(model_cfg, lo) / 1e6:.2f}M trained parameters, the "
          f"{num_params(model_cfg) / 1e6:.1f}M of the base frozen"
          + (f"; the adapters from {start}" if start else ""), file=sys.stderr)

  # ---------------------------------------------- TLT: drafter, its data, the bandit
  rollout_mesh, local = runtime.worker_meshes(cfg)  # replicas: all, and this process's
  ids = [i for i, _ in local]
  tlt = spec.tlt
  spot = spec.spot if tlt and spec.spot is not None else SpotConfig(mode="off")
  trained = spec.buffer is not None
  d = cfg.tlt.drafter
  policies = spec.policies()  # the bandit's and the gate's at step 0 (None: off)
  bandit = policies.bandit.cfg if tlt else None  # the arms every engine compiles for
  drafter = dtx = store_sh = buffer = None
  if tlt:
    dtx = make_optimizer(d.lr, warmup_steps=d.warmup_steps)
    # the store's drafter lives in the rollout layout (replicated over replicas, tensor-
    # parallel within one): every worker takes its slices as a view, in every process
    dparams = jax.tree.map(np.asarray, runtime.load_drafter(cfg, model_cfg))
    store_sh = dts.state_shardings(dparams, dtx, rollout_mesh)
    drafter = dts.init_state(dparams, dtx, store_sh)
  if trained:
    buffer = DrafterBuffer(spec.buffer, seed=cfg.seed)

  # ------------------------------------------------------- rollout workers, coordinator
  ecfg = spec.engine_config(stop)
  # paged attention or the windows for this backend and the replicas (on a GPU the kernel's
  # start-up check), before the gate's verdicts, which are keyed by the engine's config
  ecfg, attention = ecfg.resolve_attention(model_cfg, cfg.rollout.tensor_parallel)
  print(f"rollout: {attention}", file=sys.stderr)
  # one gate for this process's workers (one of them probes whether speculation pays): the
  # hardware verdicts of earlier runs on this machine
  verdicts = None
  if spec.gate is not None:
    verdicts = gate_verdicts(cfg.get("compilation_cache", ""), model_cfg, ecfg, spec.sampling,
                             dparams, local[0][1].devices.flat)
  policy = rl_learner.rollout_policy(learner, lspec)
  to_rollout = _to_rollout(lspec, rollout_mesh, policy, ecfg.fuses())
  first = to_rollout(policy)
  del policy
  workers = []
  for i, wmesh in local:  # this process's replicas (i: the global index)
    # the history index lives with its worker across steps (not checkpointed: a resumed
    # run rebuilds it from the responses it decodes from then on)
    engine = Engine(first, model_cfg, ecfg, worker_id=i, mesh=wmesh,
                    drafter_params=drafter.params if tlt else None, bandit=bandit,
                    history=HistoryIndex() if spec.history else None)
    trainer = None
    if trained:
      wsh = dts.state_shardings(drafter.params, dtx, wmesh)
      step_fn = dts.make_train_step(model_cfg, dtx, LossConfig(unroll_steps=d.unroll),
                                    donate=spot.on_barrier == "finish", state_shardings=wsh)
      trainer = DrafterTrainer(step_fn=step_fn, shardings=wsh, buffer=buffer, rows=d.rows,
                               row_len=d.row_len, target_params=lambda e=engine: e.params,
                               seed=cfg.seed * 1000 + i, hidden_dtype=model_cfg.compute_dtype)
    workers.append(Worker(engine, trainer))
  store = ParamStore(first, drafter)
  del first
  coordinator = Coordinator(
      workers, store, spot=spot,
      merge=make_merge(store_sh, rollout_mesh, ids) if trained else None, worker_ids=ids,
      num_workers=cfg.rollout.num_workers, to_rollout=to_rollout,
      gather=distributed.all_gather_objects,
      global_barrier=distributed.GlobalBarrier if jax.process_count() > 1 else None,
      verdicts=verdicts,
      # one process, one-device workers: their in-flight drafter steps run on beside the
      # learner (across processes the merge is a collective and keeps its place; a
      # tensor-parallel worker's steps have collectives of their own, which must not
      # interleave with the learner's: coordinator.py's docstring)
      overlap_settle=(spot.mode == "spot" and jax.process_count() == 1
                      and cfg.rollout.tensor_parallel == 1), buffer=buffer)
  coordinator.push()  # every worker takes the store's weights (and its trainer the drafter)
  if spot.mode == "spot":  # compiled at low priority once spot training is wanted
    compiler = background_compiler("compile-drafter")
    for w in workers:
      w.trainer.compile_on_first_use(model_cfg.hidden_size, compiler)
      if spec.gate is None or not spec.gate.gating:  # wanted from the first rollout: compile
        # while the run starts
        w.trainer.prepare()
  elif trained:  # serial: compiled now, so the first serial steps do not
    for f in [w.submit(w.trainer.compile, model_cfg.hidden_size) for w in workers]:
      f.result()
  if tlt and cfg.tlt.spec.precompile:
    t = time.perf_counter()
    n = sum(e.precompile(spec.sampling, policies=PolicyCells.of(policies))
            for e in coordinator.engines)
    print(f"precompiled {n} speculative executables in {time.perf_counter() - t:.0f}s",
          file=sys.stderr)

  # ----------------------------------------------------------------------- checkpoints
  export_engine = hf_config = None
  if tlt and cfg.train.export_drafter:
    export_engine = cfg.train.export_engine
    try:
      drafter_export.check_engine(model_cfg, export_engine)
    except drafter_export.ExportError as e:
      raise ConfigError(str(e), "train.export_engine", export_engine, in_config=True) from None
    hf_config = read_hf_config(cfg.model.path)
  ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"),
                      max_to_keep=cfg.train.keep_checkpoints,
                      save_interval_steps=cfg.train.checkpoint_every)
  run = Run(cfg=cfg, learner=lspec, model_cfg=model_cfg, tokenizer=tokenizer, stream=stream,
            test_rows=test_rows, sampling=spec.sampling, store=store,
            coordinator=coordinator, tlt=tlt, eval_bandit=spec.bandit(), buffer=buffer,
            ckpt=ckpt, compile_clock=compile_clock,
            export_engine=export_engine, target_hf_config=hf_config,
            acceptance=DrafterAcceptance(cfg, lspec, spec.sampling)
            if tlt and cfg.tlt.drafter.acceptance_sample else None, memory=spec.memory,
            profile=spec.profile)
  return run, TrainState(step=0, learner=learner, bandit=policies.bandit, gate=policies.gate)


def _to_rollout(spec: rl_learner.LearnerSpec, rollout_mesh, params: Params, fused: bool
                ) -> Callable[[Params], Params]:
  """The learner's rollout policy (rl_learner.rollout_policy) -> the store's rollout layout
  (the engine's replica layout on the whole rollout mesh: every replica's devices hold its
  tensor-parallel slices). Where the learner and the rollouts span the same devices (always
  with several processes; one GPU) one program makes the new copy straight from the learner's
  arrays, a layer at a time (no copy in the learner's layout first: the memory plan's sync
  phase)."""
  same = set(spec.mesh.devices.flat) == set(rollout_mesh.devices.flat)
  if jax.process_count() > 1 and not same:
    # the resharding would need a transfer between processes outside a collective
    raise ConfigError("config.mesh.devices: with several processes the learner must span every "
                      "device (mesh.devices=0), as the rollout replicas do")
  shardings = replica_shardings(params, spec.cfg, fused, rollout_mesh)
  if same:  # (one program, not a device_put per leaf: across processes a must, see replica.py)
    return to_replica_program(spec.cfg, fused, shardings)
  return lambda p: to_replica_layout(p, spec.cfg, fused, shardings)
