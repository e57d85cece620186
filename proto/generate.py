"""Regenerate the Python stubs of the pdserve gRPC API from the .proto files.

Usage: ``python proto/generate.py [OUT_ROOT]`` (default OUT_ROOT: the repository root), which writes
``OUT_ROOT/pdserve/v1/inference_pb2.py``, ``inference_pb2.pyi`` and ``inference_pb2_grpc.py``.

protoc is run with ``-I proto`` and a proto path relative to it, so the output holds no absolute path
and no timestamp: the same grpcio-tools version always writes the same bytes (checked by
``tests/unit/test_proto_stubs.py``).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTOS = ("pdserve/v1/inference.proto",)


def outputs(proto: str, out_root: Path) -> list[Path]:
    """The files protoc writes for ``proto`` (a path relative to ``proto/``) under ``out_root``."""
    stem = out_root / proto.removesuffix(".proto")
    return [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto in ``PROTOS`` into ``out_root``; return the files written."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency, imported lazily

    out_root.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    out = str(out_root)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit status {rc}: {' '.join(args)}")
    written = [path for proto in PROTOS for path in outputs(proto, out_root)]
    missing = [str(path) for path in written if not path.is_file()]
    if missing:
        raise RuntimeError(f"protoc did not write {', '.join(missing)}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the pdserve gRPC stubs from proto/.")
    parser.add_argument(
        "out_root",
        nargs="?",
        type=Path,
        default=REPO_ROOT,
        help="output root; stubs land in OUT_ROOT/pdserve/v1/ (default: the repository root)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
