"""A checkpoint's chat template (Jinja), found where Hugging Face checkpoints keep it and
rendered as transformers' apply_chat_template renders it: a sandboxed environment with
trim_blocks / lstrip_blocks, loop controls, the `{% generation %}` tag, raise_exception,
strftime_now and a tojson that keeps non-ASCII text, the special tokens as variables, and the
generation prompt appended.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
LEGACY_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": "..."}
ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"  # NAME.jinja each, beside chat_template.jinja (transformers 4.54+)
DEFAULT_TEMPLATE_NAME = "default"  # tokenizer_config.json may hold a list of named templates
TOOL_USE_TEMPLATE_NAME = "tool_use"  # ...of which this one renders a conversation with tools


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template refused it (raise_exception) or failed."""


def find_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> Optional[str | dict[str, str]]:
    """The template text, from chat_template.jinja, chat_template.json or tokenizer_config.json;
    a checkpoint with named templates (a list of {"name", "template"}, or the files of
    additional_chat_templates/ beside the main one, which is then `default`) gives them by
    name, and select_chat_template picks one per conversation, as transformers does."""
    template = _main_chat_template(model_dir, tokenizer_config)
    extra_dir = model_dir / ADDITIONAL_TEMPLATES_DIR
    extras = ({path.stem: path.read_text(encoding="utf-8") for path in sorted(extra_dir.glob("*.jinja"))}
              if extra_dir.is_dir() else {})
    if not extras:
        return template
    named = dict(template) if isinstance(template, dict) else {DEFAULT_TEMPLATE_NAME: template} if template else {}
    return {**named, **extras}


def _main_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> Optional[str | dict[str, str]]:
    if (model_dir / TEMPLATE_FILE).is_file():
        return (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (model_dir / LEGACY_TEMPLATE_FILE).is_file():
        return json.loads((model_dir / LEGACY_TEMPLATE_FILE).read_text(encoding="utf-8")).get("chat_template")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def select_chat_template(templates: str | Mapping[str, str], tools: bool) -> str:
    """The template a conversation renders with, as transformers' get_chat_template picks it:
    the only one; or, of named templates, `tool_use` when the request has tools and the
    checkpoint names one, else `default`; ChatTemplateError when none applies."""
    if isinstance(templates, str):
        return templates
    if tools and TOOL_USE_TEMPLATE_NAME in templates:
        return templates[TOOL_USE_TEMPLATE_NAME]
    if DEFAULT_TEMPLATE_NAME in templates:
        return templates[DEFAULT_TEMPLATE_NAME]
    raise ChatTemplateError(f"the model has chat templates named {', '.join(map(repr, templates))} but none named "
                            f"{DEFAULT_TEMPLATE_NAME!r} (transformers refuses it too): serve it with --chat-template "
                            "FILE, or send a completion instead")


def check_chat_templates(templates: str | Mapping[str, str]) -> None:
    """check_chat_template for each of a checkpoint's templates, the failing one named."""
    if isinstance(templates, str):
        check_chat_template(templates)
        return
    for name, template in templates.items():
        try:
            check_chat_template(template)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{error} (the template named {name!r})") from error.__cause__


# The variables the renderer defines itself (the template's globals among them), which a
# request's own template variables (OpenAI's chat_template_kwargs) may not replace.
RENDERER_VARIABLES = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now"})


# What a template's own code raises on a conversation it does not expect (an earlier call's
# arguments as an object where it concatenates text, `|items` of a list): the conversation is
# the cause, as vLLM answers it (400), not a server fault.
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                 RuntimeError)
_NOTHING_TO_CONTINUE = "there is nothing in the rendered conversation to continue"


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, **variables: Any) -> str:
    """The conversation as prompt text, ending where the assistant's reply begins (the template's
    generation prompt, unless not `add_generation_prompt`); or, `continue_final_message`, cut
    right after the last message's content, so that the model writes on in that message (a
    template that trims the content's trailing space: after the content trimmed, as transformers
    cuts it); ChatTemplateError naming continue_final_message when the template drops or rewrites
    that content."""
    compiled = _compiled(template)
    text = _render(compiled, messages, add_generation_prompt, variables)
    if not continue_final_message:
        return text
    final = messages[-1]["content"] or ""
    if not final.strip():
        raise ChatTemplateError(f"continue_final_message: the last message's content is empty: {_NOTHING_TO_CONTINUE}")
    # Where the content ends is where a marker appended to it lands when rendered again.
    # transformers searches the text for the content itself (rindex), which for a short one
    # matched inside the template's own end-of-turn tag ("d" in ChatML's `<|im_end|>`).
    marker = f"HeadroomContinue{secrets.token_hex(8)}"  # letters and digits: no filter changes it
    marked = _render(compiled, [*messages[:-1], {**messages[-1], "content": final + marker}], add_generation_prompt,
                     variables)
    if marked.count(marker) == 1:
        cut = marked[:marked.index(marker)]
        # The text before the marker must be the conversation's own; what the template trims from
        # the content's end (kept there only because the marker followed it) stays out, as in `text`.
        for prefix in (cut, cut.rstrip()):
            if text.startswith(prefix):
                return prefix
    raise ChatTemplateError(f"continue_final_message: the chat template drops or rewrites the last message's "
                            f"content: {_NOTHING_TO_CONTINUE}")


def _render(compiled: jinja2.Template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
            variables: Mapping[str, Any]) -> str:
    try:
        return compiled.render(messages=[dict(message) for message in messages],
                               add_generation_prompt=add_generation_prompt, **variables)
    except RENDER_ERRORS as error:
        detail = str(error) if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {error}"
        raise ChatTemplateError(f"the chat template refused the conversation: {detail}") from error


def resolve_chat_template(value: str) -> str:
    """A chat template given outside the checkpoint (`--chat-template`, vLLM's flag), as vLLM
    reads it: the text of the file `value` names, or, when no such file exists and `value`
    holds Jinja (`{`), the template itself (a Serve config or Helm values can carry it inline,
    so no node needs the file). It must be UTF-8 and compile; ChatTemplateError otherwise."""
    path = Path(value)
    try:
        # Any path that is there but a directory: a file, or one a shell hands over (`<(...)`, /dev/stdin).
        is_dir = path.is_dir()
        is_file = not is_dir and path.exists()
    except (OSError, ValueError):  # a long inline template is no path the OS accepts
        is_file = is_dir = False
    if is_dir:
        raise ChatTemplateError(f"{value}: is a directory, not a chat template file")
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ChatTemplateError(f"{value}: cannot be read: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise ChatTemplateError(f"{value}: is not UTF-8 text") from None
        where = f"{value}: "
    elif "{" in value:
        template, where = value, ""
    else:
        raise ChatTemplateError(f"{value}: no such file (and, with no '{{', not a template itself)")
    if not template.strip():
        raise ChatTemplateError(f"{where}the chat template is empty")
    try:
        check_chat_template(template)
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{where}the chat template does not compile: {error.__cause__}") from None
    return template


def check_chat_template(template: str) -> None:
    """Raise ChatTemplateError when `template` does not compile: a checkpoint's broken template
    is an error at load, naming it, not a 400 blamed on every chat request's messages."""
    _compiled(template)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's
    tokens for training masks (checkpoints fine-tuned on assistant-only loss ship it):
    rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _GenerationTag])
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
