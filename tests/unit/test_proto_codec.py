"""The wire codecs: round trips, and every refusal of the strict decoder names its field."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbeam.errors import KvbeamError, ProtocolError, ProtocolVersionError
from kvbeam.pools.checks import compare_sides
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import DTYPE_SIZES, load_side_config
from kvbeam.proto.differences import differences_from_proto, differences_to_proto
from kvbeam.proto.endpoint_codec import endpoint_from_proto, endpoint_to_proto
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2_grpc as pb_grpc
from kvbeam.proto.layout_codec import DTYPE_TO_PROTO, layout_from_proto, layout_to_proto
from kvbeam.proto.side import Role, SideInfo, side_from_bytes, side_from_proto, side_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION, SERVICE_NAME
from kvbeam.transport.endpoint import Endpoint, RemoteRegion
from tests.control_helpers import config, draft_changed, rdma_endpoint, side, tcp_endpoint
from tests.fixtures import CONFIGS, REPO


def _msg(paged: bool = False, endpoint: Endpoint | None = None) -> pb.SideInfo:
    return side_to_proto(side(Role.PREFILL, config(paged), endpoint,
                              control_address="127.0.0.1:7000"))


# ---- generated code and version --------------------------------------------
def test_generated_code_imports_from_the_package() -> None:
    assert pb.DESCRIPTOR.package == "kvbeam.v1"
    assert pb_grpc.KvbeamControlStub.__module__ == "kvbeam.proto.kvbeam.v1.kvbeam_pb2_grpc"
    assert SERVICE_NAME == "kvbeam.v1.KvbeamControl"
    names = set(pb.DESCRIPTOR.services_by_name["KvbeamControl"].methods_by_name)
    assert names == {"Handshake", "Reserve", "Send", "Status", "WatchStatus", "Abort",
                     "Heartbeat", "Release", "Connect"}


def test_protocol_version_is_the_schema_constant() -> None:
    assert PROTOCOL_VERSION == pb.ProtocolVersion.PROTOCOL_VERSION_CURRENT == 10


def test_transfer_state_enum_is_the_single_state_machine() -> None:
    states = [v.name for v in pb.TransferState.DESCRIPTOR.values]
    assert states == ["TRANSFER_STATE_UNSPECIFIED", "TRANSFER_STATE_BOOTSTRAPPING",
                      "TRANSFER_STATE_WAITING_FOR_INPUT", "TRANSFER_STATE_TRANSFERRING",
                      "TRANSFER_STATE_SUCCESS", "TRANSFER_STATE_FAILED"]


def test_wire_enums_mirror_the_lifecycle() -> None:
    from kvbeam import states

    def names(enum_type: str, prefix: str) -> set[str]:
        values = pb.DESCRIPTOR.enum_types_by_name[enum_type].values
        return {v.name.removeprefix(prefix) for v in values} - {"UNSPECIFIED"}

    assert names("TransferState", "TRANSFER_STATE_") == {s.name for s in states.TransferState}
    assert names("FailureReason", "FAILURE_REASON_") == {r.name for r in states.FailureReason}


def test_every_dtype_has_a_wire_value() -> None:
    assert set(DTYPE_TO_PROTO) == set(DTYPE_SIZES)


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(["bash", str(REPO / "proto/generate.sh"), "--check"],
                            capture_output=True, text=True, env={"PYTHON": sys.executable,
                                                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr


# ---- round trips -------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")),
                         ids=lambda p: p.name)
def test_layout_round_trip_on_shipped_configs(path: Path) -> None:
    layout = build_side_layout(load_side_config(path))
    assert layout_from_proto(layout_to_proto(layout)) == layout


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("draft", [False, True])
def test_layout_round_trip(paged: bool, draft: bool) -> None:
    layout = build_side_layout(config(paged, draft=draft))
    wire = layout_to_proto(layout).SerializeToString()
    assert layout_from_proto(pb.PoolMetadata.FromString(wire)) == layout


@pytest.mark.parametrize("endpoint", [tcp_endpoint(), rdma_endpoint()], ids=["tcp", "rdma"])
def test_endpoint_round_trip(endpoint: Endpoint) -> None:
    assert endpoint_from_proto(endpoint_to_proto(endpoint)) == endpoint


def test_side_round_trip_through_bytes() -> None:
    local = side(Role.DECODE, config(), rdma_endpoint(), control_address="[::1]:7000")
    decoded = side_from_bytes(side_to_proto(local).SerializeToString())
    assert decoded == local
    assert decoded.protocol_version == PROTOCOL_VERSION


def test_within_side_mismatch_still_decodes() -> None:
    # The decoder is structural only: compatibility is compare_sides' job.
    layout = build_side_layout(draft_changed(config(), unified_kv=False))
    decoded = layout_from_proto(layout_to_proto(layout))
    assert [d.field for d in compare_sides(decoded, decoded)][:1] == ["unified_kv"]


def test_differences_round_trip() -> None:
    diffs = compare_sides(build_side_layout(config()), build_side_layout(config(True)))
    assert diffs
    assert differences_from_proto(differences_to_proto(diffs), "d") == diffs


# ---- refusals ------------------------------------------------------------------
Mutation = Callable[[pb.SideInfo], None]


def _set_tensor_zero(m: pb.SideInfo) -> None:
    m.metadata.tensors[m.metadata.components[0].buffers[0].tensor].nbytes = 0


REFUSALS: list[tuple[str, Mutation, str]] = [
    ("negative size", lambda m: setattr(m.metadata.components[0].buffers[0], "nbytes", -1),
     "side.metadata.components[0].buffers[0].nbytes"),
    ("negative offset", lambda m: setattr(m.metadata.components[1].buffers[0], "offset", -8),
     "side.metadata.components[1].buffers[0].offset"),
    ("item_len 0", lambda m: setattr(m.metadata.components[0].buffers[1], "item_len", 0),
     "side.metadata.components[0].buffers[1].item_len"),
    ("negative window", lambda m: setattr(m.metadata.target, "sliding_window", -128),
     "side.metadata.target.sliding_window"),
    ("zero page size", lambda m: setattr(m.metadata.target, "page_size", 0),
     "side.metadata.target.page_size"),
    ("page size out of range", lambda m: setattr(m.metadata.target, "page_size", 1 << 40),
     "side.metadata.target.page_size"),
    ("head dim out of range", lambda m: setattr(m.metadata.draft, "head_dim", 1 << 30),
     "side.metadata.draft.head_dim"),
    ("negative draft tokens", lambda m: setattr(m.metadata.target, "num_draft_tokens", -1),
     "side.metadata.target.num_draft_tokens"),
    ("bad ratio", lambda m: m.metadata.target.compression_ratios.append(8),
     "side.metadata.target.compression_ratios[4]"),
    ("no target layers", lambda m: m.metadata.target.ClearField("compression_ratios"),
     "side.metadata.target.compression_ratios"),
    ("unknown dtype", lambda m: setattr(m.metadata.target, "dtype", 99),
     "side.metadata.target.dtype"),
    ("unset dtype", lambda m: setattr(m.metadata.draft, "dtype", 0),
     "side.metadata.draft.dtype"),
    ("empty mapping", lambda m: setattr(m.metadata.target, "swa_index_mapping", ""),
     "side.metadata.target.swa_index_mapping"),
    ("missing target", lambda m: m.metadata.ClearField("target"), "side.metadata.target"),
    ("missing metadata", lambda m: m.ClearField("metadata"), "side.metadata"),
    ("missing endpoint", lambda m: m.ClearField("endpoint"), "side.endpoint"),
    ("empty model", lambda m: setattr(m.metadata, "model", ""), "side.metadata.model"),
    ("unknown index kind", lambda m: setattr(m.metadata.components[1].buffers[0],
                                             "index_kind", 42),
     "side.metadata.components[1].buffers[0].index_kind"),
    ("unknown component type", lambda m: setattr(m.metadata.components[2], "type", 17),
     "side.metadata.components[2].type"),
    ("unknown pool", lambda m: setattr(m.metadata.components[2], "pool", 5),
     "side.metadata.components[2].pool"),
    ("draft component without draft", lambda m: m.metadata.ClearField("draft"),
     "side.metadata.components[4].pool"),
    ("no components", lambda m: m.metadata.ClearField("components"),
     "side.metadata.components"),
    ("KV not first", lambda m: setattr(m.metadata.components[0], "type",
                                       pb.ComponentType.COMPONENT_TYPE_SWA),
     "side.metadata.components[0]"),
    ("second KV", lambda m: setattr(m.metadata.components[1], "type",
                                    pb.ComponentType.COMPONENT_TYPE_KV),
     "side.metadata.components[1].type"),
    ("tensor index out of range", lambda m: setattr(m.metadata.components[0].buffers[0],
                                                    "tensor", 10_000),
     "side.metadata.components[0].buffers[0].tensor"),
    ("buffer outside its tensor", _set_tensor_zero, "side.metadata.components[0].buffers[0]"),
    ("unknown role", lambda m: setattr(m, "role", 9), "side.role"),
    ("unset role", lambda m: setattr(m, "role", 0), "side.role"),
    ("empty instance id", lambda m: setattr(m, "instance_id", ""), "side.instance_id"),
    ("bad instance id", lambda m: setattr(m, "instance_id", "a b"), "side.instance_id"),
    ("bad control address", lambda m: setattr(m, "control_address", "nohost"),
     "side.control_address"),
    ("control port out of range", lambda m: setattr(m, "control_address", "h:70000"),
     "side.control_address"),
    ("missing protocol version", lambda m: setattr(m, "protocol_version", 0),
     "side.protocol_version"),
    ("unknown transport", lambda m: setattr(m.endpoint, "kind", 7), "side.endpoint.kind"),
    ("tcp without address", lambda m: setattr(m.endpoint, "address", ""),
     "side.endpoint.address"),
    ("zero-length region", lambda m: setattr(m.endpoint.regions[0], "length", 0),
     "side.endpoint.regions[0].length"),
    ("region wraps", lambda m: setattr(m.endpoint.regions[0], "addr", (1 << 64) - 16),
     "side.endpoint.regions[0]"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in REFUSALS],
                         ids=[name for name, _, _ in REFUSALS])
def test_decoder_refuses_and_names_the_field(mutate: Mutation, field: str) -> None:
    msg = _msg()
    mutate(msg)
    with pytest.raises(ProtocolError) as info:
        side_from_proto(msg)
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")
    assert isinstance(info.value, KvbeamError)


RDMA_REFUSALS: list[tuple[str, Mutation, str]] = [
    ("no gid", lambda m: setattr(m.endpoint, "gid", ""), "side.endpoint.gid"),
    ("bad gid", lambda m: setattr(m.endpoint, "gid", "not-a-gid"), "side.endpoint.gid"),
    ("no qpn", lambda m: m.endpoint.ClearField("qpns"), "side.endpoint.qpns"),
    ("qpn beyond 24 bits", lambda m: m.endpoint.qpns.append(1 << 24), "side.endpoint.qpns[2]"),
    ("qpn 0", lambda m: m.endpoint.qpns.append(0), "side.endpoint.qpns[2]"),
    ("psn beyond 24 bits", lambda m: setattr(m.endpoint, "psn", 1 << 24), "side.endpoint.psn"),
    ("bad mtu", lambda m: setattr(m.endpoint, "mtu", 1500), "side.endpoint.mtu"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in RDMA_REFUSALS],
                         ids=[name for name, _, _ in RDMA_REFUSALS])
def test_rdma_endpoint_refusals(mutate: Mutation, field: str) -> None:
    msg = _msg(endpoint=rdma_endpoint())
    mutate(msg)
    with pytest.raises(ProtocolError) as info:
        side_from_proto(msg)
    assert info.value.field == field


def test_hex_gid_is_accepted() -> None:
    msg = _msg(endpoint=rdma_endpoint())
    msg.endpoint.gid = "fe800000000000000202c9fffe000001"
    assert side_from_proto(msg).endpoint.gid == msg.endpoint.gid


def test_wrong_protocol_version_is_a_version_error() -> None:
    msg = _msg()
    msg.protocol_version = PROTOCOL_VERSION + 1
    # Checked before anything else: a v2 peer's other fields may mean other things.
    msg.ClearField("metadata")
    with pytest.raises(ProtocolVersionError) as info:
        side_from_proto(msg)
    assert (info.value.local, info.value.remote) == (PROTOCOL_VERSION, PROTOCOL_VERSION + 1)
    assert "protocol version mismatch" in str(info.value)
    assert info.value.field == "side.protocol_version"


def test_garbage_bytes_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError) as info:
        side_from_bytes(b"\x0a\xff\x01")
    assert info.value.field == "side"


def test_encoder_refuses_unknown_transport_kind() -> None:
    local = side(Role.PREFILL, config(), Endpoint("carrier-pigeon", address="a:1"))
    with pytest.raises(ProtocolError, match=r"endpoint\.kind"):
        side_to_proto(local)


def test_encoder_refuses_values_the_wire_cannot_carry() -> None:
    local = side(Role.PREFILL, config(), Endpoint("rdma", gid="fe80::1", qpns=(1 << 33,),
                                                  mtu=1024))
    with pytest.raises(ProtocolError):
        side_to_proto(local)


def test_encoder_validates_locally() -> None:
    # A value our own decoder would refuse fails on our side, before any peer sees it.
    local = SideInfo(Role.PREFILL, build_side_layout(config()),
                     Endpoint("rdma", regions=(RemoteRegion(1, 1),), gid="fe80::1", qpns=(5,),
                              mtu=1500))
    with pytest.raises(ProtocolError, match=r"endpoint\.mtu"):
        side_to_proto(local)
    assert side_to_proto(local, validate=False).endpoint.mtu == 1500
