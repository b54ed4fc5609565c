"""The verbs resources of one link: completion channel, CQ and RC queue pair."""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any

from kvbeam.errors import TransportError
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs.device import PORT, VerbsDevice

log = logging.getLogger(__name__)

RECV_TAG = 1 << 63  # wr_id bit that marks receive WRs; send WRs count up from 0

_fd_lock = threading.Lock()


def _event_fds() -> set[int]:
    """This process's open ``[infinibandevent]`` descriptors."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                found.add(int(name))
        except OSError:  # closed meanwhile, e.g. the descriptor listdir itself used
            continue
    return found


def _open_channel(ctx: Any) -> tuple[Any, int | None]:
    """A completion channel and its file descriptor.

    pyverbs 44 does not expose ``CompChannel.fd``: the fd is the one
    ``[infinibandevent]`` descriptor that appears while the channel is created
    (the lock keeps our own threads from creating another at the same time). None
    if it cannot be told apart; the caller then polls with back-off instead.
    """
    from pyverbs.cq import CompChannel

    with _fd_lock:
        before = _event_fds()
        channel = CompChannel(ctx)
        new = _event_fds() - before
    if len(new) != 1:
        log.warning("cannot find the completion channel's fd (%s): polling with back-off",
                    sorted(new))
        return channel, None
    fd = new.pop()
    # Non-blocking, so that ibv_get_cq_event can never block the loop.
    os.set_blocking(fd, False)
    return channel, fd


class QueuePair:
    """One RC QP with its own CQ and completion channel; receive WRs stay posted."""

    def __init__(self, dev: VerbsDevice, opts: TransportOptions) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR

        self.sq_depth = min(opts.sq_depth, dev.max_qp_wr)
        self.recv_depth = min(opts.recv_depth, dev.max_qp_wr)
        self.psn = random.getrandbits(24)
        self._dev = dev
        self._opts = opts
        self.channel, self.event_fd = _open_channel(dev.ctx)
        try:
            # Signalled sends outstanding never exceed the SQ depth (we never overflow
            # it), receives never exceed recv_depth; flushes stay within the same bound.
            cqe = min(self.sq_depth + self.recv_depth + 16, dev.max_cqe)
            self.cq = CQ(dev.ctx, cqe, None, self.channel, 0)
            cap = QPCap(max_send_wr=self.sq_depth, max_recv_wr=self.recv_depth,
                        max_send_sge=1, max_recv_sge=1)
            self.qp = QP(dev.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                            cap=cap, sq_sig_all=0))
        except Exception as exc:
            self.close()
            raise TransportError(f"cannot create a queue pair on {dev.name}: {exc}") from exc
        self.qpn = int(self.qp.qp_num)
        self._recvs = []
        for i in range(self.recv_depth):
            # WRITE WITH IMM consumes a receive WR but writes nothing through it: no SGE.
            # pyverbs refuses num_sge=0 at construction, so it is set afterwards.
            wr = RecvWR(wr_id=RECV_TAG | i, num_sge=1, sg=[SGE(0, 0, 0)])
            wr.num_sge = 0
            self._recvs.append(wr)

    def to_rts(self, peer_gid: str, peer_qpn: int, peer_psn: int, mtu: int) -> None:
        """RESET -> INIT -> RTR -> RTS towards the peer's QP, then post all receive WRs."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        o = self._opts
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=PORT)
        # Peers may write into our MRs that allow it; nobody may read (no REMOTE_READ).
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = mtu
        attr.dest_qp_num = peer_qpn
        attr.rq_psn = peer_psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = o.min_rnr_timer
        attr.timeout = o.qp_timeout
        attr.retry_cnt = o.retry_cnt
        attr.rnr_retry = o.rnr_retry
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1,
                              gr=GlobalRoute(dgid=GID(peer_gid), sgid_index=self._dev.gid_index))
        try:
            self.qp.to_rts(attr)
            for wr in self._recvs:
                self.qp.post_recv(wr)
        except Exception as exc:
            raise TransportError(f"cannot connect QP {self.qpn} to {peer_gid} QP {peer_qpn}: "
                                 f"{exc}") from exc

    def repost_recv(self, wr_id: int) -> None:
        """Give a consumed receive WR back to the QP."""
        self.qp.post_recv(self._recvs[wr_id & ~RECV_TAG])

    def poll(self, n: int) -> list[Any]:
        """Up to ``n`` work completions, without waiting."""
        _, wcs = self.cq.poll(n)
        return list(wcs)

    def arm(self) -> None:
        """Ask for one completion event on the channel fd at the next completion."""
        self.cq.req_notify()

    def take_event(self) -> None:
        """Consume and acknowledge the event that made the channel fd readable."""
        self.channel.get_cq_event(self.cq)
        self.cq.ack_events(1)

    def state(self) -> int:
        """The QP's current state (``enum ibv_qp_state``)."""
        import pyverbs.enums as e

        attr, _ = self.qp.query(e.IBV_QP_STATE)
        return int(attr.qp_state)

    def close(self) -> None:
        """Destroy QP, CQ and channel, in that order."""
        for name in ("qp", "cq", "channel"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("closing %s of QP failed", name)
                setattr(self, name, None)
