"""The committed generated modules must match proto/meshd.proto."""

from pathlib import Path

import pytest

from meshd.wire import gen

pytestmark = pytest.mark.unit


def test_generated_code_is_current(tmp_path: Path) -> None:
    gen.generate(tmp_path)
    for name in gen.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (gen.WIRE_DIR / name).read_text()
        assert fresh == committed, (
            f"daemon/wire/{name} is stale against proto/meshd.proto: run `python -m meshd.wire.gen`"
        )


def test_services_are_complete() -> None:
    from meshd.wire import pb

    peer = pb.DESCRIPTOR.services_by_name["Peer"]
    local = pb.DESCRIPTOR.services_by_name["Local"]
    assert {"Hello", "Heartbeat", "GetState", "Ping", "ProbeBandwidth"} <= set(peer.methods_by_name)
    assert {"Status", "WatchStatus", "GetToken", "Remeasure"} <= set(local.methods_by_name)
