"""A stand-in engine that drives its requests over the engine channel (no gRPC).

Run as a fresh process (``python -m tests.channel_engine --socket S --config C``): it
allocates memfd pools (EnginePools), fills them with ``--seed``'s pattern, attaches
(``--pushes``: which state changes the daemon pushes, default ``all``; ``--reattach``:
attach again when the daemon goes away, with a short backoff), prints
``attached INSTANCE`` and serves commands on stdin, one answer line each:

- ``reserve RID SEQ PREFILL_ADDR LIST_SEED [SKIP]``: Receiver.send_metadata at random
  lists; with SKIP, only the KV pages from position SKIP on (``kv_skip``: the engine
  holds the first SKIP, a prefix cache)
- ``decline RID PREFILL_ADDR``: Receiver.decline (decode will not load RID)
- ``send RID SEQ DECODE_ADDR LIST_SEED``: Sender.send at random lists (DECODE_ADDR ``-``:
  none, the decode whose reservation names RID gets it)
- ``chunk RID SEQ DECODE_ADDR LIST_SEED OFFSET START END FINAL``: Sender.send_chunk of
  tokens [START, END) with the request's KV pages from position OFFSET up to the chunk's
  last page (FINAL 1: all the rest, and the other lists)
- ``layers RID SEQ DECODE_ADDR LIST_SEED LAYERS``: Sender.send_chunk ready in the model's
  layers [0, LAYERS): the first gives every KV page of the request, later ones none
  (their pages are those given); the final chunk is ``chunk`` with FINAL 1
- ``prefill RID SEQ DECODE_ADDR LIST_SEED LAYERS COMPUTE_MS WAY``: a prompt of LAYERS
  layers computed COMPUTE_MS each (a sleep), sent ``layerwise`` (after each layer but
  the last a piece ready in the layers so far, the first giving every KV page; after
  the last the final chunk, as vLLM's connector sends its last layer's frame) or
  ``whole`` (nothing until the last layer is computed, then one ``send``); then waits
  (120 s) for prefill's end. Answers ``prefilled RID T0 T1 W0 STATE``: CLOCK_MONOTONIC
  seconds (comparable across processes) just before the final frame, and when the
  wait for prefill's end returned; W0 is T0's wall-clock time (to set beside the
  daemons' log lines)
- ``stamp RID``: a thread waits (120 s) for RID's end and notes the CLOCK_MONOTONIC time
  its wait returned (woken by the pushed STATE); ``stamped RID`` joins it and answers
  ``STATE T`` (the KVPoll name, and the failure, if any, before T)
- ``poll RID`` / ``wait RID SECONDS``: the KVPoll name (and the failure, if any)
- ``abort RID`` / ``release RID``
- ``reuse RID NEW SEQ PREFILL_ADDR``: abort RID, wait for its pushed terminal state,
  and at once reserve NEW at RID's very lists (an engine whose allocator frees a
  request's pages on Failed and hands them to the next); answers RID's state
- ``events``: every change since the last call (poll_many), ``RID:STATE`` each
- ``digests RID [FROM [TO]]``: CRC32C of each buffer's items at the request's lists
  (its KV pages from position FROM up to TO only)
- ``heads RID FIRST COUNT``: CRC32C of each KV buffer's items at the request's lists,
  only the bytes of the pool's heads [FIRST, FIRST + COUNT) (a paged pool: heads are a
  block's outermost dimension)
- ``grpc``: whether gRPC was ever imported in this process
- ``state``: ``state ATTACHED REATTACHES INSTANCE`` (the attachment's; ATTACHED 1 or 0)
- ``refusal RID``: ``refusal TEXT``, the daemon's last refusal of one of RID's frames
- ``exit``
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import crc32c
import numpy as np
import yaml

from kvbeam.engine import EnginePools, KVPoll, Receiver, Sender, attach
from kvbeam.engine.attach import Reattach
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig
from tests.engine_lists import random_lists


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pushes", choices=("all", "final"), default="all")
    ap.add_argument("--reattach", action="store_true")
    args = ap.parse_args()
    with open(args.config) as f:
        config = SideConfig.from_mapping(yaml.safe_load(f), args.config)
    layout = build_side_layout(config)
    pools = EnginePools(config)
    pools.fill_pattern(args.seed)
    att = attach(args.socket, pools, pushes=args.pushes,
                 reattach=Reattach(first_delay_s=0.05, max_delay_s=0.5) if args.reattach
                 else False)
    assert att.channel is not None
    print(f"attached {att.instance_id}", flush=True)
    requests: dict[str, Sender | Receiver] = {}
    lists: dict[str, dict[str, list[int]]] = {}
    stamps: dict[str, tuple[threading.Thread, list[str]]] = {}

    def answer(req: Sender | Receiver, state: KVPoll) -> str:
        failed = req.failure()
        return state.name if failed is None else (
            f"{state.name} {failed[0].value if failed[0] else '?'}: {failed[1]}")

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        op = cmd[0]
        if op in ("reserve", "send"):
            rid, seq, addr, seed = cmd[1], int(cmd[2]), cmd[3], int(cmd[4])
            picked = random_lists(config.target, layout, seq, np.random.default_rng(seed))
            mapping = {k.value: v.tolist() for k, v in picked.items()}
            lists[rid] = mapping
            kv = mapping.pop("KV_PAGES")
            if op == "reserve":
                skip = int(cmd[5]) if len(cmd) > 5 else 0
                r = Receiver(att, rid, addr)
                r.send_metadata(kv[skip:], mapping, seq_len=seq, kv_skip=skip)
                requests[rid] = r
            else:
                s = Sender(att, rid, "" if addr == "-" else addr)
                s.send(kv, mapping, seq_len=seq)
                requests[rid] = s
            mapping["KV_PAGES"] = kv
            print(f"{op} {rid}", flush=True)
        elif op == "chunk":
            rid, seq, addr, seed = cmd[1], int(cmd[2]), cmd[3], int(cmd[4])
            # The chunk's tokens [start, end): the frame names the pages they complete.
            offset, _start, end, final = int(cmd[5]), int(cmd[6]), int(cmd[7]), cmd[8] == "1"
            if rid not in lists:
                picked = random_lists(config.target, layout, seq, np.random.default_rng(seed))
                lists[rid] = {k.value: v.tolist() for k, v in picked.items()}
            mapping = lists[rid]
            kv = mapping["KV_PAGES"]
            # An engine gives a page once every token in it is computed.
            upto = len(kv) if final else end // config.target.page_size
            states = {k: v for k, v in mapping.items() if k != "KV_PAGES"} if final else None
            sender = requests.get(rid)
            if not isinstance(sender, Sender):
                sender = requests[rid] = Sender(att, rid, addr)
            sender.send_chunk(kv[offset:upto], seq_len=seq, final=final,
                              state_indices=states, kv_offset=offset)
            print(f"chunk {rid}", flush=True)
        elif op == "layers":
            rid, seq, addr, seed, ready = cmd[1], int(cmd[2]), cmd[3], int(cmd[4]), int(cmd[5])
            if rid not in lists:
                picked = random_lists(config.target, layout, seq, np.random.default_rng(seed))
                lists[rid] = {k.value: v.tolist() for k, v in picked.items()}
            sender = requests.get(rid)
            given = [] if isinstance(sender, Sender) else lists[rid]["KV_PAGES"]
            if not isinstance(sender, Sender):
                sender = requests[rid] = Sender(att, rid, addr)
            sender.send_chunk(given, seq_len=seq, layers=ready)
            print(f"layers {rid}", flush=True)
        elif op == "prefill":
            rid, seq, addr, seed = cmd[1], int(cmd[2]), cmd[3], int(cmd[4])
            num_layers, compute_s, way = int(cmd[5]), float(cmd[6]) / 1000, cmd[7]
            picked = random_lists(config.target, layout, seq, np.random.default_rng(seed))
            mapping = lists[rid] = {k.value: v.tolist() for k, v in picked.items()}
            kv = mapping["KV_PAGES"]
            states = {k: v for k, v in mapping.items() if k != "KV_PAGES"}
            sender = requests[rid] = Sender(att, rid, addr)
            for layer in range(1, num_layers):
                time.sleep(compute_s)  # the layer's forward
                if way == "layerwise":
                    sender.send_chunk(kv if layer == 1 else [], seq_len=seq, layers=layer)
            time.sleep(compute_s)  # the last layer's
            t0, w0 = time.monotonic(), time.time()
            if way == "layerwise":
                sender.send_chunk([], seq_len=seq, final=True, state_indices=states,
                                  kv_offset=len(kv))
            else:
                sender.send(kv, states, seq_len=seq)
            state = sender.wait(120.0)
            t1 = time.monotonic()
            print(f"prefilled {rid} {t0:.9f} {t1:.9f} {w0:.6f} {answer(sender, state)}",
                  flush=True)
        elif op == "stamp":
            req, box = requests[cmd[1]], list[str]()

            def stamp(req: Sender | Receiver = req, box: list[str] = box) -> None:
                state = req.wait(120.0)
                t = time.monotonic()
                box.append(f"{answer(req, state)} {t:.9f}")

            stamps[cmd[1]] = (threading.Thread(target=stamp, daemon=True), box)
            stamps[cmd[1]][0].start()
            print(f"stamp {cmd[1]}", flush=True)
        elif op == "stamped":
            thread, box = stamps.pop(cmd[1])
            thread.join()
            print(box[0], flush=True)
        elif op == "poll":
            print(answer(requests[cmd[1]], requests[cmd[1]].poll()), flush=True)
        elif op == "wait":
            req = requests[cmd[1]]
            print(answer(req, req.wait(float(cmd[2]))), flush=True)
        elif op == "abort":
            requests[cmd[1]].abort("aborted by the test engine")
            print("aborted", flush=True)
        elif op == "reuse":
            rid, new, seq, addr = cmd[1], cmd[2], int(cmd[3]), cmd[4]
            old = requests[rid]
            old.abort("aborted by the test engine")
            state = old.wait(60.0)
            mapping = dict(lists[rid])
            kv = mapping.pop("KV_PAGES")
            r = Receiver(att, new, addr)
            r.send_metadata(kv, mapping, seq_len=seq)  # no command line in between
            requests[new], lists[new] = r, lists[rid]
            print(answer(old, state), flush=True)
        elif op == "release":
            req = requests[cmd[1]]
            assert isinstance(req, Receiver)
            req.release()
            print("released", flush=True)
        elif op == "events":
            evs = att.channel.poll_many()
            print("events " + ",".join(f"{e.request_id}:{e.state.value}" for e in evs),
                  flush=True)
        elif op == "decline":
            Receiver(att, cmd[1], cmd[2]).decline("the test engine will not load it")
            print("declined", flush=True)
        elif op == "digests":
            mapping = lists[cmd[1]]
            pages = slice(int(cmd[2]) if len(cmd) > 2 else 0,
                          int(cmd[3]) if len(cmd) > 3 else None)
            out = []
            for buf in layout.flat_buffers:
                items = pools.buffer_array(buf).reshape(buf.items, buf.item_len)
                at = np.asarray(mapping[buf.index_kind.value])
                take = np.take(items, at[pages] if buf.index_kind.value == "KV_PAGES" else at,
                               axis=0)
                out.append(crc32c.crc32c(np.ascontiguousarray(take).data))
            print("digests " + ",".join(map(str, out)), flush=True)
        elif op == "heads":
            mapping = lists[cmd[1]]
            first, count = int(cmd[2]), int(cmd[3])
            out = []
            for buf in layout.flat_buffers:
                per_head = buf.item_len // config.target.num_kv_heads
                items = pools.buffer_array(buf).reshape(buf.items, buf.item_len)
                rows = np.take(items, np.asarray(mapping["KV_PAGES"]), axis=0)
                window = rows[:, first * per_head:(first + count) * per_head]
                out.append(crc32c.crc32c(np.ascontiguousarray(window).data))
            print("heads " + ",".join(map(str, out)), flush=True)
        elif op == "refusal":
            print(f"refusal {requests[cmd[1]].refusal}", flush=True)
        elif op == "state":
            print(f"state {int(att.attached)} {att.reattaches} {att.instance_id}", flush=True)
        elif op == "grpc":
            print("grpc " + str("grpc" in sys.modules), flush=True)
        elif op == "exit":
            break
    att.close()
    pools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
