"""The learner: GRPO's loss (grpo.py) stepped over packed micro-batches on the learner mesh.

`prepare` is the old-log-prob pass (the rollout's log-probs are never trusted: grpo.py's
docstring), `update` one optimizer step per mini-batch, its gradients accumulated micro-batch
by micro-batch (each its own jitted call: one executable per length bucket). The state is one
pytree (`LearnerState`): what `update` takes and returns (donated) and what a checkpoint
holds. With LoRA (models/lora.py) the state's params are the adapters and `base` the frozen
model they update: the loss differentiates the adapters only (`policy_tree`); the rollout
decodes the merged weights, merged layer by layer into its own layout (`rollout_policy`), and
the exports merge them a layer at a time as they write them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from tlt_jax import watchdog
from tlt_jax.models import ModelConfig, Params, lora
from tlt_jax.optim import if_finite
from tlt_jax.rl.batching import MicroBatch
from tlt_jax.rl.grpo import Batch, GRPOConfig, grpo_loss, token_logprobs
from tlt_jax.sharding import BATCH, batch_sharding, replicated, tree_shardings


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
  """What the learner's jitted functions are specialised on: hashable, passed as a static
  argument (one run has one, so each function compiles once per micro-batch shape). tx: from
  tlt_jax/optim.py; mesh: the learner's (FSDP over data x fsdp); micro_batch, pad_multiple,
  max_len, micro_batch_tokens, max_rows: the batch layout of `micro_batches`."""

  cfg: ModelConfig
  gcfg: GRPOConfig
  tx: optax.GradientTransformation
  mesh: Mesh
  micro_batch: int
  pad_multiple: int = 64
  max_len: int = 1 << 30
  micro_batch_tokens: int = 0
  max_rows: bool = False
  # LoRA (models/lora.py): the state's params are adapters over a frozen base (None: the
  # whole model is trained)
  lora: lora.LoraConfig | None = None

  @property
  def row_multiple(self) -> int:
    """Rows of a micro-batch come in multiples of this: they are split over these devices."""
    return int(np.prod([self.mesh.shape[a] for a in BATCH]))


@struct.dataclass
class LearnerState:
  """Everything the learner changes, one pytree: what `update` takes and returns (donated)
  and what a checkpoint saves and restores."""

  params: Params  # the actor (with LoRA its adapters), FSDP-sharded (tree_shardings)
  opt_state: optax.OptState  # Adam moments sharded like their params, counts replicated
  ref_params: Params | None = None  # the frozen reference policy (kl_coef > 0), else None
  # with LoRA the frozen base model the adapters update, in the compute dtype; it is also
  # the reference policy (ref_params None); None without LoRA
  base: Params | None = None


def policy_tree(params: Params, base: Params | None, spec: LearnerSpec) -> Params:
  """What the forward takes: the params themselves, or with LoRA the base with the adapters
  `params` attached (differentiable in them)."""
  return params if base is None else lora.attach(base, params, spec.lora.scale)


def rollout_policy(state: LearnerState, spec: LearnerSpec) -> Params:
  """What the rollout's weights and the exports are made from (the coordinator's
  `to_rollout`, models.replica_layout; hf_io.hf_state_dict): the params, or with LoRA the base
  with the adapters attached, which those merge a layer at a time, so the merged model is
  never held in the learner's layout as well."""
  return policy_tree(state.params, state.base, spec)


def _state_constraint(tree, mesh: Mesh):
  """Pins a learner tree to the partition rules: left to XLA, a step could return another
  layout than it took, and the next call would then compile again (or the donation fail)."""
  return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, mesh))


def init_learner(params: Params, spec: LearnerSpec, seed: int = 0,
                 adapters: Params | None = None) -> LearnerState:
  """Params (anywhere) -> a fresh state on the learner mesh. With LoRA the params become the
  frozen base (cast to the compute dtype, which every forward casts them to anyway) and the
  trained params `adapters` (e.g. lora.load_peft_adapter's), or fresh ones (`seed`: their A's
  draw; B = 0, so the policy is the base)."""
  base = None
  if spec.lora is not None:
    dt = spec.cfg.compute_dtype
    base = jax.device_put(params, tree_shardings(params, spec.mesh))
    base = jax.jit(lambda p: _state_constraint(jax.tree.map(lambda a: a.astype(dt), p),
                                               spec.mesh))(base)
    params = (lora.init_adapters(spec.cfg, spec.lora, jax.random.key(seed)) if adapters is None
              else adapters)
  params = jax.device_put(params, tree_shardings(params, spec.mesh))
  # ...in the layout every update returns (`_state_constraint`'s output: a jit writes P() where
  # device_put kept P(None,)): the learner's jitted steps key their executables on it, and
  # the first optimizer step would otherwise make every micro-batch shape of `_accumulate`
  # and `logprobs` compile a second time (measured: ~3 s per shape on the CPU default run)
  params = jax.jit(lambda p: _state_constraint(p, spec.mesh))(params)
  # Adam moments sharded like their params (the path rules match "mu/layers/q" as they
  # match "layers/q"), counts replicated. Left to itself, init (zeros, independent of the
  # params' values) lands on one device; the state restored from a checkpoint onto such a
  # template would then meet params on the whole mesh and fail.
  opt_state = jax.jit(lambda p: _state_constraint(spec.tx.init(p), spec.mesh))(params)
  ref = jax.tree.map(jnp.copy, params) if spec.gcfg.kl_coef > 0 and base is None else None
  return LearnerState(params, opt_state, ref, base)


def put_batch(x: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host batch (the same in every process) onto the mesh: each process supplies the rows
  of its own devices."""
  sharding = batch_sharding(mesh, x.ndim)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


@functools.partial(jax.jit, static_argnames=("spec",))
def logprobs(params: Params, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
             *, spec: LearnerSpec) -> jax.Array:
  """A packed micro-batch [b, T] -> log-probs [b, T] under `params`: the old (and reference)
  log-probs, with the function the loss differentiates (grpo.py's docstring)."""
  with jax.sharding.use_abstract_mesh(spec.mesh.abstract_mesh):  # a fused kernel per shard
    lp = token_logprobs(params, tokens, positions, segment_ids, cfg=spec.cfg,
                        temperature=spec.gcfg.temperature, chunk=spec.gcfg.logit_chunk)[0]
  # in the batch layout (`put_batch`'s), as the first mini-batch's placeholders come: left to
  # XLA, its own choice made `_accumulate` compile every shape a second time
  return jax.lax.with_sharding_constraint(lp, batch_sharding(spec.mesh, 2))


def prepare(state: LearnerState, batches: list[list[MicroBatch]], spec: LearnerSpec
            ) -> list[list[Batch]]:
  """The old-log-prob pass: every micro-batch on device with old (and reference) log-probs
  under the state's params, ready for `update` (same nesting). The first mini-batch's old
  log-probs are not computed where each mini-batch steps once (ppo_epochs 1): `update` steps
  it before any optimizer step, under the params that are the old policy, so its loss takes
  them from its own forward (`Batch.on_policy`: the ratio 1 and the same gradient; verl's
  on-policy shortcut, one mini-batch's pass saved). A later pass steps it under moved params:
  with ppo_epochs > 1 its old log-probs are computed too."""
  out = []
  shortcut = spec.gcfg.ppo_epochs == 1
  reference = state.ref_params
  if state.base is not None and spec.gcfg.kl_coef > 0:
    # LoRA: the base is the reference, run with zero adapters (exactly the base: x W + 0):
    # the same program as the policy's log-probs, not a second one per micro-batch shape
    reference = policy_tree(jax.tree.map(jnp.zeros_like, state.params), state.base, spec)
  for k, group in enumerate(batches):
    prepared = []
    flag = np.bool_(k == 0 and shortcut)
    for mb in group:
      watchdog.beat()
      tokens, positions, segments = (put_batch(x, spec.mesh)
                                     for x in (mb.tokens, mb.positions, mb.segment_ids))
      ref = None
      if reference is not None:
        ref = logprobs(reference, tokens, positions, segments, spec=spec)
      mask = put_batch(mb.loss_mask, spec.mesh)
      if flag:  # a placeholder of the right shape and layout, never read
        old = mask
      else:
        old = logprobs(policy_tree(state.params, state.base, spec), tokens, positions,
                       segments, spec=spec)
      prepared.append(Batch(tokens, positions, segments, mask,
                            put_batch(mb.loss_weight, spec.mesh),
                            put_batch(mb.advantages, spec.mesh), old, ref, flag,
                            None if mb.rollout_logp is None
                            else put_batch(mb.rollout_logp, spec.mesh)))
    out.append(prepared)
  return out


@functools.partial(jax.jit, static_argnames=("spec",))
def _zero_grads(params: Params, *, spec: LearnerSpec) -> Params:
  return _state_constraint(jax.tree.map(jnp.zeros_like, params), spec.mesh)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(2,))
def _accumulate(params: Params, base: Params | None, acc, mb: Batch, num_tokens: jax.Array, *,
                spec: LearnerSpec):
  """acc (gradient sums, metric sums) + this micro-batch's (the gradient in `params`: with
  LoRA the adapters, the base frozen); acc donated."""
  loss = functools.partial(grpo_loss, cfg=spec.cfg, gcfg=spec.gcfg)
  with jax.sharding.use_abstract_mesh(spec.mesh.abstract_mesh):  # a fused kernel per shard
    (_, m), g = jax.value_and_grad(
        lambda p: loss(policy_tree(p, base, spec), mb, num_tokens=num_tokens), has_aux=True)(
            params)
  acc_g, acc_m = acc
  # the sums in the layout they came in (`_zero_grads`'s, `update`'s replicated metric zeros):
  # left to XLA, a mini-batch starting with a shape so far seen only after the first
  # micro-batch compiled it again
  return (_state_constraint(jax.tree.map(jnp.add, acc_g, g), spec.mesh),
          jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, acc_m, m),
                                           replicated(spec.mesh)))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(0,))
def apply_gradients(state: LearnerState, grads: Params, *, spec: LearnerSpec
                    ) -> tuple[LearnerState, jax.Array]:
  """One optimizer step; -> (state, global gradient norm). The state is donated. Gradients
  that are not all finite (a NaN or an inf: their norm is not finite) take no step: the state
  comes back as it was, optimizer moments and count included (`update` counts the skip)."""
  gnorm = optax.tree.norm(grads)
  updates, opt_state = spec.tx.update(grads, state.opt_state, state.params)
  new = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)
  return _state_constraint(if_finite(jnp.isfinite(gnorm), new, state), spec.mesh), gnorm


def update(state: LearnerState, prepared: list[list[Batch]], spec: LearnerSpec
           ) -> tuple[LearnerState, dict[str, float]]:
  """One optimizer step per mini-batch (from `prepare`), grpo.ppo_epochs passes over them in
  their order; -> (state, metrics averaged over the optimizer steps that stepped, "skipped":
  how many did not, their gradients not finite: `apply_gradients`). The input state is
  donated.

  The gradients of a mini-batch are accumulated micro-batch by micro-batch, each its own call
  of one jitted step: micro-batches come in several length buckets, and one jit over the
  whole mini-batch would compile once per combination of buckets (instead of once per
  bucket) and let XLA hold every micro-batch's activations at once."""
  runs: list[dict[str, float]] = []
  for group in prepared * spec.gcfg.ppo_epochs:
    num_tokens = jnp.float32(sum(float(jnp.sum(mb.loss_mask)) for mb in group))
    metric_shapes = jax.eval_shape(functools.partial(grpo_loss, cfg=spec.cfg, gcfg=spec.gcfg),
                                   policy_tree(state.params, state.base, spec), group[0],
                                   num_tokens=num_tokens)[1]
    # the metric sums committed to the mesh as `_accumulate` returns them: left uncommitted,
    # the first micro-batch of a mini-batch would call another executable than the others
    # (every micro-batch shape compiled twice)
    acc = (_zero_grads(state.params, spec=spec),
           jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype),
                                                 replicated(spec.mesh)), metric_shapes))
    for mb in group:
      watchdog.beat()
      acc = _accumulate(state.params, state.base, acc, mb, num_tokens, spec=spec)
    grads, metrics = acc
    state, gnorm = apply_gradients(state, grads, spec=spec)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics["grad_norm"] = float(gnorm)
    runs.append(metrics)
  if not runs:  # (every response dropped: nothing trained, nothing to report)
    return state, {}
  stepped = [m for m in runs if math.isfinite(m["grad_norm"])]
  totals = {k: sum(m[k] for m in stepped or runs) / len(stepped or runs) for k in runs[0]}
  return state, dict(totals, skipped=len(runs) - len(stepped))
