"""Weights & Biases logging of a run (`config.wandb`): the scalars TensorBoard gets, the logged
responses as tables, the run's config; off unless `config.wandb.project` is set.

wandb is not a requirement of the main job (`pip install wandb` where it is wanted): a config
that names a project without it installed is one error when the config is checked. The wandb
run starts before the model loads (a login or network problem costs nothing), on process 0
only, with wandb's console capture and banners off (the run's stderr stays as the README
shows it) and one `wandb:` line of its own saying where the run is: online, its URL; offline,
the folder `wandb sync` uploads.

Resume: the wandb run's id is kept in `<workdir>/wandb.json`, so the same command continues
the same wandb run (`resume="allow"`; a changed project or entity starts a new one). wandb's
history only moves forward: a step at or after the one wandb holds is logged, an earlier one
(a resumed run repeating the steps after its checkpoint, which it computes as the killed run
did: docs/training.md) is not sent again. Offline, each start writes its own folder under
`<workdir>/wandb/` with the same id, and the newest holds every step (`MetricsWriter` sends
a resumed run's steps on disk first): `wandb sync` that one.

A failure inside wandb during the run (its service gone, a full disk) is one warning and the
end of wandb logging, never of the run: metrics.jsonl and TensorBoard hold everything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
import string
import sys
from typing import Any, Sequence

from tlt_jax.errors import ConfigError

MODES = ("", "online", "offline")
RUN_FILE = "wandb.json"  # <workdir>/wandb.json: {"id", "project", "entity"} of the wandb run


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """config.wandb. project: the wandb project ("": no wandb logging); entity: the team or user
  ("": wandb's default); name: the run's display name ("": the workdir's folder name); group,
  tags (comma-separated): wandb's; mode: "online", "offline", or "" for wandb's own choice
  (WANDB_MODE, else online)."""
  project: str = ""
  entity: str = ""
  name: str = ""
  group: str = ""
  tags: str | tuple[str, ...] = ""
  mode: str = ""

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not (isinstance(value, str) or f.name == "tags" and isinstance(value, (list, tuple))
              and all(isinstance(t, str) for t in value)):
        raise ConfigError("a string" + (" (comma-separated) or a list of strings"
                                        if f.name == "tags" else ""), f.name, value)
    if self.mode not in MODES:
      raise ConfigError("use 'online', 'offline' (upload later with `wandb sync`) or '' "
                        "(wandb's own choice: WANDB_MODE, else online)", "mode", self.mode)
    if self.project and importlib.util.find_spec("wandb") is None:
      raise ConfigError("wandb is not installed: `pip install wandb`, or leave wandb.project "
                        "'' (metrics.jsonl and TensorBoard have every metric)", "project",
                        self.project)

  @property
  def tag_list(self) -> list[str]:
    tags = self.tags.split(",") if isinstance(self.tags, str) else self.tags
    return [t.strip() for t in tags if t.strip()]


def _saved_id(path: str, cfg: WandbConfig) -> str | None:
  """The id in `path` (wandb.json) where it names cfg's project and entity."""
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  if saved.get("project") == cfg.project and saved.get("entity") == cfg.entity:
    return saved.get("id") or None
  return None


def new_id() -> str:
  """A fresh wandb run id: 8 characters of [a-z0-9], as wandb makes them."""
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def table_cell(value: Any) -> Any:
  """A response record's value as a wandb.Table cell: numbers, strings, booleans and None as
  they are, anything else (a verl reward's extra entries) as its JSON text."""
  if value is None or isinstance(value, (str, bool, int, float)):
    return value
  return json.dumps(value)


class WandbRun:
  """One run's wandb logging (module docstring). `start` makes it; `log` sends a step's
  scalars and tables; `close` finishes the wandb run."""

  def __init__(self, run, wandb_module):
    self._run, self._wandb = run, wandb_module
    self.id = getattr(run, "id", None)  # the wandb run's id (kept in <workdir>/wandb.json)

  @classmethod
  def start(cls, cfg: WandbConfig, workdir: str, config: dict[str, Any],
            out=sys.stderr, job_type: str = "train") -> WandbRun | None:
    """The wandb run of `workdir` (the one wandb.json names, else a new one), `config` its
    config; None where cfg.project is "". A run wandb cannot start is a ConfigError.
    job_type "eval" (`python -m tlt_jax.eval`): a new wandb run each time, its id not kept
    (wandb.json stays the training run's), named `<name>-eval`, its group the training run's
    name (the workdir's folder by default) unless the config gives one."""
    if not cfg.project:
      return None
    import wandb
    os.makedirs(workdir, exist_ok=True)
    name = cfg.name or os.path.basename(os.path.normpath(os.path.abspath(workdir)))
    group = cfg.group or None
    if job_type == "train":
      path = os.path.join(workdir, RUN_FILE)
      run_id = _saved_id(path, cfg) or new_id()
      with open(path + ".tmp", "w") as f:  # (before init: a run killed at once keeps its id)
        json.dump({"id": run_id, "project": cfg.project, "entity": cfg.entity}, f)
      os.replace(path + ".tmp", path)
    else:
      run_id, group, name = new_id(), group or name, f"{name}-{job_type}"
    try:
      run = wandb.init(project=cfg.project, entity=cfg.entity or None, name=name,
                       group=group, tags=cfg.tag_list or None, job_type=job_type,
                       mode=cfg.mode or None, dir=workdir, id=run_id,
                       resume="allow" if job_type == "train" else None,
                       settings=wandb.Settings(console="off", silent=True))
      # (a resumed run's config may differ where train.resume_with_changes allows it)
      run.config.update(config, allow_val_change=True)
    except Exception as e:  # noqa: BLE001 - wandb's errors: login, network, permissions
      why = (str(e).strip().splitlines() or [""])[0]
      raise ConfigError(f"wandb could not start the run ({type(e).__name__}: {why}): log in "
                        "(`wandb login` or WANDB_API_KEY), or set wandb.mode=offline and "
                        "upload later with `wandb sync`, or wandb.project='' for none",
                        "wandb.project", cfg.project, in_config=True) from None
    what = f"run {name} ({run.id}{', resumed' if run.resumed else ''})"
    if run.settings._offline:
      print(f"wandb: offline {what} in {run.settings.sync_dir} (`wandb sync` it to upload)",
            file=out)
    else:
      print(f"wandb: {what} at {run.url}", file=out)
    return cls(run, wandb)

  def log(self, step: int, scalars: dict[str, float],
          tables: Sequence[tuple[str, Sequence[dict[str, Any]]]] = ()) -> None:
    """Step `step`'s scalars, and each (name, response records) as a table, in one history
    row; a step before the one wandb holds (a resumed run's repeat) is not sent."""
    if self._run is None or step < self._run.step:
      return
    row: dict[str, Any] = dict(scalars)
    try:
      for name, records in tables:
        columns = list(dict.fromkeys(k for r in records for k in r))
        row[name] = self._wandb.Table(
            columns=columns, data=[[table_cell(r.get(c)) for c in columns] for r in records])
      self._run.log(row, step=step)
    except Exception as e:  # noqa: BLE001 - wandb's own failure ends wandb's logging only
      self._stop(e)

  def _stop(self, e: Exception) -> None:
    print(f"wandb: logging stopped ({type(e).__name__}: {e}); metrics.jsonl and TensorBoard "
          "go on", file=sys.stderr)
    run, self._run = self._run, None
    try:
      run.finish(exit_code=1)
    except Exception:  # noqa: BLE001
      pass

  def close(self, exit_code: int = 0) -> None:
    """Finishes the wandb run (exit_code != 0: marked failed)."""
    if self._run is None:
      return
    run, self._run = self._run, None
    try:
      run.finish(exit_code=exit_code)
    except Exception as e:  # noqa: BLE001
      print(f"wandb: finishing the run failed ({type(e).__name__}: {e})", file=sys.stderr)
