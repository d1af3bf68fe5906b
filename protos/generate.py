"""Regenerates the Python code for protos/headroom.proto: `python -m protos.generate`.

Runs protoc from the repository root with `-I.`, so the generated gRPC module imports
`from protos import headroom_pb2` and works as part of the `protos` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "protos/headroom.proto"
GENERATED_FILES = ("protos/headroom_pb2.py", "protos/headroom_pb2.pyi", "protos/headroom_pb2_grpc.py")


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Writes the generated files under out_dir (mirroring protos/) and returns their paths."""
    # Imported here so that importing protos.generate (e.g. for GENERATED_FILES) does not
    # need grpcio-tools, a development-only dependency.
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(REPO_ROOT / PROTO_FILE),
    ]
    exit_code = protoc.main(args)
    if exit_code != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE} with exit code {exit_code}")
    return [out_dir / name for name in GENERATED_FILES]


def main() -> int:
    for path in generate():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
