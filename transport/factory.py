"""Open the right transport for this host: RDMA where a device exists, TCP otherwise."""

from __future__ import annotations

import logging
import os
from typing import Literal

from kvbeam.errors import TransportError
from kvbeam.loop import DaemonLoop
from kvbeam.transport.base import Transport
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs.pyverbs_import import import_pyverbs

log = logging.getLogger(__name__)

Kind = Literal["auto", "rdma", "tcp"]


def rdma_devices() -> list[str]:
    """Names of the RDMA devices pyverbs lists; empty where pyverbs or devices are absent."""
    try:
        import_pyverbs()
        import pyverbs.device as d
    except ImportError:
        return []
    try:
        return [dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
                for dev in d.get_device_list()]
    except Exception as exc:  # pyverbs raises its own error types when no provider loads
        log.debug("listing RDMA devices failed: %s", exc)
        return []


def pick_rdma_device(device: str | None = None) -> str | None:
    """The device given, else $KVBEAM_RDMA_DEVICE, else the first device listed, else None."""
    return device or os.environ.get("KVBEAM_RDMA_DEVICE") or next(iter(rdma_devices()), None)


def open_transport(kind: Kind = "auto", device: str | None = None, gid_index: int | None = None,
                   *, options: TransportOptions | None = None,
                   tcp_host: str | None = None, loop: DaemonLoop | None = None) -> Transport:
    """Open a transport.

    ``rdma``: the verbs transport on ``device`` (see :func:`pick_rdma_device`) and
    ``gid_index`` (else $KVBEAM_RDMA_GID_INDEX, else 0); raises TransportError if
    no device exists. ``tcp``: the TCP transport listening on ``tcp_host`` (else
    $KVBEAM_TCP_HOST, else 127.0.0.1). ``auto``: RDMA when a device exists, else TCP
    with a WARNING saying so. ``loop``: the daemon's loop, not started yet, which then
    serves the transport too (TCP's sockets; RDMA's posts, polls and completion events).
    """
    if kind not in ("auto", "rdma", "tcp"):
        raise ValueError(f"transport kind must be auto, rdma or tcp, got {kind!r}")
    if kind != "tcp":
        name = pick_rdma_device(device)
        if name is not None:
            from kvbeam.transport.verbs import VerbsTransport  # needs pyverbs: import late

            if gid_index is None:
                gid_index = int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0"))
            return VerbsTransport(name, gid_index, options, loop=loop)
        if kind == "rdma":
            raise TransportError("no RDMA device found (pyverbs lists none and "
                                 "KVBEAM_RDMA_DEVICE is unset)")
        log.warning("no RDMA device found: falling back to the TCP transport")
    from kvbeam.transport.tcp import TcpTransport

    return TcpTransport(tcp_host, options=options, loop=loop)
