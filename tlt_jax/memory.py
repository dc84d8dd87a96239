"""Per-device memory plan of a training run: what is resident in each phase, from the config.

A run has five phases on every device (README: architecture), and their peaks decide whether a
config fits its GPUs:
  rollout   learner state + rollout weights + KV cache + decode/prefill activations
  spot      the same device once its share is decoded (the KV cache is freed): the drafter
            trained on the idle worker
  logprobs  learner state + rollout weights + the forward of the largest micro-batch
  update    learner state + gradient accumulator + rollout weights + the backward of the
            largest micro-batch
  sync      learner state + the rollout weights made anew from the learner's (beside the old
            copy unless memory.release_rollout_weights freed it) + the conversion's working
            memory, a layer at a time (with LoRA the merge's float32 products)

Everything is counted per device (memory_phases.py: what each phase holds) from the same
layout rules the run uses (`sharding.PARAM_RULES` over the learner's FSDP mesh and each
rollout replica's tensor-parallel mesh), so an axis that does not divide a dimension is
replicated here as it is there.
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
from tlt_jax.errors import ConfigError
from tlt_jax.memory_phases import (PHASES, Item, Sizes, drafter, learner_activations,
                                   learner_axes, learner_state, rollout, sharded_bytes,
                                   stand_in_mesh, sync)

GiB = 1 << 30
# Memory of one device, GB as vendors state them (1e9 bytes); "cpu" has no fixed limit.
DEVICE_MEMORY_GB = {"h100": 80, "h100-80gb": 80, "h100-94gb": 94, "h200": 141, "h200-141gb": 141,
                    "a100": 80, "a100-80gb": 80, "a100-40gb": 40, "l40s": 48, "b200": 180,
                    "gh200": 96, "a10g": 24, "l4": 24}

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


# --------------------------------------------------------------------------------- plan
def plan(spec, model_cfg, *, device: str | None = None, num_devices: int | None = None,
         fraction: float | None = None, max_batch: int | None = None,
         kv_pages: int | None = None) -> Plan:
  """The per-device plan of a run (spec: its config.RunSpec; model_cfg: runtime.model_config).
  device / num_devices / fraction: default config.memory.*; max_batch, kv_pages: default the
  spec's (rollout.kv_pages 0: max_batch rows of max length; `derive_max_batch` passes
  candidates). One function per phase's items (memory_phases.py): the learner's state, the
  rollout's, the sync's, the drafter's, the learner's activations."""
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
  lmesh = stand_in_mesh(**axes)
  pbytes = DTYPE_BYTES[m.param_dtype]
  tp = int(cfg.rollout.tensor_parallel)
  mb = int(max_batch if max_batch is not None else spec.max_batch)
  e = spec.engine  # the cache geometry's owner (rollout/config.py)
  pages = int(kv_pages if kv_pages is not None else e.kv_pages or mb * e.row_pages)
  if spec.lora is not None:  # the frozen base in the compute dtype (models/lora.py)
    pbytes = DTYPE_BYTES[m.dtype]
  z = Sizes(spec=spec, cfg=cfg, m=m, gpu=cap is not None, pbytes=pbytes,
             cbytes=DTYPE_BYTES[m.dtype], shapes=shapes, axes=axes, lmesh=lmesh,
             learner=sharded_bytes(shapes, lmesh, pbytes), tp=tp, rmesh=stand_in_mesh(tensor=tp),
             mb=mb, pages=pages, paged=e.plans_paged(m, tp, gpu=cap is not None))
  items = (learner_state(z) + rollout(z) + sync(z) + (drafter(z) if spec.tlt else [])
           + learner_activations(z))
  return Plan(items, capacity, device or "cpu", num_devices, KNOBS, mb, pages)


KNOBS = {  # what to turn when a phase does not fit
    "rollout": "lower rollout.max_batch (or 0 to size it from memory), raise "
               "rollout.tensor_parallel, or use more devices",
    "spot": "lower tlt.drafter.rows or tlt.drafter.row_len",
    "logprobs": "lower grpo.micro_batch_tokens (or grpo.micro_batch) or grpo.logit_chunk",
    "update": "lower grpo.micro_batch_tokens (or grpo.micro_batch), set model.remat=True "
              "(with model.remat_policy='full': the least memory), "
              "or shard the learner over more devices (mesh.fsdp)",
    "sync": "set memory.release_rollout_weights=True (the old rollout copy freed before the "
            "new is made), raise rollout.tensor_parallel, or use more devices"}


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


