"""The one results schema (``benchmarks/results_schema.py``): every file in ``benchmarks/results/`` holds to it, a
file written since the schema carries its command, commit and versions, and the benchmarks behind the product's
promises write it themselves (``status_bench`` and ``data_stats_bench`` here, run for real; ``patch_bench``,
``fsdp_bench`` and ``evaluate_bench`` in their own tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from benchmarks import data_stats_bench, results_schema, status_bench
from benchmarks.results_schema import Results
from tests.support.common import REPO

RESULTS = REPO / "benchmarks" / "results"
FILES = sorted(RESULTS.iterdir())


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_results_file_holds_to_the_schema(path: Path):
    """A ``.json`` is a results file; a ``.log`` is the console of the results file beside it, nothing else."""
    if path.suffix == ".log":
        assert path.with_suffix(".json").is_file(), f"{path.name} is the console of no results file"
        return
    assert path.suffix == ".json", f"{path.name}: benchmarks/results/ holds results files (.json) and their consoles"
    results = Results.read(path)
    assert results.figures == results_schema.figures_of(results.variants, results.detail)  # no figure made up
    assert results.converted or results.commit  # a file written since the schema says which tree measured it


def test_a_file_written_since_the_schema_must_name_its_command_commit_and_versions(tmp_path):
    made = results_schema.build(
        {"command": "python -m benchmarks.x", "variants": {"on": {"tokens_per_s": 1.5}}}, bench="benchmarks.x"
    )
    good = made.model_dump(mode="json")
    for field, empty in (("commit", None), ("versions", {}), ("command", None)):
        planted = tmp_path / f"no-{field}.json"
        planted.write_text(json.dumps({**good, field: empty}))
        with pytest.raises(pydantic.ValidationError, match=field):
            Results.read(planted)
    (tmp_path / "extra.json").write_text(json.dumps({**good, "tokens_per_s": 9}))  # a figure outside ``figures``
    with pytest.raises(pydantic.ValidationError, match="tokens_per_s"):
        Results.read(tmp_path / "extra.json")
    (tmp_path / "converted.json").write_text(json.dumps({**good, "commit": None, "converted": "before the schema"}))
    assert Results.read(tmp_path / "converted.json").commit is None


def test_build_lifts_the_scripts_record_and_raw_gives_it_back():
    record = {
        "command": "python -m benchmarks.x --out D",
        "shape": "tiny",
        "targets": {"on": {"met": True}},
        "runs": {"on": {"1": {"tokens_per_s": 10.0, "ok": True, "steps": [1.0, 2.0]}}},
        "path": Path("/x"),
    }
    made = results_schema.build(record, bench="benchmarks.x", variants_key="runs")
    assert made.figures == {"on.1.tokens_per_s": 10.0}  # numbers only: no bool, nothing inside a list
    assert made.raw("runs") == {**record, "path": "/x"} and made.detail == {"shape": "tiny", "path": "/x"}
    assert made.date.isoformat() and made.device and made.versions["python"]
    assert made.commit.removesuffix("+dirty") == results_schema.commit().removesuffix("+dirty")


def test_status_bench_writes_the_schema(tmp_path):
    """The real benchmark on a small log (strace counts the bytes read): its results file is a ``Results``."""
    code = status_bench.main(["--out", str(tmp_path), "--lines", "2000", "--repeats", "1"])
    written = Results.read(tmp_path / "results.json")
    assert written.bench == "benchmarks.status_bench" and written.command.endswith("--lines 2000 --repeats 1")
    assert written.commit and written.versions and written.converted is None
    assert written.figures["trainer_log_lines"] == 2000 and written.figures["wall_s.median"] > 0
    assert code == (0 if all(written.detail["passed"].values()) else 1)


@pytest.mark.slow
def test_data_stats_bench_writes_the_schema(tmp_path):
    """The real ``launcher data stats`` over a small synthetic set: its results file is a ``Results``."""
    assert data_stats_bench.main(["--out", str(tmp_path), "--samples", "40", "--tokens", "300"]) == 0
    written = Results.read(tmp_path / "results.json")
    assert written.bench == "benchmarks.data_stats_bench" and written.commit and written.converted is None
    assert written.figures["samples"] == 40 and written.figures["tokens"] > 40 * 100
