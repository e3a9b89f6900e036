"""`launcher profile` on CPU with the tiny model: real runs through the supervisor, the real torch profiler.

A planted sleep in one rank's collator (``tests/support/slow_rank_entry.py``) must show as data loading on that rank
and as a spread of work across the two ranks; the parts of every rank must add up to its measured step.
A planted stand-in Triton compile must show in the first step (before the profiled window, on the host's
clock) and, in a profiled step, as kernel compile / autotune. The split itself is also checked on known
intervals.
"""

from __future__ import annotations

import json

import pytest

from launcher.rank.profiling import TritonClock, kernel_part, split_step
from launcher.results.profile_report import first_step_summary, rank_summary, render
from tests.support.common import launcher_cmd, make_config


def test_the_split_of_a_step_on_known_intervals():
    work = [("matmul", 0.0, 1.0), ("communication", 0.5, 1.5), ("deltanet", 2.0, 3.0)]
    host = {"data_loading": [(3.0, 3.6)], "optimizer_host": [(3.5, 3.8)], "compile_autotune": [(1.5, 1.7)]}
    parts = split_step((0.0, 4.0), work, host)
    assert parts["matmul"] == 1.0 and parts["communication"] == 1.0 and parts["deltanet"] == 1.0
    assert parts["overlap"] == pytest.approx(0.5)  # matmul and communication side by side
    assert parts["compile_autotune"] == pytest.approx(0.2) and parts["data_loading"] == pytest.approx(0.6)
    assert parts["optimizer_host"] == pytest.approx(0.2)  # 3.6-3.8; 3.5-3.6 was already data loading
    assert parts["host_gaps"] == pytest.approx(4.0 - 2.5 - 0.2 - 0.6 - 0.2)
    summary = rank_summary(
        {
            "rank": 0,
            "profiled_steps": [{**parts, "seconds": 4.0}],
            "periods": [{"seconds": 9.0}, {"seconds": 4.2, "profiled": True}],
        }
    )
    assert summary["accounted_s"] == pytest.approx(4.0) and summary["adds_up"]  # 4.0 of 4.2: within 10 %
    assert "within 10%" in render({"ranks": [summary]})
    assert summary["first_step"]["seconds"] == 9.0 and summary["first_step"]["excess_over_profiled_s"] == 4.8


def test_the_first_step_against_the_warmup_and_the_profiled_steps():
    periods = [
        {"step": 1, "seconds": 12.0, "profiled": False, "compile_autotune_s": 9.0, "compiles": 40, "autotunes": 6},
        {"step": 2, "seconds": 1.6, "profiled": False, "compile_autotune_s": 0.0, "compiles": 0, "autotunes": 0},
    ]
    periods += [
        {"step": n, "seconds": s, "profiled": True, "compile_autotune_s": 0.0}
        for n, s in ((3, 2.0), (4, 1.8), (5, 2.2))
    ]
    first = first_step_summary(periods)
    assert first["seconds"] == 12.0 and first["compile_autotune_s"] == 9.0 and first["compiles"] == 40
    assert first["warmup_after"] == {"steps": 1, "median_s": 1.6, "compile_autotune_median_s": 0.0}
    assert first["profiled_steps"]["median_s"] == 2.0 and first["excess_over_profiled_s"] == 10.0
    assert first["compile_share_of_excess"] == 0.9
    rank = {
        "rank": 0,
        "profiled_steps": 3,
        "parts_s": {},
        "accounted_s": 2.0,
        "step_s": 2.0,
        "accounted_share": 1.0,
        "adds_up": True,
        "seq_lens": [],
        "first_step": first,
    }
    table = render({"ranks": [rank]})
    assert "| **first step minus the profiled median** | 10.000 |" in table and "| 40 / 6 |" in table
    assert "| kernel compile / autotune in the first step | 9.000 |" in table and "90%" in table
    assert first_step_summary([]) is None


def test_the_triton_clock_counts_nested_calls_once():
    clock = TritonClock()
    with clock.timing("autotunes"), clock.timing("compiles"), clock.timing("compiles"):  # compile in _do_compile
        pass
    with clock.timing("compiles"):
        pass
    totals = clock.read()
    assert totals["compiles"] == 2 and totals["autotunes"] == 1
    assert 0 < totals["compile_autotune_s"] < 1


def test_a_device_profile_counts_kernels_not_the_ranges_mirrored_onto_the_device():
    """The torch profiler's events on CUDA, stood in by plain objects (no GPU here): the step and ``deltanet::``
    ranges exist on the CPU and again as device user annotations; only kernels count as device work, a kernel
    inside a device ``deltanet::`` range is DeltaNet, and cuBLASLt's Hopper kernels (``nvjet``) are matmul."""
    from types import SimpleNamespace

    from launcher.rank.profiling import summarize_profiler

    def event(name, start, end, device="CPU", annotation=False, parent=None, kernels=(), shapes=()):
        return SimpleNamespace(
            name=name,
            time_range=SimpleNamespace(start=start * 1e6, end=end * 1e6),
            device_type=f"DeviceType.{device}",
            is_user_annotation=annotation,
            cpu_parent=parent,
            kernels=[SimpleNamespace(name=n, duration=us) for n, us in kernels],
            input_shapes=list(shapes),
        )

    step = event("ProfilerStep#3", 0.0, 1.0)
    deltanet = event("deltanet::fla", 0.1, 0.3, parent=step)
    backward = event("autograd::engine::evaluate_function: ToCopyBackward0", 0.75, 0.8, parent=step)
    gathers = [
        event(f"FSDP::pre_forward (model.layers.{n})", 0.6 + n / 100, 0.61 + n / 100, parent=step) for n in (3, 12)
    ]
    to_copy = event("aten::_to_copy", 0.75, 0.8, parent=backward)
    events = [
        step,
        event("ProfilerStep#3", 0.0, 1.0, "CUDA", True),
        deltanet,
        event("deltanet::fla", 0.1, 0.3, "CUDA", True),
        event("aten::copy_", 0.15, 0.16, parent=deltanet, kernels=[("elementwise_kernel", 5e4)]),
        backward,
        to_copy,
        event(
            "aten::copy_",
            0.76,
            0.77,
            parent=to_copy,
            kernels=[("elementwise_kernel", 6e4)],
            shapes=[[1, 4096, 5120], [1, 4096, 5120], []],
        ),
        *gathers,
        *[
            event(
                "aten::copy_",
                g.time_range.start / 1e6,
                g.time_range.end / 1e6,
                parent=g,
                kernels=[("elementwise_kernel", 2e4)],
            )
            for g in gathers
        ],
        # a runtime call that torch gave the same kernel (a shared correlation id): not a second launcher
        event("cudaStreamIsCapturing", 0.61, 0.612, parent=gathers[0], kernels=[("elementwise_kernel", 2e4)]),
        event("chunk_fwd_kernel_o", 0.1, 0.2, "CUDA"),
        event("elementwise_kernel", 0.2, 0.3, "CUDA"),
        event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 0.3, 0.8, "CUDA"),
        event("elementwise_kernel", 0.8, 0.9, "CUDA"),
    ]
    summary = summarize_profiler(SimpleNamespace(events=lambda: events), "cuda", 2, 1)
    steps = summary["profiled_steps"]
    assert len(steps) == 1
    # the kernel inside the deltanet:: range is DeltaNet, not other compute; the other one is listed with the
    # operators that launched it outside DeltaNet (the copy launched inside the deltanet:: range is not named)
    chain = (
        "aten::copy_ < aten::_to_copy < autograd::engine::evaluate_function: ToCopyBackward0 "
        "[[1, 4096, 5120], [1, 4096, 5120]]"
    )
    assert summary["other_compute_top"] == [
        {
            "kernel": "elementwise_kernel",
            "ms_per_step": 100.0,
            "launched_by": [
                {"ops": chain, "ms_per_step": 60.0},
                {"ops": "aten::copy_ < FSDP::pre_forward (model.layers.N)", "ms_per_step": 40.0},
            ],
        }
    ]
    top = summary["other_compute_top"][0]  # the chains share out the kernel's time, never more
    assert sum(c["ms_per_step"] for c in top["launched_by"]) <= top["ms_per_step"]
    table = render(
        {
            "ranks": [
                {
                    "rank": 0,
                    "profiled_steps": 1,
                    "parts_s": {},
                    "accounted_s": 1.0,
                    "step_s": 1.0,
                    "accounted_share": 1.0,
                    "adds_up": True,
                    "seq_lens": [],
                    "other_compute_top": summary["other_compute_top"],
                }
            ]
        }
    )
    assert f"  - 60.0 ms launched by `{chain}`" in table
    parts = steps[0]
    assert parts["deltanet"] == pytest.approx(0.2) and parts["matmul"] == pytest.approx(0.5)
    assert parts["other_compute"] == pytest.approx(0.1) and parts["host_gaps"] == pytest.approx(0.2)
    assert parts["overlap"] == pytest.approx(0.0, abs=1e-9)


def test_kernel_names_go_to_their_parts():
    assert kernel_part("chunk_gated_delta_rule_fwd_kernel_h") == "deltanet"
    assert kernel_part("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kernel_part("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kernel_part("pytorch_flash::flash_fwd_kernel") == "attention"
    assert kernel_part("multi_tensor_apply_kernel") == "optimizer"
    assert kernel_part("elementwise_kernel") == "other_compute"
    assert kernel_part("causal_conv1d_fwd_kernel") == kernel_part("swiglu_fwdbwd_kernel") == "glue"
    assert kernel_part("layer_norm_gated_fwd_kernel") == kernel_part("conv_depthwise2d_forward_kernel") == "glue"


@pytest.mark.slow
def test_profile_of_two_ranks_with_a_slow_collator_and_planted_compiles(tmp_path, demo_assets, monkeypatch):
    pytest.importorskip("triton")  # the stand-in compile replaces Triton's JITFunction._do_compile
    monkeypatch.setenv("SLOW_DATA", json.dumps({"rank": 1, "seconds": 0.5}))
    compiles = [{"step": 1, "seconds": 0.6}, {"step": 2, "seconds": 0.3, "rank": 1}]  # step 1: warm-up; 2: profiled
    monkeypatch.setenv("SLOW_COMPILE", json.dumps(compiles))
    cfg = make_config(tmp_path, demo_assets, launcher={"entry": "tests.support.slow_rank_entry", "nproc_per_node": 2})
    proc = launcher_cmd("profile", cfg, "--steps", "2", "--warmup", "1", "--quiet")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert run_dir.name.startswith("demo-cpu-profile-")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "SUCCEEDED"
    report = json.loads((run_dir / "profile.json").read_text())
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert set(ranks) == {0, 1} and all(r["profiled_steps"] == 2 for r in ranks.values())
    for r in ranks.values():
        assert r["adds_up"], r  # the parts against the step measured on the rank's own clock
        assert r["parts_s"]["deltanet"] > 0 and r["parts_s"]["matmul"] > 0 and r["seq_lens"]
    assert ranks[1]["parts_s"]["data_loading"] >= 0.45  # the planted 0.5 s
    assert ranks[0]["parts_s"]["data_loading"] < 0.25
    assert ranks[0]["parts_s"]["communication"] > ranks[1]["parts_s"]["communication"]  # rank 0 waits
    assert report["spread_across_ranks"]["spread_s"] >= 0.3
    for r in ranks.values():  # step 1 is the warm-up: the profiler saw nothing, the host's clock did
        first = r["first_step"]
        assert first["step"] == 1 and not first["profiled"] and first["compiles"] == 1
        assert 0.55 <= first["compile_autotune_s"] < 0.9 and first["seconds"] >= first["compile_autotune_s"]
        # how much slower the first step is than the profiled ones depends on the machine's load and on the
        # profiler's own overhead; what the planted compile must show is its own time, measured above
        assert "excess_over_profiled_s" in first and first["profiled_steps"]["steps"] == 2
    assert ranks[1]["parts_s"]["compile_autotune"] == pytest.approx(0.15, abs=0.05)  # 0.3 s in one of 2 steps
    assert ranks[0]["parts_s"]["compile_autotune"] < 0.02
    assert (run_dir / "profile" / "rank0.trace.json").is_file() and (run_dir / "profile.md").is_file()
    table = (run_dir / "profile.md").read_text()
    assert "the faster ranks wait" in table and "| **first step minus the profiled median** |" in table
    assert f"profile: {run_dir / 'profile.md'} (2 rank(s))" in proc.stdout


def test_bad_profile_arguments_are_refused(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets)
    proc = launcher_cmd("profile", cfg, "--steps", "0")
    assert proc.returncode == 2 and "profile at least 1 step" in proc.stderr
    assert not (tmp_path / "runs").exists() or not [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]


def test_the_largest_other_compute_kernels_are_listed_under_the_table():
    from launcher.results.profile_report import render

    rank = {
        "rank": 0,
        "profiled_steps": 3,
        "parts_s": {"other_compute": 0.3},
        "accounted_s": 1.0,
        "step_s": 1.0,
        "accounted_share": 1.0,
        "adds_up": True,
        "seq_lens": [4096],
        "first_step": None,
        "other_compute_top": [{"kernel": "direct_copy_kernel_cuda", "ms_per_step": 57.25}],
    }
    text = render({"ranks": [rank]})
    assert "Largest kernels in other compute, rank 0" in text and "- 57.2 ms `direct_copy_kernel_cuda`" in text


def test_damaged_rank_profiles_are_left_out_of_the_report_not_a_traceback(tmp_path):
    """A rank record that is not JSON, too deep, not a mapping or wrong-typed leaves that rank out; the good
    rank's summary stays."""
    from launcher.results.profile_report import build_report

    folder = tmp_path / "profile"
    folder.mkdir()
    good = {"rank": 0, "profiled_steps": [{"data": 0.1}], "periods": [{"step": 1, "seconds": 1.0, "profiled": True}]}
    (folder / "rank0.json").write_text(json.dumps(good))
    (folder / "rank1.json").write_text("{not json")
    (folder / "rank2.json").write_text("[" * 5000 + "]" * 5000)
    (folder / "rank3.json").write_text("[1, 2]")
    (folder / "rank4.json").write_text(json.dumps({"rank": 4, "profiled_steps": "x", "periods": 5}))
    report = build_report(tmp_path)
    assert [r["rank"] for r in report["ranks"]] == [0]
