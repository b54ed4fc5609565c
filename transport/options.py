"""Tuning knobs of the transports, with defaults that suit both a real NIC and soft-RoCE."""

from __future__ import annotations

from dataclasses import dataclass

MAX_QPS_PER_PEER = 16  # each QP holds its own send and receive queues and a CQ
MAX_CHAIN = 1 << 16  # WRs one post may hand over (transport/verbs/_post.c's MAX_CHAIN)
POSTER_KINDS = ("auto", "compiled", "pyverbs")  # TransportOptions.poster


@dataclass(frozen=True)
class TransportOptions:
    """Settings for :func:`kvbeam.transport.open_transport`. TCP uses the first two only."""

    # Blocks longer than this are written as several WRs (frames for TCP).
    slice_bytes: int = 1 << 20
    # Our own deadline: a link with work outstanding that completes nothing for
    # this long fails its transfers with status TIMEOUT. The NIC's retry timer
    # should fire first (qp_timeout/retry_cnt below), but RECIPE.md measured no
    # completion at all for 118 s after a link went down, so we never rely on it.
    op_timeout_s: float = 10.0
    # Send-queue depth per QP; posting never exceeds it.
    sq_depth: int = 512
    # Signal one WR in this many (and always a transfer's last WR).
    signal_every: int = 64
    # Most WRs handed to one post_send call.
    max_chain: int = 256
    # Receive WRs kept posted per QP: one is consumed per notification.
    recv_depth: int = 256
    # RC transport retries: an unacknowledged packet is resent after the local ACK
    # timeout, 4.096 us * 2**qp_timeout (17: 0.54 s; the spec lets a NIC wait up to 4x),
    # at most retry_cnt times (0-7), then the QP fails with IBV_WC_RETRY_EXC_ERR.
    # Measured in the soft-RoCE guest with the whole-request soak (120 s, 8 in flight,
    # an idle host): 14/7 (67 ms) failed 4 of 314 requests with IBV_WC_REM_INV_REQ_ERR,
    # rxe's responder tripping over a spurious resend when an ACK is late under TCG;
    # 17/7 failed 0 of 328 and every fault test kept its bound (a silent partition then
    # ends with our own TIMEOUT at op_timeout_s rather than the NIC's RETRY_EXC_ERR).
    # 14/3 failed a QP with RETRY_EXC_ERR in a fresh-clone soak.
    qp_timeout: int = 17
    retry_cnt: int = 7
    # 7 = retry forever on RNR NAK: a receiver briefly short of receive WRs must
    # not fail a transfer; op_timeout_s bounds the wait instead.
    rnr_retry: int = 7
    min_rnr_timer: int = 12
    # RDMA: each link registers its own remote-write MRs over the REMOTE_WRITE regions
    # (per-peer rkeys, revoked with the link). False: one shared remote-write MR per
    # region for every link (handshakes skip a registration of the whole pool).
    per_link_keys: bool = True
    # RDMA: RC queue pairs per link. A request's writes are striped over them by bytes
    # (see kvbeam.transport.verbs.lanes); both sides of a link must use the same count.
    qps_per_peer: int = 1
    # A request is striped over one more QP per this many bytes (smaller ones use one QP,
    # keeping their marker in their own chain: no wait for another QP's completion).
    stripe_min_bytes: int = 256 << 10
    # RDMA: how WR chains are posted (kvbeam.transport.verbs.chain): "auto" takes the
    # compiled helper (transport/verbs/_post.c) where it was built and loads, else pyverbs
    # objects; "compiled" refuses to start without it; "pyverbs" never uses it.
    poster: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.slice_bytes < 1 << 31:
            raise ValueError(f"slice_bytes must be in (0, 2**31), got {self.slice_bytes}")
        if self.op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be positive, got {self.op_timeout_s}")
        if not 0 < self.signal_every <= self.sq_depth:
            # With a longer unsignalled run the SQ could fill with WRs that never
            # produce a completion, and posting would wait forever.
            raise ValueError(f"signal_every must be in (0, sq_depth={self.sq_depth}], "
                             f"got {self.signal_every}")
        if not 0 < self.max_chain <= MAX_CHAIN:  # the compiled poster's bound per call
            raise ValueError(f"max_chain must be in (0, {MAX_CHAIN}], got {self.max_chain}")
        if self.poster not in POSTER_KINDS:
            raise ValueError(f"poster must be one of {', '.join(POSTER_KINDS)}, "
                             f"got {self.poster!r}")
        if self.recv_depth < 1:
            raise ValueError(f"recv_depth must be positive, got {self.recv_depth}")
        if not 1 <= self.qps_per_peer <= MAX_QPS_PER_PEER:
            raise ValueError(f"qps_per_peer must be in [1, {MAX_QPS_PER_PEER}], "
                             f"got {self.qps_per_peer}")
        if self.stripe_min_bytes <= 0:
            raise ValueError(f"stripe_min_bytes must be positive, got {self.stripe_min_bytes}")
        if not 0 <= self.qp_timeout <= 31:  # a 5-bit field of the QP attributes
            raise ValueError(f"qp_timeout must be in [0, 31], got {self.qp_timeout}")
        if not 0 <= self.retry_cnt <= 7:  # a 3-bit field
            raise ValueError(f"retry_cnt must be in [0, 7], got {self.retry_cnt}")
