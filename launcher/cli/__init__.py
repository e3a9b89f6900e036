"""The ``launcher`` command: one registry of verbs, each with help and examples, and every argparse line.

Verbs live in three modules (``run_verbs``: start, stop, check; ``view_verbs``: read runs from their
files; ``tool_verbs``: kernels, demo assets, data). Each verb imports what it needs when it runs, so
host-side verbs (``status``, ``logs``, ``list``, ``stop``) start fast and work without torch. Domain
modules define no arguments and print no errors: a ``LauncherError`` is printed here, once, and its
exit code returned.

May import every part of the launcher; nothing imports it but ``__main__``.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

from launcher import __version__
from launcher.cli import run_verbs, tool_verbs, view_verbs
from launcher.cli.registry import Verb
from launcher.errors import LauncherError
from launcher.run.signals import StopRequested, hold_stop_signals, release_stop_signals

# The registry: each module's verbs in the order its VERBS lists them (running, then watching, then tools); the
# internal verbs (hidden) exist only when called by name.
_REGISTERED: tuple[Verb, ...] = (*run_verbs.VERBS, *view_verbs.VERBS, *tool_verbs.VERBS)
VERBS: tuple[Verb, ...] = tuple(v for v in _REGISTERED if not v.hidden) + tuple(v for v in _REGISTERED if v.hidden)
_ALL = {v.name: v for v in VERBS}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``launcher`` parser. ``only`` adds the arguments of that verb alone: some verbs' argument
    functions import their module (validate-kernels, report), which a `status` call should not pay for.
    Internal verbs exist only when called by name, so no help or error message lists them."""
    shown = [v for v in VERBS if not v.hidden]
    parser = argparse.ArgumentParser(
        prog="launcher",
        description="LoRA fine-tuning of hybrid Gated-DeltaNet models (Qwen3.5) with LLaMA-Factory.",
        epilog="examples:\n" + "\n".join(f"  {v.examples.splitlines()[0]}" for v in shown),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"launcher {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        if verb.hidden and verb.name != only:
            continue
        kwargs = {} if verb.hidden else {"help": verb.help}
        p = sub.add_parser(
            verb.name,
            description=verb.help,
            epilog=f"examples:\n  {verb.examples}" if verb.examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )
        if only is None or verb.name == only:
            verb.add_arguments(p)
        p.set_defaults(_run=verb.run)
    return parser


_TAKES_OVERRIDES = {"run", "start", "submit", "check", "preflight", "profile", "_supervise"}


_OPTIONS_WITH_VALUES = ("--json", "--handshake-fd", "--resume")


def _take_overrides(argv: list[str], verb: str | None) -> tuple[list[str], list[str]]:
    """The ``KEY=VALUE`` overrides of a config verb, wherever they stand after the verb (``check CFG
    --no-model lr=1.0e-4``), taken out before argparse sees the rest; and the rest."""
    if verb not in _TAKES_OVERRIDES:
        return argv, []
    at = argv.index(verb) + 1
    rest = argv[at:]
    picked = [
        i
        for i, a in enumerate(rest)
        if "=" in a and not a.startswith("-") and not (i > 0 and rest[i - 1] in _OPTIONS_WITH_VALUES)
    ]
    return argv[:at] + [a for i, a in enumerate(rest) if i not in picked], [rest[i] for i in picked]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    argv, overrides = _take_overrides(argv, chosen)
    ns = build_parser(only=chosen if chosen in _ALL else None).parse_args(argv)
    ns.overrides = overrides
    try:
        # before the config's libraries make threads that would take a stop signal (`resume`: with --foreground)
        if _ALL[ns.verb].supervises and getattr(ns, "foreground", True):
            hold_stop_signals()
        else:
            release_stop_signals()
        return int(ns._run(ns))
    except LauncherError as err:
        _print_error(f"error: {err}")
        return err.exit_code
    except StopRequested as stop:  # before the run existed (run/signals.py: the hold's guard)
        _print_error(stop.before_the_run())
        return 128 + stop.signum
    except KeyboardInterrupt as stop:  # Ctrl-C, or a stop signal taken as it (run/signals.py: SignalInterrupt)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except BrokenPipeError:  # `launcher status | head`: the reader had enough; no traceback
        _detach(sys.stdout)
        return 128 + signal.SIGPIPE
    except OSError as err:
        if err.errno != errno.EIO:
            raise
        _detach(sys.stdout, sys.stderr)  # the terminal closed under us (EIO): nobody is left to read a traceback
        return 128 + signal.SIGHUP


def _print_error(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        _detach(sys.stderr)


def _detach(*streams) -> None:
    """Point closed output streams at /dev/null, so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in streams:
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    os.close(devnull)


__all__ = ["VERBS", "build_parser", "main"]
