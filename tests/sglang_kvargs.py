"""sglang's ``KVArgs`` for a reference engine's pools, without gRPC or the daemons' helpers
(an engine process's own imports: tests/host/test_sglang_auth.py checks it imports no
gRPC, so this module must not either)."""

from __future__ import annotations

from typing import Any

from kvbeam.engine import EnginePools


def kvargs_for(pools: EnginePools) -> Any:
    """sglang's ``KVArgs`` for ``pools``: pointers, lengths, item lengths, state types."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    from kvbeam.integrations.sglang.kvargs import SGLANG_STATE_TYPE

    def describe(comp_index: int) -> tuple[list[int], list[int], list[int]]:
        bufs = pools.layout.components[comp_index].buffers
        return ([int(pools.buffer_array(b).ctypes.data) for b in bufs],
                [b.nbytes for b in bufs], [b.item_len for b in bufs])

    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = describe(0)
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = \
        [], [], [], []
    for i, comp in enumerate(pools.layout.components[1:], start=1):
        assert comp.state_type is not None
        ptrs, lens, items = describe(i)
        args.state_types.append(StateType(SGLANG_STATE_TYPE[comp.state_type]))
        args.state_data_ptrs.append(ptrs)
        args.state_data_lens.append(lens)
        args.state_item_lens.append(items)
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.page_size = pools.config.target.page_size
    args.ib_device = ""
    args.num_draft_entries = 1 if pools.config.draft is not None else 0
    return args
