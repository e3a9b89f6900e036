"""The CLI registry: every verb is reachable and documented with an example."""

from __future__ import annotations

import pytest

from launcher.cli import VERBS, build_parser, main
from tests.support.common import launcher_cmd


def test_top_level_help_lists_every_verb():
    """Read from the modules that register verbs, not from the CLI's own list: a verb registered there is in
    ``launcher --help`` (the help once came from a hand-kept order that dropped what it left out)."""
    from launcher.cli import run_verbs, tool_verbs, view_verbs

    text = build_parser().format_help()
    registered = [*run_verbs.VERBS, *view_verbs.VERBS, *tool_verbs.VERBS]
    assert len({v.name for v in registered}) == len(registered) and set(VERBS) == set(registered)
    for verb in registered:
        assert (f"\n    {verb.name}" in text) != verb.hidden, verb.name


@pytest.mark.parametrize("verb", [v.name for v in VERBS if not v.hidden])
def test_every_verb_has_help_with_an_example(verb, capsys):
    with pytest.raises(SystemExit) as info:
        main([verb, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"launcher {verb}" in out


def test_console_entry_runs_without_a_verb_as_a_usage_error():
    proc = launcher_cmd()
    assert proc.returncode == 2 and "VERB" in proc.stderr


def test_host_verbs_find_runs_from_launcher_root_or_a_configs_output_root(tmp_path):
    """Without --root, the runs folder is $LAUNCHER_ROOT, or the output_root of the config given with --config."""
    import os

    from tests.support.fake_runs import crafted_run, launcher

    run_dir = crafted_run(tmp_path, name="r-20261201-101500", state="FAILED", ended="2026-12-01T10:20:00+00:00")
    env = {**os.environ, "LAUNCHER_ROOT": str(run_dir.parent)}
    shown = launcher("status", "--json", env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert '"run_id": "r-20261201-101500"' in shown.stdout
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"launcher:\n  output_root: {run_dir.parent}\nstage: sft\n")
    listed = launcher("list", "--config", cfg, timeout=60)
    assert listed.returncode == 0 and "r-20261201-101500" in listed.stdout and "FAILED" in listed.stdout
    nowhere = launcher("status", "--root", tmp_path / "none", timeout=60)
    assert nowhere.returncode == 2 and "LAUNCHER_ROOT" in nowhere.stderr and "Traceback" not in nowhere.stderr


@pytest.mark.parametrize(("raised", "status"), [("ctrl-c", 130), ("sigterm", 143), ("sighup", 129)])
def test_an_interrupt_exits_128_plus_the_signal_that_made_it(monkeypatch, raised, status):
    """Ctrl-C ends a verb with 130; a stop signal a verb takes as Ctrl-C (``SignalInterrupt``, as ``launcher
    evaluate`` does while its child runs) with 128 + that signal, as a process killed by it would."""
    import dataclasses
    import signal

    from launcher import cli
    from launcher.run.signals import SignalInterrupt

    error = {
        "ctrl-c": KeyboardInterrupt(),
        "sigterm": SignalInterrupt(signal.SIGTERM),
        "sighup": SignalInterrupt(signal.SIGHUP),
    }[raised]

    def interrupted(ns):
        raise error

    verbs = [dataclasses.replace(v, run=interrupted) if v.name == "status" else v for v in cli.VERBS]
    monkeypatch.setattr(cli, "VERBS", verbs)
    assert cli.main(["status"]) == status
