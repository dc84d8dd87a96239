"""Per-device memory plan of a training run: what is resident in each phase, from the config.

A run has four phases on every device (README: architecture), and their peaks decide whether a
config fits its GPUs:
  rollout   learner state + rollout weights + KV cache + decode/prefill activations
  spot      the same device once its share is decoded (the KV cache is freed): the drafter
            trained on the idle worker
  logprobs  learner state + rollout weights + the forward of the largest micro-batch
  update    learner state + gradient accumulator + rollout weights + the backward of the
            largest micro-batch

Everything is counted per device from the same layout rules the run uses
(`sharding.PARAM_RULES` over the learner's FSDP mesh and each rollout replica's tensor-parallel
mesh), so an axis that does not divide a dimension is replicated here as it is there.
Resident arrays are exact; activations are estimates of what XLA keeps live at the peak
(validated against `compiled.memory_analysis()` on this CPU in tests/test_memory.py). On a GPU
in bf16/fp16 the attention of prefill (cuDNN's, through `jax.nn.dot_product_attention`) and
of training (kernels/flash_attention.py over packed rows) is fused: no [T, S] score matrix;
elsewhere the scores are materialised in float32 and counted.

`plan(spec, model_cfg, device=...)` -> Plan (spec: a config.RunSpec); `Plan.check()` raises
ConfigError naming the knob to turn when a phase does not fit. The KV cache is paged
(rollout/pages.py): the plan counts the pool's pages (rollout.kv_pages; 0: max_batch rows of
max length). `derive_max_batch` sizes both from what the rollout phase leaves free
(`rollout.max_batch = 0`): the pool takes it all, and max_batch is the most rows it holds at
rollout.mean_live_tokens each; at start-up runtime.py's `resolve` plans the run on what this
machine has and returns the plan of the sizes it chose (Plan.max_batch, Plan.kv_pages) for
the caller to use: nothing here writes into the config. `scripts/plan_memory.py` prints the
table.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import numpy as np

from tlt_jax.errors import ConfigError
from tlt_jax.sharding import AXES, mesh_sizes, spec_for

GiB = 1 << 30
# Memory of one device, GB as vendors state them (1e9 bytes); "cpu" has no fixed limit.
DEVICE_MEMORY_GB = {"h100": 80, "h100-80gb": 80, "h100-94gb": 94, "h200": 141, "h200-141gb": 141,
                    "a100": 80, "a100-80gb": 80, "a100-40gb": 40, "l40s": 48, "b200": 180,
                    "gh200": 96, "a10g": 24, "l4": 24}
PHASES = ("rollout", "spot", "logprobs", "update")


def device_bytes(device: str) -> int | None:
  """'h100' / 'a100-40gb' / '80gb' / '24GiB' -> bytes per device; 'cpu' / '' -> None (no
  fixed limit)."""
  d = device.strip().lower()
  if d in ("", "cpu"):
    return None
  if d in DEVICE_MEMORY_GB:
    return int(DEVICE_MEMORY_GB[d] * 1e9)
  m = re.fullmatch(r"([0-9.]+)\s*(gb|gib)", d)
  if m:
    return int(float(m.group(1)) * (GiB if m.group(2) == "gib" else 1e9))
  raise ConfigError(f"use a known kind ({', '.join(sorted(DEVICE_MEMORY_GB))}), a size like "
                    "'80gb', or 'cpu'", "memory.device", device, in_config=True)


@dataclasses.dataclass(frozen=True)
class Item:
  name: str
  bytes: int  # per device
  phases: tuple[str, ...]
  note: str = ""


@dataclasses.dataclass
class Plan:
  items: list[Item]
  capacity: int | None  # usable bytes per device (None: no fixed limit)
  device: str
  num_devices: int
  knobs: dict[str, str]  # phase -> what to change when it does not fit
  max_batch: int  # rollout sequences per worker the plan holds (sized when asked for 0)
  kv_pages: int  # pages of a replica's KV pool (sized with max_batch when asked for 0)

  def total(self, phase: str) -> int:
    return sum(i.bytes for i in self.items if phase in i.phases)

  def peak(self) -> tuple[str, int]:
    phase = max(PHASES, key=self.total)
    return phase, self.total(phase)

  def over(self) -> list[str]:
    if self.capacity is None:
      return []
    return [p for p in PHASES if self.total(p) > self.capacity]

  def table(self) -> str:
    unit, scale = ("GiB", GiB) if max(self.capacity or 0, self.peak()[1]) >= GiB else \
        ("MiB", 1 << 20)
    w = max(len(i.name) for i in self.items)
    head = f"{'per device (' + unit + ')':<{w}}  " + "  ".join(f"{p:>9}" for p in PHASES) \
        + "  note"
    lines = [head, "-" * len(head)]
    for i in self.items:
      cells = "  ".join(f"{i.bytes / scale:9.2f}" if p in i.phases else f"{'':9}"
                        for p in PHASES)
      lines.append(f"{i.name:<{w}}  {cells}  {i.note}")
    lines.append("-" * len(head))
    row = lambda name, f: f"{name:<{w}}  " + "  ".join(f"{f(p) / scale:9.2f}" for p in PHASES)
    lines.append(row("total", self.total))
    if self.capacity is not None:
      lines.append(row("usable", lambda p: self.capacity))
      lines.append(row("headroom", lambda p: self.capacity - self.total(p)))
    return "\n".join(lines)

  def check(self) -> None:
    """ConfigError (one line) for the first phase that does not fit."""
    for p in self.over():
      raise ConfigError(
          f"memory: the {p} phase needs {self.total(p) / GiB:.1f} GiB per device, "
          f"{self.capacity / GiB:.1f} GiB are usable on {self.device} "
          f"(config.memory.fraction of it): {self.knobs[p]} "
          "(scripts/plan_memory.py prints the plan)")


# ------------------------------------------------------------------------------- layout
def _mesh(**sizes) -> Any:
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


def _count(shapes: Any) -> int:
  import jax
  return sum(int(np.prod(s)) for s in jax.tree.leaves(shapes,
                                                      is_leaf=lambda x: isinstance(x, tuple)))


def learner_axes(cfg, num_devices: int) -> dict[str, int]:
  """config.mesh's axis sizes over the devices the learner spans (-1 resolved)."""
  n = int(cfg.mesh.get("devices", 0) or 0) or num_devices
  return mesh_sizes({a: int(cfg.mesh[a]) for a in AXES}, n)


def _verify_width(spec) -> int:
  """Tokens per verification forward: the widest arm the bandit can choose."""
  from tlt_jax.rollout.policies.mab import default_mab_buckets
  arms = {spec.speculation.strategy}
  for group in (spec.mab_buckets or default_mab_buckets()).values():
    arms.update(group)
  return max(a.verify_tokens for a in arms)


# --------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _Sizes:
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


def plan(spec, model_cfg, *, device: str | None = None, num_devices: int | None = None,
         fraction: float | None = None, max_batch: int | None = None,
         kv_pages: int | None = None) -> Plan:
  """The per-device plan of a run (spec: its config.RunSpec; model_cfg: config.model_config).
  device / num_devices / fraction: default config.memory.*; max_batch, kv_pages: default the
  spec's (rollout.kv_pages 0: max_batch rows of max length; `derive_max_batch` passes
  candidates). One function per phase's items: the learner's state, the rollout's, the
  drafter's, the learner's activations."""
  from tlt_jax.models.config import DTYPE_BYTES
  from tlt_jax.models.transformer import param_shapes
  cfg = spec.cfg
  mem = cfg.memory
  device = device if device is not None else mem.device
  num_devices = num_devices or int(mem.num_devices or 0) or visible_devices()
  fraction = mem.fraction if fraction is None else fraction
  cap = device_bytes(device)
  capacity = None if cap is None else int(cap * fraction)
  m = model_cfg
  shapes = param_shapes(m)
  axes = learner_axes(cfg, num_devices)
  lmesh = _mesh(**axes)
  pbytes = DTYPE_BYTES[m.param_dtype]
  tp = int(cfg.rollout.tensor_parallel)
  mb = int(max_batch if max_batch is not None else spec.max_batch)
  e = spec.engine  # the cache geometry's owner (rollout/config.py)
  pages = int(kv_pages if kv_pages is not None else e.kv_pages or mb * e.row_pages)
  if spec.lora is not None:  # the frozen base in the compute dtype (models/lora.py)
    pbytes = DTYPE_BYTES[m.dtype]
  z = _Sizes(spec=spec, cfg=cfg, m=m, gpu=cap is not None, pbytes=pbytes,
             cbytes=DTYPE_BYTES[m.dtype], shapes=shapes, axes=axes, lmesh=lmesh,
             learner=sharded_bytes(shapes, lmesh, pbytes), tp=tp, rmesh=_mesh(tensor=tp),
             mb=mb, pages=pages, paged=e.plans_paged(m, tp, gpu=cap is not None))
  items = (_learner_state(z) + _rollout(z) + (_drafter(z) if spec.tlt else [])
           + _learner_activations(z))
  return Plan(items, capacity, device or "cpu", num_devices, KNOBS, mb, pages)


KNOBS = {  # what to turn when a phase does not fit
    "rollout": "lower rollout.max_batch (or 0 to size it from memory), raise "
               "rollout.tensor_parallel, or use more devices",
    "spot": "lower tlt.drafter.rows or tlt.drafter.row_len",
    "logprobs": "lower grpo.micro_batch_tokens (or grpo.micro_batch) or grpo.logit_chunk",
    "update": "lower grpo.micro_batch_tokens (or grpo.micro_batch), set model.remat=True "
              "(with model.remat_policy='full': the least memory), "
              "or shard the learner over more devices (mesh.fsdp)"}


def _adapter_bytes(z: _Sizes) -> int:
  """LoRA's adapters per device (float32, sharded by their rules); 0 without LoRA."""
  from tlt_jax.models.lora import adapter_shapes
  return 0 if z.spec.lora is None else sharded_bytes(adapter_shapes(z.m, z.spec.lora), z.lmesh,
                                                    4)


def _learner_state(z: _Sizes) -> list[Item]:
  """The learner's params (FSDP (+ data, tensor) over the learner mesh), its optimizer, a
  reference copy (KL), the gradient accumulator; with LoRA the frozen base (also the
  reference) and the adapters with their optimizer and gradients."""
  m, axes, learner = z.m, z.axes, z.learner
  lora = z.spec.lora
  if lora is not None:
    from tlt_jax.models.lora import adapter_shapes
    ad = _adapter_bytes(z)
    return [Item("learner params", learner, PHASES, f"{_count(z.shapes) / 1e9:.2f}B x "
                 f"{m.dtype}, frozen (LoRA's base; the KL reference), FSDP {axes['fsdp']} x "
                 f"tensor {axes['tensor']}"),
            Item("LoRA adapters", ad, PHASES, f"rank {lora.rank}, "
                 f"{_count(adapter_shapes(m, lora)) / 1e6:.1f}M x float32"),
            Item("optimizer state", 2 * ad, PHASES, "AdamW mu + nu of the adapters"),
            Item("gradient accumulator", ad, ("update",), "the adapters' grads summed")]
  items = [Item("learner params", learner, PHASES, f"{_count(z.shapes) / 1e9:.2f}B x "
                f"{m.param_dtype}, FSDP {axes['fsdp']} x tensor {axes['tensor']}"),
           Item("optimizer state", 2 * learner, PHASES, "AdamW mu + nu, sharded like params")]
  if z.cfg.grpo.kl_coef > 0:
    items.append(Item("reference params", learner, PHASES, "kl_coef > 0: a frozen copy"))
  items.append(Item("gradient accumulator", learner, ("update",), "micro-batch grads summed"))
  return items


def _rollout(z: _Sizes) -> list[Item]:
  """A rollout replica: its weights (tensor parallel, the compute dtype), the KV pages, and
  the larger of a prefill of max_batch rows (a group's n responses prefill their prompt once:
  decode.prefill_shared) and a decode step (logits and the MLP's activations; with the
  attention windows also the scores and one layer's k/v window gathered from the pages, at
  the longest row's window: paged attention reads the pages in place)."""
  m, cfg, cbytes, mb, pages = z.m, z.cfg, z.cbytes, z.mb, z.pages
  L, D, N, K, H, F, V = (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim_,
                         m.intermediate_size, m.vocab_size)
  release = bool(cfg.memory.get("release_rollout_weights", False))
  items = [Item("rollout weights", sharded_bytes(z.shapes, z.rmesh, cbytes),
                ("rollout", "spot") if release else PHASES,
                f"one replica per {z.tp} device(s), {m.dtype}"
                + (", freed after the rollout" if release else ""))]
  S, page = z.spec.engine.cache_len, z.spec.engine.page_size
  kv_token = L * 2 * z.split(K) * H * cbytes
  items.append(Item("KV cache", pages * page * kv_token, ("rollout",),
                    f"{pages} pages x {page} slots x {kv_token / 1024:.0f} KiB/token "
                    f"(= {pages * page / max(mb, 1):.0f} slots per row of max_batch {mb})"))
  P = int(cfg.data.max_prompt_len)
  f_dev, n_dev = z.split(F), z.split(N)
  w = _verify_width(z.spec) if z.spec.tlt else 1
  u = -(-mb // max(int(cfg.grpo.n), 1))  # distinct prompts
  prefill = u * P * (4 * D + 3 * f_dev) * cbytes
  if not (z.gpu and cbytes == 2):  # materialised scores and probabilities (float32)
    prefill += 2 * u * n_dev * P * P * 4
  decode = mb * w * z.split(V) * 4 * 2 + mb * w * (4 * D + 3 * f_dev) * 4
  if not z.paged:  # the windows: scores over S slots and one layer's k/v window gathered
    decode += 2 * mb * n_dev * w * S * 4 + 2 * mb * S * z.split(K) * H * cbytes
  items.append(Item("rollout activations", max(prefill, decode), ("rollout",),
                    f"prefill of {u} prompts x {P} / decode x {w} tokens"))
  return items


def _drafter(z: _Sizes) -> list[Item]:
  """The drafter: the store's copy on the learner mesh, each worker's (and its trainer's
  state), its KV pages, and a spot-training step's activations."""
  from tlt_jax.drafter.loss import LossConfig
  from tlt_jax.drafter.model import drafter_param_shapes
  m, cbytes = z.m, z.cbytes
  D, F, V = m.hidden_size, m.intermediate_size, m.vocab_size
  dshapes = drafter_param_shapes(m)
  items = [Item("drafter (store)", 3 * sharded_bytes(dshapes, z.lmesh, 4), PHASES,
                f"{_count(dshapes) / 1e9:.2f}B params + AdamW, float32")]
  d = z.cfg.tlt.drafter
  trained = d.mode != "off"
  worker = sharded_bytes(dshapes, z.rmesh, 4) * (3 if trained else 1)
  items.append(Item("drafter (worker)", worker, PHASES, "params" + (" + AdamW" if trained
                                                                     else "")))
  page = z.spec.engine.page_size
  items.append(Item("drafter KV cache",
                    z.pages * page * 2 * z.split(m.num_kv_heads) * m.head_dim_ * cbytes,
                    ("rollout",), "one layer, the same pages"))
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


def _learner_activations(z: _Sizes) -> list[Item]:
  """The log-prob pass's and the update's activations: the largest micro-batch (padded to
  max_len), per device."""
  m, cfg, g, axes, cbytes = z.m, z.cfg, z.cfg.grpo, z.axes, z.cbytes
  L, D, N, F, V = m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.vocab_size
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
  gathered = (sharded_bytes(layer_shapes(z.shapes), _mesh(tensor=tp_l), z.pbytes)
              if fsdp > 1 else 0)
  layers_dev = sharded_bytes({"layers": z.shapes["layers"]}, z.lmesh, z.pbytes)  # sharded
  embed_dev = z.learner - layers_dev
  # the stacked per-layer gradients the backward keeps: with LoRA the adapters' (the base's
  # weights take none)
  grads_dev = _adapter_bytes(z) if z.spec.lora is not None else layers_dev
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


def derive_max_batch(spec, model_cfg, *, device: str | None = None,
                     num_devices: int | None = None, fraction: float | None = None
                     ) -> tuple[int, int]:
  """(max_batch, kv_pages): the most rows (a multiple of 8 above 8, capped at the largest
  bucket) whose rollout phase fits with a KV pool that holds them at
  rollout.mean_live_tokens each (0: at their longest; never less than one longest row), and
  the pool's pages: what the phase leaves free (rollout.kv_pages when it is set). Admission
  by pages (rollout/pages.py) keeps the run correct when rows outgrow the mean: the youngest
  wait. ConfigError when not even one sequence fits."""
  kw = dict(device=device, num_devices=num_devices, fraction=fraction)
  base = plan(spec, model_cfg, max_batch=0, kv_pages=0, **kw)
  if base.capacity is None:
    raise ConfigError("(size it from memory) needs a device with a fixed memory size: set "
                      "config.memory.device (e.g. h100) or max_batch", "rollout.max_batch", 0,
                      in_config=True)
  r = spec.cfg.rollout
  S, page, row_pages = spec.engine.cache_len, spec.engine.page_size, spec.engine.row_pages
  live = int(r.get("mean_live_tokens", 0)) or S
  page_bytes = plan(spec, model_cfg, max_batch=0, kv_pages=1, **kw).total("rollout") - \
      base.total("rollout")
  fixed = int(spec.engine.kv_pages)

  def pool(n: int) -> int:  # the pages left beside n rows' activations (or the fixed pool)
    rest = base.capacity - plan(spec, model_cfg, max_batch=n, kv_pages=0, **kw).total("rollout")
    free = rest // max(page_bytes, 1)
    if fixed:
      return fixed if free >= fixed else 0
    return free

  def fits(n: int) -> bool:
    pages = pool(n)
    return pages >= row_pages and pages * page >= n * live

  lo, hi = 0, max(r.buckets)  # fits(lo); the largest n that fits, by bisection (monotone)
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  n = lo
  if n > 8:
    n = n // 8 * 8
  pages = pool(n)
  if n < 1 or pages < row_pages:
    raise ConfigError(
        f"memory: not one sequence fits the rollout phase on {base.device} (the rest needs "
        f"{base.total('rollout') / GiB:.1f} of {base.capacity / GiB:.1f} GiB): raise "
        "rollout.tensor_parallel, shorten rollout.max_new_tokens, or use more devices")
  return n, pages


def visible_devices() -> int:
  import jax
  return jax.device_count()


def human(n: float) -> str:
  return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


