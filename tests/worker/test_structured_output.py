"""Structured output in the engine: answers that always parse and validate, neighbours that are
not disturbed, bad specs refused naming the field, and the lookahead, preemption and continuations
keeping each matcher right."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from worker.core.messages import Add
from worker.engine.errors import InvalidRequestError
from worker.engine.sampling_params import SamplingParams, StructuredOutput

# Bounded schemas (every answer ends within MAX_TOKENS), one feature each.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["id", "tags"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "y": {"type": "integer", "minimum": 100, "maximum": 200}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "month": {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])$"}},
     "required": ["code", "month"], "additionalProperties": False},
]
MAX_TOKENS = 48


def _schema(i: int) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[i]))


def _run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[str, str]]:
    """Each request's (text, finish_reason), all in one batch."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(engine.tokenizer.decode(tokens[i], skip_special_tokens=True), reasons[i]) for i in ids]


@pytest.fixture(scope="module")
def prompt(smollm2) -> list[int]:
    return smollm2.tokenize(messages=[{"role": "user", "content": "Answer in JSON: describe a person."}])


def test_json_schemas_validate_greedy_and_sampled_beside_unconstrained(smollm2, make_engine, prompt, prompt_ids):
    engine = make_engine()
    free = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0.9, seed=5)]
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=s, structured_output=_schema(i))
                   for i in range(len(SCHEMAS)) for t, s in ((0, None), (0.9, 100 + i))]
    results = _run(engine, [(prompt_ids[0], free[0])] + [(prompt, sp) for sp in constrained]
                   + [(prompt_ids[1], free[1])])
    for (text, reason), sp in zip(results[1:-1], constrained):
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), json.loads(sp.structured_output.spec))
    # The unconstrained neighbours answer as they do alone.
    assert [results[0], results[-1]] == _run(engine, [(prompt_ids[0], free[0]), (prompt_ids[1], free[1])])
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_regex_choice_grammar_and_json_object(make_engine, prompt):
    engine = make_engine()
    lark = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/'
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    cases = [
        (StructuredOutput("regex", r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutput("regex", r"(cat|dog)s? are (great|fine)"),
         lambda t: re.fullmatch(r"(cat|dog)s? are (great|fine)", t)),
        (StructuredOutput("choice", choices=("Paris", "London", 'say "hi"', "ünï")),
         lambda t: t in ("Paris", "London", 'say "hi"', "ünï")),
        (StructuredOutput("grammar", lark), lambda t: re.fullmatch(r"The answer is [1-9][0-9]?\.", t)),
        (StructuredOutput("grammar", gbnf), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ]
    requests = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=7, structured_output=so))
                for so, _ in cases for t in (0, 1.0)]
    results = _run(engine, requests)
    for (text, reason), (so, check) in zip(results, [c for c in cases for _ in (0, 1)]):
        if so.kind == "json_object" and reason == "length":
            continue  # an open-ended object may run past max_tokens; it parses when it ends
        assert reason == "stop" and check(text), (so, text, reason)


@pytest.mark.parametrize("so, field, says", [
    (StructuredOutput("json_schema", "{not json"), "structured_output.json_schema", "not JSON"),
    (StructuredOutput("json_schema", '{"type": "foo"}'), "structured_output.json_schema", "foo"),
    (StructuredOutput("regex", "(ab"), "structured_output.regex", "unclosed group"),
    (StructuredOutput("grammar", "start: nothing_here"), "structured_output.grammar", "nothing_here"),
    (StructuredOutput("choice"), "structured_output.choice", "give 1 to"),
    (StructuredOutput("yaml", "x"), "structured_output", "kind must be"),
])
def test_bad_specs_are_refused_naming_the_field(make_engine, prompt, so, field, says):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, SamplingParams(structured_output=so))
    assert err.value.field == field and says in err.value.message
    assert not engine.requests  # nothing admitted; the engine goes on
    three = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput("regex", "[a-z]{3}"))
    [(text, reason)] = _run(engine, [(prompt, three)])
    assert re.fullmatch("[a-z]{3}", text) and reason == "stop"


def test_min_tokens_with_a_constraint_is_refused(make_engine, prompt):
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        make_engine().add_request(prompt, SamplingParams(min_tokens=2,
                                                         structured_output=StructuredOutput("json_object")))


def test_lookahead_and_preemption_keep_the_matchers_right(make_engine, prompt, prompt_ids):
    requests = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=i, structured_output=_schema(i)))
                for i in (0, 3, 5)]
    requests += [(p, SamplingParams(max_tokens=16, temperature=0)) for p in prompt_ids[:3]]
    expected = _run(make_engine(), requests)
    ahead = make_engine(async_scheduling=True)
    # Constrained batches look ahead too: the forward launched before the step before is read,
    # the sampling (and its masks) once the matchers have taken that step's tokens.
    deferred = [0]
    original = ahead.runner.sample_launched

    def spy(logits, samplers, **kw):
        deferred[0] += ahead._inflight is not None and ahead._inflight.tokens is None
        return original(logits, samplers, **kw)

    ahead.runner.sample_launched = spy
    assert _run(ahead, requests) == expected
    assert deferred[0] >= 10, deferred[0]
    ahead.check_integrity()
    small = make_engine(num_kv_blocks=8, max_num_seqs=16)  # too few blocks for all: some are preempted
    assert _run(small, requests) == expected
    assert small.scheduler.num_preemptions > 0
    small.check_integrity()


def test_a_continuation_resumes_the_grammar(make_engine, prompt):
    # The router moves a stream as prompt + tokens so far with seed_offset = their count.
    engine = make_engine()
    so = _schema(3)
    [full] = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=so))
    k = len(full) // 2
    [rest] = engine.generate([prompt + full[:k]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                  seed_offset=k, structured_output=so))
    assert full[:k] + rest == full


def test_structured_output_crosses_to_the_engine_core():
    params = SamplingParams(structured_output=StructuredOutput("choice", choices=("a", "b")))
    add = msgspec.msgpack.decode(msgspec.msgpack.encode(Add("r", [1], params, 0.0)), type=Add)
    assert add.params.structured_output == params.structured_output
