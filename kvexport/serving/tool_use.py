"""A chat request's tools and thinking, served as vLLM serves them (``/v1/chat/completions`` and ``/tokenize``).

Server-wide (:class:`ToolSettings`): the tool-call parser (``--tool-call-parser``), the
reasoning parser (``--reasoning-parser``), each chosen from the export's chat template
when its flag is left out (``none`` turns one off), and whether ``tool_choice: "auto"`` is
served (``--enable-auto-tool-choice``, as vLLM spells it).

Per request (:meth:`ToolUse.of`): ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``chat_template_kwargs`` checked with vLLM's meanings, and what follows from them:

- the chat template's extra arguments (``tools``, the request's ``chat_template_kwargs``);
  a template that does not read ``tools`` refuses them in one line;
- ``required`` and a named function are enforced by a grammar (vLLM's JSON schemas: a
  list of ``{"name", "parameters"}`` over every tool, or the named function's
  parameters), so the output always parses and its arguments validate; ``auto`` lets the
  model choose and the tool-call parser reads what it wrote; ``none`` reads no calls;
- with a reasoning parser and thinking on, every grammar (the tools' or the request's
  ``response_format``) applies after ``</think>``, as vLLM applies it;
- one :class:`~kvexport.serving.parsed_output.OutputParser` per choice, and the
  ``finish_reason`` a choice ends with (``tool_calls`` when it called, except for a named
  function, which stops as OpenAI's does).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvexport.errors import KvexportError
from kvexport.serving.chat import ChatTemplate
from kvexport.serving.config import ApiConfig
from kvexport.serving.errors import ParameterError
from kvexport.serving.parsed_output import OutputParser
from kvexport.serving.reasoning import REASONING_PARSERS, choose_reasoning_parser, reasoning_parser
from kvexport.serving.structured import Constraint, json_grammar
from kvexport.serving.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    choose_tool_parser,
    tool_parser,
)

OFF = "none"  # a parser flag's value that turns the parser off
Choice = Literal["none", "auto", "required", "named"]
# chat_template_kwargs that are request fields of their own (or the template's input)
_OWN_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message")
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolSettings:
    """The server's parsers (None: none) and whether ``tool_choice: "auto"`` is served."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    auto_tool_choice: bool = False

    @classmethod
    def resolve(cls, api: ApiConfig, template: ChatTemplate | None) -> ToolSettings:
        """The settings ``api`` gives: a parser left out (None) is the one the template implies, ``none`` is none.

        An unknown parser name is one line naming the known ones.
        """
        source = "" if template is None else template.text
        tools = _named(api.tool_call_parser, TOOL_PARSERS, "--tool-call-parser", choose_tool_parser(source))
        implied = None
        if template is not None:
            opening = _generation_prompt(template)
            implied = choose_reasoning_parser(source, reads_thinking_flag=template.reads("enable_thinking"), generation_prompt=opening)
        reasoning = _named(api.reasoning_parser, REASONING_PARSERS, "--reasoning-parser", implied)
        if api.enable_auto_tool_choice and tools is None:
            raise KvexportError(
                "--enable-auto-tool-choice needs a tool-call parser, and the chat template implies none; name one with --tool-call-parser"
            )
        return cls(tools, reasoning, api.enable_auto_tool_choice)

    @property
    def serves_auto(self) -> bool:
        """Whether ``tool_choice: "auto"`` is served (the flag, and a parser to read the calls)."""
        return self.auto_tool_choice and self.tool_call_parser is not None


def _generation_prompt(template: ChatTemplate) -> str:
    """What ``template`` renders for one user message and a generation prompt ("" if it refuses)."""
    try:
        return template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    except KvexportError:
        return ""


def chat_settings(directory: Path, api: ApiConfig) -> tuple[ChatTemplate | None, ToolSettings]:
    """The chat template and parsers ``api`` gives for the export in ``directory``; a bad template file or parser name fails in one line.

    The app reads them here, and the servers call it before an engine loads, so a mistake
    fails at once and not in every replica.
    """
    template = ChatTemplate.find(directory, api.chat_template)
    return template, ToolSettings.resolve(api, template)


def _named(flag: str | None, known: dict[str, Any], option: str, chosen: str | None) -> str | None:
    if flag is None:
        return chosen
    if flag == OFF:
        return None
    if flag not in known:
        raise KvexportError(f"{option} {flag}: unknown; use one of {', '.join([*sorted(known), OFF])}")
    return flag


@dataclass(frozen=True)
class ToolUse:
    """What one chat request asks of tools and thinking."""

    choice: Choice
    tools: list[dict[str, Any]] | None  # the request's tools, as the template sees them
    function: str | None  # the named function (choice "named")
    parallel: bool
    settings: ToolSettings
    thinking: bool  # the template's enable_thinking (a thinking model thinks unless it is false)
    template_arguments: dict[str, Any]

    @classmethod
    def of(
        cls,
        tools: Any,
        tool_choice: Any,
        parallel_tool_calls: bool | None,
        chat_template_kwargs: dict[str, Any] | None,
        settings: ToolSettings,
        template: ChatTemplate | None,
    ) -> ToolUse:
        """The request's tool use, checked; a :class:`ParameterError` naming the field otherwise (vLLM's messages where it has one)."""
        checked = _tools(tools)
        choice, function = _choice(tool_choice, checked, settings)
        if checked and template is not None and not template.reads("tools"):
            raise ParameterError(
                "tools: this model's chat template does not render tools; serve it with --chat-template FILE "
                "(a template that reads `tools`), or leave tools out",
                parameter="tools",
            )
        arguments = dict(chat_template_kwargs or {})
        own = [key for key in _OWN_FIELDS if key in arguments]
        if own:
            raise ParameterError(
                f"chat_template_kwargs: {own[0]} is a request field of its own; set it there", parameter="chat_template_kwargs"
            )
        if checked is not None:
            arguments["tools"] = checked
        # thinking is off only where the template reads the flag that turns it off (Qwen3's enable_thinking)
        thinking = not (template is not None and template.reads("enable_thinking") and arguments.get("enable_thinking") is False)
        parallel = parallel_tool_calls is not False
        return cls(choice, checked, function, parallel, settings, thinking, arguments)

    @property
    def reasons(self) -> bool:
        """Whether the output is read for reasoning first (a reasoning parser, thinking on)."""
        return self.settings.reasoning_parser is not None and self.thinking

    def constraint(self, asked: Constraint | None) -> Constraint | None:
        """The grammar the output follows: the tools' for ``required`` and a named function, else ``asked``; after the thinking when there is any."""
        forced = self._forced()
        if forced is not None and asked is not None:
            raise ParameterError(
                f"tool_choice: {self._choice_text()} sets the output's structure; leave out {asked.field.split('.')[0]}",
                parameter="tool_choice",
            )
        constraint = forced or asked
        if constraint is None or not self.reasons:
            return constraint
        assert self.settings.reasoning_parser is not None
        return dataclasses.replace(constraint, after=REASONING_PARSERS[self.settings.reasoning_parser].end)

    def output_parser(self) -> OutputParser | None:
        """A fresh parser for one choice's output (None: the output is all content)."""
        thinking = None
        if self.settings.reasoning_parser is not None:
            thinking = reasoning_parser(self.settings.reasoning_parser, self.thinking)
        calls: ToolParser | None = None
        if self.choice == "auto":
            assert self.settings.tool_call_parser is not None
            calls = tool_parser(self.settings.tool_call_parser)
        elif self.choice == "required":
            calls = RequiredToolParser()
        elif self.choice == "named":
            assert self.function is not None
            calls = NamedToolParser(self.function)
        if thinking is None and calls is None:
            return None
        return OutputParser(thinking, calls, None if self.parallel else 1)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """The ``finish_reason`` of a choice that ended with ``reason``: ``tool_calls`` when it stopped having called, as vLLM's.

        A named function stops (``stop``), as OpenAI's does.
        """
        if reason == "stop" and called and self.choice != "named":
            return "tool_calls"
        return reason

    def content(self, parsed: str | None, called: bool) -> str | None:
        """A whole reply's ``content`` as vLLM sends it: "" for a forced call; beside ``auto``'s calls, None where it is only whitespace."""
        if self.choice in ("required", "named"):
            return parsed or ""
        if called and parsed is not None and not parsed.strip():
            return None
        return parsed

    def _forced(self) -> Constraint | None:
        assert self.tools is not None or self.choice in ("none", "auto")
        if self.choice == "named":
            tool = next(t["function"] for t in self.tools or () if t["function"]["name"] == self.function)
            return Constraint("tools", json_grammar(_parameters(tool), "tools"))
        if self.choice == "required":
            return Constraint("tools", json_grammar(_required_schema(self.tools or [], self.parallel), "tools"))
        return None

    def _choice_text(self) -> str:
        return f"the function {self.function}" if self.choice == "named" else json.dumps(self.choice)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools``: a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ParameterError("tools: must be a list of tools", parameter="tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ParameterError(f'{where}: only tools of type "function" are served', parameter="tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ParameterError(f"{where}.function: must be an object with a name", parameter="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ParameterError(f"{where}.function.parameters: must be a JSON schema object", parameter="tools")
    return tools


def _choice(tool_choice: Any, tools: list[dict[str, Any]] | None, settings: ToolSettings) -> tuple[Choice, str | None]:
    """``tool_choice`` as vLLM reads it: ``auto`` when tools come without one, ``none`` without tools."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return "none", None
    if tools is None:
        raise ParameterError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if not tools:
        raise ParameterError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", parameter="tools"
        )
    if tool_choice == "required":
        return "required", None
    if tool_choice == "auto":
        if not settings.serves_auto:
            raise ParameterError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', parameter="tool_choice"
            )
        return "auto", None
    if not isinstance(tool_choice, dict):
        raise ParameterError(
            f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", "auto" or "required" are supported.',
            parameter="tool_choice",
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ParameterError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}", parameter="tool_choice")
    if "name" not in function:
        raise ParameterError(f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}", parameter="tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ParameterError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}", parameter="tool_choice")
    if not any(tool["function"]["name"] == name for tool in tools):
        raise ParameterError("The tool specified in `tool_choice` does not match any of the specified `tools`", parameter="tool_choice")
    return "named", name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema, strict (an object with no properties when it has none)."""
    parameters = function.get("parameters")
    strict = _strict(parameters) if parameters else {"type": "object", "properties": {}, "additionalProperties": False}
    assert isinstance(strict, dict)
    return strict


_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains")
_DEFINITIONS = ("$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say, as vLLM's default grammar backend reads a tool's schema.

    A model may then write only the properties a function declares; without this a JSON
    schema allows any others, and a weak model can spend its whole budget inventing keys.
    """
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    for key in _SUBSCHEMAS:
        if key in strict:
            strict[key] = _strict(strict[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(strict.get(key), list):
            strict[key] = [_strict(item) for item in strict[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(strict.get(key), dict):
            strict[key] = {name: _strict(item) for name, item in strict[key].items()}
    if (strict.get("type") == "object" or "properties" in strict) and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """VLLM's schema for ``required``: a list of one or more ``{"name", "parameters"}``, one per tool; at most one without parallel calls.

    Each tool's ``$defs`` (and ``definitions``) move to the top, where the references of every
    tool find them; two tools that define one name differently are refused.
    """
    choices = []
    hoisted: dict[str, dict[str, Any]] = {}  # "$defs" and "definitions", each moved to the top
    for tool in tools:
        parameters = _parameters(tool["function"])
        for key in _DEFINITIONS:
            definitions = hoisted.setdefault(key, {})
            for name, definition in parameters.pop(key, {}).items():
                if definitions.setdefault(name, definition) != definition:
                    raise ParameterError(f"tools: the definition {name!r} has two different schemas; rename one", parameter="tools")
        choices.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: definitions for key, definitions in hoisted.items() if definitions})
    return schema
