"""What LLaMA-Factory's collator costs the host per 4,096-token row, packed against unpacked, on the CPU.

    python -m benchmarks.lab.collate_bench --out DIR [--rows 0] [--repeats 3] [--cutoff 4096]

A training step's period holds, besides its forward and backward, the collation of the next batch in the training
process (``dataloader_num_workers: 0``, the product's default). This times that collation alone, one row a batch
(batch size 1), through LLaMA-Factory 0.9.5's own data path and collator as its SFT workflow builds them
(``SFTDataCollatorWith4DAttentionMask``, neat packing where packed, the model's ``get_rope_index`` for the
multimodal rotary positions), for three cases:

- ``unpacked``: samples that fill the cutoff and answer in 70 % of their tokens (``bench_assets.write_dataset``
  with the spread's reply share; ``patch_bench``'s ``on-reply70``);
- ``packed``: the spread's samples (about 1,000 to 4,096 tokens) packed into rows of the cutoff, through the
  ``packed_rows`` patch as the product runs it (the sample numbers left 2D for the device to turn into the mask,
  each row's samples read and their positions checked; ``patch_bench``'s ``spread-packed``);
- ``packed-cpu-mask``: the same rows with LLaMA-Factory's 4D mask built by its collator on the CPU
  (``packed_rows.device_mask: false``).

Every case runs with the collator patches the product applies to text-only data (``text_only_batches``: no dummy
image; ``packed_rows`` where packed), which this process applies and removes around the case.

The model is the tiny demo model (``launcher.data.demo``): the collator reads its rotary-position function, whose host
cost depends on the tokens, not on the model's width, so the figures hold for the 27B shape's host work on the same
CPU. The model and both datasets are written afresh into ``DIR`` at ``--cutoff``. Per case: every row collated
once untimed, then ``--repeats`` passes over the first ``--rows`` rows (all of them by default), the median and the
90th percentile in ms, the samples per row and the lengths of the collated rows (packed: after ``packed_rows``' cut of
the padding, ``cut_padding``); beside them the CPU and the versions. Results go to
``DIR/collate.json`` (never overwritten), after every case; interrupted, it keeps the cases done. Measurement only:
nothing of the product's state is changed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lab import kernel_cli
from benchmarks.lab.kernel_cli import Results, run

CASES = ("unpacked", "packed", "packed-cpu-mask")
SPREAD_TOKENS = (1000, 4096)  # patch_bench's spread at the 27B shape's cutoff


def collator_of(model_dir: Path, data_dir: Path, dataset: str, cutoff: int, packing: bool, work: Path):
    """LLaMA-Factory's training dataset and collator for these arguments, built as its SFT workflow builds them."""
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.extras.constants import IGNORE_INDEX
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    model_args, data_args, training_args, finetuning_args, _ = get_train_args(
        {
            "model_name_or_path": str(model_dir),
            "dataset_dir": str(data_dir),
            "dataset": dataset,
            "template": "qwen3_vl_nothink",
            "cutoff_len": cutoff,
            "packing": packing,
            "neat_packing": packing,
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "lora",
            "lora_target": "q_proj",
            "output_dir": str(work),
            "overwrite_cache": True,
            "preprocessing_num_workers": 1,
            "report_to": "none",
            "per_device_train_batch_size": 1,
        }
    )
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    rows = get_dataset(template, model_args, data_args, training_args, "sft", **tokenizer_module)["train_dataset"]
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, is_trainable=False)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template,
        model=model,
        pad_to_multiple_of=8,
        label_pad_token_id=IGNORE_INDEX,
        block_diag_attn=model_args.block_diag_attn,
        neat_packing=data_args.neat_packing,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype,
        **tokenizer_module,
    )
    return rows, collator


def samples_in(batch) -> int:
    """The samples of a one-row batch, as ``packed_rows`` reads them: off its sample numbers (2D: all ones unpacked,
    1, 1, 2, 2, 0 packed) or off its 4D mask."""
    from patches.packing.masks import numbered_segments, segments

    mask = batch["attention_mask"]
    return (numbered_segments(mask) if mask.dim() == 2 else segments(mask)).samples_per_row()[0]


def time_case(collator, rows, count: int, repeats: int) -> dict[str, Any]:
    """Each row collated alone, once untimed, then ``repeats`` timed passes; the collator pops keys of the features
    it is given (``packing_params``), so every call gets its own copy, made outside the timed call, as the
    DataLoader hands the Trainer fresh features."""
    features = [rows[i] for i in range(min(count or len(rows), len(rows)))]
    batches = [collator([dict(f)]) for f in features]
    samples, lengths = [samples_in(b) for b in batches], [int(b["input_ids"].shape[-1]) for b in batches]
    seconds = []
    for _ in range(repeats):
        for feature in features:
            batch = [dict(feature)]
            started = time.perf_counter()
            collator(batch)
            seconds.append(time.perf_counter() - started)
    seconds.sort()
    return {
        "rows": len(features),
        "calls": len(seconds),
        "median_ms": round(statistics.median(seconds) * 1000, 3),
        "p90_ms": round(seconds[int(0.9 * (len(seconds) - 1))] * 1000, 3),
        "samples_per_row": {str(n): samples.count(n) for n in sorted(set(samples))},
        "row_lengths": {str(n): lengths.count(n) for n in sorted(set(lengths))},
        "mean_row_length": round(statistics.mean(lengths), 1),
    }


def measure(case: str, out: Path, cutoff: int, count: int, repeats: int) -> dict[str, Any]:
    """One case, with the collator patches the product applies to text-only data: ``text_only_batches`` (no dummy
    image) and, packed, ``packed_rows`` (``device_mask`` off for ``packed-cpu-mask``)."""
    from benchmarks import bench_assets
    from patches import packed_rows, text_only_batches
    from patches.core.proof import ProofFile

    packed = case != "unpacked"
    data, dataset = ("data-spread", bench_assets.SPREAD) if packed else ("data-reply70", bench_assets.DATASET)
    rows, collator = collator_of(out / "model", out / data, dataset, cutoff, packed, out / "lf")
    facts = {"packing": packed, "dataset_media": {"counted": True, "datasets": [dataset], "records": 0}}
    try:
        text_only_batches.apply(
            {}, backend="cpu", proof=ProofFile(out / "proof", text_only_batches.NAME, 0), facts=facts
        )
        if packed:
            packed_rows.apply(
                {"device_mask": case == "packed"},
                backend="cpu",
                proof=ProofFile(out / "proof", packed_rows.NAME, 0),
                facts=facts,
            )
        return time_case(collator, rows, count, repeats)
    finally:
        packed_rows.restore()
        text_only_batches.restore()


def write_assets(out: Path, cutoff: int) -> None:
    """The tiny demo model and both datasets at ``cutoff``, written afresh (the benchmark's own folders in ``out``)."""
    from benchmarks import bench_assets
    from launcher.data.demo import build_model_dir

    for folder in ("model", "data-spread", "data-reply70", "lf"):
        shutil.rmtree(out / folder, ignore_errors=True)
    model_dir = build_model_dir(out / "model")
    low = min(SPREAD_TOKENS[0], cutoff // 4)  # about a quarter of the cutoff, as at 4,096
    bench_assets.write_spread_dataset(out / "data-spread", model_dir, low, cutoff)
    bench_assets.write_dataset(out / "data-reply70", model_dir, cutoff, reply_share=bench_assets.SPREAD_REPLY_SHARE)


def host() -> dict[str, Any]:
    """What the figures depend on: the CPU, its threads for torch, and the versions of the data path."""
    import importlib.metadata

    import torch

    info = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (info.read_text().splitlines() if info.exists() else [])
        if line.startswith("model name")
    ]
    cpu = names[0] if names else platform.processor()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **{name: importlib.metadata.version(name) for name in ("llamafactory", "transformers")},
    }


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    if args.rows < 0 or args.repeats < 1:
        return f"--rows {args.rows}, --repeats {args.repeats}: give 0 (every row) or more rows, and 1 or more repeats"
    if args.cutoff < 256:
        return f"--cutoff {args.cutoff}: give 256 tokens or more (the spread's samples run from 1,000 up to it)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "collate.json", "the model, the data and collate.json")
    parser.add_argument("--rows", type=int, default=0, help="rows timed per case (default 0: every row)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the rows (default 3)")
    parser.add_argument("--cutoff", type=int, default=4096, help="row length, cutoff_len (default 4096)")
    args = kernel_cli.parse("collate_bench", parser, argv, "collate.json", input_problem, needs_cuda=False)
    if args is None:
        return 2
    results = Results("collate_bench", args.out, "collate.json", {"cutoff": args.cutoff, "cases": {}})
    case = "assets"
    try:
        results.data.update(host=host())
        write_assets(args.out, args.cutoff)
        for case in CASES:
            results.data["cases"][case] = measure(case, args.out, args.cutoff, args.rows, args.repeats)
            print(json.dumps({case: results.data["cases"][case]}), flush=True)
            results.save()
    except KeyboardInterrupt:
        return results.interrupted(case, f"the case {case}" if case != "assets" else "building the model and data")
    return 0


if __name__ == "__main__":
    run(main)
