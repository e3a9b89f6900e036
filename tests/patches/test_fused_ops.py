"""The fused glue (``fused_ops``) and LoRA without the fp32 input copy (``lora_input_cast``), on CPU.

There is no GPU or NPU here: FLA's Triton kernels and ``torch_npu`` cannot run. The selection logic and the
adapters are tested against stand-ins: ``stub_fla`` writes a package named ``fla`` whose fused ops implement
fla-core 0.6.0's contracts in plain torch (conv on ``[B, T, D]`` with weight ``[D, W]``; norms with the
weight as given; ``swiglu(gate, up)``), and a stand-in ``torch_npu`` module offers ``npu_rms_norm``. A model
built with the patch selecting those kernels (backend ``cuda`` or ``npu``, routing off so the DeltaNet chunk
stays transformers' torch kernel on the CPU) must compute what transformers' own ops compute, forward and
backward; a planted layout error must not. The real kernels are checked by ``launcher validate-kernels`` on the
device (``tests/checks/test_validate_kernels.py`` and docs/lab/2026-12-02-fused-glue.md).
"""

from __future__ import annotations

import sys
import types

import pytest

import patches
from patches import fused_ops, lora_input_cast
from patches.core.proof import read_proof
from patches.kernels import fused_kernels
from tests.support.patch_fixtures import EVAL_EVERY_STEP_SGD, lora_model, trainer_log

pytest_plugins = ["tests.support.patch_fixtures"]

ROUTING_OFF = {"deltanet_routing": False, "packed_rows": False}


@pytest.mark.parametrize(
    ("backend", "fla", "npu_norm", "expected"),
    [
        ("cpu", None, False, ("torch", "torch", "torch", "torch")),
        ("cuda", None, False, ("fla", "fla", "fla", "fla")),
        ("cuda", "FLA (fla-core) is not installed", False, ("torch", "torch", "torch", "torch")),
        ("npu", None, True, ("fla", "torch_npu", "fla", "fla")),
        ("npu", None, False, ("fla", "fla", "fla", "fla")),
    ],
)
def test_kernels_per_backend(backend, fla, npu_norm, expected):
    wanted = dict.fromkeys(fused_kernels.OPS, True)
    choices = fused_kernels.select_kernels(backend, wanted, fla, npu_norm)
    assert tuple(choices[op].kernel for op in fused_kernels.OPS) == expected
    if fla:
        assert all(fla in c.reason for c in choices.values())


def test_each_op_has_its_off_switch():
    wanted = {"conv": True, "rms_norm": False, "gated_norm": True, "swiglu": False}
    choices = fused_kernels.select_kernels("cuda", wanted, None, False)
    assert {op: c.kernel for op, c in choices.items()} == {
        "conv": "fla",
        "rms_norm": "torch",
        "gated_norm": "fla",
        "swiglu": "torch",
    }
    assert choices["rms_norm"].reason == "launcher.patches.fused_ops.rms_norm: false"
    with pytest.raises(ValueError, match=r"fused_ops\.swiglu is 'no'; expected true or false"):
        patches.normalize_settings({"fused_ops": {"swiglu": "no"}})


def forward_backward(model, seed: int = 5):
    """Loss and every gradient of a tiny causal-LM step (two rows, one padded)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.randint(1, 64, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_gap(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b)


def autotune_keys() -> dict[str, list[str]]:
    """The autotune keys of the stand-in FLA's row-bucketed norm kernels (real Triton autotuners, never launched)."""
    pairs = (kernel for pair in fused_kernels.FLA_ROW_BUCKETED.values() for kernel in pair)
    return {name: list(fused_kernels.autotuner_of(module_name, name).keys) for module_name, name in pairs}


@pytest.mark.usefixtures("restore_patches")
def test_on_cuda_flas_narrow_norms_are_tuned_once_per_width_and_get_their_keys_back(tmp_path, stub_fla):
    """fla-core 0.6.0 re-tunes its norm kernels of 512 channels or fewer at every bucket of rows (``NB`` in the
    autotune key): on CUDA the patch takes ``NB`` out of the four kernels' keys and records them; switched off, FLA's
    own keys are back; on NPU (triton-ascend kernels, no autotuner) nothing is re-keyed."""
    stub_fla(platform="cuda")
    own = autotune_keys()
    without_nb = {name: [key for key in keys if key != "NB"] for name, keys in own.items()}
    assert all("NB" in keys for keys in own.values()) and without_nb != own
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path / "on")
    record = read_proof(tmp_path / "on", "fused_ops")
    assert record["fla_norms_tuned_by_width"] == sorted(
        f"{m}.{n}" for pair in fused_kernels.FLA_ROW_BUCKETED.values() for m, n in pair
    )
    assert autotune_keys() == without_nb
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path / "again")  # idempotent
    assert read_proof(tmp_path / "again", "fused_ops")["fla_norms_tuned_by_width"] == record["fla_norms_tuned_by_width"]
    assert autotune_keys() == without_nb
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": False}, backend="cuda", proof_dir=tmp_path / "off")
    assert autotune_keys() == own
    patches.apply_enabled(ROUTING_OFF, backend="npu", proof_dir=tmp_path / "npu")
    assert "fla_norms_tuned_by_width" not in read_proof(tmp_path / "npu", "fused_ops") and autotune_keys() == own
    # the plain norm off: only the gated norm's kernels are FLA's to re-key
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": {"rms_norm": False}}, backend="cuda", proof_dir=tmp_path / "g")
    assert read_proof(tmp_path / "g", "fused_ops")["fla_norms_tuned_by_width"] == [
        f"fla.modules.norm.fused_norm_gate.{n}" for n in ("layer_norm_gated_bwd_kernel", "layer_norm_gated_fwd_kernel")
    ]
    assert autotune_keys() == {**own, **{n: k for n, k in without_nb.items() if "gated" in n}}


@pytest.mark.usefixtures("restore_patches")
def test_an_fla_whose_norm_kernels_differ_keeps_its_own_tuning(tmp_path, stub_fla):
    """A kernel renamed or keyed without ``NB`` is left as FLA has it, and the proof says none was re-keyed."""
    root = stub_fla(platform="cuda")
    for rel in ("fla/modules/norm/layernorm.py", "fla/modules/norm/fused_norm_gate.py"):
        path = root / rel
        path.write_text(path.read_text().replace('"NB", ', "").replace("layer_norm_bwd_kernel", "renamed"))
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path / "on")
    assert read_proof(tmp_path / "on", "fused_ops")["fla_norms_tuned_by_width"] == []


@pytest.mark.usefixtures("restore_patches")
def test_the_fused_path_computes_what_transformers_computes(tmp_path, make_tiny_model, stub_fla):
    """Every norm of the tiny model (hidden norms, q/k norms) goes to the stand-in FLA, as the 27B's do on CUDA."""
    stub_fla(platform="cuda")
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": False}, backend="cuda", proof_dir=tmp_path / "off")
    loss_off, grads_off = forward_backward(make_tiny_model())
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path / "on")
    model = make_tiny_model()
    assert fused_ops.census(model) == {"conv": 1, "rms_norm": 2 * 2 + 2 + 1, "gated_norm": 1, "swiglu": 2}
    loss_on, grads_on = forward_backward(model)
    calls = fused_ops._state["calls"]
    assert calls["rms_norm"] == 2 * 2 + 2 + 1, calls  # hidden norms, q and k norms, the final norm
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert worst_gap(grads_on, grads_off) < 1e-5
    from fla.modules.causal_conv1d import CALLS

    assert CALLS["n"] == 1  # one DeltaNet layer, one forward
    record = read_proof(tmp_path / "on", "fused_ops")
    assert record["status"] == "applied"
    assert {op: v["kernel"] for op, v in record["ops"].items()} == dict.fromkeys(fused_kernels.OPS, "fla")
    assert record["ops"]["conv"]["callable"] == "fla.modules.causal_conv1d.causal_conv1d"


@pytest.mark.usefixtures("restore_patches")
def test_a_conv_adapter_that_forgot_the_transpose_is_caught(tmp_path, make_tiny_model, stub_fla, monkeypatch):
    """The comparison above can fail: a conv fed ``[B, D, T]`` as if it were ``[B, T, D]`` gives other numbers."""
    stub_fla(platform="cuda")
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": False}, backend="cuda", proof_dir=tmp_path / "off")
    loss_off, _ = forward_backward(make_tiny_model())

    def no_transpose(self, x, weight, bias=None, activation=None, seq_idx=None):
        return self.kernel(x, weight=weight, bias=bias, activation=activation)[0]

    monkeypatch.setattr(fused_kernels.FlaConv, "__call__", no_transpose)
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path / "on")
    with pytest.raises(RuntimeError):  # [B, D, T] read as [B, T, D]: the weight's channels do not line up
        forward_backward(make_tiny_model())


@pytest.mark.usefixtures("restore_patches")
def test_on_npu_the_plain_norm_goes_to_torch_npu_and_the_gated_norm_to_fla(
    tmp_path, make_tiny_model, stub_fla, monkeypatch
):
    """No ``torch.cuda`` call builds the gated norm on NPU: transformers' own module is built and its forward fused."""
    import torch

    stub_fla(platform="npu")
    seen = []

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        seen.append((x.dtype, gamma.dtype))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_rms_norm=npu_rms_norm))
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": False}, backend="npu", proof_dir=tmp_path / "off")
    loss_off, grads_off = forward_backward(make_tiny_model())
    patches.apply_enabled(ROUTING_OFF, backend="npu", proof_dir=tmp_path / "on")
    model = make_tiny_model()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    assert type(model.model.layers[0].linear_attn.norm) is m.Qwen3_5RMSNormGated
    loss_on, grads_on = forward_backward(model)
    assert seen and seen[0] == (torch.float32, torch.float32)  # gamma in the input's dtype
    assert loss_on == pytest.approx(loss_off, rel=1e-6) and worst_gap(grads_on, grads_off) < 1e-5
    ops = read_proof(tmp_path / "on", "fused_ops")["ops"]
    assert ops["rms_norm"]["callable"] == "torch_npu.npu_rms_norm" and ops["gated_norm"]["kernel"] == "fla"


@pytest.mark.usefixtures("restore_patches")
def test_on_cpu_nothing_is_replaced_and_the_first_step_says_so(tmp_path, make_tiny_model, stub_trainer):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    upstream = m.Qwen3_5RMSNorm.forward
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert m.Qwen3_5RMSNorm.forward is upstream and m.causal_conv1d_fn is None
    model = make_tiny_model()
    import torch
    import transformers

    transformers.Trainer.training_step(
        stub_trainer, model, {"input_ids": torch.randint(1, 64, (1, 8)), "labels": torch.randint(1, 64, (1, 8))}
    )
    record = read_proof(tmp_path, "fused_ops")
    assert all(v["kernel"] == "torch" for v in record["ops"].values())
    assert record["first_training_step"]["fused_calls"] == dict.fromkeys(fused_kernels.OPS, 0)
    assert record["first_training_step"]["modules"]["swiglu"] == 2


@pytest.mark.usefixtures("restore_patches")
def test_turning_the_patch_off_puts_the_upstream_ops_back(tmp_path, stub_fla):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    upstream = (m.Qwen3_5RMSNorm.forward, m.Qwen3_5RMSNormGated.forward, m.Qwen3_5MLP.forward, m.causal_conv1d_fn)
    stub_fla(platform="cuda")
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path)
    patches.apply_enabled(ROUTING_OFF, backend="cuda", proof_dir=tmp_path)  # twice: one wrapper each
    assert m.Qwen3_5MLP.forward.__deltanet_launcher_original__ is upstream[2]
    patches.apply_enabled({**ROUTING_OFF, "fused_ops": False}, backend="cuda", proof_dir=tmp_path)
    now = (m.Qwen3_5RMSNorm.forward, m.Qwen3_5RMSNormGated.forward, m.Qwen3_5MLP.forward, m.causal_conv1d_fn)
    assert now == upstream
    assert read_proof(tmp_path, "fused_ops")["status"] == "disabled"


# --- lora_input_cast ------------------------------------------------------------------------------------------


def lora_step(model, autocast: bool):
    import torch

    torch.manual_seed(11)
    ids = torch.randint(1, model.config.text_config.vocab_size, (2, 24))
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def bf16_base(model):
    """The frozen base in bf16, LoRA in fp32: how LLaMA-Factory trains with ``bf16: true``."""
    import torch

    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    return model


@pytest.mark.usefixtures("restore_patches")
def test_lora_under_autocast_skips_the_fp32_copy_and_makes_the_same_update(tmp_path, demo_assets):
    """Under bf16 autocast the LoRA branch computes in bf16 either way: skipping PEFT's fp32 copy of the input
    changes nothing but the copy (dropout 0: the same numbers to the last bit)."""
    patches.apply_enabled({"lora_input_cast": False}, backend="cpu", proof_dir=tmp_path / "off")
    model = bf16_base(lora_model(demo_assets["model"]))
    loss_off, grads_off = lora_step(model, autocast=True)
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path / "on")
    loss_on, grads_on = lora_step(model, autocast=True)
    assert lora_input_cast._state["skipped"] == 4  # q/k/v/o of the demo model's one full-attention layer
    assert loss_on == loss_off
    assert worst_gap(grads_on, grads_off) == 0.0


@pytest.mark.usefixtures("restore_patches")
def test_without_autocast_peft_casts_as_upstream(tmp_path, demo_assets):
    import torch

    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    model = lora_model(demo_assets["model"])
    lora_step(model, autocast=False)
    assert lora_input_cast._state["skipped"] == 0
    assert lora_input_cast.skips(torch.zeros(2, dtype=torch.bfloat16), torch.float32) is False


# --- through the real LLaMA-Factory training path ---------------------------------------------------------


@pytest.fixture(scope="module")
def glue_trainings(demo_assets, tiny_training, tmp_path_factory):
    """The demo model, 2 steps of 2 micro-batches, bf16 autocast on the CPU, evaluated at every step: the fused
    glue served by the stand-in FLA (``tests.support.fused_standin_entry``) with ``lora_input_cast``, then both off."""
    root = tmp_path_factory.mktemp("glue_runs")
    extra = {**EVAL_EVERY_STEP_SGD, "lora_dropout": 0.05, "bf16": True, "use_cpu": True}
    results = {
        "on": tiny_training(root / "on", demo_assets, {}, lf=extra, entry="tests.support.fused_standin_entry"),
        "off": tiny_training(
            root / "off",
            demo_assets,
            {"fused_ops": False, "lora_input_cast": False},
            lf=extra,
            entry="tests.support.fused_standin_entry",
        ),
    }
    for name, result in results.items():
        assert result.returncode == 0, f"{name} training failed:\n{result.stderr[-3000:]}"
    return {name: root / name for name in results}


@pytest.mark.slow
def test_the_fused_glue_and_lora_cast_train_as_transformers_does(glue_trainings):
    """First loss, eval loss and the LoRA update with the new patches on and off, in bf16 (autocast on the CPU):
    the fused path rounds once where transformers rounds twice, so they agree to bf16, not to the bit; a missing
    ``1 +`` in the norm or a swapped gate would move the loss by far more (a norm without its offset is planted in
    tests/checks/test_validate_kernels.py)."""
    from safetensors.torch import load_file

    on, off = (trainer_log(glue_trainings[n]) for n in ("on", "off"))
    first_on, first_off = (next(x["loss"] for x in log if "loss" in x) for log in (on, off))
    assert first_on == pytest.approx(first_off, rel=1e-3)  # seen: 1e-5
    evals_on, evals_off = ([x["eval_loss"] for x in log if "eval_loss" in x] for log in (on, off))
    assert evals_on[0] == pytest.approx(evals_off[0], rel=1e-3)
    adapters = {n: load_file(glue_trainings[n] / "output" / "adapter_model.safetensors") for n in ("on", "off")}
    b_names = [n for n in adapters["off"] if "lora_B" in n]
    assert b_names and all(adapters["off"][n].abs().max() > 0 for n in b_names)
    worst = max(float((adapters["on"][n] - adapters["off"][n]).norm() / adapters["off"][n].norm()) for n in b_names)
    assert worst < 0.03, worst  # seen: 0.7 % (bf16 gradients of two micro-batches)
    proof = read_proof(glue_trainings["on"] / "proof", "fused_ops")
    assert {op: v["kernel"] for op, v in proof["ops"].items()} == dict.fromkeys(fused_kernels.OPS, "fla")
    calls = proof["first_training_step"]["fused_calls"]
    assert all(calls[op] > 0 for op in fused_kernels.OPS), calls
    cast = read_proof(glue_trainings["on"] / "proof", "lora_input_cast")["first_training_step"]
    assert cast["skipped_casts"] > 0, cast  # the Trainer's bf16 autocast: PEFT's fp32 copy was skipped
