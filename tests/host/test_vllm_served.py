"""vLLM served as users run it: two `vllm serve` with the kvbeam connector behind vllm-router.

A prefill and a decode ``vllm serve`` (each with its own ``--pools engine`` kvbeam
daemon, TCP between the daemons) behind vllm-router 0.1.17 in its vLLM PD mode
(``--vllm-pd-disaggregation --prefill URL --decode URL``), and a third, plain ``vllm
serve`` without kvbeam; all three with prefix caching and chunked prefill on
(``--max-num-batched-tokens 64``: prompts up to 250 tokens are prefilled in up to four
chunks). The tiny seeded Llama of tests/vllm_served.py, float32, block size 32.
Completions at temperature 0 through the router must equal the plain server's token
for token, streamed and not, several prompts at once; the decode daemon must have
received the transfers (else decode computed the prompts itself and nothing was
shown). Decode runs tests/vllm_zeroing.py's connector (kvbeam's, plus zeroing the
first landed block of transfers named ``zero-N``) for the negative control, sent in
vLLM's toy proxy protocol.

The pair's prefill has no ``decode_daemons`` (the recommended configuration: its sends
name no decode, and the decode that reserves a transfer gets it, decode's daemon
connecting the pair) and sends layer by layer (``layerwise``, every prompt: its
``layerwise_min_tokens`` 0) where a request names its
decode (``decode_daemon``: the direct requests here, and tests/vllm_concurrent_proxy.py,
which sends each request to prefill and decode at once), whole otherwise; behind
vllm-router and behind tests/vllm_contract_proxy.py, a proxy written to vLLM's NIXL
contract (NIXL's fixed kv_transfer_params, a plain uuid X-Request-Id), which passes
the same tests and moves the KV (both daemons' counters), and behind vLLM's own
toy_proxy_server.py, unchanged (tests/vllm_upstream.py fetches it from vLLM's sdist),
which moves the KV too.

The fleet: one more prefill (prefill2) and decode server (decode2), each with its own
daemon, and a second vllm-router over all four (two ``--prefill``, two ``--decode``);
prefill2's ``decode_daemons`` maps both decodes (the explicit mapping still works). The
decode2 test kills decode2 mid-transfer; the last one kills prefill2's daemon (nothing
moves, decode computes, both say so). A sixth server (decode, block size 64, bfloat16)
is refused for both mismatches, at once and naming the cause. All start at once, once
per module.

Runs only where vLLM and vllm-router are installed in the interpreter running pytest
(``make test-vllm``); KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from kvbeam.integrations.vllm.params import blocks_for
from kvbeam.procs import DaemonProcess
from tests.attach_helpers import start_engine_daemon
from tests.vllm_helpers import require_vllm
from tests.vllm_served import (
    Completion,
    Deployment,
    Served,
    complete,
    concurrent_proxy,
    contract_proxy,
    kv_config,
    metric,
    routed_ids,
    start_deployment,
    vllm_serve,
    vllm_toy_proxy,
    write_checkpoint,
)

pytestmark = require_vllm("vllm", "vllm_router")

log = logging.getLogger(__name__)
BLOCK = 32
MAX_TOKENS = 8
#: One block of every layer: K and V, 2 KV heads x 32 dims, float32, 2 layers.
BLOCK_BYTES = 2 * BLOCK * 2 * 32 * 4 * 2
#: Prefill's send waits this long for decode's reservation (--send-wait-s): the lease
#: under which prefill's vLLM holds a finished prompt's blocks for decode.
SEND_WAIT_S = 30
DEADLINES = ["--deadline-bootstrap-s", "20", "--deadline-waiting-s", "60",
             "--deadline-transfer-s", "30", "--heartbeat-s", "1", "--rpc-timeout-s", "5",
             "--handoff-lease-s", "60", "--send-wait-s", str(SEND_WAIT_S),
             "--log-level", "INFO", "--log-requests"]  # each request's steps: one grep
#: Transfers whose link prefill's daemon breaks (its KVBEAM_FAULT_BREAK_LINK prefix).
BROKEN = "broken-"
#: The mismatched decode's reservations give up after this (its --deadline-bootstrap-s):
#: before decode could ask prefill to connect, a refused pair reached its client only then.
MISMATCH_DEADLINE_S = 10
#: The mismatched decode server's --dtype (the others run float32).
MISMATCHED_DTYPE = "bfloat16"
#: The fleet's second prefill daemon waits this long before each write
#: (KVBEAM_FAULT_WRITE_DELAY_S): the window in which decode2 is killed mid-transfer.
SLOW_WRITE_S = 3
#: Both sides and the plain server: prefix caching and chunked prefill on, small chunks.
SERVE_ARGS = ["--enable-prefix-caching", "--enable-chunked-prefill",
              "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
              "--enable-log-requests"]  # each request's id in vLLM's log: one grep finds it


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 1024, n)]


@dataclass
class Mismatched:
    """A decode server with block size 64 (prefill's is 32; vLLM's CPU attention takes
    multiples of 32 only) and KV dtype bfloat16 (prefill's float32), policy ``fail``,
    its daemon: one server for both mismatches (the handshake names every difference)."""

    server: Served
    daemon: DaemonProcess


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mismatched]:
    """Started before the deployment (its start-up overlaps theirs)."""
    work = tmp_path_factory.mktemp("vllm-mismatched")
    model = write_checkpoint(work / "tiny-llama")
    sock = str(work / "decode64.sock")
    # Its reservations give up after 10 s (Bootstrapping: a reservation's state until
    # prefill writes): before decode could ask prefill to connect, a refused handshake
    # reached them only then.
    daemon = start_engine_daemon("decode", sock, deadlines=[
        *DEADLINES, "--deadline-bootstrap-s", str(MISMATCH_DEADLINE_S)])
    server = vllm_serve("decode64", model, block_size=64, dtype=MISMATCHED_DTYPE, args=SERVE_ARGS,
                        kv_transfer_config=kv_config("decode", {
                            "daemon": daemon.address, "attach_socket": sock}, policy="fail"))
    try:
        yield Mismatched(server, daemon)
    finally:
        server.stop()
        daemon.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, mismatched: Mismatched
           ) -> Iterator[Deployment]:
    deployment = start_deployment(
        tmp_path_factory.mktemp("vllm-served"), SERVE_ARGS, DEADLINES,
        decode_connector=("tests.vllm_zeroing", "ZeroingConnector"), decode_policy="recompute",
        # Test-only: transfers named broken-N fail on prefill (a broken link, no resend).
        prefill_daemon_args=["--enable-fault-injection", "--resend-retries", "0"],
        prefill_daemon_env={"KVBEAM_FAULT_BREAK_LINK": f"1000:{BROKEN}"},
        # One more prefill and decode (prefill2, decode2) and a router over all four;
        # test-only: prefill2's daemon writes slowly (decode2 is killed mid-transfer).
        fleet_extra=1, fleet_prefill_daemon_args=["--enable-fault-injection"],
        fleet_prefill_daemon_env={"KVBEAM_FAULT_WRITE_DELAY_S": str(SLOW_WRITE_S)},
        # The pair's prefill maps no decode: its sends go to whichever decode reserves them;
        # those that name their decode go layer by layer.
        unmapped=["prefill"], extra={"prefill": {"layerwise": True,
                                                 "layerwise_min_tokens": 0}})
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def contract(served: Deployment) -> Iterator[Served]:
    """A proxy written to vLLM's NIXL contract over the pair (no vLLM server more)."""
    proxy = contract_proxy([served.prefill.url], [served.decode.url])
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def concurrent(served: Deployment) -> Iterator[Served]:
    """tests/vllm_concurrent_proxy.py over the pair: each request to both at once, both
    daemons named (the pair's prefill then sends it layer by layer)."""
    proxy = concurrent_proxy([(served.prefill, served.daemons["prefill"])],
                             [(served.decode, served.daemons["decode"])])
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def toy(served: Deployment) -> Iterator[Served]:
    """vLLM's own toy_proxy_server.py (fetched unchanged from vLLM's sdist) over the pair."""
    proxy = vllm_toy_proxy([served.prefill], [served.decode])
    try:
        yield proxy
    finally:
        proxy.stop()


def _at_once(router: Served, plain: Served, prompts: list[list[int]], *, stream: bool
             ) -> tuple[list[Completion], list[Completion]]:
    """Every prompt through ``router`` and to ``plain``, all at once; (router's, plain's)."""
    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        via = [pool.submit(complete, router.url, p, MAX_TOKENS, stream=stream)
               for p in prompts]
        direct = [pool.submit(complete, plain.url, p, MAX_TOKENS, stream=stream)
                  for p in prompts]
        return [f.result() for f in via], [f.result() for f in direct]


def _compare(d: Deployment, prompts: list[list[int]], *, stream: bool
             ) -> tuple[list[Completion], list[Completion], float, float]:
    """All prompts at once through the router and to the plain server; (router's, plain's,
    transfers landed on decode, bytes landed) for this batch."""
    before = d.landed()
    got, want = _at_once(d.router, d.plain, prompts, stream=stream)
    after = d.landed()
    rows = [f"prompt len {len(p)} ({blocks_for(len(p), BLOCK)} blocks): {len(w.tokens)} tokens "
            f"identical={g.tokens == w.tokens} router ttft {g.ttft_s:.2f}s plain {w.ttft_s:.2f}s"
            for p, g, w in zip(prompts, got, want, strict=True)]
    log.warning("vllm-router vs plain (stream=%s):\n%s\nlanded on decode: %d transfers, %d "
                "bytes", stream, "\n".join(rows), after[0] - before[0], after[1] - before[1])
    return got, want, after[0] - before[0], after[1] - before[1]


def test_router_output_equals_the_direct_server(served: Deployment) -> None:
    """Non-streamed, seven prompts at once: under one block, two sharing two blocks, and
    longer than one chunk (64 tokens) up to 200 tokens (four chunks)."""
    rng = np.random.default_rng(0)
    prompts = [_tokens(rng, n) for n in (45, 70, 100, 64, 33, 20, 200)]
    prompts[2][:64] = prompts[1][:64]
    since = len(served.daemons["prefill"].lines)
    got, want, landed, nbytes = _compare(served, prompts, stream=False)
    # Prefill maps no decode: each send named none and went to the decode that reserved
    # it (vllm-router hands prefill's returned kv_transfer_params to decode unchanged).
    bound = [line for line in served.daemons["prefill"].lines[since:]
             if "reserved it: sending there" in line]
    assert len(bound) == len(prompts), bound
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.finish, w.status, w.finish) == (200, "length", 200, "length"), (g, w)
        assert len(w.tokens) == MAX_TOKENS
    assert [g.tokens for g in got] == [w.tokens for w in want]
    # Decode loaded every one from prefill (one whose prefix decode already held, only
    # the blocks after it).
    assert landed == len(prompts), landed
    assert nbytes >= sum(blocks_for(len(p), BLOCK) for p in prompts[:2]) * BLOCK_BYTES
    # The connector's workers asked to be pushed only each request's end.
    for role in ("prefill", "decode"):
        assert any("(pushes: final)" in line for line in served.daemons[role].lines), role


def test_router_streams_what_the_direct_server_streams(served: Deployment) -> None:
    rng = np.random.default_rng(1)
    prompts = [_tokens(rng, n) for n in (50, 90, 130, 250, 31)]
    got, want, landed, _ = _compare(served, prompts, stream=True)
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.finish, w.finish) == (200, "length", "length"), (g, w)
        # Streamed: the tokens came in several events, one per token as a rule; vLLM's
        # output handler coalesces consecutive steps' tokens into one event when it falls
        # behind (a loaded 2-core host: 7 events for 8 tokens, once in a dozen runs).
        assert 1 <= len(g.gaps_s) <= MAX_TOKENS - 1, g
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert landed == len(prompts), landed


def _one(d: Deployment, prompt: list[int], via: Served | None = None
         ) -> tuple[Completion, Completion, float, float]:
    """One prompt through the router (or ``via``), then to the plain server: (router's,
    plain's, transfers landed on decode, blocks landed)."""
    before = d.landed()
    got = complete((via or d.router).url, prompt, MAX_TOKENS)
    after = d.landed()
    want = complete(d.plain.url, prompt, MAX_TOKENS)
    return got, want, after[0] - before[0], (after[1] - before[1]) / BLOCK_BYTES


def test_decode_loads_only_the_blocks_its_prefix_cache_lacks(served: Deployment) -> None:
    """Prefix caching on decode: vLLM reports the blocks it holds (``num_computed_tokens``,
    whole blocks, never the whole prompt: it computes the last token again), and decode
    reserves only the others (``kv_skip``): prefill writes just those. One prompt at a
    time so each one's blocks are counted alone (decode's daemon's landed bytes)."""
    rng = np.random.default_rng(2)
    base = _tokens(rng, 96)  # 3 blocks
    shared = base[:64] + _tokens(rng, 40)  # 4 blocks, the first 2 base's
    short = _tokens(rng, 20)  # under one block
    cases = [  # (case, prompt, blocks decode holds when it comes)
        ("new prompt", base, 0),
        ("shared 2-block prefix", shared, 2),
        ("shared 2-block prefix", base[:64] + _tokens(rng, 10), 2),
        ("repeat (all but the last block held)", base, 2),
        ("repeat (all but the last block held)", shared, 3),
        ("under one block", short, 0),
        ("under one block, repeated", short, 0),
    ]
    rows = []
    for case, prompt, held in cases:
        got, want, landed, blocks = _one(served, prompt)
        total = blocks_for(len(prompt), BLOCK)
        rows.append(f"{case}: {len(prompt)} tokens, {total} blocks, {blocks:g} moved, "
                    f"{len(want.tokens)} tokens identical={got.tokens == want.tokens}")
        assert (got.status, got.finish) == (200, "length"), got
        assert got.tokens == want.tokens, case
        assert (landed, blocks) == (1, total - held), (case, landed, blocks)
    log.warning("partial loads through vllm-router:\n%s", "\n".join(rows))


def _whole_prompts_move(served: Deployment, proxy: Served, rng: np.random.Generator,
                        batches: tuple[tuple[bool, tuple[int, ...]], ...]
                        ) -> tuple[list[str], int, int]:
    """Each batch (streamed?, prompt lengths) of new random prompts at once through
    ``proxy`` and to the plain server: token-identical, and every prompt's blocks written
    by prefill's daemon and landed on decode's (both daemons' counters: decode computed
    none itself). (a row per batch, transfers, blocks)."""
    p_url = served.metrics("prefill")
    p_before = (metric(p_url, "kvbeam_transfers_total", state="Success"),
                metric(p_url, "kvbeam_request_bytes_total"))
    moved = blocks = 0
    rows = []
    for stream, lengths in batches:
        prompts = [_tokens(rng, n) for n in lengths]
        before = served.landed()
        got, want = _at_once(proxy, served.plain, prompts, stream=stream)
        after = served.landed()
        for g, w in zip(got, want, strict=True):
            assert (g.status, g.finish, w.status, w.finish) == (200, "length", 200, "length"), \
                (g, w)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        n = sum(blocks_for(len(p), BLOCK) for p in prompts)  # random: no prefix held
        assert (after[0] - before[0], after[1] - before[1]) == (len(prompts), n * BLOCK_BYTES)
        moved, blocks = moved + len(prompts), blocks + n
        rows.append(f"stream={stream}: {lengths}: {len(prompts)} transfers, {n} blocks, "
                    f"{n * BLOCK_BYTES} bytes landed on decode, tokens identical")
    p_after = (metric(p_url, "kvbeam_transfers_total", state="Success"),
               metric(p_url, "kvbeam_request_bytes_total"))
    assert (p_after[0] - p_before[0], p_after[1] - p_before[1]) == (moved, blocks * BLOCK_BYTES)
    return rows, moved, blocks


def _prefix_loads_move_only_the_missing_blocks(served: Deployment, proxy: Served,
                                               rng: np.random.Generator, *,
                                               repeat: bool) -> list[str]:
    """A new 3-block prompt, then one sharing its first 2 blocks (and, ``repeat``, the
    first prompt again) through ``proxy``: token-identical to the plain server, each
    landed once, and prefill's daemon moved only the blocks decode's prefix cache
    lacked. (a row per prompt)."""
    base = _tokens(rng, 96)  # 3 blocks
    shared = base[:64] + _tokens(rng, 40)  # 4 blocks, the first 2 base's
    cases = [("new prompt", base, 0), ("shared 2-block prefix", shared, 2)]
    if repeat:
        cases.append(("repeat", base, 2))
    rows = []
    for case, prompt, held in cases:
        got, want, landed, moved = _one(served, prompt, via=proxy)
        total = blocks_for(len(prompt), BLOCK)
        rows.append(f"{case}: {total} blocks, {moved:g} moved, tokens identical")
        assert (got.status, got.finish) == (200, "length"), got
        assert got.tokens == want.tokens, case
        assert (landed, moved) == (1, total - held), (case, landed, moved)
    return rows


def test_behind_a_contract_proxy_output_equals_the_direct_server_and_the_kv_moves(
        served: Deployment, contract: Served) -> None:
    """vLLM's NIXL contract and nothing else (tests/vllm_contract_proxy.py: NIXL's fixed
    kv_transfer_params to prefill, a plain uuid X-Request-Id to both, prefill's returned
    params to decode unchanged), 5 prompts at once not streamed, then 3 streamed:
    token-identical to the plain server; prefill's daemon wrote every prompt whole and
    decode's landed it (Success and bytes in both daemons' counters: decode computed
    nothing itself); and each X-Request-Id the proxy made names its transfer in both
    daemons' logs and both servers' (one grep follows the request)."""
    logs = {"prefill daemon": served.daemons["prefill"].lines,
            "decode daemon": served.daemons["decode"].lines,
            "prefill vLLM": served.prefill.lines, "decode vLLM": served.decode.lines}
    since = {name: len(lines) for name, lines in logs.items()}
    proxied = len(contract.lines)
    rows, moved, blocks = _whole_prompts_move(
        served, contract, np.random.default_rng(20),
        ((False, (45, 100, 64, 20, 200)), (True, (50, 130, 31))))
    ids = routed_ids(contract, proxied)
    assert len(ids) == moved, ids
    missing = [(rid, name) for rid in ids for name, lines in logs.items()
               if not any(rid in line for line in lines[since[name]:])]
    example = [line.strip() for line in logs["decode daemon"][since["decode daemon"]:]
               if ids[0] in line][:1]
    log.warning("behind the contract proxy:\n%s\nprefill daemon: %d transfers, %d bytes "
                "written; X-Request-Id %s in decode's daemon: %s", "\n".join(rows), moved,
                blocks * BLOCK_BYTES, ids[0], example)
    assert not missing, missing


def test_behind_a_contract_proxy_decode_loads_only_the_blocks_its_prefix_cache_lacks(
        served: Deployment, contract: Served) -> None:
    """Partial loads need nothing from the proxy: decode's reservation names the blocks
    its prefix cache lacks, and prefill's daemon writes only those."""
    rows = _prefix_loads_move_only_the_missing_blocks(served, contract,
                                                      np.random.default_rng(21), repeat=True)
    log.warning("partial loads behind the contract proxy: %s", rows)


def test_layer_by_layer_behind_a_concurrent_proxy_equals_the_direct_server(
        served: Deployment, concurrent: Served) -> None:
    """Layer by layer, decode reserving while prefill computes (the concurrent proxy):
    prompts of one to eight blocks (chunked prefill: up to four chunks), at once, not
    streamed then streamed, token-identical to the plain server, each written once by
    prefill's daemon and landed on decode's (decode computed nothing itself); partial
    loads (decode's prefix cache holding the first blocks) move only the blocks decode
    lacks; every one was streamed (prefill's ``vllm:kvbeam_events_total{event=
    "streamed"}``). The negative controls on the same path: a transfer named ``zero-N``
    (its first landed block zeroed on decode) and one named ``zlayer-N`` (one layer's
    piece: the prompt's blocks in the middle layer) change the tokens."""
    prefill_metrics = f"{served.prefill.url}/metrics"
    streamed = metric(prefill_metrics, "vllm:kvbeam_events_total", event="streamed")
    rows, moved, _ = _whole_prompts_move(served, concurrent, np.random.default_rng(40),
                                         ((False, (45, 100, 200, 250)), (True, (70, 130))))
    rows += _prefix_loads_move_only_the_missing_blocks(served, concurrent,
                                                       np.random.default_rng(41), repeat=True)
    sent = moved + 3
    deadline = time.monotonic() + 30  # vLLM's stats reach /metrics with its next log
    while (metric(prefill_metrics, "vllm:kvbeam_events_total", event="streamed") - streamed
           < sent and time.monotonic() < deadline):
        time.sleep(0.5)
    counted = metric(prefill_metrics, "vllm:kvbeam_events_total", event="streamed") - streamed
    log.warning("layer by layer behind the concurrent proxy:\n%s\nstreamed: %g",
                "\n".join(rows), counted)
    assert counted >= sent, (counted, sent)
    zeroed = len(served.decode.log("negative control: zeroed block"))
    prompt = _tokens(np.random.default_rng(42), 100)
    zero = complete(concurrent.url, prompt, MAX_TOKENS,
                    kv_transfer_params={"kvbeam_id": "zero-layerwise"})
    plain = complete(served.plain.url, prompt, MAX_TOKENS)
    assert zero.finish == "length" and zero.tokens != plain.tokens, (zero, plain)
    assert len(served.decode.log("negative control: zeroed block")) == zeroed + 1
    # One layer's piece: every block of the prompt in the model's middle layer.
    layer = complete(concurrent.url, prompt, MAX_TOKENS,
                     kv_transfer_params={"kvbeam_id": "zlayer-layerwise"})
    assert layer.finish == "length" and layer.tokens != plain.tokens, (layer, plain)
    assert len(served.decode.log("negative control: zeroed layer")) == 1


def test_behind_vllms_own_toy_proxy_output_equals_the_direct_server_and_the_kv_moves(
        served: Deployment, toy: Served) -> None:
    """vLLM's own P/D test proxy, unchanged (tests/v1/kv_connector/nixl_integration/
    toy_proxy_server.py from vLLM 0.32.0's sdist): 4 prompts at once not streamed, 2
    streamed, then a prompt sharing a prefix: token-identical to the plain server, and
    both daemons' counters show every prompt's KV written and landed (decode computed
    none of them), the shared prefix's blocks not moved again."""
    rng = np.random.default_rng(22)
    rows, _, _ = _whole_prompts_move(served, toy, rng,
                                     ((False, (40, 110, 70, 25)), (True, (60, 140))))
    rows += _prefix_loads_move_only_the_missing_blocks(served, toy, rng, repeat=False)
    log.warning("behind vLLM's own toy_proxy_server.py:\n%s", "\n".join(rows))


def test_a_declined_transfer_frees_prefills_blocks_at_once(served: Deployment) -> None:
    """Decode declines a transfer it will not load (here its prompt is not the one
    prefill computed, 5 tokens longer): its daemon tells prefill's at once, prefill's
    send ends Failed ("declined by decode") and prefill's vLLM frees the blocks, long
    before the --send-wait-s lease; decode computes the prompt itself."""
    rng = np.random.default_rng(8)
    prompt = _tokens(rng, 150)
    other = prompt + _tokens(rng, 5)
    first = complete(served.prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": "decline-1",
        "decode_daemon": served.daemons["decode"].address})
    usage = f"{served.prefill.url}/metrics"
    began = time.monotonic()
    got = complete(served.decode.url, other, MAX_TOKENS,
                   kv_transfer_params=first.kv_transfer_params)
    want = complete(served.plain.url, other, MAX_TOKENS)
    assert (got.status, got.finish) == (200, "length"), got
    assert got.tokens == want.tokens
    end = time.monotonic() + SEND_WAIT_S + 60  # bounded: the lease would free them too
    while time.monotonic() < end and metric(usage, "vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    freed_s = time.monotonic() - began
    assert metric(usage, "vllm:kv_cache_usage_perc") == 0
    ended = [line for line in served.daemons["prefill"].lines if "decline-1" in line
             and "fail" in line]
    log.warning("declined: prefill's blocks freed %.1f s after decode's request (lease %d "
                "s): %s", freed_s, SEND_WAIT_S, ended[-1:])
    # Freed by the decline, not by the lease (whose failure names --send-wait-s).
    assert any("declined by decode: its prompt has 155 tokens, prefill computed 150" in line
               for line in ended), ended
    assert not any("send-wait-s" in line for line in ended), ended


def test_a_zeroed_block_changes_the_tokens(served: Deployment) -> None:
    """The comparison can fail: in vLLM's toy proxy protocol (prefill first with
    ``max_tokens`` 1, then decode with the returned params), transfers named ``zero-N``
    get their first landed block zeroed by the test's connector on decode."""
    rng = np.random.default_rng(3)
    prompts = [_tokens(rng, n) for n in (70, 100)]
    decode_daemon = served.daemons["decode"].address
    zeroed = len(served.decode.log("negative control: zeroed block"))  # other tests' too
    for i, p in enumerate(prompts):
        first = complete(served.prefill.url, p, 1, kv_transfer_params={
            "do_remote_decode": True, "kvbeam_id": f"zero-{i}", "decode_daemon": decode_daemon})
        assert first.kv_transfer_params["kvbeam_id"] == f"zero-{i}", first
        got = complete(served.decode.url, p, MAX_TOKENS,
                       kv_transfer_params=first.kv_transfer_params)
        want = complete(served.plain.url, p, MAX_TOKENS)
        assert got.finish == "length" and got.tokens != want.tokens, (got, want)
    assert len(served.decode.log("negative control: zeroed block")) == zeroed + len(prompts)


def test_prefill_frees_its_blocks_when_decode_never_comes(served: Deployment) -> None:
    """Prefill holds a finished prompt's blocks for decode under a lease: its daemon's
    ``--send-wait-s``. A prefill request whose decode never comes fails its send once
    the lease ends, and prefill's vLLM frees the blocks (its KV usage back to zero)."""
    url = f"http://{served.daemons['prefill'].metrics}/metrics"
    before = metric(url, "kvbeam_transfers_total", state="Failed")
    out = complete(served.prefill.url, _tokens(np.random.default_rng(4), 300), 1,
                   kv_transfer_params={"do_remote_decode": True, "kvbeam_id": "orphan-1",
                                       "decode_daemon": served.daemons["decode"].address})
    assert out.kv_transfer_params["kvbeam_id"] == "orphan-1"
    usage = f"{served.prefill.url}/metrics"
    held = metric(usage, "vllm:kv_cache_usage_perc")
    assert held > 0, "prefill's blocks are not held for decode"
    end = time.monotonic() + SEND_WAIT_S + 60
    while time.monotonic() < end and metric(usage, "vllm:kv_cache_usage_perc") > 0:
        time.sleep(1)
    assert metric(usage, "vllm:kv_cache_usage_perc") == 0
    after = metric(url, "kvbeam_transfers_total", state="Failed")
    log.warning("orphaned prefill: usage %.4f held, freed; prefill daemon failed %s -> %s",
                held, before, after)
    assert after > before  # the send ended (failed: no reservation came)
    assert [line for line in served.daemons["prefill"].lines
            if "orphan-1" in line and "fail" in line]


def _toy_proxy(d: Deployment, prompt: list[int], kvbeam_id: str, max_tokens: int,
               **kwargs: bool) -> tuple[Completion, Completion]:
    """vLLM's toy proxy protocol: prefill first (``max_tokens`` 1, naming the transfer and
    decode's daemon), then decode with the parameters prefill returned."""
    first = complete(d.prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": kvbeam_id,
        "decode_daemon": d.daemons["decode"].address})
    assert first.kv_transfer_params["kvbeam_id"] == kvbeam_id, first
    return first, complete(d.decode.url, prompt, max_tokens,
                           kv_transfer_params=first.kv_transfer_params, **kwargs)


def test_a_failed_transfer_is_recomputed(served: Deployment) -> None:
    """Decode runs ``kv_load_failure_policy: recompute``: a transfer whose link prefill's
    daemon breaks (fault injection, armed by --enable-fault-injection) fails on both
    daemons, and decode's vLLM computes the prompt itself: same tokens, no error."""
    d_url = f"http://{served.daemons['decode'].metrics}/metrics"
    failed = metric(d_url, "kvbeam_transfers_total", state="Failed")
    prompt = _tokens(np.random.default_rng(5), 90)
    _, got = _toy_proxy(served, prompt, f"{BROKEN}1", MAX_TOKENS)
    want = complete(served.plain.url, prompt, MAX_TOKENS)
    assert (got.status, got.finish) == (200, "length"), got
    assert got.tokens == want.tokens
    assert metric(d_url, "kvbeam_transfers_total", state="Failed") == failed + 1
    assert [line for line in served.daemons["prefill"].lines
            if "FAULT INJECTED: broke link" in line and f"{BROKEN}1" in line], \
        served.daemons["prefill"].lines[-20:]


def test_a_client_that_disconnects_frees_both_instances(served: Deployment) -> None:
    """A streamed request through the router, dropped after its first tokens: decode's
    vLLM aborts it and frees its blocks (its running requests and KV usage back to
    zero), prefill's were freed when its send ended, and neither daemon keeps a live
    transfer."""
    import urllib.request

    body = {"model": "tiny", "prompt": _tokens(np.random.default_rng(6), 120),
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(served.router.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    seen = [response.readline() for _ in range(6)]  # a few events (and blank lines)
    assert any(line.startswith(b"data: ") for line in seen), seen
    decode_metrics = f"{served.decode.url}/metrics"
    assert metric(decode_metrics, "vllm:num_requests_running") == 1
    generated = metric(decode_metrics, "vllm:generation_tokens_total")
    response.close()  # the client goes away mid-stream
    end = time.monotonic() + 60
    gauges: dict[str, float] = {}
    while time.monotonic() < end:
        gauges = {
            "decode running": metric(decode_metrics, "vllm:num_requests_running"),
            "decode kv usage": metric(decode_metrics, "vllm:kv_cache_usage_perc"),
            "prefill running": metric(f"{served.prefill.url}/metrics",
                                      "vllm:num_requests_running"),
            "prefill kv usage": metric(f"{served.prefill.url}/metrics",
                                       "vllm:kv_cache_usage_perc"),
            **{f"{r} daemon live": metric(f"http://{d.metrics}/metrics", "kvbeam_transfers_live")
               for r, d in served.daemons.items()}}
        if not any(gauges.values()):
            break
        time.sleep(1)
    more = metric(decode_metrics, "vllm:generation_tokens_total") - generated
    log.warning("after the client disconnected: %s; decode generated %d more tokens of 400",
                gauges, more)
    assert not any(gauges.values()), gauges
    assert more < 300, more  # aborted, not run to its end




@pytest.fixture(scope="module")
def contract_mismatched(served: Deployment, mismatched: Mismatched) -> Iterator[Served]:
    """A contract proxy over the pair's prefill and the mismatched decode server."""
    mismatched.server.wait_ready()
    proxy = contract_proxy([served.prefill.url], [mismatched.server.url],
                           name="contract-mismatched")
    try:
        yield proxy
    finally:
        proxy.stop()


def _load_failures(server: Served, transfer: str) -> list[str]:
    """What decode's vLLM (its kvbeam worker) logged of the failed load of the transfer
    whose id holds ``transfer``: "transfer ID failed (REASON: DETAIL)"."""
    said = re.compile(rf"transfer \S*{re.escape(transfer)}\S* failed \(")
    return [line.strip() for line in server.lines if said.search(line)]


def _refused(got: Completion) -> bool:
    """Decode's vLLM (``kv_load_failure_policy: "fail"``) failed the request rather than
    generate from blocks that never landed."""
    return got.status != 200 or got.finish == "error"


def test_a_block_size_mismatch_is_refused_at_once_naming_both(served: Deployment,
                                                               mismatched: Mismatched) -> None:
    """Prefill (block size 32) sends to a decode server with block size 64 (its daemon
    named, toy proxy order): prefill's handshake is refused naming both values and its
    send fails; decode's reservation makes its daemon ask prefill's to connect, the
    same refusal fails it at once, and decode's vLLM (``"fail"``) fails the request at
    once, not at the reservation's deadline. Prefill now knows that decode cannot be
    paired: its next request for it returns no do_remote_prefill (decode computes the
    prompt), counted in prefill's vLLM metrics."""
    mismatched.server.wait_ready()
    daemons = {"prefill": served.daemons["prefill"], "decode": mismatched.daemon}
    since = {role: len(d.lines) for role, d in daemons.items()}
    prompt = _tokens(np.random.default_rng(7), 70)
    first = complete(served.prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": "bs-1",
        "decode_daemon": mismatched.daemon.address})
    began = time.monotonic()
    got = complete(mismatched.server.url, prompt, MAX_TOKENS,
                   kv_transfer_params=first.kv_transfer_params)
    took = time.monotonic() - began
    named = {role: [line.strip() for line in d.lines[since[role]:]
                    if "bs-1" in line and "block size: prefill=32, decode=64" in line]
             for role, d in daemons.items()}
    loads = _load_failures(mismatched.server, "bs-1")
    log.warning("block size mismatch: the client saw HTTP %s %s %r after %.2f s; the "
                "daemons: %s; decode's vLLM: %s", got.status, got.finish, got.error[:120],
                took, {role: lines[:1] for role, lines in named.items()}, loads)
    assert _refused(got), got
    assert named["prefill"] and named["decode"], named
    # At once: decode's reservation, and so the load its vLLM failed the request for,
    # ended with the refusal (incompatible, naming both values), not at the
    # reservation's deadline (timeout: "no progress in Bootstrapping for 10.0 s").
    assert any("failed: incompatible" in line for line in named["decode"]), named
    assert any("(incompatible: " in line and "block size: prefill=32, decode=64" in line
               for line in loads), loads
    # Prefill's vLLM heard of the refused send (its workers' report): no transfer now.
    usage = f"{served.prefill.url}/metrics"
    prompt = _tokens(np.random.default_rng(9), 70)
    second = complete(served.prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": "bs-2",
        "decode_daemon": mismatched.daemon.address})
    assert second.kv_transfer_params is None, second
    assert metric(usage, "vllm:kvbeam_events_total", event="no_transfer_decode_refused") >= 1
    computed = complete(mismatched.server.url, prompt, MAX_TOKENS)  # what the proxy sends on
    assert (computed.status, computed.finish) == (200, "length"), computed
    assert any("asked for a remote decode: no transfer (a send to decode daemon "
               f"{mismatched.daemon.address} failed" in line for line in served.prefill.lines)


def test_a_dtype_mismatch_behind_a_contract_proxy_fails_both_sides_at_once(
        served: Deployment, mismatched: Mismatched, contract_mismatched: Served) -> None:
    """Prefill's KV is float32, the mismatched decode server's bfloat16 (``--dtype``; the
    connector describes its pool from the live cache tensor, so the handshake compares
    dtypes, not item bytes alone). Behind the contract proxy prefill's send names no
    decode; the mismatched decode's reservation makes its daemon ask prefill's to
    connect; prefill's handshake is refused naming dtype (and block size: every
    difference); decode's reservation fails at once with that text, decode's vLLM fails
    the request at once, and decode tells prefill, whose send fails too: prefill's
    blocks are free at once, not at its --send-wait-s lease."""
    daemons = {"prefill": served.daemons["prefill"], "decode": mismatched.daemon}
    since = {role: len(d.lines) for role, d in daemons.items()}
    proxied = len(contract_mismatched.lines)
    usage = f"{served.prefill.url}/metrics"
    began = time.monotonic()
    got = complete(contract_mismatched.url, _tokens(np.random.default_rng(8), 90), MAX_TOKENS)
    took = time.monotonic() - began
    [rid] = routed_ids(contract_mismatched, proxied)
    end = time.monotonic() + SEND_WAIT_S + 60  # bounded: the lease would free them too
    while time.monotonic() < end and metric(usage, "vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.1)
    freed = time.monotonic() - began
    failed = {role: [line.strip() for line in d.lines[since[role]:]
                     if rid in line and "fail" in line] for role, d in daemons.items()}
    loads = _load_failures(mismatched.server, rid)
    log.warning("dtype mismatch behind the contract proxy: the client saw HTTP %s %s %r after "
                "%.2f s; prefill's blocks free after %.2f s; the daemons: %s; decode's vLLM: "
                "%s", got.status, got.finish, got.error[:120], took, freed,
                {role: lines[:1] for role, lines in failed.items()}, loads)
    assert _refused(got), got
    assert metric(usage, "vllm:kv_cache_usage_perc") == 0
    # At once, on both sides: decode's reservation (and the load its vLLM failed the
    # request for) ended with the refusal's text, not at the reservation's deadline
    # (timeout: "no progress in Bootstrapping for 10.0 s"); prefill's send, and so its
    # blocks, by decode's word, not by the lease (whose failure names --send-wait-s).
    dtypes = f"dtype: prefill=float32, decode={MISMATCHED_DTYPE}"
    assert any(dtypes in line and "incompatible" in line for line in failed["decode"]), failed
    assert any("(incompatible: " in line and dtypes in line for line in loads), loads
    assert any(dtypes in line and "decode's reservation failed" in line
               for line in failed["prefill"]), failed
    assert not any("send-wait-s" in line for line in failed["prefill"]), failed


#: vllm-router's request id in a daemon's log: (prefill's, decode's HTTP host:port).
ROUTED = re.compile(r"___prefill_addr_([\w.:-]+?)___decode_addr_([\w.:-]+?)_[0-9a-f]{32}")


def _routed(lines: list[str]) -> set[tuple[str, str]]:
    return {(m.group(1), m.group(2)) for line in lines for m in ROUTED.finditer(line)}


def _host(server: Served) -> str:
    return server.url.removeprefix("http://")


def test_a_fleet_behind_one_router_equals_the_direct_server(served: Deployment) -> None:
    """Two prefill and two decode servers behind one vllm-router (``--prefill A
    --prefill B --decode C --decode D``, prefill round robin, ``--decode-policy
    random``; A maps no decode, B's ``decode_daemons`` maps both): 8 prompts at once
    not streamed, then 8 streamed, token-identical to the plain server; every daemon
    counted transfers, every transfer went to the decode server the router named in the
    request id (and came from the prefill it named), and a prefill sent to a decode
    other than its round-robin partner."""
    assert served.fleet_router is not None
    fleet = [*served.fleet_prefill, *served.fleet_decode]
    names = [s.name for s in fleet]
    before = {n: metric(served.metrics(n), "kvbeam_transfers_total", state="Success")
              for n in names}
    since = {n: len(served.daemons[n].lines) for n in names}
    rng = np.random.default_rng(10)
    rows = []
    for stream, lengths in ((False, (40, 75, 110, 150, 66, 200, 90, 130)),
                            (True, (55, 95, 120, 180, 35, 70, 140, 100))):
        prompts = [_tokens(rng, n) for n in lengths]
        got, want = _at_once(served.fleet_router, served.plain, prompts, stream=stream)
        for g, w in zip(got, want, strict=True):
            assert (g.status, g.finish, w.status, w.finish) == (200, "length", 200, "length"), \
                (g, w)
            assert len(w.tokens) == MAX_TOKENS
        assert [g.tokens for g in got] == [w.tokens for w in want]
        rows.append(f"stream={stream}: {len(prompts)} prompts {lengths}, "
                    f"{sum(len(w.tokens) for w in want)} tokens identical")
    moved = {n: metric(served.metrics(n), "kvbeam_transfers_total", state="Success") - before[n]
             for n in names}
    routed = {n: _routed(served.daemons[n].lines[since[n]:]) for n in names}
    log.warning("fleet behind one router:\n%s\ntransfers per daemon: %s\nrouted pairs: %s",
                "\n".join(rows), moved, {n: sorted(r) for n, r in routed.items()})
    assert all(moved[n] > 0 for n in names), moved  # every server took part
    # Every prompt moved (random prompts: no prefix held on decode).
    assert sum(moved[d.name] for d in served.fleet_decode) == 16, moved
    assert sum(moved[p.name] for p in served.fleet_prefill) == 16, moved
    for d in served.fleet_decode:  # landed where the router sent the request
        assert {dec for _, dec in routed[d.name]} == {_host(d)}, routed
    for p in served.fleet_prefill:
        assert {pre for pre, _ in routed[p.name]} == {_host(p)}, routed
    # The router picks decode at random: some prefill sent to the decode server that is
    # not its lockstep partner (missed with probability 2**-16): A to the decode that
    # reserved it, B through decode_daemons.
    pairs = {pair for r in routed.values() for pair in r}
    hosts = [_host(s) for s in fleet]
    assert pairs & {(hosts[0], hosts[3]), (hosts[1], hosts[2])}, pairs


def _outcome(url: str, prompt: list[int], params: dict[str, object] | None) -> str:
    """What a client of ``url`` saw: the HTTP status and tokens, or the exception."""
    try:
        got = complete(url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
    except OSError as exc:  # http.client.RemoteDisconnected is a ConnectionResetError
        return f"{type(exc).__name__}: {exc}"
    return f"HTTP {got.status} {got.finish} {len(got.tokens)} tokens {got.error[:100]}"


def _reserved_from(decode_lines: list[str], since: int, prefill_daemon: str) -> str | None:
    """A request decode's daemon reserved (after line ``since``) for prefill at
    ``prefill_daemon``, or None."""
    for line in decode_lines[since:]:
        m = re.search(r"request (\S+): reserved slot .* from prefill (\S+)", line)
        if m and m.group(2) == prefill_daemon:
            return m.group(1)
    return None


def test_a_decode_killed_mid_transfer_behind_the_router_leaves_prefill_serving(
        served: Deployment) -> None:
    """Last but one in the module: it kills decode2. Waves of four 400-token prompts go through
    the fleet's router (prefill round robin, decode at random) until decode2's daemon
    reserves one from prefill2, whose daemon writes slowly
    (``KVBEAM_FAULT_WRITE_DELAY_S``); then decode2's ``vllm serve`` and its engine
    processes get SIGKILL, mid-transfer. The clients routed to decode2 see the router's
    error; every prefill's vLLM frees the prompts' blocks (KV usage 0, within its
    ``--send-wait-s`` lease for those decode2 never reserved), no daemon keeps a live
    transfer, decode2's daemon its attachment; the router and both prefills keep
    serving: the next prompts through the router that reach the surviving decode (the
    router may still pick decode2 for some) and prefill2's next one (toy proxy order)
    equal the plain server's tokens."""
    assert served.fleet_router is not None
    router = served.fleet_router
    prefill2, decode2 = served.fleet_prefill[1], served.fleet_decode[1]
    p_metrics, d_metrics = served.metrics("prefill2"), served.metrics("decode2")
    failed = metric(p_metrics, "kvbeam_transfers_total", state="Failed")
    decode2_lines = served.daemons["decode2"].lines
    rng = np.random.default_rng(11)
    killed: str | None = None
    seen: list[str] = []
    live: dict[str, float] = {}
    with ThreadPoolExecutor(4) as pool:
        for _wave in range(6):
            since = len(decode2_lines)
            wave = [pool.submit(_outcome, router.url, _tokens(rng, 400), None)
                    for _ in range(4)]
            while killed is None and not all(f.done() for f in wave):
                killed = _reserved_from(decode2_lines, since,
                                        served.daemons["prefill2"].address)
                time.sleep(0.05)
            if killed is not None:
                live = {"decode2 daemon": metric(d_metrics, "kvbeam_transfers_live"),
                        "prefill2 daemon": metric(p_metrics, "kvbeam_transfers_live")}
                decode2.kill()
            seen += [f.result(timeout=300) for f in wave]
            if killed is not None:
                break
    assert killed is not None, f"no transfer from prefill2 to decode2 in 6 waves: {seen}"
    log.warning("decode2 killed with %s live, mid-transfer of %s; the router's clients saw: %s",
                live, killed, seen)
    assert live["decode2 daemon"] >= 1, live
    assert any(not s.startswith("HTTP 200 length") for s in seen), seen  # decode2's clients
    # The router and both prefills keep serving: prompts through the router reach the
    # surviving decode (those it still sends to decode2 fail), token-identical. The
    # router picks the decode at random and keeps the dead one in its list, so up to
    # 24 prompts go until 3 complete (8 at random all to decode2 happened once).
    after: list[tuple[str, bool]] = []
    for _ in range(24):
        if sum(ok for _, ok in after) >= 3:
            break
        prompt = _tokens(rng, 150)
        try:
            got = complete(router.url, prompt, MAX_TOKENS, timeout=120)
        except OSError as exc:
            after.append((f"{type(exc).__name__}: {exc}", False))
            continue
        ok = (got.status, got.finish) == (200, "length")
        after.append((f"HTTP {got.status} {got.finish} {got.error[:160]}", ok))
        if ok:
            assert got.tokens == complete(served.plain.url, prompt, MAX_TOKENS).tokens
    log.warning("through the router after the kill: %s", after)
    assert any(ok for _, ok in after), after
    usages = [f"{p.url}/metrics" for p in served.fleet_prefill]
    end = time.monotonic() + SEND_WAIT_S + 60
    gauges: dict[str, float] = {}
    while time.monotonic() < end:
        gauges = {**{f"{p.name} kv usage": metric(u, "vllm:kv_cache_usage_perc")
                     for p, u in zip(served.fleet_prefill, usages, strict=True)},
                  **{f"{p.name} running": metric(u, "vllm:num_requests_running")
                     for p, u in zip(served.fleet_prefill, usages, strict=True)},
                  **{f"{n} daemon live": metric(served.metrics(n), "kvbeam_transfers_live")
                     for n in ("prefill", "prefill2", "decode", "decode2")},
                  "decode2 daemon attached": metric(d_metrics, "kvbeam_engine_attached")}
        if not any(gauges.values()):
            break
        time.sleep(1)
    ended = metric(p_metrics, "kvbeam_transfers_total", state="Failed") - failed
    log.warning("after the kill: %s; prefill2's sends Failed since: %d; lines of %s: %s",
                gauges, ended, killed, [line.strip() for line in
                                        served.daemons["prefill2"].lines if killed in line][-3:])
    assert not any(gauges.values()), gauges
    assert ended >= 1  # at least the killed transfer
    assert metric(p_metrics, "kvbeam_engine_attached") == 1  # prefill2 still attached
    # prefill2 and its daemon keep serving: the next prompt through the surviving decode.
    landed = served.landed()[0]
    prompt = _tokens(rng, 150)
    first = complete(prefill2.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "kvbeam_id": "after-kill-1",
        "decode_daemon": served.daemons["decode"].address})
    got = complete(served.decode.url, prompt, MAX_TOKENS,
                   kv_transfer_params=first.kv_transfer_params)
    want = complete(served.plain.url, prompt, MAX_TOKENS)
    assert (got.status, got.finish) == (200, "length"), got
    assert got.tokens == want.tokens
    assert served.landed()[0] == landed + 1


def test_with_prefills_daemon_gone_nothing_moves_decode_computes_and_both_say_so(
        served: Deployment) -> None:
    """The negative control of the contract proxy's test, last in the module: prefill2's
    daemon is killed (SIGKILL; its vLLM worker keeps trying to re-attach), and prompts go
    through a contract proxy over prefill2 and the pair's decode (``recompute``). No KV
    moves (decode's daemon lands nothing), decode computes every prompt (tokens identical
    to the plain server's), at once, and neither side is silent: prefill2's send fails at
    once (WARNING, ``vllm:kvbeam_events_total{event="send_failed_..."}``), and decode's
    reservation fails at once, its daemon unable to reach prefill2's (WARNING,
    ``load_failed_peer_unreachable``): not at decode's --deadline-bootstrap-s."""
    assert served.fleet_prefill
    prefill2 = served.fleet_prefill[1]
    p_metrics, d_metrics = f"{prefill2.url}/metrics", f"{served.decode.url}/metrics"
    before = (metric(p_metrics, "vllm:kvbeam_events_total"),
              metric(d_metrics, "vllm:kvbeam_events_total", event="load_failed_peer_unreachable"))
    served.daemons["prefill2"].kill()
    proxy = contract_proxy([prefill2.url], [served.decode.url], name="contract-prefill2")
    try:
        landed = served.landed()
        since = {"prefill2": len(prefill2.lines), "decode": len(served.decode.lines)}
        rng = np.random.default_rng(30)
        seen = []
        for _ in range(3):
            prompt = _tokens(rng, 90)
            began = time.monotonic()
            got = complete(proxy.url, prompt, MAX_TOKENS)
            took = time.monotonic() - began
            want = complete(served.plain.url, prompt, MAX_TOKENS)
            seen.append(f"HTTP {got.status} {got.finish} in {took:.2f} s, identical="
                        f"{got.tokens == want.tokens}")
            assert (got.status, got.finish) == (200, "length"), got
            assert got.tokens == want.tokens
    finally:
        proxy.stop()
    after = (metric(p_metrics, "vllm:kvbeam_events_total"),
             metric(d_metrics, "vllm:kvbeam_events_total", event="load_failed_peer_unreachable"))
    said = {"prefill2": [line.strip() for line in prefill2.lines[since["prefill2"]:]
                         if "send of transfer" in line and "failed" in line],
            "decode": [line.strip() for line in served.decode.lines[since["decode"]:]
                       if "failed (peer_unreachable" in line]}
    log.warning("prefill2's daemon killed: %s; landed on decode: %s -> %s; events: prefill2 "
                "%s -> %s, decode load_failed_peer_unreachable %s -> %s; said: %s", seen,
                landed, served.landed(), before[0], after[0], before[1], after[1],
                {k: v[:1] for k, v in said.items()})
    assert served.landed() == landed  # nothing moved
    assert after[0] - before[0] >= 3 and after[1] - before[1] >= 3, (before, after)
    assert len(said["prefill2"]) >= 3 and len(said["decode"]) >= 3, said
    # At once: every load failed as prefill2's daemon was unreachable, none at decode's
    # --deadline-bootstrap-s (timeout: "no progress in Bootstrapping").
    assert not any("failed (timeout" in line
                   for line in served.decode.lines[since["decode"]:]), said
