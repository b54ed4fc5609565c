"""Proves the RDMA harness itself, without torch or kvbeam (fast even under qemu TCG).

1. Two processes, each with its own verbs context on the device, exchange QP info, one RDMA
   WRITEs WITH IMM a pattern into the other's buffer, which checks every byte, that nothing
   outside the target range changed, and the immediate value.
2. perftest's ib_write_bw runs against itself on the device and reports a bandwidth (the
   reference that timings measured in the same boot are compared with).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.control_helpers import free_port

pytestmark = pytest.mark.rdma

PEER = Path(__file__).with_name("verbs_peer.py")
IBV_WC_SUCCESS = 0  # pyverbs.enums values; the peers report plain ints
IBV_WC_RDMA_WRITE = 1
IBV_WC_RECV_RDMA_WITH_IMM = 129


def _send(proc: subprocess.Popen[str], msg: dict[str, Any]) -> None:
    stdin: IO[str] | None = proc.stdin
    assert stdin is not None
    stdin.write(json.dumps(msg) + "\n")
    stdin.flush()


def _recv(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        pytest.fail(f"{what}: peer exited with {proc.returncode} before answering", pytrace=False)
    msg: dict[str, Any] = json.loads(line)
    return msg


def test_write_with_imm_between_two_processes(rdma_device: tuple[str, int]) -> None:
    device, gid_index = rdma_device
    size, offset, imm = 4 << 20, 123, 0xC0FFEE42  # 4 MiB = 1024 packets at MTU 4096
    common = ["--device", device, "--gid-index", str(gid_index), "--size", str(size)]
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(PEER), role, *common, "--offset", str(offset), "--imm", str(imm)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("recv", "send")
    }
    recv, send = procs["recv"], procs["send"]
    try:
        recv_info, send_info = _recv(recv, "recv info"), _recv(send, "send info")
        _send(recv, send_info)
        _send(send, recv_info)
        assert _recv(recv, "recv ready") == {"ready": True}
        _send(send, {"go": True})
        sent, got = _recv(send, "send completion"), _recv(recv, "recv completion")
        assert sent == {"status": IBV_WC_SUCCESS, "opcode": IBV_WC_RDMA_WRITE}
        assert got["status"] == IBV_WC_SUCCESS
        assert got["opcode"] == IBV_WC_RECV_RDMA_WITH_IMM
        assert got["imm"] == imm
        assert got["byte_len"] == size
        assert got["mismatch"] is None, f"first wrong byte at receive offset {got['mismatch']}"
        for proc in procs.values():
            assert proc.wait(10) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_ib_write_bw_loopback(rdma_device: tuple[str, int]) -> None:
    device, gid_index = rdma_device
    # 200 x 64 KiB = 13 MB: well under a second even at soft-RoCE-under-TCG speed (~57 MB/s).
    args = ["ib_write_bw", "-d", device, "-x", str(gid_index), "-s", "65536", "-n", "200", "-F"]
    args += ["-p", str(free_port())]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # the server needs a moment to listen; perftest's client does not retry
            client = subprocess.run(
                [*args, "127.0.0.1"], capture_output=True, text=True, timeout=60, check=False
            )
            out = client.stdout + client.stderr
            if client.returncode == 0 or "Couldn't connect" not in out:
                break
            assert time.monotonic() < deadline, f"ib_write_bw server never listened:\n{out}"
            time.sleep(0.3)
        assert client.returncode == 0, f"ib_write_bw client failed:\n{out}"
        server_out, _ = server.communicate(timeout=30)
        assert server.returncode == 0, f"ib_write_bw server failed:\n{server_out}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    # " #bytes  #iterations  BW peak[MB/sec]  BW average[MB/sec]  MsgRate[Mpps]" + a values line
    match = re.search(r"BW average\[MB/sec\].*\n\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)", out)
    assert match, f"no bandwidth line in ib_write_bw output:\n{out}"
    peak, average = float(match.group(3)), float(match.group(4))
    # Once in a dozen runs under TCG perftest printed an average of 0.00 next to a sane peak (its
    # cycle-counter timing); the transfer itself completed, which is what this test is about.
    assert peak > 0, f"no bandwidth measured:\n{out}"
    print(f"ib_write_bw {device} gid {gid_index} 64 KiB x 200: {average} MB/s avg, {peak} peak")
