"""A stand-in for a wheel that no public index carries (triton-ascend 3.6.0 is on Huawei's index only).

It is a real, installable wheel with the right name, version and tags, holding one module that says it is a
stand-in; pip installs it like any other. Tests use it to show that the npu-cann9 build and
``docker/wheelhouse.py install-pinned`` accept the wheel whose sha256 was pinned and refuse any other file, not that
triton-ascend works (that needs an NPU).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str = "triton_ascend", version: str = "3.6.0", note: str = "stand-in") -> Path:
    """Write ``{name}-{version}-py3-none-any.whl`` into ``folder``; ``note`` changes its bytes (another hash)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}_standin.py": f"NOTE = {note!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0)), text)
    return wheel
