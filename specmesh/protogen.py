"""Generates the Python gRPC stubs in ``specmesh/v1`` from ``proto/specmesh/v1``.

The stubs are committed; ``make proto`` regenerates them and a test fails when
they differ from what the ``.proto`` files produce.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "specmesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) into ``out_dir``; returns the files written."""
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
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    gen_dir = out_dir / "specmesh" / "v1"
    (gen_dir / "__init__.py").write_text('"""Generated gRPC stubs of the specmesh.v1 protocol."""\n')
    return sorted(p for p in gen_dir.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> None:
    # argparse, not typer: the Docker build runs this before the project (and typer) is installed.
    import argparse

    argparse.ArgumentParser(prog="python specmesh/protogen.py",
                            description="Regenerate the gRPC stubs in specmesh/v1 from "
                                        "proto/specmesh/v1 (needs grpcio-tools).").parse_args(argv)
    written = generate(ROOT)
    sys.stdout.write("".join(f"wrote {p.relative_to(ROOT)}\n" for p in written))


if __name__ == "__main__":
    main()
