"""What flash-linear-attention (FLA) can do in this process, as plain data for the routing decision.

Written against fla-core 0.6.0 (read at the source). Facts it relies on:

- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` takes ``[B, T, H, D]`` tensors, the layout
  transformers' ``Qwen3_5GatedDeltaNet`` passes; on Ascend it runs on triton-ascend through FLA's
  ``triton_ascend`` backends.
- ``fla.utils.device_platform`` is the Triton backend FLA found (``cuda``, ``npu``, ``hip``, ``cpu``...).
  Community ``triton`` installed next to ``triton-ascend`` shadows it, and FLA then sees the wrong platform.
- The Hopper guard: ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` (the gated chunk backward) raises
  ``RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated
  chunk_bwd_dqkwg (see #640) ...")`` when ``g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and
  not TRITON_ABOVE_3_7_1`` (flags read from that module's globals). It fires only in the first *backward*,
  i.e. after the model is loaded and the first forward ran. It is skipped when FLA's dispatcher hands the
  call to another backend first: the TileLang ``common`` backend (enabled by default on Hopper with Triton
  >= 3.4 when ``tilelang`` and a usable ``nvcc`` are present; ``FLA_TILELANG=0`` turns it off) or, for the
  whole ``chunk_gated_delta_rule``, the FlashQLA backend (``flash_qla`` package; ``FLA_FLASH_QLA=0``).
  ``FLA_DISABLE_BACKEND_DISPATCH=1`` disables both. We read these flags; we never change them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import asdict, dataclass

from packaging.specifiers import SpecifierSet

from ..core.versions import installed_version

logger = logging.getLogger(__name__)

# The FLA releases whose guard and API this module was checked against.
FLA_SUPPORTED = SpecifierSet(">=0.6.0,<0.7")
FLA_DISTRIBUTIONS = ("fla-core", "flash-linear-attention")


@dataclass(frozen=True)
class FlaFacts:
    """What FLA offers here. ``refusal`` is FLA's own reason to refuse this device, if any."""

    installed: bool
    version: str | None = None
    import_error: str | None = None
    platform: str | None = None
    refusal: str | None = None
    workaround: str | None = None

    def as_record(self) -> dict:
        return asdict(self)


def fla_version() -> str | None:
    for dist in FLA_DISTRIBUTIONS:
        version = installed_version(dist)
        if version is not None:
            return version
    return None


def fla_presence() -> FlaFacts:
    """Whether FLA is installed and its version, without importing it."""
    return FlaFacts(installed=importlib.util.find_spec("fla") is not None, version=fla_version())


def probe_fla(backend: str) -> FlaFacts:
    """Import FLA (only on npu/cuda) and collect the facts ``select_route`` needs."""
    presence = fla_presence()
    if not presence.installed or backend == "cpu":
        return presence
    version = presence.version
    try:
        import fla.ops.gated_delta_rule
        import fla.utils
    except Exception as exc:  # noqa: BLE001 - FLA's import touches Triton drivers; any error means unusable
        return FlaFacts(installed=True, version=version, import_error=f"{type(exc).__name__}: {exc}")
    refusal = _hopper_guard_refusal(version)
    return FlaFacts(
        installed=True,
        version=version,
        platform=getattr(fla.utils, "device_platform", None),
        refusal=refusal,
        workaround=_guard_workaround() if refusal else None,
    )


def _hopper_guard_refusal(version: str | None) -> str | None:
    """FLA's Hopper guard, evaluated with the flags the guard itself reads; None when it would not fire."""
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        return None  # no such module: not the 0.6.0 layout; FLA_SUPPORTED keeps unknown releases out

    flags = {
        name: getattr(chunk_o, name, None) for name in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
    }
    if None in flags.values():
        return None  # not the 0.6.0 guard; FLA_SUPPORTED keeps unknown releases out
    if not (flags["IS_NVIDIA_HOPPER"] and flags["TRITON_ABOVE_3_4_0"] and not flags["TRITON_ABOVE_3_7_1"]):
        return None
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "device name unavailable"
    triton_version = installed_version("triton") or installed_version("pytorch-triton") or "unknown"
    return (
        f"fla-core {version} refuses the gated-delta-rule backward on this Hopper GPU "
        f"({gpu}) with Triton {triton_version}: FLA's guard in "
        "fla/ops/common/chunk_o.py (chunk_bwd_dqkwg) rejects Triton >= 3.4.0 and < 3.7.1 on Hopper because "
        "it produces incorrect gradients (FLA issue #640); it would raise at the first backward"
    )


def _guard_workaround() -> str | None:
    """The FLA backend that would take the call before the guard runs, if one is usable here."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return None
    candidates = (
        ("fla.ops.gated_delta_rule.backends.flash_qla", "FlashQLABackend", "flash_qla"),
        ("fla.ops.common.backends.tilelang", "CommonTileLangBackend", "tilelang"),
    )
    for module_name, class_name, label in candidates:
        try:
            module = importlib.import_module(module_name)
            if getattr(module, class_name).can_use():
                return label
        except Exception:  # a backend that cannot even be asked is not usable
            logger.debug("FLA backend %s is not usable", label, exc_info=True)
    return None
