"""What each phase of the memory plan holds per device (memory.py's docstring: the phases):
the learner's state, a rollout replica's weights, KV pages and activations, the drafter's
copies and its spot training, the learner's activations in the log-prob pass and the update.
Each function takes the run's `Sizes` and returns its `Item`s; memory.plan sums them per
phase. Resident arrays are counted from the run's own layout rules (`sharded_bytes` over
`sharding.PARAM_RULES` on a stand-in mesh of the same axis sizes); activations are estimates
fitted to XLA's temp sizes (tests/test_memory.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np

from tlt_jax.sharding import AXES, mesh_sizes, spec_for

PHASES = ("rollout", "spot", "logprobs", "update", "sync")


@dataclasses.dataclass(frozen=True)
class Item:
  name: str
  bytes: int  # per device
  phases: tuple[str, ...]
  note: str = ""


def stand_in_mesh(**sizes) -> Any:
  """A stand-in for a Mesh where only axis sizes matter (sharding.fit_spec reads .shape)."""
  return SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1, **sizes})


def sharded_bytes(shapes: Any, mesh: Any, dtype_bytes: int) -> int:
  """Per-device bytes of a params pytree of shape tuples under PARAM_RULES on `mesh` (the
  largest shard: rules only split evenly or replicate)."""
  import jax
  total = 0
  leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  for path, shape in leaves[0]:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    spec = spec_for(name, shape, mesh)
    n = 1
    for dim, entry in zip(shape, list(spec) + [None] * len(shape)):
      axes = entry if isinstance(entry, tuple) else ((entry,) if entry else ())
      n *= dim // int(np.prod([mesh.shape[a] for a in axes])) if axes else dim
    total += n * dtype_bytes
  return total


def count(shapes: Any) -> int:
  import jax
  return sum(int(np.prod(s)) for s in jax.tree.leaves(shapes,
                                                      is_leaf=lambda x: isinstance(x, tuple)))


def learner_axes(cfg, num_devices: int) -> dict[str, int]:
  """config.mesh's axis sizes over the devices the learner spans (-1 resolved)."""
  n = int(cfg.mesh.get("devices", 0) or 0) or num_devices
  return mesh_sizes({a: int(cfg.mesh[a]) for a in AXES}, n)


def mlp_width(m) -> int:
  """A token's MLP activations in elements of the hidden width's kind (what the estimates
  below take as F): a dense MLP's F; a mixture of experts' k copies of the token and its k
  experts' (models/moe.py: the (token, expert) pairs). Qwen3-30B-A3B: 8 x (768 + 2048),
  where its dense intermediate_size is 6144 = 8 x 768."""
  if not m.moe:
    return m.intermediate_size
  return m.experts_per_token * (m.moe_intermediate_size + m.hidden_size)


def verify_width(spec) -> int:
  """Tokens per verification forward: the widest arm the bandit can choose."""
  from tlt_jax.rollout.policies.mab import default_mab_buckets
  arms = {spec.speculation.strategy}
  for group in (spec.mab_buckets or default_mab_buckets()).values():
    arms.update(group)
  return max(a.verify_tokens for a in arms)


# ---------------------------------------------------------------------------- the phases
@dataclasses.dataclass(frozen=True)
class Sizes:
  """What every phase of the plan reads: the run's spec and config, the model's dimensions,
  the device and its meshes, the rollout's batch and KV pages."""
  spec: Any
  cfg: Any
  m: Any  # the model config
  gpu: bool  # a device with a fixed memory size (its attention kernels keep no scores)
  pbytes: int
  cbytes: int
  shapes: Any  # the model's parameter shapes
  axes: dict[str, int]  # the learner mesh's
  lmesh: Any
  learner: int  # learner params' bytes per device
  tp: int  # rollout tensor parallelism
  rmesh: Any
  mb: int  # rows one rollout worker decodes at once
  pages: int  # KV pages of a replica's pool
  paged: bool  # attention reads the rows' pages in place (EngineConfig.plans_paged)

  def split(self, x: int) -> int:
    """A dimension split over the rollout's tensor parallelism (when it divides)."""
    return x // self.tp if x % self.tp == 0 else x


def adapter_bytes(z: Sizes) -> int:
  """LoRA's adapters per device (float32, sharded by their rules); 0 without LoRA."""
  from tlt_jax.models.lora import adapter_shapes
  return 0 if z.spec.lora is None else sharded_bytes(adapter_shapes(z.m, z.spec.lora), z.lmesh,
                                                    4)


def learner_state(z: Sizes) -> list[Item]:
  """The learner's params (FSDP (+ data, tensor) over the learner mesh), its optimizer, a
  reference copy (KL), the gradient accumulator; with LoRA the frozen base (also the
  reference) and the adapters with their optimizer and gradients."""
  m, axes, learner = z.m, z.axes, z.learner
  lora = z.spec.lora
  if lora is not None:
    from tlt_jax.models.lora import adapter_shapes
    ad = adapter_bytes(z)
    return [Item("learner params", learner, PHASES, f"{count(z.shapes) / 1e9:.2f}B x "
                 f"{m.dtype}, frozen (LoRA's base; the KL reference), FSDP {axes['fsdp']} x "
                 f"tensor {axes['tensor']}"),
            Item("LoRA adapters", ad, PHASES, f"rank {lora.rank}, "
                 f"{count(adapter_shapes(m, lora)) / 1e6:.1f}M x float32"),
            Item("optimizer state", 2 * ad, PHASES, "AdamW mu + nu of the adapters"),
            Item("gradient accumulator", ad, ("update",), "the adapters' grads summed")]
  items = [Item("learner params", learner, PHASES, f"{count(z.shapes) / 1e9:.2f}B x "
                f"{m.param_dtype}, FSDP {axes['fsdp']} x tensor {axes['tensor']}"),
           Item("optimizer state", 2 * learner, PHASES, "AdamW mu + nu, sharded like params")]
  if z.cfg.grpo.kl_coef > 0:
    items.append(Item("reference params", learner, PHASES, "kl_coef > 0: a frozen copy"))
  items.append(Item("gradient accumulator", learner, ("update",), "micro-batch grads summed"))
  return items


def rollout(z: Sizes) -> list[Item]:
  """A rollout replica: its weights (tensor parallel, the compute dtype), the KV pages, and
  the larger of a prefill of max_batch rows (a group's n responses prefill their prompt once:
  decode.prefill_shared) and a decode step (logits and the MLP's activations; with the
  attention windows also the scores and one layer's k/v window gathered from the pages, at
  the longest row's window: paged attention reads the pages in place)."""
  m, cfg, cbytes, mb, pages = z.m, z.cfg, z.cbytes, z.mb, z.pages
  L, D, N, K, H, F, V = (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim_,
                         mlp_width(m), m.vocab_size)
  release = bool(cfg.memory.get("release_rollout_weights", False))
  items = [Item("rollout weights", sharded_bytes(z.shapes, z.rmesh, cbytes),
                ("rollout", "spot", "sync") if release else PHASES,
                f"one replica per {z.tp} device(s), {m.dtype}"
                + (", freed after the rollout, made again in the sync" if release else ""))]
  S, page = z.spec.engine.cache_len, z.spec.engine.page_size
  kv_token = L * 2 * z.split(K) * H * cbytes
  # (the pools go with the weights, Replica.release_params; kept, they stay for every phase)
  items.append(Item("KV cache", pages * page * kv_token, ("rollout",) if release else PHASES,
                    f"{pages} pages x {page} slots x {kv_token / 1024:.0f} KiB/token "
                    f"(= {pages * page / max(mb, 1):.0f} slots per row of max_batch {mb})"
                    + ("" if release else ", kept between rollouts")))
  P = int(cfg.data.max_prompt_len)
  f_dev, n_dev = z.split(F), z.split(N)
  w = verify_width(z.spec) if z.spec.tlt else 1
  u = -(-mb // max(int(cfg.grpo.n), 1))  # distinct prompts
  prefill = u * P * (4 * D + 3 * f_dev) * cbytes
  if not (z.gpu and cbytes == 2):  # materialised scores and probabilities (float32)
    prefill += 2 * u * n_dev * P * P * 4
  decode = mb * w * z.split(V) * 4 * 2 + mb * w * (4 * D + 3 * f_dev) * 4
  if m.moe:  # models/moe.py's way for a step of mb x w tokens
    from tlt_jax.models import moe
    way, r, fe = moe.path(mb * w, m), mb * w, z.split(m.moe_intermediate_size)
    if way is moe._gathered:  # each (token, expert) pair's expert weights gathered
      decode += r * m.experts_per_token * 3 * D * fe * cbytes
    elif way is moe._dense:  # every expert's gate, up and product for every token
      decode += 3 * r * m.num_experts * fe * cbytes
  if not z.paged:  # the windows: scores over S slots and one layer's k/v window gathered
    decode += 2 * mb * n_dev * w * S * 4 + 2 * mb * S * z.split(K) * H * cbytes
  items.append(Item("rollout activations", max(prefill, decode), ("rollout",),
                    f"prefill of {u} prompts x {P} / decode x {w} tokens"))
  return items


# the sync conversion's working memory, in layers of the model in float32 (`sync`)
SYNC_LAYERS = 1.25


def sync(z: Sizes) -> list[Item]:
  """The weight sync beside what every phase holds (the new rollout copy is `rollout`'s
  item): the old copy where it was not released, and the conversion program's working memory
  (models.replica_layout: one program on the learner's and the rollouts' devices, its layers
  made one after another). XLA's temp holds the merge's float32 products (LoRA) or the
  gathers of the learner's shards: 0.4-1.1 of a layer's weights in float32 at any depth on
  this CPU, with tensor parallelism too (not split by it: 2-way measured 1.0;
  tests/test_memory.py)."""
  items = []
  if not z.cfg.memory.get("release_rollout_weights", False):
    items.append(Item("rollout weights (next)", sharded_bytes(z.shapes, z.rmesh, z.cbytes),
                      ("sync",), "the sync's new copy beside the old "
                      "(memory.release_rollout_weights frees the old first)"))
  layer = count(layer_shapes(z.shapes))
  items.append(Item("sync conversion", int(SYNC_LAYERS * layer * 4), ("sync",),
                    "a layer in float32: " + ("the LoRA merge's products"
                                              if z.spec.lora is not None
                                              else "the learner's shards gathered")))
  return items


def drafter(z: Sizes) -> list[Item]:
  """The drafter: the store's copy on the learner mesh, each worker's (and its trainer's
  state), its KV pages, and a spot-training step's activations."""
  from tlt_jax.drafter.loss import LossConfig
  from tlt_jax.drafter.model import drafter_param_shapes
  m, cbytes = z.m, z.cbytes
  D, F, V = m.hidden_size, m.intermediate_size, m.vocab_size
  dshapes = drafter_param_shapes(m)
  items = [Item("drafter (store)", 3 * sharded_bytes(dshapes, z.lmesh, 4), PHASES,
                f"{count(dshapes) / 1e9:.2f}B params + AdamW, float32")]
  d = z.cfg.tlt.drafter
  trained = d.mode != "off"
  worker = sharded_bytes(dshapes, z.rmesh, 4) * (3 if trained else 1)
  items.append(Item("drafter (worker)", worker, PHASES, "params" + (" + AdamW" if trained
                                                                     else "")))
  page = z.spec.engine.page_size
  release = bool(z.cfg.memory.get("release_rollout_weights", False))  # (as the target's pools)
  items.append(Item("drafter KV cache",
                    z.pages * page * 2 * z.split(m.num_kv_heads) * m.head_dim_ * cbytes,
                    ("rollout",) if release else PHASES, "one layer, the same pages"))
  if trained:
    t = int(d.rows) * int(d.row_len)
    chunk = min(LossConfig().logit_chunk, t)
    act = t * (8 * D + 3 * z.split(F)) * 4 * int(d.unroll) + 6 * chunk * z.split(V) * 4
    if not z.gpu:
      act += 2 * int(d.rows) * z.split(m.num_heads) * int(d.row_len) ** 2 * 4
    items.append(Item("drafter training", act, ("spot",),
                      f"{d.rows} x {d.row_len} tokens, logits {chunk} at a time"))
  return items


DOTS_SAVED = 0.45  # remat_policy="dots": of its projection outputs, the share XLA keeps (fitted)


def learner_activations(z: Sizes) -> list[Item]:
  """The log-prob pass's and the update's activations: the largest micro-batch (padded to
  max_len), per device."""
  m, cfg, g, axes, cbytes = z.m, z.cfg, z.cfg.grpo, z.axes, z.cbytes
  L, D, N, F, V = m.num_layers, m.hidden_size, m.num_heads, mlp_width(m), m.vocab_size
  n_batch = axes["data"] * axes["fsdp"]
  max_len = int(cfg.data.max_prompt_len) + int(cfg.rollout.max_new_tokens)
  T = -(-max_len // g.pad_multiple) * g.pad_multiple
  rows = g.micro_batch
  if g.micro_batch_tokens > 0:
    rows = max(n_batch, (g.micro_batch_tokens // T) // n_batch * n_batch)
  b = max(1, rows // n_batch)  # rows per device
  tp_l = axes["tensor"]
  n_l, f_l, v_l = (x // tp_l if x % tp_l == 0 else x for x in (N, F, V))
  t = b * T
  chunk = min(int(g.logit_chunk), T)
  fsdp = axes["fsdp"] * axes["data"]
  # one layer's weights gathered for its matmuls, and its full gradient before the
  # reduce-scatter (FSDP only; on one device the arrays are used in place)
  gathered = (sharded_bytes(layer_shapes(z.shapes), stand_in_mesh(tensor=tp_l), z.pbytes)
              if fsdp > 1 else 0)
  layers_dev = sharded_bytes({"layers": z.shapes["layers"]}, z.lmesh, z.pbytes)  # sharded
  embed_dev = z.learner - layers_dev
  # the stacked per-layer gradients the backward keeps: with LoRA the adapters' (the base's
  # weights take none)
  grads_dev = adapter_bytes(z) if z.spec.lora is not None else layers_dev
  act = lambda n: n * cbytes  # activation elements (compute dtype)
  scores = 0 if (z.gpu and cbytes == 2) else b * n_l * T * T * 4  # f32 [T, T] per head
  head = b * chunk * v_l * 4  # one LM-head chunk of f32 logits
  # The coefficients are calibrated against XLA's temp sizes on this CPU (float32; 27 random
  # shapes; tests/test_memory.py checks them): a forward keeps the hidden states and, at its
  # peak, either one layer's attention or one LM-head chunk. (The forward's scores: 2 copies
  # since attention's queries are laid out per kv head, 3 before: 11 shapes, 2026-12-03.)
  lp_layer = 2.0 * scores + 1.3 * act(t * D) + 0.8 * layers_dev / L
  items = [Item("log-prob activations", int(0.85 * act(t * D) + max(lp_layer, head)
                                             + 2 * gathered),
                ("logprobs",), f"{b} row(s) x {T} tokens per device")]
  # The backward keeps what the forward saved (remat: each layer's input; otherwise every
  # layer's internals) and the stacked per-layer gradients, then peaks in one layer's
  # recomputed backward or in an LM-head chunk's.
  if m.remat and m.remat_policy == "dots":  # + every projection's output, per layer
    k_l = m.num_kv_heads // tp_l if m.num_kv_heads % tp_l == 0 else m.num_kv_heads
    saved = n_l * m.head_dim_ + 2 * k_l * m.head_dim_ + 3 * D + 2 * f_l
    if z.spec.lora is not None:  # each target's (x a) b is a saved dot output too
      saved *= 2
    stored = L * (1.05 * act(t * D) + DOTS_SAVED * act(t * saved)) + 1.25 * grads_dev
    peak = max(6.0 * act(t * f_l) + 3.8 * scores + 12.0 * act(t * D),
               2.1 * head + 1.0 * embed_dev)
  elif m.remat:
    stored = 1.05 * L * act(t * D) + 1.25 * grads_dev
    peak = max(6.0 * act(t * f_l) + 3.8 * scores + 12.0 * act(t * D),
               2.1 * head + 1.0 * embed_dev)
  else:
    stored = L * (0.3 * act(t * D) + 8.1 * act(t * f_l) + 2.9 * scores) + 1.5 * grads_dev
    peak = max(20.0 * act(t * D), 2.8 * head)
  items.append(Item("update activations", int(stored + peak + 2 * gathered), ("update",),
                    f"{b} x {T} tokens per device, remat="
                    f"{m.remat_policy if m.remat else 'off'}"))
  return items


def layer_shapes(shapes: dict) -> dict:
  """One decoder layer's param shapes (the stacked [L, ...] arrays without L)."""
  return {k: v[1:] for k, v in shapes["layers"].items()}
