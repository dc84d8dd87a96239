"""Configs load and validate; user mistakes are one clear line (tlt_jax/config.py, the CLIs'
error path)."""

import functools
import json
import os
import subprocess
import sys

import pytest

from tlt_jax import config as config_lib
from tlt_jax import workdir
from tlt_jax.errors import ConfigError
from tlt_jax.rollout.sampling import SamplingParams
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def _run(args, **kw):
  env = user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, **kw)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_loads_and_validates(name):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
  spec = config_lib.run_spec(cfg)
  assert spec.sampling.temperature == cfg.rollout.temperature  # typed = the keys' values
  assert spec.engine.chunk_size == cfg.rollout.chunk_size
  assert spec.engine.max_prompt_len == cfg.data.max_prompt_len


def test_typo_key_suggests_the_right_one():
  with pytest.raises(ConfigError, match=r"no key 'rollout.max_batchh'.*--config.rollout.max_batch"):
    config_lib.check_overrides(["--config", "configs/default.py",
                                "--config.rollout.max_batchh=3"])


def test_history_arms_need_the_history_index():
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.tlt.spec.buckets = "1:hist_4,4_1_5,off 3:4_1_5,off"
  assert config_lib.run_spec(cfg).history
  cfg.tlt.spec.history = False
  with pytest.raises(ConfigError, match=r"history arms \['hist_4'\] draft from a history index"):
    config_lib.run_spec(cfg)
  # the bandit's default grid (no buckets named) has history arms too
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.tlt.spec.history = False
  with pytest.raises(ConfigError, match=r"history arms \['hist_4', 'hyb_4'\] draft from"):
    config_lib.run_spec(cfg)
  cfg.tlt.spec.selector = "fixed"  # the fixed selector runs tlt.spec.strategy only
  assert not config_lib.run_spec(cfg).history


@pytest.mark.parametrize("key,value,needle", [
    ("rollout.top_p", 1.5, "config.rollout.top_p=1.5: must be in (0, 1]"),
    ("rollout.temperature", -1.0, "config.rollout.temperature=-1.0"),
    ("rollout.buckets", (4, 2), "config.rollout.buckets=(4, 2): a strictly increasing"),
    ("rollout.chunk_size", 0, "config.rollout.chunk_size=0: must be > 0"),
    ("rollout.max_batch", -1, "config.rollout.max_batch=-1: sequences per worker, or 0"),
    ("memory.device", "tpu9", "config.memory.device='tpu9': use a known kind"),
    ("memory.fraction", 1.5, "config.memory.fraction=1.5: the share"),
    ("model.dtype", "float8", "model.dtype"),
    ("data.on_bad_row", "ignore", "data.on_bad_row"),
    ("data.answer_key", "reward_model..ground_truth", "config.data.answer_key='reward_model.."
     "ground_truth': a column name, or a dotted path into nested fields"),
    ("data.prompt_key", "", "config.data.prompt_key='': a column name"),
    ("data.max_prompt_len", 0, "config.data.max_prompt_len=0"),
    ("mesh.fsdp", 0, "mesh"),
    ("grpo.logit_chunk", 0, "config.grpo.logit_chunk=0: must be >= 1"),
    ("grpo.eps_low", 1.5, "config.grpo.eps_low=1.5: must be in [0, 1)"),
    ("grpo.loss_agg", "seq-mean", "config.grpo.loss_agg='seq-mean': must be one of token-mean, "
     "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    ("grpo.loss_norm_len", -2, "config.grpo.loss_norm_len=-2: must be >= 0"),
    ("grpo.clip_ratio_c", 1.0, "config.grpo.clip_ratio_c=1.0: must be > 1 (dual-clip's"),
    ("grpo.kl_loss_type", "k3", "config.grpo.kl_loss_type='k3': use one of low_var_kl, kl, "
     "mse, abs (low_var_kl: k3, kl: k1, mse: k2)"),
    ("grpo.rollout_is", "seq", "config.grpo.rollout_is='seq': use '' (off), 'token', "
     "'sequence' or 'geometric'"),
    ("grpo.rollout_is_cap", 0.5, "config.grpo.rollout_is_cap=0.5: must be a finite number >= 1"),
    ("grpo.rollout_is_cap", float("inf"), "config.grpo.rollout_is_cap=inf: must be a finite"),
    ("grpo.loss_mode", "gpg", "config.grpo.loss_mode='gpg': use one of vanilla, gspo (PPO's"),
    ("grpo.ppo_epochs", 0, "config.grpo.ppo_epochs=0: must be >= 1 (passes over the step's"),
    ("reward.overlong_buffer", 10_000, "config.reward.overlong_buffer=10000: must be in [0, "
     "rollout.max_new_tokens="),
    ("reward.overlong_penalty", -0.5, "config.reward.overlong_penalty=-0.5: must be >= 0"),
    ("grpo.max_rollouts", 0, "config.grpo.max_rollouts=0: must be >= 1"),
    ("grpo.row_layout", "one", "config.grpo.row_layout='one': use one of auto, max_len, "
     "buckets"),
    ("grpo.entropy_coef", -0.1, "config.grpo.entropy_coef=-0.1: must be >= 0"),
    ("grpo.adv_estimator", "gae", "config.grpo.adv_estimator='gae': use one of grpo, rloo, "
     "reinforce_plus_plus_baseline"),
    ("eval.n", 0, "config.eval.n=0: must be >= 1"),
    ("eval.n", 8, "config.eval.n=8: greedy responses to a prompt are all one"),
    ("eval.top_p", 0.0, "config.eval.top_p=0.0: must be in (0, 1]"),
    ("eval.top_p", 1.5, "config.eval.top_p=1.5: must be in (0, 1]"),
    ("eval.temperature", -0.5, "config.eval.temperature=-0.5: must be >= 0"),
    ("grpo.gen_prompts", -1, "config.grpo.gen_prompts=-1: must be >= 0"),
    ("grpo.gen_prompts", 64, "config.grpo.gen_prompts=64: applies with grpo.filter_groups=True"),
    ("tlt.drafter.lr", -1e-4, "config.tlt.drafter.lr=-0.0001: must be > 0"),
    ("tlt.drafter.mode", "async", "config.tlt.drafter.mode='async': use one of off, spot"),
    ("tlt.drafter.window", 0, "config.tlt.drafter.window=0: must be >= 1"),
    ("tlt.drafter.row_len", 64, "config.tlt.drafter.row_len=64: must be >= tlt.drafter.window"),
    ("tlt.drafter.acceptance_response_len", 0,
     "config.tlt.drafter.acceptance_response_len=0: must be >= 1"),
    ("tlt.spec.strategy", "4_1_3", "config.tlt.spec.strategy='4_1_3': strategy 4_1_3: a chain"),
    ("tlt.spec.epsilon", 2.0, "config.tlt.spec.epsilon=2.0: must be in [0, 1]"),
    ("tlt.spec.buckets", "1:4_1_5 x", "config.tlt.spec.buckets: 'x' is not"),
    ("tlt.spec.buckets", "1:4_1_5,4_1_5", "config.tlt.spec.buckets: bucket 1 lists an arm twice"),
    ("tlt.spec.selector", "thompson", "config.tlt.spec.selector='thompson': use one of"),
    ("tlt.spec.window", 0, "config.tlt.spec.window=0: must be a positive integer"),
    ("tlt.spec.min_pulls", 0, "config.tlt.spec.min_pulls=0: must be an integer in [1, "
     "window=300]"),
    ("tlt.spec.gate.margin", -1.0, "config.tlt.spec.gate.margin=-1.0: must be >= 0"),
    ("tlt.drafter.buffer_tokens", 64, "config.tlt.drafter.buffer_tokens=64: must hold"),
    ("tlt.drafter.windows_per_response", 0, "config.tlt.drafter.windows_per_response=0"),
    ("rollout.temperature", 0.0, "config.rollout.temperature=0.0: GRPO samples its groups"),
    ("distributed.heartbeat_timeout", 0, "config.distributed.heartbeat_timeout=0: use a number"),
    ("eval.batch_size", 0, "config.eval.batch_size=0: must be >= 1"),
    ("rollout.page_size", 0, "config.rollout.page_size=0: must be > 0"),
    ("rollout.kv_pages", 3, "config.rollout.kv_pages=3: a KV pool must hold one row"),
    ("rollout.mean_live_tokens", -1, "config.rollout.mean_live_tokens=-1"),
    ("rollout.attention", "flash", "config.rollout.attention='flash': must be 'auto'"),
    ("train.export_best", "best", "config.train.export_best='best': use 'accuracy' (every "
     "held-out prompt's), 'accuracy:<source>'"),
    ("train.export_best", "accuracy:", "config.train.export_best='accuracy:': use 'accuracy'"),
    ("optim.b1", 1.5, "config.optim.b1=1.5: must be in [0, 1)"),
    ("optim.b2", 1.0, "config.optim.b2=1.0: must be in [0, 1)"),
    ("optim.b2", -0.1, "config.optim.b2=-0.1: must be in [0, 1)"),
    ("optim.weight_decay", -0.1, "config.optim.weight_decay=-0.1: must be >= 0"),
    ("optim.grad_clip", -1.0, "config.optim.grad_clip=-1.0: must be >= 0"),
    ("optim.schedule", "linear", "config.optim.schedule='linear': use 'constant'"),
    ("seed", -1, "config.seed=-1: use 0 to 2^31-1"),
    ("seed", 2**40, "config.seed=1099511627776: use 0 to 2^31-1"),
    ("eval.num_prompts", -1, "config.eval.num_prompts=-1: must be >= 0"),
    ("data.train_weights", "0.7,0.3", "config.data.train_weights='0.7,0.3': 2 weights for the "
     "1 file of data.train_path; give one per file"),
    ("data.train_weights", "heavy", "config.data.train_weights='heavy': comma-separated "
     "numbers, one per file"),
    ("data.train_weights", "0", "config.data.train_weights='0': every weight must be a finite "
     "number > 0"),
    ("data.train_weights", "-1", "config.data.train_weights='-1': every weight must be"),
    ("data.train_weights", "nan", "config.data.train_weights='nan': every weight must be"),
])
def test_invalid_values_name_the_key(key, value, needle):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  *path, field = key.split(".")
  node = cfg
  for p in path:
    node = node[p]
  node[field] = value
  with pytest.raises(ConfigError) as e:
    config_lib.run_spec(cfg)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
  assert e.value.key == key or key.startswith(e.value.key + "."), e.value.key  # an attribute


@pytest.mark.parametrize("name", CONFIGS)
def test_no_key_takes_a_number_that_is_not_finite(name):
  """NaN passes every range check written as `if x < 0` (each comparison with it is False),
  inf many more: every number a shipped config holds, set to either, is one error naming it."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
  keys = [k for k in config_lib.dotted_keys(cfg) if isinstance(_get(cfg, k), float)]
  assert len(keys) >= 15, keys  # (the walk reaches the nested sections)
  for key in keys:
    for bad in (float("nan"), float("inf"), float("-inf")):
      c = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
      *path, field = key.split(".")
      _get(c, ".".join(path))[field] = bad
      with pytest.raises(ConfigError) as e:
        config_lib.run_spec(c)
      assert e.value.key == key and "must be a finite number" in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                       ("temperature", -0.5), ("top_p", float("nan")),
                                       ("top_p", 0.0), ("top_k", -1)])
def test_sampling_takes_finite_values_in_range_only(key, value):
  # (the generate CLI and the engine's API build SamplingParams without run_spec's walk)
  with pytest.raises(ConfigError) as e:
    SamplingParams(**{key: value})
  assert e.value.key == key and "\n" not in str(e.value)


def _get(cfg, key):
  for p in filter(None, key.split(".")):
    cfg = cfg[p]
  return cfg


@pytest.mark.parametrize("mesh,micro_batch,needle", [
    ({"data": 3, "fsdp": 1, "tensor": 1, "devices": 0}, 6,
     r"config.mesh=.* does not fit the 8 cpu devices it spans"),
    ({"data": 1, "fsdp": 16, "tensor": 1, "devices": 0}, 16,
     r"config.mesh=.* does not fit the 8 cpu devices it spans"),
    ({"data": 1, "fsdp": 2, "tensor": 1, "devices": 1}, 16,
     r"config.mesh=.* does not fit the 1 cpu devices it spans"),
    ({"data": 1, "fsdp": -1, "tensor": 1, "devices": 16}, 16,
     r"config.mesh.devices=16: only 8 cpu devices are visible"),
    ({"data": 2, "fsdp": -1, "tensor": 1, "devices": 0}, 12,
     r"config.grpo.micro_batch=12: must be a multiple of the mesh's data x fsdp size \(8"),
])
def test_mesh_against_visible_devices(mesh, micro_batch, needle):
  from tlt_jax import runtime
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.mesh.update(mesh)
  cfg.grpo.micro_batch = micro_batch
  with pytest.raises(ConfigError, match=needle):
    runtime.prepare(config_lib.run_spec(cfg))  # 8 fake CPU devices in the test process


def test_model_without_any_stop_token_is_a_config_error(tmp_path):
  import shutil

  from tlt_jax import runtime
  model = tmp_path / "model"
  shutil.copytree(config_lib.asset_path("default", "model"), model)
  os.remove(model / "generation_config.json")
  tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
  tok_cfg.update(eos_token=None, unk_token=None)  # transformers would default both to <|endoftext|>
  (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.model.path = str(model)
  with pytest.raises(ConfigError, match="defines no stop token.*eos_token_id"):
    runtime.load_model(cfg)


def test_paths_that_cannot_serve_the_run_are_config_errors(tmp_path):
  """A data path that is a directory, a workdir that is a file or cannot be made: one error
  naming the key, the file in the way untouched; a run whose config fails a later check makes
  no workdir, one that passes them all gets its workdir made."""
  from tlt_jax import runtime

  def prepare(workdir, training=False, mesh_data=None, train_path=None, drafter=None,
              test_path=None):
    cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
    cfg.workdir = str(workdir)
    if test_path:
      cfg.data.test_path = test_path
    if mesh_data:
      cfg.mesh.data = mesh_data
    if train_path:
      cfg.data.train_path = str(train_path)
    if drafter:
      cfg.tlt.drafter.init = str(drafter)
    return runtime.prepare(config_lib.run_spec(cfg), training=training)

  run = tmp_path / "run"
  with pytest.raises(ConfigError, match=r"^config.data.train_path='.*': is a directory; point"):
    prepare(run, train_path=tmp_path)
  # several held-out files: the one that is missing named
  test = config_lib.asset_path("default", "data", "test.jsonl")
  with pytest.raises(ConfigError, match=r"^config.data.test_path='.*/aime24.jsonl': does not "
                     r"exist; point it at a local JSONL or Parquet file \(several: comma"):
    prepare(run, test_path=f"{test},{tmp_path}/aime24.jsonl")
  train = config_lib.asset_path("default", "data", "train.jsonl")  # several training files
  with pytest.raises(ConfigError, match=r"^config.data.train_path='.*/math.jsonl': does not "
                     r"exist; point it at a local JSONL or Parquet file \(several: comma"):
    prepare(run, train_path=f"{train}, {tmp_path}/math.jsonl")
  # the drafter's directory before the model is loaded; its form before anything is read
  with pytest.raises(ConfigError, match=r"^config.tlt.drafter.init='.*nowhere': is not a "
                     r"directory; point"):
    prepare(run, drafter=tmp_path / "nowhere")
  with pytest.raises(ConfigError, match=r"^config.tlt.drafter.init='init:zero': use "
                     r"'init:<integer seed>'"):
    prepare(run, drafter="init:zero")
  in_the_way = tmp_path / "saved"
  in_the_way.write_text("an earlier result")
  with pytest.raises(ConfigError, match=r"^config.workdir='.*saved': is a file; pass a dir"):
    prepare(in_the_way)
  with pytest.raises(ConfigError, match=r"^config.workdir='.*saved/run': cannot be made \(\S*"
                     r"saved is a file\); pass"):
    prepare(in_the_way / "run")
  assert in_the_way.read_text() == "an earlier result"
  with pytest.raises(ConfigError, match="config.mesh="):
    prepare(run, training=True, mesh_data=3)
  assert not run.exists()
  prepare(run, training=True)
  assert run.is_dir()


def test_the_best_policy_needs_evaluation_and_a_source_that_is_held_out(tmp_path):
  """train.export_best without held-out evaluation, or naming a source no test file gives:
  one error each naming the key and the fix (the sources there are), before the model loads."""
  from tlt_jax import runtime
  from tlt_jax.run import build
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.train.export_best = "accuracy"
  cfg.train.eval_every = 0
  with pytest.raises(ConfigError, match=r"^config.train.export_best='accuracy': the best policy "
                     r"is chosen by held-out evaluation: set data.test_path and "
                     r"train.eval_every > 0"):
    config_lib.run_spec(cfg)
  cfg.train.eval_every = 10
  cfg.train.export_best = "accuracy:aime24"
  cfg.workdir = str(tmp_path / "run")
  cfg.data.test_path = ",".join(config_lib.asset_path(name, "data", "test.jsonl")
                                for name in ("default", "longtail"))
  with pytest.raises(ConfigError, match=r"^config.train.export_best='accuracy:aime24': names no "
                     r"held-out source: use accuracy:default/data/test, "
                     r"accuracy:longtail/data/test or accuracy$"):
    build(runtime.prepare(config_lib.run_spec(cfg)))


def test_a_reward_module_that_cannot_load_is_one_config_error(tmp_path):
  """A user's reward file that fails at import (here: a syntax error) stops the run at
  start-up with one line naming config.reward.name and the error (it once surfaced as the
  SyntaxError's traceback, the module imported in the main process)."""
  from tlt_jax import runtime
  (tmp_path / "my_reward.py").write_text("def fn(response, answer:\n")
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.workdir = str(tmp_path / "run")
  cfg.reward.name = f"{tmp_path / 'my_reward.py'}:fn"
  with pytest.raises(ConfigError, match=r"^config\.reward\.name='.*my_reward\.py:fn': .*cannot "
                     r"load \(SyntaxError: '\(' was never closed"):
    runtime.prepare(config_lib.run_spec(cfg))
  assert not (tmp_path / "run").exists()


def _default_in(workdir, **values):
  """configs/default.py with workdir set and `section__name=value` overrides."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.workdir = str(workdir)
  for key, value in values.items():
    section, name = key.split("__")
    cfg[section][name] = value
  return cfg


def test_a_resumed_run_that_switches_a_setting_off_names_what_it_acted_on(tmp_path):
  """The checkpointed run had dynamic sampling and the loss_norm_len normalisation on, the
  resumed one has them off: their values acted in the saved run, so their changes are named
  too (workdir.ACTIVE_WHEN: active in either config)."""
  from tlt_jax import runtime
  cfg_of = functools.partial(_default_in, tmp_path)

  workdir.write_config(cfg_of(grpo__filter_groups=True, grpo__loss_norm_len=64,
                              grpo__loss_agg="seq-mean-token-sum-norm"))
  (tmp_path / "checkpoints" / "3").mkdir(parents=True)
  with pytest.raises(ConfigError, match=r"other values: grpo.filter_groups True -> False; "
                     r"grpo.max_rollouts 4 -> 2; grpo.loss_agg 'seq-mean-token-sum-norm' -> "
                     r"'token-mean'; grpo.loss_norm_len 64 -> 77; pass"):
    runtime.prepare(config_lib.run_spec(cfg_of(grpo__max_rollouts=2, grpo__loss_norm_len=77)))


def test_a_resumed_run_that_would_learn_otherwise_stops_and_its_configs_are_kept(tmp_path,
                                                                                 capsys):
  """A workdir with a checkpoint: resuming it with other values of what the run learns (model,
  data, sampling, GRPO, optimizer, seed) is one error naming each change, unless
  train.resume_with_changes; more steps, another engine setting or TLT switched (lossless)
  resume as before. Each config a run ran with is kept."""
  from tlt_jax import runtime
  cfg_of = functools.partial(_default_in, tmp_path)

  def prepare(**values):
    return runtime.prepare(config_lib.run_spec(cfg_of(**values)))

  first = cfg_of()
  workdir.write_config(first)
  prepare(optim__lr=1e-4)  # no checkpoint yet: a fresh run, whatever config.json says
  (tmp_path / "checkpoints" / "3").mkdir(parents=True)
  (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()  # a save cut short
  prepare(train__steps=80, rollout__chunk_size=8, train__eval_every=0)
  # dynamic sampling off in both: its rollout cap changes nothing (on in one, it does)
  prepare(grpo__max_rollouts=2, grpo__loss_norm_len=77)
  prepare(grpo__kl_loss_type="mse")  # no KL term in either: its estimator changes nothing
  prepare(grpo__rollout_is_cap=5.0)  # no correction in either: its cap changes nothing
  with pytest.raises(ConfigError, match=r"other values: grpo.rollout_is '' -> 'token'; "
                     r"grpo.rollout_is_cap 2.0 -> 5.0; pass"):
    prepare(grpo__rollout_is="token", grpo__rollout_is_cap=5.0)
  with pytest.raises(ConfigError, match=r"other values: grpo.kl_coef 0.0 -> 0.001; "
                     r"grpo.kl_loss_type 'low_var_kl' -> 'mse'; pass"):
    prepare(grpo__kl_coef=0.001, grpo__kl_loss_type="mse")
  with pytest.raises(ConfigError, match=r"other values: grpo.filter_groups False -> True; "
                     r"grpo.max_rollouts 4 -> 2; pass"):
    prepare(grpo__max_rollouts=2, grpo__filter_groups=True)
  with pytest.raises(ConfigError, match=r"grpo.loss_agg 'token-mean' -> "
                     r"'seq-mean-token-sum-norm'; grpo.loss_norm_len \d+ -> 77; pass"):
    prepare(grpo__loss_norm_len=77, grpo__loss_agg="seq-mean-token-sum-norm")
  # another per-sequence sum that does not normalise by loss_norm_len: its length still inert
  with pytest.raises(ConfigError, match=r"grpo.loss_agg 'token-mean' -> 'seq-mean-token-sum'; "
                     r"pass"):
    prepare(grpo__loss_norm_len=77, grpo__loss_agg="seq-mean-token-sum")
  with pytest.raises(ConfigError, match=r"^config.workdir='.*': holds a run checkpointed at "
                     r"step 3 that learned with other values: rollout.temperature 1.0 -> "
                     r"0.7; optim.lr 5e-05 -> 0.0001; pass a new --workdir"):
    prepare(optim__lr=1e-4, rollout__temperature=0.7)
  with pytest.raises(ConfigError, match=r"model.path '.*default/model' -> '.*longtail/model'"):
    prepare(model__path=config_lib.asset_path("longtail", "model"))
  capsys.readouterr()
  prepare(optim__lr=1e-4, train__resume_with_changes=True)
  assert "resuming with changed values: optim.lr 5e-05 -> 0.0001" in capsys.readouterr().err
  prepare(tlt__enabled=False)  # lossless: the same run goes on, said (test_train: the drafter)
  assert "resuming with TLT switched off" in capsys.readouterr().err
  # config.json is the latest run's; the one it resumed from kept as config.<step>.json
  workdir.write_config(first)
  assert sorted(p.name for p in tmp_path.glob("config*.json")) == ["config.json"]
  changed = cfg_of(optim__lr=1e-4, train__resume_with_changes=True)
  workdir.write_config(changed)
  assert json.loads((tmp_path / "config.3.json").read_text())["optim"]["lr"] == 5e-05
  assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 1e-4
  (tmp_path / "config.json").write_text('{"seed": ')  # cut short: not compared, said
  prepare(optim__lr=2e-4)
  assert "config.json is unreadable" in capsys.readouterr().err
  workdir.write_config(first)  # resumed at step 3 again: the earlier ones stay
  assert (tmp_path / "config.3-1.json").read_text() == '{"seed": '
  assert json.loads((tmp_path / "config.3.json").read_text())["optim"]["lr"] == 5e-05


def test_config_json_names_its_inputs_wherever_the_run_is_resumed_from(tmp_path, monkeypatch):
  """config.json holds the input paths absolute (export and a resume read it from any working
  directory), a reward function's file too; a resume given the same file by another relative
  path is no change, another file by the same relative path is one."""
  (tmp_path / "data").mkdir()
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.workdir = str(tmp_path / "run")
  cfg.data.train_path = "data/train.jsonl"
  cfg.data.test_path = "data/a.jsonl, data/b.jsonl"  # (several files: each one's path)
  cfg.tlt.drafter.init = "init:3"
  cfg.reward.name = "data/score.py:score"
  os.makedirs(cfg.workdir)
  monkeypatch.chdir(tmp_path)
  workdir.write_config(cfg)
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["data"]["train_path"] == str(tmp_path / "data" / "train.jsonl")
  assert saved["reward"]["name"] == f"{tmp_path / 'data' / 'score.py'}:score"
  assert saved["data"]["test_path"] == ",".join(str(tmp_path / "data" / f) for f in ("a.jsonl",
                                                                                   "b.jsonl"))
  assert saved["tlt"]["drafter"]["init"] == "init:3"
  assert saved["model"]["path"] == cfg.model.path and os.path.isabs(cfg.model.path)
  (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "data")
  cfg.data.train_path, cfg.reward.name = "train.jsonl", "score.py:score"
  assert workdir.config_changes(cfg) == []
  cfg.data.train_path, cfg.reward.name = "data/train.jsonl", "data/score.py:score"
  assert workdir.config_changes(cfg) == [
      ("data.train_path", str(tmp_path / "data" / "train.jsonl"), "data/train.jsonl"),
      ("reward.name", f"{tmp_path / 'data' / 'score.py'}:score", "data/score.py:score")]
  # several training files: each one's path resolved
  cfg.data.train_path, cfg.reward.name = "train.jsonl, more.jsonl", "score.py:score"
  workdir.write_config(cfg)
  monkeypatch.chdir(tmp_path)
  cfg.data.train_path, cfg.reward.name = "data/train.jsonl,data/more.jsonl", "data/score.py:score"
  assert workdir.config_changes(cfg) == []
  cfg.data.train_weights = "0.3,0.7"  # another mixture of the same files: another experiment
  assert workdir.config_changes(cfg) == [("data.train_weights", "", "0.3,0.7")]
  cfg.data.train_path, cfg.data.train_weights = "data/train.jsonl", ""
  assert [c[0] for c in workdir.config_changes(cfg)] == ["data.train_path"]


def test_a_config_files_own_bug_keeps_its_traceback(tmp_path):
  """Only a value of another type than the field's becomes one line (test below); any other
  error raised by a config file's code is that code's bug, raised as it is."""
  bug = tmp_path / "bug.py"
  bug.write_text("def get_config():\n  return undefined_name\n")
  with pytest.raises(NameError, match="undefined_name"):
    config_lib.load_config_file(str(bug))
  odd = tmp_path / "odd.py"
  odd.write_text("def get_config():\n  return len(3)\n")
  with pytest.raises(TypeError, match="has no len"):
    config_lib.load_config_file(str(odd))


def test_cli_errors_are_one_line(tmp_path):
  unsupported = tmp_path / "gpt2"
  unsupported.mkdir()
  (unsupported / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
  (unsupported / "model.safetensors").write_bytes(b"")
  broken = tmp_path / "broken"  # a config.json cut short
  broken.mkdir()
  (broken / "config.json").write_text('{"model_type": "qwen2", "hidden_si')
  mine = tmp_path / "mine.py"  # a config file giving a field a value of another type
  mine.write_text(f"from tlt_jax.config import load_config_file\n\ndef get_config():\n"
                  f"  c = load_config_file({os.path.join(ROOT, 'configs', 'default.py')!r})\n"
                  "  c.rollout.max_batch = '8'\n  return c\n")
  for module, args, needle in [
      ("train", ["--config", str(mine)], f"error: --config {mine}, line 5: "
       "`c.rollout.max_batch = '8'`: field 'max_batch' takes int values, not str; write a "
       "whole number, unquoted\n"),
      ("eval", ["--config", "configs/missing.py"], "no such file"),
      ("eval", ["--config", "configs/default.py", "--config.rollout.chunksize=4"],
       "did you mean"),
      ("eval", ["--config", "configs/default.py", "--config.model.path=/nonexistent"],
       "is not a directory"),
      ("eval", ["--config", "configs/default.py", "--config.rollout.top_p=abc"],
       "could not convert"),
      ("eval", ["--config", "configs/default.py", f"--config.model.path={unsupported}",
                f"--config.workdir={tmp_path / 'e'}"], "model_type='gpt2'"),
      ("train", ["--config", "configs/default.py", f"--config.model.path={unsupported}",
                 f"--workdir={tmp_path / 'w'}"], "model_type='gpt2'"),
      ("train", ["--config", "configs/default.py", f"--config.model.path={broken}",
                 f"--workdir={tmp_path / 'w'}"], "config.json"),
      ("train", ["--config", "configs/default.py", "--config.data.train_path=",
                 f"--workdir={tmp_path / 'w'}"], "config.data.train_path='': is empty"),
      ("train", ["--config", "configs/default.py", "--config.mesh.data=3",
                 f"--workdir={tmp_path / 'w'}"], "config.mesh="),
      ("train", ["--config", "configs/default.py", "--config.tlt.drafter.mode=async",
                 f"--workdir={tmp_path / 'w'}"], "config.tlt.drafter.mode='async'"),
      ("train", ["--config", "configs/default.py", "--config.optim.b2=nan",
                 f"--workdir={tmp_path / 'w'}"], "config.optim.b2=nan: must be a finite number"),
  ]:
    p = _run([f"tlt_jax.{module}", *args])
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("workers,tp,want", [(0, 1, 8), (0, 4, 2), (3, 2, 3), (0, 16, None)])
def test_rollout_workers_follow_the_visible_devices(workers, tp, want):
  """rollout.num_workers=0 (the default's): one replica per tensor_parallel devices of the 8
  visible here (on one GPU: one), written back into the config; a pinned count is kept; a
  replica wider than the machine is the one-line error."""
  from tlt_jax import runtime
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  assert cfg.rollout.num_workers == 0
  cfg.rollout.num_workers, cfg.rollout.tensor_parallel = workers, tp
  if want is None:
    with pytest.raises(ConfigError, match=r"config.rollout.tensor_parallel=16: needs 16 devices"):
      runtime.resolve_workers(cfg)
    return
  assert runtime.resolve_workers(cfg) == want and cfg.rollout.num_workers == want


@pytest.mark.parametrize("value,paged", [("auto", None), ("paged", True), ("windows", False)])
def test_rollout_attention_reaches_the_engine(value, paged):
  """rollout.attention -> EngineConfig.paged_attention; "auto" is paged attention on every
  backend (a GPU's replica checks the kernel when it is built: tests/test_paged_attention.py)."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.rollout.attention = value
  ecfg = config_lib.run_spec(cfg).engine
  assert ecfg.paged_attention is paged
  assert ecfg.reads_pages() is (True if paged is None else paged)


@pytest.mark.parametrize("mesh_devices,tp,doubled", [(1, 1, False), (0, 1, True), (2, 1, True),
                                                     (1, 2, True)])
def test_a_learner_on_several_cpu_devices_gets_xla_a_pool_it_cannot_deadlock(
    mesh_devices, tp, doubled, monkeypatch):
  """XLA sizes its CPU execution pool at one thread per device, and a learner sharded over
  them deadlocked in it (tests/conftest.py, scripts/stress_cpu_collectives.py): a run whose
  learner or replica spans several fake CPU devices gets twice the threads; the default run
  (one learner device) keeps XLA's own pool; a user's NPROC wins."""
  from tlt_jax import runtime
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.cpu_devices, cfg.compilation_cache = 8, ""
  cfg.mesh.devices, cfg.rollout.tensor_parallel = mesh_devices, tp
  monkeypatch.delenv("NPROC", raising=False)
  runtime.setup_jax(cfg)
  assert os.environ.get("NPROC") == (str(max(os.cpu_count(), 16)) if doubled else None)
  monkeypatch.setenv("NPROC", "3")
  runtime.setup_jax(cfg)
  assert os.environ["NPROC"] == "3"


def test_the_data_line_says_when_every_step_repeats_prompts():
  """A training file smaller than one step's draw (most often the wrong file) is said on the
  run's first line; a file that holds a step's draw is not flagged."""
  from tlt_jax.run import data_line
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.num_prompts = 8
  assert data_line(7, 0, cfg).endswith("; fewer than the 8 a rollout draws (grpo.num_prompts): "
                                       "every step repeats prompts")
  assert data_line(8, 2, cfg).endswith("(2 dropped as longer than max_prompt_len=80 tokens)")
  cfg.data.train_path = "/d/a.jsonl,/d/b.jsonl"  # weighted: each file's prompts and share
  assert data_line(8, 2, cfg, mixture=[("a", 6, 0.25), ("b", 2, 0.75)]).startswith(
      "data: 8 training prompts from 2 files weighted (a 6 at 0.25, b 2 at 0.75; 2 dropped ")
  cfg.data.train_path = "/d/a.jsonl"
  assert data_line(8, 2, cfg, 1).endswith("max_prompt_len=80 tokens, 1 as encoding to no tokens)")
  cfg.grpo.filter_groups, cfg.grpo.gen_prompts = True, 24  # (DAPO's gen batch: a rollout's)
  assert data_line(20, 0, cfg).endswith("; fewer than the 24 a rollout draws "
                                        "(grpo.gen_prompts): every step repeats prompts")


def test_a_context_past_the_models_positions_is_said(tmp_path, capsys):
  """Prompt + response longer than the checkpoint's max_position_embeddings: one warning (the
  run goes on: RoPE computes any position, but the model never trained on them)."""
  from tlt_jax import runtime
  model = config_lib.asset_path("default", "model")
  for name in os.listdir(model):
    if name != "config.json":
      os.symlink(os.path.join(model, name), tmp_path / name)
  hf = json.loads(open(os.path.join(model, "config.json")).read())
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.model.path = str(tmp_path)
  for positions, said in ((80 + 288, False), (80 + 287, True)):  # the default's prompt + answer
    (tmp_path / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": positions}))
    runtime.load_model(cfg)
    err = capsys.readouterr().err
    assert ("data.max_prompt_len + rollout.max_new_tokens = 368 tokens, past the 367 positions"
            in err) == said, err


def test_help_is_not_an_error():
  """--help prints the flags and exits 0 (absl's own exit status is 1, which scripts read as
  a failure: plan_memory.py's 'a phase does not fit')."""
  p = _run(["tlt_jax.plan", "--help"])
  assert p.returncode == 0 and "--config" in p.stdout + p.stderr


def test_dr_grpos_length_is_the_generation_budget_unless_set():
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.loss_agg = "seq-mean-token-sum-norm"
  assert config_lib.run_spec(cfg).grpo.loss_norm_len == cfg.rollout.max_new_tokens
  cfg.grpo.loss_norm_len = 300
  assert config_lib.run_spec(cfg).grpo.loss_norm_len == 300


def test_dr_grpo_std_switch_is_grpos_alone():
  """norm_adv_by_std=False (Dr. GRPO's advantages) with an estimator that never divides by the
  std would do nothing: one error naming it; with grpo it stands."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  cfg.grpo.norm_adv_by_std = False
  config_lib.run_spec(cfg)
  cfg.grpo.adv_estimator = "rloo"
  with pytest.raises(ConfigError, match=r"config.grpo.norm_adv_by_std=False: False applies to "
                                        r"grpo.adv_estimator='grpo' only"):
    config_lib.run_spec(cfg)


def test_the_gate_horizon_counts_every_rollout_of_a_step():
  """The gate's clock advances once per rollout (payoff.py: R = horizon - rollouts so far);
  with grpo.filter_groups a step rolls out up to grpo.max_rollouts times, so a horizon of
  train.steps would leave the gate no rollouts to repay a compile from mid-run on."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "default.py"))
  assert config_lib.run_spec(cfg).gate.horizon == cfg.train.steps
  cfg.grpo.filter_groups, cfg.grpo.max_rollouts = True, 3
  assert config_lib.run_spec(cfg).gate.horizon == 3 * cfg.train.steps
