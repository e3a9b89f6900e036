"""The kernel choice on NPU (``launcher.checks.kernels.choice``): order, fall-through, the torch-fallback rule, records.

There is no NPU here. Every test runs the real validation machinery (``check_case``, ``check_glue_case``: forward
and backward against the fp32 reference) on the CPU, with stand-ins for the NPU kernels: transformers' torch chunk
kernel (and ``tests.support.patch_fixtures.grouped_varlen_kernel``, which takes ``cu_seqlens``) stands in for a
correct FLA or AscendC kernel, and a kernel that reads the layout the wrong way round for a broken one. The shapes
are small (a 96-token "run"), so the cases take seconds.
"""

from __future__ import annotations

import json

import pytest

from launcher.checks.kernels import choice as kernel_choice
from launcher.checks.kernels.choice import choose, run_cases
from launcher.checks.preflight import PreflightReport, kernel_row
from tests.support.patch_fixtures import grouped_varlen_kernel

SHAPES = {"seq_len": 96, "key_heads": 2, "value_heads": 4, "head_dim": 32}


def reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def head_major(q, k, v, g, beta, **kw):
    """A broken stand-in: treats [B, T, H, D] as [B, H, T, D] (a layout bug); its outputs and gradients are wrong."""
    out, state = reference()(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g=g.transpose(1, 2), beta=beta.transpose(1, 2), **kw
    )
    return out.transpose(1, 2), state


def loader(kernel, description: str, calls: list[str] | None = None, name: str = ""):
    def load():
        if calls is not None:
            calls.append(name)
        return kernel, description

    return load


def not_installed():
    raise RuntimeError("fla_npu (flash-linear-attention-npu) is not installed")


def glue(op: str):
    from launcher.checks.kernels.glue import torch_ops

    return torch_ops()[op]


def broken_gated_norm(x, gate, weight, eps):
    """A broken stand-in for FLA's gated norm: forgets the gate's SiLU."""
    xf = x.float()
    return (weight * (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(x.dtype) * gate).to(x.dtype)


def test_every_chunk_case_runs_at_the_runs_heads_and_head_size() -> None:
    """fla_npu's AscendC kernel takes K = 128 only: a case at another head size would refuse it for nothing."""
    shapes = {"seq_len": 4096, "key_heads": 16, "value_heads": 48, "head_dim": 128}
    cases = run_cases(shapes)
    assert {(c.heads, c.dim, c.key_heads or 16) for c in cases["chunk"]} == {(48, 128, 16)}
    assert [c.seq_len for c in cases["chunk"] if c.name.startswith("run")] == [4096, 4096]
    assert {c.op for c in cases["conv"]} == {"conv"} and cases["conv"][-1].shape == [1, 4096, 80, 128]
    assert cases["gated_norm"][-1].shape == [1, 4096, 48, 128]


def test_the_first_candidate_that_passes_wins_and_later_ones_are_not_tried() -> None:
    calls: list[str] = []
    candidates = {
        "chunk": [
            ("fla", loader(grouped_varlen_kernel(), "stand-in fla", calls, "fla")),
            ("ascendc", loader(reference(), "stand-in ascendc", calls, "ascendc")),
            ("torch", loader(reference(), "torch", calls, "torch")),
        ]
    }
    choice = choose("npu", candidates, run_cases(SHAPES), "cpu", SHAPES)
    chunk = choice.components["chunk"]
    assert (chunk.chosen, chunk.description, chunk.refused, calls) == ("fla", "stand-in fla", [], ["fla"])
    assert list(chunk.passed_cases) == [c.name for c in run_cases(SHAPES)["chunk"]]
    assert "run" in chunk.passed_cases and "run_varlen" in chunk.passed_cases  # the run's shapes were checked
    assert all(0 < error < 0.05 for error in chunk.passed_cases.values())  # each case's largest error, kept
    assert chunk.expected_slowdown is None and choice.torch_fallbacks == []


def test_a_failing_first_choice_falls_to_the_second_and_records_the_failing_case() -> None:
    candidates = {
        "chunk": [
            ("fla", loader(head_major, "broken fla")),
            ("ascendc", loader(reference(), "stand-in ascendc")),
            ("torch", loader(reference(), "torch")),
        ],
        "gated_norm": [
            ("fla", loader(broken_gated_norm, "broken fla norm")),
            ("torch", loader(glue("gated_norm"), "torch")),
        ],
    }
    seen = []
    choice = choose("npu", candidates, run_cases(SHAPES), "cpu", SHAPES, on_case=lambda name, r: seen.append(name))
    chunk, norm = choice.components["chunk"], choice.components["gated_norm"]
    assert chunk.chosen == "ascendc" and [r.kernel for r in chunk.refused] == ["fla"]
    assert chunk.refused[0].case == "layout" and "differs by" in chunk.refused[0].note  # the first case it failed
    assert seen[0] == "chunk/fla/layout" and "chunk/fla/grouped" not in seen  # a refused kernel stops at its failure
    assert norm.chosen == "torch" and norm.refused[0].kernel == "fla" and norm.refused[0].case == "gated_norm"
    assert norm.expected_slowdown == kernel_choice.SLOWDOWN["gated_norm"]
    assert choice.torch_fallbacks == ["gated_norm"]


def test_a_candidate_that_does_not_load_is_refused_at_load_and_the_next_one_tried() -> None:
    candidates = {
        "chunk": [
            ("fla", loader(head_major, "broken fla")),
            ("ascendc", not_installed),
            ("torch", loader(reference(), "torch")),
        ]
    }
    record = choose("npu", candidates, run_cases(SHAPES), "cpu", SHAPES).to_dict()
    chunk = record["components"]["chunk"]
    assert chunk["chosen"] == "torch" and chunk["expected_slowdown"].startswith("about 8x the 27B step")
    assert [(r["kernel"], r["case"]) for r in chunk["refused"]] == [("fla", "layout"), ("ascendc", "load")]
    assert "fla_npu (flash-linear-attention-npu) is not installed" in chunk["refused"][1]["note"]
    line = kernel_choice.summary(record)
    assert "chunk torch (fla refused at layout:" in line and "ascendc refused at load:" in line
    assert "[torch fallback: about 8x the 27B step" in line


def _torch_fallback_result() -> dict:
    candidates = {
        "chunk": [
            ("fla", loader(head_major, "broken fla")),
            ("ascendc", not_installed),
            ("torch", loader(reference(), "torch")),
        ]
    }
    record = choose("npu", candidates, run_cases(SHAPES), "cpu", SHAPES).to_dict()
    return {"ok": True, "kernel": "torch", "device": "npu:0", "dtype": "bfloat16", "kernel_choice": record}


def test_a_silent_torch_fallback_on_npu_fails_preflight_unless_the_config_allows_it() -> None:
    result = _torch_fallback_result()
    name, status, detail = kernel_row("npu", result, allow=False)
    assert (name, status) == ("kernel", "fail")
    assert "chunk fell back to torch" in detail and "about 8x the 27B step" in detail
    assert "launcher.patches.deltanet_routing.allow_torch_fallback: true" in detail
    assert "fla refused at layout" in detail  # the failing case of the kernel that was refused
    assert kernel_row("npu", result, allow=True)[1] == "warn"
    chosen = json.loads(json.dumps(result))
    chosen["kernel_choice"]["components"]["chunk"]["chosen"] = "ascendc"
    assert kernel_row("npu", chosen)[1] == "ok"  # not torch: nothing to allow


def test_the_allow_key_is_a_config_option_of_the_routing_patch(tmp_path) -> None:
    from patches.deltanet_routing import Options

    assert Options().allow_torch_fallback is False and Options(allow_torch_fallback=True).allow_torch_fallback
    with pytest.raises(ValueError):
        Options(allow_torch_fallback="yes")  # strict: a typo'd value is refused, not read as true


def test_the_choice_is_recorded_in_preflight_json_and_shown_by_status(tmp_path) -> None:
    from launcher.monitor.status import collect, render
    from tests.support.fake_runs import crafted_run

    record = _torch_fallback_result()["kernel_choice"]
    run_dir = crafted_run(tmp_path, state="FAILED_SETUP", ended="2026-11-30T10:16:00+00:00")
    report = PreflightReport("config.yaml", "npu", kernel_choice=record)
    written = json.loads(report.write(run_dir).read_text())
    assert written["kernel_choice"] == record
    info = collect(run_dir)
    assert info["kernel_choice"] == record
    row = next(line for line in render(info).splitlines() if line.startswith("kernels"))
    assert "chunk torch (fla refused at layout" in row and "[torch fallback: about 8x" in row


def test_the_kernel_check_on_npu_chooses_then_reports_one_row(monkeypatch) -> None:
    """``kernel_check.check`` on a simulated NPU: the device is the CPU and the candidates are stand-ins (a broken
    FLA chunk kernel, a missing fla_npu, torch; a correct FLA convolution and gated norm), as there is no NPU here.
    The child's result carries the choice; the preflight row made from it refuses the torch fallback."""
    from launcher.checks.kernels import check as kernel_check

    candidates = {
        "chunk": [
            ("fla", loader(head_major, "broken fla")),
            ("ascendc", not_installed),
            ("torch", loader(reference(), "transformers torch_chunk_gated_delta_rule")),
        ],
        "conv": [("fla", loader(glue("conv"), "stand-in fla conv")), ("torch", loader(glue("conv"), "t"))],
        "gated_norm": [("fla", loader(glue("gated_norm"), "stand-in fla norm"))],
    }
    monkeypatch.setattr(kernel_check, "device_name", lambda backend: "cpu")
    monkeypatch.setattr(kernel_choice, "npu_candidates", lambda: candidates)
    result = kernel_check.check("npu", "auto", glue_ops=("conv", "gated_norm"), shapes=SHAPES)
    assert result["ok"] is True and result["kernel"] == "transformers torch_chunk_gated_delta_rule", result
    components = result["kernel_choice"]["components"]
    assert {name: c["chosen"] for name, c in components.items()} == {
        "chunk": "torch",
        "conv": "fla",
        "gated_norm": "fla",
    }
    assert json.loads(json.dumps(result)) == result  # the child prints it as one JSON line
    status, detail = kernel_row("npu", result)[1:]
    assert status == "fail" and detail.startswith("kernel choice: chunk torch (fla refused at layout")
    off = kernel_check.check("npu", "auto", glue_ops=(), shapes=SHAPES)  # fused_ops off: only the chunk is chosen
    assert list(off["kernel_choice"]["components"]) == ["chunk"]


def test_the_runs_shapes_come_from_the_model_config_and_cutoff_len(demo_assets) -> None:
    """The demo model's config (tiny, real) against the 27B defaults used when a config cannot be read."""
    from launcher.checks.model import read_config

    text = read_config(demo_assets["model"])["text_config"]
    shapes = kernel_choice.run_shapes(read_config(demo_assets["model"]), 256)
    expected = {
        "key_heads": "linear_num_key_heads",
        "value_heads": "linear_num_value_heads",
        "head_dim": "linear_key_head_dim",
    }
    assert shapes == {"seq_len": 256, **{key: text[field] for key, field in expected.items()}}
    assert kernel_choice.run_shapes(None, 4096) == {
        "seq_len": 4096,
        "key_heads": 16,
        "value_heads": 48,
        "head_dim": 128,
    }


def test_each_rank_gets_the_choice_from_preflight_json_in_its_facts(tmp_path) -> None:
    from launcher.rank.entry import run_facts

    launch = {"facts": {"cutoff_len": 4096, "packing": False}}
    assert run_facts(tmp_path, launch) == launch["facts"]  # no preflight.json (the kernel row skipped): no choice
    record = _torch_fallback_result()["kernel_choice"]
    PreflightReport("config.yaml", "npu", kernel_choice=record).write(tmp_path)
    assert run_facts(tmp_path, launch) == {**launch["facts"], "kernel_choice": record}
    (tmp_path / "preflight.json").write_text("{ damaged")
    assert run_facts(tmp_path, launch) == launch["facts"]
