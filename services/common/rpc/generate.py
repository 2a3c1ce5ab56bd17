"""Regenerate the committed gRPC stubs from every `.proto` file under `proto/`.

    python -m services.common.rpc.generate            # into services/common/rpc/
    python -m services.common.rpc.generate --out DIR  # elsewhere (tests/unit/test_proto_stubs.py)

grpc_tools names a proto import after its path (`import "kvmesh/v1/common.proto"` becomes
`from kvmesh.v1 import common_pb2`); the stubs live inside our package, so those imports are
rewritten to `from services.common.rpc.kvmesh.v1 import common_pb2`. The output depends only on
the .proto files and the pinned grpcio-tools/protobuf versions, so the test can diff it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
STUB_ROOT = Path(__file__).resolve().parent
PACKAGE = "services.common.rpc"
# Top-level proto packages whose imports get the PACKAGE prefix (google.protobuf stays as it is).
OUR_ROOTS = ("kvmesh",)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py` (and package `__init__.py` files) under
    out_dir; returns the paths written."""
    files = proto_files(proto_root)
    if not files:
        raise FileNotFoundError(f"no .proto files under {proto_root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for root in OUR_ROOTS:  # stubs of a deleted .proto must not linger
        for stale in (out_dir / root).rglob("*_pb2*.py*"):
            stale.unlink()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *(str(f.relative_to(proto_root)) for f in files)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written: list[Path] = []
    for proto in files:
        stem = out_dir / proto.relative_to(proto_root).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.with_name(stem.name + suffix)
            path.write_text(_fix_imports(path.read_text()))
            written.append(path)
        for package_dir in stem.relative_to(out_dir).parents:
            if package_dir != Path("."):
                init = out_dir / package_dir / "__init__.py"
                if not init.exists():
                    init.write_text("")
                if init not in written:
                    written.append(init)
    return sorted(written)


_IMPORT = re.compile(rf"^(from|import) ({'|'.join(OUR_ROOTS)})(\.| )", re.MULTILINE)


def _fix_imports(source: str) -> str:
    return _IMPORT.sub(rf"\1 {PACKAGE}.\2\3", source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=STUB_ROOT, help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
