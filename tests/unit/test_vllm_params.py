"""The vLLM connector's request parameters and scheduler side, without vLLM (fakes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvbeam.errors import ConfigError
from kvbeam.integrations.vllm import params as P
from kvbeam.integrations.vllm import scheduler as S

SETTINGS = P.Settings(daemons=("127.0.0.1:7",), attach_sockets=("/x.sock",), model="m")


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: str = "FINISHED_LENGTH_CAPPED"


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def test_the_scheduler_side_makes_no_kvbeam_call() -> None:
    assert not hasattr(S, "Sender") and not hasattr(S, "Receiver") and not hasattr(S, "client_for")


def test_prefill_holds_the_prompt_blocks_and_plans_their_send() -> None:
    side = S.SchedulerSide(SETTINGS, block_size=32)
    req = Req("a", list(range(70)), {"do_remote_decode": True, "kvbeam_id": "t1",
                                      "decode_daemon": "d:1"})
    hold, out = side.request_finished(req, [5, 9, 2, 11])
    assert hold and side.has_pending_push_work()
    assert out == {"do_remote_prefill": True, "kvbeam_id": "t1", "prefill_daemon": "127.0.0.1:7",
                   "prompt_len": 70}
    assert side.take_plan().sends == [S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)]
    side.sends_finished({"a"})
    assert not side.has_pending_push_work()


def test_an_aborted_prefill_request_is_not_sent() -> None:
    side = S.SchedulerSide(SETTINGS, block_size=32)
    req = Req("a", [1] * 40, {"do_remote_decode": True, "kvbeam_id": "t", "decode_daemon": "d"},
              status="FINISHED_ABORTED")
    assert side.request_finished(req, [1, 2]) == (False, None)
    assert not side.has_pending_push_work() and side.take_plan().sends == []


def test_decode_loads_the_whole_prompt_into_its_blocks() -> None:
    side = S.SchedulerSide(SETTINGS, block_size=32)
    req = Req("b", list(range(45)), P.returned_params("t2", ("p:1",), 45))
    assert side.get_num_new_matched_tokens(req, 0) == (45, True)
    side.update_state_after_alloc(req, Blocks([7, 3]), 45)
    assert side.take_plan().loads == [S.Load("b", "t2", (7, 3), ("p:1",), 45)]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: no reload


def test_a_request_cannot_switch_on_test_behaviour(caplog: pytest.LogCaptureFixture) -> None:
    """``kv_transfer_params`` comes from any API caller: the retired test switch
    ``kvbeam_test_zero_first_block`` (it zeroed the first landed block) and any other
    unknown ``kvbeam_`` key change nothing; the connector logs them as ignored."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    params = {**P.returned_params("t5", ("p:1",), 45), "kvbeam_test_zero_first_block": True,
              "kvbeam_bogus": 1, "remote_engine_id": "another connector's key"}
    req = Req("e", list(range(45)), params)
    assert side.get_num_new_matched_tokens(req, 0) == (45, True)
    side.update_state_after_alloc(req, Blocks([7, 3]), 45)
    # The plan the worker reserves from is the one without the keys.
    assert side.take_plan().loads == [S.Load("e", "t5", (7, 3), ("p:1",), 45)]
    assert P.load_params(params) == P.load_params(P.returned_params("t5", ("p:1",), 45))
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored and all("kvbeam_bogus, kvbeam_test_zero_first_block" in m
                           and "remote_engine_id" not in m for m in ignored), ignored
    prefill = {"do_remote_decode": True, "kvbeam_id": "t6", "decode_daemon": "d:1",
               "kvbeam_test_zero_first_block": True}
    assert P.send_params(prefill) == P.SendParams("t6", ("d:1",))
    hold, _ = side.request_finished(Req("h", list(range(45)), prefill), [4, 8])
    assert hold and side.take_plan().sends == [S.Push("h", "t6", (4, 8), ("d:1",), 45)]


def test_malformed_params_do_not_raise_into_vllms_scheduler(
        caplog: pytest.LogCaptureFixture) -> None:
    """An exception in a connector call stops vLLM's engine core for every request: a
    request whose kvbeam keys are malformed runs without a transfer instead (decode
    computes the prompt itself, prefill sends nothing: nothing in the plan), and the log
    says why."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    for bad in ({"do_remote_prefill": True, "prefill_daemon": "p:1"},
                {"do_remote_prefill": True, "kvbeam_id": 7, "prefill_daemon": "p:1"}):
        req = Req("f", list(range(45)), bad)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        side.update_state_after_alloc(req, Blocks([7, 3]), 45)
    prefill = Req("g", list(range(45)), {"do_remote_decode": True, "kvbeam_id": "t7",
                                          "decode_daemon": 5})
    assert side.request_finished(prefill, [1, 2]) == (False, None)
    assert side.take_plan() == S.StepPlan()
    assert not side.has_pending_push_work()
    refused = [r.getMessage() for r in caplog.records if "no transfer" in r.getMessage()]
    assert any("request f" in m and "kvbeam_id" in m for m in refused), refused
    assert any("request g" in m and "decode_daemon" in m for m in refused), refused
    assert side.take_counts() == {"no_transfer_malformed_params": 1}  # vLLM's /metrics


def test_decode_with_a_local_prefix_loads_only_the_blocks_it_lacks() -> None:
    """vLLM's blocks for the request come cached ones first: the load names the rest,
    and kv_skip counts the cached blocks (prefill writes only those after them)."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    req = Req("c", list(range(100)), P.returned_params("t3", ("p:1",), 100))
    assert side.get_num_new_matched_tokens(req, 64) == (36, True)
    side.update_state_after_alloc(req, Blocks([4, 8, 6, 1]), 36)
    assert side.take_plan().loads == [S.Load("c", "t3", (6, 1), ("p:1",), 100, kv_skip=2)]
    assert not side.has_pending_push_work()


def test_decode_declines_what_it_will_not_load_and_tells_prefill_once() -> None:
    """Prefill holds its blocks for every returned request: one decode will not load
    (another prompt, a whole-prompt hit, a hit not in whole blocks, or it ended before
    it loaded) goes out as a decline at once, and vLLM computes the prompt itself."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    other = Req("d1", list(range(50)), P.returned_params("t7", ("p:1",), 45))
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)  # asked again: once
    whole = Req("d2", list(range(64)), P.returned_params("t8", ("p:1",), 64))
    assert side.get_num_new_matched_tokens(whole, 64) == (0, False)
    odd = Req("d3", list(range(64)), P.returned_params("t9", ("p:1",), 64))
    assert side.get_num_new_matched_tokens(odd, 20) == (0, False)
    assert side.has_pending_push_work()  # vLLM steps until the worker sent them
    plan = side.take_plan()
    assert [(d.req_id, d.kvbeam_id, d.prefill_daemons) for d in plan.declines] == [
        ("d1", "t7", ("p:1",)), ("d2", "t8", ("p:1",)), ("d3", "t9", ("p:1",))]
    assert "50 tokens, prefill computed 45" in plan.declines[0].why
    assert "holds all 64" in plan.declines[1].why and "whole blocks" in plan.declines[2].why
    assert not side.has_pending_push_work()
    assert side.request_finished(other, []) == (False, None)  # declined already
    gone = Req("d4", list(range(40)), P.returned_params("t10", ("p:1",), 40),
               status="FINISHED_ABORTED")
    assert side.get_num_new_matched_tokens(gone, 0) == (40, True)  # never allocated
    assert side.request_finished(gone, []) == (False, None)
    assert [(d.req_id, "before decode loaded it" in d.why)
            for d in side.take_plan().declines] == [("d4", True)]
    loaded = Req("d5", list(range(40)), P.returned_params("t11", ("p:1",), 40))
    side.get_num_new_matched_tokens(loaded, 0)
    side.update_state_after_alloc(loaded, Blocks([2, 3]), 40)
    side.request_finished(loaded, [2, 3])
    assert side.take_plan().declines == []  # it loaded: nothing to decline


def test_params_and_settings_refuse_what_is_missing() -> None:
    with pytest.raises(ValueError, match="decode_daemon"):
        P.send_params({"do_remote_decode": True, "kvbeam_id": "x", "decode_daemon": ""})
    with pytest.raises(ValueError, match="kvbeam_id"):
        P.send_params({"do_remote_decode": True, "kvbeam_id": 3})
    assert P.load_params({"other": 1}) is None
    with pytest.raises(ConfigError, match="attach_socket"):
        P.Settings.from_extra({"daemon": "a"}, "m")
    with pytest.raises(ConfigError, match="unknown"):
        P.Settings.from_extra({"daemon": "a", "attach_socket": "b", "bogus": 1}, "m")


#: What vllm-router 0.1.17's PD mode sends: NIXL's fixed kv_transfer_params (the caller's
#: are replaced) and X-Request-Id ``___prefill_addr_P___decode_addr_D_UUID``, which vLLM
#: wraps as ``cmpl-<id>-<prompt>-<hex>`` (docs/vllm.md, "Behind vllm-router").
ROUTER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
ROUTER_ID = ("cmpl-___prefill_addr_10.0.0.1:8100___decode_addr_10.0.0.2:8200_"
             "0123456789abcdef0123456789abcdef-0-9f3a")
ROUTED = P.Settings(daemons=("10.0.0.1:50051",), attach_sockets=("/x.sock",), model="m",
                    decode_daemons={"10.0.0.2:8200": ("10.0.0.2:50052",)})


def test_behind_vllm_router_prefill_finds_decode_in_the_request_id() -> None:
    side = S.SchedulerSide(ROUTED, block_size=32)
    delay, back = side.request_finished(Req(ROUTER_ID, list(range(40)), dict(ROUTER_PARAMS)),
                                        [[4, 5, 6]])
    assert delay is True
    plan = side.take_plan()
    assert [(p.kvbeam_id, p.decode_daemons, p.block_ids) for p in plan.sends] == [
        (ROUTER_ID, ("10.0.0.2:50052",), (4, 5))]
    assert back == {"do_remote_prefill": True, "kvbeam_id": ROUTER_ID,
                    "prefill_daemon": "10.0.0.1:50051", "prompt_len": 40}


def test_behind_vllm_router_an_unmapped_decode_goes_to_the_decode_that_reserves_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A decode server vllm-router names that decode_daemons lacks is no longer silence:
    the send names no decode (the one that reserves it gets it), a WARNING says so once
    a minute, and every such request is counted."""
    side = S.SchedulerSide(ROUTED, block_size=32)
    other = ROUTER_ID.replace("10.0.0.2:8200", "10.0.0.3:8200")
    with caplog.at_level("WARNING"):
        for i in range(3):
            hold, back = side.request_finished(
                Req(f"{other}{i}", list(range(40)), dict(ROUTER_PARAMS)), [[4, 5]])
            assert hold and back is not None and back["kvbeam_send_tp"] == 1
    assert [(p.kvbeam_id, p.decode_daemons) for p in side.take_plan().sends] == [
        (f"{other}{i}", ()) for i in range(3)]
    warned = [r.getMessage() for r in caplog.records if "is not in" in r.getMessage()]
    assert len(warned) == 1 and "decode 10.0.0.3:8200 (named in vllm-router's request id) " \
        "is not in kv_connector_extra_config.decode_daemons" in warned[0], warned
    assert side.take_counts() == {"unmapped_decode": 3}


def test_decode_daemons_setting_is_checked() -> None:
    extra = {"daemon": "h:1", "attach_socket": "/s"}
    got = P.Settings.from_extra({**extra, "decode_daemons": {"http://10.0.0.2:8200/": "d:2"}},
                                "m")
    assert got.decode_daemons == {"10.0.0.2:8200": ("d:2",)}
    with pytest.raises(ConfigError, match="decode_daemons: a mapping of decode vLLM"):
        P.Settings.from_extra({**extra, "decode_daemons": ["d:2"]}, "m")
    with pytest.raises(ConfigError, match="decode_daemons"):
        P.Settings.from_extra({**extra, "decode_daemons": {"10.0.0.2:8200": ["d:2", 3]}}, "m")
    ranks = P.Settings.from_extra({**extra, "decode_daemons": {"10.0.0.2:8200": ["a:1", "b:2"]}},
                                  "m")
    assert ranks.decode_daemons == {"10.0.0.2:8200": ("a:1", "b:2")}
    with pytest.raises(ConfigError, match="decode_daemons"):
        P.Settings.from_extra({**extra, "decode_daemons": {"10.0.0.2:8200": 5}}, "m")


def test_explicit_params_win_over_the_router_request_id() -> None:
    explicit = {"do_remote_decode": True, "kvbeam_id": "t9", "decode_daemon": "d:9"}
    got = P.send_params(explicit, ROUTER_ID, ROUTED.decode_daemons)
    assert got == P.SendParams("t9", ("d:9",))
    assert P.router_decode(ROUTER_ID) == "10.0.0.2:8200"
    assert P.router_decode("cmpl-0123456789abcdef0123456789abcdef-0-1") is None


# ---- tensor parallelism ---------------------------------------------------------------
def test_tp_settings_name_one_daemon_and_socket_per_rank() -> None:
    got = P.Settings.from_extra({"daemon": ["h:1", "h:2"], "attach_socket": ["/a", "/b"]}, "m")
    assert (got.daemons, got.attach_sockets) == (("h:1", "h:2"), ("/a", "/b"))
    got.check_tp(2)
    with pytest.raises(ConfigError, match=r"daemon: 2 given for tensor_parallel_size 1"):
        got.check_tp(1)
    with pytest.raises(ConfigError, match=r"daemon names 2 daemon\(s\), attach_socket 1"):
        P.Settings.from_extra({"daemon": ["h:1", "h:2"], "attach_socket": "/a"}, "m")
    with pytest.raises(ConfigError, match="daemon: required"):
        P.Settings.from_extra({"daemon": [], "attach_socket": "/a"}, "m")


def test_rank_transfer_ids_and_which_ranks_pair() -> None:
    assert P.rank_transfer_id("t", 0, 1) == "t"
    assert [P.rank_transfer_id("t", d, 2) for d in range(2)] == ["t.r0", "t.r1"]
    assert list(P.decode_ranks_of(0, 1, 2)) == [0, 1]
    assert [list(P.decode_ranks_of(p, 2, 4)) for p in range(2)] == [[0, 1], [2, 3]]
    assert [P.prefill_rank_of(d, 4, 2) for d in range(4)] == [0, 0, 1, 1]
    assert [P.prefill_rank_of(d, 2, 1) for d in range(2)] == [0, 0]
    # Prefill TP above decode's: only the rank the decode rank names sends (and the
    # daemons' handshake refuses the pair).
    assert [list(P.decode_ranks_of(p, 2, 1)) for p in range(2)] == [[0], []]
    for p_tp, d_tp in ((1, 1), (1, 2), (2, 2), (2, 4), (1, 4)):
        for d in range(d_tp):
            assert d in P.decode_ranks_of(P.prefill_rank_of(d, d_tp, p_tp), p_tp, d_tp)


def test_tp_params_carry_every_rank_daemon() -> None:
    back = P.returned_params("t", ("p:1", "p:2"), 40)
    assert back["prefill_daemon"] == ["p:1", "p:2"]
    assert P.load_params(back) == P.LoadParams("t", ("p:1", "p:2"), 40)
    asked = {"do_remote_decode": True, "kvbeam_id": "t", "decode_daemon": ["d:1", "d:2"]}
    assert P.send_params(asked) == P.SendParams("t", ("d:1", "d:2"))
    with pytest.raises(ValueError, match="decode_daemon: a daemon address or a list"):
        P.send_params({**asked, "decode_daemon": ["d:1", 7]})
    routed = P.send_params({"do_remote_decode": True}, ROUTER_ID,
                           {"10.0.0.2:8200": ("d:1", "d:2")})
    assert routed == P.SendParams(ROUTER_ID, ("d:1", "d:2"))


# ---- vLLM's P/D contract: NIXL's parameters only --------------------------------------
#: What vLLM's toy proxy (and every proxy written to NixlConnector's contract) sends
#: prefill: do_remote_decode and NIXL's other keys, null; a plain uuid X-Request-Id.
NIXL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None,
               "remote_request_id": None}
TOY_ID = "cmpl-3f0c1f6e-8a43-4d8e-b1b2-54b1c7f0a9de-0-6a1b2c3d"


def test_nixls_parameters_alone_send_to_whichever_decode_reserves_the_request() -> None:
    """No kvbeam key and no decode address: prefill names the transfer after its own
    request id (the client's X-Request-Id is in it), sends it naming no decode, and
    returns it with its daemon: decode's request, given those back unchanged, reserves
    it there. Decode of prefill's TP loads; another declines (prefill sent for its own)."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    hold, back = side.request_finished(Req(TOY_ID, list(range(70)), dict(NIXL_PARAMS)),
                                       [5, 9, 2, 11])
    assert hold
    assert side.take_plan().sends == [S.Push(TOY_ID, TOY_ID, (5, 9, 2), (), 70)]
    assert back == {"do_remote_prefill": True, "kvbeam_id": TOY_ID,
                    "prefill_daemon": "127.0.0.1:7", "prompt_len": 70, "kvbeam_send_tp": 1}
    decode = S.SchedulerSide(SETTINGS, block_size=32)
    assert decode.get_num_new_matched_tokens(Req("d", list(range(70)), back), 0) == (70, True)
    tp2 = P.Settings(daemons=("a:1", "a:2"), attach_sockets=("/a", "/b"), model="m")
    other = S.SchedulerSide(tp2, block_size=32)
    assert other.get_num_new_matched_tokens(Req("e", list(range(70)), back), 0) == (0, False)
    [declined] = other.take_plan().declines
    assert "prefill named no decode and sent for a decode of TP 1, this one has TP 2" in \
        declined.why


def test_prefill_returns_no_remote_prefill_while_its_daemon_is_detached(
        caplog: pytest.LogCaptureFixture) -> None:
    """The workers report their daemon detached (vLLM's connector worker metadata): a
    send cannot happen, so prefill returns no do_remote_prefill (decode computes the
    prompt, no failed load), holds no blocks, and says so; once they report it attached
    again, sends resume."""
    side = S.SchedulerSide(SETTINGS, block_size=32)
    with caplog.at_level("WARNING"):
        side.worker_report(S.WorkerReport("the daemon on /x.sock closed the attach socket"))
        assert side.request_finished(Req("a", list(range(40)), dict(NIXL_PARAMS)),
                                     [1, 2]) == (False, None)
    assert not side.has_pending_push_work() and side.take_plan().sends == []
    assert any("request a asked for a remote decode: no transfer (prefill's kvbeam daemon "
               "is not attached: the daemon on /x.sock closed" in r.getMessage()
               for r in caplog.records)
    assert side.take_counts() == {"no_transfer_detached": 1}
    side.worker_report(S.WorkerReport(None))  # no change: still detached
    assert side.request_finished(Req("b", list(range(40)), dict(NIXL_PARAMS)),
                                 [1, 2]) == (False, None)
    side.worker_report(S.WorkerReport(""))
    hold, back = side.request_finished(Req("c", list(range(40)), dict(NIXL_PARAMS)), [1, 2])
    assert hold and back is not None


def test_a_decode_daemon_whose_pair_was_refused_gets_no_transfer_for_a_while() -> None:
    now = [100.0]
    side = S.SchedulerSide(SETTINGS, block_size=32, clock=lambda: now[0])
    named = {"do_remote_decode": True, "kvbeam_id": "t", "decode_daemon": "d:1"}
    side.worker_report(S.WorkerReport(None, {"d:1": "incompatible: block size: prefill=128, "
                                                     "decode=64"}))
    assert side.request_finished(Req("a", [1] * 40, named), [1, 2]) == (False, None)
    other = {**named, "kvbeam_id": "u", "decode_daemon": "d:2"}
    assert side.request_finished(Req("b", [1] * 40, other), [1, 2])[0]  # another decode
    now[0] += S.REFUSED_HOLD_S + 1
    assert side.request_finished(Req("c", [1] * 40, {**named, "kvbeam_id": "v"}),
                                 [1, 2])[0]  # tried again
    assert side.take_counts() == {"no_transfer_decode_refused": 1}


def test_workers_reports_merge_a_detached_rank_wins() -> None:
    up, down = S.WorkerReport(""), S.WorkerReport("gone", {"d:1": "x"})
    assert up.merged(down) == S.WorkerReport("gone", {"d:1": "x"})
    assert down.merged(S.WorkerReport(None)) == down
    assert S.WorkerReport(None).merged(S.WorkerReport(None)).detached is None


# ---- layer by layer ------------------------------------------------------------------
LAYERWISE = P.Settings(daemons=("127.0.0.1:7",), attach_sockets=("/x.sock",), model="m",
                       layerwise=True, layerwise_min_tokens=0)
SEND = {"do_remote_decode": True, "kvbeam_id": "t1", "decode_daemon": "d:1"}


def _output(new: Sequence[tuple[str, list[int], int]] = (),
            cached: Sequence[tuple[str, list[int] | None, int]] = (),
            scheduled: dict[str, int] | None = None, resumed: set[str] | None = None) -> Any:
    """vLLM's SchedulerOutput as plan_streams reads it: new requests (id, blocks,
    computed), cached ones (id, new blocks or None, computed), tokens scheduled."""
    return SimpleNamespace(
        num_scheduled_tokens=scheduled or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                            for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=resumed or set(),
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]))


def test_layerwise_streams_a_prompt_in_the_step_that_computes_its_last_tokens() -> None:
    """Chunked prefill: the prompt's blocks accumulate over its steps, and the stream
    starts in the last one (its layers go as the forward computes them); its end then
    plans the send as usual (the worker takes it as the stream's end)."""
    side = S.SchedulerSide(LAYERWISE, block_size=32)
    req = Req("a", list(range(70)), SEND)
    side.update_state_after_alloc(req, Blocks([5, 9]), 0)
    side.plan_streams(_output(new=[("a", [5, 9], 0)], scheduled={"a": 64}))
    assert side.take_plan().streams == []  # 64 of 70 tokens: not its last step
    side.plan_streams(_output(cached=[("a", [2], 64)], scheduled={"a": 6}))
    plan = side.take_plan()
    assert plan.streams == [S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)]
    hold, out = side.request_finished(req, [5, 9, 2])
    assert hold and out is not None and out["kvbeam_id"] == "t1"
    assert side.take_plan().sends == [S.Push("a", "t1", (5, 9, 2), ("d:1",), 70)]


def test_layerwise_needs_a_named_decode_and_a_resumed_request_takes_its_new_blocks() -> None:
    side = S.SchedulerSide(LAYERWISE, block_size=32)
    unnamed = Req("u", list(range(40)), {"do_remote_decode": True, "kvbeam_id": "t2"})
    side.update_state_after_alloc(unnamed, Blocks([1, 2]), 0)
    side.plan_streams(_output(new=[("u", [1, 2], 0)], scheduled={"u": 40}))
    assert side.take_plan().streams == []  # whoever reserves it gets it: sent whole
    req = Req("r", list(range(40)), SEND)
    side.update_state_after_alloc(req, Blocks([3]), 0)
    side.plan_streams(_output(new=[("r", [3], 0)], scheduled={"r": 32}))
    side.plan_streams(_output(cached=[("r", [7, 8], 0)], scheduled={"r": 40},
                              resumed={"r"}))  # preempted, then resumed elsewhere
    assert side.take_plan().streams == [S.Push("r", "t1", (7, 8), ("d:1",), 40)]
    off = S.SchedulerSide(SETTINGS, block_size=32)
    off.update_state_after_alloc(req, Blocks([3, 4]), 0)
    off.plan_streams(_output(new=[("r", [3, 4], 0)], scheduled={"r": 40}))
    assert off.take_plan().streams == []  # layerwise off


def test_a_streamed_request_that_ends_without_a_transfer_is_cancelled_and_held() -> None:
    """Its layers may be on their way: vLLM must not free its blocks before the worker
    aborted the send and it ended (prefill's daemon may still read them)."""
    side = S.SchedulerSide(LAYERWISE, block_size=32)
    req = Req("a", list(range(40)), SEND, status="FINISHED_ABORTED")
    side.update_state_after_alloc(req, Blocks([5, 9]), 0)
    side.plan_streams(_output(new=[("a", [5, 9], 0)], scheduled={"a": 40}))
    assert side.take_plan().streams
    assert side.request_finished(req, [5, 9]) == (True, None)
    assert side.has_pending_push_work()
    plan = side.take_plan()
    assert plan.cancels == ["a"] and plan.sends == []
    side.sends_finished({"a"})
    assert not side.has_pending_push_work()
    # Not streamed (its end came before its last step): nothing held, as before.
    early = Req("b", list(range(40)), SEND, status="FINISHED_ABORTED")
    side.update_state_after_alloc(early, Blocks([1]), 0)
    assert side.request_finished(early, [1]) == (False, None)
    assert side.take_plan().cancels == []


def test_layerwise_is_a_boolean_setting_with_a_minimum_prompt() -> None:
    base = {"daemon": "127.0.0.1:7", "attach_socket": "/x.sock"}
    on = P.Settings.from_extra({**base, "layerwise": True}, "m")
    assert on.layerwise and on.layerwise_min_tokens == P.LAYERWISE_MIN_TOKENS
    assert not P.Settings.from_extra(base, "m").layerwise
    assert P.Settings.from_extra({**base, "layerwise_min_tokens": 0},
                                 "m").layerwise_min_tokens == 0
    with pytest.raises(ConfigError, match="layerwise: true or false"):
        P.Settings.from_extra({**base, "layerwise": "yes"}, "m")
    with pytest.raises(ConfigError, match="layerwise_min_tokens: a token count"):
        P.Settings.from_extra({**base, "layerwise_min_tokens": -1}, "m")


def test_a_prompt_under_the_minimum_goes_whole() -> None:
    """Its whole transfer is short: pieces would cost its forward more than they save."""
    side = S.SchedulerSide(P.Settings(daemons=("127.0.0.1:7",), attach_sockets=("/x.sock",),
                                      model="m", layerwise=True, layerwise_min_tokens=64),
                           block_size=32)
    short, long = Req("s", list(range(63)), SEND), Req("l", list(range(64)), SEND)
    for req, blocks in ((short, [1, 2]), (long, [3, 4])):
        side.update_state_after_alloc(req, Blocks(blocks), 0)
    side.plan_streams(_output(new=[("s", [1, 2], 0), ("l", [3, 4], 0)],
                              scheduled={"s": 63, "l": 64}))
    assert [p.req_id for p in side.take_plan().streams] == ["l"]
