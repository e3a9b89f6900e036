"""Read safetensors files and LoRA adapters on a host without torch: the header, each tensor as numpy.

The one safetensors reader of the launcher: preflight's model check reads shard headers with it, and
``verify`` reads the adapter.

Why not ``safetensors.numpy.load_file``: numpy has no bfloat16, so it refuses BF16 tensors
("data type 'bfloat16' not understood"), which is what a bf16 run can save; and a damaged file
should be reported with evidence (which tensor, which byte range, how big the file is), not as a
library exception. The format is small and fixed (https://github.com/huggingface/safetensors):
an 8-byte little-endian header length, a JSON header mapping each name to ``dtype``, ``shape`` and
``data_offsets`` relative to the end of the header, then the raw little-endian data. Tensors are
memory-mapped, so checking a large adapter does not load it all at once.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.state.runs import ADAPTER_CONFIG, ADAPTER_FILE

# safetensors dtype -> (numpy dtype string, bytes per element). BF16 is read as its raw 16 bits and
# widened to float32 (bf16 is the top half of an IEEE float32).
_DTYPES: dict[str, tuple[str, int]] = {
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
# peft saves adapter weights as base_model.model.<module>.lora_A.weight (the adapter name is dropped)
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


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
    size = path.stat().st_size
    if size == 0:
        raise SafetensorsError(f"{path}: empty file (0 bytes)")
    with open(path, "rb") as f:
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
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SafetensorsError(f"{path}: header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
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
    except (KeyError, TypeError, ValueError) as err:
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from err
    if dtype not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    info = TensorInfo(name, dtype, shape, base + begin, base + end)
    expected = info.numel * _DTYPES[dtype][1]
    if end < begin or end - begin != expected:
        raise SafetensorsError(
            f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) needs {expected} bytes but its offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    return info


def load_tensor(header: SafetensorsHeader, name: str):
    """Tensor ``name`` as a numpy array (floats as float32/float64, memory-mapped where possible)."""
    import numpy as np

    info = header.tensors[name]
    np_dtype, _ = _DTYPES[info.dtype]
    if info.numel == 0:
        return np.zeros(info.shape, dtype=np.float32)
    array = np.memmap(header.path, dtype=np_dtype, mode="r", offset=info.start, shape=(info.numel,))
    if info.dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    elif info.dtype == "F16":
        array = array.astype(np.float32)
    return array.reshape(info.shape)


def iter_tensors(header: SafetensorsHeader) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, array)`` for every tensor, in file order."""
    for name in sorted(header.tensors, key=lambda n: header.tensors[n].start):
        yield name, load_tensor(header, name)


@dataclass
class LoraAdapter:
    """A LoRA adapter folder as read once: header, config, modules, per-tensor statistics.

    ``problem`` is set (and the rest left empty) when the files are missing or damaged.
    """

    header: SafetensorsHeader | None = None
    config: dict[str, Any] | None = None
    problem: str | None = None
    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> {"A": key, "B": key}
    others: list[str] = field(default_factory=list)
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (nan, inf)
    max_abs: dict[str, float] = field(default_factory=dict)
    values: int = 0


def read_lora_adapter(folder: Path) -> LoraAdapter:
    """Read ``adapter_model.safetensors`` and ``adapter_config.json`` in ``folder``; never raises for bad
    content. Every tensor is scanned once for non-finite values and its largest magnitude."""
    import numpy as np

    adapter = LoraAdapter()
    path, config_path = folder / ADAPTER_FILE, folder / ADAPTER_CONFIG
    missing = [p.name for p in (path, config_path) if not p.is_file()]
    if missing:
        adapter.problem = f"{' and '.join(missing)} missing at the top of {folder}"
        return adapter
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        adapter.problem = f"{config_path} is unreadable ({err})"
        return adapter
    if not isinstance(config, dict):
        adapter.problem = f"{config_path} does not hold a JSON object"
        return adapter
    adapter.config = config
    try:
        adapter.header = read_header(path)
    except (OSError, SafetensorsError) as err:
        adapter.problem = str(err)
        return adapter
    for key in adapter.header.tensors:
        match = _LORA_KEY.match(key)
        if match:
            adapter.modules.setdefault(match["module"], {})[match["ab"]] = key
        else:
            adapter.others.append(key)
    for key, array in iter_tensors(adapter.header):
        if array.dtype.kind != "f":
            continue
        adapter.values += array.size
        finite = np.isfinite(array)
        if not finite.all():
            nan = int(np.isnan(array).sum())
            adapter.nonfinite[key] = (nan, int(array.size - finite.sum()) - nan)
        adapter.max_abs[key] = float(np.abs(array[finite]).max()) if finite.any() else math.nan
    return adapter
