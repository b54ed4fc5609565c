"""vLLM served staged: two `vllm serve` whose KV caches stay ordinary tensors, behind vllm-router.

A prefill and a decode ``vllm serve`` with the kvbeam connector and ``staging: true``
(each with its own ``--pools engine`` daemon, TCP between them): vLLM's KV cache stays
in the tensors vLLM allocated (nothing is moved into a memfd) and each worker attaches
a host staging buffer of the cache's geometry instead, as it does for a cache on a
GPU; the same code copies there (gathers on prefill, scatters on decode), on CPU
tensors. Behind vllm-router in its PD mode, beside a plain ``vllm serve``; prefix
caching and chunked prefill on; the tiny seeded Llama of tests/vllm_served.py, float32,
block size 32 (tests/host/test_vllm_served.py's setup, one pair).

Decode's staging buffer is small on purpose (2 requests of 128 tokens: 8 blocks, about
half of the batch below): requests queue for its room at vLLM's steps and all land; a
prompt larger than the whole buffer is declined at once and decode (``kv_load_failure_
policy: recompute``) computes it. Decode runs tests/vllm_zeroing.py's connector: a
transfer named ``zero-N`` gets its first landed block's staging item zeroed after the
landing and before the scatter (the negative control). Prefill's buffer is the default
(4 requests of ``--max-model-len``).

Runs where vLLM and vllm-router are installed (``make test-vllm``);
KVBEAM_REQUIRE_VLLM=1 turns the skip into a failure.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbeam.integrations.vllm.params import blocks_for
from tests.host.test_vllm_served import (
    BLOCK,
    BLOCK_BYTES,
    DEADLINES,
    MAX_TOKENS,
    SERVE_ARGS,
    _at_once,
    _compare,
    _one,
    _tokens,
    _toy_proxy,
)
from tests.vllm_helpers import require_vllm
from tests.vllm_served import Deployment, Served, complete, descendants, metric, start_deployment

pytestmark = require_vllm("vllm", "vllm_router")

log = logging.getLogger(__name__)
#: Decode's staging buffer: 2 requests of 128 tokens, 8 blocks of 32 in all.
DECODE_STAGING = {"staging": True, "staging_requests": 2, "staging_tokens": 128,
                  "staging_wait_s": 60}
DECODE_STAGED_BLOCKS = 8


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_deployment(
        tmp_path_factory.mktemp("vllm-staged"), SERVE_ARGS, DEADLINES,
        decode_connector=("tests.vllm_zeroing", "ZeroingConnector"), decode_policy="recompute",
        unmapped=["prefill"], extra={"prefill": {"staging": True}, "decode": DECODE_STAGING})
    try:
        yield deployment
    finally:
        deployment.stop()


def _memfds(server: Served) -> set[str]:
    """The memfd names mapped by a ``vllm serve`` and every process it started."""
    names: set[str] = set()
    for pid in (server.proc.pid, *descendants(server.proc.pid)):
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names |= set(re.findall(r"memfd:(\S+)", text))
    return names


def _explain(d: Deployment) -> str:
    """What the servers and daemons said about requests that did not move."""
    out = []
    for server in (d.prefill, d.decode):
        out.append(f"--- {server.name}:\n" + "".join(
            line for line in server.lines if "WARNING" in line or "ERROR" in line
            or "kvbeam" in line.lower())[-6000:])
    for role, daemon in d.daemons.items():
        out.append(f"--- {role} daemon:\n" + "".join(
            line for line in daemon.lines if "WARNING" in line or "Failed" in line)[-4000:])
    return "\n".join(out)


def test_the_kv_caches_stay_ordinary_tensors_and_staging_buffers_are_attached(
        staged: Deployment) -> None:
    """Neither worker moved its KV cache into shared memory (no ``kvbeam.vllm-kv``
    memfd, which an unstaged worker maps); each maps its staging buffer's memfds, and
    said so when it attached."""
    for server in (staged.prefill, staged.decode):
        names = _memfds(server)
        log.warning("%s maps memfds %s", server.name, sorted(names))
        assert not any("kvbeam.vllm-kv" in n for n in names), names
        assert any(n.startswith("kvbeam.") for n in names), names
        assert server.log("on cpu, staged"), server.lines[-40:]
        assert server.log("staging buffer for tiny on cpu"), server.lines[-40:]


def test_staged_router_output_equals_the_direct_server(staged: Deployment) -> None:
    """Seven prompts at once (21 blocks; decode's buffer holds 8): they queue for
    decode's staging room and every one lands; token-identical to the plain server."""
    rng = np.random.default_rng(0)
    prompts = [_tokens(rng, n) for n in (45, 70, 100, 64, 33, 20, 200)]
    prompts[2][:64] = prompts[1][:64]
    got, want, landed, nbytes = _compare(staged, prompts, stream=False)
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.finish, w.status, w.finish) == (200, "length", 200, "length"), (g, w)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert landed == len(prompts), _explain(staged)
    assert nbytes >= sum(blocks_for(len(p), BLOCK) for p in prompts[:2]) * BLOCK_BYTES


def test_staged_router_streams_what_the_direct_server_streams(staged: Deployment) -> None:
    rng = np.random.default_rng(1)
    prompts = [_tokens(rng, n) for n in (50, 90, 130, 31)]
    got, want, landed, _ = _compare(staged, prompts, stream=True)
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.finish, w.finish) == (200, "length", "length"), (g, w)
        # Several events, one per token as a rule (vLLM coalesces consecutive steps'
        # tokens into one event when its output handler falls behind: test_vllm_served).
        assert 1 <= len(g.gaps_s) <= MAX_TOKENS - 1, g
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert landed == len(prompts), landed


def test_staged_decode_loads_only_the_blocks_its_prefix_cache_lacks(staged: Deployment
                                                                    ) -> None:
    rng = np.random.default_rng(2)
    base = _tokens(rng, 96)  # 3 blocks
    shared = base[:64] + _tokens(rng, 40)  # 4 blocks, the first 2 base's
    rows = []
    for case, prompt, held in (("new prompt", base, 0), ("shared 2-block prefix", shared, 2),
                               ("repeat", base, 2), ("repeat", shared, 3)):
        got, want, landed, blocks = _one(staged, prompt)
        total = blocks_for(len(prompt), BLOCK)
        rows.append(f"{case}: {total} blocks, {blocks:g} moved, identical "
                    f"{got.tokens == want.tokens}")
        assert (got.status, got.finish) == (200, "length"), got
        assert got.tokens == want.tokens, case
        assert (landed, blocks) == (1, total - held), (case, landed, blocks)
    log.warning("staged partial loads: %s", rows)


def test_a_zeroed_staging_item_changes_the_tokens(staged: Deployment) -> None:
    """The negative control: in vLLM's toy proxy order, transfers named ``zero-N`` get
    their first landed block zeroed in decode's staging buffer, after the landing and
    before the scatter: the tokens change (so the scatter is what decode decodes from)."""
    rng = np.random.default_rng(3)
    prompts = [_tokens(rng, n) for n in (70, 100)]
    for i, p in enumerate(prompts):
        _, got = _toy_proxy(staged, p, f"zero-{i}", MAX_TOKENS)
        want = complete(staged.plain.url, p, MAX_TOKENS)
        assert got.finish == "length" and got.tokens != want.tokens, (got, want)
    zeroed = staged.decode.log("negative control: zeroed the staging item")
    assert len(zeroed) == len(prompts), zeroed


def test_a_prompt_larger_than_decodes_staging_buffer_is_declined_and_recomputed(
        staged: Deployment) -> None:
    """300 tokens need 10 blocks, decode's buffer has 8: refused at once (no wait),
    prefill told (it frees its blocks), decode computes it (policy recompute): the same
    tokens, nothing landed, the refusal counted in decode's vLLM metrics."""
    url = f"{staged.decode.url}/metrics"
    refused = metric(url, "vllm:kvbeam_events_total", event="load_failed_staging_full")
    prompt = _tokens(np.random.default_rng(4), 300)
    before = staged.landed()
    got = complete(staged.router.url, prompt, MAX_TOKENS)
    want = complete(staged.plain.url, prompt, MAX_TOKENS)
    assert (got.status, got.finish) == (200, "length"), got
    assert got.tokens == want.tokens
    assert staged.landed()[0] == before[0]
    end = time.monotonic() + 30  # vLLM publishes its stats on its own schedule
    while metric(url, "vllm:kvbeam_events_total", event="load_failed_staging_full") \
            <= refused and time.monotonic() < end:
        time.sleep(0.5)
    assert metric(url, "vllm:kvbeam_events_total", event="load_failed_staging_full") \
        == refused + 1
    assert staged.decode.log(f"holds {DECODE_STAGED_BLOCKS} in all")
    usage = f"{staged.prefill.url}/metrics"  # declined: prefill's blocks freed at once
    end = time.monotonic() + 20
    while metric(usage, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < end:
        time.sleep(0.2)
    assert metric(usage, "vllm:kv_cache_usage_perc") == 0


def test_the_staging_metrics_are_in_vllms_metrics_and_log(staged: Deployment) -> None:
    """Staged bytes and copy time by direction and the occupancy, in each vLLM's
    /metrics and its periodic "KV Transfer metrics" log line."""
    rng = np.random.default_rng(5)
    _at_once(staged.router, staged.plain, [_tokens(rng, 90)], stream=False)
    p_url, d_url = f"{staged.prefill.url}/metrics", f"{staged.decode.url}/metrics"
    end = time.monotonic() + 30
    while time.monotonic() < end and not (
            metric(p_url, "vllm:kvbeam_staging_bytes_total", direction="out")
            and metric(d_url, "vllm:kvbeam_staging_bytes_total", direction="in")):
        time.sleep(0.5)
    figures = {
        "prefill out bytes": metric(p_url, "vllm:kvbeam_staging_bytes_total", direction="out"),
        "prefill out s": metric(p_url, "vllm:kvbeam_staging_copy_seconds_total",
                                direction="out"),
        "decode in bytes": metric(d_url, "vllm:kvbeam_staging_bytes_total", direction="in"),
        "decode in s": metric(d_url, "vllm:kvbeam_staging_copy_seconds_total",
                              direction="in"),
        "decode occupancy": metric(d_url, "vllm:kvbeam_staging_occupancy")}
    log.warning("staging metrics: %s", figures)
    assert figures["prefill out bytes"] > 0 and figures["decode in bytes"] > 0
    assert figures["prefill out s"] > 0 and figures["decode in s"] > 0
    assert figures["decode occupancy"] == 0  # every request ended
    end = time.monotonic() + 40  # vLLM logs its stats every 10 s (VLLM_LOG_STATS_INTERVAL)
    while True:
        lines = {s.name: [line.strip() for line in s.lines if "KV Transfer metrics" in line
                          and "kvbeam staging_bytes" in line]
                 for s in (staged.prefill, staged.decode)}
        if all(lines.values()) or time.monotonic() > end:
            break
        time.sleep(1)
    log.warning("vLLM's log: %s", {k: v[-1:] for k, v in lines.items()})
    assert all(lines.values()), lines
