"""DeltaNet routing: the kernel chosen per backend, the record of the first call, the device check.

There is no NPU or GPU here. NPU and CUDA are covered at two levels: ``select_route`` (pure logic, fed
with the facts an FLA probe would return) and a stub ``fla`` package (see ``patch_fixtures.stub_fla``)
that lets the real probe and the real install run on CPU. CPU is covered for real, with a tiny model.
"""

from __future__ import annotations

import pytest

import patches
from patches import deltanet_routing
from patches.core.errors import PatchError
from patches.core.proof import read_proof
from patches.deltanet_routing import select_route
from patches.kernels.fla_probe import FlaFacts
from patches.kernels.recorder import CallLog, KernelRecorder

pytest_plugins = ["tests.support.patch_fixtures"]

FLA_OK = {"npu": FlaFacts(True, "0.6.0", platform="npu"), "cuda": FlaFacts(True, "0.6.0", platform="cuda")}
NO_FLA = FlaFacts(installed=False)
HOPPER = FlaFacts(True, "0.6.0", platform="cuda", refusal="fla-core 0.6.0 refuses ... (FLA issue #640)")


@pytest.mark.parametrize(
    ("backend", "kernel", "fla", "expected"),
    [
        ("cpu", "auto", NO_FLA, ("torch", "torch", "torch")),
        ("cpu", "torch", NO_FLA, ("torch", "torch", "torch")),
        ("npu", "auto", FLA_OK["npu"], ("fla", "fla", "torch")),
        ("npu", "fla", FLA_OK["npu"], ("fla", "fla", "torch")),
        ("npu", "torch", FLA_OK["npu"], ("torch", "torch", "torch")),
        ("cuda", "auto", FLA_OK["cuda"], ("fla", "fla", "upstream")),
        ("cuda", "auto", NO_FLA, ("torch", "torch", "torch")),
        ("cuda", "torch", HOPPER, ("torch", "torch", "torch")),
    ],
)
def test_route_per_backend(backend, kernel, fla, expected):
    route = select_route(backend, kernel, fla)
    assert (route.kernel, route.recurrent, route.conv) == expected


@pytest.mark.parametrize(
    ("backend", "kernel", "fla", "fragment"),
    [
        ("cpu", "fla", NO_FLA, "kernel: fla was requested on backend cpu"),
        ("npu", "auto", NO_FLA, "kernel: auto on backend npu needs FLA, which is not installed"),
        ("cuda", "fla", NO_FLA, "kernel: fla on backend cuda needs FLA, which is not installed"),
        ("npu", "auto", FlaFacts(True, "0.6.0", platform="cuda"), "FLA's Triton backend is 'cuda'"),
        ("npu", "auto", FlaFacts(True, "0.5.2", platform="npu"), "fla-core) 0.5.2 is installed"),
        ("cuda", "auto", FlaFacts(True, "0.6.0", import_error="ImportError: libcuda"), "does not import"),
        ("cuda", "auto", HOPPER, "refuses ... (FLA issue #640)"),
    ],
)
def test_unusable_kernel_is_refused_with_the_torch_escape_hatch(backend, kernel, fla, fragment):
    with pytest.raises(PatchError) as info:
        select_route(backend, kernel, fla)
    assert fragment in str(info.value)
    if kernel != "fla" or backend != "cpu":
        assert "deltanet_routing.kernel: torch" in str(info.value)


def test_hopper_guard_worked_around_by_an_fla_backend_keeps_fla():
    facts = FlaFacts(True, "0.6.0", platform="cuda", refusal=HOPPER.refusal, workaround="tilelang")
    route = select_route("cuda", "auto", facts)
    assert route.kernel == "fla"
    assert "avoided by its tilelang backend" in route.reason


@pytest.mark.usefixtures("restore_patches")
def test_cpu_run_routes_to_the_torch_reference_and_records_the_first_call(tmp_path, make_tiny_model):
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    for module in (m, moe):
        assert isinstance(module.chunk_gated_delta_rule, KernelRecorder)
        assert module.chunk_gated_delta_rule.kernel is module.torch_chunk_gated_delta_rule
        assert module.FusedRMSNormGated is None
    model = make_tiny_model()
    deltanet = model.model.layers[0].linear_attn
    assert deltanet.chunk_gated_delta_rule is m.chunk_gated_delta_rule
    assert type(deltanet.norm) is m.Qwen3_5RMSNormGated
    assert "first_call" not in read_proof(tmp_path, "deltanet_routing")

    model(input_ids=torch.randint(1, 64, (3, 7)))

    record = read_proof(tmp_path, "deltanet_routing")
    assert record["route"]["kernel"] == "torch"
    call = record["first_call"]
    assert call["kernel"] == "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"
    assert (call["device"], call["dtype"], call["layout"]) == ("cpu", "torch.float32", "[B, T, H, D]")
    assert call["shape"] == [3, 7, 2, 16]  # B=3, T=7, H=linear_num_value_heads (q repeated), D=key dim
    assert call["value_shape"] == [3, 7, 2, 16]


def test_a_call_off_the_expected_device_fails_loudly():
    import torch

    calls = []
    recorder = KernelRecorder(
        lambda *a, **k: calls.append(1),
        label="fla",
        expected_device="npu",
        log=CallLog(calls.append),
        patch="deltanet_routing",
        backend="npu",
    )
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(PatchError, match="received query on cpu, but this run's backend is npu"):
        recorder(q, q, q, g=torch.zeros(1, 4, 2), beta=torch.zeros(1, 4, 2))
    assert calls == []  # neither recorded nor run


@pytest.mark.usefixtures("restore_patches")
def test_apply_is_idempotent_and_restore_gives_upstream_back(tmp_path):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = {name: getattr(m, name) for name in deltanet_routing.ROUTED_GLOBALS}
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert m.chunk_gated_delta_rule.kernel is m.torch_chunk_gated_delta_rule  # not a recorder of a recorder
    deltanet_routing.restore()
    assert {name: getattr(m, name) for name in deltanet_routing.ROUTED_GLOBALS} == before


@pytest.mark.usefixtures("restore_patches")
def test_disabled_routing_leaves_upstream_untouched_and_records_its_choice(tmp_path):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    patches.apply_enabled({"deltanet_routing": {"kernel": "torch"}}, backend="cpu", proof_dir=tmp_path)
    patches.apply_enabled({"deltanet_routing": False}, backend="cpu", proof_dir=tmp_path)
    assert m.chunk_gated_delta_rule is None  # transformers' own value without FLA/CUDA
    record = read_proof(tmp_path, "deltanet_routing")
    assert (record["enabled"], record["status"]) == (False, "disabled")
    assert record["upstream"]["chunk_gated_delta_rule"].endswith("modeling_qwen3_5.torch_chunk_gated_delta_rule")


@pytest.mark.usefixtures("restore_patches")
def test_a_model_built_before_the_patch_fails_at_the_first_training_step(tmp_path, make_tiny_model):
    model = make_tiny_model()
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    with pytest.raises(
        PatchError,
        match="1 of 1 DeltaNet layers are bound to .*torch_chunk_gated_delta_rule "
        "instead of the routed kernel: the model was built before",
    ):
        deltanet_routing._before_first_step(None, model)
    assert read_proof(tmp_path, "deltanet_routing")["status"] == "failed"


@pytest.mark.usefixtures("restore_patches")
def test_simulated_npu_routes_to_fla_with_torch_conv_and_norm_and_checks_the_device(
    tmp_path, make_tiny_model, stub_fla
):
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    stub_fla(platform="npu")
    patches.apply_enabled({"fused_ops": False}, backend="npu", proof_dir=tmp_path)  # the routing's own choice
    record = read_proof(tmp_path, "deltanet_routing")
    assert record["fla"] == {
        "installed": True,
        "version": "0.6.0",
        "import_error": None,
        "platform": "npu",
        "refusal": None,
        "workaround": None,
    }
    assert record["route"]["chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule (recorded)"
    assert record["route"]["rms_norm_gated"].endswith("Qwen3_5RMSNormGated")
    assert record["route"]["causal_conv1d"] == "torch.nn.Conv1d (transformers fallback)"
    assert (m.FusedRMSNormGated, m.causal_conv1d_fn, m.is_fast_path_available) == (None, None, True)

    model = make_tiny_model()  # the torch norm is built: FLA's fused norm would call torch.cuda here
    assert type(model.model.layers[0].linear_attn.norm) is m.Qwen3_5RMSNormGated
    with pytest.raises(PatchError, match="received query on cpu, but this run's backend is npu"):
        model(input_ids=torch.randint(1, 64, (1, 5)))


@pytest.mark.usefixtures("restore_patches")
def test_simulated_hopper_guard_stops_before_the_model_is_built(tmp_path, stub_fla, monkeypatch):
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    stub_fla(platform="cuda", hopper=True, above_3_4_0=True, above_3_7_1=False)
    with pytest.raises(PatchError) as info:
        patches.apply_enabled({}, backend="cuda", proof_dir=tmp_path)
    message = str(info.value)
    assert "fla-core 0.6.0 refuses the gated-delta-rule backward on this Hopper GPU" in message
    assert "rejects Triton >= 3.4.0 and < 3.7.1 on Hopper" in message
    assert "Fix: use a Triton that FLA accepts (>= 3.7.1" in message
    assert "set launcher.patches.deltanet_routing.kernel: torch" in message

    patches.apply_enabled({"deltanet_routing": {"kernel": "torch"}}, backend="cuda", proof_dir=tmp_path)
    record = read_proof(tmp_path, "deltanet_routing")
    assert record["route"]["kernel"] == "torch"
    assert record["route"]["reason"].startswith("the config chose kernel: torch; FLA would have refused: fla-core")


@pytest.mark.usefixtures("restore_patches")
def test_simulated_cuda_without_the_guard_routes_everything_to_fla(tmp_path, stub_fla):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    stub_fla(platform="cuda", hopper=True, above_3_4_0=True, above_3_7_1=True)
    patches.apply_enabled({}, backend="cuda", proof_dir=tmp_path)
    assert m.chunk_gated_delta_rule.kernel.__module__ == "fla.ops.gated_delta_rule"
    assert m.FusedRMSNormGated is None  # transformers' gated norm module; fused_ops fuses its forward
    assert m.causal_conv1d_fn.kernel.__module__ == "fla.modules.causal_conv1d"
    assert m.fused_recurrent_gated_delta_rule.kernel.__module__ == "fla.ops.gated_delta_rule"
    assert m.chunk_gated_delta_rule.expected_device == "cuda"


@pytest.mark.usefixtures("restore_patches")
def test_greedy_decoding_goes_through_the_recorded_recurrent_kernel(tmp_path, make_tiny_model):
    """The prompt runs the chunk kernel, each later token the recurrent one; both first calls are recorded."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert isinstance(m.fused_recurrent_gated_delta_rule, KernelRecorder)
    assert m.fused_recurrent_gated_delta_rule.kernel is m.torch_recurrent_gated_delta_rule
    model = make_tiny_model().eval()
    assert model.model.layers[0].linear_attn.recurrent_gated_delta_rule is m.fused_recurrent_gated_delta_rule
    with torch.no_grad():
        model.generate(input_ids=torch.randint(1, 64, (1, 6)), max_new_tokens=3, do_sample=False)

    record = read_proof(tmp_path, "deltanet_routing")
    assert record["route"]["recurrent_gated_delta_rule"].endswith("torch_recurrent_gated_delta_rule (recorded)")
    assert record["first_call"]["shape"][1] == 6  # the prompt: the chunk kernel
    decode = record["first_decode_call"]
    assert decode["role"] == "recurrent_gated_delta_rule" and decode["shape"][1] == 1  # one new token
    assert decode["kernel"].endswith("torch_recurrent_gated_delta_rule") and not decode["grad_enabled"]


@pytest.mark.usefixtures("restore_patches")
def test_simulated_npu_decodes_with_fla_recurrent(tmp_path, stub_fla):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    stub_fla(platform="npu")
    patches.apply_enabled({}, backend="npu", proof_dir=tmp_path)
    recurrent = m.fused_recurrent_gated_delta_rule
    assert recurrent.kernel.__module__ == "fla.ops.gated_delta_rule" and recurrent.expected_device == "npu"
    route = read_proof(tmp_path, "deltanet_routing")["route"]
    assert route["recurrent"] == "fla"
    assert route["recurrent_gated_delta_rule"] == "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule (recorded)"


def _choice(chunk: str, conv: str = "fla", gated_norm: str = "fla") -> dict:
    """A ``launcher.checks.kernels.choice`` record as preflight writes it into preflight.json (each refusal with its
    failing case)."""
    refused = {
        "ascendc": [{"kernel": "fla", "case": "layout", "note": "dg differs by 40.00% (threshold 5%)"}],
        "torch": [
            {"kernel": "fla", "case": "layout", "note": "dg differs by 40.00% (threshold 5%)"},
            {"kernel": "ascendc", "case": "load", "note": "RuntimeError: fla_npu is not installed"},
        ],
        "fla": [],
    }
    component = {
        name: {
            "component": name,
            "chosen": kernel,
            "refused": refused[kernel] if name == "chunk" else ([] if kernel == "fla" else refused["ascendc"]),
            "passed_cases": [],
            "description": "",
            "expected_slowdown": None,
        }
        for name, kernel in (("chunk", chunk), ("conv", conv), ("gated_norm", gated_norm))
    }
    return {"backend": "npu", "shapes": {"seq_len": 4096}, "components": component}


@pytest.mark.usefixtures("restore_patches")
def test_simulated_npu_binds_the_ascendc_kernel_preflight_chose_and_records_the_choice(tmp_path, stub_fla):
    """Stand-ins: ``stub_fla`` for FLA on triton-ascend; fla_npu itself is never imported here (the AscendC adapter
    loads it at its first call, which no test makes: there is no NPU)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from patches.kernels import ascendc_gdn

    stub_fla(platform="npu")
    choice = _choice("ascendc")
    patches.apply_enabled({"fused_ops": False}, backend="npu", proof_dir=tmp_path, facts={"kernel_choice": choice})
    record = read_proof(tmp_path, "deltanet_routing")
    assert record["route"]["kernel"] == "ascendc" and record["route"]["recurrent"] == "torch"
    assert "preflight chose ascendc by validation (fla refused at layout" in record["route"]["reason"]
    assert record["kernel_choice"] == choice
    assert isinstance(m.chunk_gated_delta_rule, KernelRecorder)
    assert m.chunk_gated_delta_rule.kernel is ascendc_gdn.chunk_gated_delta_rule
    assert m.is_fast_path_available is False


@pytest.mark.usefixtures("restore_patches")
def test_simulated_npu_binds_torch_where_preflight_chose_it_and_fla_without_a_choice(tmp_path, stub_fla):
    """Stand-in: ``stub_fla`` for FLA on triton-ascend. A torch choice reaches training only when the config allowed
    it (preflight refuses it otherwise); without a choice (the kernel row skipped) FLA is required, as before."""
    stub_fla(platform="npu")
    patches.apply_enabled(
        {"fused_ops": False}, backend="npu", proof_dir=tmp_path / "t", facts={"kernel_choice": _choice("torch")}
    )
    route = read_proof(tmp_path / "t", "deltanet_routing")["route"]
    assert (route["kernel"], route["recurrent"]) == ("torch", "torch") and "ascendc refused at load" in route["reason"]
    patches.apply_enabled(
        {"fused_ops": False}, backend="npu", proof_dir=tmp_path / "f", facts={"kernel_choice": _choice("fla")}
    )
    assert read_proof(tmp_path / "f", "deltanet_routing")["route"]["kernel"] == "fla"
    patches.apply_enabled({"fused_ops": False}, backend="npu", proof_dir=tmp_path / "n")
    assert read_proof(tmp_path / "n", "deltanet_routing")["route"]["kernel"] == "fla"
    # kernel: torch in the config is the user's own choice, whatever preflight recorded
    patches.apply_enabled(
        {"fused_ops": False, "deltanet_routing": {"kernel": "torch"}},
        backend="npu",
        proof_dir=tmp_path / "c",
        facts={"kernel_choice": _choice("ascendc")},
    )
    assert "the config chose kernel: torch" in read_proof(tmp_path / "c", "deltanet_routing")["route"]["reason"]


@pytest.mark.usefixtures("restore_patches")
def test_simulated_npu_fused_ops_keep_torch_for_a_glue_op_preflight_refused_fla_for(tmp_path, stub_fla):
    """Stand-in: ``stub_fla`` (FLA's conv and gated norm in plain torch) on a simulated NPU."""
    stub_fla(platform="npu")
    patches.apply_enabled({}, backend="npu", proof_dir=tmp_path, facts={"kernel_choice": _choice("fla", conv="torch")})
    ops = read_proof(tmp_path, "fused_ops")["ops"]
    assert (
        ops["conv"]["kernel"] == "torch"
        and "preflight chose torch by validation (fla refused at layout" in (ops["conv"]["reason"])
    )
    assert ops["gated_norm"]["kernel"] == "fla" and ops["swiglu"]["kernel"] == "fla"
    assert read_proof(tmp_path, "fused_ops")["kernel_choice"]["components"]["conv"]["chosen"] == "torch"
