"""Version guards and symbol checks: an enabled patch that cannot apply stops the run, saying why.

The installed versions are simulated by replacing ``patches.core.versions.installed_version``; everything else
(the registry, the checks, the proof files) is the real code.
"""

from __future__ import annotations

import pytest

import patches
from patches.core import versions
from patches.core.errors import PatchError
from patches.core.proof import read_proof

pytest_plugins = ["tests.support.patch_fixtures"]
pytestmark = pytest.mark.usefixtures("restore_patches")


def fake_versions(monkeypatch, **overrides: str | None) -> None:
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda dist: overrides.get(dist, real(dist)))


def test_out_of_range_transformers_is_refused_with_version_range_and_fix(tmp_path, monkeypatch):
    fake_versions(monkeypatch, transformers="5.7.0")
    with pytest.raises(PatchError) as info:
        patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    message = str(info.value)
    assert message.startswith("patch deltanet_routing: transformers 5.7.0 is installed; this patch supports ")
    assert "transformers<5.7,>=5.6.0" in message
    assert "Fix: install a supported version (pip install 'transformers<5.7,>=5.6.0')" in message
    assert "launcher.patches.deltanet_routing: false" in message
    record = read_proof(tmp_path, "deltanet_routing")
    assert record["status"] == "failed"
    assert record["error"] == message
    # the run stops at the first failing patch: the next one was never started
    assert not (tmp_path / "rank0" / "checkpoint_all_layers.json").exists()


def test_out_of_range_llamafactory_is_refused_by_the_checkpointing_patch(tmp_path, monkeypatch):
    fake_versions(monkeypatch, llamafactory="0.9.6")
    with pytest.raises(
        PatchError,
        match=r"patch checkpoint_all_layers: llamafactory 0\.9\.6 is installed; "
        r"this patch supports llamafactory<0\.9\.6,>=0\.9\.5",
    ):
        patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)


def test_a_missing_package_is_named(tmp_path, monkeypatch):
    fake_versions(monkeypatch, llamafactory=None)
    with pytest.raises(PatchError, match=r"llamafactory is not installed; the patch supports .*pip install"):
        patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)


def test_turning_the_refused_patch_off_lets_the_run_go_on_and_is_recorded(tmp_path, monkeypatch):
    fake_versions(monkeypatch, llamafactory="0.9.6")
    off = {"checkpoint_all_layers": False, "text_only_batches": False, "final_eval_once": False, "packed_rows": False}
    applied = patches.apply_enabled(off, backend="cpu", proof_dir=tmp_path)
    # the ones that do not touch LLaMA-Factory
    assert applied == [
        "deltanet_routing",
        "fused_ops",
        "chunked_loss",
        "lora_input_cast",
        "fsdp2_frozen_dtype",
        "fsdp2_resume_adapter",
        "gc_freeze",
    ]
    record = read_proof(tmp_path, "checkpoint_all_layers")
    assert record["enabled"] is False
    assert record["status"] == "disabled"
    assert read_proof(tmp_path, "deltanet_routing")["status"] == "applied"


def test_a_missing_upstream_symbol_is_refused(tmp_path, monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.delattr(modeling_qwen3_5, "FusedRMSNormGated")
    with pytest.raises(PatchError) as info:
        patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert "transformers.models.qwen3_5.modeling_qwen3_5 (transformers 5.6.0) has no FusedRMSNormGated" in str(
        info.value
    )


def test_a_function_that_stopped_reading_the_global_is_refused():
    def reads_global():
        return versions.installed_version

    def reads_local(installed_version=None):
        return installed_version

    versions.require_global_loads("demo", reads_global, ["versions"], "transformers")
    with pytest.raises(PatchError, match="no longer reads installed_version from its module globals"):
        versions.require_global_loads("demo", reads_local, ["installed_version"], "transformers")


def test_records_go_to_the_folder_of_this_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    patches.apply_enabled({"deltanet_routing": {"kernel": "torch"}}, backend="cpu", proof_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "rank3").iterdir()) == sorted(f"{n}.json" for n in patches.PATCH_NAMES)
    record = read_proof(tmp_path, "deltanet_routing", rank=3)
    assert (record["rank"], record["world_size"], record["options"]) == (
        3,
        4,
        {"kernel": "torch", "allow_torch_fallback": False},
    )
