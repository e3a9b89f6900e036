"""Read LoRA adapters on a host without torch: each tensor of a safetensors file as numpy (its header is read by
``launcher.state.safetensors_header``); ``verify`` reads the adapter with it.

Why not ``safetensors.numpy.load_file``: numpy has no bfloat16, so it refuses BF16 tensors
("data type 'bfloat16' not understood"), which is what a bf16 run can save; and a damaged file
should be reported with evidence (which tensor, which byte range, how big the file is), not as a
library exception. Tensors are memory-mapped, so checking a large adapter does not load it all at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import read_json_object
from launcher.state.runs import ADAPTER_CONFIG, ADAPTER_FILE
from launcher.state.safetensors_header import DTYPES, SafetensorsError, SafetensorsHeader, read_header

# peft saves adapter weights as base_model.model.<module>.lora_A.weight (the adapter name is dropped)
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def load_tensor(header: SafetensorsHeader, name: str):
    """Tensor ``name`` as a numpy array (floats as float32/float64, memory-mapped where possible)."""
    import numpy as np

    info = header.tensors[name]
    np_dtype, _ = DTYPES[info.dtype]
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
    config = read_json_object(config_path)
    if isinstance(config, str):
        adapter.problem = config
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
