"""The policy out of a run (`python -m tlt_jax.export`, config.train.export_policy) against
Hugging Face transformers as the independent reference.

Three short GRPO runs (2 steps, 2 prompts x 4 samples, the learner FSDP over the 8 test
devices) start from tiny random HF checkpoints made with transformers (every tensor random):
a Qwen2 (qkv biases, tied head) and a Qwen3 (q/k norms, head_dim apart from hidden/heads)
with TLT on, so a drafter is checkpointed beside the actor, and a Llama (attention_bias,
untied head) with TLT off. A reward that varies with the random
text makes the advantages, so the actor, non-zero. What the export wrote is loaded by
`transformers.AutoModelForCausalLM.from_pretrained` alone; its logits must equal
`tlt_jax.models.forward` on the checkpoint's params (read with the Checkpointer, no export
code) to F32_TOL, and its greedy `generate` the project's greedy decoding (`Engine`).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tlt_jax import config as config_lib
from tlt_jax import runtime
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.config import asset_path
from tlt_jax.export import ExportError, export_run, policy_path
from tlt_jax.models import forward
from tlt_jax.models.hf_io import hf_state_dict, load_hf_config, load_hf_model
from tlt_jax.models.safetensors_io import read_safetensors_header
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import make_mesh
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = asset_path("default", "model")  # the default task's tokenizer (32 tokens)
F32_TOL = 1e-4  # max|ours - hf| / max(1, max|hf|), as tests/test_models.py
EOS = 1  # the default tokenizer's <|endoftext|>
STEPS = 2
# a reward of the text alone, which differs between a random model's samples
REWARD = "def digits(response, answer):\n  return sum(c.isdigit() for c in response) / " \
         "(1.0 + len(response))\n"
ARCHS = {
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False)),
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True,
                                             rope_theta=500.0)),
    # q/k norms, head_dim 32 != 64 / 4, as Qwen3's sizes
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32,
                                             rope_theta=1e6)),
}


def _env():
  return user_env(PYTHONPATH=ROOT)


def _starting_model(path: str, arch: str, seed: int) -> None:
  """A tiny random `arch` checkpoint with the default task's tokenizer; the Qwen2 one with
  the default model's generation_config.json, the Llama one without (the export builds one
  from the tokenizer)."""
  cls, kw = ARCHS[arch]
  config = cls(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               eos_token_id=EOS, pad_token_id=0, **kw)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in model.named_parameters():  # norms around 1, weights and biases around 0
      p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
  model.save_pretrained(path)
  os.remove(os.path.join(path, "generation_config.json"))
  names = ["tokenizer.json", "tokenizer_config.json"]
  names += ["generation_config.json"] if arch == "qwen2" else []
  for name in names:
    shutil.copy(os.path.join(TOKENIZER, name), path)


def _spec(workdir, model_dir, reward, *, tlt: bool, **overrides):
  """configs/default.py made small: 2 steps on the tiny model, a checkpoint each step."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.workdir = str(workdir)
  cfg.compilation_cache = ""
  cfg.model.path = model_dir
  for key, value in {"train.steps": STEPS, "train.eval_every": 0, "train.checkpoint_every": 1,
                     "grpo.num_prompts": 2, "grpo.n": 4, "grpo.micro_batch": 8,
                     "grpo.minibatches": 1, "rollout.max_batch": 8,
                     "rollout.max_new_tokens": 16, "rollout.num_workers": 1,
                     "reward.name": reward, "reward.num_workers": 1,
                     "mesh.devices": 0,  # the learner FSDP over all 8 devices: a sharded actor
                     "optim.lr": 1e-3, "optim.warmup_steps": 0, **overrides}.items():
    section, field = key.split(".")
    cfg[section][field] = value
  if tlt:  # a drafter in the checkpoint; nothing speculative compiled or trained
    cfg.tlt.drafter.init = "init:0"
    cfg.tlt.drafter.mode = "off"
    cfg.tlt.drafter.acceptance_sample = 0
    cfg.tlt.spec.selector = "fixed"
    cfg.tlt.spec.strategy = "off"
    cfg.tlt.spec.history = False
  else:
    cfg.tlt.enabled = False
  return runtime.prepare(config_lib.run_spec(cfg))  # (train writes the workdir's config.json)


def _train(spec):
  from tlt_jax.run import build
  from tlt_jax.train import train
  run, state = build(spec)
  train(run, state, progress=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """arch -> the workdir and starting model of its finished 2-step run: Qwen2 with TLT on
  and export_policy "final" (the default), Llama with TLT off and "every" (keep 2)."""
  root = tmp_path_factory.mktemp("export_runs")
  reward = str(root / "reward.py")
  with open(reward, "w") as f:
    f.write(REWARD)
  out = {}
  for i, arch in enumerate(ARCHS):
    model_dir, workdir = str(root / f"{arch}_model"), root / f"{arch}_run"
    _starting_model(model_dir, arch, seed=i)
    every = {} if arch != "llama" else {"train.export_policy": "every"}
    _train(_spec(workdir, model_dir, f"{reward}:digits", tlt=arch != "llama", **every))
    out[arch] = dict(workdir=str(workdir), model_dir=model_dir, reward=f"{reward}:digits")
  return out


def _checkpoint_params(workdir, step):
  with Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
    return ck.read_subtree("actor", step)


def _hf(folder, dtype=torch.float32):
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _prompts(n=4):
  tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
  with open(asset_path("default", "data", "test.jsonl")) as f:
    rows = [json.loads(line) for _, line in zip(range(n), f)]
  return [tok.encode(r["prompt"]) for r in rows]


def _assert_logits_equal(model, cfg, params, prompts):
  for ids in prompts:
    with torch.no_grad():
      want = model(torch.tensor([ids])).logits.float().numpy()[0]
    tokens = jnp.asarray([ids], jnp.int32)
    got = np.asarray(forward(params, tokens, jnp.arange(len(ids))[None], cfg=cfg).logits)[0]
    rel = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert rel <= F32_TOL, rel


def _greedy_ours(params, cfg, prompts, max_new):
  engine = Engine(params, cfg, EngineConfig(max_batch=4, buckets=(1, 2, 4), chunk_size=4,
                                            max_prompt_len=32, prompt_bucket=32,
                                            max_new_tokens=max_new, stop_tokens=(EOS,)))
  out = engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)],
                        SamplingParams(temperature=0.0))
  return [r.response_ids.tolist() for r in sorted(out, key=lambda r: r.request_id)]


def _greedy_hf(model, prompts, max_new):
  outs = []
  for ids in prompts:
    t = torch.tensor([ids])
    with torch.no_grad():
      o = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, num_beams=1,
                         max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0)
    outs.append(o[0, len(ids):].tolist())
  return outs


# ------------------------------------------------------------------ the export vs transformers
@pytest.mark.parametrize("arch", list(ARCHS))
def test_exported_policy_is_the_checkpoint_in_transformers(runs, arch):
  """The command (a subprocess) writes export/<step>/policy,
  which transformers loads: its logits are the checkpoint's under tlt_jax's forward, its
  greedy generations the project's, its weights not the starting model's (the run trained);
  config.json is the starting model's with the dtype written, and the generation config and
  tokenizer files are the starting model's (Llama: one from the tokenizer's ids). The
  drafter's EAGLE export sits beside it for the TLT run; the Llama run has none, said."""
  r = runs[arch]
  workdir, model_dir = r["workdir"], r["model_dir"]
  out = os.path.join(workdir, "export", str(STEPS))
  p = subprocess.run([sys.executable, "-m", "tlt_jax.export", "--workdir", workdir],
                     cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  wrote = f"wrote {out}/policy: the policy at step {STEPS} (float32), a Hugging Face model folder"
  if arch != "llama":
    assert p.stdout.splitlines() == [
        wrote, f"wrote {out}/drafter_eagle: the drafter's EAGLE export for sglang"]
    assert sorted(os.listdir(os.path.join(out, "drafter_eagle"))) == ["config.json",
                                                                      "model.safetensors"]
    with open(os.path.join(out, "drafter_eagle", "config.json")) as f:
      eagle = json.load(f)["architectures"]
    assert eagle == [{"qwen2": "Qwen2ForCausalLMEagle", "qwen3": "Qwen3ForCausalLMEagle"}[arch]]
  else:
    assert p.stdout.splitlines() == [
        wrote, f"no drafter: checkpoint {STEPS} holds none (a run with tlt.enabled=False trains "
        "none); wrote the policy alone"]
    assert os.listdir(out) == ["policy"]
  policy = os.path.join(out, "policy")
  assert "model.safetensors" in os.listdir(policy)
  assert not any(n.endswith(".tmp") for n in os.listdir(out))

  cfg = load_hf_config(model_dir)
  params = jax.tree.map(jnp.asarray, _checkpoint_params(workdir, STEPS))
  model = _hf(policy)
  prompts = _prompts()
  _assert_logits_equal(model, cfg, params, prompts)
  assert _greedy_hf(model, prompts, 12) == _greedy_ours(params, cfg, prompts, 12)

  start = _hf(model_dir).state_dict()
  moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
  assert len(moved) == len(start)  # every tensor trained (Adam moves each by ~lr)

  conf = json.load(open(os.path.join(policy, "config.json")))
  base = json.load(open(os.path.join(model_dir, "config.json")))
  assert conf["torch_dtype"] == conf["dtype"] == "float32"
  for k, v in base.items():  # every entry of the starting model's kept, as it was
    assert conf[k] == v, k
  gen = json.load(open(os.path.join(policy, "generation_config.json")))
  if arch == "qwen2":
    assert gen == json.load(open(os.path.join(model_dir, "generation_config.json")))
  else:
    assert gen == {"eos_token_id": EOS, "pad_token_id": 0}  # no bos in this tokenizer
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert open(os.path.join(policy, name)).read() == open(os.path.join(model_dir, name)).read()
  tok = transformers.AutoTokenizer.from_pretrained(policy)
  assert tok.encode("7+3=10") == transformers.AutoTokenizer.from_pretrained(TOKENIZER).encode(
      "7+3=10")


def _files(folder):
  return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def test_training_writes_the_policy_at_the_end_or_every_checkpoint(runs, tmp_path):
  """export_policy="final" leaves policy_hf/<last step>/ alone, "every" one per checkpoint
  (here both kept); each equals the command's folder file for file. A resumed run with no
  step left neither crashes nor rewrites it; "none" writes none."""
  q, l = runs["qwen2"], runs["llama"]
  assert os.listdir(os.path.join(q["workdir"], "policy_hf")) == [str(STEPS)]
  assert sorted(os.listdir(os.path.join(l["workdir"], "policy_hf"))) == ["1", "2"]
  for r in (q, l):
    final = policy_path(r["workdir"], STEPS)
    cli = export_run(r["workdir"], out=str(tmp_path / os.path.basename(r["workdir"]))).policy
    assert _files(final) == _files(cli)
  one = policy_path(l["workdir"], 1)
  model = _hf(one)
  cfg = load_hf_config(l["model_dir"])
  _assert_logits_equal(model, cfg, jax.tree.map(jnp.asarray, _checkpoint_params(
      l["workdir"], 1)), _prompts(2))

  before = os.stat(os.path.join(policy_path(q["workdir"], STEPS), "model.safetensors"))
  _train(_spec(q["workdir"], q["model_dir"], q["reward"], tlt=True))  # nothing left to do
  after = os.stat(os.path.join(policy_path(q["workdir"], STEPS), "model.safetensors"))
  assert after.st_mtime_ns == before.st_mtime_ns and after.st_ino == before.st_ino


def test_bfloat16_export_is_bfloat16_on_disk(runs, tmp_path):
  """--dtype bfloat16: every tensor BF16 in the file and in config.json, and the weights are
  torch's own rounding of the float32 export's."""
  r = runs["llama"]
  f32 = export_run(r["workdir"], out=str(tmp_path / "f32")).policy
  bf16 = export_run(r["workdir"], out=str(tmp_path / "bf16"), dtype="bfloat16").policy
  header, _ = read_safetensors_header(os.path.join(bf16, "model.safetensors"))
  assert {v["dtype"] for v in header.values()} == {"BF16"}
  conf = json.load(open(os.path.join(bf16, "config.json")))
  assert conf["torch_dtype"] == conf["dtype"] == "bfloat16"
  got = _hf(bf16, dtype=torch.bfloat16).state_dict()
  want = _hf(f32).to(torch.bfloat16).state_dict()
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]), k


def test_sharded_export_has_an_index_and_loads(runs, tmp_path):
  """Above the max shard size the weights are model-0000i-of-0000n.safetensors with
  model.safetensors.index.json (each file under the size, every tensor once); transformers
  loads them into the same model as the single file."""
  r = runs["qwen2"]
  one = export_run(r["workdir"], out=str(tmp_path / "one")).policy
  many = export_run(r["workdir"], out=str(tmp_path / "many"), max_shard_bytes=40_000).policy
  files = sorted(n for n in os.listdir(many) if n.endswith(".safetensors"))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
  assert sorted(set(index["weight_map"].values())) == files
  total = 0
  for name in files:
    header, offset = read_safetensors_header(os.path.join(many, name))
    size = os.path.getsize(os.path.join(many, name)) - offset
    assert size <= 40_000 or len(header) == 1
    assert all(index["weight_map"][k] == name for k in header)
    total += size
  assert index["metadata"]["total_size"] == total
  a, b = _hf(one).state_dict(), _hf(many).state_dict()
  assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gather_of_sharded_params_is_the_hf_state_dict(tmp_path):
  """hf_state_dict on params spread over the 8 devices (FSDP and tensor axes) yields, one
  tensor at a time, exactly the tensors transformers saved (an untied Llama with biases)."""
  _starting_model(str(tmp_path), "llama", seed=5)
  mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  cfg, params = load_hf_model(str(tmp_path), mesh=mesh)
  assert len(params["layers"]["q"].sharding.device_set) == 8
  want = _hf(str(tmp_path)).state_dict()
  got = dict(hf_state_dict(params, cfg))
  assert got.keys() == want.keys()
  for k, v in got.items():
    assert v.flags["C_CONTIGUOUS"] and np.array_equal(v, want[k].numpy()), k


# ------------------------------------------------------------------------------- user mistakes
def test_user_errors_are_one_line_and_touch_nothing(runs, tmp_path):
  r = runs["qwen2"]
  workdir = r["workdir"]
  def listing(d):  # (export/ exists once another test exported from this run)
    path = os.path.join(workdir, d)
    return sorted(os.listdir(path)) if os.path.isdir(path) else None
  before = {d: listing(d) for d in ("checkpoints", "policy_hf", "drafter_eagle", "export")}
  (tmp_path / "bare").mkdir()
  (tmp_path / "fresh").mkdir()
  (tmp_path / "a_file").write_text("kept")
  with open(tmp_path / "fresh" / "config.json", "w") as f:
    f.write(open(os.path.join(workdir, "config.json")).read())
  for kwargs, msg in [
      (dict(workdir=str(tmp_path / "nope")),
       f"--workdir {str(tmp_path / 'nope')!r} does not exist; pass the workdir of a "
       "tlt_jax.train run"),
      (dict(workdir=str(tmp_path / "bare")),
       f"--workdir {tmp_path / 'bare'}: no config.json; not the workdir of a tlt_jax.train run"),
      (dict(workdir=str(tmp_path / "fresh")),
       f"--workdir {tmp_path / 'fresh'}: no checkpoints in {tmp_path / 'fresh' / 'checkpoints'}; "
       "the run saved none yet (config.train.checkpoint_every)"),
      (dict(workdir=workdir, step=7),
       f"--step 7: {workdir}/checkpoints holds steps [1, 2]; pass one of them"),
      (dict(workdir=workdir, dtype="fp8"),
       "--dtype 'fp8' is not one of ['bfloat16', 'float16', 'float32']"),
      (dict(workdir=workdir, engine="vllm"),
       "--engine vllm: export_eagle(engine='vllm'): vLLM has no EAGLE-1 drafter class for "
       "qwen2 targets (only EagleLlamaForCausalLM); use engine='sglang'"),
      (dict(workdir=workdir, out=str(tmp_path / "a_file")),
       f"--out {tmp_path / 'a_file'}: is a file; pass a directory (new, or an earlier export's)"),
      (dict(workdir=workdir, out=str(tmp_path / "a_file" / "x")),
       f"--out {tmp_path / 'a_file' / 'x'}: cannot be made ({tmp_path / 'a_file'} is a file); "
       "pass a directory (new, or an earlier export's)")]:
    with pytest.raises(ExportError) as e:
      export_run(kwargs.pop("workdir"), **kwargs)
    assert str(e.value) == msg
  p = subprocess.run([sys.executable, "-m", "tlt_jax.export", "--workdir", workdir, "--step",
                      "7"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert p.returncode == 2 and p.stdout == ""
  assert p.stderr.strip().splitlines() == [
      f"error: --step 7: {workdir}/checkpoints holds steps [1, 2]; pass one of them"]
  after = {d: listing(d) for d in before}
  assert after == before and (tmp_path / "a_file").read_text() == "kept"


def test_export_policy_and_dtype_are_validated(tmp_path):
  from tlt_jax.errors import ConfigError
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.train.export_policy = "always"
  with pytest.raises(ConfigError) as e:
    config_lib.run_spec(cfg)
  assert str(e.value) == (
      "config.train.export_policy='always': use one of ['final', 'every', 'none']: the policy "
      "as a Hugging Face folder at the last checkpoint only, at every checkpoint, or never")
  cfg.train.export_policy = "none"
  cfg.train.export_dtype = "fp16"
  with pytest.raises(ConfigError, match=r"config.train.export_dtype='fp16': use one of "):
    config_lib.run_spec(cfg)


def test_two_processes_export_what_one_does(runs, tmp_path):
  """Launched as 2 processes x 4 CPU devices, each reads its shards of the actor and joins
  every gather, process 0 alone writes: the same files as one process."""
  from tests.mp_launch import describe, launch
  r = runs["qwen2"]
  one = export_run(r["workdir"], out=str(tmp_path / "one"))
  results = launch("tlt_jax.export", 2, devices_per_process=4, timeout=300,
                   args=["--workdir", r["workdir"], "--out", str(tmp_path / "two")])
  assert all(x.returncode == 0 for x in results), describe(results)
  assert "process 1/2" in results[1].stderr and "wrote" not in results[1].stdout
  for sub in ("policy", "drafter_eagle"):
    assert _files(os.path.join(one.policy, os.pardir, sub)) == _files(str(tmp_path / "two" / sub))


def test_best_policy_rule_on_scripted_scores(tmp_path):
  """BestPolicy's rule, counted by hand: a step is written where its score beats every earlier
  one (ties keep the earlier step), the starting policy's (step 0) sets the bar unwritten, an
  unevaluated step (None) changes nothing; `accuracy:<source>` reads that source's accuracy;
  a resumed run's bar is the best of the records up to its step and best.json of its metric."""
  from tlt_jax.export import BEST_FILE, BestPolicy, best_path
  wrote = []
  best = BestPolicy(str(tmp_path), "accuracy")
  scores = {0: 0.5, 1: 0.25, 2: 0.75, 3: 0.75, 4: None, 5: 0.5, 6: 0.8}
  for step, value in scores.items():
    best.offer(step, value, lambda out, notes: wrote.append((out, notes)))
  assert [n[BEST_FILE]["step"] for _, n in wrote] == [2, 6]
  assert wrote[-1] == (best_path(str(tmp_path)),
                       {BEST_FILE: {"step": 6, "metric": "accuracy", "value": 0.8}})
  assert BestPolicy(str(tmp_path), "accuracy:b").value(
      {"accuracy": 0.5, "accuracy_by_source": {"a": 0.25, "b": 0.75}}) == 0.75
  assert BestPolicy(str(tmp_path), "accuracy:b").value({"accuracy": 0.5}) == 0.5  # one source

  def ev(acc, b):
    return {"accuracy": acc, "accuracy_by_source": {"a": 0.0, "b": b}}
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step, e in [(0, ev(0.4, 0.1)), (1, None), (2, ev(0.6, 0.3)), (4, ev(0.9, 0.9))]:
      f.write(json.dumps({"step": step, **({"eval": e} if e else {})}) + "\n")
  assert BestPolicy.resume(str(tmp_path), "accuracy", 3).bar == 0.6  # step 4 was lost
  assert BestPolicy.resume(str(tmp_path), "accuracy:b", 3).bar == 0.3
  assert BestPolicy.resume(str(tmp_path), "accuracy", 0).bar is None  # a fresh run
  os.makedirs(best_path(str(tmp_path)))
  with open(os.path.join(best_path(str(tmp_path)), BEST_FILE), "w") as f:
    json.dump({"step": 3, "metric": "accuracy", "value": 0.7}, f)
  assert BestPolicy.resume(str(tmp_path), "accuracy", 3).bar == 0.7
  assert BestPolicy.resume(str(tmp_path), "accuracy:b", 3).bar == 0.3  # another metric's


def test_training_keeps_the_best_evaluated_policy_across_a_resume(runs, tmp_path, monkeypatch):
  """train.export_best with evaluation scripted by step: policy_hf/best/ holds the policy of
  the step that scored best (step 2; step 3's tie keeps it), file for file the command's
  export of that step's checkpoint, with best.json; only that step's record times an export.
  Resumed to 6 steps, step 5's score equal to the saved best writes nothing (the bar came back
  from best.json), step 6's higher one replaces it."""
  from tlt_jax import train as train_mod
  from tlt_jax.export import BEST_FILE, best_path
  r = runs["llama"]
  scores = {0: 0.5, 1: 0.25, 2: 0.75, 3: 0.75, 4: 0.5, 5: 0.75, 6: 0.875}

  def scripted(run, pool, state, bandit):
    return {"accuracy": scores[state.step]}, bandit
  monkeypatch.setattr(train_mod, "evaluate", scripted)
  workdir = tmp_path / "run"
  test = config_lib.asset_path("default", "data", "test.jsonl")
  kw = {"train.eval_every": 1, "train.export_best": "accuracy", "train.keep_checkpoints": 10,
        "train.export_policy": "none", "data.test_path": test, "eval.num_prompts": 2}
  _train(_spec(workdir, r["model_dir"], r["reward"], tlt=False, **{"train.steps": 4, **kw}))
  best = best_path(str(workdir))
  with open(os.path.join(best, BEST_FILE)) as f:
    assert json.load(f) == {"step": 2, "metric": "accuracy", "value": 0.75}
  recs = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [x["step"] for x in recs if "export_best" in x.get("time", {})] == [2]

  def same_as_checkpoint(step):
    cli = export_run(str(workdir), step=step, out=str(tmp_path / f"cli{step}")).policy
    files = _files(best)
    del files[BEST_FILE]
    assert files == _files(cli)
  same_as_checkpoint(2)
  _train(_spec(workdir, r["model_dir"], r["reward"], tlt=False, **{"train.steps": 6, **kw}))
  with open(os.path.join(best, BEST_FILE)) as f:
    assert json.load(f) == {"step": 6, "metric": "accuracy", "value": 0.875}
  recs = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [x["step"] for x in recs if "export_best" in x.get("time", {})] == [2, 6]
  same_as_checkpoint(6)
