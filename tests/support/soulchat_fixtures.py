"""Small synthetic files in both SoulChat-R1 shapes, written by us (no real counselling data).

Every client turn and counselor reply carries ``SENTINEL``, so a test can tell whether conversation
text reached a log or a terminal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SENTINEL = "Zebra7731sentinel"
HANDBOOK = "Synthetic handbook: listen first, reflect feelings, ask one open question at a time."
_CLIENT = [
    "I have been feeling anxious before every exam and cannot sleep.",
    "My roommate and I keep arguing about small things.",
    "Since I moved to a new city I feel lonely most evenings.",
    "Work has been overwhelming and I feel tired all the time.",
]
_COUNSELOR = [
    "That sounds exhausting. Could you tell me more about when the feeling is strongest?",
    "It makes sense that this weighs on you. What have you tried so far?",
    "Thank you for sharing that. What would a small first step look like?",
    "I hear how much this matters to you. What do you need most right now?",
]


def client(d: int, t: int) -> str:
    return f"{_CLIENT[(d + t) % len(_CLIENT)]} ({SENTINEL} d{d} t{t})"


def counselor(d: int, t: int) -> str:
    return f"{_COUNSELOR[(d + 2 * t) % len(_COUNSELOR)]} ({SENTINEL} d{d} t{t})"


def reasoning(d: int, t: int) -> str:
    return f"<think>The client worries; reflect first, then ask one open question (d{d} t{t}).</think>\n\n"


def mdpcot_records(dialogues: int = 12, turns: int = 3) -> list[dict[str, Any]]:
    """catch_mdpcot.json shape: one record per counselor turn, earlier turns repeated in ``history``."""
    records = []
    for d in range(dialogues):
        for t in range(1 + d % turns):
            records.append(
                {
                    "system": HANDBOOK,
                    "instruction": client(d, t),
                    "input": "",
                    "output": reasoning(d, t) + counselor(d, t),
                    "history": [[client(d, k), counselor(d, k)] for k in range(t)],
                }
            )
    return records


def dialogue_records(dialogues: int = 10, turns: int = 3) -> list[dict[str, Any]]:
    """catch_dialogue.json shape: whole conversations of client/counselor turns."""
    records = []
    for d in range(dialogues):
        conversation = []
        for t in range(1 + d % turns):
            conversation.append({"role": "client", "content": client(d, t)})
            stage = ("target", "working", "ending")[min(t, 2)]
            conversation.append({"role": "counselor", "content": counselor(d, t), "stage": stage})
        records.append(
            {
                "dialogue_id": f"dlg-{d:03d}",
                "consultation_target": f"Target {d}: sleep before exams",
                "conversation": conversation,
            }
        )
    return records


def write_json(path: Path, records: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, ensure_ascii=False, indent=1))
    return path
