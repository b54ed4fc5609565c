"""The vLLM connector's request parameters and scheduler side, without vLLM (fakes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvbeam.errors import ConfigError
from kvbeam.integrations.vllm import params as P
from kvbeam.integrations.vllm import scheduler as S

SETTINGS = P.Settings(daemon="127.0.0.1:7", attach_socket="/x.sock", model="m")


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
    assert side.take_plan().sends == [S.Push("a", "t1", (5, 9, 2), "d:1", 70)]
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
    req = Req("b", list(range(45)), P.returned_params("t2", "p:1", 45))
    assert side.get_num_new_matched_tokens(req, 0) == (45, True)
    side.update_state_after_alloc(req, Blocks([7, 3]), 45)
    assert side.take_plan().loads == [S.Load("b", "t2", (7, 3), "p:1", 45)]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: no reload


def test_decode_with_a_local_prefix_computes_itself() -> None:
    side = S.SchedulerSide(SETTINGS, block_size=32)
    req = Req("c", list(range(45)), P.returned_params("t3", "p:1", 45))
    assert side.get_num_new_matched_tokens(req, 32) == (0, False)


def test_params_and_settings_refuse_what_is_missing() -> None:
    with pytest.raises(ValueError, match="decode_daemon"):
        P.send_params({"do_remote_decode": True, "kvbeam_id": "x"})
    assert P.load_params({"other": 1}) is None
    with pytest.raises(ConfigError, match="attach_socket"):
        P.Settings.from_extra({"daemon": "a"}, "m")
    with pytest.raises(ConfigError, match="unknown"):
        P.Settings.from_extra({"daemon": "a", "attach_socket": "b", "bogus": 1}, "m")
