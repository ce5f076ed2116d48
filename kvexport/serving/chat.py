"""Chat templates: ``messages`` to one prompt, rendered as transformers' ``apply_chat_template`` does.

The template comes from ``kvexport serve --chat-template FILE`` or, failing that, the
``chat_template`` of the export's ``tokenizer_config.json``. It is Jinja, compiled in
jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``tojson``
filter and the ``raise_exception`` and ``strftime_now`` globals, and rendered with
``messages``, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``), as transformers renders it.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvexport.errors import KvexportError

ROLES = ("system", "user", "assistant")


class ChatTemplateError(KvexportError):
    """A template that does not compile, or that refuses the messages it was given."""


@dataclass
class ChatTemplate:
    """A compiled chat template and where it came from."""

    source: str
    text: str  # the template's Jinja source
    template: Any  # jinja2.Template
    variables: frozenset[str]  # the names the template reads from its arguments (``tools``, ``enable_thinking``, ...)
    special_tokens: dict[str, str]

    @classmethod
    def find(cls, directory: Path, file: str | Path | None = None) -> ChatTemplate | None:
        """The template of ``file``, else the export's ``tokenizer_config.json`` one, else None."""
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise ChatTemplateError(f"{config_path}: not readable JSON ({exc}); fix or remove it") from None
        special = {key: str(config[key]) for key in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(config.get(key), str)}
        special.setdefault("eos_token", "<|endoftext|>")
        special.setdefault("bos_token", "<|endoftext|>")
        if file is not None:
            try:
                text = Path(file).read_text()
            except OSError as exc:
                raise ChatTemplateError(f"--chat-template {file}: can't read it ({exc.strerror}); pass a Jinja template file") from None
            return cls(str(file), text, *_compile(text, str(file)), special)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(template, str) and template:
            return cls(str(config_path), template, *_compile(template, str(config_path)), special)
        return None

    def reads(self, name: str) -> bool:
        """Whether the template reads the argument ``name`` (``tools``: whether it can render tools)."""
        return name in self.variables

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``, with ``extra`` arguments (``tools``, ``enable_thinking``, ...); a template that raises gives one line."""
        import jinja2

        arguments = {**self.special_tokens, **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return str(self.template.render(**arguments))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
        except Exception as exc:  # a template reading a value of another type than it expects (a name that is a number, ...)
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None


def _compile(text: str, source: str) -> tuple[Any, frozenset[str]]:
    """The compiled template and the argument names it reads."""
    import jinja2
    import jinja2.ext
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        parsed = environment.parse(text)  # parsed once: compiled, and searched for the names it reads
        return environment.from_string(parsed), frozenset(jinja2.meta.find_undeclared_variables(parsed))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{source}: not a valid Jinja template (line {exc.lineno}: {exc.message}); fix it") from None
