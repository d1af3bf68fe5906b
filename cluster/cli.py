"""The `headroom` command: one argparse subcommand per module, each registering its own flags
and a `run(args, parser) -> exit status`, so this file stays a table of contents.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from cluster import bench_command, generate_command, replica_command, serve_command, status_command

# name -> (module with add_arguments(parser) and run(args, parser), one-line help)
SUBCOMMANDS = {
    "serve": (serve_command, "run the cluster on a local Ray (the built-in model by default) until Ctrl-C"),
    "generate": (generate_command, "stream one prompt's generation from a running cluster over gRPC"),
    "status": (status_command, "show every replica of a running cluster with its live load"),
    "bench": (bench_command, "drive load against a running cluster and summarize latency and preemptions"),
    "replica": (replica_command, "serve one engine over gRPC without Ray"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headroom", description="LLM serving that routes on KV headroom.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run, subparser=subparser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
