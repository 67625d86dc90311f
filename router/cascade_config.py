"""The cascade file (``router --cascade FILE``): which tiers answer, how sure each must be, and
how the router escalates. Parsed into frozen dataclasses that check themselves; an error names
the file, the line and the key (``cascade.yaml:9: tiers[0].threshold: must be a number``).

    name: cascade                # the model name clients send to get the cascade
    mode: full                   # full: a tier finishes, then the router decides
                                 # early: decide after the tier's first `window` tokens
    original_prompt_only: true   # false: an escalated tier also sees the draft it replaces
    tiers:                       # tried in order; the last one always answers
      - name: small
        model: qwen2.5-coder-0.5b  # the model name its workers register
        measure: mean_logprob      # mean_logprob | sum_logprob | min_prob | mean_entropy (router/confidence.py)
        threshold: -0.35           # accept when mean_logprob >= it (mean_entropy: <= it)
        window: 16                 # judge the first 16 tokens; absent: the whole answer
        max_tokens: 256            # full mode: a trial that runs past this escalates
        judge:                     # optional: a draft below `threshold` is judged by the next tier
          measure: mean_logprob    # over the draft's tokens as the next tier's model scores them
          threshold: -0.3          # the judge accepts at or above it (one prefill, no generation)
          floor: -1.5              # optional: below this own confidence, escalate unjudged
        route:                     # optional: decide before the tier runs, from the prompt alone
          file: small.router.json  # a prompt router (router/prompt_router.py; written by calibrate),
                                   # relative to this file
          threshold: 0.4           # skip the tier when its chance of a right answer is below it
        # measure: stacked         # P(right) from the prompt and the draft's measures together
        # threshold: 0.6           # (router/stacked_confidence.py): accept at or above it
        # stacked: {file: small.stacked.json}  # its model (written by calibrate), relative to this file
      - name: large
        model: qwen2.5-coder-1.5b

``CascadeFile`` re-reads the file when it changes (polled about once a second): a request keeps
the configuration it started with, and a bad new file is refused (logged, counted in metrics)
while the old one stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from router.confidence import MEASURES, ConfidenceMeasure, create_measure
from router.prompt_router import PromptRouter, PromptRouterError
from router.stacked_confidence import OWN_MEASURES, StackedConfidenceError, StackedModel, surer

log = logging.getLogger(__name__)

MODES = ("full", "early")
DEFAULT_REVIEW_PROMPT = "The answer above may be wrong. Answer the question again, correctly."


class FieldError(ValueError):
    """A bad value, at ``path`` below the object that raised it."""

    def __init__(self, path: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.path, self.message = path, message


class CascadeConfigError(ValueError):
    """A refused cascade file; ``key`` is the dotted path of the bad key, ``line`` 1-based."""

    def __init__(self, source: str, line: int | None, key: str, message: str):
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")
        self.source, self.line, self.key, self.message = source, line, key, message


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class JudgeConfig:
    """The next tier judges a draft in one prefill: the draft's tokens' logprobs under its model
    (router/confidence.py's measures over them), accepted when at least as sure as ``threshold``."""

    threshold: float
    measure: str = "mean_logprob"
    floor: float | None = None  # the tier's own confidence below which it escalates unjudged
    top_logprobs: int = 20  # mean_entropy: alternatives per draft token

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise FieldError(("measure",), f"must be one of {sorted(MEASURES)}, not {self.measure!r}")
        if not _number(self.threshold):
            raise FieldError(("threshold",), f"must be a number, not {self.threshold!r}")
        if self.floor is not None and not _number(self.floor):
            raise FieldError(("floor",), f"must be a number, not {self.floor!r}")
        if not _positive_int(self.top_logprobs):
            raise FieldError(("top_logprobs",), f"must be an integer >= 1, not {self.top_logprobs!r}")

    def create_measure(self) -> ConfidenceMeasure:
        return create_measure(self.measure, self.top_logprobs)

    def accepts(self, score: float) -> bool:
        return surer(self.measure, score, self.threshold)


_JUDGE_KEYS = {"measure", "threshold", "floor", "top_logprobs"}


@dataclass(frozen=True)
class RouteConfig:
    """Skip the tier, before it runs, for a prompt whose router puts its chance of answering
    right below ``threshold`` (router/prompt_router.py)."""

    file: str
    threshold: float
    router: PromptRouter | None = field(default=None, compare=False, repr=False)  # the file, once read

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise FieldError(("file",), f"must be a file name, not {self.file!r}")
        if not _number(self.threshold) or not 0 <= self.threshold <= 1:
            raise FieldError(("threshold",), f"must be a probability in [0, 1], not {self.threshold!r}")

    def skips(self, prompt: str | None) -> bool:
        """A prompt with no text (token ids) is never skipped: the router reads words."""
        assert self.router is not None, "a route's file is read when the cascade file is parsed"
        return prompt is not None and self.router.score(prompt) < self.threshold


_ROUTE_KEYS = {"file", "threshold"}


@dataclass(frozen=True)
class StackedConfig:
    """The model of a tier's ``measure: stacked`` (router/stacked_confidence.py)."""

    file: str
    model: StackedModel | None = field(default=None, compare=False, repr=False)  # the file, once read

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise FieldError(("file",), f"must be a file name, not {self.file!r}")


_STACKED_KEYS = {"file"}


@dataclass(frozen=True)
class TierConfig:
    model: str
    name: str = ""  # default: the model name
    measure: str = "mean_logprob"
    threshold: float | None = None  # every tier but the last needs one
    window: int | None = None  # tokens judged; None: the whole answer
    max_tokens: int | None = None  # full mode: cap of the trial
    top_logprobs: int = 20  # mean_entropy: alternatives asked for per token
    judge: JudgeConfig | None = None  # below threshold (or always, without one): the next tier judges
    route: RouteConfig | None = None  # before the tier runs: skip it for prompts it likely gets wrong
    stacked: StackedConfig | None = None  # measure stacked: its model

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise FieldError(("model",), "must be a non-empty string (the model name its workers register)")
        if not self.name:
            object.__setattr__(self, "name", self.model)
        if not isinstance(self.name, str):
            raise FieldError(("name",), "must be a string")
        if self.measure not in OWN_MEASURES:
            raise FieldError(("measure",), f"must be one of {sorted(OWN_MEASURES)}, not {self.measure!r}")
        if self.threshold is not None and not _number(self.threshold):
            raise FieldError(("threshold",), f"must be a number, not {self.threshold!r}")
        if self.measure == "stacked":
            if self.stacked is None:
                raise FieldError(("stacked",), "missing: measure stacked reads its model from `stacked: {file: F}`")
            if self.threshold is not None and not 0 <= self.threshold <= 1:
                raise FieldError(("threshold",), f"measure stacked: must be a probability in [0, 1], "
                                                 f"not {self.threshold!r}")
        elif self.stacked is not None:
            raise FieldError(("stacked",), f"only with measure: stacked (this tier's is {self.measure})")
        for key in ("window", "max_tokens", "top_logprobs"):
            value = getattr(self, key)
            if value is not None and not _positive_int(value):
                raise FieldError((key,), f"must be an integer >= 1, not {value!r}")

    def create_measure(self, prompt: str | None = None) -> ConfidenceMeasure:
        """The tier's measure for a request with this prompt text (only the stacked one reads it)."""
        if self.stacked is not None:
            assert self.stacked.model is not None, "a stacked file is read when the cascade file is parsed"
            return self.stacked.model.measure(prompt)
        return create_measure(self.measure, self.top_logprobs)

    def accepts(self, confidence: float) -> bool:
        """Accepted on its own confidence, without asking a judge."""
        return self.threshold is not None and surer(self.measure, confidence, self.threshold)

    def judged(self, confidence: float) -> bool:
        """Not accepted on its own: does the next tier judge it (else it escalates)?"""
        return self.judge is not None and (self.judge.floor is None
                                           or surer(self.measure, confidence, self.judge.floor))


@dataclass(frozen=True)
class CascadeConfig:
    tiers: tuple[TierConfig, ...]
    name: str = "cascade"
    mode: str = "full"
    original_prompt_only: bool = True
    review_prompt: str = DEFAULT_REVIEW_PROMPT  # original_prompt_only false: asked after the draft
    source: str = field(default="<cascade>", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FieldError(("name",), "must be a non-empty string")
        if self.mode not in MODES:
            raise FieldError(("mode",), f"must be one of {list(MODES)}, not {self.mode!r}")
        for key in ("original_prompt_only",):
            if not isinstance(getattr(self, key), bool):
                raise FieldError((key,), "must be true or false")
        if not isinstance(self.review_prompt, str):
            raise FieldError(("review_prompt",), "must be a string")
        if len(self.tiers) < 2:
            raise FieldError(("tiers",), "a cascade needs at least two tiers")
        seen: set[str] = set()
        for i, tier in enumerate(self.tiers):
            if tier.name in seen:
                raise FieldError(("tiers", i, "name"), f"tier name {tier.name!r} is used twice")
            seen.add(tier.name)
            last = i == len(self.tiers) - 1
            if last and tier.threshold is not None:
                raise FieldError(("tiers", i, "threshold"), "the last tier always answers: it takes no threshold")
            if last and tier.judge is not None:
                raise FieldError(("tiers", i, "judge"), "the last tier always answers: no tier after it judges")
            if last and tier.route is not None:
                raise FieldError(("tiers", i, "route"), "the last tier always answers: it cannot be skipped")
            if not last and tier.threshold is None and tier.judge is None:
                raise FieldError(("tiers", i, "threshold"),
                                 "missing: every tier but the last needs a threshold (or a judge)")
            if not last and self.mode == "early" and tier.window is None:
                raise FieldError(("tiers", i, "window"), "missing: mode early decides after `window` tokens")
        if self.name in seen:
            raise FieldError(("name",), f"{self.name!r} is also a tier's name; pick another")

    def tier(self, name: str) -> TierConfig | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def models(self) -> list[str]:
        """The distinct models of the tiers, in tier order."""
        return list(dict.fromkeys(t.model for t in self.tiers))


# --- the YAML file, with line numbers -----------------------------------------------------------

_TOP_KEYS = {"name", "mode", "original_prompt_only", "review_prompt", "tiers"}
_TIER_KEYS = {"name", "model", "measure", "threshold", "window", "max_tokens", "top_logprobs", "judge", "route",
              "stacked"}


def _key(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def _lines(node: yaml.Node, path: tuple[str | int, ...], out: dict[tuple, int], source: str) -> None:
    """The 1-based line of every key and list item below ``node``; refuses duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = (*path, str(key_node.value))
            if sub in out:
                raise CascadeConfigError(source, key_node.start_mark.line + 1, _key(sub), "duplicate key")
            out[sub] = key_node.start_mark.line + 1
            _lines(value_node, sub, out, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = item.start_mark.line + 1
            _lines(item, (*path, i), out, source)


def parse_cascade(text: str, source: str = "<cascade>", base: Path | None = None) -> CascadeConfig:
    """A CascadeConfig from YAML text, or a CascadeConfigError naming line and key; a route's
    file is read relative to ``base`` (load_cascade: the cascade file's folder)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise CascadeConfigError(source, mark.line + 1 if mark else None, "", f"not valid YAML: {exc.problem}") \
            from None
    finally:
        loader.dispose()
    lines: dict[tuple, int] = {}
    if node is not None:
        _lines(node, (), lines, source)

    def fail(path: tuple[str | int, ...], message: str) -> CascadeConfigError:
        # The line of the deepest part of the path the file has (a missing key: its parent's).
        line = next((lines[path[:n]] for n in range(len(path), 0, -1) if path[:n] in lines), 1)
        return CascadeConfigError(source, line, _key(path), message)

    if not isinstance(data, dict):
        raise fail((), "the file must be a mapping with a `tiers` list")
    for key in data:
        if key not in _TOP_KEYS:
            raise fail((str(key),), f"unknown key; known: {sorted(_TOP_KEYS)}")
    tiers_data = data.get("tiers")
    if not isinstance(tiers_data, list):
        raise fail(("tiers",), "missing or not a list of tiers")
    tiers = []
    for i, item in enumerate(tiers_data):
        if not isinstance(item, dict):
            raise fail(("tiers", i), "a tier must be a mapping (model, measure, threshold, ...)")
        for key in item:
            if key not in _TIER_KEYS:
                raise fail(("tiers", i, str(key)), f"unknown key; known: {sorted(_TIER_KEYS)}")
        if "model" not in item:
            raise fail(("tiers", i, "model"), "missing: the model name its workers register")
        item = dict(item)
        if "judge" in item:
            item["judge"] = _judge(item["judge"], ("tiers", i, "judge"), fail)
        if "route" in item:
            item["route"] = _route(item["route"], ("tiers", i, "route"), fail, base or Path.cwd())
        if "stacked" in item:
            item["stacked"] = _stacked(item["stacked"], ("tiers", i, "stacked"), fail, base or Path.cwd())
        try:
            tiers.append(TierConfig(**item))
        except FieldError as err:
            raise fail(("tiers", i, *err.path), err.message) from None
    top = {k: v for k, v in data.items() if k != "tiers"}
    try:
        return CascadeConfig(tiers=tuple(tiers), source=source, **top)
    except FieldError as err:
        raise fail(err.path, err.message) from None


def _check_mapping(data: Any, path: tuple[str | int, ...], fail, shape: str, known: set[str],
                   required: dict[str, str]) -> None:
    """A nested section (judge, route, stacked): a mapping (``shape`` names its keys), of ``known``
    keys only, holding each of ``required`` (key: what is missing, in the message)."""
    if not isinstance(data, dict):
        raise fail(path, f"must be a mapping ({shape})")
    for key in data:
        if key not in known:
            raise fail((*path, str(key)), f"unknown key; known: {sorted(known)}")
    for key, what in required.items():
        if key not in data:
            raise fail((*path, key), f"missing: {what}")


def _judge(data: Any, path: tuple[str | int, ...], fail) -> JudgeConfig:
    _check_mapping(data, path, fail, "measure, threshold, floor", _JUDGE_KEYS,
                   {"threshold": "the judge's score to accept at"})
    try:
        return JudgeConfig(**data)
    except FieldError as err:
        raise fail((*path, *err.path), err.message) from None


def _route(data: Any, path: tuple[str | int, ...], fail, base: Path) -> RouteConfig:
    _check_mapping(data, path, fail, "file, threshold", _ROUTE_KEYS,
                   {"file": "the prompt router's file",
                    "threshold": "the chance of a right answer below which the tier is skipped"})
    try:
        route = RouteConfig(data["file"], data["threshold"])
    except FieldError as err:
        raise fail((*path, *err.path), err.message) from None
    try:
        return replace(route, router=PromptRouter.load(base / route.file))
    except PromptRouterError as err:
        raise fail((*path, "file"), str(err)) from None


def _stacked(data: Any, path: tuple[str | int, ...], fail, base: Path) -> StackedConfig:
    _check_mapping(data, path, fail, "file", _STACKED_KEYS, {"file": "the stacked confidence's file"})
    try:
        stacked = StackedConfig(data["file"])
    except FieldError as err:
        raise fail((*path, *err.path), err.message) from None
    try:
        return replace(stacked, model=StackedModel.load(base / stacked.file))
    except StackedConfidenceError as err:
        raise fail((*path, "file"), str(err)) from None


def load_cascade(path: str | os.PathLike[str]) -> CascadeConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CascadeConfigError(str(path), None, "", f"cannot read: {exc.strerror or exc}") from None
    return parse_cascade(text, str(path), path.parent)


class CascadeFile:
    """The cascade of a file, re-read when it changes. ``config`` is always a valid one: the first
    load raises on a bad file, a later bad version is refused and the last good one kept."""

    def __init__(self, path: str | os.PathLike[str], on_reload=None):
        self.path = Path(path)
        self._stamp = self._stat()
        self.config = load_cascade(self.path)
        self.on_reload = on_reload  # called with "ok" or "error" after each changed file

    def _stat(self) -> tuple[int, int, int] | None:
        # stat follows symlinks: a Kubernetes ConfigMap swaps the ..data link, changing the target.
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def check(self) -> bool:
        """Reload if the file changed; True when a new configuration took effect."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:  # unchanged, or mid-swap: look again next time
            return False
        self._stamp = stamp
        try:
            config = load_cascade(self.path)
        except CascadeConfigError as err:
            log.error("refused the changed cascade file, keeping the previous one: %s", err)
            self._report("error")
            return False
        self.config = config
        log.info("cascade reloaded from %s: tiers %s, mode %s", self.path, [t.name for t in config.tiers],
                 config.mode)
        self._report("ok")
        return True

    def _report(self, result: str) -> None:
        if self.on_reload is not None:
            self.on_reload(result)

    async def watch(self, poll_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(poll_s)
            self.check()
