"""Benchmark: `launcher data stats` over 10,000 samples of about 3,000 tokens each.

    python -m benchmarks.data_stats_bench --out DIR [--samples 10000] [--tokens 3000] [--workdir DIR]

Builds the demo assets (tiny Qwen3.5 tokenizer and processor, no download), writes a SoulChat-shaped
alpaca-with-history dataset whose samples are about ``--tokens`` tokens long after the
``qwen3_5_nothink`` template (every sample's text is drawn independently, so no two samples share
turns and the stats tool's de-duplication of shared strings gains nothing), then times the real
command in a child process, imports included. Writes ``--out/results.json`` (benchmarks/results_schema.py) and
prints its figures as one JSON line: samples, tokens, wall seconds,
the tool's own measuring seconds (after imports and loading), CPU cores, the load average at the
start, and how many cores other processes kept busy while the command ran (from /proc/stat, minus the
command's own CPU time): the machine is shared, so that number says how fair the figure is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import results_schema  # noqa: E402  (the repository root must be importable first)

SENTENCE_TOKENS = 20  # the demo sentences average about 20 tokens with the demo tokenizer


def synthesize(count: int, tokens: int, seed: int = 0) -> list[dict]:
    """``count`` alpaca-with-history records of about ``tokens`` tokens each, all text drawn at random."""
    from launcher.data.demo import CLIENT, COUNSELOR, SYSTEM

    rng = random.Random(seed)
    turns = 5  # history pairs; plus the query and the reply: 12 messages
    per_message = max(1, tokens // SENTENCE_TOKENS // (2 * turns + 2))

    def text(pool: list[str]) -> str:
        return " ".join(rng.choice(pool) for _ in range(per_message))

    return [
        {
            "system": SYSTEM,
            "instruction": text(CLIENT),
            "input": "",
            "output": text(COUNSELOR),
            "history": [[text(CLIENT), text(COUNSELOR)] for _ in range(turns)],
        }
        for _ in range(count)
    ]


def cpu_busy_seconds() -> float:
    """CPU-seconds all processes of the machine have been busy since boot (Linux /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def write_inputs(work: Path, samples: int, tokens: int) -> Path:
    from launcher.data.demo import build_demo_assets
    from launcher.data.soulchat import dataset_info_entry

    assets = build_demo_assets(work / "demo", force=True)
    data = work / "data"
    data.mkdir(exist_ok=True)
    (data / "bench.json").write_text(json.dumps(synthesize(samples, tokens), ensure_ascii=False))
    info = {"bench": dataset_info_entry("mdpcot", "bench.json")}  # the shape `launcher data prepare` writes
    (data / "dataset_info.json").write_text(json.dumps(info))
    config = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    config.update(model_name_or_path=str(assets["model"]), dataset_dir=str(data), dataset="bench", cutoff_len=4096)
    config.pop("eval_dataset", None)
    config["launcher"]["output_root"] = str(work / "runs")
    path = work / "bench.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=3_000)
    parser.add_argument("--workdir", type=Path, default=None, help="keep inputs here (default: a temp folder)")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="data-stats-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        config = write_inputs(work, args.samples, args.tokens)
        out = work / "stats"
        busy_before, own_before = cpu_busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "launcher", "data", "stats", str(config), "--out", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        busy, own = cpu_busy_seconds() - busy_before, resource.getrusage(resource.RUSAGE_CHILDREN)
        own_cpu = (own.ru_utime + own.ru_stime) - (own_before.ru_utime + own_before.ru_stime)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        result = json.loads((out / "data_stats.json").read_text())
        train = result["splits"]["train"]
        figures = {
            "samples": train["samples"],
            "tokens": train["tokens"]["before"],
            "mean_length": train["length"]["mean"],
            "wall_s": round(wall, 1),
            "measure_s": result["seconds"],
            "cpu_s": round(own_cpu, 1),
            "cores": len(os.sched_getaffinity(0)),
            "load_at_start": [round(x, 2) for x in load_start],
            "other_processes_cores": round(max(0.0, busy - own_cpu) / wall, 2),
        }
    command = " ".join(["python -m benchmarks.data_stats_bench", *(argv if argv is not None else sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": command, **figures}
    results_schema.write(args.out / "results.json", record, bench="benchmarks.data_stats_bench")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
