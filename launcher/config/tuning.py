"""Runtime levers of the job's environment: NPU host dispatch and allocator, and a persistent Triton cache.

``launcher.tuning`` (defaults from Ascend's own recipes: MindSpeed-MM's Qwen3.5-27B recipe and ms-swift set
``TASK_QUEUE_ENABLE=2``; MindSpeed-MM ``CPU_AFFINITY_CONF=1``; both ``PYTORCH_NPU_ALLOC_CONF=
expandable_segments:True``; see docs/npu-tuning.md for what each addresses):

- ``task_queue_enable`` -> ``TASK_QUEUE_ENABLE`` (npu): torch-npu's two-level dispatch queue, which moves
  operator launch off the Python thread (0 off, 1 on, 2 also moves more of the launch work);
- ``cpu_affinity_conf`` -> ``CPU_AFFINITY_CONF`` (npu): binds each rank's threads to the CPU cores near its
  NPU, so dispatch threads are not migrated across NUMA nodes;
- ``npu_alloc_conf`` -> ``PYTORCH_NPU_ALLOC_CONF`` (npu): ``expandable_segments:True`` lets the caching
  allocator grow segments instead of fragmenting on sequences of changing length;
- ``triton_cache: true`` -> ``TRITON_CACHE_DIR=<output_root>/.cache/triton`` and ``TRITON_CACHE_AUTOTUNING=1``
  (every backend): compiled Triton kernels (FLA on CUDA, triton-ascend on NPU) kept under the output root, so a
  second run skips the compile, and with them the autotuner's timings of each kernel's configurations (Triton's
  ``Autotuner`` writes them to that cache only when ``TRITON_CACHE_AUTOTUNING`` is set), so a second run does
  not benchmark them again either (first 27B step on one H200: 256.3 s with an empty cache, 251.3 s of it in
  Triton's compile and autotune; docs/npu-tuning.md has the warm figures).

A variable already set in the caller's environment wins (``compose.yaml`` sets ``TRITON_CACHE_DIR``; set it
yourself for another folder, ``TRITON_CACHE_AUTOTUNING=0`` to have every run tune again); ``null`` (``false`` for
the cache) leaves a variable alone. What was set, and from where, is recorded in the run's ``manifest.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

TRITON_CACHE_DEFAULT = ".cache/triton"  # under the output root


class Tuning(BaseModel):
    """``launcher.tuning``: the job's environment levers (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    task_queue_enable: Literal[0, 1, 2] | None = 2
    cpu_affinity_conf: str | None = "1"
    npu_alloc_conf: str | None = "expandable_segments:True"
    triton_cache: bool = True

    def wanted(self, backend: str, output_root: Path) -> dict[str, str]:
        """The variables this config asks for on ``backend``."""
        found: dict[str, str] = {}
        if backend == "npu":
            for name, value in (
                ("TASK_QUEUE_ENABLE", self.task_queue_enable),
                ("CPU_AFFINITY_CONF", self.cpu_affinity_conf),
                ("PYTORCH_NPU_ALLOC_CONF", self.npu_alloc_conf),
            ):
                if value is not None:
                    found[name] = str(value)
        if self.triton_cache:
            found["TRITON_CACHE_DIR"] = str((Path(output_root) / TRITON_CACHE_DEFAULT).resolve())
            found["TRITON_CACHE_AUTOTUNING"] = "1"
        return found


def tuning_env(
    tuning: Tuning, backend: str, output_root: Path, environ: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The variables to add to the job's environment, and the record of every lever (value and source).

    Returns:
        ``(to_set, record)``: ``to_set`` excludes what ``environ`` already sets; ``record`` maps each variable
        to ``{"value": ..., "from": "launcher.tuning" | "environment"}``.
    """
    to_set: dict[str, str] = {}
    record: dict[str, dict[str, str]] = {}
    for name, value in tuning.wanted(backend, output_root).items():
        if name in environ:
            record[name] = {"value": environ[name], "from": "environment"}
        else:
            to_set[name] = value
            record[name] = {"value": value, "from": "launcher.tuning"}
    return to_set, record
