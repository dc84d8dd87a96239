"""tlt_jax.checkpoint: round trip, resharding on restore, keep-last-N, SIGKILL mid-save, errors,
falling back past a damaged newest checkpoint (also through the train entry point)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.checkpoint import Checkpointer, CheckpointError
from user_env import user_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _train_state():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
      "embed": jax.random.normal(k1, (16, 8), jnp.float32),
      "layers": {
          "q": jax.random.normal(k2, (2, 8, 4), jnp.float32).astype(jnp.bfloat16),
          "norm": jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32),
      },
  }
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  # One real update so mu/nu/count are not all zeros.
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
  _, opt_state = opt.update(grads, opt_state, params)
  return {
      "params": params,
      "opt_state": opt_state,
      "step": 7,
      "rng": jax.random.key(42),             # new-style typed key
      "raw_rng": jax.random.PRNGKey(3),      # legacy raw uint32[2] key
      "data": {"epoch": 2, "index": 17},
  }


def _assert_tree_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, f"structure differs:\n{ta}\n{tb}"
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key) and x.dtype == y.dtype
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    if isinstance(x, (jax.Array, np.ndarray)):
      assert isinstance(y, type(x)) or isinstance(y, jax.Array), (type(x), type(y))
      assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      assert type(x) is type(y) and x == y, (x, y)


def test_round_trip_train_state(tmp_path):
  state = _train_state()
  with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(7, state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [7]

  # A fresh Checkpointer (as after a restart) with concrete arrays as the template ...
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  restored = ckpt.restore(state)
  _assert_tree_equal(state, restored)
  assert restored["params"]["layers"]["q"].dtype == jnp.bfloat16
  assert restored["raw_rng"].dtype == jnp.uint32
  # the restored keys are usable and give the same numbers
  np.testing.assert_array_equal(jax.random.normal(restored["rng"], (3,)),
                                jax.random.normal(state["rng"], (3,)))

  # ... and with abstract leaves (what a trainer does to avoid allocating the state twice).
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state)
  _assert_tree_equal(state, ckpt.restore(abstract, step=7))
  ckpt.close()


def test_numpy_scalars_come_back_as_the_templates_type(tmp_path):
  """Non-array leaves come back as the template's type (restore's docstring): numpy scalars
  included, whatever Orbax returns them as."""
  state = {"lr": np.float32(0.25), "count": np.int64(7), "flag": np.bool_(True), "n": 3}
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(1, state)
  template = {"lr": np.float32(0), "count": np.int64(0), "flag": np.bool_(False), "n": 0}
  got = Checkpointer(str(tmp_path)).restore(template)
  for k, v in state.items():
    assert type(got[k]) is type(v) and got[k] == v, (k, type(got[k]), got[k])


def test_restore_onto_different_sharding(tmp_path):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  saved_specs = {"w": P("data", "model"), "v": P("model"), "b": P(), "keys": P("data"),
                 "key": P()}
  # (a replicated typed key's data comes back from Orbax as P(None,): the key goes onto P())
  new_specs = {"w": P("model", None), "v": P(), "b": P(None), "keys": P("model"), "key": P()}
  state = {
      "w": jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16),
      "v": jnp.arange(8, dtype=jnp.bfloat16),
      "b": jnp.arange(4, dtype=jnp.int32),
      "keys": jax.random.split(jax.random.key(1), 8),
      "key": jax.random.key(7),
  }
  state = {k: jax.device_put(v, NamedSharding(mesh, saved_specs[k])) for k, v in state.items()}
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, state)
  template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, new_specs[k]))
              for k, v in state.items()}
  restored = Checkpointer(str(tmp_path)).restore(template)
  for k in state:
    assert restored[k].sharding == template[k].sharding, k
    assert restored[k].dtype == state[k].dtype
  _assert_tree_equal(state, restored)


def test_small_replicated_arrays_are_saved_without_programs(tmp_path):
  """Orbax saves an array replicated over several devices replica-parallel: each replica
  writes a slice, an eager program compiled per (shape, device). For small arrays (the drafter
  replicated over the rollout workers) that was all cost: TLT on's first checkpoint of the
  default run took 0.58 s against 0.07 s without it. One replica writes a replicated array
  whose slices would be under 4 MiB (no program compiled); a larger one is still sliced; both
  round-trip."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  everywhere = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("r",)), P())
  two = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("r",)), P())
  # (first dimensions a multiple of 8, which Orbax slices; shapes no other test compiles)
  small = {"w": jnp.arange(72 * 5, dtype=jnp.float32).reshape(72, 5),
           "b": jnp.arange(88, dtype=jnp.bfloat16)}
  small = jax.device_put(small, everywhere)
  big = jax.device_put(jnp.arange((9 << 20) // 4 + 3, dtype=jnp.float32), two)  # 2 x 4.5 MiB
  compiles = []

  def listen(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    with Checkpointer(str(tmp_path)) as ckpt:
      ckpt.save(1, small)
      ckpt.wait_until_finished()
      assert compiles == []
      ckpt.save(2, {"big": big})
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  ckpt = Checkpointer(str(tmp_path))
  _assert_tree_equal(small, ckpt.restore(small, step=1))
  _assert_tree_equal({"big": big}, ckpt.restore({"big": big}, step=2))
  ckpt.close()


def test_keep_last_n(tmp_path):
  state = {"w": jnp.ones((4,)), "step": 0}
  with Checkpointer(str(tmp_path), max_to_keep=2) as ckpt:
    for step in range(1, 6):
      assert ckpt.save(step, {**state, "step": step})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [4, 5]
  assert sorted(os.listdir(tmp_path)) == ["4", "5"]
  ckpt = Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
  assert ckpt.restore(state, step=4)["step"] == 4


def test_reader_sees_new_steps_and_async_save_is_not_listed_early(tmp_path, monkeypatch):
  writer = Checkpointer(str(tmp_path))
  reader = Checkpointer(str(tmp_path))  # e.g. an evaluator polling the trainer's directory
  state = {"w": jnp.ones((8,))}
  writer.save(1, state)
  writer.wait_until_finished()
  assert reader.latest_step() == 1
  writer.save(2, state)
  # held in flight: Orbax still writing step 2 (and listing it, as it may before it is
  # final): not restorable yet, so not listed
  listed = writer._mngr.all_steps
  monkeypatch.setattr(writer._mngr, "is_saving_in_progress", lambda: True)
  monkeypatch.setattr(writer._mngr, "all_steps", lambda *a, **k: sorted({*listed(), 2}))
  assert writer.all_steps() == [1] and writer.latest_step() == 1
  monkeypatch.undo()
  writer.close()
  assert writer.all_steps() == [1, 2] and reader.latest_step() == 2


def test_numpy_leaves_are_copied_before_an_async_save_returns(tmp_path):
  """The caller may overwrite its numpy buffers as soon as `save` returns (the class
  docstring): the checkpoint holds the values at the call, not the overwritten ones."""
  want = np.arange(4096, dtype=np.float32)
  buf = want.copy()
  with Checkpointer(str(tmp_path)) as ckpt:  # async
    assert ckpt.save(1, {"a": buf, "step": 1})
    buf[:] = -1.0  # e.g. a reused host buffer refilled by the next step
  restored = Checkpointer(str(tmp_path)).restore({"a": np.zeros(4096, np.float32), "step": 0})
  np.testing.assert_array_equal(restored["a"], want)


def test_first_save_removes_unfinished_saves_of_other_steps_and_a_reader_removes_none(
    tmp_path):
  """A save killed mid-write leaves its tmp dir; the writer's first save deletes those of
  every step (Orbax itself only replaces the one of the step it writes), while a reader
  (an evaluator opening the trainer's directory) deletes none: one may be in flight."""
  import shutil
  d = str(tmp_path)
  with Checkpointer(d, async_save=False) as ckpt:
    ckpt.save(1, {"w": jnp.ones((4,))})
  tmp = os.path.join(d, "3" + TMP_SUFFIX + "-1700000000")  # step 3's save, killed
  shutil.copytree(os.path.join(d, "1"), tmp)
  reader = Checkpointer(d)
  assert reader.all_steps() == [1]
  np.testing.assert_array_equal(reader.restore({"w": jnp.zeros((4,))})["w"], np.ones(4))
  assert os.path.isdir(tmp)
  writer = Checkpointer(d, async_save=False)
  assert writer.save(2, {"w": jnp.full((4,), 2.0)})
  writer.close()
  assert sorted(os.listdir(d)) == ["1", "2"]


def test_save_interval_and_repeated_step(tmp_path):
  with Checkpointer(str(tmp_path), save_interval_steps=10, async_save=False) as ckpt:
    state = {"w": jnp.zeros((2,))}
    assert ckpt.save(3, state)  # the first checkpoint of a directory is always written
    assert not ckpt.save(5, state)
    assert ckpt.save(5, state, force=True)
    assert ckpt.save(10, state)
    assert not ckpt.save(10, state, force=True)  # already saved: no error, no rewrite
    with pytest.raises(CheckpointError, match="newer checkpoint"):
      ckpt.save(9, state)  # e.g. a resumed run whose step counter restarted
    assert not ckpt.save(15, state)
    assert ckpt.all_steps() == [3, 5, 10]


_KILL_CHILD = textwrap.dedent("""
    import glob, os, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from tlt_jax.checkpoint import Checkpointer

    d = sys.argv[1]
    ckpt = Checkpointer(d, max_to_keep=1)
    ckpt.save(1, {"w": jnp.arange(1000, dtype=jnp.float32), "step": 1})
    ckpt.wait_until_finished()
    print("SAVED1", flush=True)
    # ~300 MB in 6 arrays of random (incompressible: constants compress to nothing) floats, so
    # the background write takes ~2 s here, against ~ms from "SAVING" to the kill.
    rng = np.random.default_rng(0)
    big = {f"a{i}": jnp.asarray(rng.random(12_500_000, np.float32)) for i in range(6)}
    big["step"] = 2
    jax.block_until_ready(big)
    ckpt.save(2, big)
    # Wait until array bytes are landing in the tmp dir, so the kill hits a half-written step.
    def tmp_bytes():
      n = 0
      for t in glob.glob(os.path.join(d, "2.*tmp*")):
        for r, _, fs in os.walk(t):
          for f in fs:
            try:
              n += os.path.getsize(os.path.join(r, f))
            except OSError:  # renamed/removed by the writer meanwhile
              pass
      return n
    t0 = time.time()
    while tmp_bytes() < 20e6 and time.time() - t0 < 10:
      time.sleep(0.002)
    print("SAVING", flush=True)
    time.sleep(120)
""")


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
  d = str(tmp_path / "ckpt")
  script = tmp_path / "child.py"
  script.write_text(_KILL_CHILD)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="", JAX_PLATFORMS="cpu")
  err = open(tmp_path / "child.stderr", "w")
  proc = subprocess.Popen([sys.executable, str(script), d], stdout=subprocess.PIPE,
                          stderr=err, env=env, text=True)
  watchdog = threading.Timer(90, proc.kill)  # a hung child must not hang the suite
  watchdog.start()
  try:
    lines = []
    for line in proc.stdout:  # EOF when the child exits (or the watchdog kills it)
      lines.append(line.strip())
      if lines[-1] == "SAVING":
        proc.send_signal(signal.SIGKILL)
        break
    if lines[-1:] != ["SAVING"]:
      proc.wait(timeout=30)
      err.close()
      tail = (tmp_path / "child.stderr").read_text()[-3000:]
      pytest.fail(f"child stdout: {lines}, rc={proc.returncode}, stderr tail:\n{tail}")
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
  finally:
    watchdog.cancel()
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    err.close()

  names = os.listdir(d)
  step2_finalized = "2" in names
  ckpt = Checkpointer(d)
  if step2_finalized:  # the write beat the kill; then it must be complete and correct
    restored = ckpt.restore({f"a{i}": np.zeros((12_500_000,), np.float32) for i in range(6)}
                            | {"step": 0})
    rng = np.random.default_rng(0)
    assert restored["step"] == 2
    for i in range(6):
      np.testing.assert_array_equal(restored[f"a{i}"], rng.random(12_500_000, np.float32))
    pytest.xfail("the kill landed after step 2 was committed; mid-save case not exercised")
  assert any(TMP_SUFFIX in n for n in names), f"expected an unfinished tmp dir, found {names}"
  tmp_size = sum(os.path.getsize(os.path.join(r, f)) for n in names if TMP_SUFFIX in n
                 for r, _, fs in os.walk(os.path.join(d, n)) for f in fs)
  assert tmp_size >= 20e6, tmp_size  # killed while array bytes were being written
  assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
  restored = ckpt.restore({"w": jnp.zeros((1000,), jnp.float32), "step": 0})
  assert restored["step"] == 1
  np.testing.assert_array_equal(restored["w"], np.arange(1000, dtype=np.float32))

  # The directory is still writable: a new save of the same step (and a later one) commits,
  # and the dead writer's tmp dir is gone.
  assert ckpt.save(2, {"w": jnp.ones((3,)), "step": 2})
  ckpt.wait_until_finished()
  assert ckpt.save(3, {"w": jnp.ones((3,)), "step": 3})
  ckpt.close()
  assert Checkpointer(d).all_steps() == [1, 2, 3]
  assert not [n for n in os.listdir(d) if TMP_SUFFIX in n]
  assert Checkpointer(d).restore({"w": jnp.zeros((3,)), "step": 0}, step=2)["step"] == 2


def test_error_empty_directory(tmp_path):
  for d in (tmp_path / "never_written", tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(str(d))):
      Checkpointer(str(d)).restore({"w": jnp.zeros((2,))})
  assert not (tmp_path / "never_written").exists()  # opening to read must not create it


def test_error_template_mismatch(tmp_path):
  state = {"params": {"layer0": {"w": jnp.ones((4, 8))}, "b": jnp.ones((8,))}, "step": 1}
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, state)
  ckpt = Checkpointer(str(tmp_path))

  bad_shape = {"params": {"layer0": {"w": jnp.ones((4, 16))}, "b": jnp.ones((8,))}, "step": 0}
  with pytest.raises(CheckpointError) as e:
    ckpt.restore(bad_shape)
  msg = str(e.value)
  assert "['params']['layer0']['w']" in msg and "(4, 16)" in msg and "(4, 8)" in msg
  assert "different model config" in msg

  missing = {**state, "drafter": {"fc": jnp.ones((2, 2))}}
  with pytest.raises(CheckpointError, match=r"\['drafter'\]\['fc'\].*not in the checkpoint"):
    ckpt.restore(missing)

  extra = {"params": state["params"]}
  with pytest.raises(CheckpointError, match=r"\['step'\].*not in the template"):
    ckpt.restore(extra)

  no_sharding = {**state, "params": {**state["params"], "b": jax.ShapeDtypeStruct((8,),
                                                                              jnp.float32)}}
  with pytest.raises(CheckpointError, match=r"\['params'\]\['b'\].*sharding"):
    ckpt.restore(no_sharding)


def test_optional_parts_restore_where_both_hold_them(tmp_path):
  """optional keys (a part a run switches on or off between restarts): read where the
  checkpoint and the template both hold them, left out where the checkpoint lacks them, not
  read where the template lacks them; every other key still checked."""
  actor = {"w": jnp.arange(8.0).reshape(2, 4)}
  drafter = {"fc": jnp.full((3,), 7.0), "step": 4}
  with Checkpointer(str(tmp_path / "with")) as ckpt:
    ckpt.save(1, {"actor": actor, "drafter": drafter, "step": 1})
  with Checkpointer(str(tmp_path / "without")) as ckpt:
    ckpt.save(1, {"actor": actor, "step": 1})
  fresh = {"actor": {"w": jnp.zeros((2, 4))}, "step": 0}
  fresh_drafter = {"fc": jnp.zeros((3,)), "step": 0}

  out = Checkpointer(str(tmp_path / "with")).restore(fresh, optional=("drafter",))
  assert set(out) == {"actor", "step"} and out["step"] == 1
  np.testing.assert_array_equal(out["actor"]["w"], actor["w"])
  out = Checkpointer(str(tmp_path / "with")).restore({**fresh, "drafter": fresh_drafter},
                                                     optional=("drafter",))
  np.testing.assert_array_equal(out["drafter"]["fc"], drafter["fc"])
  assert out["drafter"]["step"] == 4
  out = Checkpointer(str(tmp_path / "without")).restore({**fresh, "drafter": fresh_drafter},
                                                        optional=("drafter",))
  assert set(out) == {"actor", "step"}
  np.testing.assert_array_equal(out["actor"]["w"], actor["w"])
  with pytest.raises(CheckpointError, match=r"\['drafter'\]\['fc'\].*not in the template"):
    Checkpointer(str(tmp_path / "with")).restore(fresh)  # not optional: still an error
  with pytest.raises(CheckpointError, match=r"shape mismatch at state\['drafter'\]\['fc'\]"):
    Checkpointer(str(tmp_path / "with")).restore(
        {**fresh, "drafter": {"fc": jnp.zeros((5,)), "step": 0}}, optional=("drafter",))


def test_error_missing_step(tmp_path):
  state = {"w": jnp.ones((2,))}
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(3, state)
    ckpt.save(6, state)
  with pytest.raises(CheckpointError, match=r"step 4.*available steps: \[3, 6\]"):
    Checkpointer(str(tmp_path)).restore(state, step=4)


def test_error_unsupported_leaf(tmp_path):
  with Checkpointer(str(tmp_path)) as ckpt:
    with pytest.raises(CheckpointError, match=r"\['opt'\]\['fn'\].*function"):
      ckpt.save(1, {"opt": {"fn": lambda x: x}})
    # a numpy scalar Orbax has no handler for: named here, not deep in Orbax's save
    with pytest.raises(CheckpointError, match=r"\['t'\] of type datetime64"):
      ckpt.save(1, {"t": np.datetime64("2024-01-01")})


# ------------------------------------------------------------- damaged newest checkpoint

def _files(step_dir):
  return {os.path.relpath(os.path.join(r, f), step_dir): open(os.path.join(r, f), "rb").read()
          for r, _, fs in os.walk(step_dir) for f in fs}


def _truncate_all(step_dir):  # a copy cut short: every file half its size
  for r, _, fs in os.walk(step_dir):
    for f in fs:
      p = os.path.join(r, f)
      os.truncate(p, os.path.getsize(p) // 2)


def _empty_array_data(step_dir):  # a disk fault in the array store only, metadata intact
  for r, _, fs in os.walk(os.path.join(step_dir, "state", "d")):
    for f in fs:
      os.truncate(os.path.join(r, f), 0)


def _damage_metadata(step_dir):  # the item's tree metadata cut short
  p = os.path.join(step_dir, "state", "_METADATA")
  os.truncate(p, os.path.getsize(p) // 2)


def _drop_manifest(step_dir):  # a file of the array store missing
  os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))


def _drop_item(step_dir):  # the whole item directory missing
  import shutil
  shutil.rmtree(os.path.join(step_dir, "state"))


def _saved_5_and_10(d):
  """Steps 5 and 10 with different values; returns {step: state}."""
  states = {s: {"w": jnp.arange(64, dtype=jnp.float32) * s, "step": s, "note": f"at {s}"}
            for s in (5, 10)}
  with Checkpointer(d, async_save=False) as ckpt:
    for s, st in states.items():
      ckpt.save(s, st)
  return states


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == "tlt_jax.checkpoint" and r.levelname == "WARNING"]


# Orbax's restore, failing on an empty array file, leaves TensorStore reads that finish after
# its event loop has closed; their callbacks raise "Event loop is closed" in a TensorStore
# thread, which Python prints as ignored (nothing is lost: the fallback is what counts).
_ORBAX_LATE_READS = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*Event loop is closed:pytest.PytestUnraisableExceptionWarning")


@_ORBAX_LATE_READS
@pytest.mark.parametrize("damage", [_truncate_all, _empty_array_data, _damage_metadata,
                                    _drop_manifest, _drop_item])
def test_damaged_newest_step_falls_back_and_is_kept(tmp_path, caplog, damage):
  d = str(tmp_path / "ckpt")
  states = _saved_5_and_10(d)
  step10 = os.path.join(d, "10")
  damage(step10)
  damaged_bytes = _files(step10)
  template = {"w": jnp.zeros((64,), jnp.float32), "step": 0, "note": ""}

  ckpt = Checkpointer(d, async_save=False)
  with caplog.at_level("WARNING", logger="tlt_jax.checkpoint"):
    restored = ckpt.restore(template)
  _assert_tree_equal(states[5], restored)
  [line] = _warnings(caplog)
  assert "\n" not in line
  assert f"checkpoint step 10 in {d} is damaged (" in line
  assert "resuming from step 5" in line and os.path.join(d, "damaged") in line
  assert _files(step10) == damaged_bytes  # restoring changed nothing on disk

  # The resumed run saves again up to and past the damaged step number; its first save sets
  # the damaged step aside instead of skipping step 10 (taken) or refusing step 6 (older).
  caplog.clear()
  with caplog.at_level("WARNING", logger="tlt_jax.checkpoint"):
    for s in (6, 10, 11):
      assert ckpt.save(s, {**states[5], "step": s, "w": states[5]["w"] + s})
  ckpt.close()
  [aside] = os.listdir(os.path.join(d, "damaged"))
  assert aside.startswith("10-")
  assert _files(os.path.join(d, "damaged", aside)) == damaged_bytes
  assert any(aside in m for m in _warnings(caplog))

  again = Checkpointer(d)
  assert again.all_steps() == [6, 10, 11]  # keep-last-3 counts live steps only
  assert again.restore(template, step=10)["step"] == 10
  np.testing.assert_array_equal(again.restore(template, step=10)["w"],
                                np.arange(64, dtype=np.float32) * 5 + 10)


def test_keep_last_n_after_fallback_leaves_the_damaged_copy(tmp_path):
  d = str(tmp_path)
  _saved_5_and_10(d)
  _truncate_all(os.path.join(d, "10"))
  ckpt = Checkpointer(d, max_to_keep=1, async_save=False)
  ckpt.restore({"w": jnp.zeros((64,), jnp.float32), "step": 0, "note": ""})
  for s in (6, 7, 10, 12):
    ckpt.save(s, {"w": jnp.ones((64,)), "step": s, "note": ""})
  ckpt.close()
  assert sorted(os.listdir(d)) == ["12", "damaged"]
  assert len(os.listdir(os.path.join(d, "damaged"))) == 1


def test_every_step_damaged_is_one_error_and_changes_nothing(tmp_path, caplog):
  d = str(tmp_path)
  _saved_5_and_10(d)
  _damage_metadata(os.path.join(d, "10"))
  _empty_array_data(os.path.join(d, "5"))
  before = {s: _files(os.path.join(d, s)) for s in ("5", "10")}
  template = {"w": jnp.zeros((64,), jnp.float32), "step": 0, "note": ""}
  ckpt = Checkpointer(d)
  with caplog.at_level("WARNING", logger="tlt_jax.checkpoint"):
    with pytest.raises(CheckpointError) as e:
      ckpt.restore(template)
  msg = str(e.value)
  assert "\n" not in msg and len(msg) < 1500, msg
  assert msg.startswith(f"no checkpoint in {d!r} restores (step 10: JSONDecodeError"), msg
  assert "move it aside" in msg
  # the empty array file found before Orbax reads (its failed read leaves reads running)
  empty = re.search(r"; step 5: OSError reading its arrays: (\S+) is empty \(0 bytes", msg)
  assert empty and os.path.getsize(empty[1]) == 0 and f"{os.sep}5{os.sep}" in empty[1], msg
  assert not _warnings(caplog)  # nothing was skipped in favour of another step
  with pytest.raises(CheckpointError, match=r"step 10 in .* is damaged \(JSONDecodeError"):
    ckpt.restore(template, step=10)  # an explicit step never falls back
  assert sorted(os.listdir(d)) == ["10", "5"]
  assert {s: _files(os.path.join(d, s)) for s in ("5", "10")} == before


def test_template_mismatch_is_not_damage(tmp_path, caplog):
  """A healthy newest step that does not fit the template is the user's error: it raises at
  once instead of skipping good checkpoints as damaged."""
  d = str(tmp_path)
  _saved_5_and_10(d)
  ckpt = Checkpointer(d)
  with caplog.at_level("WARNING", logger="tlt_jax.checkpoint"):
    with pytest.raises(CheckpointError, match=r"shape mismatch.*checkpoint step 10"):
      ckpt.restore({"w": jnp.zeros((32,), jnp.float32), "step": 0, "note": ""})
  assert not _warnings(caplog)
  assert ckpt.save(11, {"w": jnp.zeros((64,)), "step": 11, "note": ""})
  ckpt.close()
  assert sorted(os.listdir(d)) == ["10", "11", "5"]


# A few-second RL step on the shipped default model, TLT off (as in test_train.py).
_TRAIN_FLAGS = ["--config", "configs/default.py", "--config.tlt.enabled=False",
                "--config.grpo.num_prompts=4", "--config.grpo.n=4",
                "--config.grpo.micro_batch=16", "--config.grpo.minibatches=1",
                "--config.rollout.max_batch=16", "--config.rollout.max_new_tokens=96",
                "--config.train.eval_every=0", "--config.train.checkpoint_every=1",
                "--config.reward.num_workers=1", "--config.train.steps=2"]


def test_train_resumes_past_a_damaged_checkpoint(tmp_path):
  """The real entry point: a run's newest checkpoint cut short resumes from the one before
  and redoes the lost step exactly; with every checkpoint damaged it exits 2 with one line."""
  import json

  def train(workdir):
    return subprocess.run([sys.executable, "-m", "tlt_jax.train", *_TRAIN_FLAGS, "--workdir",
                           str(workdir)], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu"))

  def records():
    with open(tmp_path / "metrics.jsonl") as f:
      return {r["step"]: r for r in map(json.loads, f)}

  first = train(tmp_path)
  assert first.returncode == 0, first.stderr[-3000:]
  want = records()[2]
  ckpts = tmp_path / "checkpoints"
  _truncate_all(ckpts / "2")

  again = train(tmp_path)
  assert again.returncode == 0, again.stderr[-3000:]
  [line] = [l for l in again.stderr.splitlines() if "damaged (" in l]
  assert f"checkpoint step 2 in {ckpts} is damaged" in line and "resuming from step 1" in line
  assert f"resumed from {ckpts} at step 1" in again.stderr
  # Orbax's own reports of the unreadable files (kilobytes of tracebacks) stay out of it.
  assert "Traceback" not in again.stderr and "_METADATA" not in again.stderr
  got = records()[2]
  assert got["reward"] == want["reward"] and got["tokens"] == want["tokens"]
  assert got["loss"]["loss"] == pytest.approx(want["loss"]["loss"], rel=1e-4, abs=1e-6)
  assert sorted(os.listdir(ckpts)) == ["1", "2", "damaged"]
  assert Checkpointer(str(ckpts)).read(2)["step"] == 2

  for step in ("1", "2"):
    _truncate_all(ckpts / step)
  last = train(tmp_path)
  assert last.returncode == 2, last.stderr[-3000:]
  error = [l for l in last.stderr.splitlines() if l.startswith("error:")]
  assert error == [l for l in last.stderr.splitlines() if "restores (" in l], last.stderr
  assert error[0].startswith(f"error: --workdir {tmp_path}: no checkpoint in '{ckpts}' "
                             "restores (step 2: "), error
  assert "Traceback" not in last.stderr
