"""Token statistics of a run's data after LLaMA-Factory's chat template, per split.

Every sample goes through LLaMA-Factory's own ``SupervisedDatasetProcessor._encode_data_example``
(template, multimodal plugin, ``infer_seqlen`` truncation, label masking), so lengths and supervised
tokens are the ones training sees. Only the tokenizer calls are served differently: LLaMA-Factory
encodes each template element with one ``tokenizer.encode`` call; here a first pass over a chunk of
samples records those strings, the tokenizer encodes them in one batch (the Rust tokenizer, with no
per-call Python overhead), and a second pass runs the same LLaMA-Factory code on the cached ids.
Strings shared by many samples (a long system prompt, repeated history turns) are encoded once per
chunk. Chunks run in forked worker processes. ``tests/data/test_data_stats.py`` checks the numbers against
LLaMA-Factory's own ``get_dataset`` output.

Per split: length (mean, p50, p90, p95, p99, max; percentiles are observed lengths: at least that share
of samples is no longer), the samples LLaMA-Factory truncates at ``cutoff_len``, supervised tokens
(labels not ignored) before and after truncation, and the samples left with no supervised token.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from launcher.data.lfdata import LFData, StatsError, load_lf_data, load_splits

PERCENTILES = (50, 90, 95, 99)
CHUNK = 64  # samples per batch of strings handed to the tokenizer
DEFAULT_WARN_SHARE = 0.05  # launcher.truncation_warn_share when the config has no such key
# columns of the per-sample array
VALID, FULL_LEN, FULL_SUP, CUT_LEN, CUT_SUP = range(5)


class _BatchedTokenizer:
    """Stands in for the tokenizer inside LLaMA-Factory's encoding code.

    ``encode(text, add_special_tokens=False)``, the call LLaMA-Factory's templates make for each
    element, is answered from ids encoded in batch; every other attribute is the real tokenizer's.
    While ``collecting``, unknown strings are recorded and answered with ``[]`` (lengths of that pass
    are discarded). A string not in the cache outside collection is encoded on the spot.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}
        self._seen: Counter[str] = Counter()
        self._pending: dict[str, None] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._backend = backend if hasattr(backend, "encode_batch_fast") else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if add_special_tokens or kwargs or not isinstance(text, str):
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        if self._pending is not None:
            self._seen[text] += 1
            if text not in self._ids:
                self._pending[text] = None
                return []
        ids = self._ids.get(text)
        if ids is None:
            return self._tokenizer.encode(text, add_special_tokens=False)
        return list(ids)  # callers own their list, as with a real encode

    def collect(self) -> None:
        self._pending = {}

    def encode_pending(self) -> None:
        texts, self._pending = list(self._pending or ()), None
        if not texts:
            return
        # The first string goes through the tokenizer's own __call__, which also resets any truncation or
        # padding the backend carries from tokenizer.json; the rest through the Rust batch call directly.
        first = self._tokenizer(texts[:1], add_special_tokens=False)["input_ids"]
        if self._backend is not None:
            rest = [e.ids for e in self._backend.encode_batch_fast(texts[1:], add_special_tokens=False)]
        else:
            rest = self._tokenizer(texts[1:], add_special_tokens=False)["input_ids"] if len(texts) > 1 else []
        self._ids.update(zip(texts, first + rest, strict=True))

    def end_chunk(self, max_cached: int = 4096) -> None:
        """Keep only strings the chunk encoded more than once (system prompts, shared history turns)."""
        shared = [t for t, n in self._seen.most_common(max_cached) if n > 1]
        self._ids = {t: self._ids[t] for t in shared if t in self._ids}
        self._seen.clear()


class _Measurer:
    """Runs LLaMA-Factory's supervised encoding on samples and returns per-sample counts."""

    def __init__(self, lfd: LFData):
        from llamafactory.data.processor import SupervisedDatasetProcessor

        self.tokenizer = _BatchedTokenizer(lfd.tokenizer)
        self.cutoff = lfd.data_args.cutoff_len
        unlimited = copy.copy(lfd.data_args)
        unlimited.cutoff_len = 1 << 40
        self.cut = SupervisedDatasetProcessor(lfd.template, self.tokenizer, lfd.processor, lfd.data_args)
        self.full = SupervisedDatasetProcessor(lfd.template, self.tokenizer, lfd.processor, unlimited)

    @staticmethod
    def _valid(sample: dict[str, Any]) -> bool:
        # the check SupervisedDatasetProcessor.preprocess_dataset drops samples by
        return len(sample["_prompt"]) % 2 == 1 and len(sample["_response"]) == 1

    @staticmethod
    def _encode(processor: Any, s: dict[str, Any]) -> tuple[list[int], list[int]]:
        return processor._encode_data_example(
            prompt=s["_prompt"],
            response=s["_response"],
            system=s["_system"],
            tools=s["_tools"],
            images=s["_images"] or [],
            videos=s["_videos"] or [],
            audios=s["_audios"] or [],
        )

    def measure(self, samples: list[dict[str, Any]], keep_ids: bool = False) -> tuple[np.ndarray, list]:
        from llamafactory.extras.constants import IGNORE_INDEX

        out = np.zeros((len(samples), 5), dtype=np.int64)
        kept: list[tuple[list[int], list[int]] | None] = []
        for start in range(0, len(samples), CHUNK):
            chunk = samples[start : start + CHUNK]
            self.tokenizer.collect()
            for s in chunk:
                if self._valid(s):
                    self._encode(self.cut, s)
            self.tokenizer.encode_pending()
            for offset, s in enumerate(chunk):
                row = out[start + offset]
                if not self._valid(s):
                    if keep_ids:
                        kept.append(None)
                    continue
                ids, labels = self._encode(self.cut, s)
                row[VALID], row[CUT_LEN], row[CUT_SUP] = 1, len(ids), len(labels) - labels.count(IGNORE_INDEX)
                if len(ids) >= self.cutoff:
                    # Truncation in infer_seqlen always fills the sequence to cutoff_len, so a shorter one was
                    # not truncated and its full counts are the same; only these need the unlimited pass.
                    full_ids, full_labels = self._encode(self.full, s)
                    row[FULL_LEN], row[FULL_SUP] = len(full_ids), len(full_labels) - full_labels.count(IGNORE_INDEX)
                else:
                    row[FULL_LEN], row[FULL_SUP] = row[CUT_LEN], row[CUT_SUP]
                if keep_ids:
                    kept.append((ids, labels))
            self.tokenizer.end_chunk()
        return out, kept


_WORKER: dict[str, Any] = {}


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already


def _measure_range(bounds: tuple[int, int]) -> np.ndarray:
    start, stop = bounds
    return _WORKER["measurer"].measure(_WORKER["samples"][start:stop])[0]


def measure_samples(lfd: LFData, samples: list[dict[str, Any]], workers: int = 1) -> np.ndarray:
    """Per-sample ``[valid, full_len, full_sup, cut_len, cut_sup]`` rows, in ``samples`` order.

    With ``workers > 1`` the samples are cut into contiguous ranges measured in forked processes (each
    inherits the loaded tokenizer and template, so nothing is pickled but the ranges and the results).
    """
    measurer = _Measurer(lfd)
    if workers <= 1 or len(samples) < 4 * CHUNK:
        return measurer.measure(samples)[0]
    import multiprocessing

    _WORKER.update(measurer=measurer, samples=samples)
    step = max(CHUNK, -(-len(samples) // (workers * 8)) // CHUNK * CHUNK)
    ranges = [(i, min(i + step, len(samples))) for i in range(0, len(samples), step)]
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
            parts = list(pool.map(_measure_range, ranges))
    finally:
        _WORKER.clear()
    return np.concatenate(parts) if parts else np.zeros((0, 5), dtype=np.int64)


def summarize(rows: np.ndarray, cutoff_len: int) -> dict[str, Any]:
    """The statistics of one split from its per-sample rows."""
    valid = rows[rows[:, VALID] == 1]
    n = len(valid)
    full, cut = valid[:, FULL_LEN], valid[:, CUT_LEN]
    sup_before, sup_after = int(valid[:, FULL_SUP].sum()), int(valid[:, CUT_SUP].sum())
    truncated = int((full > cut).sum())
    length: dict[str, Any] = {"mean": round(float(full.mean()), 1) if n else None}
    for p in PERCENTILES:
        length[f"p{p}"] = int(np.percentile(full, p, method="inverted_cdf")) if n else None
    length["max"] = int(full.max()) if n else None
    return {
        "records": len(rows),
        "dropped_invalid": len(rows) - n,  # LLaMA-Factory drops these with a warning (odd prompt turns)
        "samples": n,
        "length": length,
        "truncated": {"count": truncated, "share": round(truncated / n, 4) if n else 0.0},
        "tokens": {"before": int(full.sum()), "after": int(cut.sum())},
        "supervised_tokens": {
            "before": sup_before,
            "after": sup_after,
            "lost_share": round(1 - sup_after / sup_before, 4) if sup_before else 0.0,
        },
        "no_supervised": {"before": int((valid[:, FULL_SUP] == 0).sum()), "after": int((valid[:, CUT_SUP] == 0).sum())},
    }


# Fewer validation samples than this cannot tell checkpoints apart: the eval loss's sampling noise (its
# standard error shrinks as 1/sqrt(n)) is then as large as the differences between checkpoints.
MIN_VALIDATION_SAMPLES = 20


def problems_for(result: dict[str, Any], warn_share: float) -> list[str]:
    """What makes the training or its model selection wrong: samples left without a supervised token,
    more than ``warn_share`` of the supervised tokens cut by ``cutoff_len``, a validation split too small
    to select a checkpoint by. Preflight refuses a formal run on these and warns for a smoke run."""
    found = []
    cutoff = result["cutoff_len"]
    for name, s in result["splits"].items():
        sup = s["supervised_tokens"]
        if sup["lost_share"] > warn_share:
            found.append(
                f"{name}: truncation at cutoff_len {cutoff} removes {sup['lost_share']:.1%} of the supervised "
                f"tokens ({sup['before'] - sup['after']} of {sup['before']}; threshold "
                f"launcher.truncation_warn_share {warn_share:g}); raise cutoff_len"
            )
        if s["no_supervised"]["after"]:
            found.append(
                f"{name}: {s['no_supervised']['after']} of {s['samples']} sample(s) keep no supervised token after "
                f"truncation at cutoff_len {cutoff} (they train on nothing); raise cutoff_len or drop them"
            )
    validation = result["splits"].get("validation")
    if validation is not None and validation.get("records_total", validation["samples"]) < MIN_VALIDATION_SAMPLES:
        count = validation.get("records_total", validation["samples"])
        found.append(
            f"validation: {count} sample(s) are too few to select a checkpoint by (fewer than "
            f"{MIN_VALIDATION_SAMPLES}: the eval loss's noise is as large as the differences between checkpoints); "
            "give the eval dataset more samples (launcher data prepare --val-size)"
        )
    return found


def warnings_for(result: dict[str, Any], warn_share: float) -> list[str]:
    """Warnings a user should read before a long run: samples truncated above ``warn_share``, dropped ones."""
    warns = []
    cutoff = result["cutoff_len"]
    for name, s in result["splits"].items():
        t = s["truncated"]
        if t["share"] > warn_share:
            warns.append(
                f"{name}: {t['share']:.1%} of samples ({t['count']} of {s['samples']}) are longer than cutoff_len "
                f"{cutoff} and get truncated (p99 {s['length']['p99']}, max {s['length']['max']}); raise cutoff_len "
                f"or accept it (threshold launcher.truncation_warn_share: {warn_share:g})"
            )
        if s["dropped_invalid"]:
            warns.append(f"{name}: LLaMA-Factory drops {s['dropped_invalid']} sample(s) with an invalid turn structure")
    return warns


def _without_records(message: str) -> str:
    """An upstream error message with any quoted record cut off (they quote messages in some errors)."""
    if "'content'" in message or "'role'" in message:
        return message.split(" in [", 1)[0].split(" in {", 1)[0] + " (record text withheld)"
    return message


def _sample_indices(n: int, sample: int | None, seed: int = 0) -> list[int]:
    if sample is None or n <= sample:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), sample))


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def compute_stats(
    config: Any,
    *,
    sample: int | None = None,
    workers: int | None = None,
    warn_share: float | None = None,
    lfd: LFData | None = None,
) -> dict[str, Any]:
    """Token statistics of every split of a run config (``compute_stats_with_lengths`` without the lengths).

    Args:
        config: A ``launcher.config.RunConfig``.
        sample: Measure at most this many samples per split (a seeded draw); None measures all.
        workers: Processes to measure in (default: the usable CPU cores).
        warn_share: Truncation share above which a warning is raised (default: the config's
            ``launcher.truncation_warn_share``, else 0.05).
        lfd: Already loaded LLaMA-Factory data machinery (tests reuse one).

    Returns:
        A JSON-ready dict: ``config``, ``model``, ``template``, ``cutoff_len``, ``sampled``, ``splits``
        (name -> statistics, see ``summarize``), ``warnings``, ``notes``, ``seconds``.

    Raises:
        StatsError: the config, tokenizer, template or data cannot be used; the message says how to fix it.
    """
    return compute_stats_with_lengths(config, sample=sample, workers=workers, warn_share=warn_share, lfd=lfd)[0]


def compute_stats_with_lengths(
    config: Any,
    *,
    sample: int | None = None,
    workers: int | None = None,
    warn_share: float | None = None,
    lfd: LFData | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``compute_stats`` plus each split's untruncated sample lengths (for the histogram)."""
    started = time.perf_counter()
    lf = config.llamafactory
    lfd = lfd or load_lf_data(lf)
    splits = load_splits(lfd)
    workers = default_workers() if workers is None else workers
    result: dict[str, Any] = {
        "config": str(config.source),
        "model": str(lf.get("model_name_or_path")),
        "template": lfd.data_args.template,
        "cutoff_len": lfd.data_args.cutoff_len,
        "packing": bool(lfd.data_args.packing),
        "sampled": sample,
        "splits": {},
    }
    lengths = {}
    for name, samples in splits.items():
        chosen = [samples[i] for i in _sample_indices(len(samples), sample)]
        try:
            rows = measure_samples(lfd, chosen, workers=workers)
        except ValueError as err:  # LLaMA-Factory refuses to encode (e.g. a qwen3_5 template without processor)
            raise StatsError(
                f"{name}: LLaMA-Factory cannot encode the samples with template {lfd.data_args.template!r} and the "
                f"tokenizer of {lf.get('model_name_or_path')!r}: {_without_records(str(err))}"
            ) from err
        result["splits"][name] = summarize(rows, lfd.data_args.cutoff_len) | {"records_total": len(samples)}
        lengths[name] = rows[rows[:, VALID] == 1][:, FULL_LEN]
    if warn_share is None:
        warn_share = float(getattr(config.launcher, "truncation_warn_share", DEFAULT_WARN_SHARE))
    result["warn_share"] = warn_share
    result["problems"] = problems_for(result, warn_share)
    result["warnings"] = warnings_for(result, warn_share)
    result["notes"] = lfd.notes + (
        ["packing: samples longer than cutoff_len are dropped, not truncated"] if lfd.data_args.packing else []
    )
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result, lengths


def short_stats(config: Any, sample: int = 500, warn_share: float | None = None) -> dict[str, Any]:
    """The preflight form: statistics of at most ``sample`` samples per split, measured in this process.

    Returns the ``compute_stats`` dict; ``warnings`` holds the lines a
    preflight should show (truncation above ``warn_share`` or ``launcher.truncation_warn_share``,
    samples left with no supervised token).

    Raises:
        StatsError: as ``compute_stats``.
    """
    return compute_stats(config, sample=sample, workers=1, warn_share=warn_share)


def short_stats_line(result: dict[str, Any]) -> str:
    """One line per the whole result, for a preflight table row."""
    parts = []
    for name, s in result["splits"].items():
        parts.append(
            f"{name}: p99 {s['length']['p99']}, max {s['length']['max']}, truncated {s['truncated']['share']:.1%}, "
            f"supervised kept {1 - s['supervised_tokens']['lost_share']:.1%}"
        )
    sampled = f" (sample of {result['sampled']} per split)" if result["sampled"] else ""
    return f"cutoff_len {result['cutoff_len']}{sampled}: " + "; ".join(parts)


__all__ = [
    "StatsError",
    "compute_stats",
    "compute_stats_with_lengths",
    "measure_samples",
    "short_stats",
    "short_stats_line",
    "summarize",
    "problems_for",
    "warnings_for",
]
