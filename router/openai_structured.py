"""Structured output on the OpenAI-style wire: ``response_format`` (OpenAI's) and vLLM's extras
(``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, and newer vLLM's
``structured_outputs``) -> the proto's one StructuredOutput.

Only the shape is checked here; the worker compiles the spec and its complaint comes back naming
the field the client set (``response_format.json_schema.schema: ...``). Two constraints at once
are a 400 naming the second (StructuredOutputError).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protos import kvcascade_pb2 as pb

_Schema = dict[str, Any] | bool | str  # a JSON Schema, or its JSON text


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: _Schema | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its newer spelling of the guided_* fields)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    json_: _Schema | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredOutputFields(BaseModel):
    """The request fields, shared by chat and completions."""

    model_config = ConfigDict(extra="ignore", strict=True)
    response_format: ResponseFormat | None = None
    guided_json: _Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> tuple[pb.StructuredOutput | None, dict[str, str]]:
        """The constraint the body asks for (None: any text), and the engine's name for its field
        -> the name the client used (for the worker's complaints)."""
        asked: list[tuple[str, str, Any]] = []  # (client's field, proto member, value)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", "json_object", True))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise _bad("response_format.json_schema.schema", "required when type is json_schema")
            asked.append(("response_format.json_schema.schema", "json_schema", rf.json_schema.schema_))
        for name, member in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                             ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, member, getattr(self, name)))
        so = self.structured_outputs
        if so is not None:
            for name, member, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                        ("json_object", "json_object", so.json_object),
                                        ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar)):
                if value is not None and value is not False:
                    asked.append((f"structured_outputs.{name}", member, value))
        if not asked:
            return None, {}
        if len(asked) > 1:
            raise _bad(asked[1][0], f"only one structured output at a time, and {asked[0][0]} is set too")
        name, member, value = asked[0]
        msg = pb.StructuredOutput()
        if member == "json_schema":
            msg.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif member == "json_object":
            msg.json_object = True
        elif member == "choice":
            if not value:
                raise _bad(name, "give at least one choice")
            msg.choice.choices.extend(value)
        else:
            setattr(msg, member, value)
        return msg, {f"structured_output.{member}": name, "structured_output": name}


class StructuredOutputError(ValueError):
    """A 400 naming ``param`` (openai_protocol turns it into its BadRequest)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def _bad(param: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(param, f"{param}: {message}")
