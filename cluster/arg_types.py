"""argparse types the commands share: a value a command would only refuse later (the engine
core, the server, ray.init) is a usage error naming the flag instead, exit status 2."""

from __future__ import annotations

import argparse
import ipaddress
import math
import re


def checked(convert, check, wanted: str):
    """An argparse type: `convert`, then `check`; anything else is a usage error naming the flag
    (rather than a traceback from the engine core or the server that would have used it)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {wanted}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {wanted}")
        return value
    return parse


def is_utf8(text: str) -> bool:
    """Whether `text` has a UTF-8 form: a lone surrogate (JSON's `\\ud83d` alone, or an argument
    the locale could not decode, held as Python's surrogateescape) has none, and protobuf or a
    response body would raise encoding it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


port_number = checked(int, lambda port: 0 <= port <= 65535, "a port, 0-65535")
# A port a server must listen on as given (Serve's proxies: no "any free port").
fixed_port_number = checked(int, lambda port: 1 <= port <= 65535, "a port, 1-65535")
positive_int = checked(int, lambda value: value >= 1, "an integer >= 1")
seconds = checked(float, lambda value: math.isfinite(value) and value >= 0, "a number of seconds >= 0")
positive_seconds = checked(float, lambda value: 0 < value < math.inf, "a number of seconds > 0")
positive_number = checked(float, lambda value: 0 < value < math.inf, "a number > 0")
# What torch.device takes for the devices the engine runs on.
device_name = checked(str, lambda name: re.fullmatch(r"cpu|cuda(:\d+)?", name) is not None, "cpu, cuda or cuda:N")


# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def is_address(text: str) -> bool:
    """An IP address or an RFC 1123 host name (not resolved: a name may only resolve on the nodes)."""
    return is_ip_address(text) or _HOST_NAME.fullmatch(text) is not None


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


host_address = checked(str, is_address, "an IP address or a host name")


def is_metadata_name(text: str) -> bool:
    """A name gRPC metadata can carry as a value, as Serve's proxy routes by the `application`
    one: printable ASCII, without spaces."""
    return text.isascii() and text.isprintable() and text != "" and not any(char.isspace() for char in text)


application_name = checked(str, is_metadata_name, "an application name (printable ASCII without spaces)")


def chat_template(text: str) -> str:
    """--chat-template: the template's text, from the file named or given inline (vLLM's two
    forms); a file that cannot be read or a template that does not compile is a usage error."""
    from replica.text.tokenizer import ChatTemplateError, resolve_chat_template  # jinja2 only when given

    try:
        return resolve_chat_template(text)
    except ChatTemplateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
