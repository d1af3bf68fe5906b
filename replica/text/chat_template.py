"""A checkpoint's chat template (Jinja), found where Hugging Face checkpoints keep it and
rendered as transformers' apply_chat_template renders it: a sandboxed environment with
trim_blocks / lstrip_blocks, loop controls, raise_exception, strftime_now and a tojson that
keeps non-ASCII text, the special tokens as variables, and the generation prompt appended.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
LEGACY_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": "..."}
DEFAULT_TEMPLATE_NAME = "default"  # tokenizer_config.json may hold a list of named templates


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template refused it (raise_exception) or failed."""


def find_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> Optional[str]:
    """The template text, from chat_template.jinja, chat_template.json or tokenizer_config.json."""
    if (model_dir / TEMPLATE_FILE).is_file():
        return (model_dir / TEMPLATE_FILE).read_text()
    if (model_dir / LEGACY_TEMPLATE_FILE).is_file():
        return json.loads((model_dir / LEGACY_TEMPLATE_FILE).read_text()).get("chat_template")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        templates = {entry.get("name"): entry.get("template") for entry in template}
        return templates.get(DEFAULT_TEMPLATE_NAME)
    return template


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
    """The conversation as prompt text, ending where the assistant's reply begins."""
    try:
        return _compiled(template).render(messages=[dict(message) for message in messages],
                                          add_generation_prompt=True, **variables)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template refused the conversation: {error}") from error


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the checkpoint's chat template does not compile: {error}") from error


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
