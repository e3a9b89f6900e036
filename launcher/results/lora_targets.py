"""Which modules a LoRA config adapts in a Qwen3.5 model, derived from ``config.json`` alone.

Host side, no torch: the module names are rebuilt from the config the way transformers 5.6 names
them, and the selection follows LLaMA-Factory 0.9.5 (``model/adapter.py::_setup_lora_tuning``):

- ``lora_target: all`` becomes the short names of every ``*Linear*`` module, minus ``lm_head``, the
  multi-modal projector and (with the default ``freeze_vision_tower: true``) the vision tower
  (``model/model_utils/misc.py::find_all_linear_modules``);
- for composite models such as ``qwen3_5`` the short names are then matched as *substrings* of the
  full module names, dropping the vision tower, the projector and ``patch_embed``
  (``model/model_utils/visual.py::patch_target_modules`` and the ``qwen3_5`` registration);
- for the text-only ``qwen3_5_text`` peft's own rule applies: a name matches a target when it equals
  it or ends with ``.<target>``.

Layer names (Qwen3.5): full-attention layers have ``self_attn.{q,k,v,o}_proj``; Gated DeltaNet
(linear-attention) layers have ``linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}``;
every layer has ``mlp.{gate,up,down}_proj``. So ``q_proj,k_proj,v_proj,o_proj`` adapts only the
full-attention layers (16 of 64 in Qwen3.5-27B: 64 modules, 128 LoRA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
VISION_BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")

# LLaMA-Factory 0.9.5, model/model_utils/visual.py: _register_composite_model(model_type="qwen3_5", ...)
_QWEN3_5_VISION_KEYS = ("visual.pos_embed", "visual.patch_embed", "visual.blocks")
_QWEN3_5_PROJECTOR_KEYS = ("model.visual.merger",)
_QWEN3_5_LORA_CONFLICT_KEYS = ("patch_embed",)
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class UnsupportedModel(ValueError):
    """The expected modules cannot be derived for this model or LoRA setting; the message says why."""


@dataclass(frozen=True)
class ModelLayout:
    """The parts of a Qwen3.5 model that LoRA can target, rebuilt from its ``config.json``."""

    model_type: str
    layer_types: tuple[str, ...]
    vision_depth: int

    @property
    def composite(self) -> bool:
        return self.model_type == "qwen3_5"

    @property
    def layer_prefix(self) -> str:
        return "model.language_model.layers" if self.composite else "model.layers"

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    def linear_modules(self) -> list[str]:
        """Full names of every Linear module (plus the vision patch-embedding conv), in model order."""
        names = []
        if self.composite:
            names.append("model.visual.patch_embed.proj")  # a Conv3d, never a Linear
            for j in range(self.vision_depth):
                names.extend(f"model.visual.blocks.{j}.{leaf}" for leaf in VISION_BLOCK_LINEARS)
            names.extend(("model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"))
        for i, kind in enumerate(self.layer_types):
            layer = f"{self.layer_prefix}.{i}"
            if kind == FULL_ATTENTION:
                names.extend(f"{layer}.self_attn.{p}" for p in ATTENTION_PROJECTIONS)
            else:
                names.extend(f"{layer}.linear_attn.{p}" for p in DELTANET_PROJECTIONS)
            names.extend(f"{layer}.mlp.{p}" for p in MLP_PROJECTIONS)
        names.append("lm_head")
        return names


def read_model_layout(config: dict[str, Any]) -> ModelLayout:
    """The layout of a Qwen3.5 model from its parsed ``config.json``.

    Raises:
        UnsupportedModel: the model type is not Qwen3.5, or the layer pattern is inconsistent.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not one this check knows; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    text = (config.get("text_config") or {}) if model_type == "qwen3_5" else config
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise UnsupportedModel(f"num_hidden_layers is {layers!r} in the model config; expected a positive int")
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' Qwen3_5TextConfig derives it the same way
        interval = text.get("full_attention_interval", 4)
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise UnsupportedModel(
            f"layer_types has {len(layer_types)} entries {sorted(set(layer_types))} for num_hidden_layers "
            f"{layers}; expected one of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r} per layer"
        )
    depth = int((config.get("vision_config") or {}).get("depth", 0)) if model_type == "qwen3_5" else 0
    return ModelLayout(model_type, tuple(layer_types), depth)


def split_targets(value: Any) -> list[str]:
    """LLaMA-Factory's comma-separated ``lora_target`` as a list (its default is ``all``)."""
    if value is None:
        return ["all"]
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(t).strip() for t in items if str(t).strip()]


def expected_lora_modules(layout: ModelLayout, lf_args: dict[str, Any]) -> list[str]:
    """Full names of the modules LLaMA-Factory wraps with LoRA for these arguments, in model order.

    Raises:
        UnsupportedModel: for settings whose selection is not rebuilt here (not LoRA, LLaMA Pro,
            resuming from an existing adapter).
    """
    kind = lf_args.get("finetuning_type", "lora")
    if kind != "lora":
        raise UnsupportedModel(f"finetuning_type is {kind!r}; this check covers LoRA adapters only")
    for key in ("use_llama_pro", "adapter_name_or_path"):
        if lf_args.get(key):
            raise UnsupportedModel(f"{key} is set; the adapted modules then come from elsewhere")
    targets = split_targets(lf_args.get("lora_target"))
    freeze_vision = bool(lf_args.get("freeze_vision_tower", True))
    freeze_projector = bool(lf_args.get("freeze_multi_modal_projector", True))
    linear = [n for n in layout.linear_modules() if n != "model.visual.patch_embed.proj"]
    if targets == ["all"]:
        forbidden = {"lm_head"}
        if layout.composite:
            forbidden.update(_QWEN3_5_PROJECTOR_KEYS)
            if freeze_vision:
                forbidden.update(_QWEN3_5_VISION_KEYS)
        targets = sorted({n.rsplit(".", 1)[-1] for n in linear if not any(f in n for f in forbidden)})
    if not layout.composite:
        return [n for n in linear if any(n == t or n.endswith(f".{t}") for t in targets)]
    forbidden = set(_QWEN3_5_LORA_CONFLICT_KEYS)
    if freeze_vision:
        forbidden.update(_QWEN3_5_VISION_KEYS)
    if freeze_projector:
        forbidden.update(_QWEN3_5_PROJECTOR_KEYS)
    return [n for n in layout.linear_modules() if any(t in n for t in targets) and not any(f in n for f in forbidden)]


def describe_coverage(layout: ModelLayout, modules: list[str]) -> tuple[str, str]:
    """A short verdict and a sentence naming what ``modules`` cover, per layer kind.

    Returns:
        ``(verdict, detail)``; the verdict is e.g. ``"full-attention projections only"`` or
        ``"full-attention and DeltaNet projections"``.
    """
    groups = {"self_attn": {}, "linear_attn": {}, "mlp": {}}
    other = []
    prefix = layout.layer_prefix + "."
    for name in modules:
        parts = name[len(prefix) :].split(".") if name.startswith(prefix) else []
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in groups:
            groups[parts[1]].setdefault(parts[2], set()).add(int(parts[0]))
        else:
            other.append(name)
    full, linear = layout.layers_of(FULL_ATTENTION), layout.layers_of(LINEAR_ATTENTION)
    every = list(range(len(layout.layer_types)))

    def _part(label: str, found: dict[str, set[int]], order: tuple[str, ...], of: list[int]) -> str:
        if not found:
            return f"{label}: not adapted ({len(of)} layers)"
        names = [n for n in order if n in found] + sorted(set(found) - set(order))
        layers = set().union(*found.values())
        return f"{label}: {', '.join(names)} in {len(layers)} of {len(of)} layers"

    detail = [
        _part("full attention", groups["self_attn"], ATTENTION_PROJECTIONS, full),
        _part("DeltaNet", groups["linear_attn"], DELTANET_PROJECTIONS, linear),
        _part("MLP", groups["mlp"], MLP_PROJECTIONS, every),
    ]
    if other:
        detail.append(f"other: {len(other)} module(s) such as {other[0]}")
    covered = [
        label
        for label, key in (("full-attention", "self_attn"), ("DeltaNet", "linear_attn"), ("MLP", "mlp"))
        if groups[key]
    ]
    if not covered and not other:
        verdict = "nothing"
    elif covered == ["full-attention"] and not other:
        verdict = "full-attention projections only"
    else:
        names = covered + (["other"] if other else [])
        verdict = (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + " projections"
    return verdict, "; ".join(detail)
