"""vLLM with the kvbeam connector: prefill and decode instances, token-identical to one.

A prefill vLLM and a decode vLLM, each with its KV cache attached to its own
``--pools engine`` kvbeam daemon (TCP between the daemons), and one plain vLLM; a tiny
dummy-weight Llama (float32, seeded unit-scale weights: tests/vllm_peer.py). For a
batch of prompts (lengths not multiples of the block size, two sharing a prefix)
decode's generated token ids must equal the plain instance's exactly; with the first
moved block zeroed on decode they must differ (the context matters); a transfer that
never comes fails the request instead of producing tokens.

The zeroing is the test harness's own: decode runs tests/vllm_zeroing.py's connector
subclass, which zeroes the first landed block of transfers named ``zero-N`` (and is
kvbeam's connector otherwise); no request parameter can ask kvbeam for it.

Runs only where vLLM is installed in the interpreter running pytest (``make
test-vllm``); KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbeam.integrations.vllm.params import blocks_for
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import Peer, require_vllm, write_model

pytestmark = require_vllm()

log = logging.getLogger(__name__)
BLOCK = 32
#: One block of every layer: K and V, 2 KV heads x 32 dims, float32, 2 layers.
BLOCK_BYTES = 2 * BLOCK * 2 * 32 * 4 * 2
MAX_TOKENS = 8
#: Prefill's sends wait for decode's reservations (--send-wait-s) while decode starts its
#: batch after prefill's (vLLM's proxy order) and admits the requests one by one.
DEADLINES = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "60",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "60", "--send-wait-s", "120", "--log-level", "INFO"]


def prompts() -> list[list[int]]:
    """Lengths 45, 70, 100, 64 and 33 (block 32); the 2nd and 3rd share 50 tokens;
    the last two differ only in their first token."""
    rng = np.random.default_rng(0)
    tok = [rng.integers(3, 1024, n).tolist() for n in (45, 70, 100, 64, 33)]
    tok[2][:50] = tok[1][:50]
    tok.append([(tok[4][0] + 1) % 1021 + 3, *tok[4][1:]])
    return tok


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Peer, Peer, Peer, DaemonProcess, DaemonProcess]]:
    work = tmp_path_factory.mktemp("vllm")
    model = write_model(work / "tiny-llama")
    sockets = {r: str(work / f"{r}.sock") for r in ("prefill", "decode")}
    daemons = {r: start_engine_daemon(r, sockets[r], deadlines=DEADLINES)
               for r in ("prefill", "decode")}
    base = {"prompts": prompts(), "block_size": BLOCK, "dtype": "float32"}
    peers = {
        "plain": Peer("plain", model, {**base, "max_tokens": MAX_TOKENS}, work),
        "prefill": Peer("prefill", model, {**base, "max_tokens": 1, "connector": {
            "daemon": daemons["prefill"].address, "attach_socket": sockets["prefill"]}}, work),
        "decode": Peer("decode", model, {
            **base, "max_tokens": MAX_TOKENS, "connector": {
                "daemon": daemons["decode"].address, "attach_socket": sockets["decode"]},
            "connector_module": "tests.vllm_zeroing", "connector_class": "ZeroingConnector"},
            work),
    }
    try:
        for p in peers.values():
            p.ready()
        yield peers["plain"], peers["prefill"], peers["decode"], daemons["prefill"], \
            daemons["decode"]
    finally:
        for p in peers.values():
            p.stop()
        for d in daemons.values():
            d.stop()


def transfer(prefill: Peer, decode: Peer, daemons: tuple[str, str], tag: str
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """vLLM's standard proxy order: prefill first (``max_tokens`` 1; its sends wait for
    decode's reservations), then decode with the ``kv_transfer_params`` prefill returned.

    Transfers tagged ``zero`` (tests/vllm_zeroing.py's ``ZERO_PREFIX``) get their first
    block zeroed on decode by the test's connector."""
    ids = [f"{tag}-{i}" for i in range(len(prompts()))]
    sent = prefill.run([{"do_remote_decode": True, "kvbeam_id": i, "decode_daemon": daemons[1]}
                        for i in ids])
    decode.start([s["kv_transfer_params"] for s in sent])
    return sent, decode.result()


def test_decode_tokens_equal_one_instance(
        instances: tuple[Peer, Peer, Peer, DaemonProcess, DaemonProcess]) -> None:
    plain, prefill, decode, p_daemon, d_daemon = instances
    want = plain.run(None)
    sent, got = transfer(prefill, decode, (p_daemon.address, d_daemon.address), "run")
    rows = []
    for i, (w, g, s) in enumerate(zip(want, got, sent, strict=True)):
        assert g["finish"] == "length", g
        moved = blocks_for(len(prompts()[i]), BLOCK) * BLOCK_BYTES
        rows.append(f"prompt {i} len {len(prompts()[i])}: {moved} bytes, {len(w['tokens'])} tokens "
                    f"identical={w['tokens'] == g['tokens']} batch: prefill {s['seconds']:.2f}s "
                    f"decode {g['seconds']:.2f}s plain {w['seconds']:.2f}s")
    log.warning("vLLM comparison:\n%s", "\n".join(rows))
    for s in sent:
        assert s["kv_transfer_params"]["kvbeam_id"] in [f"run-{i}" for i in range(len(want))]
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    # The context matters: the last two prompts differ only in their first token.
    assert want[4]["tokens"] != want[5]["tokens"], want
    assert decode.log("negative control") == []  # the test's connector zeroed nothing


def test_zeroed_block_changes_the_tokens(
        instances: tuple[Peer, Peer, Peer, DaemonProcess, DaemonProcess]) -> None:
    plain, prefill, decode, p_daemon, d_daemon = instances
    from tests.vllm_zeroing import ZERO_PREFIX  # it imports vLLM: only past the skip

    want = plain.run(None)
    _, got = transfer(prefill, decode, (p_daemon.address, d_daemon.address),
                      ZERO_PREFIX.rstrip("-"))
    assert all(g["finish"] == "length" for g in got), got
    zeroed = decode.log("negative control: zeroed block")
    assert sorted(line.split("(transfer ")[1].split(")")[0] for line in zeroed) == sorted(
        f"{ZERO_PREFIX}{i}" for i in range(len(want))), zeroed
    differ = [i for i, (w, g) in enumerate(zip(want, got, strict=True))
              if w["tokens"] != g["tokens"]]
    log.warning("zeroed first block: tokens differ for prompts %s of %d", differ, len(want))
    assert len(differ) == len(want), (want, got)


def test_wrong_transfer_fails_the_request(
        instances: tuple[Peer, Peer, Peer, DaemonProcess, DaemonProcess]) -> None:
    """Decode's requests name another prompt's transfer (another length): the transfers
    fail and vLLM fails those requests; no tokens come from a wrong KV."""
    plain, prefill, decode, p_daemon, d_daemon = instances
    n = len(prompts())
    ids = [f"wrong-{i}" for i in range(n)]
    prefill.run([{"do_remote_decode": True, "kvbeam_id": i, "decode_daemon": d_daemon.address}
                 for i in ids])
    decode.start([*[{"do_remote_prefill": True, "kvbeam_id": ids[(i + 1) % 4],
                     "prefill_daemon": p_daemon.address} for i in range(4)],
                  *[None] * (n - 4)])
    got = decode.result(600)
    want = plain.run(None)
    for i in range(4):
        assert got[i]["finish"] != "length", got[i]
    assert [g["tokens"] for g in got[4:]] == [w["tokens"] for w in want[4:]]
