"""vLLM's connector against token-protected daemons (issue 22, item 6).

Both ``--pools engine`` daemons require a shared token; each vLLM instance's
``kv_connector_extra_config`` names the token file, and every call its connector makes
(decode's Reserve, prefill's Send, Status, Release) presents it: every request's KV
moves and decode generates its tokens from it. Before the connector took credentials,
the key was unknown (vLLM refused to start) and without it every call was refused.

Runs only where vLLM is installed in the interpreter running pytest (``make
test-vllm``); KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvbeam.auth import Security
from kvbeam.engine.requests import client_for
from kvbeam.errors import AuthenticationError, KvbeamError
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import Peer, write_model

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("KVBEAM_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVBEAM_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm)")
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make test-vllm)")

BLOCK = 32
MAX_TOKENS = 4
DEADLINES = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "60",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "60", "--log-level", "INFO"]


def test_connector_with_a_token_file_moves_kv_between_token_protected_daemons(
        tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("vllm-token\n")
    sec = Security(token="vllm-token")
    model = write_model(tmp_path / "tiny-llama")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (45, 70)]
    sockets = {r: str(tmp_path / f"{r}.sock") for r in ("prefill", "decode")}
    daemons = {r: start_engine_daemon(r, sockets[r], deadlines=DEADLINES,
                                      extra=["--auth-token-file", str(token)])
               for r in ("prefill", "decode")}
    base = {"prompts": prompts, "block_size": BLOCK, "dtype": "float32"}
    peers = {r: Peer(r, model, {**base, "max_tokens": 1 if r == "prefill" else MAX_TOKENS,
                                "connector": {"daemon": daemons[r].address,
                                              "attach_socket": sockets[r],
                                              "auth_token_file": str(token)}}, tmp_path)
             for r in ("prefill", "decode")}
    try:
        for p in peers.values():
            p.ready()
        p_addr, d_addr = daemons["prefill"].address, daemons["decode"].address
        # The daemons refuse a caller without the token.
        with pytest.raises(AuthenticationError, match="refused our credentials"):
            client_for(d_addr).status("auth-0")
        ids = [f"auth-{i}" for i in range(len(prompts))]
        peers["decode"].start([{"do_remote_prefill": True, "kvbeam_id": i,
                                "prefill_daemon": p_addr} for i in ids])
        decode = client_for(d_addr, sec)
        deadline = time.monotonic() + 300
        for rid in ids:  # decode's connector reserved with the token
            while True:
                try:
                    decode.status(rid)
                    break
                except KvbeamError:
                    assert time.monotonic() < deadline, f"decode never reserved {rid}"
                    time.sleep(0.2)
        sent = peers["prefill"].run([{"do_remote_decode": True, "kvbeam_id": i,
                                      "decode_daemon": d_addr} for i in ids])
        got = peers["decode"].result()
        assert [s["kv_transfer_params"]["kvbeam_id"] for s in sent] == ids
        # A failed load fails the request (finish != length): every KV moved.
        assert [g["finish"] for g in got] == ["length"] * len(ids), got
        assert all(len(g["tokens"]) == MAX_TOKENS for g in got), got
    finally:
        for p in peers.values():
            p.stop()
        for d in daemons.values():
            d.stop()
