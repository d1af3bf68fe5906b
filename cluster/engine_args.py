"""Command-line flags for every EngineConfig field, generated from the config model itself so
a new engine knob is a flag at once; values are validated by EngineConfig, once, here.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Callable, Literal

from pydantic.fields import FieldInfo

from replica.config import EngineConfig, make_engine_config

# What a flag takes for None where None is not the field's default ("None: unbounded"): the
# flags' own default, None, means "not given".
NONE_VALUE = "none"


def flag_for(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _without_optional(annotation: Any) -> Any:
    """X for Optional[X]; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return annotation


def _takes_none(field: FieldInfo) -> bool:
    """Whether None is a value of the field the flag must be able to give: Optional, and not its default."""
    return field.default is not None and _without_optional(field.annotation) is not field.annotation


def _or_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert`, taking NONE_VALUE (any case) as itself; engine_overrides_from_args makes it None."""
    def parse(text: str) -> Any:
        return NONE_VALUE if text.lower() == NONE_VALUE else convert(text)
    parse.__name__ = convert.__name__  # argparse names it in its error: "invalid float value"
    return parse


def add_engine_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags keep EngineConfig's defaults."""
    group = parser.add_argument_group("engine", "knobs of replica.config.EngineConfig")
    for name, field in EngineConfig.model_fields.items():
        takes_none = _takes_none(field)
        default = f"{field.default}; {NONE_VALUE!r} for None" if takes_none else field.default
        # argparse expands help text with %-formatting: a literal % (block_size's "// and %") must be doubled.
        help_text = f"{field.description or name} (default: {default})".replace("%", "%%")
        # default=None marks "not given", so only explicit flags override the config.
        kwargs: dict[str, Any] = dict(dest=name, default=None, help=help_text)
        annotation = _without_optional(field.annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = typing.get_args(annotation)
        else:
            kwargs["type"] = _or_none(annotation) if takes_none else annotation
        group.add_argument(flag_for(name), **kwargs)


def engine_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (unvalidated)."""
    overrides = {}
    for name, field in EngineConfig.model_fields.items():
        value = getattr(args, name)
        if value is not None:  # NONE_VALUE is None given; a choice may be the text "none" itself
            overrides[name] = None if value == NONE_VALUE and _takes_none(field) else value
    return overrides


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed flags; raises ConfigError naming the bad field."""
    return make_engine_config(**engine_overrides_from_args(args))
