"""Checks of a local model folder that need neither torch nor a download.

What is checked (each function returns ``(status, detail)`` with status ``ok``, ``warn`` or ``fail``):

- ``config.json``: ``model_type`` is a Qwen3.5 hybrid, and its layer pattern (``text_config.layer_types``)
  has one entry per layer, only known kinds, and both Gated DeltaNet and full-attention layers.
- weights: ``model.safetensors.index.json`` names shards; every shard is present, non-empty, has a
  readable safetensors header, is as long as its header says, and holds the tensors the index puts in
  it. A folder with a single ``model.safetensors`` needs no index; several shards without one fail.
- tokenizer and processor files LLaMA-Factory's Qwen3.5/Qwen3-VL templates need.
- an optional checksum manifest (``SHA256SUMS`` or ``checksums.sha256``, ``sha256sum`` format) is
  verified file by file.

Shard headers are read with ``launcher.state.safetensors_header.read_header`` (``safetensors.safe_open`` needs
numpy or torch, maps the whole file, and reports a truncated shard as a generic error, while a
preflight table needs "shard X: truncated, N bytes of data but the header needs M" on a host without torch).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from launcher.files import read_json_object, sha256_file
from launcher.state.safetensors_header import SafetensorsError, read_header

SUPPORTED_MODEL_TYPES = ("qwen3_5",)
LAYER_KINDS = ("linear_attention", "full_attention")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHECKSUM_FILES = ("SHA256SUMS", "checksums.sha256")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")

Result = tuple[str, str]


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` as a dict; raises ``ValueError`` saying what is wrong."""
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir} is not a folder (mount or copy the model there)")
    if not path.is_file():
        raise ValueError(f"{path} is missing; this is not a Hugging Face model folder")
    data = read_json_object(path)
    if isinstance(data, str):
        raise ValueError(f"{data}; the model folder's config.json must be a JSON object")
    return data


def check_model_type(config: dict[str, Any]) -> Result:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return "fail", (
            f"model_type is {model_type!r}; this launcher and its patches are written for "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3.5 hybrid Gated DeltaNet); point "
            "model_name_or_path at a Qwen3.5 model folder"
        )
    arch = ",".join(config.get("architectures") or []) or "no architectures listed"
    return "ok", f"{model_type} ({arch})"


def check_layer_pattern(config: dict[str, Any]) -> Result:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = text.get("layer_types")
    n_layers = text.get("num_hidden_layers")
    if not isinstance(layers, list) or not layers:
        return "fail", "text_config.layer_types is missing; cannot tell DeltaNet from full-attention layers"
    unknown = sorted({str(k) for k in layers} - set(LAYER_KINDS))
    if unknown:
        return "fail", f"text_config.layer_types has unknown kinds {unknown}; expected {list(LAYER_KINDS)}"
    if n_layers is not None and n_layers != len(layers):
        return "fail", f"text_config.layer_types has {len(layers)} entries but num_hidden_layers is {n_layers}"
    full = [i for i, kind in enumerate(layers) if kind == "full_attention"]
    linear = len(layers) - len(full)
    if not full or not linear:
        return "fail", (
            f"{len(layers)} layers, {linear} Gated DeltaNet and {len(full)} full attention; a Qwen3.5 hybrid has both"
        )
    shown = ",".join(map(str, full[:6])) + (",..." if len(full) > 6 else "")
    return "ok", f"{len(layers)} layers: {linear} Gated DeltaNet + {len(full)} full attention (at {shown})"


def _check_shard(path: Path, expected: set[str]) -> str | None:
    if not path.is_file():
        return f"{path.name}: missing"
    try:
        header = read_header(path)
    except (OSError, SafetensorsError) as err:
        return str(err).replace(str(path), path.name)
    missing = expected - set(header.tensors)
    if missing:
        return f"{path.name}: lacks {len(missing)} tensor(s) the index puts there, e.g. {sorted(missing)[0]}"
    return None


def check_weights(model_dir: Path) -> Result:
    index_path = model_dir / INDEX_FILE
    shards_on_disk = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not index_path.is_file():
        if (model_dir / SINGLE_FILE).exists():
            problem = _check_shard(model_dir / SINGLE_FILE, set())
            return ("fail", problem) if problem else ("ok", f"{SINGLE_FILE} (single file, header and size ok)")
        if shards_on_disk:
            return "fail", (
                f"{INDEX_FILE} is missing but there are {len(shards_on_disk)} shard(s) "
                f"({shards_on_disk[0]}, ...); copy the index from the model's source"
            )
        return "fail", f"no weights: neither {INDEX_FILE} nor {SINGLE_FILE} in {model_dir}"
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return "fail", f"{INDEX_FILE} is unreadable or has no weight_map ({err})"
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    problems = [p for shard in sorted(by_shard) if (p := _check_shard(model_dir / shard, by_shard[shard]))]
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return "fail", "; ".join(problems[:3]) + more
    total = sum((model_dir / s).stat().st_size for s in by_shard)
    size = f"{total / 2**30:.1f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"
    return "ok", f"{len(by_shard)} shard(s) named by the index, all present, {size}, headers and sizes ok"


def check_tokenizer(model_dir: Path) -> Result:
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return "fail", f"no tokenizer ({' or '.join(TOKENIZER_FILES)}) in {model_dir}"
    if not any((model_dir / f).is_file() for f in PROCESSOR_FILES):
        return "warn", (
            f"no {' or '.join(PROCESSOR_FILES)}; LLaMA-Factory's qwen3_5/qwen3_vl templates need the "
            "processor files from the model's source"
        )
    return "ok", "tokenizer and processor files present"


def find_checksum_manifest(model_dir: Path) -> Path | None:
    return next((model_dir / f for f in CHECKSUM_FILES if (model_dir / f).is_file()), None)


def check_checksums(model_dir: Path) -> Result:
    """Verify the optional manifest; reads every listed file in full (about 1 GB/s on a local disk)."""
    manifest = find_checksum_manifest(model_dir)
    if manifest is None:
        return "ok", f"no checksum manifest ({' or '.join(CHECKSUM_FILES)}); skipped"
    entries = []
    for number, line in enumerate(manifest.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, _, name = line.strip().partition(" ")
        name = name.strip().lstrip("*")
        if len(digest) != 64 or not name:
            return "fail", f"{manifest.name}:{number}: not '<sha256>  <file>': {line[:80]!r}"
        entries.append((digest.lower(), name))
    started = time.monotonic()
    bad = []
    for digest, name in entries:
        path = model_dir / name
        if not path.is_file():
            bad.append(f"{name}: missing")
            continue
        if sha256_file(path) != digest:
            bad.append(f"{name}: sha256 differs from {manifest.name}")
    if bad:
        return "fail", "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
    return "ok", f"{len(entries)} file(s) match {manifest.name} ({time.monotonic() - started:.0f} s)"
