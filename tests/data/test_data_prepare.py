"""`launcher data prepare`: SoulChat-R1 files to LLaMA-Factory data files, split, rejects, refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.data.prepare import PrepareError, convert_file, prepare, split_by_conversation
from launcher.data.soulchat import REJECT_KINDS, Options, Rejected, convert
from tests.support.common import launcher_cmd
from tests.support.soulchat_fixtures import (
    HANDBOOK,
    SENTINEL,
    counselor,
    dialogue_records,
    mdpcot_records,
    write_json,
)

PREPARE = ("data", "prepare", "--format", "soulchat-r1")


def _load(path: Path):
    return json.loads(path.read_text())


# --- catch_mdpcot.json ------------------------------------------------------------------------------


def test_mdpcot_drop_writes_files_without_any_think_tag(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records())
    out = tmp_path / "data"
    proc = launcher_cmd(*PREPARE, src, "--out", out, "--reasoning", "drop")
    assert proc.returncode == 0, proc.stderr
    assert "read 24 records" in proc.stdout and "rejected 0" in proc.stdout
    info = _load(out / "dataset_info.json")
    assert set(info) == {"soulchat_r1_nothink", "soulchat_r1_nothink_val"}  # the names the formal configs use
    assert info["soulchat_r1_nothink"]["formatting"] == "alpaca"
    assert info["soulchat_r1_nothink"]["columns"]["history"] == "history"
    train, val = _load(out / "soulchat_r1_nothink.json"), _load(out / "soulchat_r1_nothink_val.json")
    assert len(train) + len(val) == 24 and val
    for path in out.iterdir():
        assert b"<think>" not in path.read_bytes() and b"</think>" not in path.read_bytes(), path
    first = next(s for s in train if s["instruction"].endswith("d0 t0)"))
    assert first["output"] == counselor(0, 0)  # the reply survives, the reasoning is gone
    assert first["system"] == HANDBOOK and first["history"] == []
    assert (out / "soulchat_r1_nothink.rejects.jsonl").read_text() == ""  # written even when empty


def test_mdpcot_keep_retains_the_reasoning(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records())
    result = prepare(src, tmp_path / "data", Options(reasoning="keep"), val_size=0)
    assert result.name == "soulchat_r1_think" and result.counts["val"] == 0
    assert all(s["output"].startswith("<think>") and "</think>" in s["output"] for s in result.train)
    assert not (tmp_path / "data" / "soulchat_r1_think_val.json").exists()


def test_system_option_replaces_the_handbook(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=3))
    result = prepare(src, tmp_path / "data", Options(system="Be kind."), val_size=0)
    assert {s["system"] for s in result.train} == {"Be kind."}
    summary = _load(result.files["summary"])
    assert summary["options"]["system"] == "option" and "Be kind." not in json.dumps(summary)


# --- catch_dialogue.json ----------------------------------------------------------------------------


def test_dialogue_becomes_sharegpt_conversations(tmp_path):
    src = write_json(tmp_path / "catch_dialogue.json", dialogue_records())
    result = prepare(src, tmp_path / "data", Options(system="You are a counsellor."), val_size=0)
    assert result.name == "soulchat_r1_dialogue_nothink"
    entry = _load(result.files["info"])[result.name]
    assert entry["formatting"] == "sharegpt" and entry["columns"] == {"messages": "conversations", "system": "system"}
    assert entry["tags"]["user_tag"] == "human" and entry["tags"]["assistant_tag"] == "gpt"
    sample = result.train[2]  # dialogue 2 has three client/counselor exchanges
    assert [m["from"] for m in sample["conversations"]] == ["human", "gpt"] * 3
    assert sample["system"] == "You are a counsellor."


def test_dialogue_system_from_consultation_target(tmp_path):
    src = write_json(tmp_path / "catch_dialogue.json", dialogue_records(dialogues=2))
    result = prepare(src, tmp_path / "data", Options(system="Role.", system_from_target=True), val_size=0)
    assert [s["system"] for s in result.train] == [
        "Role.\n\nTarget 0: sleep before exams",
        "Role.\n\nTarget 1: sleep before exams",
    ]


def test_system_from_target_refused_for_mdpcot(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=2))
    with pytest.raises(PrepareError, match="needs catch_dialogue.json"):
        prepare(src, tmp_path / "data", Options(system_from_target=True))


# --- split ------------------------------------------------------------------------------------------


def test_split_is_deterministic_and_keeps_conversations_whole(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=40))
    a = prepare(src, tmp_path / "a", Options(), val_size=0.25, seed=7)
    b = prepare(src, tmp_path / "b", Options(), val_size=0.25, seed=7)
    c = prepare(src, tmp_path / "c", Options(), val_size=0.25, seed=8)
    assert a.files["train"].read_bytes() == b.files["train"].read_bytes()
    assert a.files["val"].read_bytes() == b.files["val"].read_bytes()
    assert a.val != c.val  # the seed matters

    def dialogue(sample) -> str:  # "... (Zebra d12 t0)" -> "d12"
        first = sample["history"][0][0] if sample["history"] else sample["instruction"]
        return first.rsplit(" ", 2)[1]

    train_ids, val_ids = {dialogue(s) for s in a.train}, {dialogue(s) for s in a.val}
    assert train_ids and val_ids and not train_ids & val_ids
    assert abs(len(a.val) - 0.25 * 80) <= 3  # whole conversations: close to, not exactly, the share


def test_a_test_split_is_held_out_disjoint_hashed_and_never_registered(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=40))
    result = prepare(src, tmp_path / "d", Options(), val_size=0.2, test_size=0.2, seed=7)

    def dialogue(sample) -> str:
        first = sample["history"][0][0] if sample["history"] else sample["instruction"]
        return first.rsplit(" ", 2)[1]

    test = _load(result.files["test"])
    sides = [{dialogue(s) for s in side} for side in (result.train, result.val, test)]
    assert all(sides) and not (sides[0] & sides[1]) and not (sides[0] & sides[2]) and not (sides[1] & sides[2])
    accepted = result.counts["records"] - result.counts["rejected"]
    assert len(result.train) + len(result.val) + len(test) == accepted and abs(len(test) - 0.2 * accepted) <= 3
    info = _load(tmp_path / "d" / "dataset_info.json")
    assert set(info) == {result.name, f"{result.name}_val"}  # the test file is never registered
    record = _load(result.files["summary"])
    from launcher.files import sha256_file

    assert record["test"] == {
        "file": result.files["test"].name,
        "sha256": sha256_file(result.files["test"]),
        "samples": len(test),
    }
    again = prepare(src, tmp_path / "e", Options(), val_size=0.2, test_size=0.2, seed=7)
    assert again.files["test"].read_bytes() == result.files["test"].read_bytes()  # deterministic


def test_check_refuses_a_config_that_trains_or_evaluates_on_the_test_split(tmp_path):
    from launcher.checks.data_check import held_out_problems

    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=20))
    result = prepare(src, tmp_path / "d", Options(), val_size=0.2, test_size=0.2, seed=7)
    info_path = tmp_path / "d" / "dataset_info.json"
    info = _load(info_path)
    info["sneaky"] = {**info[result.name], "file_name": result.files["test"].name}  # registered by hand
    info_path.write_text(json.dumps(info))
    lf = {"dataset_dir": str(tmp_path / "d"), "dataset": result.name, "eval_dataset": "sneaky"}
    (problem,) = held_out_problems(lf)
    assert problem.startswith(f"sneaky: {result.files['test']} is the held-out test split")
    assert held_out_problems({**lf, "eval_dataset": f"{result.name}_val"}) == []


def test_split_by_count_and_empty_validation():
    keys = [str(i // 2) for i in range(20)]  # ten conversations of two samples
    train, val = split_by_conversation(keys, 4, seed=1)
    assert len(val) == 4 and sorted(train + val) == list(range(20))
    assert split_by_conversation(keys, 0, seed=1) == (list(range(20)), [])


def test_bad_val_sizes_are_refused(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=3))
    with pytest.raises(PrepareError, match="takes all 6 accepted samples"):
        prepare(src, tmp_path / "a", Options(), val_size=1000)
    with pytest.raises(PrepareError, match="neither a share in \\(0, 1\\) nor a whole count"):
        prepare(src, tmp_path / "b", Options(), val_size=2.5)
    with pytest.raises(PrepareError, match="--test-size 1.5 is neither a share"):
        prepare(src, tmp_path / "c", Options(), test_size=1.5)
    with pytest.raises(PrepareError, match="--val-size 3 and --test-size 3 take all 6 accepted samples"):
        prepare(src, tmp_path / "d", Options(), val_size=3, test_size=3)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_user_validation_file(tmp_path):
    src = write_json(tmp_path / "train.json", mdpcot_records(dialogues=6))
    val = write_json(tmp_path / "val.json", mdpcot_records(dialogues=2))
    proc = launcher_cmd(*PREPARE, src, "--out", tmp_path / "data", "--val", val)
    assert proc.returncode == 0, proc.stderr
    assert len(_load(tmp_path / "data" / "soulchat_r1_nothink.json")) == len(mdpcot_records(dialogues=6))
    assert len(_load(tmp_path / "data" / "soulchat_r1_nothink_val.json")) == len(mdpcot_records(dialogues=2))
    assert _load(tmp_path / "data" / "soulchat_r1_nothink.prepare.json")["split"]["mode"] == "file"


# --- malformed records: one test per kind -----------------------------------------------------------

GOOD_MDPCOT = mdpcot_records(dialogues=2)[0]
GOOD_DIALOGUE = dialogue_records(dialogues=2)[1]


def _turns(*pairs):
    return {"conversation": [{"role": r, "content": c} for r, c in pairs]}


MALFORMED = {
    "not_a_record": ("mdpcot", ["a", "list"]),
    "missing_field": ("mdpcot", {**GOOD_MDPCOT, "output": None}),
    "bad_role": ("dialogue", _turns(("client", f"hi {SENTINEL}"), ("therapist", f"hello {SENTINEL}"))),
    "empty_content": ("dialogue", _turns(("client", f"hi {SENTINEL}"), ("counselor", "   "))),
    "history_not_pairs": ("mdpcot", {**GOOD_MDPCOT, "history": [[f"a {SENTINEL}", "b", "c"]]}),
    "not_alternating": ("dialogue", _turns(("client", f"a {SENTINEL}"), ("client", "b"), ("counselor", "c"))),
    "not_ending_on_counselor": ("dialogue", _turns(("client", f"a {SENTINEL}"), ("counselor", "b"), ("client", "c"))),
    "think_tag": ("mdpcot", {**GOOD_MDPCOT, "output": f"<think>unclosed {SENTINEL} reply"}),
}


def test_every_reject_kind_has_a_case():
    assert set(MALFORMED) == set(REJECT_KINDS)


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_record_is_rejected_with_index_and_reason(tmp_path, kind):
    fmt, bad = MALFORMED[kind]
    good = GOOD_MDPCOT if fmt == "mdpcot" else GOOD_DIALOGUE
    src = write_json(tmp_path / "src.json", [good, bad, good])
    converted = convert_file(src, Options())
    assert len(converted.samples) == 2
    assert [(r["index"], r["kind"]) for r in converted.rejects] == [(1, kind)]
    assert SENTINEL not in converted.rejects[0]["reason"]  # reasons name fields, never their text


@pytest.mark.parametrize(
    "record, reason",
    [
        ({**GOOD_MDPCOT, "output": "<think>only reasoning</think>"}, "output is empty once the <think> block"),
        ({**GOOD_MDPCOT, "instruction": "", "input": ""}, "no client turn"),
        ({**GOOD_MDPCOT, "history": [["x", ""]]}, "history[0][1] (counselor) is empty"),
        ({**GOOD_MDPCOT, "instruction": "a <think> in a question"}, "only counselor replies carry reasoning"),
        (_turns(("counselor", "hello"), ("client", "hi"), ("counselor", "ok")), "must start with the client"),
        (_turns(), "no turns"),
    ],
)
def test_reject_reasons_name_the_problem(record, reason):
    kind = "dialogue" if "conversation" in record else "mdpcot"
    with pytest.raises(Rejected, match=re.escape(reason)):
        convert(kind, record, Options())


def test_rejects_file_and_printed_counts(tmp_path):
    records = mdpcot_records(dialogues=3) + [MALFORMED["think_tag"][1], MALFORMED["history_not_pairs"][1]]
    src = write_json(tmp_path / "catch_mdpcot.json", records)
    proc = launcher_cmd(*PREPARE, src, "--out", tmp_path / "data")
    assert proc.returncode == 0, proc.stderr
    n = len(records)
    assert f"read {n} records" in proc.stdout and "rejected 2 (" in proc.stdout
    assert f"catch_mdpcot.json[{n - 2}] think_tag" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "data" / "soulchat_r1_nothink.rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["kind"]) for r in lines] == [(n - 2, "think_tag"), (n - 1, "history_not_pairs")]
    summary = _load(tmp_path / "data" / "soulchat_r1_nothink.prepare.json")
    assert summary["counts"]["rejected_by_kind"] == {"think_tag": 1, "history_not_pairs": 1}
    assert summary["counts"]["train"] + summary["counts"]["val"] + 2 == n  # nothing dropped silently


# --- privacy ----------------------------------------------------------------------------------------


def test_no_conversation_text_printed_unless_asked(tmp_path):
    src = write_json(tmp_path / "catch_dialogue.json", dialogue_records())
    quiet = launcher_cmd(*PREPARE, src, "--out", tmp_path / "a")
    assert quiet.returncode == 0 and SENTINEL not in quiet.stdout + quiet.stderr
    shown = launcher_cmd(*PREPARE, src, "--out", tmp_path / "b", "--show-samples", "1")
    assert shown.returncode == 0 and SENTINEL in shown.stdout


# --- refusals: one clear message, non-zero exit, nothing overwritten ---------------------------------


def _one_error(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_missing_source_file(tmp_path):
    err = _one_error(launcher_cmd(*PREPARE, tmp_path / "nope.json", "--out", tmp_path / "data"))
    assert "source file not found" in err and "nope.json" in err
    assert not (tmp_path / "data").exists()


def test_invalid_json(tmp_path):
    src = tmp_path / "bad.json"
    src.write_text('[{"instruction": "hi", ]')
    err = _one_error(launcher_cmd(*PREPARE, src, "--out", tmp_path / "data"))
    assert "not valid JSON" in err and "line 1" in err


def test_not_an_array_and_unknown_records(tmp_path):
    obj = write_json(tmp_path / "obj.json", {"instruction": "x"})
    assert "expected an array" in _one_error(launcher_cmd(*PREPARE, obj, "--out", tmp_path / "d"))
    other = write_json(tmp_path / "other.json", [{"question": "x", "answer": "y"}])
    err = _one_error(launcher_cmd(*PREPARE, other, "--out", tmp_path / "d"))
    assert "does not look like a SoulChat-R1 file" in err and "['answer', 'question']" in err


def test_unknown_format(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=1))
    proc = launcher_cmd("data", "prepare", "--format", "alpaca", src, "--out", tmp_path / "d")
    assert proc.returncode == 2 and "invalid choice: 'alpaca'" in proc.stderr and "soulchat-r1" in proc.stderr


def test_existing_output_needs_force(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records(dialogues=6))
    out = tmp_path / "data"
    assert launcher_cmd(*PREPARE, src, "--out", out, "--seed", "1").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    err = _one_error(launcher_cmd(*PREPARE, src, "--out", out, "--seed", "2"))
    assert "output exists" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    assert launcher_cmd(*PREPARE, src, "--out", out, "--seed", "2", "--force").returncode == 0


def test_other_dataset_info_entries_are_kept(tmp_path):
    out = tmp_path / "data"
    write_json(out / "dataset_info.json", {"mine": {"file_name": "mine.json"}})
    prepare(write_json(tmp_path / "m.json", mdpcot_records(dialogues=4)), out, Options(), val_size=2)
    prepare(write_json(tmp_path / "d.json", dialogue_records(dialogues=4)), out, Options(), val_size=2)
    assert set(_load(out / "dataset_info.json")) == {
        "mine",
        "soulchat_r1_nothink",
        "soulchat_r1_nothink_val",
        "soulchat_r1_dialogue_nothink",
        "soulchat_r1_dialogue_nothink_val",
    }


def test_all_records_rejected_writes_nothing(tmp_path):
    src = write_json(tmp_path / "catch_mdpcot.json", [MALFORMED["think_tag"][1]] * 3)
    err = _one_error(launcher_cmd(*PREPARE, src, "--out", tmp_path / "data"))
    assert "no training sample left" in err and "think_tag 3" in err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("source_mode", [0o600, 0o640, 0o644])
def test_prepared_conversations_are_never_more_open_than_their_source(tmp_path, source_mode):
    import os

    src = write_json(tmp_path / "catch_mdpcot.json", mdpcot_records())
    src.chmod(source_mode)
    prepare(src, tmp_path / "data", Options(), val_size=0.25)
    mask = os.umask(0)
    os.umask(mask)
    for name in ("soulchat_r1_nothink.json", "soulchat_r1_nothink_val.json", "soulchat_r1_nothink.rejects.jsonl"):
        mode = (tmp_path / "data" / name).stat().st_mode & 0o777
        assert mode == source_mode & 0o666 & ~mask, (name, oct(mode))
    assert (tmp_path / "data" / "dataset_info.json").stat().st_mode & 0o777 == 0o666 & ~mask  # no conversation
