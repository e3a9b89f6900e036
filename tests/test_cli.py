"""The CLI registry: every verb is reachable and documented with an example."""

from __future__ import annotations

import pytest

from launcher.cli import VERBS, build_parser, main
from tests.conftest import launcher_cmd


def test_top_level_help_lists_every_verb():
    text = build_parser().format_help()
    for verb in VERBS:
        assert (verb.name in text) != verb.hidden


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
