"""Values no reader may die of (issue 64): integers past Python's digit limit, non-finite numbers, lone
surrogates, timestamps without an offset, special files in place of records, records of a million entries,
alias bombs, a planted lock link, damaged checkpoints. Each host verb answers in one line or reads past the
value; nothing hangs and nothing on disk changes but the verb's own outputs."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.errors import ExitCode
from launcher.files import MAX_INT_DIGITS, Unreadable, load_yaml, parse_json, read_json_bounded
from launcher.state import trainer_log
from launcher.state.record import parse_time, read_record
from tests.support.common import EMPTY_SAFETENSORS, make_config
from tests.support.fake_runs import crafted_run, launcher, planned_resume

HUGE = "9" * 5000  # past Python's 4,300-digit limit for int(): json.loads raises a bare ValueError on it
VERBS = ("status", "list", "verify", "report", "stop", "resume", "logs")


def run_verb(verb: str, run: Path) -> list[str]:
    args = {"list": ["list", "--root", str(run.parent)], "report": ["report", str(run), "--no-plot"]}
    return args.get(verb, [verb, str(run)])


# --- the one parser -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f'{{"a": {HUGE}}}', "an integer of 5,000 digits"),
        ('{"a": NaN}', "a non-finite number (NaN)"),
        ('{"a": -Infinity}', "a non-finite number (-Infinity)"),
        ('{"a": 1e999}', "a number out of range (1e999)"),
        ('{"a": [' + ",".join(["1"] * 50) + "]}", "more than 40 values"),
        ("[" * 80 + "]" * 80, "nested more than 64 levels deep"),
        ('{"a": 1', "not JSON"),
    ],
)
def test_the_parser_refuses_what_no_reader_can_use_in_one_line(text: str, why: str) -> None:
    with pytest.raises(Unreadable) as info:
        parse_json(text.encode(), max_items=40)
    assert str(info.value).startswith(why) and "\n" not in str(info.value)


def test_the_parser_keeps_what_is_in_bounds_and_makes_lone_surrogates_printable() -> None:
    assert parse_json(f'{{"a": {"9" * MAX_INT_DIGITS}, "b": -2.5e10}}'.encode()) == {
        "a": int("9" * MAX_INT_DIGITS),
        "b": -2.5e10,
    }
    value = parse_json(rb'{"reason": "x\ud800y", "pair": "\ud83d\ude00", "\udfff": 1}')
    assert value == {"reason": "x\ufffdy", "pair": "\U0001f600", "\ufffd": 1}
    json.dumps(value).encode("utf-8")  # printable and writable again


def test_a_timestamp_without_an_offset_is_taken_as_utc_and_garbage_is_refused(tmp_path: Path) -> None:
    assert parse_time("2026-12-07T10:00:00").utcoffset().total_seconds() == 0
    assert parse_time("2026-12-07T10:00:00+02:00").utcoffset().total_seconds() == 7200
    run = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    record = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**record, "started": "2026-12-07T10:00:00"}))
    assert read_record(run).started == "2026-12-07T10:00:00+00:00"
    (run / "status.json").write_text(json.dumps({**record, "started": "yesterday"}))
    with pytest.raises(Exception, match="field 'started': \"yesterday\", not a timestamp"):
        read_record(run)


# --- planted values, every host verb ---------------------------------------------------------------------------


def plant_status(run: Path, raw: str) -> None:
    """``status.json`` with ``raw`` (JSON text) spliced in as the last field."""
    text = (run / "status.json").read_text().rstrip().rstrip("}")
    (run / "status.json").write_text(f"{text}, {raw}}}")


PLANTED = {
    "a 5,000-digit attempt": ('"attempt": ' + HUGE, "an integer of 5,000 digits"),
    "a 4 MiB record of 1.3 million processes": ('"processes": [' + ",".join(["{}"] * 1_300_000) + "]", "values"),
}


@pytest.mark.parametrize("what", sorted(PLANTED))
def test_a_planted_status_value_is_one_unreadable_line_and_list_lists_the_rest(tmp_path: Path, capsys, what) -> None:
    run = crafted_run(tmp_path, name="bad", state="SUCCEEDED", exit_code=0)
    crafted_run(tmp_path, name="good", state="FAILED", exit_code=1)
    raw, why = PLANTED[what]
    plant_status(run, raw)
    planted = (run / "status.json").read_bytes()
    for verb in VERBS:
        code = main(run_verb(verb, run))
        out, err = capsys.readouterr()
        assert code in {int(c) for c in ExitCode} and "Traceback" not in out + err, (verb, err[-2000:])
        if verb == "list":
            assert "good" in out and f"unreadable: {run / 'status.json'}" in out and why in out, out
        elif verb != "logs":
            assert err.startswith(f"error: unreadable: {run / 'status.json'} (") and err.count("\n") == 1, (verb, err)
            assert why in err, (verb, err)
    assert (run / "status.json").read_bytes() == planted


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("status.json", '"reason": "bad \\ud800 text"'),
        ("status.json", '"started": "2026-12-07T10:00:00", "ended": "2026-12-07T11:00:00+00:00"'),
        ("trainer_log", '{"current_steps": 2, "total_steps": 4, "loss": 1.0, "elapsed_time": "inf"}'),
        ("trainer_log", '{"current_steps": 2, "total_steps": 4, "loss": 1.0, "elapsed_time": "nan"}'),
        ("trainer_log", '{"current_steps": ' + HUGE + ', "total_steps": 4, "loss": 1.0}'),
        ("trainer_log", '{"current_steps": 2, "total_steps": 4, "loss": NaN, "reason": "\\udc80"}'),
        ("trainer_state", '{"global_step": ' + HUGE + "}"),
        ("manifest", '{"model": {"files": ' + HUGE + "}}"),
    ],
)
def test_every_host_verb_reads_past_a_planted_value(tmp_path: Path, capsys, where: str, value: str) -> None:
    """The value is either read (made whole: a lone surrogate printed as U+FFFD, a naive time as UTC) or skipped
    as one unreadable line; no verb gives a traceback, and the step before a skipped trainer-log line shows."""
    run = crafted_run(tmp_path, name="bad", state="SUCCEEDED", exit_code=0)
    good_line = json.dumps({"current_steps": 1, "total_steps": 4, "loss": 2.0, "elapsed_time": "0:00:05"})
    (run / "output").mkdir(exist_ok=True)
    (run / "output" / "trainer_log.jsonl").write_text(good_line + "\n")
    if where == "status.json":
        plant_status(run, value)
    else:
        path = {
            "trainer_log": run / "output" / "trainer_log.jsonl",
            "manifest": run / "manifest.json",
            "trainer_state": run / "output" / "trainer_state.json",
        }[where]
        with open(path, "a") as f:
            f.write(value + "\n")
    for verb in VERBS:
        code = main(run_verb(verb, run))
        out, err = capsys.readouterr()
        assert code in {int(c) for c in ExitCode}, (verb, code, err[-2000:])
        assert "Traceback" not in out + err and err.count("\n") <= 1, (verb, err[-2000:])
        (out + err).encode("utf-8")  # printable
        if verb == "status" and where == "trainer_log":
            assert "1/4" in out, out  # the planted line skipped, the good one before it shown
        if verb == "status" and "started" in value:
            assert "1:00:00" in out, out  # an hour from a naive start (UTC) to an aware end


# --- special files in place of records --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["status.json", "output/trainer_log.jsonl", "manifest.json"])
def test_a_fifo_in_place_of_a_record_never_hangs_a_verb(tmp_path: Path, where: str) -> None:
    run = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    path = run / where
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    for verb in ("status", "verify", "report", "stop", "resume"):
        proc = launcher(*run_verb(verb, run), timeout=120)  # a hang would end in TimeoutExpired
        assert "Traceback" not in proc.stderr and proc.returncode in {int(c) for c in ExitCode}, (verb, proc.stderr)
        if where == "status.json":
            assert proc.stderr == f"error: unreadable: {path} (not a regular file (a FIFO))\n", (verb, proc.stderr)


def test_a_trainer_log_linked_to_dev_zero_is_never_read(tmp_path: Path, monkeypatch) -> None:
    run = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    log = run / "output" / "trainer_log.jsonl"
    log.parent.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    log.symlink_to("/dev/zero")
    reads: list[int] = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real(fd, n))
    assert list(trainer_log.iter_trainer_log(log)) == [] and trainer_log.read_tail(log).records == []
    with pytest.raises(Unreadable, match="a character device"):
        read_json_bounded(log)
    assert sum(reads) < 1 << 20
    proc = launcher("verify", run, timeout=120)
    assert "Traceback" not in proc.stderr and proc.returncode in {int(c) for c in ExitCode}, proc.stderr


# --- config and lock ---------------------------------------------------------------------------------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_an_alias_bomb_config_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 1300
    with pytest.raises(Unreadable, match="expand it to 490,329,064 values"):
        load_yaml(ALIAS_BOMB, "bomb")
    for verb in ("check", "start"):
        proc = launcher(verb, cfg, timeout=120)
        assert proc.returncode == ExitCode.USAGE and "Traceback" not in proc.stderr, proc.stderr
        assert "alias bomb" in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr
    assert load_yaml("a: &x 1\nb: *x\n", "fine") == {"a": 1, "b": 1}


def test_a_lock_planted_as_a_symlink_refuses_start_in_one_line(tmp_path: Path, demo_assets) -> None:
    cfg = make_config(tmp_path, demo_assets)
    root = tmp_path / "runs"
    root.mkdir(parents=True, exist_ok=True)
    (root / "launcher.lock").symlink_to(tmp_path / "elsewhere")
    proc = launcher("start", cfg, timeout=120)
    assert proc.returncode == ExitCode.USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: the run lock {root / 'launcher.lock'} is a symbolic link"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "elsewhere").exists()


# --- resume never takes a damaged checkpoint -----------------------------------------------------------------------


def write_adapter(path: Path, values: int = 64) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (4 * values))


DAMAGE = {
    "truncated adapter": lambda c: os.truncate(c / "adapter_model.safetensors", 40),
    "corrupt header": lambda c: (c / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 6) + b'{"w": '),
    "half-written trainer state": lambda c: (c / "trainer_state.json").write_text('{"global_step": 6, "log_hi'),
    "empty optimizer": lambda c: (c / "optimizer.pt").write_bytes(b""),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_takes_the_newest_checkpoint_that_loads_and_keeps_the_damaged_one(tmp_path: Path, damage) -> None:
    run = crafted_run(tmp_path, state="CANCELLED", exit_code=None)
    for step in (5, 6):
        ckpt = run / "output" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        write_adapter(ckpt / "adapter_model.safetensors")
        (ckpt / "adapter_config.json").write_text("{}")
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (ckpt / "optimizer.pt").write_bytes(b"o")
        (ckpt / "scheduler.pt").write_bytes(b"s")
    newest = run / "output" / "checkpoint-6"
    DAMAGE[damage](newest)
    before = sorted(p.name for p in newest.iterdir())
    plan = planned_resume(run, adapter_only=damage == "empty optimizer")
    if damage == "empty optimizer":  # with --adapter-only the newest still loads: taken, as adapter-only
        assert plan.step == 6 and plan.mode == "adapter-only"
        plan = planned_resume(run, adapter_only=False)  # an exact resume needs the optimizer: the older one
    assert plan.step == 5 and plan.mode == "exact", plan
    assert len(plan.skipped) == 1 and plan.skipped[0].startswith("checkpoint-6 ("), plan.skipped
    assert sorted(p.name for p in newest.iterdir()) == before  # nothing deleted


def test_resume_with_every_checkpoint_damaged_says_which_and_why(tmp_path: Path) -> None:
    run = crafted_run(tmp_path, state="FAILED", exit_code=1)
    ckpt = run / "output" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS[:5])
    (ckpt / "adapter_config.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text("{}")
    proc = launcher("resume", run, "--adapter-only", timeout=120)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "has no complete checkpoint" in proc.stderr and "checkpoint-2 (" in proc.stderr, proc.stderr
    assert ckpt.is_dir()


@pytest.mark.parametrize("how", ["deleted", "a FIFO"])
def test_a_run_without_a_readable_status_is_a_row_of_list(tmp_path: Path, capsys, how: str) -> None:
    run = crafted_run(tmp_path, name="b-lost", state="SUCCEEDED", exit_code=0)
    crafted_run(tmp_path, name="a-good", state="FAILED", exit_code=1)
    (run / "config.yaml").write_text("launcher: {}\n")
    (run / "status.json").unlink()
    if how == "a FIFO":
        os.mkfifo(run / "status.json")
    assert main(["list", "--root", str(run.parent)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 3 and rows[1].startswith("a-good"), rows
    why = "missing" if how == "deleted" else "not a regular file (a FIFO)"
    assert rows[2].startswith("b-lost") and f"unreadable: {run / 'status.json'} ({why})" in rows[2], rows


def test_an_unterminated_string_is_scanned_once_not_from_every_quote() -> None:
    """The pre-scan's string pattern takes an unterminated string to the end in one match (it was retried from every
    quote: a 64 KiB line of escaped quotes took 14 s, a 4 MiB record would have taken hours)."""
    from launcher.files import _JSON_STRING

    escaped = b'"' + b'\\"' * 100_000
    assert _JSON_STRING.match(escaped).end() == len(escaped)
    assert _JSON_STRING.findall(b'{"a": "x\\"y", "b": "]"}') == [b'"a"', b'"x\\"y"', b'"b"', b'"]"']
    with pytest.raises(Unreadable, match="not JSON"):
        parse_json(escaped)


@pytest.mark.parametrize(
    "header",
    [{"__metadata__": 5}, {"__metadata__": "x"}, {"w": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}],
    ids=["metadata-number", "metadata-string", "dtype-list"],
)
def test_a_planted_safetensors_header_is_damage_not_a_traceback(tmp_path: Path, header) -> None:
    from launcher.state.checkpoints import damage, scan_checkpoints
    from launcher.state.safetensors_header import SafetensorsError, read_header

    ckpt = tmp_path / "output" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    text = json.dumps(header).encode()
    (ckpt / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    (ckpt / "adapter_config.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    with pytest.raises(SafetensorsError):
        read_header(ckpt / "adapter_model.safetensors")
    (found,), _ = scan_checkpoints(tmp_path / "output")
    assert damage(found)
