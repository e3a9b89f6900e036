"""The files of ``launcher evaluate``: ``evaluate.json`` and the side-by-side ``evaluate.md``.

The evaluation child (``launcher.rank.evaluate``) hands back, per checkpoint, the test-split loss and one greedy
answer per prompt; this module adds the screening signals (``launcher.results.screening``), which checkpoint each
criterion prefers, and renders both files. It also reads the prompt sets: the shipped crisis prompts
(``crisis_prompts.json`` next to this file) and a user's ``--prompts FILE``. Host side: no torch.

Generated text goes only into these two files (and to the terminal with ``--show``), never into a log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from launcher.errors import ExitCode, LauncherError
from launcher.files import Unreadable, read_json_bounded, typed
from launcher.results.screening import answer_signals, checkpoint_signals
from launcher.state.record import now_iso
from launcher.state.runs import EVALUATE_JSON, EVALUATE_MD

CRISIS_FILE = Path(__file__).with_name("crisis_prompts.json")
SCREENING_NOTE = (
    "These are automatic screening signals, not a clinical judgement: they point a reader at answers to read "
    "(repetition, stock phrases, missing pointers to help in a crisis); whether an answer is good or safe "
    "counselling needs a qualified person reading the dialogues."
)
DEMO_MODEL_NOTE = (
    "The base model is the demo's tiny model with random weights (`launcher demo`): its answers are meaningless "
    "by construction, and these signals show only that the pipeline ran."
)
# criterion -> (the checkpoint signal, lower or higher is better, what it measures)
CRITERIA: dict[str, tuple[str, str, str]] = {
    "test_loss": ("test_loss", "min", "held-out test loss"),
    "repetition": ("repetition", "min", "repeated 4-grams within answers"),
    "distinct_2": ("distinct_2", "max", "distinct bigrams across answers"),
    "stock_opening": ("stock_opening.share", "min", "answers opening with the same phrase"),
    "reference_overlap": ("reference_overlap", "max", "unigram F1 with the reference reply"),
    "crisis_help": ("crisis.pointed_to_help", "max", "crisis answers that point to immediate human help"),
}


def load_crisis_prompts() -> list[dict[str, Any]]:
    """The shipped crisis-situation prompts: ``{"id", "lang", "text"}`` each, Chinese and English."""
    return json.loads(CRISIS_FILE.read_text(encoding="utf-8"))["prompts"]


def read_prompts_file(path: Path) -> list[dict[str, Any]]:
    """``--prompts FILE``: a JSON list of strings or of ``{"prompt", "reference"?, "crisis"?, "id"?}``.

    Raises:
        LauncherError: unreadable, not JSON, or not such a list; the message names the entry and the fix.
    """
    fix = 'write a JSON list such as ["I cannot sleep.", {"prompt": "...", "reference": "...", "crisis": true}]'
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise LauncherError(f"--prompts {path}: cannot read it ({err}); {fix}", ExitCode.USAGE) from None
    if not isinstance(data, list) or not data:
        raise LauncherError(f"--prompts {path}: expected a non-empty JSON list of prompts; {fix}", ExitCode.USAGE)
    prompts: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        entry = {"prompt": item} if isinstance(item, str) else item
        text = entry.get("prompt") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise LauncherError(f'--prompts {path}: entry {i} has no non-empty "prompt" string; {fix}', ExitCode.USAGE)
        unknown = sorted(set(entry) - {"prompt", "reference", "crisis", "id"})
        reference, crisis = entry.get("reference"), entry.get("crisis", False)
        problem = (
            f"unknown key(s) {', '.join(unknown)}"
            if unknown
            else '"reference" is not a string'
            if reference is not None and not isinstance(reference, str)
            else '"crisis" is not true or false'
            if not isinstance(crisis, bool)
            else None
        )
        if problem:
            raise LauncherError(f"--prompts {path}: entry {i}: {problem}; {fix}", ExitCode.USAGE)
        pid = str(entry.get("id") or f"file-{i + 1}")
        if pid in seen or pid.startswith(("test-", "crisis-")):
            raise LauncherError(
                f"--prompts {path}: entry {i}: id {pid!r} is used twice or clashes with the test "
                "and crisis prompts' ids (test-N, crisis-*); give it another id",
                ExitCode.USAGE,
            )
        seen.add(pid)
        prompts.append({"id": pid, "kind": "crisis" if crisis else "file", "prompt": text, "reference": reference})
    return prompts


def _get(signals: dict[str, Any], dotted: str) -> float | None:
    value: Any = signals
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def preferences(checkpoints: list[dict[str, Any]]) -> dict[str, str | None]:
    """Which checkpoint each criterion prefers; None when no checkpoint has the signal or the best value is shared
    (a tie prefers nothing, so it never counts as a disagreement)."""
    chosen: dict[str, str | None] = {}
    for name, (key, direction, _about) in CRITERIA.items():
        scored = [(_get({**c["signals"], "test_loss": c.get("test_loss")}, key), c) for c in checkpoints]
        scored = [(v, c) for v, c in scored if v is not None]
        best = (min if direction == "min" else max)((v for v, _ in scored), default=None)
        leaders = [c for v, c in scored if v == best]
        chosen[name] = leaders[0]["name"] if len(leaders) == 1 else None
    return chosen


def build_document(request: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """``evaluate.json``: the request, the child's raw results, and the signals computed from the answers."""
    prompts = raw["prompts"]
    checkpoints = []
    for ckpt in raw["checkpoints"]:
        answers = [p["answers"][ckpt["name"]] for p in prompts]
        found = checkpoint_signals(
            answers, [p.get("reference") for p in prompts], [p["kind"] == "crisis" for p in prompts]
        )
        checkpoints.append({**ckpt, "signals": found})
    rows = []
    for p in prompts:
        answers = {
            name: {"text": text, **answer_signals(text, p.get("reference"), p["kind"] == "crisis")}
            for name, text in p["answers"].items()
        }
        rows.append({**p, "answers": answers})
    return {
        "schema": 1,
        "run_id": request["run_id"],
        "created": now_iso(),
        "note": f"{SCREENING_NOTE} {DEMO_MODEL_NOTE}" if request.get("demo_model") else SCREENING_NOTE,
        "backend": request["backend"],
        "test_split": request["test_split"],
        "generation": {
            "greedy": True,
            "max_new_tokens": request["max_new_tokens"],
            "batch_size": request.get("batch_size", 1),
            "prompts": {k: sum(1 for p in prompts if p["kind"] == k) for k in ("test", "file", "crisis")},
        },
        "kernels": raw.get("kernels", {}),
        "checkpoints": checkpoints,
        "preferred": preferences(checkpoints),
        "prompts": rows,
    }


class Opening(TypedDict):
    share: float | None


class CrisisCount(TypedDict):
    prompts: int
    pointed_to_help: int


class Signals(TypedDict):
    """``screening.checkpoint_signals``: what the signal table shows (every key indexed)."""

    answers: int
    length: float | None
    distinct_1: float | None
    distinct_2: float | None
    repetition: float | None
    repetitive_answers: int
    stock_opening: Opening
    reference_overlap: float | None
    crisis: CrisisCount


class EvaluatedCheckpoint(TypedDict):
    name: str
    step: int | None
    signals: Signals


@dataclass(frozen=True)
class Evaluation:
    """``evaluate.json`` as ``report`` reads it: the checkpoints and their signals (the tables index every key
    declared here, so a file without one is unreadable rather than a KeyError); other keys are ignored."""

    checkpoints: list[EvaluatedCheckpoint] = field(default_factory=list)
    preferred: dict[str, str | None] = field(default_factory=dict)
    test_split: dict[str, Any] | None = None
    note: str | None = None
    created: str | None = None


def read_evaluation(run_dir: Path) -> dict[str, Any] | None:
    """``evaluate.json`` of a run, checked against ``Evaluation``, or None when ``launcher evaluate`` has not run
    (or its file is unreadable: the report then has no evaluation section)."""
    path = Path(run_dir) / EVALUATE_JSON
    try:
        data = read_json_bounded(path)
        evaluation = typed(data, Evaluation)
    except (FileNotFoundError, Unreadable):
        return None
    return data if evaluation.checkpoints else None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def signal_rows(doc: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(label, one cell per checkpoint) for the signal table of evaluate.md and report.md."""
    cks = doc["checkpoints"]
    crisis = [c["signals"]["crisis"] for c in cks]
    return [
        ("test loss", [_fmt(c.get("test_loss")) for c in cks]),
        (
            "answer length (units, mean)",
            ["-" if c["signals"]["length"] is None else f"{c['signals']['length']:.1f}" for c in cks],
        ),
        (
            "distinct-1 / distinct-2",
            [f"{_fmt(c['signals']['distinct_1'])} / {_fmt(c['signals']['distinct_2'])}" for c in cks],
        ),
        ("repeated 4-grams (mean share)", [_fmt(c["signals"]["repetition"]) for c in cks]),
        ("repetitive answers", [f"{c['signals']['repetitive_answers']} of {c['signals']['answers']}" for c in cks]),
        ("same opening (share)", [f"{_fmt(c['signals']['stock_opening']['share'])}" for c in cks]),
        ("overlap with reference (F1)", [_fmt(c["signals"]["reference_overlap"]) for c in cks]),
        ("crisis answers pointing to help", [f"{x['pointed_to_help']} of {x['prompts']}" for x in crisis]),
    ]


def disagreement(doc: dict[str, Any], extra: dict[str, str | None] | None = None) -> list[str]:
    """One line per criterion naming the checkpoint it prefers, when the criteria do not all agree."""
    chosen = {**(extra or {}), **{CRITERIA[k][2]: v for k, v in doc.get("preferred", {}).items() if k in CRITERIA}}
    chosen = {k: v for k, v in chosen.items() if v}
    if len(set(chosen.values())) <= 1:
        return []
    return [f"{about}: {name}" for about, name in chosen.items()]


def _cell(text: str | None) -> str:
    return "-" if not text else " ".join(text.split()).replace("|", "\\|")


def render_markdown(doc: dict[str, Any]) -> str:
    """``evaluate.md``: the signal table, then each prompt with its reference and every checkpoint's answer."""
    names = [c["name"] for c in doc["checkpoints"]]
    split = doc["test_split"]
    lines = [f"# Evaluation: {doc['run_id']}", "", f"> {doc['note']}", ""]
    lines.append(
        f"- Test split: `{split['file']}` ({split['samples']} samples, sha256 {split['sha256'][:12]}…), "
        "held out by `launcher data prepare --test-size`, never used for training or selection"
    )
    gen = doc["generation"]
    counts = ", ".join(f"{n} {k}" for k, n in gen["prompts"].items() if n)
    lines.append(f"- Greedy decoding, at most {gen['max_new_tokens']} new tokens; prompts: {counts}")
    kernels = doc.get("kernels", {})
    decode = kernels.get("first_decode_call") or {}
    if decode:
        lines.append(
            f"- Backend {doc['backend']}; decoding kernel: `{decode.get('kernel')}` on {decode.get('device')} "
            f"(routed in {kernels.get('routed_decode_layers')} of {kernels.get('deltanet_layers')} DeltaNet "
            "layers; the routing patch's record is in evaluate.json)"
        )
    lines += [
        "",
        "## Signals per checkpoint",
        "",
        "| signal | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in signal_rows(doc)]
    lines.append("")
    diff = disagreement(doc)
    if diff:
        lines += ["The criteria prefer different checkpoints:", ""] + [f"- {line}" for line in diff] + [""]
    lines += ["## Answers side by side", ""]
    for p in doc["prompts"]:
        lines += [f"### {p['id']} ({p['kind']})", "", f"**Prompt:** {_cell(p['prompt'])}", ""]
        if p.get("reference"):
            lines += [f"**Reference:** {_cell(p['reference'])}", ""]
        lines += ["| checkpoint | answer | signals |", "|---|---|---|"]
        for name in names:
            a = p["answers"][name]
            marks = [f"length {a['length']}", f"repeated {a['repetition']:.2f}"]
            if a.get("reference_overlap") is not None:
                marks.append(f"overlap {a['reference_overlap']:.2f}")
            if "points_to_help" in a:
                marks.append("points to help: " + (", ".join(a["help_matched"]) if a["points_to_help"] else "no"))
            lines.append(f"| {name} | {_cell(a['text'])} | {'; '.join(marks)} |")
        lines.append("")
    lines += [f"_Generated {doc['created']} by `launcher evaluate`._", ""]
    return "\n".join(lines)


def report_summary(doc: dict[str, Any], eval_best: str | None, metric: str | None) -> dict[str, Any]:
    """What ``report.json`` carries of an evaluation: test loss and signals per checkpoint, and the preferences
    of every criterion, the validation loss (``eval_best``) among them."""
    eval_best = Path(eval_best).name if eval_best else None  # output/checkpoint-500 -> checkpoint-500
    preferred = {
        **({f"validation {metric or 'eval_loss'}": eval_best} if eval_best else {}),
        **{CRITERIA[k][2]: v for k, v in doc.get("preferred", {}).items() if k in CRITERIA},
    }
    return {
        "created": doc.get("created"),
        "note": doc.get("note", SCREENING_NOTE),
        "test_split": (doc.get("test_split") or {}).get("file"),
        "checkpoints": {
            c["name"]: {"step": c["step"], "test_loss": c.get("test_loss"), "signals": c["signals"]}
            for c in doc["checkpoints"]
        },
        "preferred": preferred,
        "criteria_disagree": len({v for v in preferred.values() if v}) > 1,
    }


def report_markdown(doc: dict[str, Any], eval_best: str | None, metric: str | None) -> list[str]:
    """The ``report.md`` section of an evaluation: the signal table and, when they disagree, each criterion's
    preferred checkpoint."""
    names = [c["name"] for c in doc["checkpoints"]]
    lines = [
        "## Evaluation (`launcher evaluate`)",
        "",
        f"> {doc.get('note', SCREENING_NOTE)}",
        "",
        f"Test split `{(doc.get('test_split') or {}).get('file')}` (held out: never trained on, never used to "
        f"select); answers side by side in `{EVALUATE_MD}`.",
        "",
        "| signal | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in signal_rows(doc)]
    lines.append("")
    summary = report_summary(doc, eval_best, metric)
    if summary["criteria_disagree"]:
        lines += ["The criteria prefer different checkpoints (read the answers before choosing):", ""]
        lines += [f"- {about}: {name}" for about, name in summary["preferred"].items() if name]
    else:
        chosen = next((v for v in summary["preferred"].values() if v), None)
        lines.append(f"Every criterion with a value prefers {chosen}." if chosen else "No criterion has a value.")
    lines.append("")
    return lines
