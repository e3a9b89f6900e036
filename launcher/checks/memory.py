"""Memory forecast per device: what one training rank will hold at its peak, term by term, before it starts.

``launcher check`` and preflight show it as the ``memory`` row. Every term is arithmetic on the model's
``config.json`` (hidden size, intermediate size, layers and their kinds, heads, vocabulary, vision tower) and
the run config (dtype, ``cutoff_len``, batch sizes, LoRA targets and rank, distribution and ranks, the patches
and their options), with the few calibration constants below, each named with the measurement it comes from
(docs/lab/2026-12-02-memory-forecast.md has the table of forecasts against every measured point).

The terms (GiB per device):

- ``weights``: every parameter in the load dtype; under FSDP2 divided over the ranks, and in float32 when
  accelerate 1.11 upcasts the frozen base (``fsdp2_frozen_dtype`` off);
- ``FSDP2 gathered units``: what FSDP2 holds gathered in bf16 beside the shards. With ``fsdp2_frozen_dtype``'s
  ``embedding_units`` (the default, untied embeddings): the root unit's rest (final norm, the vision tower outside
  its blocks) and either two decoder layers (in their backward) or ``lm_head`` (at the loss), whichever phase
  peaks higher; otherwise the whole root unit (embedding, ``lm_head``, the rest) and two decoder layers;
- ``lora``: the LoRA parameters (float32), their gradients and Adam's two moments: 16 bytes a parameter;
- ``checkpointed inputs``: what every checkpointed decoder layer keeps for its backward, its input. With
  ``checkpoint_all_layers.offload_inputs`` on, the checkpointed layers' inputs live in pinned host memory and the
  device keeps ``OFFLOAD_IN_FLIGHT`` of them (the layer being recomputed and the next one, prefetched) plus the
  inputs of the layers left un-checkpointed; the host memory this takes (``host_gib``: per rank, times the ranks
  on a node, in the allocator's chunks) is held against the host's free memory;
- ``un-checkpointed layers``: the saved activations of the layers the run leaves un-checkpointed (LLaMA-Factory's
  own rule with ``checkpoint_all_layers`` off, ``uncheckpointed_layers``, or the ``memory_budget_gib`` plan),
  per layer kind: Gated DeltaNet and full attention save different widths;
- ``backward working set`` or ``loss``, whichever is larger (they are not held at the same time): the layer
  being recomputed and back-propagated, or the logits of the loss (one chunk with ``chunked_loss``, the whole
  sequence without);
- ``evaluation`` and ``final save`` are peaks of their own (between steps, activations freed) and count only when
  larger than the training step's;
- ``allocator slack``: what the caching allocator keeps reserved beyond the allocated peak.

The verdict compares peak + slack with the device's memory: ``fits``, ``tight`` (the allocated peak fits, the
slack does not) or ``will not fit``; it names the largest term and the option that shrinks it. The forecast is made
with and without ``offload_inputs``; ``auto`` takes it when the run would not fit without it and would with it
(``Forecast.offload`` says which and why; preflight passes that decision to the ranks). With ``--device-memory``
the row also lists the ``cutoff_len`` values that fit, with and without it (``fitting_lengths``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config.run_config import cutoff_len
from launcher.results.lora_targets import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    UnsupportedModel,
    expected_lora_modules,
    read_model_layout,
)

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# --- calibration constants (one H200, 27B shape, LoRA r8 q/k/v/o, batch 1) -------------------------------------------
# (docs/lab/2026-12-02-memory-forecast.md)
# Saved activations of one un-checkpointed decoder layer per token, in elements of the activation dtype: the MLP
# keeps its gate and up projections and their SwiGLU product (3 x intermediate_size), the token mixer keeps
# these many hidden-widths. From the layer meter's counts at 4,096 tokens (`budget120`, run 4 of "Performance
# options"): 0.713 GiB for a full-attention layer, 0.636 GiB for a DeltaNet layer, less 3 x 17,408 for the MLP.
MLP_SAVED_WIDTHS = 3
MIXER_SAVED_HIDDENS = {FULL_ATTENTION: 8.05, LINEAR_ATTENTION: 6.08}
# What an un-checkpointed layer really costs against that count (kernels' own buffers, backward workspace): the
# same run peaked at 117.21 GiB with all 64 layers un-checkpointed, 1.48 x the 41.94 GiB counted.
REAL_OVER_COUNTED = 1.48
# With the fused glue (`fused_ops` and `lora_input_cast`, both on by default) the same 64-layer plan peaked at
# 99.0 GiB instead of 117.21 (glue-budget-h200.json against perf-h200-run4.json): (99.0 - 55.06) / (117.21 - 55.11).
FUSED_GLUE_LAYER_SHARE = 0.708
# The backward of one checkpointed layer (its recomputed activations, their gradients, the layer's input gradient)
# against the count of the widest layer kind: fitted on the 65,536-token point (115.94 GiB, `ctx64k`), where it
# dominates; the 8k, 16k and 32k points check it (docs/lab/2026-12-02-memory-forecast.md).
BACKWARD_OVER_COUNTED = 2.18
# The loss per logit: bf16 logits, their float32 copy for the cross-entropy, its float32 gradient and the bf16
# gradient of the logits: 2 + 4 + 4 + 2 bytes. Check: chunks of 1,024 peaked 1.41 GiB above chunks of 512 (56.55
# against 55.14 GiB), 12 x 512 x 248,320 bytes = 1.42 GiB; without the chunked loss the peak was 65.12 GiB.
LOSS_BYTES_PER_LOGIT = 12
EVAL_LOSS_BYTES_PER_LOGIT = 6  # no gradient in evaluation: the bf16 logits and their float32 copy
# Greedy decoding (``decode_row_bytes``): what a batch row takes beyond its cache and logits, per prompt token, in
# hidden widths of the activation dtype: the prompt pass's short-lived working set (in-projections, the
# convolution, FLA's chunk intermediates, the MLP). Fitted on one H200 (27B shape, 512-token prompts, 128 new
# tokens; decode-batched-h200.json): the larger per-row slope of the peak, 0.2033 GiB from 8 to 32 rows, less a
# row's cache (115.75 MiB) and logits (1.42 MiB) leaves 91.0 MiB over 512 tokens, 18.2 hidden widths; rounded up.
# Measured at 512 tokens only: taken linear in the prompt's length above it, and never less than at 512 below it.
DECODE_PROMPT_HIDDENS = 20
DECODE_MEASURED_PROMPT = 512
# FSDP2 gathers the next decoder layer while one runs (prefetch): two layers' bf16 weights at a time. With one
# process the FSDP2 run measured 60.36 GiB against 55.09 single-device with the embeddings in the root unit (the
# root and a layer gathered), 57.55 GiB with them as units of their own (lm_head gathered at the loss:
# fsdp2-embedding-units-h200.json).
FSDP_GATHERED_LAYERS = 2
# The caching allocator's reserved memory beyond the allocated peak: not recorded in the H200 runs. The layer
# plan leaves 1 GiB under a budget for fragmentation and the optimizer step (patches/planning/budget.py); the
# forecast adds 5 % of the peak on top of that, an allowance until a run records its reserved peak.
SLACK_GIB = 1.0
SLACK_SHARE = 0.05
# offload_inputs: the inputs on the device at a time in the backward, the one being recomputed and the next,
# prefetched (patches/planning/offload.py); the host keeps them in chunks of this size (a power of two: the pinned
# allocator rounds every allocation up to one, patches.planning.offload.CHUNK_BYTES)
OFFLOAD_IN_FLIGHT = 2
OFFLOAD_CHUNK_BYTES = 64 * 1024**2
# the cutoff_len values --device-memory reports as fitting or not: 1,024 to 262,144 tokens
FIT_LENGTHS = tuple(1024 * 2**k for k in range(9))


@dataclass(frozen=True)
class ModelShape:
    """The sizes the forecast needs, from ``config.json``."""

    hidden: int
    intermediate: int
    vocab: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    tied: bool
    dtype: str
    vision: dict[str, int] = field(default_factory=dict)  # depth, hidden, intermediate, out, patch, ...

    def kinds(self) -> dict[str, int]:
        return {kind: self.layer_types.count(kind) for kind in (LINEAR_ATTENTION, FULL_ATTENTION)}


def read_shape(config: dict[str, Any]) -> ModelShape:
    """The sizes of a Qwen3.5 model from its parsed ``config.json``; ``UnsupportedModel`` saying what is missing."""
    layout = read_model_layout(config)
    text = (config.get("text_config") or {}) if layout.composite else config
    vision = (config.get("vision_config") or {}) if layout.composite else {}

    def need(section: dict[str, Any], key: str, where: str) -> int:
        value = section.get(key)
        if not isinstance(value, int) or value <= 0:
            raise UnsupportedModel(f"{where}{key} is {value!r} in the model's config.json; expected a positive int")
        return value

    t = "text_config." if layout.composite else ""
    hidden = need(text, "hidden_size", t)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16")
    shape = ModelShape(
        hidden=hidden,
        intermediate=need(text, "intermediate_size", t),
        vocab=need(text, "vocab_size", t),
        layer_types=layout.layer_types,
        heads=need(text, "num_attention_heads", t),
        kv_heads=need(text, "num_key_value_heads", t),
        head_dim=text.get("head_dim") or hidden // need(text, "num_attention_heads", t),
        key_heads=need(text, "linear_num_key_heads", t),
        value_heads=need(text, "linear_num_value_heads", t),
        key_dim=need(text, "linear_key_head_dim", t),
        value_dim=need(text, "linear_value_head_dim", t),
        conv_kernel=need(text, "linear_conv_kernel_dim", t),
        tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
        vision={}
        if not vision
        else {
            "depth": int(vision.get("depth", 0)),
            "hidden": need(vision, "hidden_size", "vision_config."),
            "intermediate": need(vision, "intermediate_size", "vision_config."),
            "out": need(vision, "out_hidden_size", "vision_config."),
            "patch": need(vision, "patch_size", "vision_config."),
            "temporal": need(vision, "temporal_patch_size", "vision_config."),
            "merge": need(vision, "spatial_merge_size", "vision_config."),
            "channels": int(vision.get("in_channels", 3)),
            "positions": need(vision, "num_position_embeddings", "vision_config."),
        },
    )
    return shape


# --- parameters ------------------------------------------------------------------------------------------------


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every decoder-layer linear by its leaf name, as transformers 5.6 builds Qwen3.5."""
    h, kd, vd = shape.hidden, shape.key_heads * shape.key_dim, shape.value_heads * shape.value_dim
    return {
        "q_proj": (h, shape.heads * shape.head_dim * 2),  # queries and the output gate
        "k_proj": (h, shape.kv_heads * shape.head_dim),
        "v_proj": (h, shape.kv_heads * shape.head_dim),
        "o_proj": (shape.heads * shape.head_dim, h),
        "in_proj_qkv": (h, 2 * kd + vd),
        "in_proj_z": (h, vd),
        "in_proj_b": (h, shape.value_heads),
        "in_proj_a": (h, shape.value_heads),
        "out_proj": (vd, h),
        "gate_proj": (h, shape.intermediate),
        "up_proj": (h, shape.intermediate),
        "down_proj": (shape.intermediate, h),
    }


def layer_parameters(shape: ModelShape, kind: str) -> int:
    """Parameters of one decoder layer of ``kind`` (weights, norms, the DeltaNet convolution and gates)."""
    sizes = linear_shapes(shape)
    mlp = sum(i * o for i, o in (sizes[p] for p in ("gate_proj", "up_proj", "down_proj")))
    norms = 2 * shape.hidden
    if kind == FULL_ATTENTION:
        mixer = sum(i * o for i, o in (sizes[p] for p in ("q_proj", "k_proj", "v_proj", "o_proj")))
        mixer += 2 * shape.head_dim  # q_norm, k_norm
    else:
        mixer = sum(
            i * o for i, o in (sizes[p] for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
        )
        conv_channels = 2 * shape.key_heads * shape.key_dim + shape.value_heads * shape.value_dim
        mixer += (
            conv_channels * shape.conv_kernel + 2 * shape.value_heads + shape.value_dim
        )  # conv, dt_bias, A_log, norm
    return mixer + mlp + norms


def vision_parameters(shape: ModelShape) -> tuple[int, int]:
    """``(one block, the rest of the tower)``: patch embedding, position table and merger."""
    v = shape.vision
    if not v:
        return 0, 0
    d, m = v["hidden"], v["intermediate"]
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)  # 2 norms, qkv, proj, MLP
    merged = d * v["merge"] ** 2
    patch = v["channels"] * v["temporal"] * v["patch"] ** 2 * d + d
    merger = 2 * d + (merged * merged + merged) + (merged * v["out"] + v["out"])
    return block, patch + v["positions"] * d + merger


def parameter_counts(shape: ModelShape) -> dict[str, int]:
    """Parameters by part: ``total``, ``layers`` (per kind), ``largest_layer`` and the FSDP2 ``root`` unit."""
    per_kind = {kind: layer_parameters(shape, kind) for kind in set(shape.layer_types)}
    layers = sum(per_kind[kind] for kind in shape.layer_types)
    block, tower_rest = vision_parameters(shape)
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)  # embed_tokens and lm_head
    root = embeddings + shape.hidden + tower_rest  # + the final norm
    total = root + layers + block * shape.vision.get("depth", 0)
    return {
        "total": total,
        "root": root,
        "embedding": shape.vocab * shape.hidden,  # one of embed_tokens / lm_head
        "largest_layer": max(per_kind.values()),
        "vision_block": block,
        **{f"layer:{k}": v for k, v in per_kind.items()},
    }


def lora_parameters(shape: ModelShape, config: dict[str, Any], lf: dict[str, Any]) -> int:
    """LoRA parameters: ``r x (in + out)`` for every module LLaMA-Factory adapts (``lora_target``)."""
    if lf.get("finetuning_type", "lora") != "lora":
        raise UnsupportedModel(f"finetuning_type is {lf.get('finetuning_type')!r}; the forecast covers LoRA only")
    modules = expected_lora_modules(read_model_layout(config), lf)
    sizes, rank = linear_shapes(shape), int(lf.get("lora_rank") or 8)
    return sum(rank * sum(sizes[name.rsplit(".", 1)[-1]]) for name in modules if name.rsplit(".", 1)[-1] in sizes)


# --- the run ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunShape:
    """What the run does with the model, read from the run config."""

    tokens: int  # cutoff_len x per_device_train_batch_size
    eval_tokens: int  # cutoff_len x per_device_eval_batch_size, 0 without evaluation
    act_bytes: int  # the activation and load dtype
    ranks: int
    fsdp2: bool
    fp32_frozen: bool  # accelerate 1.11's float32 upcast of the frozen base (fsdp2 without fsdp2_frozen_dtype)
    embedding_units: bool  # fsdp2_frozen_dtype's embedding_units: the embeddings as FSDP2 units of their own
    uncheckpointed: dict[str, int]  # layers left un-checkpointed per kind, before a budget plan
    budget_gib: float | None
    chunk_tokens: int | None  # None: the whole logits
    fused_glue: bool
    offload: bool | str = False  # checkpoint_all_layers.offload_inputs: True, False or "auto"
    node_ranks: int = 1  # training ranks on one node (they share its host memory)
    cutoff: int = 0  # cutoff_len (tokens = cutoff x batch)
    backend: str = "auto"


def run_shape(
    shape: ModelShape, model_config: dict[str, Any], launcher, patches: dict[str, dict[str, Any]], lf: dict[str, Any]
) -> RunShape:
    """The ``RunShape`` of a run: its ``launcher`` section, normalized ``patches`` and LLaMA-Factory arguments
    ``lf``; ``model_config`` is the parsed ``config.json``."""
    cutoff = cutoff_len(lf)
    batch = int(lf.get("per_device_train_batch_size") or 8)  # the HF TrainingArguments default
    evaluates = str(lf.get("eval_strategy", "no")) != "no" and (lf.get("eval_dataset") or lf.get("val_size"))
    eval_batch = int(lf.get("per_device_eval_batch_size") or 8)
    half = bool(lf.get("bf16") or lf.get("fp16") or lf.get("pure_bf16"))
    act_bytes = 2 if half else DTYPE_BYTES[shape.dtype]
    fsdp2 = launcher.distribution == "fsdp2"
    ranks = launcher.nproc_per_node * launcher.nnodes
    ckpt = patches.get("checkpoint_all_layers", {})
    kinds = shape.kinds()
    checkpointing = not (lf.get("gradient_checkpointing") is False or lf.get("disable_gradient_checkpointing"))
    offload = ckpt.get("offload_inputs", "auto") if ckpt.get("enabled", True) and checkpointing else False
    if not checkpointing:
        left = dict(kinds)  # nothing checkpointed
    elif not ckpt.get("enabled", True):
        # LLaMA-Factory 0.9.5 checkpoints only layers owning a trainable parameter (patches/checkpoint_all_layers.py)
        adapted = _adapted_layers(model_config, lf)
        left = {
            kind: sum(1 for i, t in enumerate(shape.layer_types) if t == kind and i not in adapted) for kind in kinds
        }
    elif ckpt.get("uncheckpointed_layers"):
        left, n = {}, int(ckpt["uncheckpointed_layers"])
        for kind in sorted(kinds, key=lambda k: -_counted_per_token(shape, k, act_bytes)):  # priciest first: a bound
            left[kind] = min(n, kinds[kind])
            n -= left[kind]
    else:
        left = {}
    chunked = patches.get("chunked_loss", {})
    frozen_dtype = patches.get("fsdp2_frozen_dtype", {})
    glue = patches.get("fused_ops", {}).get("enabled", True) and patches.get("lora_input_cast", {}).get("enabled", True)
    return RunShape(
        tokens=cutoff * batch,
        eval_tokens=cutoff * eval_batch if evaluates else 0,
        act_bytes=act_bytes,
        ranks=ranks,
        fsdp2=fsdp2,
        fp32_frozen=fsdp2 and half and not frozen_dtype.get("enabled", True),
        embedding_units=fsdp2 and frozen_dtype.get("enabled", True) and frozen_dtype.get("embedding_units", True),
        uncheckpointed={k: v for k, v in left.items() if v},
        budget_gib=ckpt.get("memory_budget_gib"),
        chunk_tokens=int(chunked.get("chunk_tokens", 512)) if chunked.get("enabled", True) else None,
        fused_glue=bool(glue),
        offload=offload,
        node_ranks=launcher.nproc_per_node,
        cutoff=cutoff,
        backend=launcher.backend,
    )


def _adapted_layers(model_config: dict[str, Any], lf: dict[str, Any]) -> set[int]:
    """Indices of the decoder layers owning a LoRA module."""
    found = set()
    for name in expected_lora_modules(read_model_layout(model_config), lf):
        if match := re.search(r"\.layers\.(\d+)\.", name):
            found.add(int(match.group(1)))
    return found


def _counted_per_token(shape: ModelShape, kind: str, act_bytes: int) -> float:
    """Bytes per token the layer meter would count for one un-checkpointed layer of ``kind``."""
    return act_bytes * (MLP_SAVED_WIDTHS * shape.intermediate + MIXER_SAVED_HIDDENS[kind] * shape.hidden)


# --- the forecast ----------------------------------------------------------------------------------------------


@dataclass
class Forecast:
    """Per-device GiB by term, the peak, and the verdict against ``device_gib`` (None: not known)."""

    terms: dict[str, float]
    step_peak: float
    eval_peak: float
    save_peak: float
    slack: float
    device_gib: float | None
    notes: list[str] = field(default_factory=list)
    fixes: dict[str, str] = field(default_factory=dict)
    host_gib: float = 0.0  # pinned host memory per node for offloaded inputs (0: not offloaded)
    offload: dict[str, Any] = field(default_factory=dict)  # setting, on, reason
    other: Forecast | None = None  # the same run with offload_inputs the other way
    offloaded: bool = False  # this forecast has the checkpointed inputs in host memory
    lengths: dict[str, list[int]] = field(default_factory=dict)  # fitting_lengths, where asked for

    @property
    def peak(self) -> float:
        return max(self.step_peak, self.eval_peak, self.save_peak)

    @property
    def largest(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])

    @property
    def verdict(self) -> str | None:
        if self.device_gib is None:
            return None
        if self.peak > self.device_gib:
            return "will not fit"
        return "tight" if self.peak + self.slack > self.device_gib else "fits"

    def to_dict(self) -> dict[str, Any]:
        return {
            "terms_gib": {k: round(v, 2) for k, v in self.terms.items()},
            "step_peak_gib": round(self.step_peak, 2),
            "eval_peak_gib": round(self.eval_peak, 2),
            "save_peak_gib": round(self.save_peak, 2),
            "peak_gib": round(self.peak, 2),
            "slack_gib": round(self.slack, 2),
            "device_gib": self.device_gib,
            "verdict": self.verdict,
            "largest": self.largest,
            "fix": self.fixes.get(self.largest),
            "notes": self.notes,
            "offload_inputs": self.offload_record(),
        }

    def offload_record(self) -> dict[str, Any]:
        """The ``offload_inputs`` decision and the forecast both ways (``without`` / ``with``)."""
        both = {("with" if f.offloaded else "without"): f for f in (self, self.other) if f is not None}
        return {
            **self.offload,
            **{
                key: {
                    "terms_gib": {k: round(v, 2) for k, v in f.terms.items()},
                    "peak_gib": round(f.peak, 2),
                    "verdict": f.verdict,
                    "host_gib_per_node": round(f.host_gib, 2),
                }
                for key, f in both.items()
            },
        }

    def line(self) -> str:
        """One line for a check table: the peak, the terms, the verdict, the largest term and its option."""
        terms = sorted(((k, v) for k, v in self.terms.items() if v > 0), key=lambda kv: -kv[1])
        shown = ", ".join(f"{k} {_size(v)}" for k, v in terms)
        text = f"forecast peak {_size(self.peak)} per device ({shown}; + slack {_size(self.slack)})"
        if self.eval_peak > self.step_peak or self.save_peak > self.step_peak:
            text += f"; evaluation {_size(self.eval_peak)}, final save {_size(self.save_peak)}"
        if self.host_gib:
            text += f"; checkpointed inputs offloaded: {_size(self.host_gib)} of pinned host memory per node"
        if self.offload.get("reason"):
            text += f"; offload_inputs {str(self.offload['setting']).lower()}: {'on' if self.offload['on'] else 'off'} "
            text += f"({self.offload['reason']})"
        if self.device_gib is None:
            text += "; device memory not known here: give --device-memory GIB for a verdict"
        else:
            text += f" against {self.device_gib:.1f} GiB: {self.verdict.upper()}"
            if self.verdict != "fits":
                largest = self.largest
                text += f"; largest term: {largest} ({_size(self.terms[largest])}): {self.fixes[largest]}"
        return text + "".join(f"; {n}" for n in self.notes)


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"


def forecast(
    shape: ModelShape,
    run: RunShape,
    lora_params: int,
    device_gib: float | None = None,
    host_free_gib: float | None = None,
) -> Forecast:
    """The per-device forecast of one training rank (see the module docstring for the terms), with
    ``offload_inputs`` as set or, for ``auto``, as decided here: on when the run will not fit ``device_gib``
    without it and its allocated peak would with it (``fits`` or ``tight``), and the host's free memory
    (``host_free_gib``, where known) holds the inputs.
    ``Forecast.other`` is the forecast the other way."""
    if run.offload is False:
        return _forecast(shape, run, lora_params, device_gib, offload=False)
    off = _forecast(shape, run, lora_params, device_gib, offload=False)
    on = _forecast(shape, run, lora_params, device_gib, offload=True)
    off.other, on.other = on, off
    if run.offload is True:
        on.offload = {"setting": True, "on": True, "reason": "set true in the config"}
        return on
    chosen, reason = off, ""
    if run.backend == "cpu":
        reason = "auto: the cpu backend keeps everything in host memory already"
    elif device_gib is None:
        reason = "auto: the device's memory is not known here"
    elif off.verdict != "will not fit":
        reason = f"auto: the run {off.verdict} without it ({_size(off.peak)} peak against {device_gib:.1f} GiB)"
    elif on.verdict == "will not fit" or on.peak >= off.peak:
        reason = f"auto: the run would not fit with it either ({_size(on.peak)} peak against {device_gib:.1f} GiB)"
    elif host_free_gib is not None and on.host_gib > host_free_gib:
        reason = (
            f"auto: the run needs it ({_size(off.peak)} peak without it against {device_gib:.1f} GiB), but the "
            f"host has {host_free_gib:.1f} GiB free for the {_size(on.host_gib)} it would pin"
        )
    else:
        chosen = on
        reason = (
            f"auto: {_size(off.peak)} peak without it ({off.verdict}), {_size(on.peak)} with it against "
            f"{device_gib:.1f} GiB"
        )
    chosen.offload = {"setting": "auto", "on": chosen is on, "reason": reason}
    return chosen


def _forecast(
    shape: ModelShape, run: RunShape, lora_params: int, device_gib: float | None, *, offload: bool
) -> Forecast:
    """The forecast with the checkpointed layers' inputs offloaded to host memory, or not."""
    counts = parameter_counts(shape)
    b, shards = run.act_bytes, run.ranks if run.fsdp2 else 1
    weight_bytes = 4 if run.fp32_frozen else b
    terms: dict[str, float] = {"weights": counts["total"] * weight_bytes / shards / GIB}
    fixes = {
        "weights": (
            "launcher.patches.fsdp2_frozen_dtype: true (accelerate 1.11 holds the frozen base in float32)"
            if run.fp32_frozen
            else "more ranks (launcher.nproc_per_node, launcher.nnodes)"
            if run.fsdp2
            else "launcher.distribution: fsdp2 over several devices (shards the frozen weights)"
        )
    }
    per_layer = {k: _counted_per_token(shape, k, b) * run.tokens / GIB for k in shape.kinds()}
    working, gathered, gathered_most = _working_phase(shape, run, counts, per_layer)
    if run.fsdp2:
        terms["FSDP2 gathered units"] = gathered
        fixes["FSDP2 gathered units"] = (
            "launcher.patches.fsdp2_frozen_dtype.embedding_units: true (else the root unit, embedding and "
            "lm_head, stays gathered through the step)"
            if not run.embedding_units and not shape.tied
            else "no option shrinks it (two decoder layers, or lm_head at the loss, gathered whole); "
            "use a device with more memory"
        )
    terms["lora"] = lora_params * 16 / shards / GIB
    fixes["lora"] = "a lower lora_rank or fewer lora_target modules"
    layers = len(shape.layer_types)
    one_input = run.tokens * shape.hidden * b  # bytes of one layer's input
    terms["checkpointed inputs"] = one_input * (OFFLOAD_IN_FLIGHT if offload else layers) / GIB
    fixes["checkpointed inputs"] = (
        "a lower cutoff_len or per_device_train_batch_size"
        if offload or run.offload is False
        else "launcher.patches.checkpoint_all_layers.offload_inputs: true (keeps them in pinned host memory), or a "
        "lower cutoff_len or per_device_train_batch_size"
    )
    real = REAL_OVER_COUNTED * (FUSED_GLUE_LAYER_SHARE if run.fused_glue else 1.0)
    left = dict(run.uncheckpointed)
    notes = []
    if run.budget_gib is not None:
        # offloaded, a layer left un-checkpointed keeps its input on the device too
        extra = one_input / GIB if offload else 0.0
        left, note = _budget_plan(shape, run, per_layer, terms, counts, max(real, 1.0), extra)
        notes.append(note)
    host_gib = 0.0
    if offload:
        kept = sum(left.values())
        checkpointed = layers - kept
        terms["checkpointed inputs"] = one_input * (min(OFFLOAD_IN_FLIGHT, checkpointed) + kept) / GIB
        host_gib = checkpointed * _host_bytes(one_input) * run.node_ranks / GIB
    terms["un-checkpointed layers"] = sum(n * per_layer[k] * real for k, n in left.items())
    fixes["un-checkpointed layers"] = (
        "fewer un-checkpointed layers (a lower checkpoint_all_layers."
        "memory_budget_gib or uncheckpointed_layers; checkpoint_all_layers: true)"
    )
    name, terms[name] = working
    fixes["loss"] = (
        "launcher.patches.chunked_loss: true (never holds the whole logits)"
        if run.chunk_tokens is None
        else "a lower launcher.patches.chunked_loss.chunk_tokens"
    )
    fixes["backward working set"] = "a lower cutoff_len or per_device_train_batch_size"
    step = sum(terms.values())
    held = terms["weights"] + terms.get("FSDP2 gathered units", 0.0) + terms["lora"]
    eval_peak = held
    if run.eval_tokens:
        eval_held = terms["weights"] + gathered_most + terms["lora"]  # evaluation: layers, then lm_head at the loss
        eval_loss = (
            EVAL_LOSS_BYTES_PER_LOGIT
            * (run.eval_tokens if run.chunk_tokens is None else min(run.chunk_tokens, run.eval_tokens))
            * shape.vocab
            / GIB
        )
        one_layer = max(per_layer.values()) * run.eval_tokens / run.tokens
        eval_peak = eval_held + max(eval_loss, one_layer) + 2 * run.eval_tokens * shape.hidden * b / GIB
        fixes["evaluation"] = "a lower per_device_eval_batch_size"
    # the final save gathers each full tensor on the device under FSDP2 (the embedding is the largest)
    save_peak = held + (shape.vocab * shape.hidden * 2 / GIB if run.fsdp2 else 0.0)
    if eval_peak > step:
        terms["evaluation"] = eval_peak - held
    slack = SLACK_GIB + SLACK_SHARE * max(step, eval_peak, save_peak)
    return Forecast(terms, step, eval_peak, save_peak, slack, device_gib, notes, fixes, host_gib, offloaded=offload)


def _host_bytes(nbytes: int) -> int:
    """Pinned bytes one offloaded input takes: whole chunks, and the last one rounded up to a power of two."""
    whole, rest = divmod(nbytes, OFFLOAD_CHUNK_BYTES)
    return whole * OFFLOAD_CHUNK_BYTES + (1 << (rest - 1).bit_length() if rest else 0)


def fitting_lengths(
    shape: ModelShape, run: RunShape, lora_params: int, device_gib: float, lengths: tuple[int, ...] = FIT_LENGTHS
) -> dict[str, list[int]]:
    """The ``cutoff_len`` values (``lengths``) whose forecast ``fits`` ``device_gib``, without and with
    ``offload_inputs`` (``{"without": [...], "with": [...]}``; ``with`` is empty when the run cannot offload), and
    those only ``tight`` there (``without_tight``, ``with_tight``: the allocated peak fits, the slack does not)."""
    from dataclasses import replace

    found: dict[str, list[int]] = {"without": [], "with": [], "without_tight": [], "with_tight": []}
    cutoff = run.cutoff or run.tokens
    for length in lengths:
        scaled_run = replace(
            run, tokens=run.tokens * length // cutoff, eval_tokens=run.eval_tokens * length // cutoff, cutoff=length
        )
        for key, offload in (("without", False), ("with", True)):
            if offload and run.offload is False:
                continue
            verdict = _forecast(shape, scaled_run, lora_params, device_gib, offload=offload).verdict
            if verdict != "will not fit":
                found[key if verdict == "fits" else f"{key}_tight"].append(length)
    return found


def _working_phase(
    shape: ModelShape, run: RunShape, counts: dict[str, int], per_layer: dict[str, float]
) -> tuple[tuple[str, float], float, float]:
    """``((name, GiB), gathered GiB, most gathered GiB)``: the working set of the step's peak phase, the decoder
    layers' backward or the loss (they are not held at the same time), what FSDP2 holds gathered in that phase, and
    the most it holds gathered in either (0 without FSDP2).

    With the embeddings as units of their own, the backward phase holds two decoder layers and the loss phase
    ``lm_head``, so the peak phase is the larger sum; in the root unit both embeddings are held in either."""
    backward = BACKWARD_OVER_COUNTED * max(per_layer.values())
    loss_tokens = run.tokens if run.chunk_tokens is None else min(run.chunk_tokens, run.tokens)
    loss = LOSS_BYTES_PER_LOGIT * loss_tokens * shape.vocab / GIB
    layers = FSDP_GATHERED_LAYERS * counts["largest_layer"] * 2 / GIB
    if not run.fsdp2:
        gathered = {"backward": 0.0, "loss": 0.0}
    elif run.embedding_units and not shape.tied:
        rest = (counts["root"] - 2 * counts["embedding"]) * 2 / GIB
        gathered = {"backward": rest + layers, "loss": rest + counts["embedding"] * 2 / GIB}
    else:
        gathered = {"backward": counts["root"] * 2 / GIB + layers, "loss": counts["root"] * 2 / GIB + layers}
    most = max(gathered.values())
    if loss + gathered["loss"] > backward + gathered["backward"]:
        return ("loss", loss), gathered["loss"], most
    return ("backward working set", backward), gathered["backward"], most


def _budget_plan(
    shape: ModelShape,
    run: RunShape,
    per_layer: dict[str, float],
    terms: dict[str, float],
    counts: dict[str, int],
    real: float,
    extra_gib: float = 0.0,
) -> tuple[dict[str, int], str]:
    """The layers a ``memory_budget_gib`` plan leaves un-checkpointed from the third step on:
    ``patches.planning.budget.plan`` on the forecast's counts priced at what a layer really costs (``real``), as
    the patch's plan is once the second step's peak has narrowed or widened the first plan (priced at
    ``PRIOR_FACTOR`` times the count) to the real factor."""
    from patches.planning.budget import LayerCost, plan

    kinds = shape.kinds()
    costs = {
        k: LayerCost(k, kinds[k], int((per_layer[k] * real + extra_gib) * GIB), per_layer[k], run.tokens)
        for k in kinds
        if kinds[k]
    }
    (_, working), _, _ = _working_phase(shape, run, counts, per_layer)
    activations = terms["checkpointed inputs"] + working
    held = terms["weights"] + terms.get("FSDP2 gathered units", 0.0) + terms["lora"]
    chosen = plan(costs, budget_gib=run.budget_gib, peak_gib=held + activations, held_gib=held).uncheckpointed
    shown = ", ".join(f"{n} {k}" for k, n in chosen.items()) or "none"
    return chosen, f"the memory_budget_gib {run.budget_gib:g} plan leaves {shown} layer(s) un-checkpointed"


# --- greedy decoding (launcher evaluate) ------------------------------------------------------------------------


def decode_cache_bytes(shape: ModelShape, tokens: int, act_bytes: int = 2) -> int:
    """One row's generation cache after ``tokens`` tokens, in the activation dtype: per DeltaNet layer the recurrent
    state (``value_heads x key_dim x value_dim``; FLA's kernels return it in float32, but transformers 5.6.0's
    ``LinearAttentionLayer`` allocates the cached copy in the conv state's dtype, ``cache_utils.py``) and the conv
    state (the last ``conv_kernel`` inputs of every conv channel); per full-attention layer the keys and values of
    every KV head for every token."""
    kinds = shape.kinds()
    conv_channels = 2 * shape.key_heads * shape.key_dim + shape.value_heads * shape.value_dim
    deltanet = (shape.value_heads * shape.key_dim * shape.value_dim + conv_channels * shape.conv_kernel) * act_bytes
    attention = 2 * shape.kv_heads * shape.head_dim * act_bytes * tokens
    return kinds[LINEAR_ATTENTION] * deltanet + kinds[FULL_ATTENTION] * attention


def decode_row_bytes(shape: ModelShape, prompt_tokens: int, new_tokens: int, act_bytes: int = 2) -> int:
    """What one more row of a greedy batch holds at its peak beside the model: its cache at the answer's end
    (``decode_cache_bytes``), the last position's logits (activation dtype and generation's float32 scores), and
    the prompt pass's short-lived working set, ``DECODE_PROMPT_HIDDENS`` hidden widths a prompt token (at least
    ``DECODE_MEASURED_PROMPT`` tokens' worth).

    At the 27B shape with a 512-token prompt and 128 new tokens that is 0.212 GiB; one H200 measured 0.184 GiB a
    row from 1 to 8 rows and 0.203 from 8 to 32 (``decode-batched-h200.json``).
    """
    logits = shape.vocab * (act_bytes + 4)
    prompt_pass = DECODE_PROMPT_HIDDENS * shape.hidden * act_bytes * max(prompt_tokens, DECODE_MEASURED_PROMPT)
    return decode_cache_bytes(shape, prompt_tokens + new_tokens, act_bytes) + logits + prompt_pass


# --- the check row ---------------------------------------------------------------------------------------------


def device_memory_gib(backend: str) -> float | None:
    """The first visible device's memory, read through torch (``cuda``, ``npu``); the host's RAM for ``cpu``."""
    try:
        if backend == "cpu":
            import psutil

            return psutil.virtual_memory().total / GIB
        import torch

        if backend == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        module = getattr(torch, backend)
        if not module.is_available():
            return None
        return module.get_device_properties(0).total_memory / GIB
    except Exception:  # no torch, no device here: the forecast is shown without a verdict
        return None


def forecast_run(
    config, lf: dict[str, Any], device_gib: float | None, host_free_gib: float | None = None, lengths: bool = False
) -> Forecast:
    """The forecast of a run config; raises ``ValueError`` (``UnsupportedModel``) saying why it cannot be made.
    ``lengths``: also the ``cutoff_len`` values that fit ``device_gib`` (``Forecast.lengths``)."""
    from launcher.checks.model import read_config

    raw = read_config(Path(str(lf.get("model_name_or_path", ""))))
    shape = read_shape(raw)
    run = run_shape(shape, raw, config.launcher, config.patches, lf)
    lora = lora_parameters(shape, raw, lf)
    result = forecast(shape, run, lora, device_gib, host_free_gib)
    if lengths and device_gib is not None:
        result.lengths = fitting_lengths(shape, run, lora, device_gib)
    return result


def host_free_gib() -> float | None:
    """The host's available memory now (``psutil.virtual_memory().available``), None where it cannot be read."""
    try:
        import psutil

        return psutil.virtual_memory().available / GIB
    except Exception:  # no psutil: the host check is not made
        return None


def _lengths_line(found: dict[str, list[int]], device_gib: float) -> str:
    def most(values: list[int]) -> str:
        return f"up to {max(values):,}" if values else f"none of {FIT_LENGTHS[0]:,} to {FIT_LENGTHS[-1]:,}"

    def tight(key: str) -> str:
        return f" ({', '.join(f'{n:,}' for n in found[key])} tight)" if found[key] else ""

    text = f"cutoff_len that fits {device_gib:.1f} GiB: {most(found['without'])} tokens without offload_inputs"
    text += tight("without_tight")
    if found["with"] or found["with_tight"]:
        text += f", {most(found['with'])} with it{tight('with_tight')}"
    return text


def check_memory(
    config,
    lf: dict[str, Any],
    backend: str,
    device_gib: float | None = None,
    free_gib: float | None = None,
    *,
    host: bool = True,
    out: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """``(status, detail)`` of the ``memory`` row: ``fail`` for will not fit, ``warn`` for tight or when the
    forecast cannot be made, ``ok`` otherwise. ``device_gib`` (``--device-memory``) overrides what torch reads, and
    then the row lists the ``cutoff_len`` values that fit, with and without ``offload_inputs``; ``free_gib``, the
    least free memory of the run's devices now (preflight's ``devices`` row), is held against the peak too: a peak
    that fits the device but not what other processes leave of it fails. ``host``: the host's free memory is this
    machine's (not a check for another machine): offloaded inputs that need more pinned memory than it has fail.
    ``out`` gets the ``offload_inputs`` decision (``Forecast.offload``) for preflight to pass to the ranks."""
    lengths = device_gib is not None
    if device_gib is None:
        device_gib = device_memory_gib(backend)
    host_gib = host_free_gib() if host else None
    try:
        result = forecast_run(config, lf, device_gib, host_gib, lengths=lengths)
    except (ValueError, OSError) as err:
        return "warn", f"memory forecast not made: {err}"
    if out is not None and result.offload:
        out["offload_inputs"] = {k: result.offload[k] for k in ("setting", "on", "reason")}
    status = {"will not fit": "fail", "tight": "warn"}.get(result.verdict or "", "ok")
    line = result.line()
    if result.lengths:
        line += f"; {_lengths_line(result.lengths, device_gib)}"
    if result.host_gib and host_gib is not None:
        if result.host_gib > host_gib:
            status = "fail"
            line += (
                f"; but the host has only {host_gib:.1f} GiB available for the {_size(result.host_gib)} of pinned "
                "memory the offloaded inputs need: set offload_inputs: false, or free host memory"
            )
        else:
            line += f"; {host_gib:.1f} GiB of host memory available"
    if free_gib is not None and status != "fail":
        if result.peak > free_gib:
            status = "fail"
            line += (
                f"; but only {free_gib:.1f} GiB are free now on the fullest of the run's devices (other "
                "processes hold the rest, see the devices row): WILL NOT FIT beside them"
            )
        else:
            line += f"; {free_gib:.1f} GiB free now on the fullest of the run's devices"
    return status, line


def parse_gib(text: str) -> float:
    """``--device-memory`` as a positive number of GiB; ``ValueError`` with the message the CLI prints."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--device-memory {text!r}: give the device's memory in GiB, such as 64 or 139.8") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--device-memory {text}: must be a positive number of GiB")
    return value
