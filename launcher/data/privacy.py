"""Keep conversation text out of training logs (counselling data is sensitive).

LLaMA-Factory 0.9.5 prints the first processed training and evaluation sample, token ids and decoded
text, from ``llamafactory/data/loader.py::_get_preprocessed_dataset``
(``if training_args.should_log: ... dataset_processor.print_data_example(...)``): on the main process
of every node, with no config switch to turn it off. It also quotes whole records in warnings when
it drops a malformed one (``data/processor/*.py``: "Dropped invalid example: ..."; ``data/converter.py``:
"Invalid role tag in ...", "Invalid message count in ...").

``protect_training_log()`` replaces ``print_data_example`` on every dataset processor class with a
version that prints only token counts, and puts a filter on LLaMA-Factory's data loggers that
withholds the quoted records (logger-level, so it covers every handler, including the
``running_log.txt`` one LLaMA-Factory adds later). It is idempotent and must run in each rank before
``run_exp``; ``launcher.entry`` calls it unless the run config asks for the dump with
``launcher.log_examples: true`` (read by ``log_examples_wanted``).

Written against llamafactory 0.9.5. Delete when LLaMA-Factory gets a switch for the example dump
(check ``_get_preprocessed_dataset``). ``tests/data/test_data_stats.py`` checks a real run's log for a
sentinel string from the training data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from launcher.state.runfiles import read_launch
from launcher.state.runs import CONFIG_COPY

LOG_EXAMPLES_KEY = "log_examples"  # launcher.log_examples in the run config
WITHHELD = "text withheld; set launcher.log_examples: true to print it"
# LLaMA-Factory warnings that quote a whole record, by their fixed beginning
QUOTING_WARNINGS = ("Dropped invalid example:", "Invalid role tag in", "Invalid message count in")
DATA_LOGGERS = (
    "llamafactory.data.converter",
    "llamafactory.data.processor.supervised",
    "llamafactory.data.processor.unsupervised",
    "llamafactory.data.processor.pairwise",
    "llamafactory.data.processor.feedback",
    "llamafactory.data.processor.pretrain",
)
_ORIGINALS: dict[type, Any] = {}


class WithholdRecordText(logging.Filter):
    """Rewrites LLaMA-Factory warnings that quote a record to their fixed beginning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for prefix in QUOTING_WARNINGS:
            if message.startswith(prefix):
                record.msg, record.args = f"{prefix} [record {WITHHELD}]", ()
        return True


def _print_counts(self: Any, example: dict[str, list[int]]) -> None:
    """Stands in for ``print_data_example``: lengths only, for every processor's field names."""
    from llamafactory.extras.constants import IGNORE_INDEX

    parts = []
    for key, ids in example.items():
        if key.endswith("input_ids"):
            labels = example.get(key.replace("input_ids", "labels")) or []
            supervised = sum(1 for t in labels if t != IGNORE_INDEX)
            parts.append(f"{key}: {len(ids)} tokens, {supervised} supervised")
    print(f"{'; '.join(parts) or 'no token ids'} ({WITHHELD})")


def _processor_classes() -> list[type]:
    from llamafactory.data.processor import processor_utils

    found, todo = [], [processor_utils.DatasetProcessor]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "print_data_example" in vars(cls) and cls is not processor_utils.DatasetProcessor:
            found.append(cls)
    return found


def protect_training_log() -> list[str]:
    """Stop LLaMA-Factory from writing training text to the log; safe to call more than once.

    Returns:
        The names of the processor classes whose example dump was replaced (proof for a run record).
    """
    import llamafactory.data.processor  # noqa: F401  (registers every processor class)

    patched = []
    for cls in _processor_classes():
        if cls not in _ORIGINALS:
            _ORIGINALS[cls] = vars(cls)["print_data_example"]
            cls.print_data_example = _print_counts
        patched.append(cls.__name__)
    withhold_record_warnings()
    return sorted(patched)


def withhold_record_warnings() -> None:
    """Only the logging half of ``protect_training_log`` (for tools that read data but do not train)."""
    for name in DATA_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, WithholdRecordText) for f in logger.filters):
            logger.addFilter(WithholdRecordText())


def restore_training_log() -> None:
    """Undo ``protect_training_log`` (tests)."""
    for cls, original in _ORIGINALS.items():
        cls.print_data_example = original
    _ORIGINALS.clear()
    for name in DATA_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, WithholdRecordText)]:
            logger.removeFilter(f)


def log_examples_wanted(run_dir: Path) -> bool:
    """Whether the run asked for LLaMA-Factory's example dump (``launcher.log_examples: true``).

    Read from ``launch.json`` when the launcher writes the key there, else from the run's copy of the
    config (``config.yaml``); absent or unreadable means no.
    """
    launch, _ = read_launch(run_dir)
    if launch is not None and launch.log_examples is not None:
        return launch.log_examples
    try:
        config = yaml.safe_load((run_dir / CONFIG_COPY).read_text())
    except (OSError, yaml.YAMLError):
        return False
    section = config.get("launcher") if isinstance(config, dict) else None
    return isinstance(section, dict) and section.get(LOG_EXAMPLES_KEY) is True


__all__ = ["log_examples_wanted", "protect_training_log", "restore_training_log", "withhold_record_warnings"]
