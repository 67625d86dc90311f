"""Labelled short-answer tasks for calibrating the cascade, and the scorers that judge a model's reply.

A task file is JSON Lines, one task per line (blank lines and lines starting with ``#`` are skipped):

    {"id": "add-001", "kind": "add", "prompt": "What is 47 + 38?", "answer": "85", "scorer": "numeric"}
    {"id": "capital-001", "prompt": "The capital of Switzerland?", "answer": "^(bern|berne)$", "scorer": "regex"}

``prompt``, ``answer`` and ``scorer`` are required; ``id`` (default: the line number, unique in the file) and ``kind``
(a label to break results down by) are optional; any other key is an error, so a typo cannot silently drop a field.

Every scorer first normalises the reply (surrounding whitespace, code fences, backticks, ``**``, quotes and a trailing
period go), then:

    exact     the reply, or its first line, equals the answer (case-insensitive, whitespace collapsed)
    numeric   the first number in the reply (``-3``, ``1,234``, ``2.5``) equals the answer
    contains  the answer occurs in the reply as a whole word or phrase ("Paris" in "It is Paris", not in "Parisian")
    regex     ``re.search(answer, reply, re.IGNORECASE)``; anchor it (``^...$``) to accept nothing else
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

SCORERS = ("exact", "numeric", "contains", "regex")
_REQUIRED = ("prompt", "answer", "scorer")
_OPTIONAL = ("id", "kind")

# A number as models write it, not part of a word or of a longer number (no 2.5 out of "Qwen2.5"): a sign, thousands
# separators or plain digits, decimals.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
# A whole reply in a code fence, with an optional language tag on the opening line.
_FENCE = re.compile(r"```(?:[\w+#.-]*\n)?(.*?)```", re.DOTALL)
# Markdown and quotes that models wrap a short answer in.
_WRAPPERS = (("**", "**"), ("`", "`"), ('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019"))


@dataclass(frozen=True)
class Task:
    """One prompt with its known answer; ``scorer`` (one of SCORERS) says how a reply is compared with it."""

    id: str
    prompt: str
    answer: str
    scorer: str
    kind: str = ""


class TaskFileError(ValueError):
    """A task file that cannot be used, saying where to fix it: ``<path>:<line>: <field>: <message>`` (no field for a
    line that is not a JSON object, or for a file with no tasks)."""

    def __init__(self, path: str | Path, line: int, field: str, message: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        super().__init__(f"{path}:{line}: {field}: {message}" if field else f"{path}:{line}: {message}")


def load_tasks(path: str | Path) -> list[Task]:
    """The tasks in a JSON Lines file, checked up front so that a bad task fails here and not mid-calibration."""
    tasks: list[Task] = []
    first_seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            task = _parse_line(path, lineno, line)
            if task.id in first_seen:
                first = first_seen[task.id]
                raise TaskFileError(path, lineno, "id", f"duplicate id {task.id!r} (first on line {first})")
            first_seen[task.id] = lineno
            tasks.append(task)
    if not tasks:
        raise TaskFileError(path, 1, "", "no tasks in the file")
    return tasks


def _parse_line(path: str | Path, lineno: int, line: str) -> Task:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFileError(path, lineno, "", f"not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TaskFileError(path, lineno, "", f"not a JSON object but {type(obj).__name__}")
    if problem := _problem(obj):
        raise TaskFileError(path, lineno, *problem)
    return Task(id=obj.get("id", str(lineno)), prompt=obj["prompt"], answer=obj["answer"], scorer=obj["scorer"],
                kind=obj.get("kind", ""))


def _problem(obj: dict) -> tuple[str, str] | None:
    """The first (field, message) wrong with a task object, or None."""
    for key in obj:
        if key not in _REQUIRED + _OPTIONAL:
            return key, f"unknown key (expected {', '.join(_REQUIRED + _OPTIONAL)})"
    for key in _REQUIRED:
        if key not in obj:
            return key, "missing"
    for key, value in obj.items():
        if not isinstance(value, str):
            return key, f"must be a string, not {type(value).__name__}"
    for key in ("prompt", "answer", "id"):
        if key in obj and not obj[key].strip():
            return key, "empty"
    if obj["scorer"] not in SCORERS:
        return "scorer", f"{obj['scorer']!r} is not one of {', '.join(SCORERS)}"
    if obj["scorer"] == "numeric" and not _NUMBER.fullmatch(obj["answer"].strip()):
        return "answer", f"{obj['answer']!r} is not a number"
    if obj["scorer"] == "regex":
        try:
            re.compile(obj["answer"])
        except re.error as e:
            return "answer", f"bad regex: {e}"
    return None


def normalise(text: str) -> str:
    """A reply without the wrapping models put around a short answer (fences, backticks, bold, quotes, a final period),
    peeled until nothing changes; a wrapper whose mark also occurs inside (``"a" or "b"``) is left alone."""
    while True:
        before = text
        text = text.strip()
        if fenced := _FENCE.fullmatch(text):
            text = fenced.group(1).strip()
        for left, right in _WRAPPERS:
            text = _unwrap(text, left, right)
        text = text.removesuffix(".")
        if text == before:
            return text


def _unwrap(text: str, left: str, right: str) -> str:
    inner = text[len(left):-len(right)]
    wrapped = len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right)
    return inner.strip() if wrapped and left not in inner and right not in inner else text


def score(task: Task, text: str) -> bool:
    """Whether ``text``, a model's reply to ``task.prompt``, is correct."""
    return _SCORER_FNS[task.scorer](task.answer, normalise(text))


def _collapse(text: str) -> str:
    return " ".join(text.split()).casefold()


def _exact(answer: str, text: str) -> bool:
    """Equal, or equal to the first line: a model often answers and then explains."""
    first_line = normalise(text.splitlines()[0]) if text else ""
    return _collapse(answer) in (_collapse(text), _collapse(first_line))


def _parse_number(text: str) -> float:
    return float(text.replace(",", ""))


def _numeric(answer: str, text: str) -> bool:
    """The first number, so that "The answer is 42." counts but a number in a later explanation does not."""
    found = _NUMBER.search(text)
    return found is not None and math.isclose(_parse_number(found.group()), _parse_number(answer), rel_tol=1e-9)


def _contains(answer: str, text: str) -> bool:
    """A whole word or phrase: "cold" is not in "colder" nor in "ice-cold"."""
    phrase = r"\s+".join(re.escape(word) for word in answer.split())
    return re.search(rf"(?<![^\W_])(?<!-){phrase}(?![^\W_]|-)", text, re.IGNORECASE) is not None


def _regex(answer: str, text: str) -> bool:
    return re.search(answer, text, re.IGNORECASE) is not None


_SCORER_FNS = {"exact": _exact, "numeric": _numeric, "contains": _contains, "regex": _regex}
