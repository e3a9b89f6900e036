"""The ``launcher.patches`` section: defaults, accepted forms, every problem reported at once.

These run on the host side of the contract: no torch, transformers or LLaMA-Factory is imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import patches
from patches.registry import PATCHES

CHECKPOINT_DEFAULTS = {
    "enabled": True,
    "uncheckpointed_layers": None,
    "memory_budget_gib": None,
    "offload_inputs": "auto",
}
DEFAULTS = {
    "deltanet_routing": {"enabled": True, "kernel": "auto", "allow_torch_fallback": False},
    "fused_ops": {"enabled": True, "conv": True, "rms_norm": True, "gated_norm": True, "swiglu": True},
    "checkpoint_all_layers": CHECKPOINT_DEFAULTS,
    "chunked_loss": {"enabled": True, "chunk_tokens": 512},
    "text_only_batches": {"enabled": True},
    "final_eval_once": {"enabled": True},
    "pad_lengths": {"enabled": False, "multiple": 256},  # the one patch that is off unless named
    "lora_input_cast": {"enabled": True},
    "packed_rows": {
        "enabled": True,
        "varlen_attention": True,
        "device_mask": True,
        "unpacked_forward": True,
        "cut_padding": 256,
    },
    "fsdp2_frozen_dtype": {"enabled": True, "trainable_units": "auto", "embedding_units": True},
    "fsdp2_resume_adapter": {"enabled": True},
    "gc_freeze": {"enabled": True},
}


def test_registry_order_is_routing_then_checkpointing_then_the_rest():
    assert patches.PATCH_NAMES == (
        "deltanet_routing",
        "fused_ops",
        "checkpoint_all_layers",
        "chunked_loss",
        "text_only_batches",
        "final_eval_once",
        "pad_lengths",
        "lora_input_cast",
        "packed_rows",
        "fsdp2_frozen_dtype",
        "fsdp2_resume_adapter",
        "gc_freeze",
    )
    assert tuple(PATCHES) == patches.PATCH_NAMES


def test_an_off_by_default_patch_is_on_once_named_with_options():
    assert patches.normalize_settings({"pad_lengths": {"multiple": 512}})["pad_lengths"] == {
        "enabled": True,
        "multiple": 512,
    }
    assert patches.normalize_settings({"pad_lengths": True})["pad_lengths"] == {"enabled": True, "multiple": 256}
    assert patches.normalize_settings({"pad_lengths": {}})["pad_lengths"]["enabled"] is True  # named: on


@pytest.mark.parametrize("raw", [None, {}])
def test_unmentioned_patches_are_enabled_with_defaults(raw):
    settings = patches.normalize_settings(raw)
    assert settings == DEFAULTS
    assert tuple(settings) == patches.PATCH_NAMES


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"deltanet_routing": False}, {"enabled": False, "kernel": "auto", "allow_torch_fallback": False}),
        (
            {"deltanet_routing": {"kernel": "torch"}},
            {"enabled": True, "kernel": "torch", "allow_torch_fallback": False},
        ),
        (
            {"deltanet_routing": {"enabled": False, "kernel": "fla"}},
            {"enabled": False, "kernel": "fla", "allow_torch_fallback": False},
        ),
    ],
)
def test_bool_and_mapping_forms(raw, expected):
    settings = patches.normalize_settings(raw)
    assert settings["deltanet_routing"] == expected
    assert settings["checkpoint_all_layers"] == CHECKPOINT_DEFAULTS


def test_normalized_settings_are_a_fixed_point():
    once = patches.normalize_settings({"checkpoint_all_layers": False, "deltanet_routing": {"kernel": "torch"}})
    assert patches.normalize_settings(once) == once


def test_every_problem_is_reported_at_once_with_its_key_and_fix():
    raw = {
        "deltanet_routng": True,
        "deltanet_routing": {"kernal": "torch", "kernel": "cuda", "enabled": "yes"},
        "checkpoint_all_layers": None,
    }
    with pytest.raises(ValueError) as info:
        patches.normalize_settings(raw)
    lines = str(info.value).splitlines()
    assert lines[0] == "5 problem(s) in launcher.patches:"
    message = "\n".join(lines)
    assert "launcher.patches.deltanet_routng: unknown patch (did you mean deltanet_routing?)" in message
    assert "known patches: deltanet_routing, fused_ops, checkpoint_all_layers, chunked_loss" in message
    assert "launcher.patches.deltanet_routing.kernal: unknown option" in message
    assert "its options are enabled, kernel" in message
    assert "launcher.patches.deltanet_routing.kernel is 'cuda'; expected one of 'auto', 'fla' or 'torch'" in message
    assert "launcher.patches.deltanet_routing.enabled is 'yes'; expected true or false" in message
    assert "launcher.patches.checkpoint_all_layers is None; expected true, false, or a mapping" in message


def test_checkpointing_refuses_an_unknown_option():
    with pytest.raises(ValueError, match=r"checkpoint_all_layers\.use_reentrant: unknown option"):
        patches.normalize_settings({"checkpoint_all_layers": {"use_reentrant": True}})


def test_a_non_mapping_section_is_refused():
    with pytest.raises(ValueError, match="launcher.patches is .*expected a mapping of patch name"):
        patches.normalize_settings(["deltanet_routing"])


def test_apply_enabled_refuses_an_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="backend is 'tpu'; expected one of npu, cuda, cpu"):
        patches.apply_enabled({}, backend="tpu", proof_dir=tmp_path)


def test_package_imports_and_validates_without_torch():
    code = (
        "import sys, patches; patches.normalize_settings({'deltanet_routing': {'kernel': 'torch'}}); "
        "heavy = {'torch', 'transformers', 'llamafactory'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_embedding_units_takes_true_or_false_only():
    assert (
        patches.normalize_settings({"fsdp2_frozen_dtype": {"embedding_units": False}})["fsdp2_frozen_dtype"][
            "embedding_units"
        ]
        is False
    )
    with pytest.raises(ValueError, match=r"fsdp2_frozen_dtype\.embedding_units is 'no'; expected true or false"):
        patches.normalize_settings({"fsdp2_frozen_dtype": {"embedding_units": "no"}})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (-5, "cut_padding is -5: Input should be greater than or equal to 0"),
        ("256", "cut_padding is '256': Input should be a valid integer"),
        (True, "cut_padding is True: Input should be a valid integer"),
        (1 << 21, "cut_padding is 2097152: Input should be less than or equal to 1048576"),
    ],
)
def test_cut_padding_takes_a_whole_number_of_tokens(value, says):
    assert patches.normalize_settings({"packed_rows": {"cut_padding": 0}})["packed_rows"]["cut_padding"] == 0
    with pytest.raises(ValueError, match=r"launcher\.patches\.packed_rows\." + says.replace(".", r"\.")):
        patches.normalize_settings({"packed_rows": {"cut_padding": value}})
