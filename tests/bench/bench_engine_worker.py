"""One engine process of the engine-channel benchmark (tests/bench/bench_engine_channel.py).

``python -m tests.bench.bench_engine_worker --socket S --config C --role prefill|decode
[--pushes final|all]``: allocates memfd pools (EnginePools), attaches (by default with
``pushes="final"``, as the vLLM and sglang integrations do), prints ``attached``, then serves the
router's commands on stdin, one answer line each (times are CLOCK_MONOTONIC seconds,
comparable across processes):

- decode: ``reserve ID PREFILL_ADDR`` -> ``ok``; ``done ID`` (wait Success, release)
  -> ``t SECONDS``
- prefill: ``send ID DECODE_ADDR`` -> ``t SECONDS`` (just before the send); ``wait ID`` ->
  the state; ``poll N`` -> ``poll_us MEDIAN`` (N polls of the last request, each timed)
- either: ``flow PREFIX N INFLIGHT PEER_ADDR`` -> ``flow START END FAILED``: requests
  PREFIX0..PREFIX(N-1), at most INFLIGHT at once, completions read with poll_many()
- ``grpc`` -> whether gRPC was imported; ``exit``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import yaml

from kvbeam.engine import EnginePools, KVPoll, Receiver, Sender, attach
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import PUSH_MODES
from kvbeam.states import TransferState

SEQ = 128


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--pushes", choices=PUSH_MODES, default="final",
                    help="which state changes the daemon pushes (kvbeam.engine.attach)")
    args = ap.parse_args()
    with open(args.config) as f:
        config = SideConfig.from_mapping(yaml.safe_load(f), args.config)
    pools = EnginePools(config)
    pools.fill_pattern(1 if args.role == "prefill" else 2)
    att = attach(args.socket, pools, pushes=args.pushes)
    channel = att.channel
    assert channel is not None
    slots = list(range(config.target.num_req_slots))
    used = {b.index_kind for b in build_side_layout(config).flat_buffers}

    def slot_lists(slot: int) -> tuple[list[int], dict[str, list[int]]]:
        idx = {k.value: v.tolist() for k, v in request_indices(config.target, slot,
                                                               SEQ).items() if k in used}
        return idx.pop("KV_PAGES"), idx

    # Each slot's lists built once, at start: an engine has its page table at hand, and
    # building them per request was a third of this process's CPU, taken from the
    # daemons on a small host (the gRPC phase's lists are built once too).
    by_slot = {slot: slot_lists(slot) for slot in slots}
    lists = by_slot.__getitem__

    reqs: dict[str, Sender | Receiver] = {}
    held: dict[str, int] = {}
    last: Sender | None = None
    print("attached", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        op = cmd[0]
        if op == "reserve":
            slot = slots.pop()
            held[cmd[1]] = slot
            r = Receiver(att, cmd[1], cmd[2])
            kv, st = lists(slot)
            r.send_metadata(kv, st, seq_len=SEQ)
            reqs[cmd[1]] = r
            print("ok", flush=True)
        elif op == "done":
            r2 = reqs.pop(cmd[1])
            state = r2.wait(60)
            t = time.monotonic()
            assert isinstance(r2, Receiver)
            if state is KVPoll.Success:
                r2.release()
            slots.append(held.pop(cmd[1]))
            print(f"t {t:.9f} {state.name}", flush=True)
        elif op == "send":
            s = Sender(att, cmd[1], cmd[2])
            kv, st = lists(0)
            t = time.monotonic()
            s.send(kv, st, seq_len=SEQ)
            reqs[cmd[1]] = last = s
            print(f"t {t:.9f}", flush=True)
        elif op == "wait":
            print(reqs.pop(cmd[1]).wait(60).name, flush=True)
        elif op == "poll":
            assert last is not None
            times = []
            for _ in range(int(cmd[1])):
                t0 = time.perf_counter_ns()
                last.poll()
                times.append(time.perf_counter_ns() - t0)
            print(f"poll_us {statistics.median(times) / 1000:.3f}", flush=True)
        elif op == "flow":
            prefix, n, inflight, peer = cmd[1], int(cmd[2]), int(cmd[3]), cmd[4]
            live: dict[str, Sender | Receiver] = {}
            failed = 0
            nxt = 0
            start = time.monotonic()
            channel.poll_many()
            while nxt < n or live:
                with channel.batch():  # every start of this step in one write
                    while nxt < n and len(live) < inflight:
                        rid = f"{prefix}{nxt}"
                        nxt += 1
                        if args.role == "decode":
                            slot = slots.pop()
                            held[rid] = slot
                            rr = Receiver(att, rid, peer)
                            kv, st = lists(slot)
                            rr.send_metadata(kv, st, seq_len=SEQ)
                            live[rid] = rr
                        else:
                            ss = Sender(att, rid, peer)
                            kv, st = lists(nxt % len(slots))
                            ss.send(kv, st, seq_len=SEQ)
                            live[rid] = ss
                for ev in channel.events(timeout=30):
                    req = live.get(ev.request_id)
                    if req is None or not ev.state.terminal:
                        continue
                    del live[ev.request_id]
                    if ev.state is TransferState.SUCCESS:
                        if isinstance(req, Receiver):
                            req.release()
                    else:
                        failed += 1
                    if isinstance(req, Receiver):
                        slots.append(held.pop(ev.request_id))
                    break
            print(f"flow {start:.9f} {time.monotonic():.9f} {failed}", flush=True)
        elif op == "grpc":
            print(f"grpc {'grpc' in sys.modules}", flush=True)
        elif op == "exit":
            break
    att.close()
    pools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
