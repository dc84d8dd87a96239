"""The trained model out of a run: its policy as a Hugging Face folder, with its drafter.

  python -m tlt_jax.export --workdir DIR [--step N] [--out DIR] \
      [--dtype bfloat16|float16|float32] [--engine sglang|vllm]

For checkpoint N of a tlt_jax.train run (default: the newest) it writes

  OUT/policy/         the actor as a Hugging Face model folder: model.safetensors (above 5 GB
                      model-0000i-of-0000n.safetensors + model.safetensors.index.json, as
                      transformers shards), config.json (the starting model's, with the
                      architecture's fields and torch_dtype / dtype the dtype written),
                      generation_config.json (the starting model's, else its tokenizer's
                      eos / bos / pad ids) and the starting model's tokenizer files;
                      `transformers.AutoModelForCausalLM.from_pretrained(OUT/policy)` and the
                      serving engines load it as it is
  OUT/drafter_eagle/  the drafter's EAGLE export for --engine (tlt_jax/drafter/export.py),
                      for a run with a drafter (TLT on; without one, the policy alone)
  OUT/adapter/        a LoRA run's adapters (config.model.lora) in PEFT's format:
                      adapter_model.safetensors + adapter_config.json

OUT defaults to <workdir>/export/<N>/; --dtype to the starting model's (its config.json's
torch_dtype or dtype), else the run's model.param_dtype; --engine to the run's
train.export_engine. The starting model is model.path of the run's <workdir>/config.json.
Training writes the same policy folder itself as <workdir>/policy_hf/<N>/ (`export_step`;
config.train.export_policy "final", "every" or "none", dtype config.train.export_dtype), and
with config.train.export_best the policy of its best held-out evaluation so far as
<workdir>/policy_hf/best/, its step and score in best.json (`BestPolicy`).

Memory: the actor is read from the checkpoint onto a mesh of every device (FSDP, as the
learner holds it), then gathered to the host one tensor at a time, a stacked layer leaf one
layer at a time, each converted and written as it comes (hf_io.save_hf_model): no host holds
the model twice. Launched as several processes (srun, mpirun or the TLT_* variables:
tlt_jax/distributed.py), every process reads its shards and takes part in each gather, and
process 0 writes. A folder is written under a `.tmp` name and renamed into place when whole.
A LoRA run's checkpoint holds its adapters (config.model.lora): the policy written is the
starting model with them merged in, in the run's model.dtype, as its rollout decoded it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, NamedTuple

import jax

from tlt_jax.drafter import export as drafter_export
from tlt_jax.drafter.export import ExportError
from tlt_jax.drafter.model import ENGINES, export_eagle
from tlt_jax.errors import output_dir_problem
from tlt_jax.models import lora
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf_io import (MAX_SHARD_BYTES, CheckpointFormatError, load_hf_config,
                                  load_hf_model, read_hf_config, save_hf_model)
from tlt_jax.models.tokenizer import load_tokenizer

DTYPES = ("bfloat16", "float16", "float32")
POLICIES = ("final", "every", "none")  # config.train.export_policy
EXPORT_DIR = "export"  # the command's default OUT: <workdir>/export/<step>/
POLICY_DIR = "policy_hf"  # training's: <workdir>/policy_hf/<step>/
BEST_DIR = "best"  # config.train.export_best's: <workdir>/policy_hf/best/
BEST_FILE = "best.json"  # inside it: the step, the metric and its value
# keys of the starting model's config.json that do not describe the folder written: its
# weights are dense (not quantised), and it is not that model's hub entry
_DROPPED = ("quantization_config", "_name_or_path")


def policy_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, POLICY_DIR, str(int(step)))


def policy_dtype(requested: str, model_dir: str, param_dtype: str) -> str:
  """`requested`; where it is "", the starting model's dtype (config.json's torch_dtype, or
  transformers 5's dtype) if it is one of DTYPES, else the run's param dtype."""
  if requested:
    return requested
  base = read_hf_config(model_dir)
  for key in ("torch_dtype", "dtype"):
    if base.get(key) in DTYPES:
      return base[key]
  return param_dtype


def _generation_config(model_dir: str) -> dict[str, Any] | None:
  """The starting model's generation_config.json, else its tokenizer's special token ids."""
  path = os.path.join(model_dir, "generation_config.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  tok = load_tokenizer(model_dir)
  ids = {f"{k}_token_id": getattr(tok, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
  return {k: v for k, v in ids.items() if v is not None} or None


def write_policy(out: str, params, cfg: ModelConfig, *, model_dir: str, dtype: str,
                 max_shard_bytes: int = MAX_SHARD_BYTES,
                 notes: dict[str, Any] | None = None) -> str:
  """The Hugging Face folder of the actor `params` (any sharding) at `out`, replacing one
  there: weights in `dtype`, and the starting model `model_dir`'s config.json (its
  architecture fields cfg's, its dtype `dtype`), generation config and tokenizer files;
  `notes`: more JSON files in it (name -> content), in place before the folder is. Every
  process calls it (the gathers are collectives); process 0 writes."""
  primary = jax.process_index() == 0
  config = {k: v for k, v in read_hf_config(model_dir).items() if k not in _DROPPED}
  config.update(cfg.to_hf_dict(), torch_dtype=dtype, dtype=dtype)
  tmp = out.rstrip(os.sep) + ".tmp"
  if primary:
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers
  save_hf_model(params, cfg, tmp, dtype=dtype, extra_config=config,
                generation_config=_generation_config(model_dir) if primary else None,
                tokenizer_dir=model_dir, max_shard_bytes=max_shard_bytes)
  if primary:
    for name, content in (notes or {}).items():
      with open(os.path.join(tmp, name), "w") as f:
        json.dump(content, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
  return out


def export_step(workdir: str, step: int, params, cfg: ModelConfig, *, model_dir: str,
                dtype: str, keep: int | None = None) -> str:
  """Training's export of checkpoint `step` to policy_path(workdir, step); with `keep`
  (config.train.keep_checkpoints), all but the newest `keep` are deleted, as the
  checkpointer does with its steps. Every process calls it."""
  out = write_policy(policy_path(workdir, step), params, cfg, model_dir=model_dir, dtype=dtype)
  if keep is not None and jax.process_index() == 0:
    drafter_export.keep_newest(os.path.join(workdir, POLICY_DIR), keep)
  return out


def best_path(workdir: str) -> str:
  return os.path.join(workdir, POLICY_DIR, BEST_DIR)


def read_best(workdir: str) -> dict[str, Any] | None:
  """best.json of <workdir>/policy_hf/best/ (None: no best policy written)."""
  try:
    with open(os.path.join(best_path(workdir), BEST_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def best_source(metric: str) -> str | None:
  """config.train.export_best's source: "accuracy" -> None (every held-out prompt),
  "accuracy:<source>" -> <source> (one test file's prompts, `eval.accuracy_by_source`)."""
  return metric.partition(":")[2] or None


class BestPolicy:
  """config.train.export_best: the policy whose held-out evaluation scored best so far, as
  <workdir>/policy_hf/best/ with best.json ({"step", "metric", "value"}). A step's policy is
  written where its score beats every earlier evaluation's of this metric in the run, the
  starting policy's (step 0) included, which is not written (it is model.path): ties keep the
  earlier step. A resumed run's bar is the best of best.json (of the same metric) and the
  evaluations its metrics.jsonl holds up to the restored step."""

  def __init__(self, workdir: str, metric: str, bar: float | None = None):
    self.workdir, self.metric, self.bar = workdir, metric, bar
    self.source = best_source(metric)

  @classmethod
  def resume(cls, workdir: str, metric: str, start: int) -> "BestPolicy":
    from tlt_jax.metrics import read_records
    best = cls(workdir, metric)
    path = os.path.join(workdir, "metrics.jsonl")
    records = read_records(path) if start > 0 and os.path.isfile(path) else []
    values = [best.value(r["eval"]) for r in records if "eval" in r and r["step"] <= start]
    saved = read_best(workdir)
    if saved is not None and saved.get("metric") == metric:
      values.append(saved.get("value"))
    values = [v for v in values if v is not None]
    best.bar = max(values) if values else None
    return best

  def value(self, ev: dict[str, Any]) -> float | None:
    """The metric of an evaluation's record (`train.evaluate`'s): its accuracy, or its
    source's (a run with one source has no breakdown: its accuracy is the source's)."""
    if self.source is not None and "accuracy_by_source" in ev:
      return ev["accuracy_by_source"].get(self.source)
    return ev.get("accuracy")

  def offer(self, step: int, value: float | None, write) -> bool:
    """Step `step` scored `value` (None: not evaluated): where it beats the bar, `write(out,
    notes)` writes its policy to `out` with `notes` (write_policy's) and the bar rises;
    step 0 (the starting policy) sets the bar only. Returns whether it wrote."""
    if value is None or (self.bar is not None and value <= self.bar):
      return False
    self.bar = value
    if step == 0:
      return False
    write(best_path(self.workdir),
          {BEST_FILE: {"step": int(step), "metric": self.metric, "value": float(value)}})
    return True


class Exported(NamedTuple):
  """What `export_run` wrote."""

  step: int
  policy: str  # the Hugging Face folder
  dtype: str
  drafter: str | None  # the EAGLE export (None: the run has no drafter)
  engine: str
  adapter: str | None = None  # a LoRA run's adapters in PEFT's format (None: no LoRA)


def export_run(workdir: str, *, step: int | None = None, out: str | None = None,
               dtype: str | None = None, engine: str | None = None,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
  """OUT/policy and, for a run with a drafter, OUT/drafter_eagle of checkpoint `step` (the
  module docstring: the defaults). ExportError, one line naming the input and the fix, for a
  missing workdir, config.json or starting model, no checkpoints, an unknown step, a bad
  dtype or engine, an --out that cannot be a directory, found before anything is written.
  Every process calls it."""
  from tlt_jax.checkpoint import Checkpointer, CheckpointError
  from tlt_jax.models.transformer import abstract_params
  from tlt_jax.sharding import make_mesh, tree_shardings
  if not os.path.isdir(workdir):
    raise ExportError(f"--workdir {workdir!r} does not exist; pass the workdir of a "
                      "tlt_jax.train run")
  cpath = os.path.join(workdir, "config.json")
  if not os.path.isfile(cpath):
    raise ExportError(f"--workdir {workdir}: no config.json; not the workdir of a tlt_jax.train "
                      "run")
  with open(cpath) as f:
    run_cfg = json.load(f)
  if dtype is not None and dtype not in DTYPES:
    raise ExportError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
  engine = engine or run_cfg.get("train", {}).get("export_engine", "sglang")
  if engine not in ENGINES:
    raise ExportError(f"--engine {engine!r} is not one of {list(ENGINES)}")
  m = run_cfg.get("model", {})
  model_dir = m.get("path", "")
  try:
    cfg = load_hf_config(model_dir, param_dtype=m.get("param_dtype", "float32"))
    dtype = policy_dtype(dtype or "", model_dir, cfg.param_dtype)
  except CheckpointFormatError as e:
    raise ExportError(f"{cpath}: model.path: {e}") from None
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise ExportError(f"--workdir {workdir}: no checkpoints in {ckpt_dir}; the run saved none "
                      "yet (config.train.checkpoint_every)")
  with Checkpointer(ckpt_dir, max_to_keep=None) as ckpt:
    steps = ckpt.all_steps()
    if not steps:
      raise ExportError(f"--workdir {workdir}: no checkpoints in {ckpt_dir}; the run saved "
                        "none yet (config.train.checkpoint_every)")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
      raise ExportError(f"--step {step}: {ckpt_dir} holds steps {steps}; pass one of them")
    out = out or os.path.join(workdir, EXPORT_DIR, str(step))
    made = os.path.abspath(out)  # the topmost folder output_dir_problem makes (None: none)
    while not os.path.exists(os.path.dirname(made)):
      made = os.path.dirname(made)
    made = None if os.path.exists(made) else made
    why = output_dir_problem(out)
    if why:
      raise ExportError(f"--out {out}: {why}; pass a directory (new, or an earlier export's)")
    try:
      dparams = ckpt.read_subtree("drafter/params", step)
      if dparams:
        drafter_export.check_engine(cfg, engine)
      # the actor over every device of every process, as the learner holds it
      mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
      lo = lora.from_settings(m.get("lora") or {})
      shapes = abstract_params(cfg)
      if lo is not None:  # the checkpoint's actor: the adapters (models/lora.py)
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jax.numpy.float32),
                              lora.adapter_shapes(cfg, lo), is_leaf=lambda x: isinstance(x, tuple))
      shardings = tree_shardings(shapes, mesh)
      template = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              shapes, shardings)
      params = ckpt.read_subtree("actor", step, template=template)
      adapters = None
      if lo is not None:  # attached to the base as the run's learner held it (model.dtype),
        # merged a layer at a time as the policy is written (hf_io.hf_state_dict)
        adapters = params
        if jax.process_count() > 1:  # (slices on other processes: every process takes part)
          from jax.experimental import multihost_utils
          adapters = multihost_utils.process_allgather(adapters, tiled=True)
        adapters = jax.device_get(adapters)
        held = m.get("dtype", "float32")
        base = load_hf_model(model_dir, dtype=held, param_dtype=held, mesh=mesh)[1]
        params = lora.attach(base, params, lo.scale)
        del base
    except (CheckpointError, ExportError) as e:
      if made is not None:  # (nothing written in it yet: an error leaves no folder behind)
        shutil.rmtree(made, ignore_errors=True)
      what = f"--workdir {workdir}" if isinstance(e, CheckpointError) else f"--engine {engine}"
      raise ExportError(f"{what}: {e}") from None
  policy = write_policy(os.path.join(out, "policy"), params, cfg, model_dir=model_dir,
                        dtype=dtype, max_shard_bytes=max_shard_bytes)
  del params
  drafter = None
  if dparams:
    drafter = os.path.join(out, drafter_export.EXPORT_DIR)
    if jax.process_index() == 0:
      export_eagle(drafter, dparams, cfg, target_hf_config=read_hf_config(model_dir),
                   engine=engine)
  adapter = None
  if adapters is not None:
    adapter = os.path.join(out, "adapter")
    if jax.process_index() == 0:
      lora.save_peft_adapter(adapter, adapters, lo, base_model=model_dir)
  return Exported(step, policy, dtype, drafter, engine, adapter)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tlt_jax.export",
                              description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="the workdir of a tlt_jax.train run")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  p.add_argument("--out", default=None, help="default: <workdir>/export/<step>")
  p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the "
                 "starting model's, else the run's model.param_dtype)")
  p.add_argument("--engine", default=None, help="the drafter's: sglang, or vllm (Llama "
                 "targets only); default: the run's train.export_engine")
  args = p.parse_args(argv)
  from tlt_jax import distributed
  distributed.initialize()  # launched as several processes: join them first
  try:
    done = export_run(args.workdir, step=args.step, out=args.out, dtype=args.dtype,
                      engine=args.engine)
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if distributed.is_primary():
    print(f"wrote {done.policy}: the policy at step {done.step} ({done.dtype}), a Hugging Face "
          "model folder")
    if done.adapter is not None:
      print(f"wrote {done.adapter}: the LoRA adapters in PEFT's format (peft.PeftModel."
            "from_pretrained on the starting model, or a serving engine's LoRA adapter)")
    if done.drafter is None:
      print(f"no drafter: checkpoint {done.step} holds none (a run with tlt.enabled=False "
            "trains none); wrote the policy alone")
    else:
      print(f"wrote {done.drafter}: the drafter's EAGLE export for {done.engine}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
