"""LLaMA-Factory's own data machinery, set up from a run config, to measure what training will see.

``load_lf_data`` parses the config with LLaMA-Factory's ``ModelArguments``/``DataArguments``, loads the
tokenizer and processor with ``llamafactory.model.load_tokenizer`` and the template with
``get_template_and_fix_tokenizer``, exactly as ``run_sft`` does. ``load_splits`` reads the registered
datasets (``get_dataset_list``) and aligns every record with LLaMA-Factory's converters, so samples have
the same ``_prompt``/``_response``/``_system`` it feeds its ``SupervisedDatasetProcessor``.

Limits: local files only (json, jsonl; other types through ``datasets``); ``val_size`` is reproduced
with the same ``train_test_split`` call and seed; ``num_samples`` and interleaved mixing are not (a note
says so). Needs the training stack.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from launcher.errors import LauncherError


class StatsError(LauncherError):
    """The config or its data cannot be measured; the message says what, the value, and the fix."""


@dataclass
class LFData:
    """Tokenizer, processor, template and arguments as LLaMA-Factory builds them for training."""

    tokenizer: Any
    processor: Any
    template: Any
    model_args: Any
    data_args: Any
    seed: int
    notes: list[str] = field(default_factory=list)


def load_lf_data(lf: dict[str, Any]) -> LFData:
    """Build LLaMA-Factory's tokenizer, processor and template from the LLaMA-Factory part of a config.

    Raises:
        StatsError: the arguments are refused, or the tokenizer or template cannot be loaded.
    """
    from llamafactory.data.template import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer
    from transformers import HfArgumentParser

    if lf.get("stage", "sft") != "sft":
        raise StatsError(f"stage: {lf.get('stage')!r}; data stats measure supervised samples (stage: sft)")
    try:
        model_args, data_args = HfArgumentParser((ModelArguments, DataArguments)).parse_dict(lf, allow_extra_keys=True)
    except (ValueError, TypeError) as err:
        raise StatsError(f"LLaMA-Factory refuses the config: {err}") from err
    if not data_args.dataset:
        raise StatsError("dataset: missing; name the training dataset(s) registered in dataset_info.json")
    try:
        module = load_tokenizer(model_args)
    except OSError as err:
        raise StatsError(
            f"model_name_or_path: cannot load a tokenizer from {model_args.model_name_or_path!r} ({err}); "
            "point it at the model folder with tokenizer.json"
        ) from err
    try:
        template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    except ValueError as err:
        raise StatsError(f"template: {data_args.template!r}: {err}") from err
    return LFData(
        tokenizer=module["tokenizer"],
        processor=module["processor"],
        template=template,
        model_args=model_args,
        data_args=data_args,
        seed=int(lf.get("seed", 42)),
    )


class _Row(dict):
    """A record whose absent columns read as None, as they do after ``datasets`` unifies a JSON schema."""

    def __missing__(self, key: str) -> None:
        return None


def _read_rows(files: list[str], attr_name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in files:
        ext = os.path.splitext(path)[1][1:]
        try:
            if ext == "json":
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                if not isinstance(data, list):
                    raise StatsError(f"{attr_name}: {path} holds a JSON {type(data).__name__}; expected an array")
                rows.extend(data)
            elif ext == "jsonl":
                with open(path, encoding="utf-8") as f:
                    rows.extend(json.loads(line) for line in f if line.strip())
            else:
                rows.extend(_read_with_datasets(path, ext))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StatsError(f"{attr_name}: cannot read {path} ({err.__class__.__name__}: {err})") from err
    return rows


def _read_with_datasets(path: str, ext: str) -> list[dict[str, Any]]:
    from datasets import load_dataset
    from llamafactory.extras.constants import FILEEXT2TYPE

    if ext not in FILEEXT2TYPE:
        raise StatsError(f"{path}: file type .{ext} is not one LLaMA-Factory reads ({', '.join(FILEEXT2TYPE)})")
    return list(load_dataset(FILEEXT2TYPE[ext], data_files=[path], split="train"))


def _load_names(lfd: LFData, names: list[str]) -> list[dict[str, Any]]:
    """Aligned samples of the named datasets, concatenated in order (LLaMA-Factory's ``concat`` mix)."""
    from llamafactory.data.converter import get_dataset_converter
    from llamafactory.data.parser import get_dataset_list

    data_args = lfd.data_args
    try:
        attrs = get_dataset_list(names, data_args.dataset_dir)
    except ValueError as err:
        raise StatsError(
            f"dataset {names} in {data_args.dataset_dir}: {err} (register it with `launcher data prepare` or in "
            "dataset_info.json)"
        ) from err
    samples: list[dict[str, Any]] = []
    for attr in attrs:
        if attr.load_from != "file":
            raise StatsError(f"{attr}: loaded from {attr.load_from}; data stats read local files only")
        local = os.path.join(data_args.dataset_dir, attr.dataset_name)
        if os.path.isdir(local):
            files = sorted(os.path.join(local, n) for n in os.listdir(local))
        elif os.path.isfile(local):
            files = [local]
        else:
            raise StatsError(f"{attr}: file {local} not found (check file_name in dataset_info.json and dataset_dir)")
        rows = _read_rows(files, str(attr))
        if attr.num_samples is not None:
            lfd.notes.append(
                f"{attr}: num_samples ({attr.num_samples}) is a random draw in training; all rows measured"
            )
        if data_args.max_samples is not None:
            rows = rows[: data_args.max_samples]
        converter = get_dataset_converter(attr.formatting, attr, data_args)
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise StatsError(f"{attr}: row {index} is a {type(row).__name__}; expected an object")
            try:
                samples.append(converter(_Row(row)))
            except (KeyError, TypeError, ValueError, AttributeError) as err:  # what training would crash on
                raise StatsError(
                    f"{attr}: row {index} does not fit its dataset_info.json entry ({err.__class__.__name__} "
                    f"{err}); check 'formatting', 'columns' and 'tags'"
                ) from err
    return samples


def load_splits(lfd: LFData) -> dict[str, list[dict[str, Any]]]:
    """``{"train": [...], "validation": [...]}`` of aligned samples, split as LLaMA-Factory splits them."""
    from launcher.data.privacy import withhold_record_warnings

    withhold_record_warnings()  # LLaMA-Factory's converters quote whole records when they skip one
    data_args = lfd.data_args
    if data_args.streaming:
        lfd.notes.append("streaming: samples are measured in file order, not in the shuffled streaming order")
    if len(data_args.dataset) > 1 and data_args.mix_strategy != "concat":
        lfd.notes.append(f"mix_strategy {data_args.mix_strategy}: measured as a plain concatenation")
    train = _load_names(lfd, data_args.dataset)
    splits = {"train": train}
    if data_args.eval_dataset:
        splits["validation"] = _load_names(lfd, data_args.eval_dataset)
    elif data_args.val_size > 1e-6:
        from datasets import Dataset

        # the same call as llamafactory.data.data_utils.split_dataset, on row numbers instead of rows
        size = int(data_args.val_size) if data_args.val_size > 1 else data_args.val_size
        parts = Dataset.from_dict({"row": list(range(len(train)))}).train_test_split(test_size=size, seed=lfd.seed)
        splits = {
            "train": [train[i] for i in parts["train"]["row"]],
            "validation": [train[i] for i in parts["test"]["row"]],
        }
    return splits


__all__ = ["LFData", "StatsError", "load_lf_data", "load_splits"]
