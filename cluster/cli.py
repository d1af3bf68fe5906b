"""The `headroom` command: one argparse subcommand per module, each registering its own flags
and a `run(args, parser) -> exit status`, so this file stays a table of contents.

Only the chosen command's module is imported: `headroom replica` never pays for Ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Optional, Sequence

# name -> (module with add_arguments(parser) and run(args, parser), one-line help)
SUBCOMMANDS = {
    "serve": ("cluster.serve_command", "run the cluster on a local Ray (SmolLM2-135M-Instruct by default) until Ctrl-C"),
    "generate": ("cluster.generate_command", "stream one prompt's generation from a running cluster over gRPC"),
    "status": ("cluster.status_command", "show every replica of a running cluster with its live load"),
    "bench": ("cluster.bench_command", "drive load against a running cluster and summarize latency and preemptions"),
    "replica": ("cluster.replica_command", "serve one engine over gRPC without Ray"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming it: argparse would print the usage first,
    which for a command with a flag per engine knob runs to ~40 lines above the error."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every flag)\n")


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser, with flags for `command` only (every command's when None)."""
    parser = OneLineErrorParser(prog="headroom", description="LLM serving that routes on KV headroom.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(subparser)
            subparser.set_defaults(run=module.run, subparser=subparser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
        status = args.run(args, args.subparser)
        sys.stdout.flush()  # a reader that went away fails here, not in the interpreter's last flush
        return status
    except KeyboardInterrupt:  # Ctrl-C (generate mid-stream, bench, a start): the shell's ^C says it all
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader of stdout went away (`headroom generate ... | head -c5`): stop quietly, as a
        # Unix tool that SIGPIPE ends does. Python flushes stdout again at exit: to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
