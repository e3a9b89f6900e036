"""``launcher validate-kernels`` on the CPU: the routed torch kernel in bf16 against the fp32 reference.

On CPU the routed kernel is transformers' torch chunk implementation itself, so a pass there shows bf16
rounding only. These tests show the comparison is live: kernels broken on purpose (layout read as
[B, H, T, D], wrong output scale, state leaking across packed sequences, NaN, a crash) fail, and bf16 fails a
threshold below its rounding. FLA's kernel needs an accelerator;
docs/lab/2026-11-30-deltanet-kernel-validation.md records the H200 run.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from launcher.checks.kernels import check as kernel_check  # noqa: E402
from launcher.checks.kernels import decode as decode_kernels  # noqa: E402
from launcher.checks.kernels import glue as glue_kernels  # noqa: E402
from launcher.checks.kernels import validate as kernels  # noqa: E402
from launcher.cli import main  # noqa: E402
from tests.support.patch_fixtures import fla_pairing, grouped_varlen_kernel  # noqa: E402

pytest_plugins = ["tests.support.patch_fixtures"]

SMALL = kernels.Case("small", 1, 100, 3, 16)  # T=100 != H=3, not a multiple of the 64-token chunk


def reference(*args, **kwargs):
    return kernels.torch_reference()(*args, **kwargs)


def check(kernel, case: kernels.Case = SMALL, threshold: float = kernels.DEFAULT_THRESHOLD) -> kernels.CaseResult:
    return kernels.check_case(torch, case, kernel, kernels.torch_reference(), kernels.Device(torch, "cpu"), threshold)


def swapped_layout(q, k, v, g, beta, **kw):
    """Reads FLA's [B, T, H, D] as [B, H, T, D]: runs over heads instead of time."""
    out, state = reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g=g.transpose(1, 2), beta=beta.transpose(1, 2), **kw
    )
    return out.transpose(1, 2), state


def wrong_scale(*args, **kw):
    out, state = reference(*args, **kw)
    return out * 1.1, state


def honours_cu_seqlens(q, k, v, g, beta, cu_seqlens=None, **kw):
    """A stand-in for a varlen kernel: each packed sequence alone, concatenated."""
    if cu_seqlens is None:
        return reference(q, k, v, g=g, beta=beta, **kw)
    bounds = cu_seqlens.tolist()
    outs = [
        reference(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kw)[0]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs, dim=1), None


def leaks_state(q, k, v, g, beta, cu_seqlens=None, **kw):
    """Accepts cu_seqlens but ignores it: each sequence starts from the previous one's state."""
    return reference(q, k, v, g=g, beta=beta, **kw)


def test_quick_suite_passes_on_cpu_with_bf16_rounding_only():
    report = kernels.validate("cpu", suite="quick")
    assert report.ok, report.to_dict()
    assert "torch_chunk_gated_delta_rule" in report.kernel
    by_name = {c.name: c for c in report.cases}
    for name in ("layout", "grouped"):
        case = by_name[name]
        assert case.status == "pass" and case.finite
        assert set(case.errors) == {"out", "dq", "dk", "dv", "dg", "dbeta"}
        assert min(case.errors.values()) > 0 and case.max_error < 0.02  # bf16 rounding: small, never zero
    for name in ("varlen", "varlen_grouped"):  # the torch kernel takes no cu_seqlens
        varlen = by_name[name]
        assert varlen.status == "skip" and "cu_seqlens" in varlen.note and varlen.cu_seqlens == [0, 45, 130, 200]
    decode = by_name["decode"]
    assert "torch_recurrent_gated_delta_rule" in report.decode_kernel
    assert decode.status == "pass" and set(decode.errors) == {"out", "state"}
    assert 0 < decode.max_error < 0.02  # bf16 rounding of the step inputs: small, never zero


def test_bf16_fails_a_threshold_below_its_rounding():
    result = check(reference, threshold=1e-5)
    assert result.status == "fail" and "threshold" in result.note


@pytest.mark.parametrize(("kernel", "worst_at_least"), [(swapped_layout, 0.3), (wrong_scale, 0.09)])
def test_broken_kernels_fail(kernel, worst_at_least):
    result = check(kernel)
    assert result.status == "fail", result
    assert result.max_error >= worst_at_least


def test_varlen_kernel_that_honours_cu_seqlens_passes_and_a_leaky_one_fails():
    case = next(c for c in kernels.SUITES["quick"] if c.name == "varlen")
    good = check(honours_cu_seqlens, case)
    assert good.status == "pass", good
    assert max(good.errors_vs_alone.values()) < 1e-6 and good.max_error < 0.02
    leaky = check(leaks_state, case)
    assert leaky.status == "fail" and max(leaky.errors_vs_alone.values()) > 0.3
    assert "vs alone" in leaky.note


def test_grouped_value_heads_pass_with_fla_s_pairing_and_fail_with_another():
    """``varlen_grouped`` hands the routed kernel 2 key heads for 4 value heads, unrepeated (what packed rows do on
    FLA); the reference gets them repeated as transformers repeats them. FLA's pairing (value head ``j`` on key head
    ``j // groups``, its kernels' ``i_h // (HV // H)``) passes; pairing them round-robin (``j % key_heads``) fails."""
    case = next(c for c in kernels.SUITES["quick"] if c.name == "varlen_grouped")
    assert case.unrepeated and (case.key_heads, case.heads) == (2, 4) and case.seq_lens
    good = check(grouped_varlen_kernel(fla_pairing), case)
    assert good.status == "pass", good
    assert good.max_error < 0.02 and max(good.errors_vs_alone.values()) < 1e-6
    wrong = check(grouped_varlen_kernel(lambda j, groups, key_heads: j % key_heads), case)
    assert wrong.status == "fail" and wrong.max_error > 0.1, wrong


def test_non_finite_output_and_crashing_kernel_fail():
    def nan_kernel(*args, **kw):
        out, state = reference(*args, **kw)
        return out * float("nan"), state

    def crash(*args, **kw):
        raise RuntimeError("kernel exploded")

    assert check(nan_kernel).status == "fail"
    crashed = check(crash)
    assert crashed.status == "fail" and "kernel exploded" in crashed.note


def test_grouped_heads_give_gradients_of_the_key_heads():
    case = kernels.Case("g", 1, 70, 6, 16, key_heads=2)
    out, grads = kernels.run_kernel(
        torch, reference, kernels.make_inputs(torch, case), case, device="cpu", dtype=torch.bfloat16
    )
    assert list(out.shape) == [1, 70, 6, 16]
    assert list(grads["q"].shape) == list(grads["k"].shape) == [1, 70, 2, 16]
    assert list(grads["g"].shape) == [1, 70, 6] and grads["g"].dtype == torch.float32  # g stays fp32


def test_inputs_look_like_the_model_makes_them():
    inputs = kernels.make_inputs(torch, kernels.Case("x", 1, 64, 4, 8))
    assert inputs["g"].dtype == torch.float32 and bool((inputs["g"] < 0).all())
    assert inputs["beta"].dtype == torch.bfloat16 and bool(((inputs["beta"] > 0) & (inputs["beta"] < 1)).all())


def test_every_case_has_t_different_from_h_and_the_model_case_is_there():
    for suite in kernels.SUITES.values():
        for case in suite:
            assert case.seq_len != case.heads, case
            assert case.seq_lens is None or (case.batch == 1 and sum(case.seq_lens) == case.seq_len)
    full = {c.name: c for c in kernels.SUITES["full"]}
    model = full["qwen3_5_27b"]
    assert model.shape == [1, 4096, 48, 128] and model.key_heads == 16 and model.timing and model.memory
    assert (full["grouped"].key_heads, full["grouped"].heads) == (16, 48)


def test_timing_compares_the_routed_kernel_with_the_torch_fallback():
    def routed(*args, **kw):
        return reference(*args, **kw)

    case = kernels.Case("t", 1, 64, 2, 16, timing=True, memory=True)
    result = kernels.check_case(
        torch,
        case,
        routed,
        kernels.torch_reference(),
        kernels.Device(torch, "cpu"),
        0.05,
        fallback=kernels.torch_reference(),
    )
    assert result.status == "pass"
    assert set(result.timing_ms) == {"routed", "torch_fallback"} and all(v > 0 for v in result.timing_ms.values())
    assert result.peak_memory_gib is None  # no memory counters on the CPU


def test_cli_writes_json_and_exits_zero(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["validate-kernels", "--device", "cpu", "--case", "layout", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and [c["name"] for c in data["cases"]] == ["layout"]
    assert data["options"] == {
        "device": "cpu",
        "kernel": "auto",
        "suite": "quick",
        "cases": ["layout"],
        "threshold": 0.05,
    }
    assert "PASSED" in capsys.readouterr().out


def test_cli_prints_each_case_as_it_starts_and_ends(capsys):
    """Progress on stderr: a full suite on a cold Triton cache compiles for minutes, and its log says in which case."""
    assert main(["validate-kernels", "--device", "cpu", "--case", "layout", "--case", "conv"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("validate-kernels: [")]
    assert [line.split(" in ")[0] for line in err] == [
        "validate-kernels: [1/2] layout ...",
        "validate-kernels: [1/2] layout: pass",
        "validate-kernels: [2/2] conv ...",
        "validate-kernels: [2/2] conv: pass",
    ]


def test_cli_reports_a_refused_route_with_its_fix(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["validate-kernels", "--device", "cpu", "--kernel", "fla", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert not data["ok"] and "kernel: fla" in data["error"] and data["cases"] == []
    assert "no kernel to check" in capsys.readouterr().out


def test_the_fp32_reference_runs_without_tf32_in_matmuls_and_cudnn_convolutions():
    from launcher.checks.kernels.cases import _FullPrecision

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True  # torch's default: cuDNN convolutions in TF32
    try:
        with _FullPrecision(torch):
            assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is True  # put back as it was
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_unknown_case_is_an_error():
    report = kernels.validate("cpu", cases=("nope",))
    assert not report.ok and "nope" in report.error and "layout" in report.error


def test_preflight_kernel_check_runs_the_quick_suite():
    result = kernel_check.check("cpu")
    assert result["ok"], result
    suite = result["validate_kernels"]
    assert suite["ok"] and set(suite["cases"]) == {
        "layout",
        "grouped",
        "varlen",
        "varlen_grouped",
        "decode",
        "conv",
        "conv_varlen",
        "rms_norm",
        "gated_norm",
        "swiglu",
    }
    assert suite["cases"]["varlen"] == "skip" and suite["cases"]["decode"] == "skip"  # preflight: training kernel


def test_preflight_checks_only_the_glue_ops_the_run_binds():
    """An op turned off in launcher.patches.fused_ops is not checked, so a broken kernel can be worked around."""
    suite = kernel_check.check("cpu", glue_ops=("conv",))["validate_kernels"]
    assert suite["ok"] and set(suite["cases"]) == {
        "layout",
        "grouped",
        "varlen",
        "varlen_grouped",
        "decode",
        "conv",
        "conv_varlen",
    }
    assert set(kernel_check.check("cpu", glue_ops=())["validate_kernels"]["cases"]).isdisjoint(
        {"conv", "conv_varlen", "rms_norm", "gated_norm", "swiglu"}
    )


def conv_btd(x, weight, bias=None, activation="silu", seq_idx=None):
    """transformers' conv reading ``[B, D, T]`` as ``[B, T, D]``: the layout error the glue cases must catch."""
    return glue_kernels.torch_ops()["conv"](x.transpose(1, 2).reshape(x.shape), weight, bias, activation)


def test_a_failing_glue_case_in_preflight_names_the_switch_that_turns_its_kernel_off(monkeypatch):
    ops = glue_kernels.torch_ops()

    monkeypatch.setattr(glue_kernels, "select_glue_kernels", lambda backend: ({**ops, "conv": conv_btd}, {}))
    result = kernel_check.check("cpu", glue_ops=("conv", "rms_norm"))
    assert not result["ok"] and result["validate_kernels"]["cases"]["conv"].startswith("fail")
    assert "failed: conv: " in result["error"] and "launcher.patches.fused_ops.conv: false" in result["error"]
    assert "rms_norm" not in result["error"]


def test_preflight_reads_the_glue_ops_from_the_config():
    from types import SimpleNamespace

    from launcher.checks import preflight

    def prepared(patches):
        return SimpleNamespace(config=SimpleNamespace(patches=patches))

    assert preflight._glue_ops(prepared({})) == "conv,rms_norm,gated_norm,swiglu"
    no_swiglu = prepared({"fused_ops": {"enabled": True, "swiglu": False}})
    assert preflight._glue_ops(no_swiglu) == "conv,rms_norm,gated_norm"
    assert preflight._glue_ops(prepared({"fused_ops": {"enabled": False}})) == "none"


def test_preflight_kernel_check_fails_when_the_quick_suite_fails(monkeypatch):
    def failing(backend, **kw):
        report = kernels.Report(backend, backend, "k", 0.05, "quick")
        report.cases.append(kernels.CaseResult("layout", [2, 150, 4, 32], None, "fail", note="out differs by 40%"))
        return report

    monkeypatch.setattr(kernels, "validate", failing)
    result = kernel_check.check("cpu")
    assert not result["ok"] and "layout: out differs by 40%" in result["error"]
    assert kernel_check.check("cpu", suite=False)["ok"]


DECODE = kernels.Case("decode", 1, 12, 4, 16, key_heads=2, prefill=30)


def check_decode(kernel) -> kernels.CaseResult:
    return decode_kernels.check_decode_case(torch, DECODE, kernel, kernels.Device(torch, "cpu"), 0.05)


def test_decode_case_fails_a_recurrent_kernel_that_drops_the_cached_state_or_misscales():
    recurrent = decode_kernels.torch_decode_reference()

    def forgets_state(q, k, v, g, beta, initial_state=None, **kw):
        return recurrent(q, k, v, g=g, beta=beta, initial_state=None, **kw)

    def wrong_scale(*args, **kw):
        out, state = recurrent(*args, **kw)
        return out * 1.1, state

    assert check_decode(recurrent).status == "pass"
    forgot = check_decode(forgets_state)
    assert forgot.status == "fail" and forgot.errors["state"] > 0.3 and "differs" in forgot.note
    scaled = check_decode(wrong_scale)
    assert scaled.status == "fail" and scaled.errors["out"] >= 0.09 and scaled.errors["state"] < 0.02


def test_decode_case_times_routed_vs_torch_per_token():
    case = kernels.Case("decode", 1, 4, 2, 16, prefill=8, timing=True)
    recurrent = decode_kernels.torch_decode_reference()
    result = decode_kernels.check_decode_case(
        torch, case, lambda *a, **k: recurrent(*a, **k), kernels.Device(torch, "cpu"), 0.05, fallback=recurrent
    )
    assert result.status == "pass"
    assert set(result.timing_ms) == {"routed_per_token", "torch_per_token"}


# --- the glue cases (fused_ops's kernels) ---------------------------------------------------------------------


def check_glue(name: str, fn) -> kernels.CaseResult:
    case = next(c for c in kernels.SUITES["quick"] if c.name == name)
    return glue_kernels.check_glue_case(torch, case, fn, kernels.Device(torch, "cpu"), 0.05)


def test_glue_cases_pass_the_torch_ops_in_bf16_with_every_gradient():
    ops = glue_kernels.torch_ops()
    expected = {
        "conv": {"out", "dx", "dweight"},
        "rms_norm": {"out", "dx", "dweight"},
        "gated_norm": {"out", "dx", "dgate", "dweight"},
        "swiglu": {"out", "dgate", "dup"},
    }
    for name, keys in expected.items():
        result = check_glue(name, ops[name])
        assert result.status == "pass", result
        assert set(result.errors) == keys and 0 < result.max_error < 0.01  # bf16 rounding: small, never zero


def test_on_cuda_the_norm_case_checks_flas_norm_at_each_width(monkeypatch):
    """FLA's norm for the hidden norms and the narrow q/k norms alike, its norms tuned once per width, as ``fused_ops``
    binds them on CUDA. A stand-in: no CUDA or FLA here; the FLA kernel and the tuning are recorders."""
    from patches import fused_ops
    from patches.kernels import fused_kernels

    seen, tuned = [], []
    monkeypatch.setattr(fused_ops, "fla_usable", lambda backend: None)
    monkeypatch.setattr(fused_kernels, "tune_by_width", lambda ops: tuned.append(ops) or [])
    monkeypatch.setattr(fused_kernels, "load", lambda op, kernel: f"{kernel}:{op}")
    monkeypatch.setattr(fused_kernels, "rms_norm", lambda name, kernel, x, w, eps: seen.append(x.shape[-1]) or x)
    norm = glue_kernels.select_glue_kernels("cuda")[0]["rms_norm"]
    assert tuned == [("rms_norm", "gated_norm")]
    x, w = torch.randn(2, 3, 5120), torch.zeros(5120)
    assert norm(x, w, 1e-6) is x and seen == [5120]
    x, w = torch.randn(2, 3, 256), torch.zeros(256)
    assert norm(x, w, 1e-6) is x and seen == [5120, 256]


def test_glue_cases_catch_a_conv_read_the_wrong_way_round_and_a_norm_without_its_offset():
    ops = glue_kernels.torch_ops()

    def norm_without_offset(x, weight, eps):  # w instead of 1 + w: the zero-centred weight forgotten
        return ops["rms_norm"](x, weight - 1.0, eps)

    def swiglu_swapped(gate, up):
        return ops["swiglu"](up, gate)

    for name, fn in (("conv", conv_btd), ("rms_norm", norm_without_offset), ("swiglu", swiglu_swapped)):
        result = check_glue(name, fn)
        assert result.status == "fail" and result.max_error > 0.05, (name, result)
        assert "threshold 1%" in result.note or "Error" in result.note


def test_the_packed_conv_case_passes_the_segment_reset_torch_conv_and_fails_one_that_reads_across_samples(
    monkeypatch,
):
    """Off an accelerator the packed-row convolution is ``deltanet.segment_causal_conv``; the case compares it
    with each sample convolved alone in fp32, so the plain row convolution (no reset at a sample start) fails."""
    from patches.packing import deltanet

    ops = glue_kernels.torch_ops()
    result = check_glue("conv_varlen", ops["conv"])
    assert result.status == "pass" and 0 < result.max_error < 0.01, result
    assert set(result.errors) == {"out", "dx", "dweight"} and result.cu_seqlens == [0, 45, 130, 200]

    def no_reset(x, weight, bias, found):
        return ops["conv"](x, weight[:, 0], bias, "silu")

    monkeypatch.setattr(deltanet, "segment_causal_conv", no_reset)
    result = check_glue("conv_varlen", ops["conv"])
    assert result.status == "fail" and result.max_error > 0.05, result


def test_the_packed_conv_case_hands_fla_the_boundaries_and_fails_a_kernel_that_ignores_them(stub_fla):
    """On CUDA and NPU the case calls FLA's convolution through the adapter packed rows use (``FlaConv.varlen``).
    FLA needs an accelerator: here the stand-in ``fla`` (fla-core 0.6.0's contract in plain torch) serves it, and a
    kernel that drops ``cu_seqlens`` (one convolution over the whole row) must fail."""
    from patches.kernels.fused_kernels import FlaConv

    stub_fla(platform="cuda")
    from fla.modules.causal_conv1d import CALLS, causal_conv1d

    result = check_glue("conv_varlen", FlaConv(causal_conv1d))
    assert result.status == "pass" and result.max_error < 0.01, result
    assert CALLS["varlen"] == 1

    def ignores_bounds(x, weight=None, bias=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
        return causal_conv1d(x, weight=weight, bias=bias, activation=activation)

    result = check_glue("conv_varlen", FlaConv(ignores_bounds))
    assert result.status == "fail" and result.max_error > 0.05, result


def test_the_full_suite_has_a_glue_case_per_op_at_the_27b_shapes():
    full = {c.name: c for c in kernels.SUITES["full"] if c.op}
    assert {c.op for c in full.values()} == {"conv", "rms_norm", "gated_norm", "swiglu"}
    assert full["conv_27b"].shape == [1, 4096, 80, 128]  # 2 x 16 x 128 + 48 x 128 channels
    assert full["conv_varlen_27b"].shape == [1, 4096, 80, 128] and sum(full["conv_varlen_27b"].seq_lens) == 4096
    assert full["swiglu_27b"].shape[-1] == 17408 and full["rms_norm_27b"].shape[-1] == 5120
