"""The command-line frame the one-device benchmarks share (``loss_bench``, ``deltanet_bench``, ``attention_bench``,
``norm_bench``, ``lora_bench`` on CUDA, ``collate_bench`` on the CPU): their arguments checked before anything is
written, one results file in ``--out`` that is never overwritten and is rewritten after every reading, and an
interruption (Ctrl-C, ``timeout``, SIGTERM) that keeps the readings done and names the one it cut.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from launcher.files import write_json_atomic

NO_CUDA = "no CUDA device here: run it on a machine with an NVIDIA GPU"


def counts_of(text: str) -> list[int]:
    """Whole numbers separated by commas (``ValueError`` for anything else)."""
    return [int(x) for x in text.split(",") if x.strip()]


def names_of(text: str) -> list[str]:
    """Names separated by commas, in the order given."""
    return [x.strip() for x in text.split(",") if x.strip()]


def below_one(args: argparse.Namespace, *names: str) -> str | None:
    """``--name N: give 1 or more`` for the first of the whole-number options ``names`` (their argparse names) under
    1, or None."""
    for name in names:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more"
    return None


class Results:
    """The benchmark's results file, ``--out``/``name``: a dict written whole after every reading."""

    def __init__(self, prog: str, out: Path, name: str, head: dict[str, Any]) -> None:
        self.prog, self.path, self.data = prog, out / name, head

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    def interrupted(self, where: Any, said: str) -> int:
        """Keep the readings done, with where it stopped (``interrupted_in``); 130, the exit code of an interrupt."""
        self.data["interrupted_in"] = where
        self.save()
        print(f"{self.prog}: interrupted in {said}; the readings done are in {self.path}", file=sys.stderr)
        return 130


def parser(doc: str, results: str, out_holds: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser: its module docstring as the help, and ``--out``, the folder of ``results``."""
    made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("--out", type=Path, required=True, help=f"folder for {out_holds or results}")
    return made


def parse(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    results: str,
    problem: Callable[[argparse.Namespace], str | None],
    needs_cuda: bool = True,
) -> argparse.Namespace | None:
    """The arguments, or None once one line says what is wrong (the caller exits 2): the benchmark's own
    ``problem``, a results file already in ``--out`` (never overwritten), or, where it ``needs_cuda``, no CUDA
    device (torch is imported only after the arguments passed)."""
    args = parser.parse_args(argv)
    why = problem(args)
    if why is None and (args.out / results).exists():
        why = f"{args.out / results} exists; choose another --out, or move that file away"
    if why is None and needs_cuda:
        import torch

        if not torch.cuda.is_available():
            why = NO_CUDA
    if why:
        print(f"{prog}: {why}", file=sys.stderr)
        return None
    return args


def run(main: Callable[[], int]) -> NoReturn:
    """Run ``main`` as the process: ``timeout`` and ``kill`` (SIGTERM) end it as Ctrl-C does, so it keeps what it
    measured."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
