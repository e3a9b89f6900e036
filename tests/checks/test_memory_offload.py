"""The memory forecast with ``checkpoint_all_layers.offload_inputs``: its terms both ways, ``auto``'s decision, the
host's memory, the lengths ``check --device-memory`` lists, the budget plan beside it, and preflight's decision
reaching the ranks. Figures at the 27B shape, LoRA r8 q/k/v/o, batch 1, every layer checkpointed, chunked loss."""

from __future__ import annotations

import json
import re

import pytest

from launcher.checks import memory
from tests.checks.test_memory_forecast import _config, model_27b  # noqa: F401  (a fixture)
from tests.support.common import make_config
from tests.support.fake_runs import launcher

H100 = 79.1  # GiB an 80 GB H100 reports
INPUT_64K = 65536 * 5120 * 2 / memory.GIB  # one layer's input at 65,536 tokens: 0.625 GiB


def _run(model, tmp_path, offload, cutoff=65536, device_gib=H100, host=None, **settings):
    settings.setdefault("patches", {}).setdefault("checkpoint_all_layers", {})["offload_inputs"] = offload
    config = _config(model, tmp_path, cutoff_len=cutoff, **settings)
    return memory.forecast_run(config, config.llamafactory, device_gib, host, lengths=device_gib is not None)


def test_offloaded_the_device_keeps_two_inputs_and_the_host_all_the_others(model_27b, tmp_path):  # noqa: F811
    on = _run(model_27b, tmp_path, True)
    off = on.other
    assert not off.offloaded and on.offloaded
    assert off.terms["checkpointed inputs"] == pytest.approx(64 * INPUT_64K)  # 40 GiB: the figure
    assert on.terms["checkpointed inputs"] == pytest.approx(memory.OFFLOAD_IN_FLIGHT * INPUT_64K)
    assert on.host_gib == pytest.approx(64 * 0.625)  # 640 MiB: ten whole chunks, nothing rounded
    assert off.peak - on.peak == pytest.approx(62 * INPUT_64K)
    assert off.verdict == "will not fit" and on.verdict in ("fits", "tight")
    record = on.to_dict()["offload_inputs"]
    assert record["setting"] is True and record["with"]["host_gib_per_node"] == 40.0
    assert record["without"]["terms_gib"]["checkpointed inputs"] == 40.0


def test_auto_turns_it_on_only_where_the_run_needs_it_and_fits_with_it(model_27b, tmp_path):  # noqa: F811
    needs = _run(model_27b, tmp_path, "auto")
    assert needs.offloaded and needs.offload["on"] is True and "will not fit" in needs.offload["reason"]
    short = _run(model_27b, tmp_path, "auto", cutoff=4096)
    assert not short.offloaded and short.offload["on"] is False and "fits without it" in short.offload["reason"]
    too_long = _run(model_27b, tmp_path, "auto", cutoff=262144)
    assert not too_long.offloaded and "would not fit with it either" in too_long.offload["reason"]
    unknown = _run(model_27b, tmp_path, "auto", device_gib=None)
    assert not unknown.offloaded and "not known" in unknown.offload["reason"]
    cpu = _run(model_27b, tmp_path, "auto", backend="cpu")
    assert not cpu.offloaded and "cpu" in cpu.offload["reason"]
    hostless = _run(model_27b, tmp_path, "auto", host=16.0)
    assert not hostless.offloaded and "16.0 GiB free" in hostless.offload["reason"]
    never = _run(model_27b, tmp_path, False)
    assert not never.offloaded and never.other is None and never.offload == {}


def test_the_host_memory_counts_every_rank_of_the_node_and_the_pinned_rounding(model_27b, tmp_path):  # noqa: F811
    two = _run(model_27b, tmp_path, True, ranks=2, distribution="fsdp2")
    assert two.host_gib == pytest.approx(2 * 64 * 0.625)
    odd = _run(model_27b, tmp_path, True, cutoff=5000)  # 48.8 MiB an input: one chunk, rounded up to 64 MiB
    assert odd.host_gib == pytest.approx(64 * 64 / 1024)


def test_a_budget_plan_beside_offload_pays_for_the_inputs_it_keeps_on_the_device(model_27b, tmp_path):  # noqa: F811
    patches = {"checkpoint_all_layers": {"memory_budget_gib": 76.0}}
    on = _run(model_27b, tmp_path, True, cutoff=16384, patches=patches)
    kept = sum(int(n) for n in re.findall(r"(\d+) (?:linear|full)", on.notes[0]))
    assert kept > 0 and on.terms["un-checkpointed layers"] > 0
    one_input = 16384 * 5120 * 2 / memory.GIB
    assert on.terms["checkpointed inputs"] == pytest.approx((2 + kept) * one_input)
    assert on.host_gib == pytest.approx((64 - kept) * one_input)
    assert on.peak <= 76.0 + 1e-6


def test_check_memory_fails_when_the_host_cannot_hold_the_offloaded_inputs(model_27b, tmp_path, monkeypatch):  # noqa: F811
    config = _config(model_27b, tmp_path, cutoff_len=65536, patches={"checkpoint_all_layers": {"offload_inputs": True}})
    monkeypatch.setattr(memory, "host_free_gib", lambda: 12.0)
    status, line = memory.check_memory(config, config.llamafactory, "cuda", H100)
    assert status == "fail" and "only 12.0 GiB available" in line and "40.00 GiB of pinned" in line
    monkeypatch.setattr(memory, "host_free_gib", lambda: 500.0)
    found = {}
    status, line = memory.check_memory(config, config.llamafactory, "cuda", H100, out=found)
    assert status != "fail" and "500.0 GiB of host memory available" in line
    assert found["offload_inputs"]["on"] is True
    monkeypatch.setattr(memory, "host_free_gib", lambda: 12.0)
    # `check --for-another-machine`: this host's memory says nothing of the run's
    assert memory.check_memory(config, config.llamafactory, "cuda", H100, host=False)[0] != "fail"


def test_the_lengths_that_fit_an_h100_with_and_without_offload(model_27b, tmp_path):  # noqa: F811
    found = _run(model_27b, tmp_path, "auto", cutoff=4096).lengths
    assert max(found["without"]) == 16384 and 32768 not in found["without"] + found["without_tight"]
    assert max(found["with"] + found["with_tight"]) == 65536
    none = _run(model_27b, tmp_path, False, cutoff=4096).lengths
    assert none["with"] == [] and none["with_tight"] == []


def test_check_with_device_memory_lists_the_lengths_that_fit(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets)
    shown = launcher("check", cfg, "--device-memory", "64")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    (line,) = [ln for ln in shown.stdout.splitlines() if "memory:" in ln]
    assert "cutoff_len that fits 64.0 GiB: up to 262,144 tokens without offload_inputs" in line, line


def test_preflights_decision_reaches_the_ranks_facts(tmp_path):
    from launcher.rank.entry import run_facts
    from launcher.state.runs import PREFLIGHT_FILE

    decision = {"setting": "auto", "on": True, "reason": "auto: 115.9 GiB without it"}
    (tmp_path / PREFLIGHT_FILE).write_text(json.dumps({"ok": True, "offload_inputs": decision}))
    assert run_facts(tmp_path, {"facts": {"cutoff_len": 65536}})["offload_inputs"] == decision
    (tmp_path / PREFLIGHT_FILE).write_text(json.dumps({"ok": True, "offload_inputs": None}))
    assert "offload_inputs" not in run_facts(tmp_path, {"facts": {}})


def test_offload_true_without_checkpointing_is_refused():
    from launcher.checks.patch_check import patch_problems

    ckpt = {"checkpoint_all_layers": {"enabled": True, "offload_inputs": True}}
    problems = patch_problems(ckpt, {"gradient_checkpointing": False}, backend="cuda")
    assert [key for key, _ in problems] == ["launcher.patches.checkpoint_all_layers.offload_inputs"]
    assert patch_problems(ckpt, {"gradient_checkpointing": True}, backend="cuda") == []
