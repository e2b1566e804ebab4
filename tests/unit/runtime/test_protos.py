"""The committed generated code must be exactly what `make protos` produces now."""
from pathlib import Path

from tokenserve import protogen


def test_committed_generated_code_matches_fresh_generation(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    stale = []
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = protogen.ROOT / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    committed_all = {p.relative_to(protogen.ROOT) for p in (protogen.ROOT / "tokenserve").rglob("*_pb2*.py*")}
    extra = committed_all - {p.relative_to(tmp_path) for p in fresh}
    assert not stale, f"generated code differs from protos/ (run `make protos`): {stale}"
    assert not extra, f"generated files without a .proto (delete them): {sorted(map(str, extra))}"


def test_every_service_and_enum_follows_buf_conventions():
    from tokenserve.common.v1 import common_pb2
    from tokenserve.engine.v1 import engine_pb2
    from tokenserve.gateway.v1 import gateway_pb2
    from tokenserve.meter.v1 import meter_pb2
    from tokenserve.tokenizer.v1 import tokenizer_pb2

    for mod in (common_pb2, engine_pb2, gateway_pb2, meter_pb2, tokenizer_pb2):
        fd = mod.DESCRIPTOR
        area = Path(fd.name).parts[1]
        assert fd.package == f"tokenserve.{area}.v1"
        for svc in fd.services_by_name.values():
            assert svc.name.endswith("Service"), svc.full_name
        enums = list(fd.enum_types_by_name.values())
        for msg in fd.message_types_by_name.values():
            enums.extend(msg.enum_types)
        for enum in enums:
            assert enum.values[0].number == 0
            assert enum.values[0].name.endswith("_UNSPECIFIED"), enum.full_name
