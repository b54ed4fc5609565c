"""Daemon settings (flags, environment, defaults) and the decode slot pool."""

from __future__ import annotations

import pytest

from kvbeam.errors import ConfigError, KvbeamError, NoFreeSlot
from kvbeam.server.settings import env_help, resolve
from kvbeam.server.state.slots import SlotPool
from tests.control_helpers import daemon_args as _args


def test_flag_beats_env_beats_default() -> None:
    env = {"KVBEAM_CONFIG": "env.yaml", "KVBEAM_RPC_TIMEOUT_S": "2.5", "KVBEAM_INTEGRITY": "off"}
    s = resolve("decode", _args("--config", "flag.yaml"), env)
    assert s.config == "flag.yaml"
    assert s.rpc_timeout_s == 2.5
    assert s.integrity is False
    assert s.listen == "127.0.0.1:50052"
    assert s.transport == "auto"
    assert resolve("prefill", _args(), env).listen == "127.0.0.1:50051"
    assert s.qps_per_peer == 1
    assert resolve("decode", _args(), {**env, "KVBEAM_QPS_PER_PEER": "4"}).qps_per_peer == 4


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ((), {}, "--config (or KVBEAM_CONFIG) is required"),
        (("--config", "c", "--rpc-timeout-s", "abc"), {}, "--rpc-timeout-s: could not convert"),
        (("--config", "c"), {"KVBEAM_MAX_INFLIGHT": "x"}, "KVBEAM_MAX_INFLIGHT: invalid literal"),
        (("--config", "c"), {"KVBEAM_TRANSPORT": "udp"}, "KVBEAM_TRANSPORT: 'udp' is not one of"),
        (("--config", "c", "--listen", "nohost"), {}, "--listen: expected HOST:PORT"),
        (("--config", "c", "--listen", "h:70000"), {}, "--listen: expected HOST:PORT"),
        (("--config", "c", "--advertise", "fd00::1:50052"), {},
         "--advertise: an IPv6 host needs brackets"),
        (("--config", "c", "--heartbeat-s", "0"), {}, "--heartbeat-s: must be positive"),
        (("--config", "c"), {"KVBEAM_INTEGRITY": "maybe"}, "KVBEAM_INTEGRITY: not a boolean"),
        (("--config", "c", "--qps-per-peer", "0"), {}, "--qps-per-peer: must be 1 to 16"),
    ],
)
def test_bad_settings_name_the_source(argv: tuple[str, ...], env: dict[str, str],
                                      needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve("prefill", _args(*argv), env)
    assert needle in str(info.value)


def test_env_help_lists_every_variable() -> None:
    text = env_help()
    assert "KVBEAM_LISTEN" in text and "KVBEAM_RDMA_DEVICE" in text


def test_slot_pool_books() -> None:
    pool = SlotPool(2)
    assert pool.acquire("a") == 0
    assert pool.acquire("b") == 1
    with pytest.raises(NoFreeSlot):
        pool.acquire("c")
    with pytest.raises(KvbeamError, match="already holds slot"):
        pool.acquire("a")
    assert pool.release("a") == 0
    assert pool.release("a") is None
    assert (pool.free, pool.held) == (1, 1)
    assert pool.acquire("c") == 0
    assert pool.slot_of("c") == 0
