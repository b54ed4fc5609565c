"""One end of an RDMA WRITE WITH IMM, driven over stdin/stdout by test_softroce_smoke.py.

Run as a separate process (``python verbs_peer.py send|recv --size N ...``) so that the two ends
really are two processes with their own verbs contexts, as kvbeam's prefill and decode are.
Deliberately pyverbs only (no torch, no kvbeam): under qemu TCG `import torch` alone takes ~55 s.

Protocol, one JSON object per line:
  peer -> driver  {"qpn", "psn", "gid", "mtu", "addr", "rkey"}    after the QP is created
  driver -> peer  the other end's object                           peer connects its QP (to RTS)
  recv:  peer -> driver {"ready": true} once its receive WR is posted,
         then {"status", "opcode", "imm", "byte_len", "mismatch"} after the completion.
  send:  driver -> peer {"go": true}; peer -> driver {"status", "opcode"} after the completion.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import random
import socket
import sys
import time
from typing import Any

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

PORT = 1
GUARD = 0xEE  # fill byte of the receive buffer around the written range
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE


def pattern(size: int) -> bytes:
    """Bytes with period 251 (prime): a misplaced page or packet cannot still match."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def send_msg(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def recv_msg() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("verbs_peer: driver closed stdin")
    msg: dict[str, Any] = json.loads(line)
    return msg


class Endpoint:
    """Device context, one MR over an mmap'd buffer, one RC QP and its CQ."""

    def __init__(self, device: str, gid_index: int, buf: mmap.mmap) -> None:
        self.ctx = Context(name=device)
        self.gid_index = gid_index
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 16)
        self.buf = buf
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.mr = MR(self.pd, len(buf), ACCESS, address=self.addr)
        cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = random.getrandbits(24)

    def info(self) -> dict[str, Any]:
        return {
            "qpn": int(self.qp.qp_num),
            "psn": self.psn,
            "gid": str(self.ctx.query_gid(PORT, self.gid_index)),
            "mtu": int(self.ctx.query_port(PORT).active_mtu),
            "addr": self.addr,
            "rkey": int(self.mr.rkey),
        }

    def connect(self, peer: dict[str, Any]) -> None:
        """RESET -> INIT -> RTR -> RTS towards the peer's QP."""
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=PORT)
        attr.qp_access_flags = ACCESS
        attr.path_mtu = min(int(self.ctx.query_port(PORT).active_mtu), peer["mtu"])
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        # ACK timeout 4.096 us * 2**16 = 0.27 s, 7 retries: room for TCG's stalls; wait()'s own
        # deadline bounds the rest (rxe may never complete a WR on a dead path).
        attr.timeout = 16
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr)
        self.qp.to_rts(attr)

    def wait(self, timeout_s: float) -> Any:
        """The next work completion (a pyverbs WC); polls gently so the peer and rxe get CPU."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n, wcs = self.cq.poll(1)
            if n:
                return wcs[0]
            time.sleep(0.001)
        raise SystemExit(f"verbs_peer: no completion within {timeout_s} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["send", "recv"])
    ap.add_argument("--device", required=True)
    ap.add_argument("--gid-index", type=int, default=0)
    ap.add_argument("--size", type=int, required=True, help="bytes written")
    ap.add_argument("--offset", type=int, default=0, help="where in the receive buffer")
    ap.add_argument("--imm", type=int, default=0, help="immediate value (host order)")
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()

    if args.role == "send":
        buf = mmap.mmap(-1, args.size)
        buf[:] = pattern(args.size)
    else:
        # Guard bytes on both sides of the target range catch writes to the wrong address.
        buf = mmap.mmap(-1, args.offset + args.size + 4096)
        buf[:] = bytes([GUARD]) * len(buf)
    ep = Endpoint(args.device, args.gid_index, buf)
    send_msg(ep.info())
    peer = recv_msg()
    ep.connect(peer)

    if args.role == "recv":
        # WRITE WITH IMM consumes a receive WR; pyverbs refuses num_sge=0, so give it 1 byte.
        ep.qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(ep.addr, 1, ep.mr.lkey)]))
        send_msg({"ready": True})
        wc = ep.wait(args.timeout)
        end = args.offset + args.size
        expected = bytes([GUARD]) * args.offset + pattern(args.size)
        expected += bytes([GUARD]) * (len(buf) - end)
        got = buf[:]
        mismatch = None
        if got != expected:
            mismatch = next(i for i in range(len(got)) if got[i] != expected[i])
        send_msg(
            {
                "status": int(wc.status),
                "opcode": int(wc.opcode),
                "imm": socket.ntohl(wc.imm_data),  # immediate data arrives in network order
                "byte_len": int(wc.byte_len),
                "mismatch": mismatch,
            }
        )
    else:
        recv_msg()  # "go": the receiver has posted its receive WR
        wr = SendWR(
            wr_id=2,
            opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=1,
            sg=[SGE(ep.addr, args.size, ep.mr.lkey)],
            send_flags=e.IBV_SEND_SIGNALED,
            imm_data=socket.htonl(args.imm),
        )
        wr.set_wr_rdma(peer["rkey"], peer["addr"] + args.offset)
        ep.qp.post_send(wr)
        wc = ep.wait(args.timeout)
        send_msg({"status": int(wc.status), "opcode": int(wc.opcode)})
    ep.ctx.close()


if __name__ == "__main__":
    main()
