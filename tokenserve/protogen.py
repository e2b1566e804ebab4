"""Generates the committed Python code under tokenserve/ from protos/ (`make protos`).

The generated files are never edited by hand; tests/unit/test_protos.py fails when the
committed files differ from a fresh generation.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) over every proto into out_dir; returns files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    written = sorted((out_dir / "tokenserve").rglob("*_pb2*.py*"))
    # every generated folder must be an importable package
    for folder in {p.parent for p in written}:
        d = folder
        while d != out_dir:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
            d = d.parent
    return written


def main() -> int:
    written = generate(ROOT)
    for p in written:
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
