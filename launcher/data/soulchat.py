"""SoulChat-R1 records to LLaMA-Factory samples, one record at a time; malformed records are rejected.

SoulChat-R1 (CATCH framework) ships two files:

- ``catch_mdpcot.json``: alpaca records ``{system, instruction, input, output, history}`` where
  ``history`` is ``[[client, counselor], ...]`` and ``output`` is a ``<think>...</think>`` block followed
  by the counselor reply. Converted to the same alpaca shape, cleaned.
- ``catch_dialogue.json``: ``{dialogue_id, consultation_target, conversation: [{role, content, stage?}]}``
  with ``role`` in ``client|counselor``. Converted to sharegpt ``{conversations: [{from, value}], system}``.

Reasoning (``<think>...</think>``): ``drop`` removes every block from counselor text and then refuses any
record where a ``<think>`` or ``</think>`` tag is still left anywhere, so a no-think set holds none;
``keep`` leaves the blocks for thinking templates but still refuses unbalanced tags.

Nothing here prints or returns conversation text in a rejection: a reject carries the record index,
a kind and a reason that names fields and turn numbers only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["mdpcot", "dialogue"]
Reasoning = Literal["drop", "keep"]

CLIENT, COUNSELOR = "client", "counselor"
THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
THINK_TAG = re.compile(r"</?think>")

# Every reason a record can be rejected for; tests cover each one.
REJECT_KINDS = (
    "not_a_record",  # the record is not a JSON object
    "missing_field",  # a required field is absent or has the wrong type
    "bad_role",  # a dialogue turn's role is not client/counselor
    "empty_content",  # a turn (or the client query, or the reply) is empty
    "history_not_pairs",  # an mdpcot history item is not a [client, counselor] pair
    "not_alternating",  # dialogue turns do not alternate client/counselor, starting with the client
    "not_ending_on_counselor",  # a dialogue's last turn is the client's
    "think_tag",  # an unbalanced <think> tag, or one left where drop must leave none
)


class Rejected(ValueError):
    """A record that cannot become a training sample; ``kind`` is one of ``REJECT_KINDS``."""

    def __init__(self, kind: str, reason: str):
        assert kind in REJECT_KINDS, kind
        self.kind = kind
        self.reason = reason
        super().__init__(f"{kind}: {reason}")


@dataclass(frozen=True)
class Options:
    """How records become samples.

    Attributes:
        reasoning: ``drop`` removes ``<think>`` blocks, ``keep`` retains them.
        system: A system prompt; for mdpcot it replaces the record's own ``system``.
        system_from_target: Dialogue only: use ``consultation_target`` as the system prompt (after
            ``system`` when both are given).
    """

    reasoning: Reasoning = "drop"
    system: str | None = None
    system_from_target: bool = False


def detect_kind(records: list[Any]) -> Kind | None:
    """Which SoulChat-R1 file the records come from, judged by the first object's keys (None: neither)."""
    first = next((r for r in records if isinstance(r, dict)), None)
    if first is None:
        return None
    if "conversation" in first:
        return "dialogue"
    if "instruction" in first or "output" in first:
        return "mdpcot"
    return None


def _text(value: Any, field: str, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise Rejected("missing_field", f"{field} is {got}; expected a string")
    return value


def _counselor_text(text: str, field: str, reasoning: Reasoning) -> str:
    """Apply the reasoning option to one counselor message; refuse unbalanced or leftover tags."""
    if reasoning == "drop":
        text = THINK_BLOCK.sub("", text).lstrip()
        if THINK_TAG.search(text):
            raise Rejected("think_tag", f"{field} has an unbalanced <think> tag (left after dropping the blocks)")
        return text
    if THINK_TAG.search(THINK_BLOCK.sub("", text)):
        raise Rejected("think_tag", f"{field} has an unbalanced <think> tag")
    if not THINK_BLOCK.sub("", text).strip():
        raise Rejected("empty_content", f"{field} has reasoning but no reply after it")
    return text


def _plain_text(text: str, field: str) -> str:
    """Client and system text: never carries reasoning, so any tag there is refused."""
    if THINK_TAG.search(text):
        raise Rejected("think_tag", f"{field} contains a <think> tag (only counselor replies carry reasoning)")
    return text


def convert_mdpcot(record: Any, options: Options) -> dict[str, Any]:
    """One ``catch_mdpcot.json`` record to an alpaca sample (system, instruction, input, output, history).

    Raises:
        Rejected: the record is malformed; the reason names fields, never their text.
    """
    if not isinstance(record, dict):
        raise Rejected("not_a_record", f"record is a {type(record).__name__}; expected an object")
    instruction = _plain_text(_text(record.get("instruction"), "instruction"), "instruction")
    query = _plain_text(_text(record.get("input"), "input", required=False), "input")
    output = _text(record.get("output"), "output")
    if options.system is not None:
        system = options.system
    else:
        system = _plain_text(_text(record.get("system"), "system", required=False), "system")
    raw_history = record.get("history")
    if raw_history is None:
        raw_history = []
    if not isinstance(raw_history, list):
        raise Rejected("history_not_pairs", f"history is a {type(raw_history).__name__}; expected a list of pairs")
    history = []
    for i, pair in enumerate(raw_history):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            size = f"{len(pair)} items" if isinstance(pair, list | tuple) else f"a {type(pair).__name__}"
            raise Rejected("history_not_pairs", f"history[{i}] is {size}; expected [client, counselor]")
        client = _plain_text(_text(pair[0], f"history[{i}][0] (client)"), f"history[{i}][0] (client)")
        counselor = _text(pair[1], f"history[{i}][1] (counselor)")
        if not client.strip():
            raise Rejected("empty_content", f"history[{i}][0] (client) is empty")
        if not counselor.strip():
            raise Rejected("empty_content", f"history[{i}][1] (counselor) is empty")
        history.append([client, _counselor_text(counselor, f"history[{i}][1] (counselor)", options.reasoning)])
    if not (instruction.strip() or query.strip()):
        raise Rejected("empty_content", "instruction and input are both empty (no client turn)")
    if not output.strip():
        raise Rejected("empty_content", "output is empty")
    output = _counselor_text(output, "output", options.reasoning)
    if not output.strip():
        raise Rejected("empty_content", "output is empty once the <think> block is dropped")
    return {"system": system, "instruction": instruction, "input": query, "output": output, "history": history}


def convert_dialogue(record: Any, options: Options) -> dict[str, Any]:
    """One ``catch_dialogue.json`` record to a sharegpt sample (``conversations``, ``system``).

    Raises:
        Rejected: the record is malformed; the reason names turns and fields, never their text.
    """
    if not isinstance(record, dict):
        raise Rejected("not_a_record", f"record is a {type(record).__name__}; expected an object")
    turns = record.get("conversation")
    if not isinstance(turns, list):
        got = "missing" if turns is None else f"a {type(turns).__name__}"
        raise Rejected("missing_field", f"conversation is {got}; expected a list of turns")
    if not turns:
        raise Rejected("empty_content", "conversation has no turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Rejected("not_a_record", f"turn {i} is a {type(turn).__name__}; expected an object")
        role = turn.get("role")
        if role not in (CLIENT, COUNSELOR):
            raise Rejected("bad_role", f"turn {i} has role {role!r}; expected 'client' or 'counselor'")
        content = _text(turn.get("content"), f"turn {i} content")
        if not content.strip():
            raise Rejected("empty_content", f"turn {i} ({role}) is empty")
        if role == COUNSELOR:
            content = _counselor_text(content, f"turn {i} (counselor)", options.reasoning)
            if not content.strip():
                raise Rejected("empty_content", f"turn {i} (counselor) is empty once the <think> block is dropped")
        else:
            content = _plain_text(content, f"turn {i} (client)")
        messages.append((role, content))
    if messages[0][0] != CLIENT:
        raise Rejected("not_alternating", "turn 0 is the counselor's; a conversation must start with the client")
    for i in range(1, len(messages)):
        if messages[i][0] == messages[i - 1][0]:
            raise Rejected("not_alternating", f"turns {i - 1} and {i} are both {messages[i][0]}")
    if messages[-1][0] != COUNSELOR:
        raise Rejected("not_ending_on_counselor", f"the last turn ({len(messages) - 1}) is the client's")
    system = _dialogue_system(record, options)
    tags = {CLIENT: "human", COUNSELOR: "gpt"}
    return {"conversations": [{"from": tags[r], "value": c} for r, c in messages], "system": system}


def _dialogue_system(record: dict[str, Any], options: Options) -> str:
    parts = [options.system] if options.system else []
    if options.system_from_target:
        target = record.get("consultation_target")
        if not isinstance(target, str) or not target.strip():
            raise Rejected("missing_field", "consultation_target is missing or empty (asked for as the system prompt)")
        parts.append(_plain_text(target.strip(), "consultation_target"))
    return "\n\n".join(parts)


def convert(kind: Kind, record: Any, options: Options) -> dict[str, Any]:
    """Convert one record of either file; raises ``Rejected`` for a malformed one."""
    return convert_mdpcot(record, options) if kind == "mdpcot" else convert_dialogue(record, options)


def conversation_key(kind: Kind, record: dict[str, Any], sample: dict[str, Any]) -> str:
    """A key shared by every sample of one conversation, so a split never puts one on both sides.

    mdpcot records of one dialogue repeat its earlier turns in ``history``, so they share the first
    client turn; dialogue records carry a ``dialogue_id`` (the first client turn is the fallback).
    """
    if kind == "dialogue":
        ident = record.get("dialogue_id")
        first = f"id:{ident}" if ident not in (None, "") else "text:" + sample["conversations"][0]["value"]
    else:
        history = sample["history"]
        query = "\n".join(q for q in (sample["instruction"], sample["input"]) if q)  # as LLaMA-Factory joins them
        first = "text:" + (history[0][0] if history else query)
    return hashlib.sha256(first.encode("utf-8")).hexdigest()


def dataset_info_entry(kind: Kind, file_name: str) -> dict[str, Any]:
    """The ``dataset_info.json`` entry LLaMA-Factory needs for a converted file."""
    if kind == "mdpcot":
        columns = {
            "prompt": "instruction",
            "query": "input",
            "response": "output",
            "system": "system",
            "history": "history",
        }
        return {"file_name": file_name, "formatting": "alpaca", "columns": columns}
    return {
        "file_name": file_name,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "system": "system"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
    }


__all__ = [
    "REJECT_KINDS",
    "Options",
    "Rejected",
    "conversation_key",
    "convert",
    "convert_dialogue",
    "convert_mdpcot",
    "dataset_info_entry",
    "detect_kind",
]
