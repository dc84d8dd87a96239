"""Parses, without running them, the commands `scripts/gpu_check.sh --plan` prints (read as
JSON [[stage, argv], ...] on stdin): a script's argparse arguments, the main job's config
overrides and its config's checks (`config.run_spec`). Prints one JSON line per command:
{"stage", "ok", "error"}. tests/test_gpu_check.py runs it on the GPU settings, so a mistyped
argument is found here, not on a lent GPU whose minutes it would spend."""

import argparse
import contextlib
import io
import json
import runpy
import sys


class _Parsed(Exception):
  """Raised from a script's parse_args once its arguments parsed: nothing else of it runs."""


def _script(argv: list[str]) -> str | None:
  parse = argparse.ArgumentParser.parse_args

  def parse_only(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise _Parsed()

  argparse.ArgumentParser.parse_args = parse_only
  sys.argv, err = list(argv), io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      runpy.run_path(argv[0], run_name="__main__")
  except _Parsed:
    return None
  except SystemExit as e:
    return f"exit {e.code}: {err.getvalue()[-500:]}"
  finally:
    argparse.ArgumentParser.parse_args = parse
  return "ran to the end without parsing its arguments"


def _train(argv: list[str]) -> str | None:
  from absl import flags
  from ml_collections import config_flags

  from tlt_jax import config as config_lib
  from tlt_jax.errors import ConfigError
  fv = flags.FlagValues()  # each command its own flags
  config = config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True)
  sys.argv = ["train", *argv]  # (ml_collections finds the --config.* overrides there)
  try:
    config_lib.check_overrides(argv)
    fv(sys.argv)
    config_lib.run_spec(config.value)
  except (ConfigError, flags.Error) as e:
    return str(e)
  return None


def main() -> None:
  for stage, argv in json.load(sys.stdin):
    if argv[:2] == ["-m", "tlt_jax.train"]:
      error = _train(argv[2:])
    else:
      error = _script(argv)
    print(json.dumps({"stage": stage, "ok": error is None, "error": error}), flush=True)


if __name__ == "__main__":
  main()
