"""The header of a safetensors file, read and checked without torch or numpy: the one safetensors header reader
of the launcher (preflight's model check reads shard headers with it, ``verify`` reads the adapter through
``launcher.results.adapter``, and a checkpoint counts as loadable only when its weights' header holds,
``launcher.state.checkpoints``).

The format is small and fixed (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header mapping each name to ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the
header, then the raw little-endian data. A damaged file is reported with evidence (which tensor, which byte
range, how big the file is), not as a library exception.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.files import Unreadable, open_regular, parse_json

# safetensors dtype -> (numpy dtype string, bytes per element). BF16 is read as its raw 16 bits and
# widened to float32 (bf16 is the top half of an IEEE float32).
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "BOOL": ("?", 1),
    "U16": ("<u2", 2),
    "U32": ("<u4", 4),
    "U64": ("<u8", 8),
    "F8_E4M3": ("u1", 1),  # read as raw bytes (never a LoRA tensor; model shards may hold them)
    "F8_E5M2": ("u1", 1),
}
_MAX_HEADER = 100 << 20  # the format's own limit


class SafetensorsError(ValueError):
    """The file is not a complete, well-formed safetensors file; the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check the header of ``path``.

    Checks that every tensor's byte range fits its dtype and shape, lies inside the file, and that
    the file is not shorter than its header promises (a truncated copy or an interrupted save).

    Raises:
        FileNotFoundError: the file is missing.
        SafetensorsError: with the offending value when the file is damaged.
    """
    try:
        f = os.fdopen(open_regular(path), "rb")  # a FIFO or a device behind a link is never read
    except Unreadable as err:
        raise SafetensorsError(f"{path}: {err}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise SafetensorsError(f"{path}: empty file (0 bytes)")
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise SafetensorsError(
                f"{path}: header length {header_len} does not fit in a {size}-byte file (truncated or not "
                "a safetensors file)"
            )
        try:
            header = parse_json(f.read(header_len))
        except Unreadable as err:
            raise SafetensorsError(f"{path}: header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ is {type(metadata).__name__}, not an object")
    base = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        info = _tensor_info(path, name, entry, base)
        tensors[name] = info
        data_end = max(data_end, info.end)
    if data_end > size:
        raise SafetensorsError(
            f"{path}: truncated: the header describes {data_end - base} bytes of tensor data but the file "
            f"has {size - base} (file size {size}); the copy or the save was interrupted"
        )
    return SafetensorsHeader(path, size, dict(metadata), tensors)


def _tensor_info(path: Path, name: str, entry: Any, base: int) -> TensorInfo:
    try:
        dtype = entry["dtype"]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if not isinstance(dtype, str):
            raise TypeError(dtype)
    except (KeyError, TypeError, ValueError) as err:
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from err
    if dtype not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    info = TensorInfo(name, dtype, shape, base + begin, base + end)
    expected = info.numel * DTYPES[dtype][1]
    if end < begin or end - begin != expected:
        raise SafetensorsError(
            f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) needs {expected} bytes but its offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    return info
