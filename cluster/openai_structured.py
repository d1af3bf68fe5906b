"""How an OpenAI (or vLLM) request asks for structured output or tool calls, turned into the
one engine constraint a request may carry (replica/core/structured_output.py):

- `response_format`: `json_object`, `json_schema` (the schema is always enforced, `strict` or not);
- vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`;
- chat `tools` with `tool_choice`: `"required"` and a named function become a JSON schema the
  output must match (so any model calls a tool, the default SmolLM2 included), `"auto"` leaves
  the output free for a tool parser (cluster/tool_parsers.py), `"none"` keeps the tools in the
  prompt and the output content (no call is read from it).

Each constraint remembers the parameter it came from, so a bad one is refused naming it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from replica.core.request import InvalidRequestError
from replica.core.structured_output import StructuredOutput

JsonSchema = Union[dict[str, Any], StrictBool]  # strict: 1 is no schema


class OutputConstraint(NamedTuple):
    constraint: StructuredOutput
    param: str  # the request body's parameter it came from, as errors name it


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str  # required, as OpenAI's API and vLLM's server require it
    description: Optional[str] = None
    schema_: Optional[JsonSchema] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = ConfigDict(extra="forbid")  # vLLM's other knobs are refused by name

    json_: Optional[Union[str, JsonSchema]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[StrictBool] = None


class StructuredOutputFields(BaseModel):
    """The request-body fields of structured output, shared by completions and chat."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_json: Optional[Union[str, JsonSchema]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def asks_for_schemas(self) -> bool:
        """Whether building the body's constraints reads a schema, regex, grammar or choice
        (each checked by llguidance: a 60 KB schema takes it 0.6 s)."""
        return any(value is not None for value in (self.structured_outputs, self.guided_json, self.guided_regex,
                                                   self.guided_choice, self.guided_grammar)) or (
            self.response_format is not None and self.response_format.type == "json_schema")

    def output_constraints(self) -> list[OutputConstraint]:
        """Every constraint the body asks for (callers refuse more than one)."""
        found = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            found.append(OutputConstraint(StructuredOutput("json_object"), "response_format"))
        elif response_format is not None and response_format.type == "json_schema":
            param = "response_format.json_schema"
            if response_format.json_schema is None:
                raise InvalidRequestError(param, "required when response_format.type is json_schema")
            schema = response_format.json_schema.schema_
            found.append(OutputConstraint(StructuredOutput("json_object") if schema is None
                                          else StructuredOutput.of("json", schema, f"{param}.schema"), f"{param}.schema"))
        extras = self.structured_outputs
        if extras is not None:
            asked = [(name, value) for name, value in (("json", extras.json_), ("regex", extras.regex),
                                                      ("choice", extras.choice), ("grammar", extras.grammar))
                     if value is not None]
            if extras.json_object:
                asked.append(("json_object", True))
            if not asked:
                raise InvalidRequestError("structured_outputs", "names no constraint (json, regex, choice, grammar "
                                                                "or json_object)")
            for name, value in asked:
                found.append(_constraint(name, value, f"structured_outputs.{name}"))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append(_constraint(name, value, f"guided_{name}"))
        return found


def _constraint(kind: str, value: Any, param: str) -> OutputConstraint:
    return OutputConstraint(StructuredOutput.of(kind, value, param), param)


# ---- tools --------------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f"must be a JSON schema of type object, got type {value.get('type')!r}")
        return value

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema: an object whichever way it was given (no `type` means an
        object, as the validator reads it; as given, a forced call could be any JSON value)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters if "type" in self.parameters else {**self.parameters, "type": "object"}


def _as_resource(schema: dict[str, Any], index: int) -> dict[str, Any]:
    """A tool's parameters as a schema resource of its own (an `$id`, the tool's if it has one):
    nested in the array of calls, its "#", "#/$defs/..." and "#anchor" references still resolve
    against its own root, as JSON Schema resolves them inside any `$id`."""
    return schema if "$id" in schema else {"$id": f"urn:headroom:tool:{index}", **schema}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request's tools ask of its output: the mode, the function a named choice
    forces, the tool parser `auto` reads the output with."""

    mode: ToolMode
    function_name: Optional[str] = None
    parser: Optional[str] = None
    # parallel_tool_calls false: one call at most (the first the model wrote, under `auto`)
    single_call: bool = False


# OpenAI's own bound on the functions one request offers. Each is a schema compiled on its
# own (and one constraint over all of them under `required`): 30,000 one-property tools in a
# 4 MB body took the ingress 40 s before the request was refused for its max_tokens.
MAX_TOOLS = 128


class ToolFields(BaseModel):
    """The chat request-body fields of tool calling."""

    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    @field_validator("tools", mode="before")
    @classmethod
    def _at_most_max_tools(cls, tools: Any) -> Any:
        # Counted before any tool is validated: that alone was a second of the ingress' loop.
        if isinstance(tools, list) and len(tools) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} tools per request (as OpenAI's API), got {len(tools)}")
        return tools

    def tool_mode(self) -> ToolMode:
        """none / auto / required / named, refusing a choice the tools cannot meet."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or ()]
            if choice.function.name not in names:
                raise InvalidRequestError("tool_choice.function.name",
                                          f"{choice.function.name!r} is not among the tools ({', '.join(names) or 'none given'})")
            return "named"
        if not self.tools:
            if choice == "required":
                raise InvalidRequestError("tool_choice", "\"required\" needs tools")
            return "none"
        return choice or "auto"

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as the chat template's `tools` variable sees them (Hugging Face's form),
        None when this request gives none. Under tool_choice "none" too, as OpenAI's API and
        vLLM (by default) keep them in the model's context: the reply may draw on them, it
        just makes no call (its text is content, never parsed for calls)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_parameter_schemas(self) -> list[OutputConstraint]:
        """Each offered tool's parameters schema, to be compiled on its own so that a bad one is
        refused naming that tool (under `auto` too, where nothing else would compile it; there
        leniently: nothing enforces it, and a keyword llguidance cannot enforce, such as
        pydantic's uniqueItems for a set, is no reason to refuse the tool)."""
        mode = self.tool_mode()
        if mode == "none":
            return []
        return [OutputConstraint(StructuredOutput.of("json", tool.function.parameters_schema, param,
                                                     lenient=mode == "auto"), param)
                for index, tool in enumerate(self.tools) for param in (f"tools[{index}].function.parameters",)]

    def tool_constraint(self) -> Optional[OutputConstraint]:
        """The schema the output must match for `required` (a JSON array of calls) and a
        named function (its arguments object); None otherwise."""
        mode = self.tool_mode()
        if mode == "named":
            name = self.tool_choice.function.name
            function = next(tool.function for tool in self.tools if tool.function.name == name)
            return OutputConstraint(StructuredOutput.of("json", function.parameters_schema, "tool_choice"), "tool_choice")
        if mode == "required":
            # Each tool's parameters are a resource of their own in the root's $defs: pasted
            # under the call as they were, "#" and "#/$defs/..." pointed into the array of calls.
            resources = [_as_resource(tool.function.parameters_schema, index) for index, tool in enumerate(self.tools)]
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                  "arguments": {"$ref": resource["$id"]}},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for tool, resource in zip(self.tools, resources)
            ]}, "$defs": {f"tool_{index}": resource for index, resource in enumerate(resources)}}
            if self.parallel_tool_calls is False:
                calls["maxItems"] = 1
            return OutputConstraint(StructuredOutput.of("json", calls, "tools"), "tools")
        return None

    def tool_calling(self, parser: Optional[str]) -> Optional[ToolCalling]:
        mode = self.tool_mode()
        if mode == "none":
            return None
        return ToolCalling(mode, self.tool_choice.function.name if mode == "named" else None,
                           parser if mode == "auto" else None, single_call=self.parallel_tool_calls is False)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
