"""Decode-initiated pairing: a Send that names no decode, and decode's daemon reaching prefill's.

What a proxy written to vLLM's NIXL contract gives prefill is ``do_remote_decode`` and
nothing else: prefill's engine sends with no decode address, and the decode that
reserves the request names prefill's daemon. Two ``--pools engine`` daemons that never
exchanged a request, two engine processes (tests/channel_engine.py) driving their
requests over the engine channel: decode's daemon asks prefill's to connect (Connect),
prefill handshakes as usual, decode offers its reservation, the bytes move; in either
order. A pair that cannot connect fails decode's reservation at once with the cause, and
prefill's Send with it. docs/protocol.md, "Decode-initiated pairing".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvbeam.auth import Security
from kvbeam.procs import DaemonProcess
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.server.peers.client import ControlClient
from kvbeam.server.settings import ControlOptions
from tests.attach_helpers import start_engine_daemon, write_config
from tests.daemon_helpers import FAST
from tests.fixtures import side
from tests.host.test_engine_channel import ChannelEngine, attached_pair
from tests.vllm_served import free_port, metric

SEQ = 700
#: Prefill's Send waits this long for a decode's Offer (--send-wait-s).
SEND_WAIT_S = 5
#: Decode's reservations give up after this (--deadline-bootstrap-s): a failure that
#: reaches decode "at once" is not this deadline's ("Failed timeout: no progress in
#: Bootstrapping for 20.0 s").
BOOTSTRAP_S = 20
DEADLINES = [*FAST, "--send-wait-s", str(SEND_WAIT_S), "--deadline-bootstrap-s",
             str(BOOTSTRAP_S)]

Four = tuple[DaemonProcess, DaemonProcess, ChannelEngine, ChannelEngine]


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Four]:
    """(prefill daemon, decode daemon, prefill engine, decode engine): attached, never
    connected to each other."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    with attached_pair(tmp_path, cfg, DEADLINES, pushes="final") as four:
        yield four


def _metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    return metric(f"http://{daemon.metrics}/metrics", name, **labels)


def _connects(daemon: DaemonProcess, result: str) -> float:
    return _metric(daemon, "kvbeam_connects_total", result=result)


def test_a_send_naming_no_decode_moves_to_the_decode_that_reserves_it(engines: Four) -> None:
    """The first request finds the daemons unconnected: prefill's Send names no decode
    and parks, decode's reservation makes decode's daemon ask prefill's to connect, and
    the bytes land where decode's engine reserved them (its memory at its lists equals
    prefill's at prefill's lists). The second comes in the other order over the
    connection the first made."""
    prefill, decode, pe, de = engines
    assert pe.cmd(f"send any0 {SEQ} - 11") == "send any0"
    assert pe.cmd("poll any0") == "Bootstrapping"  # pushes: final; parked, waiting
    assert de.cmd(f"reserve any0 {SEQ} {prefill.address} 12") == "reserve any0"
    assert de.cmd("wait any0 60") == "Success"
    assert pe.cmd("wait any0 60") == "Success"
    assert de.cmd("digests any0") == pe.cmd("digests any0")
    de.cmd("release any0")
    assert de.cmd(f"reserve any1 {SEQ} {prefill.address} 13") == "reserve any1"
    assert pe.cmd(f"send any1 {SEQ} - 14") == "send any1"
    assert de.cmd("wait any1 60") == "Success"
    assert pe.cmd("wait any1 60") == "Success"
    assert de.cmd("digests any1") == pe.cmd("digests any1")
    # Decode asked once; prefill never dialled decode on its own (it had no address).
    assert _connects(decode, "ok") == 1 and _connects(prefill, "ok") == 1
    assert any("connected on this decode's ask: 1 reservation(s) offered" in line
               for line in decode.lines)
    assert any("request any0: decode " in line and "reserved it: sending there" in line
               for line in prefill.lines)


def test_a_send_naming_no_decode_that_nobody_reserves_ends_at_its_lease(engines: Four) -> None:
    """The negative control: no decode reserves it, nothing moves, and prefill's Send
    fails at its --send-wait-s lease saying so (a Failed on prefill's daemon's
    kvbeam_transfers_total)."""
    prefill, _decode, pe, _de = engines
    before = _metric(prefill, "kvbeam_transfers_total", state="Failed")
    pe.cmd(f"send lonely {SEQ} - 15")
    answer = pe.cmd("wait lonely 30")
    assert answer.startswith(f"Failed timeout: no progress in WaitingForInput for "
                             f"{SEND_WAIT_S:.1f} s (decode's reservation: the Send named no "
                             "decode and no decode daemon offered"), answer
    assert _metric(prefill, "kvbeam_transfers_total", state="Failed") == before + 1


def test_a_reservation_naming_a_prefill_daemon_that_is_down_fails_at_once(
        engines: Four) -> None:
    """Nothing listens at the prefill address a reservation names: decode's daemon
    cannot ask it to connect, and the reservation fails at once (peer_unreachable),
    not at its Bootstrapping deadline."""
    _prefill, decode, _pe, de = engines
    nowhere = f"127.0.0.1:{free_port()}"
    de.cmd(f"reserve down {SEQ} {nowhere} 16")
    answer = de.cmd("wait down 60")
    # The failed ask to connect ended it, naming the address: the deadline would say
    # "Failed timeout: no progress in Bootstrapping for 20.0 s".
    assert answer.startswith("Failed peer_unreachable: "), answer
    assert nowhere in answer, answer
    assert _connects(decode, "unreachable") == 1


def test_a_pair_that_is_refused_fails_both_sides_at_once_naming_the_difference(
        tmp_path: Path) -> None:
    """A decode whose pools differ from prefill's (another model): prefill's Send names
    no decode and waits; decode's reservation makes prefill handshake, the handshake is
    refused, and decode's reservation fails at once with the refusal's text (naming the
    field and both values); decode tells prefill, whose Send fails at once too."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    other = write_config(tmp_path / "other.yaml", side(model="dsv4-other"))
    with attached_pair(tmp_path, cfg, DEADLINES, pushes="final") as (prefill, _d, pe, _de):
        sock = str(tmp_path / "d2.sock")
        decode = start_engine_daemon("decode", sock, deadlines=DEADLINES)
        de = None
        try:
            de = ChannelEngine(sock, other, 2, "final")
            pe.cmd(f"send bad {SEQ} - 17")
            de.cmd(f"reserve bad {SEQ} {prefill.address} 18")
            answer = de.cmd("wait bad 60")
            sent = pe.cmd("wait bad 60")
        finally:
            if de is not None:
                de.stop()
            decode.stop()
    # The refusal ended the reservation at once, naming the difference: the deadline
    # would say "Failed timeout: no progress in Bootstrapping for 20.0 s".
    assert answer.startswith("Failed incompatible: "), answer
    assert "model" in answer and "dsv4-test" in answer and "dsv4-other" in answer, answer
    # Incompatible on prefill too: the refusal is about the pair, as prefill's own
    # handshake for the Send would have said; not at prefill's lease either ("Failed
    # timeout: no progress in WaitingForInput for 5.0 s").
    assert sent.startswith("Failed incompatible: decode's reservation failed: the pair "
                           "could not connect: "), sent


def test_a_connect_claiming_another_hosts_address_is_refused_and_dials_nothing(
        tmp_path: Path) -> None:
    """Connect makes prefill dial the address its caller claims, so the caller's
    credentials must cover it, as a handshake's claimed address must (under a shared
    token: the host it calls from): a caller with the token claiming another host's
    address is refused PERMISSION_DENIED, and prefill starts no handshake."""
    token = "connect-test-token"
    tmp_path.chmod(0o700)
    prefill = start_engine_daemon("prefill", str(tmp_path / "p.sock"), deadlines=DEADLINES,
                                  extra=["--auth-token", token])
    try:
        options = ControlOptions(rpc_timeout_s=5.0, security=Security(token=token))
        with ControlClient(prefill.address, options=options) as client, \
                pytest.raises(grpc.RpcError) as refused:
            client.stub.Connect(pb.ConnectRequest(control_address="10.20.30.40:5000",
                                                  instance_id="decode-x"), timeout=5)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "claims control address 10.20.30.40:5000" in (refused.value.details() or "")
        assert _connects(prefill, "failed") == 1
        assert _metric(prefill, "kvbeam_handshakes_total") == 0
    finally:
        prefill.stop()
