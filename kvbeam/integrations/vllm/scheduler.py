"""The connector's scheduler side: plan decode's loads and prefill's sends, hold the blocks.

Runs in vLLM's scheduler process and makes no kvbeam call: each step's loads (decode:
the blocks vLLM allocated for a remote prefill) and sends (prefill: a finished
prompt's blocks, held) go to the workers in the step's connector metadata, and the
worker that attached the KV cache reserves and sends them over its engine channel
(:mod:`kvbeam.integrations.vllm.worker`). A refused reserve or send shows there as a
failed transfer. vLLM objects are duck-typed here (``Any``): this module imports no
vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvbeam.integrations.vllm.params import (
    DO_REMOTE_DECODE,
    LoadParams,
    SendParams,
    Settings,
    blocks_for,
    load_params,
    returned_params,
    send_params,
)

log = logging.getLogger(__name__)
P = TypeVar("P")

#: Seconds after a worker reported that a send to a decode daemon could not happen (the
#: pair's handshake was refused, the daemon unreachable) during which prefill's requests
#: for that daemon run without a transfer: no ``do_remote_prefill`` to decode, which
#: computes the prompt itself, instead of a load that fails. Then one is tried again.
REFUSED_HOLD_S = 30.0
#: Seconds between two WARNINGs about the same decode server missing from
#: ``decode_daemons`` (each such request is counted).
UNMAPPED_WARNING_S = 60.0


@dataclass(frozen=True)
class WorkerReport:
    """What the workers tell the scheduler side (through vLLM's connector worker
    metadata, :mod:`kvbeam.integrations.vllm.connector`): why their daemon is not
    attached now (``detached``; "" attached; None: no change since the last report),
    and the decode daemons a send to which could not happen, with why."""

    detached: str | None = None
    refused: dict[str, str] = field(default_factory=dict)

    def merged(self, other: WorkerReport) -> WorkerReport:
        """Both ranks' reports: a rank detached counts (the instance cannot send)."""
        detached = self.detached if other.detached is None else (
            other.detached if self.detached is None else (self.detached or other.detached))
        return WorkerReport(detached, {**self.refused, **other.refused})


@dataclass(frozen=True)
class Load:
    """A decode request whose prompt KV lands in ``block_ids`` (``failed``: never will)."""

    req_id: str
    kvbeam_id: str
    block_ids: tuple[int, ...]
    #: Every prefill TP rank's daemon, rank order (each decode rank picks its own).
    prefill_daemons: tuple[str, ...] = ()
    seq_len: int = 0
    failed: bool = False
    #: Leading blocks of the prompt decode's prefix cache holds (``block_ids`` are the
    #: rest): prefill writes only those after them.
    kv_skip: int = 0


@dataclass(frozen=True)
class Decline:
    """A decode request that will not load prefill's KV: its prefill is told at once."""

    req_id: str
    kvbeam_id: str
    prefill_daemons: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Push:
    """A prefill request whose prompt KV in ``block_ids`` goes to ``decode_daemons`` (one
    per decode TP rank, rank order)."""

    req_id: str
    kvbeam_id: str
    block_ids: tuple[int, ...]
    decode_daemons: tuple[str, ...]
    seq_len: int


@dataclass
class StepPlan:
    """What the scheduler tells the workers at one step (vLLM's connector metadata body)."""

    loads: list[Load] = field(default_factory=list)
    #: Prefill requests whose blocks are held for a send.
    sends: list[Push] = field(default_factory=list)
    #: Decode requests that will not load: prefill frees their blocks now.
    declines: list[Decline] = field(default_factory=list)
    #: Prefill requests whose prompt ends in this step's forward: sent layer by layer
    #: as it computes them (``Settings.layerwise``; their ``sends`` entry follows).
    streams: list[Push] = field(default_factory=list)
    #: Streamed requests that ended without a transfer (aborted, or no longer
    #: sendable): the worker aborts their send, and vLLM frees their blocks once it
    #: ended (prefill's writes from them drained).
    cancels: list[str] = field(default_factory=list)


@dataclass
class _Prompt:
    """A prefill request that asked for a layer-by-layer send, while vLLM computes its
    prompt: its send, its length and the blocks scheduled for it so far."""

    params: SendParams
    prompt_len: int
    blocks: list[int] = field(default_factory=list)


class SchedulerSide:
    """Per-request decisions of vLLM's scheduler, in vLLM's call order."""

    def __init__(self, settings: Settings, block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.block_size = block_size
        self.clock = clock
        self._plan = StepPlan()
        self._sending: set[str] = set()
        #: Layer by layer: prompts being computed, and those streamed (no end yet).
        self._prompts: dict[str, _Prompt] = {}
        self._streamed: set[str] = set()
        self._loading: set[str] = set()
        self._declined: set[str] = set()
        #: Why the workers' daemon is not attached ("": attached), from their reports.
        self._detached = ""
        #: Decode daemons a send to could not happen: daemon -> (until, why).
        self._refused: dict[str, tuple[float, str]] = {}
        self._unmapped_warned: dict[str, float] = {}
        #: Events since :meth:`take_counts`, by name (vLLM's connector stats, a metric in
        #: vLLM's /metrics): requests that asked for a transfer and move nothing
        #: (``no_transfer_*``, ``declined``), and ``unmapped_decode``.
        self.counts: Counter[str] = Counter()

    # ---- decode ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Decode: the prompt's tokens past the local prefix-cache hit come from
        prefill, loaded asynchronously (only the blocks this cache lacks move).

        A request that will not load (its prompt is not the one prefill computed, the
        hit covers the whole prompt, or it is not whole blocks) is declined: prefill
        frees its blocks now, and vLLM computes what is missing here.
        """
        p = _checked(load_params, request)
        rid = request.request_id
        if p is None or rid in self._loading or rid in self._declined:
            return 0, False
        prompt_len = len(request.prompt_token_ids)
        why = ""
        tp = len(self.settings.daemons)
        if p.send_tp and p.send_tp != tp:
            why = (f"prefill named no decode and sent for a decode of TP {p.send_tp}, this "
                   f"one has TP {tp}: run both at the same TP, or name decode's daemons "
                   "(decode_daemon, decode_daemons)")
        elif p.prompt_len and p.prompt_len != prompt_len:
            why = (f"its prompt has {prompt_len} tokens, prefill computed {p.prompt_len}: "
                   "prefill's KV is not this prompt's")
        elif num_computed_tokens >= prompt_len:
            why = f"its prefix cache holds all {prompt_len} prompt tokens"
        elif num_computed_tokens % self.block_size:
            why = (f"its prefix-cache hit of {num_computed_tokens} tokens is not whole blocks "
                   f"of {self.block_size}")
        if why:
            self._decline(rid, p, why)
            return 0, False
        if num_computed_tokens:
            log.info("request %s: %d tokens (%d blocks) cached locally; loading the other %d",
                     rid, num_computed_tokens, num_computed_tokens // self.block_size,
                     prompt_len - num_computed_tokens)
        return prompt_len - num_computed_tokens, True

    def _decline(self, req_id: str, p: LoadParams, why: str) -> None:
        log.warning("request %s: not loading transfer %s (%s): decode computes the prompt; "
                    "prefill frees its blocks now", req_id, p.kvbeam_id, why)
        self.counts["declined"] += 1
        self._declined.add(req_id)
        self._plan.declines.append(Decline(req_id, p.kvbeam_id, p.prefill_daemons, why))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Decode: the blocks vLLM just allocated are the request's landing place (the
        worker reserves them on its daemon). Prefill, layer by layer: a request that
        asked for a send to a named decode is followed while its prompt is computed
        (:meth:`plan_streams`)."""
        if self.settings.layerwise:
            self._follow_prompt(request)
        p = _checked(load_params, request)
        if p is None or num_external_tokens == 0:
            return
        seq_len = len(request.prompt_token_ids)
        # vLLM's blocks are the request's all: the locally cached ones first.
        skip = (seq_len - num_external_tokens) // self.block_size
        ids = tuple(int(b) for b in blocks.get_block_ids()[0][skip:blocks_for(
            seq_len, self.block_size)])
        self._loading.add(request.request_id)
        self._plan.loads.append(Load(request.request_id, p.kvbeam_id, ids, p.prefill_daemons,
                                     seq_len, kv_skip=skip))

    # ---- prefill -----------------------------------------------------------------
    def _follow_prompt(self, request: Any) -> None:
        """Follow a prefill request's prompt when it may stream: at least
        ``layerwise_min_tokens`` long, asking for a send whose decode is named (a send to
        whichever decode reserves it goes whole)."""
        rid = request.request_id
        if rid in self._prompts:
            return
        prompt_len = len(request.prompt_token_ids)
        if prompt_len < self.settings.layerwise_min_tokens:
            return  # its whole transfer is short: pieces would cost more than they save
        p = _checked(lambda params: send_params(params, str(rid),
                                                self.settings.decode_daemons), request)
        if p is not None and p.decode_daemons:
            self._prompts[rid] = _Prompt(p, prompt_len)

    def plan_streams(self, scheduler_output: Any) -> None:
        """The step's scheduled prompts (vLLM's ``SchedulerOutput``): their blocks so
        far, and a stream for each whose last prompt tokens this step computes."""
        if not self._prompts:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = self._prompts.get(new.req_id)
            if prompt is not None:
                prompt.blocks = [int(b) for b in new.block_ids[0]]
                self._maybe_stream(new.req_id, prompt, int(new.num_computed_tokens),
                                   int(scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:  # a resumed request's are all of its blocks
                ids = [int(b) for b in added[0]]
                prompt.blocks = ids if rid in cached.resumed_req_ids else prompt.blocks + ids
            self._maybe_stream(rid, prompt, int(cached.num_computed_tokens[i]),
                               int(scheduled.get(rid, 0)))

    def _maybe_stream(self, rid: str, prompt: _Prompt, computed: int, scheduled: int) -> None:
        """This step computes the prompt's last tokens: stream it (unless a send could
        not happen now: then its end decides, as for a whole send)."""
        if computed + scheduled < prompt.prompt_len:
            return
        del self._prompts[rid]
        if self._cannot_send(prompt.params) is not None:
            return
        p = prompt.params
        blocks = tuple(prompt.blocks[:blocks_for(prompt.prompt_len, self.block_size)])
        self._streamed.add(rid)
        self._plan.streams.append(Push(rid, p.kvbeam_id, blocks, p.decode_daemons,
                                       prompt.prompt_len))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the prompt's blocks; the worker sends them (decode may reserve
        before or after: the send waits for the reservation, ``--send-wait-s``).

        Decode: a request that ends without having loaded (aborted while it waited) is
        declined, so prefill frees its blocks now."""
        rid = request.request_id
        self._prompts.pop(rid, None)
        streamed = rid in self._streamed
        self._streamed.discard(rid)
        loaded = rid in self._loading or rid in self._declined
        self._loading.discard(rid)
        self._declined.discard(rid)
        p_load = None if loaded else _checked(load_params, request)
        if p_load is not None:
            self._decline(rid, p_load, f"it ended ({getattr(request, 'status', '?')}) "
                                       "before decode loaded it")
            self._declined.discard(rid)
            return False, None
        p = _checked(lambda params: send_params(params, str(rid),
                                                self.settings.decode_daemons), request)
        if p is None:
            if (request.kv_transfer_params or {}).get(DO_REMOTE_DECODE):
                self.counts["no_transfer_malformed_params"] += 1  # _checked said why
            return self._cancelled(rid, streamed)
        if _aborted(request):
            return self._cancelled(rid, streamed)
        why = self._cannot_send(p)
        if why:
            log.warning("request %s asked for a remote decode: no transfer (%s); decode gets "
                        "no do_remote_prefill and computes the prompt itself", rid, why[1])
            self.counts[f"no_transfer_{why[0]}"] += 1
            return self._cancelled(rid, streamed)
        if p.unmapped:
            self._unmapped(rid, p.unmapped)
        ids = _first_group(block_ids)
        seq_len = len(request.prompt_token_ids)
        source = tuple(ids[:blocks_for(seq_len, self.block_size)])
        self._sending.add(rid)
        self._plan.sends.append(Push(rid, p.kvbeam_id, source, p.decode_daemons, seq_len))
        return True, returned_params(p.kvbeam_id, self.settings.daemons, seq_len,
                                     named_decode=bool(p.decode_daemons))

    def _cancelled(self, rid: str, streamed: bool) -> tuple[bool, dict[str, Any] | None]:
        """No transfer for a request that ended: nothing held, unless it was streamed:
        then its send is aborted and its blocks held until that ended (prefill's
        daemon may still read them)."""
        if not streamed:
            return False, None
        self._sending.add(rid)
        self._plan.cancels.append(rid)
        return True, None

    def _cannot_send(self, p: SendParams) -> tuple[str, str] | None:
        """(counted reason, why) a send cannot happen, from what the workers reported:
        their daemon is not attached, or a decode daemon it names refused the pair or
        was unreachable moments ago; None: send."""
        if self._detached:
            return "detached", f"prefill's kvbeam daemon is not attached: {self._detached}"
        now = self.clock()
        for daemon in p.decode_daemons:
            held = self._refused.get(daemon)
            if held is not None and held[0] > now:
                return "decode_refused", (f"a send to decode daemon {daemon} failed "
                                          f"{REFUSED_HOLD_S - (held[0] - now):.0f} s ago: "
                                          f"{held[1]}")
            if held is not None:
                del self._refused[daemon]  # try it again
        return None

    def _unmapped(self, rid: str, decode: str) -> None:
        """vllm-router named a decode server ``decode_daemons`` lacks: sent to whichever
        decode reserves it (that server, as it will), counted, a WARNING a minute."""
        self.counts["unmapped_decode"] += 1
        now = self.clock()
        if now - self._unmapped_warned.get(decode, -UNMAPPED_WARNING_S) >= UNMAPPED_WARNING_S:
            self._unmapped_warned[decode] = now
            log.warning("request %s: decode %s (named in vllm-router's request id) is not in "
                        "kv_connector_extra_config.decode_daemons (known: %s): sending to "
                        "whichever decode daemon reserves the request instead (the decode "
                        "that server attached to); decode_daemons is not needed, drop it or "
                        "add every decode server", rid, decode,
                        ", ".join(sorted(self.settings.decode_daemons)) or "none")

    def worker_report(self, report: WorkerReport) -> None:
        """What the workers reported this step (vLLM's connector worker metadata)."""
        if report.detached is not None and report.detached != self._detached:
            log.warning("prefill's kvbeam daemon %s", f"is not attached: {report.detached}: "
                        "requests that ask for a remote decode get no transfer until it is"
                        if report.detached else "is attached again")
            self._detached = report.detached
        until = self.clock() + REFUSED_HOLD_S
        for daemon, why in report.refused.items():
            log.warning("a send to decode daemon %s could not happen (%s): for %.0f s "
                        "prefill's requests for it get no transfer (decode computes them)",
                        daemon, why, REFUSED_HOLD_S)
            self._refused[daemon] = (until, why)

    def take_counts(self) -> dict[str, int]:
        """The events counted since the last call, by name; then zero."""
        out, self.counts = dict(self.counts), Counter()
        return out

    def sends_finished(self, req_ids: set[str] | None) -> None:
        """The workers reported these sends ended: vLLM frees their blocks now."""
        self._sending -= req_ids or set()

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while prefill holds blocks for a send (get_finished frees
        them), and until this side's declines and cancels went to the worker."""
        return bool(self._sending) or bool(self._plan.declines) or bool(self._plan.cancels)

    def take_plan(self) -> StepPlan:
        """This step's plan; the next step starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan


def _checked(read: Callable[[Any], P | None], request: Any) -> P | None:
    """``read(request.kv_transfer_params)``, or None (no transfer) where they are malformed.

    The parameters come from the API caller, and vLLM runs the connector inside its
    scheduler loop, where an exception stops the engine for every request: a request
    with malformed kvbeam keys runs without a transfer instead (decode computes its
    prompt itself; prefill sends nothing).
    """
    try:
        return read(request.kv_transfer_params)
    except ValueError as exc:
        log.warning("request %s: %s; no transfer for it", request.request_id, exc)
        return None


def _aborted(request: Any) -> bool:
    return "ABORTED" in str(getattr(request, "status", ""))


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes one list, or one list per KV cache group (then the first: full attention)."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids]
