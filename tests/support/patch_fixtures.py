"""Fixtures and helpers for the ``patches`` tests.

Test modules load it with ``pytest_plugins = ["tests.support.patch_fixtures"]`` (``tests/conftest.py`` belongs to the
launcher tests). Nothing here is autouse: only the tests that ask for a fixture get it.

There is no NPU or GPU on the test machine. NPU and CUDA are simulated by ``stub_fla``: a small package
named ``fla`` (with ``fla_core`` 0.6.0 metadata) written into a temporary folder, exposing the names the
patches read from fla-core 0.6.0. Its "FLA kernel" is transformers' torch reference, so a model routed to
it computes correctly on CPU; the device check still expects the simulated backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_patches():
    """Undo every patch (module globals, LLaMA-Factory function, Trainer hook) after the test."""
    yield
    from patches.registry import restore_all

    restore_all()


def stub_training_step(self, model, inputs, num_items_in_batch=None):
    model.train()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


@pytest.fixture
def stub_trainer(monkeypatch):
    """``transformers.Trainer.training_step`` replaced by forward+backward (so the first- and later-step hooks
    run without a whole Trainer); returns a fake trainer."""
    from types import SimpleNamespace

    import transformers

    monkeypatch.setattr(transformers.Trainer, "training_step", stub_training_step)
    return SimpleNamespace(args=SimpleNamespace(gradient_checkpointing=True))


def tiny_text_config(layer_types: tuple[str, ...] = ("linear_attention", "full_attention")):
    """A ``Qwen3_5TextConfig`` small enough to build and run in well under a second."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
    )


@pytest.fixture
def make_tiny_model():
    """Return a builder of fresh tiny ``Qwen3_5ForCausalLM`` models (one DeltaNet, one full-attention layer).

    A builder, not a model: routing tests must build the model after the patch is applied.
    """

    def build():
        import torch
        from transformers import Qwen3_5ForCausalLM

        torch.manual_seed(0)
        return Qwen3_5ForCausalLM(tiny_text_config())

    return build


def lora_model(model_dir: Path, lora_b_std: float = 0.02):
    """The model folder's ``Qwen3_5ForConditionalGeneration`` in fp32 with real PEFT LoRA (r 4) on q/k/v/o, in
    training mode; LoRA B starts at zero upstream, so it gets values here and A gets gradients."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(AutoConfig.from_pretrained(model_dir)).float()
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=lora_b_std)
    model.train()
    return model


_STUB_FILES = {
    "fla/__init__.py": '__version__ = "0.6.0"\n',
    "fla/ops/__init__.py": "",
    "fla/ops/common/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": """
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            torch_chunk_gated_delta_rule,
            torch_recurrent_gated_delta_rule,
        )


        def chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):
            return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)


        def fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs):
            return torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
        """,
    "fla/modules/__init__.py": """
        class FusedRMSNormGated:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("the stub FusedRMSNormGated must not be built in these tests")
        """,
    # fla-core 0.6.0's contracts for the fused glue (fused_ops), written here in plain torch: conv on [B, T, D]
    # with weight [D, W] and optional cu_seqlens (batch 1), returning (y, final_state); the norms in fp32 with
    # the output in x's dtype; swiglu(gate, up) = silu(gate) * up
    "fla/modules/causal_conv1d/__init__.py": """
        import torch
        import torch.nn.functional as F

        CALLS = {"n": 0, "varlen": 0, "bounds": []}


        def causal_conv1d(x, weight=None, bias=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
            CALLS["n"] += 1
            taps = weight.shape[-1]

            def one(part):
                out = F.conv1d(F.pad(part.transpose(1, 2), (taps - 1, 0)), weight.unsqueeze(1), bias,
                               groups=weight.shape[0])
                return out.transpose(1, 2)

            if cu_seqlens is None:
                y = one(x)
            else:
                assert cu_seqlens.device == x.device and cu_seqlens.dtype in (torch.int32, torch.int64), cu_seqlens
                CALLS["varlen"] += 1
                bounds = cu_seqlens_cpu.tolist()
                CALLS["bounds"].append(bounds)
                y = torch.cat([one(x[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])], dim=1)
            return (F.silu(y) if activation in ("silu", "swish") else y), None
        """,
    "fla/modules/norm/__init__.py": "",
    "fla/modules/norm/layernorm.py": """
        import torch
        import triton
        import triton.language as tl

        # fla-core 0.6.0's decorators on its row-bucketed kernels (never launched here)
        @triton.jit
        def _kernel(x, y, T, D: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr, IS_RMS_NORM: tl.constexpr,
                    RECOMPUTE_OUTPUT: tl.constexpr):
            pass


        CONFIGS = [triton.Config({"BT": 32}, num_warps=2), triton.Config({"BT": 64}, num_warps=4)]
        KEY = ["D", "NB", "IS_RMS_NORM"]
        layer_norm_fwd_kernel = triton.autotune(configs=CONFIGS, key=list(KEY))(_kernel)
        layer_norm_bwd_kernel = triton.heuristics({"RECOMPUTE_OUTPUT": lambda args: args["y"] is not None})(
            triton.autotune(configs=CONFIGS, key=list(KEY))(_kernel)
        )


        def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
            return y.to(x.dtype)
        """,
    "fla/modules/norm/fused_norm_gate.py": """
        import torch
        import torch.nn.functional as F
        import triton
        import triton.language as tl

        @triton.jit
        def _kernel(x, w, T, D: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr, HAS_WEIGHT: tl.constexpr):
            pass


        def _decorated():  # heuristics around the autotuner, as fla-core 0.6.0 has them
            tuner = triton.autotune(configs=[triton.Config({"BT": 16}, num_warps=4)], key=["D", "NB", "HAS_WEIGHT"])
            return triton.heuristics({"HAS_WEIGHT": lambda args: args["w"] is not None})(tuner(_kernel))


        layer_norm_gated_fwd_kernel = _decorated()
        layer_norm_gated_bwd_kernel = _decorated()


        def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                           residual_in_fp32=False, eps=1e-6):
            assert activation in ("swish", "silu")
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(g.float())
            return y.to(x.dtype)
        """,
    "fla/modules/activations/__init__.py": """
        import torch.nn.functional as F


        def swiglu(x, y):
            return (F.silu(x.float()) * y.float()).to(x.dtype)
        """,
    "fla_core-0.6.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fla-core\nVersion: 0.6.0\n",
}


def fla_pairing(value_head: int, groups: int, key_heads: int) -> int:
    """fla-core 0.6's grouped value attention: value head ``j`` reads key head ``j // (HV // H)`` (its kernels'
    ``i_h // (HV // H)``), the pairing transformers' ``repeat_interleave`` builds."""
    return value_head // groups


def grouped_varlen_kernel(pairing=fla_pairing, seen: list | None = None):
    """A stand-in for FLA's varlen chunk kernel that takes fewer q/k heads than value heads: each value head reads
    the key head ``pairing`` names, each ``cu_seqlens`` segment runs alone through transformers' torch reference
    (one segment without them), the last segment's final state returned. ``seen`` collects the (q, k, v) head
    counts of every call."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def kernel(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        if seen is not None:
            seen.append((q.shape[2], k.shape[2], v.shape[2]))
        groups = v.shape[2] // q.shape[2]
        index = torch.tensor([pairing(j, groups, q.shape[2]) for j in range(v.shape[2])])
        bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
        pieces = [
            torch_chunk_gated_delta_rule(
                q[:, s:e, index], k[:, s:e, index], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs
            )
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat([out for out, _ in pieces], dim=1), pieces[-1][1]

    return kernel


def write_stub_fla(
    root: Path, platform: str = "cuda", hopper: bool = False, above_3_4_0: bool = True, above_3_7_1: bool = True
) -> Path:
    """Write the stand-in ``fla`` package into ``root`` (put it on ``sys.path`` to use it); returns ``root``."""
    files = {
        **_STUB_FILES,
        "fla/utils/__init__.py": f"device_platform = {platform!r}\n",
        "fla/ops/common/chunk_o.py": (
            f"IS_NVIDIA_HOPPER = {hopper}\nTRITON_ABOVE_3_4_0 = {above_3_4_0}\nTRITON_ABOVE_3_7_1 = {above_3_7_1}\n"
        ),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture
def stub_fla(tmp_path, monkeypatch):
    """Return ``make(platform="cuda", hopper=False, above_3_4_0=True, above_3_7_1=True) -> Path``.

    ``platform`` is what FLA reports as its Triton backend; the three flags are the module globals FLA's
    Hopper guard in ``fla/ops/common/chunk_o.py`` reads.
    """
    if any(name == "fla" or name.startswith("fla.") for name in sys.modules):
        pytest.skip("a real FLA is imported in this process; the stub would not be used")

    def make(platform: str = "cuda", hopper: bool = False, above_3_4_0: bool = True, above_3_7_1: bool = True):
        root = write_stub_fla(tmp_path / "stub_fla", platform, hopper, above_3_4_0, above_3_7_1)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield make
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        del sys.modules[name]


LF_ARGS = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_target": "q_proj,k_proj,v_proj,o_proj",
    "dataset": "demo_counsel_train",
    "template": "qwen3_5_nothink",
    "cutoff_len": 256,
    "per_device_train_batch_size": 2,
    "max_steps": 2,
    "logging_steps": 1,
    "gradient_checkpointing": True,
    "report_to": "none",
    "bf16": False,
    "dataloader_num_workers": 0,
    "save_only_model": True,
}


# Two steps of two micro-batches, evaluated at every step, with SGD (the update is the gradient): the
# settings of the on/off comparisons through the real Trainer; each adds its own dropout and precision.
EVAL_EVERY_STEP_SGD = {
    "gradient_accumulation_steps": 2,
    "per_device_train_batch_size": 1,
    "eval_dataset": "demo_counsel_eval",
    "eval_strategy": "steps",
    "eval_steps": 1,
    "per_device_eval_batch_size": 2,
    "seed": 7,
    "optim": "sgd",
    "learning_rate": 1.0e-2,
}


def trainer_log(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``output/trainer_log.jsonl`` of a run made by ``run_tiny_training``."""
    from tests.support.common import read_jsonl

    return read_jsonl(run_dir / "output" / "trainer_log.jsonl")


@pytest.fixture(scope="session")
def tiny_training():
    """Return ``run(run_dir, assets, patch_settings, nproc=1)``: a real two-step training of the demo model."""
    return run_tiny_training


def run_tiny_training(
    run_dir: Path,
    assets: dict[str, Path],
    patch_settings: dict[str, Any],
    nproc: int = 1,
    timeout: float = 600,
    lf: dict[str, Any] | None = None,
    entry: str = "launcher.entry",
) -> subprocess.CompletedProcess:
    """Train the demo model for two steps through ``torchrun -m launcher.entry`` (the real path);
    ``lf`` overrides LLaMA-Factory keys; ``entry`` is the rank module (a test entry wraps launcher.entry).
    ``launch.json`` carries the facts the launcher would write."""
    import patches
    from launcher.run.rundir import run_facts

    run_dir.mkdir(parents=True)
    args = {
        **LF_ARGS,
        "model_name_or_path": str(assets["model"]),
        "dataset_dir": str(assets["data"]),
        "output_dir": str(run_dir / "output"),
        **(lf or {}),
    }
    (run_dir / "llamafactory.yaml").write_text(yaml.safe_dump(args, sort_keys=False))
    launch = {
        "patches": patches.normalize_settings(patch_settings),
        "backend": "cpu",
        "llamafactory_yaml": "llamafactory.yaml",
        "facts": run_facts(args),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        entry,
        str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    (run_dir / "train.log").write_text(result.stdout + result.stderr)
    return result
