"""A request sent layer by layer over RDMA (soft-RoCE): two ``--pools engine`` daemons on
the verbs transport and a tests/channel_engine.py process attached to each; the prefill
engine's pieces are ready in the model's first two layers (only those layers' KV lands
on decode), then in every layer, then the final chunk (Success, every digest equal);
then the same verified in sub-batches as the layers land, over two QPs. The host
test's steps (tests/host/test_engine_channel.py), over RDMA WRITEs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attach_helpers import write_config
from tests.daemon_helpers import SLOW_GUEST
from tests.fixtures import side
from tests.host.test_engine_channel import (
    LAYERED,
    SUB_BATCHES,
    attached_pair,
    move_layer_by_layer,
    move_marked_layers,
)
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma


def test_a_request_sent_layer_by_layer_over_rdma(rdma_device: RdmaDevice,
                                                 tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    with attached_pair(tmp_path, cfg, [*SLOW_GUEST, "--send-wait-s", "30"],
                       transport="rdma") as (prefill, decode, pe, de):
        move_layer_by_layer(prefill, decode, pe, de, "layered-rdma", wait_s=120)


def test_a_layered_request_is_verified_in_sub_batches_over_two_qps(rdma_device: RdmaDevice,
                                                                   tmp_path: Path) -> None:
    """Integrity per piece over two QPs: a sub-batch's bytes go under its mark's id in
    each chunk that writes them (on either lane), and its WRITE WITH IMMEDIATE, posted
    with the piece that makes it whole, comes after all of them; decode digests layers
    0-1 before the final chunk came, and the request is Success with every digest
    equal."""
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", LAYERED)
    with attached_pair(tmp_path, cfg, [*SLOW_GUEST, "--send-wait-s", "30", *SUB_BATCHES,
                                       "--qps-per-peer", "2"], transport="rdma") as four:
        move_marked_layers(*four, "marked-rdma", wait_s=120)
