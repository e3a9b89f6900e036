"""Launcher for LoRA fine-tuning of hybrid Gated-DeltaNet models with LLaMA-Factory."""

__version__ = "0.1.0"
