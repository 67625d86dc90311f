"""Workloads: a scenario's requests, as sessions of one or more turns, reproducible by seed.

A single request is a session of one turn; a labelled task (the tasks kind) is one, carrying
the task so that its answer can be scored. A multi-turn session hands out its next turn only
after the previous answer is in, because the next prompt carries that answer: the conversation
grows by the model's actual words, as a chat client's would.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from loadtest.tasks import Task
from loadtest import text
from loadtest.scenario import (
    CascadeMixWorkload,
    FixedWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    Range,
    Scenario,
    SharedPrefixWorkload,
    TasksWorkload,
)


@dataclass
class Request:
    """One request to send: the conversation so far and how many tokens to ask for."""

    session: int
    turn: int
    messages: list[dict[str, str]]
    max_tokens: int
    tag: str = ""  # easy | hard in a cascade mix, the task's kind in a tasks workload

    def as_text(self) -> str:
        """The conversation as one raw completion prompt (``api: completion``)."""
        parts = []
        for m in self.messages:
            if m["role"] == "system":
                parts.append(m["content"] + "\n\n")
            else:
                parts.append(f"{m['role'].capitalize()}: {m['content']}\n")
        return "".join(parts) + "Assistant:"


@dataclass
class Session:
    id: int
    users: list[str]  # one user message per turn
    max_tokens: list[int]  # one per turn
    system: str | None = None
    tag: str = ""
    think_time_s: float = 0.0
    history: list[dict[str, str]] = field(default_factory=list)  # earlier turns, answers included
    task: Task | None = None  # tasks workload: the answer is scored against this task's

    @property
    def turns(self) -> int:
        return len(self.users)

    def request(self, turn: int) -> Request:
        assert len(self.history) == 2 * turn, "turns are asked for in order, each after its answer"
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = [*system, *self.history, {"role": "user", "content": self.users[turn]}]
        return Request(self.id, turn, messages, self.max_tokens[turn], self.tag)

    def answered(self, turn: int, answer: str) -> None:
        self.history += [{"role": "user", "content": self.users[turn]}, {"role": "assistant", "content": answer}]


def _draw(rng: random.Random, r: Range | None, default: int) -> int:
    return default if r is None else rng.randint(*r)


def sessions(scenario: Scenario) -> Iterator[Session]:
    """The scenario's sessions in order; endless for the random and cascade-mix kinds (the run's
    max_requests bounds them), one per task for the tasks kind."""
    w, rng, default = scenario.workload, random.Random(scenario.seed), scenario.sampling.max_tokens
    if isinstance(w, RandomWorkload):
        for i in range(1 << 62):
            prompt = text.words(rng, _draw(rng, w.prompt_words, 0))
            yield Session(i, [prompt], [_draw(rng, w.output_tokens, default)])
    elif isinstance(w, SharedPrefixWorkload):
        docs = [text.sentences(rng, _draw(rng, w.prefix_words, 0)) for _ in range(w.prefixes)]
        pairs = [(p, u) for p in range(w.prefixes) for u in range(w.users_per_prefix)]
        rng.shuffle(pairs)
        for i, (p, u) in enumerate(pairs):
            question = f"I am user {u}. {text.words(rng, _draw(rng, w.question_words, 0))}?"
            yield Session(i, [question], [_draw(rng, w.output_tokens, default)], system=docs[p])
    elif isinstance(w, MultiTurnWorkload):
        for i in range(w.sessions):
            n = _draw(rng, w.turns, 1)
            system = text.sentences(rng, _draw(rng, w.system_words, 0)) or None
            users = [text.words(rng, _draw(rng, w.user_words, 1)) for _ in range(n)]
            yield Session(i, users, [_draw(rng, w.output_tokens, default) for _ in range(n)], system=system,
                          think_time_s=w.think_time_s)
    elif isinstance(w, CascadeMixWorkload):
        for i in range(1 << 62):
            hard = rng.random() < w.hard_fraction
            prompt = text.hard_prompt(rng) if hard else text.easy_prompt(rng)
            tokens = _draw(rng, w.hard_output_tokens if hard else w.easy_output_tokens, default)
            yield Session(i, [prompt], [tokens], tag="hard" if hard else "easy")
    elif isinstance(w, FixedWorkload):
        i = 0
        for prompt in w.prompts:
            for _ in range(w.repeat):
                yield Session(i, [prompt], [_draw(rng, w.output_tokens, default)])
                i += 1
    elif isinstance(w, TasksWorkload):
        tasks = w.tasks()
        rng.shuffle(tasks)
        for i, task in enumerate(tasks):
            yield Session(i, [task.prompt], [_draw(rng, w.output_tokens, default)], tag=task.kind, task=task)
    else:
        raise TypeError(f"unknown workload {w!r}")
