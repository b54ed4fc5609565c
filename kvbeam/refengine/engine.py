"""The reference engine: prefill, adopt moved state, decode; all KV in kvbeam's buffers.

A prefill engine runs a prompt token by token, writing every layer's KV rows,
compressed entries and compression states into its side's pools at indices from
its own shuffled allocator, and reports the request's index lists. A decode engine
*adopts* a request: it allocates its own (different) indices for the request's
length and returns them as the destination lists; once the state has arrived
there, it continues generation from the pools alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbeam.errors import PlanError
from kvbeam.pools.types import IndexKind
from kvbeam.refengine.allocator import Allocation, Allocator, IndexArray
from kvbeam.refengine.layers import Where, block_step
from kvbeam.refengine.memory import SideMemory, layer_views
from kvbeam.refengine.model import ReferenceModel, rms

IndexLists = dict[IndexKind, IndexArray]


@dataclass
class Request:
    """A request the engine holds: ``seq_len`` tokens in the pools, ``next_token`` not yet."""

    alloc: Allocation
    seq_len: int
    next_token: int


@dataclass
class PrefillResult:
    """What prefill hands the transfer and the decode side."""

    index_lists: IndexLists
    seq_len: int
    first_token: int
    logits: torch.Tensor
    proposals: list[int]


@dataclass
class Continuation:
    """Decoded tokens, their logits ``[k, vocab]`` and the draft's proposals per step.

    ``proposals[i]`` are the draft's guesses for the tokens after ``tokens[i]``;
    ``accepted[i]`` how many of them greedy verification would accept (counted
    against the tokens this continuation produced).
    """

    tokens: list[int]
    logits: torch.Tensor
    proposals: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def _accepted(tokens: list[int], proposals: list[list[int]]) -> list[int]:
    out = []
    for i, props in enumerate(proposals):
        n = 0
        for j, tok in enumerate(props):
            if i + 1 + j >= len(tokens) or tokens[i + 1 + j] != tok:
                break
            n += 1
        out.append(n)
    return out


class Engine:
    """One engine process's worth of state: model, side memory, allocator and requests."""

    def __init__(self, model: ReferenceModel, side: SideMemory, allocator_seed: int) -> None:
        self.model = model
        self.side = side
        cfg = model.config
        self.views = layer_views(side, "target", cfg.target)
        self.draft_views = (layer_views(side, "draft", cfg.draft)
                            if cfg.draft is not None and model.draft is not None else None)
        self.allocator = Allocator(cfg.target, allocator_seed)
        self.requests: dict[str, Request] = {}
        spec = cfg.target
        self.num_proposals = max(spec.num_draft_tokens,
                                 cfg.draft.num_draft_tokens if cfg.draft else 0, 1)

    # ---- per-request calls a scheduler makes ---------------------------------------
    def prefill(self, request_id: str, prompt: list[int]) -> PrefillResult:
        """Run ``prompt``; its state stays in the pools at this engine's own indices."""
        if not prompt:
            raise PlanError("reference engine: empty prompt")
        self._check_new(request_id, len(prompt))
        req = Request(self.allocator.new(), 0, prompt[0])
        self.requests[request_id] = req
        logits = torch.zeros(0)
        proposals: list[int] = []
        for p, tok in enumerate(prompt):
            h, logits = self._target(req, tok, p)
            nxt = prompt[p + 1] if p + 1 < len(prompt) else int(torch.argmax(logits))
            if self.draft_views is not None:
                last = p + 1 == len(prompt)
                proposals = self._draft(req, h, nxt, p, self.num_proposals if last else 1)
            req.seq_len, req.next_token = p + 1, nxt
        return PrefillResult(self.request_index_lists(request_id), req.seq_len,
                             req.next_token, logits, proposals)

    def adopt(self, request_id: str, seq_len: int, next_token: int) -> IndexLists:
        """Take over a request of ``seq_len`` tokens whose state will arrive; return where.

        The returned lists are the destination of the transfer (this engine's own
        indices). ``next_token`` is prefill's first output token (sent as metadata).
        """
        self._check_new(request_id, seq_len)
        a = self.allocator.new()
        self.allocator.cover(a, seq_len)
        self.requests[request_id] = Request(a, seq_len, next_token)
        return self.request_index_lists(request_id)

    def request_index_lists(self, request_id: str) -> IndexLists:
        """The request's index lists per kind (the draft uses the target's lists)."""
        req = self.requests[request_id]
        return self.allocator.index_lists(req.alloc, req.seq_len)

    def decode(self, request_id: str, k: int) -> Continuation:
        """Generate ``k`` tokens greedily from the request's state in the pools."""
        req = self.requests[request_id]
        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        proposals: list[list[int]] = []
        for _ in range(k):
            p = req.seq_len
            h, lg = self._target(req, req.next_token, p)
            nxt = int(torch.argmax(lg))
            if self.draft_views is not None:
                proposals.append(self._draft(req, h, nxt, p, self.num_proposals))
            tokens.append(nxt)
            logits.append(lg)
            req.seq_len, req.next_token = p + 1, nxt
        return Continuation(tokens, torch.stack(logits), proposals, _accepted(tokens, proposals))

    def release(self, request_id: str) -> None:
        """Free a request's indices."""
        self.allocator.release(self.requests.pop(request_id).alloc)

    def _check_new(self, request_id: str, seq_len: int) -> None:
        if request_id in self.requests:
            raise PlanError(f"reference engine: request {request_id!r} already exists")
        limit = self.model.config.target.max_context_len
        if not 0 < seq_len <= limit:
            raise PlanError(f"reference engine: length {seq_len} outside 1..{limit}")

    # ---- model ------------------------------------------------------------------------
    def _target(self, req: Request, token: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.allocator.cover(req.alloc, p + 1)
        m = self.model
        w = Where(m.config.target, req.alloc, m.shape, m.rope[m.config.target.head_dim])
        x = m.embed[token]
        for lw, v in zip(m.layers, self.views, strict=True):
            x = block_step(lw, v, w, x, p)
        return x, m.logits(x)

    def _draft(self, req: Request, h: torch.Tensor, nxt: int, p: int, n: int) -> list[int]:
        """NextN: from (target hidden at ``p``, token ``p + 1``) propose ``n`` tokens.

        The first step writes the draft's KV row for ``p`` into the draft component;
        the chained steps keep their rows in scratch (never in the pools).
        """
        m, dv = self.model, self.draft_views
        assert m.draft is not None and dv is not None and m.config.draft is not None
        w = Where(m.config.draft, req.alloc, m.shape, m.rope[m.config.draft.head_dim])
        scratch: list[list[torch.Tensor]] = [[] for _ in m.draft.layers]
        out: list[int] = []
        x = rms(h) @ m.draft.proj_h + rms(m.embed[nxt]) @ m.draft.proj_e
        for j in range(n):
            for i, (lw, v) in enumerate(zip(m.draft.layers, dv, strict=True)):
                x = block_step(lw, v, w, x, p + j, scratch=scratch[i] if j else None,
                               pool_end=p)
            tok = int(torch.argmax(m.logits(x)))
            out.append(tok)
            x = rms(x) @ m.draft.proj_h + rms(m.embed[tok]) @ m.draft.proj_e
        return out
