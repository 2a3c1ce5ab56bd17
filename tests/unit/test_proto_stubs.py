"""The committed stubs are exactly what the pinned grpcio-tools generates from proto/."""

from __future__ import annotations

from pathlib import Path

from services.common.rpc import generate


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts}


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path):
    generate.generate(tmp_path)
    committed = {name: text for name, text in _tree(generate.STUB_ROOT).items()
                 if name.startswith(tuple(f"{root}/" for root in generate.OUR_ROOTS))}
    fresh = _tree(tmp_path)
    assert sorted(committed) == sorted(fresh), "stale or missing stubs: run python -m services.common.rpc.generate"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale: run python -m services.common.rpc.generate"


def test_every_proto_file_is_generated_and_imports_from_our_package():
    protos = generate.proto_files()
    assert {p.name for p in protos} >= {"common.proto", "worker.proto", "engine.proto"}
    for proto in protos:
        stem = generate.STUB_ROOT / proto.relative_to(generate.PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            text = stem.with_name(stem.name + suffix).read_text()
            assert "\nfrom kvmesh" not in text and "\nimport kvmesh" not in text
