"""User-facing configuration errors and the plumbing that keys them to config entries.

A leaf: it imports nothing of tlt_jax, so every module (config, memory, distributed, the
typed configs of rollout/, rl/, drafter/) can raise a ConfigError without importing the
module that reads the config file.

A typed config (a frozen dataclass) validates itself once, in __post_init__, raising
`ConfigError(fix, key=field, value=...)` with its own field name. Its fields are named like
the config keys of the section it is built from, so `build` only has to prefix the section:
the key travels as an attribute, never as text to parse.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import traceback
from typing import Any, Callable, Mapping



class _Unset:
  def __reduce__(self):
    return "_UNSET"  # the module's one instance, also after pickling


_UNSET = _Unset()


class ConfigError(ValueError):
  """A user's configuration mistake, said in one line.

  key: the config key at fault, dotted ("rollout.top_p"), or None when no single key is (a
    missing --config file, a plan that does not fit the devices).
  value: what the key holds (left out of the message when not given).
  fix: what is wrong and what to do.
  in_config: the key is a path in the run's config (printed as `config.<key>`); False for a
    typed config's own field, raised before anyone said which section it came from.
  """

  def __init__(self, fix: str, key: str | None = None, value: Any = _UNSET, *,
               in_config: bool = False):
    self.fix, self.key, self.value, self.in_config = fix, key, value, in_config
    super().__init__(fix)

  def __str__(self) -> str:
    if self.key is None:
      return self.fix
    head = ("config." if self.in_config else "") + self.key
    if self.value is not _UNSET:
      head += f"={self.value!r}"
    return f"{head}: {self.fix}"

  def __reduce__(self):  # picklable across processes, key and all
    return (_rebuild, (self.fix, self.key, self.value, self.in_config))

  def at(self, key: str) -> ConfigError:
    """The same mistake, attributed to the config key `key`."""
    return ConfigError(self.fix, key, self.value, in_config=True)


def _rebuild(fix, key, value, in_config):
  return ConfigError(fix, key, value, in_config=in_config)


def output_dir_problem(path: str) -> str | None:
  """Why `path` cannot be the directory a command writes into, said for an error message
  ("is a file", "cannot be made (/x is a file)", ...); None once it is one (made here, before
  the work whose results would otherwise have nowhere to go)."""
  if os.path.isfile(path):
    return "is a file"
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    up = os.path.abspath(path)
    while not os.path.exists(up):
      up = os.path.dirname(up)
    return f"cannot be made ({up} is a file)" if os.path.isfile(up) else (
        f"cannot be made ({e.strerror})")
  return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"


def check(cond: bool, key: str, value: Any, fix: str) -> None:
  """ConfigError for config key `key` (dotted, without "config.") unless `cond`."""
  if not cond:
    raise ConfigError(fix, key, value, in_config=True)


def check_finite(section: Any, prefix: str = "") -> None:
  """ConfigError for the first number under `section` (a config's nested mapping, anything
  with `.items()`) that is NaN or infinite. No key of a run takes either, and a NaN slips past
  a range check written as `if x < 0: raise` (every comparison with it is False): a NaN
  temperature or Adam beta would train on garbage without a word."""
  for key, value in section.items():
    name = f"{prefix}{key}"
    if hasattr(value, "items"):
      check_finite(value, name + ".")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ConfigError("must be a finite number", name, value, in_config=True)


def section_values(cls: type, section: Mapping[str, Any]) -> dict[str, Any]:
  """The entries of a config section that are fields of dataclass `cls` (a key is a field)."""
  return {f.name: section[f.name] for f in dataclasses.fields(cls) if f.name in section}


def build(fn: Callable[..., Any], section: str, values: Mapping[str, Any],
          **elsewhere: tuple[str, Any]) -> Any:
  """`fn(**values, **{name: value for name, (key, value) in elsewhere})`, a ConfigError
  raised by it attributed to the config key it concerns: `section.<name>` for `values`, the
  given key for an argument that lives elsewhere in the config (`temperature=
  ("rollout.temperature", 1.0)`), the section itself for an error no field owns."""
  kw = dict(values)
  kw.update({name: v for name, (_, v) in elsewhere.items()})
  try:
    return fn(**kw)
  except ConfigError as e:
    if e.in_config:
      raise
    if e.key in elsewhere:
      raise e.at(elsewhere[e.key][0]) from None
    raise e.at(f"{section}.{e.key}" if e.key else section) from None


# ml_collections' refusal of a value whose type is not the field's default's
_OVERRIDE = re.compile(r"Could not override field '([^']*)' \(reference\)\. .* is of original "
                       r"type <class '([\w.]+)'> and cannot be casted to type <class '([\w.]+)'>")


def config_file_mistake(error: BaseException, path: str) -> ConfigError | None:
  """A config file whose get_config gives a field a value of another type than its default
  (`c.tlt.enabled = "False"` on a loaded config: ml_collections refuses it from deep inside
  itself) as one ConfigError naming the file's line, the field and both types; None for any
  other error (the file's own bug, for which its traceback is the answer)."""
  m = _OVERRIDE.search(str(error)) if isinstance(error, TypeError) else None
  if m is None:
    return None
  field, given, holds = m.groups()
  lines = [f for f in traceback.extract_tb(error.__traceback__)
           if os.path.abspath(f.filename) == os.path.abspath(path)]
  where = f"{path}, line {lines[-1].lineno}: `{lines[-1].line}`" if lines else path
  how = {"bool": "True or False, unquoted", "int": "a whole number, unquoted",
         "float": "a number, unquoted"}.get(holds, f"a {holds}")
  return ConfigError(f"--config {where}: field '{field}' takes {holds} values, not {given}; "
                     f"write {how}")
