"""sglang's backend against token-protected daemons and bootstrap store (issue 22, item 6).

One environment variable (``KVBEAM_AUTH_TOKEN_FILE``) gives the daemons, the backend's
managers and its bootstrap store the same token, as on a node: a request moves. A
backend without the token is refused by the store and by the daemons, with errors
that say what is missing.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvbeam.auth import Security
from kvbeam.client import KvbeamClient
from kvbeam.errors import AuthenticationError
from kvbeam.integrations.sglang.conn import PREFILL_KEY, KvbeamKVReceiver, KvbeamKVSender
from kvbeam.refengine.configs import tiny_config
from tests.attach_helpers import start_engine_daemon, write_config
from tests.sglang_helpers import SglangPair

SUCCESS, WAITING = 4, 2


def _lists(item: int) -> dict[str, list[int]]:
    """Index lists of a 100-token request at item ``item`` of every kind."""
    return {"KV_PAGES": [item], "SWA_RING_ROWS": list(range(32 * item, 32 * item + 32)),
            "REQ_SLOT": [item], "C128_STATE": [item]}


def _states(pair: SglangPair, lists: dict[str, list[int]]) -> list[object]:
    return [None if c.pool == "draft" else
            {k: lists[k] for k in sorted({b.index_kind.name for b in c.buffers})}
            for c in pair.prefill_mgr.layout.states]


def test_backend_with_the_token_moves_a_request_and_without_it_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("sglang-token\n")
    monkeypatch.setenv("KVBEAM_AUTH_TOKEN_FILE", str(token))  # daemons, managers, store
    with SglangPair(tiny_config(unified=True, draft=True),
                    security=Security(token="sglang-token")) as pair:
        rx = KvbeamKVReceiver(pair.decode_mgr, pair.bootstrap_addr, 1)
        rx.init(0)
        tx = KvbeamKVSender(pair.prefill_mgr, pair.bootstrap_addr, 1)
        tx.init(1, 0)
        rx.send_metadata(np.array([0], dtype=np.int32), 0, _states(pair, _lists(0)))
        assert tx.poll() == WAITING and rx.poll() == WAITING
        tx.send(np.array([1], dtype=np.int32), _states(pair, _lists(1)), num_kv_tokens=100)
        deadline = time.monotonic() + 60
        while {tx.poll(), rx.poll()} - {0, SUCCESS} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tx.poll(), rx.poll()) == (SUCCESS, SUCCESS), (tx.error, tx.last, rx.last)
        tx.clear()
        rx.clear()

        # The same backend configured without the token.
        bare = copy.copy(pair.prefill_mgr)
        bare.security = Security()
        with pytest.raises(AuthenticationError, match="refused: no token; this bootstrap store "
                                                      "requires the kvbeam token"):
            bare.store(pair.bootstrap_addr, "get", PREFILL_KEY)
        # The daemon's gRPC API (a scheduler's, or a tool's) refuses the same credentials.
        with KvbeamClient(pair.prefill_mgr.daemon, security=bare.security) as tool, \
                pytest.raises(AuthenticationError, match="refused our credentials"):
            tool.status(tx.request_id)
        # A request of that backend fails at once naming the refusal (no exception into
        # sglang's scheduler loop, no wait for a deadline).
        refused = KvbeamKVSender(bare, pair.bootstrap_addr, 2)
        assert refused.poll() == 0
        with pytest.raises(RuntimeError, match="requires the kvbeam token"):
            refused.failure_exception()
        # Nothing a refused caller sent reached the store: prefill's entry is intact, and
        # the refused request's tombstone was refused too.
        assert pair.prefill_mgr.store(pair.bootstrap_addr, "get", PREFILL_KEY) == \
            pair.prefill_mgr.registration()
        assert pair.prefill_mgr.store(pair.bootstrap_addr, "get", "room.2") is None


#: What an sglang server process does at start with the kvbeam backend (the modules
#: sglang's plugin hook imports; the manager: its config, credentials and attach,
#: prefill's bootstrap store and registration; a request object of each side), then
#: which gRPC modules it loaded. (The hook's install() patches sglang's server modules,
#: which need sglang's full install, not this venv's base classes: its imports are here.)
_ENGINE_START = """
import sys
from types import SimpleNamespace

import yaml

import kvbeam.engine
import kvbeam.integrations.sglang
from kvbeam.integrations.sglang import memory, plugin, select
from kvbeam.integrations.sglang.conn import (KvbeamKVBootstrapServer, KvbeamKVManager,
                                             KvbeamKVReceiver, KvbeamKVSender)
from kvbeam.pools.spec import SideConfig
from tests.sglang_kvargs import kvargs_for

cfg, sock = sys.argv[1], sys.argv[2]
with open(cfg) as f:
    pools = kvbeam.engine.EnginePools(SideConfig.from_mapping(yaml.safe_load(f), cfg))
store = KvbeamKVBootstrapServer("127.0.0.1", 0)
args = SimpleNamespace(kvbeam_config=cfg, kvbeam_daemon="127.0.0.1:1",
                       kvbeam_attach_socket=sock, host="127.0.0.1",
                       disaggregation_bootstrap_port=store.server.address.rpartition(":")[2])
mgr = KvbeamKVManager(kvargs_for(pools), "prefill", args)
assert mgr.security.token == "sglang-token" and mgr.attachment.channel is not None
KvbeamKVSender(mgr, store.server.address, 1).poll()
KvbeamKVReceiver(mgr, store.server.address, 2).init(0)
mgr.close()
store.close()
print("grpc modules:", sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc.")
                              or m in ("kvbeam.client", "kvbeam.auth_grpc")))
"""


def test_the_sglang_engine_process_imports_no_grpc(tmp_path: Path) -> None:
    """The backend makes no gRPC call per request, so its process never imports gRPC: not
    through the plugin, the engine channel, the credentials (kvbeam.auth) or the store."""
    tmp_path.chmod(0o700)
    token = tmp_path / "token"
    token.write_text("sglang-token\n")
    cfg = write_config(tmp_path / "side.yaml", tiny_config(unified=True, draft=True))
    sock = str(tmp_path / "prefill.sock")
    daemon = start_engine_daemon("prefill", sock, config=cfg,
                                 extra=["--auth-token-file", str(token)])
    try:
        out = subprocess.run([sys.executable, "-c", _ENGINE_START, cfg, sock],
                             capture_output=True, text=True, timeout=300, check=False,
                             cwd=Path(__file__).resolve().parents[2],
                             env={**os.environ, "KVBEAM_AUTH_TOKEN_FILE": str(token)})
    finally:
        daemon.stop()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "grpc modules: []", out.stdout
