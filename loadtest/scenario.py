"""A load-test scenario: what to send, how fast, for how long, and what counts as good enough.

Scenarios are YAML files mapped onto the frozen dataclasses below, which are the one place the
keys and their defaults live. Loading checks every key: an unknown or mistyped one is refused
with its full path (``workload.prefix_wrds: unknown key (did you mean 'prefix_words'?)``).

    name, seed, protocol, api, model, max_requests, max_duration_s, request_timeout_s
    sampling:  max_tokens, temperature, ignore_eos
    arrival:   kind: closed (concurrency) | poisson (rate) | burst (size, interval_s)
    workload:  kind: random | shared_prefix | multi_turn | cascade_mix | fixed | tasks, and its keys
    slo:       ttft_s, tpot_s, e2e_s
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from loadtest.tasks import Task, load_tasks

SCENARIO_DIR = Path(__file__).parent / "scenarios"
REPO_ROOT = Path(__file__).resolve().parents[1]


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the offending key."""


# A length drawn uniformly from [lo, hi]; YAML gives either one number or [lo, hi].
Range = tuple[int, int]


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ScenarioError(f"{key}: {message}")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16  # output length when the workload sets none
    temperature: float = 0.0  # greedy: the same scenario gives the same answers
    ignore_eos: bool = True  # so output lengths are the ones asked for

    def validate(self, key: str) -> None:
        _check(self.max_tokens >= 1, f"{key}.max_tokens", "must be >= 1")
        _check(self.temperature >= 0, f"{key}.temperature", "must be >= 0")


@dataclass(frozen=True)
class Arrival:
    """closed: ``concurrency`` clients, each sending its next request when its last one ends.
    poisson: new sessions at ``rate`` per second, exponential gaps. burst: ``size`` sessions at
    once every ``interval_s`` seconds. Later turns of a multi-turn session follow their previous
    turn (after the workload's think time) rather than the arrival process."""

    kind: str = "closed"
    concurrency: int | None = None
    rate: float | None = None
    size: int | None = None
    interval_s: float | None = None

    NEEDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "closed": ("concurrency",), "poisson": ("rate",), "burst": ("size", "interval_s"),
    }  # fmt: skip

    def validate(self, key: str) -> None:
        _check(self.kind in self.NEEDS, f"{key}.kind", f"must be one of {', '.join(self.NEEDS)}, got {self.kind!r}")
        for name in ("concurrency", "rate", "size", "interval_s"):
            given = getattr(self, name) is not None
            needed = name in self.NEEDS[self.kind]
            _check(given or not needed, f"{key}.{name}", f"required for arrival kind {self.kind!r}")
            _check(needed or not given, f"{key}.{name}", f"not used by arrival kind {self.kind!r}")
            if given:
                _check(getattr(self, name) > 0, f"{key}.{name}", "must be > 0")


@dataclass(frozen=True)
class Slo:
    """Limits a request must meet to count towards goodput; an unset limit is not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def validate(self, key: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check(value is None or value > 0, f"{key}.{f.name}", "must be > 0")


# --- workloads: one dataclass per kind --------------------------------------------------------------


@dataclass(frozen=True)
class RandomWorkload:
    """Independent prompts of random words, with random prompt and output lengths."""

    kind: ClassVar[str] = "random"
    prompt_words: Range = (16, 128)
    output_tokens: Range | None = None  # None: sampling.max_tokens


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """``prefixes`` system prompts (documents) x ``users_per_prefix`` users, each asking one
    question after one of them, in a seeded shuffled order: the prefix-cache workload."""

    kind: ClassVar[str] = "shared_prefix"
    prefixes: int = 4
    users_per_prefix: int = 8
    prefix_words: Range = (200, 200)
    question_words: Range = (8, 24)
    output_tokens: Range | None = None


@dataclass(frozen=True)
class MultiTurnWorkload:
    """``sessions`` chats of ``turns`` turns; each turn resends the whole conversation so far,
    the model's actual answers included, plus a new user message."""

    kind: ClassVar[str] = "multi_turn"
    sessions: int = 8
    turns: Range = (3, 3)
    system_words: Range = (40, 40)
    user_words: Range = (8, 32)
    output_tokens: Range | None = None
    think_time_s: float = 0.0  # pause between an answer and the next turn


@dataclass(frozen=True)
class CascadeMixWorkload:
    """Easy prompts (short factual questions, short answers) and hard ones (explanations, code,
    long answers), each request tagged easy or hard."""

    kind: ClassVar[str] = "cascade_mix"
    hard_fraction: float = 0.3
    easy_output_tokens: Range = (8, 16)
    hard_output_tokens: Range = (48, 96)


@dataclass(frozen=True)
class FixedWorkload:
    """The given prompts, in order, each sent ``repeat`` times in a row."""

    kind: ClassVar[str] = "fixed"
    prompts: tuple[str, ...] = ()
    repeat: int = 1
    output_tokens: Range | None = None


@dataclass(frozen=True)
class TasksWorkload:
    """The labelled tasks of a JSON Lines file (loadtest/tasks.py), each sent once in a seeded
    shuffled order and tagged with its kind; every answer is scored against the task's, so a run
    weighs a cascade's accuracy against what it computed under load."""

    kind: ClassVar[str] = "tasks"
    file: str = ""
    output_tokens: Range | None = None

    def tasks(self) -> list[Task]:
        """The file's tasks. A relative path is looked up in the current directory, then in the
        repository root, so a bundled scenario runs from anywhere. Raises OSError or TaskFileError."""
        path = Path(self.file)
        if not path.is_absolute() and not path.exists():
            path = REPO_ROOT / path
        return load_tasks(path)


WORKLOADS: dict[str, type] = {w.kind: w for w in (RandomWorkload, SharedPrefixWorkload, MultiTurnWorkload,
                                                   CascadeMixWorkload, FixedWorkload, TasksWorkload)}
Workload = (RandomWorkload | SharedPrefixWorkload | MultiTurnWorkload | CascadeMixWorkload | FixedWorkload
            | TasksWorkload)


def _validate_workload(w: Workload, key: str) -> None:
    for f in dataclasses.fields(w):
        value = getattr(w, f.name)
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
            lo, hi = value
            _check(0 <= lo <= hi, f"{key}.{f.name}", f"needs 0 <= min <= max, got [{lo}, {hi}]")
            if f.name.endswith("tokens") or f.name == "turns":
                _check(lo >= 1, f"{key}.{f.name}", "must be >= 1")
    for name in ("prefixes", "users_per_prefix", "sessions", "repeat"):
        if hasattr(w, name):
            _check(getattr(w, name) >= 1, f"{key}.{name}", "must be >= 1")
    if isinstance(w, CascadeMixWorkload):
        _check(0 <= w.hard_fraction <= 1, f"{key}.hard_fraction", "must be in [0, 1]")
    if isinstance(w, MultiTurnWorkload):
        _check(w.think_time_s >= 0, f"{key}.think_time_s", "must be >= 0")
    if isinstance(w, FixedWorkload):
        _check(len(w.prompts) > 0, f"{key}.prompts", "needs at least one prompt")
    if isinstance(w, TasksWorkload):
        _validate_task_file(w, key)


def _validate_task_file(w: TasksWorkload, key: str) -> None:
    """Load the tasks once up front, so a missing or bad file fails before any request is sent."""
    _check(bool(w.file), f"{key}.file", "required: a JSON Lines file of tasks")
    try:
        w.tasks()
    except OSError as err:
        where = "" if Path(w.file).is_absolute() else f" (looked in the current directory, then in {REPO_ROOT})"
        raise ScenarioError(f"{key}.file: cannot read {w.file!r}: {err.strerror}{where}") from None
    except ValueError as err:  # TaskFileError (file:line: field: why), or a file that is not UTF-8
        raise ScenarioError(f"{key}.file: {err}") from None


# --- the scenario ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str = "scenario"
    description: str = ""
    seed: int = 0  # the same seed gives the same prompts, lengths and arrival times
    # grpc | http; unset: taken from the target's scheme (grpc:// or http://), else grpc.
    protocol: str | None = None
    api: str = "chat"  # chat: messages (the server applies the chat template) | completion: raw text
    model: str = ""  # empty: the served model
    # Every run stops by itself: after max_requests requests or max_duration_s seconds, whichever
    # comes first; requests still running at the time limit are cancelled and counted as cut off.
    max_requests: int = 100
    max_duration_s: float = 60.0
    request_timeout_s: float | None = None  # None: max_duration_s
    sampling: Sampling = field(default_factory=Sampling)
    arrival: Arrival = field(default_factory=lambda: Arrival(concurrency=1))
    workload: Workload = field(default_factory=RandomWorkload)
    slo: Slo = field(default_factory=Slo)

    def __post_init__(self) -> None:
        _check(self.protocol in (None, "grpc", "http"), "protocol", f"must be grpc or http, got {self.protocol!r}")
        _check(self.api in ("chat", "completion"), "api", f"must be chat or completion, got {self.api!r}")
        _check(self.max_requests >= 1, "max_requests", "must be >= 1")
        _check(self.max_duration_s > 0, "max_duration_s", "must be > 0")
        _check(self.request_timeout_s is None or self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        self.sampling.validate("sampling")
        self.arrival.validate("arrival")
        self.slo.validate("slo")
        _validate_workload(self.workload, "workload")

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_s or self.max_duration_s

    def bounded(self, max_requests: int | None = None, max_duration_s: float | None = None) -> Scenario:
        """This scenario with other bounds (the CLI's --max-requests / --max-duration)."""
        changes: dict[str, Any] = {}
        if max_requests is not None:
            changes["max_requests"] = max_requests
        if max_duration_s is not None:
            changes["max_duration_s"] = max_duration_s
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The scenario as its YAML would give it (lists, not tuples): ``scenario_from_dict`` reads it back."""
        out = dataclasses.asdict(self)
        out["workload"] = {"kind": self.workload.kind, **out["workload"]}
        return json.loads(json.dumps(out))


# --- loading -----------------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> Scenario:
    """A scenario from a YAML file, or a bundled one by name (``shared-prefix-chat``)."""
    p = Path(path)
    if not p.exists() and (SCENARIO_DIR / f"{path}.yaml").exists():
        p = SCENARIO_DIR / f"{path}.yaml"
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ScenarioError(f"cannot read scenario {str(path)!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ScenarioError(f"{p}: not valid YAML: {err}") from None
    try:
        return scenario_from_dict(data if data is not None else {})
    except ScenarioError as err:
        raise ScenarioError(f"{p}: {err}") from None


def scenario_from_dict(data: Any) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError("a scenario must be a mapping of keys to values")
    data = dict(data)
    workload = data.pop("workload", None)
    if workload is not None:
        _check(isinstance(workload, dict), "workload", "must be a mapping with a 'kind'")
        workload = dict(workload)
        kind = workload.pop("kind", None)
        _check(kind in WORKLOADS, "workload.kind", f"must be one of {', '.join(WORKLOADS)}, got {kind!r}")
        data["workload"] = _build(WORKLOADS[kind], workload, "workload", f" of workload kind {kind!r}")
    return _build(Scenario, data, "", "")


def _build(cls: type, data: dict[str, Any], prefix: str, where: str) -> Any:
    """``cls(**data)`` with every key and value checked, errors naming ``prefix.key``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            raise ScenarioError(f"{path}: unknown key{where}{hint}")
        if isinstance(value, dict) and key != "workload":
            _check(dataclasses.is_dataclass(hints[key]), path, "must not be a mapping")
            value = _build(hints[key], value, path, "")
        kwargs[key] = _convert(value, hints[key], path)
    try:
        return cls(**kwargs)
    except ScenarioError as err:
        raise ScenarioError(f"{prefix}.{err}" if prefix else str(err)) from None


def _convert(value: Any, hint: Any, path: str) -> Any:
    """``value`` as the annotated type, or a ScenarioError saying what was expected."""
    if dataclasses.is_dataclass(value) or (dataclasses.is_dataclass(hint) and value is None):
        _check(value is not None, path, "must be a mapping")
        return value
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        _check(type(None) in options, path, "must not be empty")
        return None
    for option in options:
        if option is type(None):
            continue
        if dataclasses.is_dataclass(option):  # a workload already built
            if isinstance(value, option):
                return value
            continue
        if option == Range:
            if type(value) is int:
                return (value, value)
            if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
                return (value[0], value[1])
        elif typing.get_origin(option) is tuple:  # tuple[str, ...]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return tuple(value)
        elif option is float and type(value) in (int, float):
            return float(value)
        elif type(value) is option:
            return value
    raise ScenarioError(f"{path}: expected {_describe(hint)}, got {value!r}")


def _describe(hint: Any) -> str:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    words = []
    for o in options:
        if o == Range:
            words.append("an integer or [min, max]")
        elif typing.get_origin(o) is tuple:
            words.append("a list of strings")
        elif dataclasses.is_dataclass(o):
            words.append("a mapping")
        elif o is not type(None):
            words.append({int: "an integer", float: "a number", str: "a string", bool: "true or false"}[o])
    return " or ".join(words)
