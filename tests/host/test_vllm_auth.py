"""vLLM's connector with token-protected daemons (issue 22, item 6; issue 23).

Both ``--pools engine`` daemons require a shared token (``--auth-token-file``): a gRPC
caller without it is refused, and the daemons present it to each other on their peer
link. The connector holds no credentials (``kv_connector_extra_config`` refuses them):
its every call goes over its attach socket, which the daemon admits by the engine's
uid, so in vLLM's standard proxy order every request's KV moves and decode generates
its tokens from it.

Runs only where vLLM is installed in the interpreter running pytest (``make
test-vllm``); KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import AuthenticationError
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import Peer, require_vllm, write_model

pytestmark = require_vllm()

BLOCK = 32
MAX_TOKENS = 4
DEADLINES = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "60",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "60", "--send-wait-s", "120", "--log-level", "INFO"]


def test_connector_moves_kv_between_token_protected_daemons(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("vllm-token\n")
    model = write_model(tmp_path / "tiny-llama")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (45, 70)]
    sockets = {r: str(tmp_path / f"{r}.sock") for r in ("prefill", "decode")}
    daemons = {r: start_engine_daemon(r, sockets[r], deadlines=DEADLINES,
                                      extra=["--auth-token-file", str(token)])
               for r in ("prefill", "decode")}
    base = {"prompts": prompts, "block_size": BLOCK, "dtype": "float32"}
    # No credential in the connector's settings: it would be refused.
    peers = {r: Peer(r, model, {**base, "max_tokens": 1 if r == "prefill" else MAX_TOKENS,
                                "connector": {"daemon": daemons[r].address,
                                              "attach_socket": sockets[r]}}, tmp_path)
             for r in ("prefill", "decode")}
    try:
        for p in peers.values():
            p.ready()
        p_addr, d_addr = daemons["prefill"].address, daemons["decode"].address
        # The daemons do require the token: a gRPC caller without it is refused.
        for addr in (p_addr, d_addr):
            with KvbeamClient(addr) as client, \
                    pytest.raises(AuthenticationError, match="refused our credentials"):
                client.status("auth-0")
        ids = [f"auth-{i}" for i in range(len(prompts))]
        # vLLM's standard proxy order: prefill first (its sends wait for decode's
        # reservations), then decode with what prefill returned.
        sent = peers["prefill"].run([{"do_remote_decode": True, "kvbeam_id": i,
                                      "decode_daemon": d_addr} for i in ids])
        assert [s["kv_transfer_params"]["kvbeam_id"] for s in sent] == ids
        peers["decode"].start([s["kv_transfer_params"] for s in sent])
        got = peers["decode"].result()
        # A failed load fails the request (finish != length): every KV moved.
        assert [g["finish"] for g in got] == ["length"] * len(ids), got
        assert all(len(g["tokens"]) == MAX_TOKENS for g in got), got
    finally:
        for p in peers.values():
            p.stop()
        for d in daemons.values():
            d.stop()
