"""Damaged and planted records (issue 30): every host verb answers in one line with a documented exit code,
changes no file, and `list` still lists every other run; tail reads stay linear; outside text is escaped."""

from __future__ import annotations

import hashlib
import json
import random
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher.cli import main
from launcher.errors import ExitCode
from launcher.state import trainer_log
from launcher.state.procs import identity
from launcher.state.record import RecordUnreadable, read_record
from tests.support.fake_runs import crafted_run, launcher, spawn

VERBS = ("status", "list", "stop", "resume", "verify", "report", "logs")
DOCUMENTED = {int(c) for c in ExitCode}
# values of every JSON kind, and the shapes the issue's probes used
ODD = [5, -1, 2.5, True, None, "x", "", [], [1], {}, {"a": 1}, [{"a": "x"}], {"pid": "x"}, "a\nb\x1b[2J", 10**30]
# ... and what only raw JSON text holds (issue 64): past Python's int() digit limit, non-finite numbers, lone
# surrogates, a timestamp without an offset, a list of a million entries
RAW = [
    "9" * 5000,
    "-" + "1" * 4400,
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    '"\\ud800"',
    '"x\\udfffy"',
    '"2026-12-07T10:00:00"',
    "[" + ",".join(["{}"] * 1_000_001) + "]",
]


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def mutations(record: dict[str, Any], seed: int = 30) -> list[tuple[str, bytes]]:
    """Damaged ``status.json`` contents: each field given a value of every other kind or removed, plus whole-file
    damage (truncation, bytes that are not UTF-8, another JSON value, deep nesting). Seeded: the same every run."""
    rng = random.Random(seed)
    found = []
    for key in record:
        for value in rng.sample(ODD, 5):
            found.append((f"{key}={value!r}", json.dumps({**record, key: value}).encode()))
        for raw in rng.sample(RAW, 3):  # values json.dumps cannot write: spliced in as JSON text
            found.append((f"{key}={raw[:20]}", json.dumps({**record, key: "<raw>"}).replace('"<raw>"', raw).encode()))
        found.append((f"no {key}", json.dumps({k: v for k, v in record.items() if k != key}).encode()))
    text = json.dumps(record).encode()
    found += [
        ("truncated", text[: len(text) // 2]),
        ("not utf-8", b"\xff\xfe" + text),
        ("a list", b"[1, 2]"),
        ("empty", b""),
        ("nested 200,000 deep", b'{"a":' * 200_000 + b"1" + b"}" * 200_000),
        (
            "deep in a field",
            json.dumps({**record, "acceptance": 1}).replace("1}", "[" * 40 + "]" * 40 + "}", 1).encode(),
        ),
    ]
    return found


@pytest.mark.slow
def test_every_host_verb_answers_mutated_records_in_one_line(tmp_path: Path, capsys) -> None:
    root = tmp_path / "runs"
    good = crafted_run(tmp_path, name="good", state="SUCCEEDED", exit_code=0)
    bad = crafted_run(tmp_path, name="bad", state="SUCCEEDED", exit_code=0)
    record = json.loads((bad / "status.json").read_text())
    unreadable = 0
    for what, content in mutations(record):
        (bad / "status.json").write_bytes(content)
        try:
            read_record(bad)
            continue  # still a valid record (e.g. an optional field removed): not this test's case
        except RecordUnreadable:
            unreadable += 1
        before = snapshot(root)
        for verb in VERBS:
            args = [verb, "--root", str(root)] if verb == "list" else [verb, str(bad)]
            code = main(args)
            out, err = capsys.readouterr()
            assert code in DOCUMENTED, (what, verb, code)
            assert snapshot(root) == before, (what, verb)
            if verb == "list":  # the good run is listed; the bad one is one row saying why
                assert "good" in out and f"unreadable: {bad / 'status.json'}" in out, (what, out)
                assert len(out.splitlines()) == 3, (what, out)
            elif verb != "logs":  # logs shows the job's log, which needs no record
                assert code == ExitCode.FAILED, (what, verb, out, err)
                assert err.startswith(f"error: unreadable: {bad / 'status.json'} (") and err.count("\n") == 1, (
                    what,
                    verb,
                    err,
                )
    assert unreadable > 50  # the generator really produced damaged records (66 with this seed)
    assert good.exists()


ISSUE_PROBES = {"processes": 5, "supervisor": "x", "progress": "x", "attempts": {"a": 1}}


@pytest.mark.parametrize("field", sorted(ISSUE_PROBES))
def test_list_lists_every_other_run_next_to_a_wrong_typed_record(tmp_path: Path, field: str) -> None:
    crafted_run(tmp_path, name="a-good", state="FAILED", exit_code=1)
    bad = crafted_run(tmp_path, name="b-bad", **{field: ISSUE_PROBES[field]})
    proc = launcher("list", "--root", tmp_path / "runs", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = proc.stdout.splitlines()
    assert len(rows) == 3 and rows[1].startswith("a-good") and "FAILED" in rows[1], rows
    assert f"unreadable: {bad / 'status.json'} (field {field!r}:" in rows[2], rows
    for verb in ("status", "stop", "resume"):
        proc = launcher(verb, bad, timeout=60)
        assert proc.returncode == ExitCode.FAILED, (verb, proc.stderr)
        assert proc.stderr.startswith("error: unreadable:") and proc.stderr.count("\n") == 1, (verb, proc.stderr)


def test_a_record_nested_200000_deep_is_refused_before_parsing(tmp_path: Path) -> None:
    run = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    (run / "status.json").write_bytes(b'{"a":' * 200_000 + b"1" + b"}" * 200_000)
    for verb in ("status", "verify", "report"):
        proc = launcher(verb, run, timeout=60)
        assert proc.returncode == ExitCode.FAILED and "RecursionError" not in proc.stderr, (verb, proc.stderr)
        assert proc.stderr == f"error: unreadable: {run / 'status.json'} (nested more than 32 levels deep)\n"
    assert not (run / "verify.json").exists() and not (run / "report.md").exists()


@pytest.mark.slow
def test_status_skips_a_100_mb_line_and_shows_the_step_before_it(tmp_path: Path) -> None:
    run = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    line = json.dumps({"current_steps": 7, "total_steps": 10, "loss": 1.5}).encode()
    with open(run / "output" / "trainer_log.jsonl", "wb") as f:
        f.write(line + b"\n" + b"x" * (100 << 20) + b"\n")  # one write of a 100 MB line
    proc = launcher("status", run, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["step"] == 7 and info["trainer_log_long_lines_skipped"] == 1, info


def test_tail_memory_stays_within_the_line_cap(tmp_path: Path) -> None:
    """The old reader rebuilt its buffer per block (quadratic time, the whole line in memory); this one holds
    at most the cap and a block, and reads each byte once."""
    log = tmp_path / "trainer_log.jsonl"
    line = json.dumps({"current_steps": 3, "total_steps": 10, "loss": 1.0}).encode()
    long = 8 << 20
    with open(log, "wb") as f:
        f.write(line + b"\n" + b"y" * long + b"\n")
    tracemalloc.start()
    try:
        tail = trainer_log.read_tail(log, count=2, max_line=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r["current_steps"] for r in tail.records] == [3] and tail.long_lines_skipped == 1
    assert tail.bytes_read == log.stat().st_size - 1  # each byte once (the last newline was read on its own)
    assert peak < long // 2, peak


def test_a_half_written_last_line_over_the_cap_is_dropped_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "trainer_log.jsonl"
    log.write_bytes(b'{"current_steps": 1, "total_steps": 2, "loss": 1.0}\n' + b"z" * 5000)
    tail = trainer_log.read_tail(log, count=5, block=512, max_line=1000)
    assert [r["current_steps"] for r in tail.records] == [1] and tail.long_lines_skipped == 1


def test_a_sender_command_line_cannot_add_rows_to_status(tmp_path: Path) -> None:
    forged = "kill 1\nstate       SUCCEEDED\x1b[2J"
    run = crafted_run(tmp_path, state="CANCELLED", exit_code=0, stopped_by=forged, reason="boom\x1b]0;title\x07")
    proc = launcher("status", run, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and proc.stdout.count("\nstate ") == 1, proc.stdout
    assert "stopped by  kill 1\\nstate       SUCCEEDED\\x1b[2J" in proc.stdout, proc.stdout


def test_verify_refuses_a_live_run_and_writes_nothing(tmp_path: Path) -> None:
    live = spawn([sys.executable, "-c", "import time; time.sleep(120)", "launcher", "_supervise"], "_supervise")
    try:
        run = crafted_run(tmp_path, supervisor=identity(psutil.Process(live.pid)))
        proc = launcher("verify", run, timeout=60)
        assert proc.returncode == ExitCode.REFUSED, proc.stderr
        assert proc.stderr.startswith(f"error: run {run.name} is RUNNING, not ended: verify judges"), proc.stderr
        assert not (run / "verify.json").exists()
    finally:
        live.kill()
        live.wait()


def test_a_lock_planted_as_a_symlink_refuses_the_run_in_one_line(tmp_path: Path) -> None:
    from launcher.run.lock import RunLock

    root = tmp_path / "out"
    root.mkdir()
    target = tmp_path / "elsewhere"
    (root / "launcher.lock").symlink_to(target)
    with pytest.raises(Exception) as caught:
        RunLock(root).acquire()
    assert type(caught.value).__name__ == "LauncherError" and caught.value.exit_code == ExitCode.USAGE
    assert str(caught.value).startswith(f"the run lock {root / 'launcher.lock'} is a symbolic link (to {target})")
    assert not target.exists() and sorted(p.name for p in root.iterdir()) == ["launcher.lock"]


def test_a_container_runs_record_is_readable_with_its_image_mapping(tmp_path):
    """What a supervisor in a container writes (``procs.container_identity``) passes the record's type check."""
    from launcher.state.record import Container, RunRecord, type_problem

    container = {
        "name": "deltanet-train-cpu",
        "id": "fa4c" * 16,
        "image": {"tag": "deltanet-launcher:cpu", "digest": "sha256:" + "6" * 64},
    }
    assert type_problem(container, Container) is None
    assert type_problem({**container, "image": 5}, Container) is not None
    assert "container" in RunRecord.__dataclass_fields__


# the records beside status.json that host verbs read: each planted damaged, one at a time, in a run whose record
# is whole (the run ended, so `stop` and `resume` only read and answer)
SIDE_RECORDS = (
    "events.jsonl",
    "launch.json",
    "manifest.json",
    "save_on_stop.json",
    "stop_saved.json",
    "stop_request.json",
    "save_request.json",
    "verify.json",
    "evaluate.json",
    "output/trainer_state.json",
    "output/trainer_log.jsonl",
    "output/best_adapter.json",
    "proof/rank0/checkpoint_all_layers.json",
    "errors/rank0.json",
    "../launcher.lock.owner.json",
)
SIDE_DAMAGE = [
    ("a number", b"5"),
    ("a string", b'"x"'),
    ("a list", b"[1, [2]]"),
    ("not utf-8", b"\xff\xfe{"),
    ("truncated", b'{"step": 3, "pa'),
    ("empty", b""),
    ("nested 200,000 deep", b"[" * 200_000),
    (
        "wrong-typed fields",
        json.dumps(
            {
                k: {"a": [1]}
                for k in (
                    "step",
                    "pid",
                    "state",
                    "event",
                    "path",
                    "current_steps",
                    "log_history",
                    "checkpoint",
                    "time",
                    "now",
                    "by",
                    "grace_s",
                )
            }
        ).encode(),
    ),
    ("odd lines", b'5\n"x"\n[1]\n{"current_steps": "x", "loss": []}\n{"event": 5}\n'),
]
OUTPUTS = {"report.md", "report.json", "verify.json"}  # what `report` and `verify` write when they can judge


@pytest.mark.slow
def test_every_host_verb_answers_damaged_side_records_without_a_traceback(tmp_path: Path, capsys) -> None:
    """Each record beside status.json (events, launch and manifest, the save-on-stop files, the stop request,
    verify and evaluate results, the Trainer's state and log, the kept adapter's record, proofs, a rank's error
    record, the lock's owner file) planted with each kind of damage: every host verb ends with a documented exit
    code and no traceback, leaves the damaged file as it was, and changes no other file but its own outputs."""
    root = tmp_path / "runs"
    run = crafted_run(tmp_path, name="bad", state="SUCCEEDED", exit_code=0)
    crafted_run(tmp_path, name="good", state="FAILED", exit_code=1)
    for name in SIDE_RECORDS:
        path = (run / name).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        for what, content in SIDE_DAMAGE:
            for verb in VERBS:
                path.write_bytes(content)
                for output in OUTPUTS - {name}:
                    (run / output).unlink(missing_ok=True)
                before = snapshot(root)
                args = {"list": ["list", "--root", str(root)], "report": ["report", str(run), "--no-plot"]}
                try:
                    code = main(args.get(verb, [verb, str(run)]))
                except SystemExit as ended:  # argparse's own exit
                    code = ended.code
                out, err = capsys.readouterr()
                where = (name, what, verb)
                assert code in DOCUMENTED, (*where, code, err[-2000:])
                assert "Traceback" not in out + err, (*where, err[-2000:])
                assert name in OUTPUTS or path.read_bytes() == content, where  # verify.json is verify's own
                changed = {k for k, v in snapshot(root).items() if before.get(k) != v}
                assert changed <= {f"bad/{o}" for o in OUTPUTS}, (*where, changed)
                if verb == "list":
                    assert "good" in out and "bad" in out, (*where, out)
        path.unlink()


# each side record with fields of the wrong type (and a depth bomb inside a field): what its typed model refuses
DEEP = json.loads("[" * 40 + "]" * 40)
WRONG_TYPED = {
    "launch.json": {"llamafactory_yaml": ["x"], "patches": [1], "backend": 5},
    "manifest.json": {"model": "x", "data": [1]},
    "save_on_stop.json": {"pid": [1], "step": "x"},
    "stop_saved.json": {"step": "x", "path": {"a": 1}},
    "stop_request.json": {"now": "yes", "grace_s": "x", "by": [1]},
    "save_request.json": {"why": DEEP},
    "verify.json": {"passed": "x", "created": [1]},
    "evaluate.json": {"checkpoints": [{"a": 1}], "prompts": 5},
    "output/best_adapter.json": {"checkpoint": {"a": 1}, "metric": "x"},
    "errors/rank0.json": {"rank": "x", "time": "x", "traceback": 5, "out_of_memory": 5, "disk": [1]},
    "output/trainer_log.jsonl": '{"current_steps": "x", "total_steps": 2}\n[1]\n{"loss": [1], "current_steps": 1}\n',
    "../launcher.lock.owner.json": {"pid": [1], "run_id": 5, "since": DEEP},
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPED))
def test_every_host_verb_answers_a_wrong_typed_side_record(tmp_path: Path, capsys, name: str) -> None:
    """A side record whose fields have the wrong type: every host verb answers without a traceback, in at most one
    line on stderr, with a documented exit code; no file changes but the verb's own outputs; `list` lists both
    runs; a verb that names the file names it as ``unreadable: PATH (why)``."""
    root = tmp_path / "runs"
    run = crafted_run(tmp_path, name="bad", state="SUCCEEDED", exit_code=0)
    crafted_run(tmp_path, name="good", state="FAILED", exit_code=1)
    path = (run / name).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    content = WRONG_TYPED[name]
    content = (content if isinstance(content, str) else json.dumps(content)).encode()
    for verb in VERBS:
        path.write_bytes(content)
        for output in OUTPUTS - {name}:
            (run / output).unlink(missing_ok=True)
        before = snapshot(root)
        args = {"list": ["list", "--root", str(root)], "report": ["report", str(run), "--no-plot"]}
        code = main(args.get(verb, [verb, str(run)]))
        out, err = capsys.readouterr()
        where = (name, verb)
        assert code in DOCUMENTED, (*where, code, err[-2000:])
        assert "Traceback" not in out + err and err.count("\n") <= 1, (*where, err[-2000:])
        assert name in OUTPUTS or path.read_bytes() == content, where
        changed = {k for k, v in snapshot(root).items() if before.get(k) != v}
        assert changed <= {f"bad/{o}" for o in OUTPUTS}, (*where, changed)
        if str(path) in err:  # an answer about the file (the good path's output names some files too)
            assert f"unreadable: {path} (" in err, (*where, out, err)
        if verb == "list":
            assert "good" in out and "bad" in out, (*where, out)


@pytest.mark.parametrize("damage", ["{not json", "[" * 5000 + "]" * 5000, "[1, 2]", "\udcff"])
def test_a_damaged_proof_record_is_written_whole_again_at_the_next_update(tmp_path, damage):
    """The rank reads its proof record back before merging an update; a damaged one counts as none."""
    from patches.core.proof import ProofFile

    proof = ProofFile(tmp_path / "proof", "demo_patch", 0)
    proof.path.parent.mkdir(parents=True)
    proof.path.write_bytes(damage.encode("utf-8", "surrogateescape"))
    assert proof.read() == {}
    proof.update(applied=True)
    assert json.loads(proof.path.read_text())["applied"] is True
