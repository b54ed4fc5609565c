"""The GPU check: what issue 46 needs a GPU to prove, in one unattended run (``make gpu-check``).

Runs with nothing but a copy of the tree and a Python that has torch (CUDA), numpy,
grpcio, grpcio-health-checking, protobuf, prometheus-client, pyyaml and xxhash: with no
kvbeam install it imports the tree through a temporary symlink farm and builds the
compiled helpers into it (tests/gpu/tree.py). Two daemons per step over TCP, started as
fresh processes; the reference engines in this process (and, for the kill step, a
prefill engine process) keep their KV on the GPU and stage it through pinned host
buffers they attach. Steps:

1. tokens: the reference engines, unified and paged DSV4 configs with the NextN draft,
   prefill -> daemons -> decode, token-identical to one colocated engine (integrity on).
2. corrupt: decode's daemon flips one staged byte in flight (fault injection): the
   request fails integrity, and the decode engine neither scatters nor decodes it.
3. kill: the prefill engine process is SIGKILLed mid-transfer: both sides fail the
   request, the prefill daemon releases the staging buffer (no memfd mapping, its fds as
   before), the GPU's free memory is back where it was, and a new engine process attaches
   and a request moves again, byte for byte.
4. bandwidth: a ``--tokens`` request (default 32768: 1 GiB in a vLLM-like paged layout)
   GPU -> staging -> daemons -> staging -> GPU, against a plain device-to-host-to-device
   copy of the same bytes in the same run (target: >= 0.8 of it on a GPU).
5. dmabuf: the engine's CUDA pools exported as dma-buf fds; a TCP daemon's answer to them
   (it cannot map GPU memory: its one-line refusal), and where an RDMA device exists, its
   registration (or its refusal line).
6. engines: the integrations' staged paths on the device, without vLLM or sglang (neither
   is on a GPU machine here): vLLM's connector worker side (kvbeam.integrations.vllm.worker,
   which imports no vLLM) with vLLM-shaped layer caches on the device, prefill's and
   decode's through two daemons, three requests at once through a decode staging buffer
   that holds two (the third waits, asked at each step), every block landed exactly; and
   sglang's pool layout with its K/V on the device and its metadata rows on the CPU (as
   sglang allocates them) through two staging buffers, gathered and scattered exactly.

``--cpu`` runs the same steps on CPU tensors (CI runs it so that it cannot rot): the same
token comparison; step 5 then needs a CPU dma-buf exporter (udmabuf or vgem) and says
NOT RUN without one. Exit status 0 when no step FAILED. A watchdog ends the run after
``--budget-s`` (default 450) with the step it was in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.gpu import tree  # noqa: E402  (stdlib only: imports no kvbeam)

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
#: Where ``make gpu-wheels`` puts the wheels the GPU machine may lack (git-ignored: carried).
WHEELS = REPO / ".gpu-wheels"


@dataclass
class Step:
    """One step's outcome and what it printed."""

    name: str
    status: str = PASS
    lines: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def say(self, line: str) -> None:
        """Print a line of this step (and keep it for the summary)."""
        print(f"  {line}", flush=True)
        self.lines.append(line)

    def check(self, ok: bool, what: str) -> None:
        """Record a check: a failed one fails the step (the run goes on)."""
        self.say(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.status = FAIL


class Budget(Exception):
    """The run's time budget ran out."""


# ---- the environment --------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    """Make kvbeam importable (the farm when not installed, or ``--from-tree``)."""
    if not args.from_tree and not args.wheels:
        try:
            import kvbeam.pools  # noqa: F401

            tree.use_paths([str(REPO)])  # the engine processes import tests.gpu from anywhere
            return None, ["kvbeam installed: imported from the install"]
        except ImportError:  # the tree's kvbeam/ alone (no mapping): forget it, use the farm
            for name in [m for m in sys.modules if m == "kvbeam" or m.startswith("kvbeam.")]:
                del sys.modules[name]
    return tree.farm(args.wheels, build=args.build_helpers)


def preflight(device: str) -> list[str]:
    """Versions, the device, and every import the daemons need (one line each)."""
    import numpy
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy "
             f"{numpy.__version__}, {os.cpu_count()} CPUs"]
    missing = []
    for mod in ("grpc", "google.protobuf", "grpc_health.v1.health", "prometheus_client",
                "yaml", "xxhash", "kvbeam.server.runtime", "kvbeam.proto.service"):
        try:
            __import__(mod)
        except Exception as exc:  # an import error of any kind: named, and the run stops
            missing.append(f"{mod}: {type(exc).__name__}: {exc}")
    if missing:
        raise SystemExit("gpu-check: the daemons cannot start here:\n  " + "\n  ".join(missing)
                         + "\n  (pure wheels may travel with the tree: --wheels DIR)")
    import google.protobuf
    import grpc

    import kvbeam

    child = subprocess.run([sys.executable, "-c", "import kvbeam.server.runtime as r; "
                            "print(r.__file__)"], capture_output=True, text=True, cwd="/")
    lines.append(f"kvbeam from {Path(kvbeam.__file__).parent}; a daemon process imports "
                 f"{child.stdout.strip() or child.stderr.strip()[-300:]}")
    lines.append(f"grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu-check: torch sees no CUDA device (use --cpu for the CPU run)")
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        lines.append(f"GPU {props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), "
                     f"CUDA {torch.version.cuda}")
    else:
        lines.append("CPU run (--cpu): the engines' KV in CPU tensors, staged the same way")
    from kvbeam.pools.digest import digester
    from kvbeam.pools.plan import planner
    from kvbeam.transport.verbs.dmabuf_mr import helper_missing

    lines.append(f"digests: {digester()}; plans: {planner()}; dma-buf registration: "
                 f"{helper_missing() or 'available'}")
    return lines


# ---- the steps ------------------------------------------------------------------------
def step_tokens(step: Step, device: str, k: int) -> None:
    """Reference engines on ``device``, staged through two daemons: token-identical."""
    from kvbeam.refengine.configs import tiny_config
    from kvbeam.refengine.served import ServedPair, Staging, format_rows, run_prompts

    for unified in (True, False):
        config = tiny_config(unified=unified, draft=True)
        with ServedPair(config, staging=Staging(device, requests=2), prefix="gpu") as pair:
            rows = run_prompts(pair, [250, 256], k)
            out, inn = pair.staging_buffers
            for line in format_rows(rows, pair.prefill.transport).splitlines():
                step.say(line)
            step.check(all(r.comparison.equal and r.record.ok for r in rows),
                       f"{config.source}: continuations equal to the colocated run "
                       f"(tokens, logits, draft proposals) and XXH3-128-verified")
            mo, mi = out.metrics, inn.metrics
            step.say(f"staging: gathered {mo.bytes_out} B in {mo.copy_out_s * 1e3:.2f} ms, "
                     f"scattered {mi.bytes_in} B in {mi.copy_in_s * 1e3:.2f} ms; pinned "
                     f"{out.pinned_bytes >> 20} + {inn.pinned_bytes >> 20} MiB")
            step.check(mo.held == mi.held == 0, "every request's staging items released")


def step_corrupt(step: Step, device: str, k: int) -> None:
    """A staged byte flipped on decode is caught; the engine never scatters or decodes."""
    from kvbeam.errors import TransferFailed
    from kvbeam.refengine.configs import tiny_config
    from kvbeam.refengine.run import SplitRun, make_prompt, torch_threads
    from kvbeam.refengine.served import ServedPair, Staging
    from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG

    config = tiny_config(unified=True, draft=True)
    with ServedPair(config, extra=(ENABLE_FLAG,), decode_env={CORRUPT_LANDED_ENV: "1"},
                    staging=Staging(device, requests=1), prefix="corrupt") as pair:
        _, inn = pair.staging_buffers
        decoded = []
        with torch_threads(1):
            split = SplitRun(config, make_prompt(250, 512), prefill_side=pair.prefill_side,
                             device=device)
            try:
                decoded = split.decode(k, transfer=pair.transfer,
                                       decode_side=pair.decode_side).tokens
                reason = "none"
            except TransferFailed as exc:
                reason = exc.reason
                step.say(f"decode: {exc.detail}")
        step.check(reason == "integrity", f"the request failed integrity (reason {reason})")
        step.check(not decoded and inn.metrics.requests_in == 0,
                   "decode scattered nothing and decoded nothing")


def _counts(pid: int) -> dict[str, int]:
    """What a daemon holds: memfd mappings, fds other than sockets (its connections to
    its peer, opened by the first request, stay), and sockets."""
    from tests.attach_helpers import fd_targets, proc_counts

    targets = fd_targets(pid)
    sockets = sum(1 for t in targets if t.startswith("socket:"))
    return {"memfd_maps": proc_counts(pid)["memfd_maps"], "files": len(targets) - sockets,
            "sockets": sockets}


class _Child:
    """tests/gpu/gpu_engine.py as a process: JSON lines out, commands in."""

    def __init__(self, sock: str, tokens: int, device: str, seed: int) -> None:
        # cwd "/": with -m the cwd comes first on sys.path, and the tree's own kvbeam/
        # (without its mapping) must not shadow the installed or farmed one.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.gpu_engine", "--socket", sock, "--tokens",
             str(tokens), "--device", device, "--seed", str(seed)], cwd="/", text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.first = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"engine process ended (exit {self.proc.wait(10)}): {err[-2000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _free_gpu(device: str) -> int:
    if device != "cuda":
        return -1
    import torch

    return int(torch.cuda.mem_get_info()[0])


def step_kill(step: Step, device: str, work: Path) -> None:
    """SIGKILL the prefill engine process mid-transfer; what both daemons hold after."""
    import numpy as np
    import torch

    from kvbeam.client import KvbeamClient
    from kvbeam.engine.attach import attach
    from kvbeam.engine.staging import StagingBuffer
    from kvbeam.pools.allocate import AllocatedSide
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.types import IndexKind
    from kvbeam.server.faults import ENABLE_FLAG, WRITE_DELAY_ENV
    from kvbeam.states import TransferState
    from tests.attach_helpers import start_engine_pair
    from tests.bench.bench_staging import bench_config
    from tests.gpu.gpu_engine import request_blocks
    from tests.waiting import wait_until

    tokens = 2048
    config = bench_config(tokens)
    psock, dsock = str(work / "p.sock"), str(work / "d.sock")
    # Prefill waits 2 s before each write: the request is certainly mid-transfer.
    prefill, decode = start_engine_pair(psock, dsock, extra=[ENABLE_FLAG],
                                        env={WRITE_DELAY_ENV: "2"})
    children: list[_Child] = []
    kv = AllocatedSide(build_side_layout(config), device)
    staging = StagingBuffer(config, device=device, requests=1, tokens=tokens)
    try:
        with attach(dsock, staging.pools) as _, \
                KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            before = _counts(prefill.proc.pid)
            free0 = _free_gpu(device)
            children.append(_Child(psock, tokens, device, seed=1))
            step.check("attached" in children[0].first, f"engine process attached: "
                       f"{children[0].first}")
            blocks = list(range(-(-tokens // 16)))
            landing = staging.reserve({IndexKind.KV_PAGES: blocks})
            sent = children[0].ask("stage")
            d.reserve("kill-1", tokens, prefill.address, indices=landing.named_lists())
            p.send("kill-1", -1, tokens, decode.address, indices=sent["lists"])
            mid = wait_until(lambda: p.status("kill-1").state is TransferState.TRANSFERRING, 15)
            children[0].proc.kill()
            children[0].proc.wait(10)
            step.check(mid, f"SIGKILLed the engine process mid-transfer ({sent['bytes']} "
                       f"bytes staged, pinned {children[0].first.get('pinned', 0) >> 20} MiB)")
            ends = {name: c.wait("kill-1", 20) for name, c in (("prefill", p), ("decode", d))}
            step.check(all(s.state is TransferState.FAILED for s in ends.values()),
                       "both sides failed the request: " + "; ".join(
                           f"{k} {v}" for k, v in ends.items()))
            staging.release(landing)
            released = wait_until(lambda: _counts(prefill.proc.pid)["memfd_maps"] == 0, 15)
            wait_until(lambda: _counts(prefill.proc.pid)["files"] <= before["files"], 5)
            after = _counts(prefill.proc.pid)
            step.check(released and after["files"] == before["files"],
                       f"prefill daemon holds what it held before the engine: {before} -> "
                       f"{after} (the staging memfd unmapped; the sockets to decode stay)")
            if device == "cuda":
                back = wait_until(lambda: abs(_free_gpu(device) - free0) <= 4 << 20, 15)
                step.check(back, f"GPU free memory back where it was: {free0 >> 20} MiB "
                           f"before the engine process, {_free_gpu(device) >> 20} MiB after")
            step.check(decode.proc.poll() is None and prefill.proc.poll() is None
                       and d.healthy(5.0), "both daemons alive, decode serving")
            # A new engine process attaches to the same prefill daemon; a request moves.
            children.append(_Child(psock, tokens, device, seed=2))
            step.check("attached" in children[1].first and p.wait_healthy(20),
                       "a new engine process attached: prefill serving again")
            landing = staging.reserve({IndexKind.KV_PAGES: blocks})
            sent = children[1].ask("stage")
            wait_until(lambda: d.healthy(2.0), 10)
            d.reserve("kill-2", tokens, prefill.address, indices=landing.named_lists())
            p.send("kill-2", -1, tokens, decode.address, indices=sent["lists"])
            st = d.wait("kill-2", 60)
            step.check(st.state is TransferState.SUCCESS, f"the next request: {st}")
            if st.state is TransferState.SUCCESS:
                staging.stage_in(landing, kv, {IndexKind.KV_PAGES: blocks}).wait()
                want = AllocatedSide(build_side_layout(config))
                want.fill_pattern(2)  # the engine process's pattern (seed 2)
                src = torch.from_numpy(np.asarray(request_blocks(
                    tokens, kv.layout.flat_buffers[0].items, 2), dtype=np.int64))
                same = all(torch.equal(
                    kv.buffer_view(b).view(-1, b.item_len)[:len(blocks)].cpu(),
                    want.buffer_view(b).view(-1, b.item_len)[src])
                    for b in kv.layout.flat_buffers)
                step.check(same, "its bytes landed in the decode engine's device KV exactly")
            staging.release(landing)
    finally:
        for c in children:
            c.stop()
        staging.close()
        prefill.stop()
        decode.stop()


def step_bandwidth(step: Step, device: str, tokens: int, repeats: int) -> None:
    """GPU -> daemons -> GPU for one request, beside a plain D2H2D copy of its bytes."""
    import numpy as np
    import torch

    from kvbeam.pools.types import IndexKind
    from kvbeam.refengine.served import ServedPair, Staging
    from tests.bench.bench_staging import bench_config

    config = bench_config(tokens)
    blocks = tokens // config.target.page_size
    rng = np.random.default_rng(0)
    with ServedPair(config, staging=Staging(device, requests=1, tokens=tokens),
                    prefix="bw", timeout=120.0) as pair:
        src_kv, dst_kv = pair.prefill_side, pair.decode_side
        items = src_kv.layout.flat_buffers[0].items
        if device == "cuda":
            gen = torch.Generator(device=device).manual_seed(1)
            for t in src_kv.cuda_tensors:  # type: ignore[attr-defined]
                t.random_(0, 256, generator=gen)
        else:
            src_kv.fill_pattern(1)  # type: ignore[attr-defined]
        src = rng.permutation(items)[:blocks]
        dst = rng.permutation(items)[:blocks]
        out, inn = pair.staging_buffers
        runs = []
        for _ in range(repeats):
            m0o, m0i = out.metrics, inn.metrics
            t0 = time.perf_counter()
            pair.transfer({IndexKind.KV_PAGES: src}, {IndexKind.KV_PAGES: dst}, tokens)
            total = time.perf_counter() - t0
            m1o, m1i = out.metrics, inn.metrics
            runs.append((total, m1o.copy_out_s - m0o.copy_out_s,
                         pair.records[-1].send_to_success_s, m1i.copy_in_s - m0i.copy_in_s))
        nbytes = pair.records[-1].bytes
        same = all(torch.equal(dst_kv.buffer_view(b).view(-1, b.item_len)[
            torch.from_numpy(dst)], src_kv.buffer_view(b).view(-1, b.item_len)[
            torch.from_numpy(src)]) for b in src_kv.layout.flat_buffers)
        step.check(same, "every block landed in decode's device KV exactly")
    plain = _plain_copy(device, nbytes, repeats)
    best = min(runs)
    gbs = nbytes / best[0] / 1e9
    ref = nbytes / plain / 1e9
    where = "GPU -> GPU" if device == "cuda" else "CPU tensors -> CPU tensors"
    step.say(f"request: {tokens} tokens, {blocks} blocks x {len(config.target.compression_ratios)} "
             f"layers, {nbytes / 2**20:.0f} MiB, integrity on, TCP; best of {repeats}")
    step.say(f"{where} through the daemons: {best[0] * 1e3:.1f} ms = {gbs:.2f} GB/s (gather "
             f"{best[1] * 1e3:.1f} ms, Send->Success {best[2] * 1e3:.1f} ms, scatter "
             f"{best[3] * 1e3:.1f} ms)")
    step.say(f"plain {'D2H2D' if device == 'cuda' else 'memcpy out + in'} of the same bytes: "
             f"{plain * 1e3:.1f} ms = {ref:.2f} GB/s")
    ratio = gbs / ref
    note = "" if device == "cuda" else "; CPU: figure only"
    step.say(f"ratio_vs_plain_copy={ratio:.2f} (target >= 0.8 on a GPU: "
             f"{'met' if ratio >= 0.8 else 'NOT met'}{note})")
    step.figures.update(bytes=nbytes, staged_gbs=gbs, plain_gbs=ref, ratio=ratio)


def _plain_copy(device: str, nbytes: int, repeats: int) -> float:
    """Best seconds of a plain device -> host -> device copy of ``nbytes`` (CPU: two
    single-threaded memcpys through a host buffer, as the staged CPU path copies)."""
    import numpy as np
    import torch

    times = []
    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(src)
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(src, non_blocking=True)
            dst.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        assert torch.equal(src, dst)
        return min(times[1:])
    a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    h, b = np.empty_like(a), np.empty_like(a)
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        h[:] = a
        b[:] = h
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def step_engines(step: Step, device: str, work: Path) -> None:
    """The vLLM worker side through two daemons, and sglang's mixed-device pools, staged."""
    _vllm_worker(step, device, work)
    _sglang_pools(step, device)


def _vllm_worker(step: Step, device: str, work: Path) -> None:
    """Two connector worker sides (prefill, decode) over vLLM-shaped device caches."""
    import torch

    from kvbeam.integrations.vllm.params import Settings, Staging
    from kvbeam.integrations.vllm.scheduler import Load, Push, StepPlan
    from kvbeam.integrations.vllm.worker import WorkerSide
    from tests.attach_helpers import start_engine_pair

    layers, blocks, heads, block, head = 4, 512, 8, 16, 128  # 64 KiB bfloat16 blocks
    per_request = 96
    gen = torch.Generator(device=device).manual_seed(7)

    def caches() -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn.attn": torch.randn(
            blocks, heads, block, 2 * head, generator=gen, device=device).to(torch.bfloat16)
            for i in range(layers)}

    psock, dsock = str(work / "p.sock"), str(work / "d.sock")
    prefill, decode = start_engine_pair(psock, dsock)
    sides: list[WorkerSide] = []
    try:
        staging = Staging(enabled=True, requests=2, tokens=per_request * block, wait_s=60)
        for daemon, sock in ((prefill, psock), (decode, dsock)):
            settings = Settings(daemons=(daemon.address,), attach_sockets=(sock,),
                                model="gpu-check", staging=staging)
            sides.append(WorkerSide(settings, block, heads, head,
                                    kv_buffer_device="cpu" if device == "cuda" else "",
                                    max_model_len=per_request * block))
        src, dst = caches(), caches()
        pw, dw = sides
        pw.register_kv_caches(src)
        dw.register_kv_caches(dst)
        assert pw.staging is not None and dw.staging is not None
        step.check(True, f"vLLM worker sides attached staged: {layers} layers x {blocks} "
                         f"blocks of {pw.staging.layout.flat_buffers[0].item_len} bytes on "
                         f"{device}, pinned {pw.staging.pinned_bytes >> 20} + "
                         f"{dw.staging.pinned_bytes >> 20} MiB")
        perm = torch.randperm(blocks).tolist()
        reqs = [(f"r{i}", tuple(perm[i * per_request:(i + 1) * per_request]),
                 tuple(perm[-(i + 1) * per_request:][:per_request])) for i in range(3)]
        seq_len = per_request * block
        dw.absorb(StepPlan(loads=[Load(r, f"gpu-{r}", d, (prefill.address,), seq_len)
                                  for r, _, d in reqs]))
        pw.absorb(StepPlan(sends=[Push(r, f"gpu-{r}", s, (decode.address,), seq_len)
                                  for r, s, _ in reqs]))
        waited = dw.staging.metrics.waiting
        sent: set[str] = set()
        received: set[str] = set()
        end = time.monotonic() + 120
        while (len(sent) < 3 or len(received) < 3) and time.monotonic() < end:
            sent |= pw.get_finished()[0]
            received |= dw.get_finished()[1]
            time.sleep(0.002)
        errors = dw.take_load_errors()
        step.check(len(sent) == len(received) == 3 and not errors,
                   f"3 requests sent and loaded through the daemons (one waited for decode's "
                   f"staging room: {waited} waiting at first); load errors {len(errors)}")
        same = all(torch.equal(dst[name][torch.tensor(d)], src[name][torch.tensor(s)])
                   for name in src for _, s, d in reqs)
        step.check(same, "every block landed in decode's device cache exactly")
        mo, mi = pw.staging.metrics, dw.staging.metrics
        step.say(f"staging: gathered {mo.bytes_out >> 20} MiB in {mo.copy_out_s * 1e3:.1f} "
                 f"ms, scattered {mi.bytes_in >> 20} MiB in {mi.copy_in_s * 1e3:.1f} ms")
        step.check(mo.held == mi.held == 0 and mi.waits >= 1,
                   "every staging item back; decode's third request waited for room")
        _layer_by_layer(step, pw, dw, src, dst, prefill.address, decode.address,
                        perm[:per_request], perm[-per_request:], seq_len)
    finally:
        for side in sides:
            side.close()
        prefill.stop()
        decode.stop()


def _layer_by_layer(step: Step, pw: Any, dw: Any, src: dict[str, Any], dst: dict[str, Any],
                    prefill: str, decode: str, s: list[int], d: list[int],
                    seq_len: int) -> None:
    """A prompt streamed layer by layer, staged: each layer is computed (rewritten on the
    engine's stream) just before its save_kv_layer, gathered on the side stream after
    it, and given once its gather completed; decode's cache must hold every layer as
    computed."""
    import torch

    from kvbeam.integrations.vllm.scheduler import Load, Push, StepPlan

    names = list(src)
    pw._layer_of = {name: i for i, name in enumerate(names)}
    push = Push("l", "gpu-layers", tuple(s), (decode,), seq_len)
    dw.absorb(StepPlan(loads=[Load("l", "gpu-layers", tuple(d), (prefill,), seq_len)]))
    pw.absorb(StepPlan(streams=[push]))
    rows = torch.tensor(s, device=src[names[0]].device)
    for name in names:
        src[name][rows] = src[name][rows] * -1 + 1  # the layer's compute, then its save
        pw.save_layer(name)
    pw.forward_done()
    pw.absorb(StepPlan(sends=[push]))  # vLLM's end of the request
    sent: set[str] = set()
    received: set[str] = set()
    end = time.monotonic() + 120
    while ("l" not in sent or "l" not in received) and time.monotonic() < end:
        sent |= pw.get_finished()[0]
        received |= dw.get_finished()[1]
        time.sleep(0.002)
    same = all(torch.equal(dst[name][torch.tensor(d)], src[name][torch.tensor(s)])
               for name in names)
    step.check("l" in sent and "l" in received and same and not dw.take_load_errors(),
               f"a prompt streamed layer by layer, staged ({pw.take_counts().get('streamed')} "
               "streamed): every layer landed as computed")


def _sglang_pools(step: Step, device: str) -> None:
    """sglang's MHA pool on the device, its metadata rows on the CPU: one staging buffer
    per side, the daemons' move done here, every item back where it belongs."""
    import numpy as np
    import torch

    from kvbeam.engine.staging import StagedRequest, StagingBuffer, TensorKV
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.sglang_mha import sglang_mha_spec
    from kvbeam.pools.spec import SideConfig
    from kvbeam.pools.types import IndexKind

    rows, heads, dim, aux = 4096, 8, 128, (64, 512)
    config = SideConfig("gpu-check", sglang_mha_spec(
        num_layers=2, page_size=1, num_kv_heads=heads, head_dim=dim, dtype="bfloat16",
        token_rows=rows, aux_item_lens=aux, aux_rows=16, max_inflight=16))
    layout = build_side_layout(config)

    def tensors(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for b in layout.flat_buffers:
            t = torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=g)
            out.append(t.to(device) if b.index_kind is IndexKind.KV_PAGES else t)
        return out

    src_t, dst_t = tensors(1), tensors(2)
    src, dst = TensorKV(layout, src_t), TensorKV(layout, dst_t)
    rng = np.random.default_rng(3)
    lists: list[dict[IndexKind, Any]] = [
        {IndexKind.KV_PAGES: rng.permutation(rows)[:700], IndexKind.REQ_SLOT: [5]},
        {IndexKind.KV_PAGES: rng.permutation(rows)[:700], IndexKind.REQ_SLOT: [11]}]
    with StagingBuffer(config, device=device, requests=2, tokens=1024) as out, \
            StagingBuffer(config, device=device, requests=2, tokens=1024) as inn:
        tx, rx = StagedRequest(out, lists[0]), StagedRequest(inn, lists[1])
        end = time.monotonic() + 30
        while (items := tx.gather(src)) is None and time.monotonic() < end:
            time.sleep(0.001)
        landing = rx.reserve()
        assert items is not None and landing is not None
        for sb, db in zip(out.layout.flat_buffers, inn.layout.flat_buffers, strict=True):
            s = out.pools.buffer_view(sb).view(-1, sb.item_len)
            d = inn.pools.buffer_view(db).view(-1, db.item_len)
            d[torch.from_numpy(landing.lists[db.index_kind])] = s[torch.from_numpy(
                items.lists[sb.index_kind])]
        while not rx.scatter(dst) and time.monotonic() < end:
            time.sleep(0.001)
        tx.release()
        rx.release()
        held = out.metrics.held + inn.metrics.held
    same = all(torch.equal(
        dst.buffer_view(b).view(-1, b.item_len)[torch.as_tensor(lists[1][b.index_kind])].cpu(),
        src.buffer_view(b).view(-1, b.item_len)[torch.as_tensor(lists[0][b.index_kind])].cpu())
        for b in layout.flat_buffers)
    where = f"K/V on {device}, metadata rows on cpu"
    step.check(same and held == 0, f"sglang's pools ({where}): a 700-token request and its "
                                   "metadata row gathered and scattered exactly; items back")


def step_dmabuf(step: Step, device: str, work: Path) -> None:
    """Export dma-buf fds (CUDA; on CPU udmabuf/vgem) and attach them: the daemons' answers."""
    from kvbeam.engine import EngineBuffers, attach
    from kvbeam.errors import AttachError, ConfigError
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.shm import filesystem_type
    from kvbeam.refengine.configs import tiny_config
    from kvbeam.server.engines.dmabuf import DMA_BUF_MAGIC
    from kvbeam.transport.factory import pick_rdma_device
    from tests.attach_helpers import start_engine_daemon

    config = tiny_config(unified=True, draft=True)
    layout = build_side_layout(config)
    keep: list[Any] = []
    if device == "cuda":
        from kvbeam.engine.dmabuf import export_side
        from kvbeam.pools.allocate import AllocatedSide

        side = AllocatedSide(layout, "cuda")
        keep.append(side)
        try:
            buffers = export_side(side)
        except ConfigError as exc:
            step.status = NOT_RUN
            step.say(f"dma-buf export refused by this GPU/driver: {exc}")
            return
        what = f"CUDA pools ({len(side.cuda_tensors)} allocations)"
    else:
        from tests.dmabuf_helpers import make_dmabuf, packed_buffers

        size, comps = packed_buffers(layout)
        try:
            buf = make_dmabuf(size)
        except OSError as exc:
            step.status = NOT_RUN
            step.say(f"{exc}: dma-buf export not tried on CPU")
            return
        keep.append(buf)
        buffers = EngineBuffers([buf.fd], comps)
        what = f"a {buf.how} dma-buf"
    step.check(all(filesystem_type(fd) == DMA_BUF_MAGIC for fd in buffers.fds),
               f"{what} exported as {len(buffers.fds)} dma-buf fd(s)")
    transports = ["tcp"] + (["rdma"] if pick_rdma_device() else [])
    if "rdma" not in transports:
        step.say("no RDMA device here: registration not tried (the TCP daemon's answer below)")
    try:
        for transport in transports:
            sock = str(work / f"dmabuf-{transport}.sock")
            daemon = start_engine_daemon("decode", sock, transport=transport,
                                         extra=["--integrity", "false"])
            try:
                try:
                    with attach(sock, buffers, config, memory_kind="dmabuf"):
                        answer = f"attached ({transport}: the daemon took the dma-buf)"
                except AttachError as exc:
                    answer = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
                step.say(f"{transport} daemon: {answer}")
                step.check(daemon.proc.poll() is None and "\n" not in answer,
                           f"{transport} daemon answered in one line and serves on")
            finally:
                daemon.stop()
    finally:
        for fd in buffers.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for k in keep:
            if hasattr(k, "close"):
                k.close()


# ---- the run ----------------------------------------------------------------------------
@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise Budget(f"the run's budget of {seconds:g} s ran out")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def main(argv: list[str] | None = None) -> int:
    """Run every step; print the summary; 0 when none failed."""
    ap = argparse.ArgumentParser(prog="tests/gpu/gpu_check.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the same steps on CPU tensors")
    ap.add_argument("--tokens", type=int, default=32768, help="bandwidth step's request")
    ap.add_argument("--repeats", type=int, default=3, help="bandwidth step's repeats")
    ap.add_argument("-k", type=int, default=8, help="tokens continued per prompt")
    ap.add_argument("--steps", default="tokens,corrupt,kill,bandwidth,dmabuf,engines")
    ap.add_argument("--from-tree", action="store_true",
                    help="import kvbeam through the symlink farm even when it is installed")
    ap.add_argument("--build-helpers", action="store_true",
                    help="with --from-tree: build the compiled helpers into the farm even "
                         "where the tree has them (as a fresh copy of the tree must)")
    ap.add_argument("--wheels", default=str(WHEELS) if WHEELS.is_dir() else "",
                    help="a folder of wheels to import before the machine's packages "
                         f"(default {WHEELS.relative_to(REPO)} when it exists: make gpu-wheels)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="watchdog for the run")
    ap.add_argument("--json", default="", help="write the steps' outcomes here")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    t_start = time.monotonic()
    print(f"gpu-check ({device})", flush=True)
    root, lines = prepare(args)
    steps: list[Step] = []
    try:
        for line in lines + preflight(device):
            print(f"  {line}", flush=True)
        import tempfile

        import torch

        torch.set_num_threads(min(4, torch.get_num_threads()))
        funcs: dict[str, Callable[[Step, Path], None]] = {
            "tokens": lambda s, w: step_tokens(s, device, args.k),
            "corrupt": lambda s, w: step_corrupt(s, device, args.k),
            "kill": lambda s, w: step_kill(s, device, w),
            "bandwidth": lambda s, w: step_bandwidth(s, device, args.tokens, args.repeats),
            "dmabuf": lambda s, w: step_dmabuf(s, device, w),
            "engines": lambda s, w: step_engines(s, device, w),
        }
        with _watchdog(args.budget_s):
            for name in args.steps.split(","):
                step = Step(name)
                steps.append(step)
                print(f"[{name}]", flush=True)
                t0 = time.monotonic()
                with tempfile.TemporaryDirectory(prefix=f"kvbeam-gpu-{name}-") as work:
                    os.chmod(work, 0o700)
                    try:
                        funcs[name](step, Path(work))
                    except Budget as exc:
                        step.status = FAIL
                        step.say(f"FAIL {exc} (in this step)")
                        break
                    except Exception as exc:  # a step's crash fails it; the run goes on
                        step.status = FAIL
                        step.say(f"FAIL {type(exc).__name__}: {exc}")
                        traceback.print_exc()
                step.seconds = time.monotonic() - t0
    finally:
        if root is not None:
            tree.remove(root)
    print(f"gpu-check ({device}) summary, {time.monotonic() - t_start:.0f} s:")
    for s in steps:
        print(f"  {s.name:<10} {s.status:<8} {s.seconds:6.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([s.__dict__ for s in steps], indent=1))
    failed = [s.name for s in steps if s.status == FAIL]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'no step failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
