"""The safetensors format, by hand: a file's JSON header, its tensors memory-mapped (no data
read until a slice is), and files written from (name, shape, dtype) specs as their tensors are
produced (one at a time: a model's tensors are never all in host memory). The format: an
8-byte little-endian header length, the JSON header (name -> dtype, shape, byte offsets into
the data section; `__metadata__`), the data section. models/hf_io.py reads and writes Hugging
Face checkpoints with it; the drafter's own and EAGLE files too (drafter/model.py).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator

import ml_dtypes
import numpy as np

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
class CheckpointFormatError(ValueError):
  """A checkpoint directory that cannot be read as a supported HF model."""


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise CheckpointFormatError(f"{path}: not a safetensors file (truncated header)")
    (n,) = struct.unpack("<Q", raw)
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointFormatError(f"{path}: corrupt safetensors header ({e})") from None
  header.pop("__metadata__", None)
  return header, 8 + n


def mmap_safetensors(path: str) -> dict[str, np.ndarray]:
  """name -> read-only memory-mapped numpy array (bf16 via ml_dtypes); reads no data."""
  header, offset = read_safetensors_header(path)
  out = {}
  for name, info in header.items():
    if info["dtype"] not in _ST_DTYPES:
      raise CheckpointFormatError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    dtype = np.dtype(_ST_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    if end - start != int(np.prod(shape)) * dtype.itemsize:
      raise CheckpointFormatError(f"{path}: tensor {name} size does not match its shape {shape}")
    if end == start:
      out[name] = np.zeros(shape, dtype)
    else:
      out[name] = np.memmap(path, dtype=dtype, mode="r", offset=offset + start, shape=shape)
  return out


def _safetensors_header(specs: list[tuple[str, tuple[int, ...], Any]],
                        metadata: dict[str, str] | None) -> bytes:
  """The length prefix and JSON header of a file holding `specs` [(name, shape, dtype)] in
  that order (the data section 8-byte aligned)."""
  header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
  pos = 0
  for name, shape, dtype in specs:
    dtype = np.dtype(dtype)
    if dtype not in _ST_NAMES:
      raise ValueError(f"cannot write tensor {name} of dtype {dtype} to safetensors")
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[name] = {"dtype": _ST_NAMES[dtype], "shape": [int(d) for d in shape],
                    "data_offsets": [pos, pos + n]}
    pos += n
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section
  return struct.pack("<Q", len(blob)) + blob


def write_safetensors_stream(path: str, specs: list[tuple[str, tuple[int, ...], Any]],
                             tensors: Iterator[tuple[str, np.ndarray]],
                             metadata: dict[str, str] | None = None) -> None:
  """A safetensors file written as its tensors are produced: the header from `specs`
  [(name, shape, dtype)] first, then exactly len(specs) items of `tensors` ((name, array),
  in the same order, e.g. a generator gathering them one by one), each written as it comes,
  so the file's tensors are never all in memory at once. Renamed into place when complete: a
  crash mid-write never leaves a truncated file under the real name."""
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(_safetensors_header(specs, metadata))
    for name, shape, dtype in specs:
      got, arr = next(tensors, (None, None))
      if got != name or tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise ValueError(f"{path}: expected tensor {name} {tuple(shape)} {np.dtype(dtype)}, got "
                         + ("none" if got is None else f"{got} {arr.shape} {arr.dtype}"))
      f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
  os.replace(tmp, path)


def write_safetensors(path: str, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
  tensors = {name: np.asarray(arr) for name, arr in tensors.items()}
  specs = [(name, arr.shape, arr.dtype) for name, arr in tensors.items()]
  write_safetensors_stream(path, specs, iter(tensors.items()), metadata)
