"""`headroom generate`: one prompt (or, with --chat, one user message through the model's chat
template) through the cluster's gRPC endpoint (Serve's proxy, or a single `headroom replica`),
its text streamed to stdout as it is generated, with control characters escaped (a model can
emit ESC sequences that would drive the terminal) unless --raw. The sampling flags are the
request's SamplingParams (an unset one takes the server's default: the model's
generation_config.json, else vLLM's); --json-schema, --json-object, --regex, --grammar and
--choice constrain the output (structured outputs).

Also how a gRPC client command (generate, bench) reaches --target: plaintext, or TLS (--tls,
--tls-ca-cert) to a TLS-terminating proxy in front of Serve's gRPC port, which has no TLS of
its own; with the API key as call metadata either way.
"""

from __future__ import annotations

import argparse
import math
import ssl
import struct
import sys
import unicodedata
from typing import Optional, Union

import grpc

from cluster.arg_types import application_name, checked, is_utf8, positive_seconds
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.server.auth import CredentialsError, add_client_api_key_argument, authorization_metadata, client_api_key

def float32(text: str) -> float:
    """A number as the request's 32-bit float fields carry it: 1e-46 arrives as 0 and 1e39 does
    not fit (ValueError), so the range checks below see what the server would."""
    try:
        return struct.unpack("f", struct.pack("f", float(text)))[0]
    except OverflowError:
        raise ValueError(text) from None


# What the request's fields carry (protos/headroom.proto: uint32 max_tokens, uint64 seed, float
# sampling values), and what the server takes: a value outside them was a traceback here, or a
# refusal there.
max_tokens_value = checked(int, lambda value: 1 <= value < 2 ** 32, "an integer from 1 to 4294967295")
seed_value = checked(int, lambda value: 0 <= value < 2 ** 64, "an integer from 0 to 2**64 - 1")
temperature_value = checked(float32, lambda value: 0 <= value < math.inf, "a number >= 0")
top_p_value = checked(float32, lambda value: 0 < value <= 1, "a number in (0, 1]")
top_k_value = checked(int, lambda value: value == -1 or 0 <= value < 2 ** 31, "-1 (off) or an integer >= 0")
min_p_value = checked(float32, lambda value: 0 <= value <= 1, "a number in [0, 1]")


# An argument the locale could not decode holds surrogate escapes: setting it on the request
# raised UnicodeEncodeError, a traceback.
utf8_text = checked(str, is_utf8, "not UTF-8 text")
stop_text = checked(str, lambda text: text != "" and is_utf8(text), "non-empty UTF-8 text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", type=utf8_text, help="prompt text (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--system", type=utf8_text, default=None,
                        help="with --chat: a system message before the user's")
    add_target_arguments(parser)
    parser.add_argument("--max-tokens", type=max_tokens_value, default=64,
                        help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=temperature_value, default=None,
                        help="0 = greedy (default: the server's: the model's generation_config.json, else 1.0)")
    parser.add_argument("--top-p", type=top_p_value, default=None, help="nucleus sampling: the smallest set of "
                        "tokens whose probability reaches this (default: the server's)")
    parser.add_argument("--top-k", type=top_k_value, default=None,
                        help="sample among the k most likely tokens; -1: all (default: the server's)")
    parser.add_argument("--min-p", type=min_p_value, default=None,
                        help="drop tokens less likely than this times the likeliest (default: the server's)")
    parser.add_argument("--seed", type=seed_value, default=None, help="sampler seed, for reproducible output")
    parser.add_argument("--stop", action="append", type=stop_text, default=None, metavar="TEXT",
                        help="end the output before this text (repeat the flag for each)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate --max-tokens tokens even past the model's end-of-sequence token")
    parser.add_argument("--timeout-s", type=positive_seconds, default=300.0, help="give up after this long (default: %(default)s)")
    parser.add_argument("--raw", action="store_true",
                        help="write the text as generated, control characters included (default: escape them)")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", default=None,
                            help="the output is JSON that validates against the JSON schema in FILE")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", type=utf8_text, default=None, help="the output matches this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", default=None,
                            help="the output is a sentence of the Lark grammar in FILE (its start rule: start)")
    constraint.add_argument("--choice", action="append", type=utf8_text, default=None, metavar="TEXT",
                            help="the output is exactly one of these (repeat the flag for each choice)")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a gRPC client command sends its requests (shared with `headroom bench`)."""
    parser.add_argument("--target", default="127.0.0.1:9000", help="gRPC address host:port (default: %(default)s)")
    parser.add_argument("--application", type=application_name, default=None,
                        help="Serve application (model) to call; needed when the cluster serves several")
    add_client_api_key_argument(parser)
    parser.add_argument("--tls", action="store_true",
                        help="speak TLS to --target (a TLS-terminating proxy in front of the cluster's gRPC port), "
                             "verifying its certificate against the system's trust store")
    parser.add_argument("--tls-ca-cert", default=None, metavar="FILE",
                        help="speak TLS to --target, verifying its certificate against the PEM CA certificate(s) "
                             "in FILE instead (implies --tls)")


class TargetError(ValueError):
    """A client flag about --target that cannot be used; names the flag."""


def channel_credentials(args: argparse.Namespace) -> Optional[grpc.ChannelCredentials]:
    """None (plaintext) without --tls and --tls-ca-cert; else TLS verified against the CA
    file, or the system's trust store (OpenSSL's default CA file, $SSL_CERT_FILE where set;
    gRPC's own roots on a system without one). Raises TargetError naming a bad file."""
    if not args.tls and args.tls_ca_cert is None:
        return None
    if args.tls_ca_cert is not None:
        return grpc.ssl_channel_credentials(root_certificates=_read_ca_certificates(args.tls_ca_cert, "--tls-ca-cert"))
    system_ca_file = ssl.get_default_verify_paths().cafile  # None where the system has none
    if system_ca_file is None:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(root_certificates=_read_ca_certificates(system_ca_file, "--tls"))


def _read_ca_certificates(path: str, flag: str) -> bytes:
    """The PEM bytes of `path`, checked here (gRPC would only fail at the handshake)."""
    try:
        with open(path, "rb") as ca_file:
            pem = ca_file.read()
    except OSError as error:
        raise TargetError(f"{flag}: cannot read {path}: {error.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # holds no certificate until it loads these
    try:
        context.load_verify_locations(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ValueError, ssl.SSLError):
        pass
    certificates = context.cert_store_stats()["x509"]
    if not certificates:
        raise TargetError(f"{flag}: {path} holds no PEM certificate")
    return pem


def target_connection(args: argparse.Namespace, parser: argparse.ArgumentParser
                      ) -> tuple[tuple[tuple[str, str], ...], Optional[grpc.ChannelCredentials]]:
    """(call metadata, channel credentials) for --target; an unusable flag exits 2 naming it."""
    try:
        return call_metadata(args), channel_credentials(args)
    except (CredentialsError, TargetError) as error:
        parser.error(str(error))


def open_channel(target: str, credentials: Optional[grpc.ChannelCredentials], *,
                 aio: bool = False) -> Union[grpc.Channel, grpc.aio.Channel]:
    """A channel to `target`: TLS with `credentials`, plaintext without."""
    channels = grpc.aio if aio else grpc
    return channels.insecure_channel(target) if credentials is None else channels.secure_channel(target, credentials)


# Newlines and tabs lay text out; every other control character (ESC, backspace, carriage
# return, C1 controls) can move the cursor, rewrite earlier output or retitle the terminal.
KEPT_CONTROL_CHARACTERS = frozenset("\n\t")


def terminal_safe(text: str) -> str:
    """`text` with control characters other than newline and tab written as escapes (\\x1b)."""
    return "".join(
        char if char in KEPT_CONTROL_CHARACTERS or unicodedata.category(char) != "Cc" else f"\\x{ord(char):02x}"
        for char in text
    )


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The metadata of every call to --target: the application (Serve's gRPC proxy picks it
    from this key) and the API key (--api-key, else $HEADROOM_API_KEY)."""
    application = (("application", args.application),) if args.application else ()
    return application + authorization_metadata(client_api_key(args.api_key))


def _read_text(path: str, flag: str, parser: argparse.ArgumentParser) -> str:
    """The UTF-8 text of the file a flag names; one that cannot be read exits 2 naming the flag."""
    try:
        with open(path, encoding="utf-8") as text_file:
            return text_file.read()
    except OSError as error:
        parser.error(f"{flag}: cannot read {path}: {error.strerror}")
    except UnicodeDecodeError as error:
        parser.error(f"{flag}: {path} is not UTF-8 text (byte {error.start})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=args.stop or ())
    for field in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(args, field) is not None:
            setattr(sampling, field, getattr(args, field))
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    metadata, credentials = target_connection(args, parser)
    request = pb.GenerateRequest(sampling=sampling)
    if args.json_schema is not None:
        request.json_schema = _read_text(args.json_schema, "--json-schema", parser)
    elif args.json_object:
        request.json_object = True
    elif args.regex is not None:
        request.regex = args.regex
    elif args.grammar is not None:
        request.grammar = _read_text(args.grammar, "--grammar", parser)
    elif args.choice is not None:
        request.choice.choices.extend(args.choice)
    if args.chat:
        if args.system is not None:
            request.chat.messages.add(role="system", content=args.system)
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    with open_channel(args.target, credentials) as channel:
        try:
            for response in pb_grpc.GenerationStub(channel).Generate(
                request, timeout=args.timeout_s, metadata=metadata
            ):
                sys.stdout.write(response.text if args.raw else terminal_safe(response.text))
                sys.stdout.flush()
        except grpc.RpcError as error:
            print(f"\nheadroom generate: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
