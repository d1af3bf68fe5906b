"""Command-line flags for every EngineConfig field, generated from the config model itself so
a new engine knob is a flag at once; values are validated by EngineConfig, once, here.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from replica.config import EngineConfig, make_engine_config


def flag_for(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _without_optional(annotation: Any) -> Any:
    """X for Optional[X]; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return annotation


def add_engine_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags keep EngineConfig's defaults."""
    group = parser.add_argument_group("engine", "knobs of replica.config.EngineConfig")
    for name, field in EngineConfig.model_fields.items():
        # argparse expands help text with %-formatting: a literal % (block_size's "// and %") must be doubled.
        help_text = f"{field.description or name} (default: {field.default})".replace("%", "%%")
        # default=None marks "not given", so only explicit flags override the config.
        kwargs: dict[str, Any] = dict(dest=name, default=None, help=help_text)
        annotation = _without_optional(field.annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = typing.get_args(annotation)
        else:
            kwargs["type"] = annotation
        group.add_argument(flag_for(name), **kwargs)


def engine_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (unvalidated)."""
    return {name: getattr(args, name) for name in EngineConfig.model_fields if getattr(args, name) is not None}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed flags; raises ConfigError naming the bad field."""
    return make_engine_config(**engine_overrides_from_args(args))
