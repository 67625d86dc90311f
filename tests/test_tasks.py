"""The cascade's task set: the scorers on replies the way models write them, load_tasks pointing at the line and field
to fix, and the shipped deploy/cascade_tasks.jsonl (valid, varied, and what its generator writes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from loadtest.tasks import Task, TaskFileError, load_tasks, normalise, score

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "deploy" / "cascade_tasks.jsonl"


def _task(scorer: str, answer: str) -> Task:
    return Task(id="t", prompt="?", answer=answer, scorer=scorer)


@pytest.mark.parametrize("reply, correct", [
    ("1234", True), ("The answer is 1,234.", True), ("**1234**", True), ("```\n1234\n```", True), ("1234.0", True),
    ("1235", False), ("12,34", False), ("123", False), ("I don't know", False),
    ("Qwen2.5 thinks 1234", True),
])  # fmt: skip
def test_numeric_takes_the_first_number(reply: str, correct: bool) -> None:
    assert score(_task("numeric", "1234"), reply) is correct


@pytest.mark.parametrize("answer, reply, correct", [
    ("-4", "-4", True), ("-4", "The result is -4.", True), ("-4", "4", False), ("0.5", "0.50", True),
    ("3", "3, because 1 + 2 = 3", True), ("3", "1 + 2 = 3", False),
])  # fmt: skip
def test_numeric_signs_decimals_and_order(answer: str, reply: str, correct: bool) -> None:
    assert score(_task("numeric", answer), reply) is correct


@pytest.mark.parametrize("reply, correct", [
    ("Paris", True), ("The capital is Paris.", True), ("paris", True), ("It's PARIS!", True), ('"Paris"', True),
    ("Parisian", False), ("Lyon", False), ("Paris-Nord", False), ("Paris2", False),
])  # fmt: skip
def test_contains_whole_words_only(reply: str, correct: bool) -> None:
    assert score(_task("contains", "Paris"), reply) is correct


def test_contains_a_phrase_across_whitespace() -> None:
    task = _task("contains", "New Delhi")
    assert score(task, "The capital of India is New\nDelhi.")
    assert not score(task, "Delhi")


@pytest.mark.parametrize("reply, correct", [
    ("Fe", True), ("fe", True), ("`Fe`", True), ("```\nFe\n```", True), ("```text\nFe\n```", True), ("**Fe**.", True),
    ("'Fe'", True), ("Fe\nIron's symbol comes from Latin ferrum.", True), ("  Fe  ", True),
    ("F", False), ("Fe2", False), ("The symbol is Fe", False), ("Ferrum", False),
])  # fmt: skip
def test_exact_after_stripping_markdown(reply: str, correct: bool) -> None:
    assert score(_task("exact", "Fe"), reply) is correct


def test_exact_collapses_whitespace_and_strips_only_whole_quotes() -> None:
    assert score(_task("exact", "New Delhi"), "new   delhi")
    assert normalise('"a" and "b"') == '"a" and "b"'
    assert not score(_task("exact", "a and b"), '"a" and "b"')


@pytest.mark.parametrize("reply, correct", [
    ("Bern", True), ("Berne.", True), ("**bern**", True), ("Bernese", False), ("The capital is Bern", False),
])  # fmt: skip
def test_regex_anchored_alternatives(reply: str, correct: bool) -> None:
    assert score(_task("regex", "^(bern|berne)$"), reply) is correct


def test_regex_case_sensitive_when_the_pattern_says_so() -> None:
    task = _task("regex", "^(?-i:OLLEH)$")
    assert score(task, "'OLLEH'")
    assert not score(task, "olleh")


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"prompt": "What is 2 + 2?", "answer": "4", "scorer": "numeric"}'


def test_load_tasks_reads_defaults_and_skips_comments(tmp_path: Path) -> None:
    other = '{"id": "x", "kind": "k", "prompt": "p", "answer": "a", "scorer": "exact"}'
    path = _write(tmp_path, "# header", "", GOOD, other)
    assert load_tasks(path) == [Task("3", "What is 2 + 2?", "4", "numeric"), Task("x", "p", "a", "exact", "k")]


@pytest.mark.parametrize("bad, field, words", [
    ('{"prompt": "p", "answer": "4",', "", "not JSON"),
    ('["prompt", "answer"]', "", "not a JSON object"),
    ('{"prompt": "p", "answer": "4", "scorer": "fuzzy"}', "scorer", "'fuzzy' is not one of"),
    ('{"prompt": "p", "answer": "four", "scorer": "numeric"}', "answer", "not a number"),
    ('{"prompt": "p", "answer": "(bern", "scorer": "regex"}', "answer", "bad regex"),
    ('{"prompt": "p", "answer": "4", "scorer": "exact", "hint": "h"}', "hint", "unknown key"),
    ('{"prompt": "", "answer": "4", "scorer": "exact"}', "prompt", "empty"),
    ('{"prompt": "p", "scorer": "exact"}', "answer", "missing"),
    ('{"prompt": "p", "answer": 4, "scorer": "numeric"}', "answer", "must be a string"),
])  # fmt: skip
def test_load_tasks_names_line_and_field(tmp_path: Path, bad: str, field: str, words: str) -> None:
    path = _write(tmp_path, GOOD, "", bad)
    with pytest.raises(TaskFileError) as raised:
        load_tasks(path)
    assert (raised.value.line, raised.value.field) == (3, field)
    assert str(raised.value).startswith(f"{path}:3: {field + ': ' if field else ''}")
    assert words in str(raised.value)


def test_load_tasks_rejects_a_duplicate_id(tmp_path: Path) -> None:
    line = '{"id": "a", "prompt": "p", "answer": "4", "scorer": "exact"}'
    with pytest.raises(TaskFileError, match=r":2: id: duplicate id 'a' \(first on line 1\)"):
        load_tasks(_write(tmp_path, line, line))


def test_load_tasks_rejects_a_file_without_tasks(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks(_write(tmp_path, "# only a comment", ""))


def _generator(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of the script (scripts/ is not a package), registered for the test only: dataclasses look their
    module up by name."""
    spec = importlib.util.spec_from_file_location("make_cascade_tasks", REPO / "scripts" / "make_cascade_tasks.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_shipped_tasks_are_many_varied_and_unique() -> None:
    tasks = load_tasks(SHIPPED)
    kinds = {t.kind for t in tasks}
    assert len(tasks) >= 300
    assert len({t.id for t in tasks}) == len(tasks)
    assert len({t.prompt for t in tasks}) == len(tasks)
    assert len(kinds) >= 8
    assert min(sum(t.kind == k for t in tasks) for k in kinds) >= 20


def test_shipped_reference_answers_score_as_correct() -> None:
    """A regex answer is a pattern, not a reply: the generator checks those against the spellings it accepts."""
    wrong = [t.id for t in load_tasks(SHIPPED) if t.scorer != "regex" and not score(t, t.answer)]
    assert wrong == []


def test_shipped_regex_answers_are_anchored() -> None:
    patterns = [t.answer for t in load_tasks(SHIPPED) if t.scorer == "regex"]
    assert patterns and all(p.startswith("^") and p.endswith("$") for p in patterns)


def test_generator_is_deterministic_and_matches_the_shipped_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    main = _generator(monkeypatch).main
    assert main(["--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(["--out", str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() == SHIPPED.read_bytes(), "run scripts/make_cascade_tasks.py"


def test_generator_checks_its_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capital spellings and Python string values go through the scorer before they are written."""
    generator = _generator(monkeypatch)
    generator.CAPITALS["France"] = ["Paris", "**Lutetia**"]  # a reply loses the **, so the pattern cannot match it
    with pytest.raises(ValueError, match=r"capital-\d+: reference replies \['\*\*Lutetia\*\*'\] score as wrong"):
        generator.generate(100)


def test_python_answers_are_what_python_says() -> None:
    python = [t for t in load_tasks(SHIPPED) if t.kind == "python"]
    assert {t.scorer for t in python} == {"numeric", "regex"}
    for task in python:
        expr = task.prompt.split("`")[1]
        assert score(task, str(eval(expr))), task.id
