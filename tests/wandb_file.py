"""Reads a wandb run's transaction log (`run-<id>.wandb`, what an offline run writes and `wandb
sync` uploads) without wandb's own reader: the file is a LevelDB-style log (a 7-byte header,
":W&B", then 32 KiB blocks of records, each a 7-byte header of CRC32, length and type, FULL or
a FIRST / MIDDLE... / LAST chain), each record a `wandb_internal_pb2.Record` protobuf. The
tests read what wandb wrote with it, independently of tlt_jax's writer."""

import glob
import json
import os
import struct
import time
import zlib

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def raw_records(path: str):
  """Each record's bytes, in order, every chunk's checksum (CRC32 of its type and bytes)
  checked."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", f"{path} is not a wandb log ({data[:8]!r})"
  pos, parts = 7, b""
  while pos + 7 <= len(data):
    if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header: zero padding
      pos += _BLOCK - pos % _BLOCK
      continue
    crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == 0 and length == 0:
      continue
    assert crc == zlib.crc32(bytes([kind]) + chunk), f"{path}: bad checksum before byte {pos}"
    if kind == _FULL:
      yield chunk
    elif kind == _FIRST:
      parts = chunk
    elif kind == _MIDDLE:
      parts += chunk
    elif kind == _LAST:
      yield parts + chunk
    else:
      raise AssertionError(f"{path}: record type {kind} at byte {pos}")


def read_run(run_dir: str, timeout: float = 60.0) -> dict:
  """A finished offline run's folder (`<dir>/wandb/offline-run-*-<id>`) as {"id", "job_type",
  "group", "config", "history": [{key: value}...] in order, "exit_code"}: each history row's
  items by key (a nested one slash-joined: a table is `<key>/path`, `<key>/_type`, ...:
  `table_rows`). wandb's service writes the log from its own process, and `finish()` has
  returned before the file held its records (once in CI, on a loaded machine: not even the
  run's first record was there): the file is read again until its exit record is in it, up
  to `timeout` seconds (then as it is)."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      out = _parse_run(run_dir)
      if out["exit_code"] is not None or time.monotonic() > deadline:
        return out
    except (AssertionError, ValueError):  # (the file, or a record of it, still being written)
      if time.monotonic() > deadline:
        raise
    time.sleep(0.2)


def _parse_run(run_dir: str) -> dict:
  from wandb.proto import wandb_internal_pb2 as pb
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  out = {"id": None, "job_type": None, "group": None, "config": {}, "history": [],
         "exit_code": None}
  for data in raw_records(path):
    rec = pb.Record()
    rec.ParseFromString(data)
    kind = rec.WhichOneof("record_type")
    if kind == "run":
      run = rec.run
      out["id"], out["job_type"], out["group"] = run.run_id, run.job_type, run.run_group
    elif kind == "config":
      for item in rec.config.update:
        out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    elif kind == "history":
      out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
    elif kind == "exit":
      out["exit_code"] = rec.exit.exit_code
  return out


def table_rows(run_dir: str, row: dict, key: str) -> list[dict]:
  """The table `key` of a history row (its items `<key>/_type` "table-file", `<key>/path`)
  read from the run's files: its rows as dicts by column."""
  assert row[f"{key}/_type"] == "table-file", row
  with open(os.path.join(run_dir, "files", row[f"{key}/path"])) as f:
    t = json.load(f)
  return [dict(zip(t["columns"], row)) for row in t["data"]]


def offline_runs(workdir: str) -> list[str]:
  """The offline run folders under <workdir>/wandb, oldest first."""
  return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*")))
