"""`vllm serve` processes, vllm-router and an OpenAI-style client.

For tests/host/test_vllm_served.py and the vLLM benchmark (tests/bench/vllm_served.py).

The model is the tiny Llama of tests/vllm_helpers.py as a real checkpoint
(``model.safetensors`` beside its ``config.json``): the seeded 1/sqrt(fan-in) weights
that tests/vllm_peer.py puts in place of vLLM's dummy ones, written once, so a
``vllm serve`` loads them as users' servers load theirs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbeam.procs import DaemonProcess
from tests.vllm_helpers import ROOT, START_S, TINY_LLAMA, VLLM_CPU_ENV

log = logging.getLogger(__name__)

#: The served model's name (``--served-model-name``).
MODEL = "tiny"


def write_checkpoint(directory: Path, config: Mapping[str, Any] = TINY_LLAMA) -> str:
    """The tiny Llama (or ``config``, a Llama of other sizes) as config.json +
    model.safetensors (seeded weights, float32)."""
    import numpy as np
    from safetensors.numpy import save_file

    c = {k: v for k, v in config.items() if isinstance(v, int)}
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads, head = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "lm_head.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * head, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter),
                   p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norms
            tensors[name] = np.ones(shape, np.float32)
            continue
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        w = rng.standard_normal(shape).astype(np.float32) / np.float32(shape[-1] ** 0.5)
        if any(k in name for k in ("q_proj", "k_proj", "v_proj")):
            w *= 2.0  # sharper attention: the context shows in the tokens
        tensors[name] = w
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def free_port() -> int:
    """A TCP port nobody listens on now (the servers bind it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(role: str, extra: Mapping[str, Any], module: str = "kvbeam.integrations.vllm",
              cls: str = "KvbeamConnector", policy: str = "fail") -> str:
    """``--kv-transfer-config`` of a kvbeam prefill (``kv_producer``) or decode server
    (``policy``: its ``kv_load_failure_policy``)."""
    return json.dumps({"kv_connector": cls, "kv_connector_module_path": module,
                       "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                       "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": dict(extra)})


@dataclass
class Served:
    """One background process (a ``vllm serve`` or the router), its output kept."""

    name: str
    port: int
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    #: When this process read each of ``lines`` (monotonic), index for index.
    line_times: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.line_times.append(time.monotonic())  # first: a line seen has its time
            self.lines.append(line)

    def wait_ready(self, path: str = "/health", timeout: float = START_S) -> None:
        """Until ``path`` answers 200; fails with the output if the process ends first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + path,
                                                                       timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(1)
        raise AssertionError(f"{self.name} not ready (exit {self.proc.poll()}):\n"
                             + "".join(self.lines[-60:]))

    def log(self, pattern: str) -> list[str]:
        return [line for line in list(self.lines) if pattern in line]

    def kill(self) -> None:
        """SIGKILL the server and every process it started (vLLM's engine core and
        worker), as an OOM kill or a lost machine ends them: nothing runs its exit path."""
        pids = descendants(self.proc.pid)
        self.proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in task.read_text().split()]
                out += kids
                todo += kids
    return out


def _spawn(name: str, port: int, cmd: Sequence[str], env: Mapping[str, str]) -> Served:
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env}, bufsize=1, cwd=ROOT)
    served = Served(name, port, proc)
    threading.Thread(target=served.pump, daemon=True).start()
    return served


def vllm_serve(name: str, model: str, *, port: int | None = None,
               kv_transfer_config: str | None = None, args: Sequence[str] = (),
               block_size: int = 32, dtype: str = "float32",
               env: Mapping[str, str] | None = None, max_model_len: int = 512) -> Served:
    """``vllm serve MODEL`` (vllm-cpu's ``vllm`` script looks up a distribution named
    ``vllm`` and fails; the same server runs as ``python -m
    vllm.entrypoints.openai.api_server``); ``dtype``: its ``--dtype`` (the KV cache's);
    ``env``: beside :data:`~tests.vllm_helpers.VLLM_CPU_ENV` (e.g. TP's core binding, a
    bigger ``VLLM_CPU_KVCACHE_SPACE``)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
           "--seed", "0",
           "--block-size", str(block_size), "--skip-tokenizer-init", *args]
    if kv_transfer_config:
        cmd += ["--kv-transfer-config", kv_transfer_config]
    full = {**VLLM_CPU_ENV, "VLLM_LOGGING_LEVEL": "INFO", "PYTHONPATH": str(ROOT), **(env or {})}
    return _spawn(name, port, cmd, full)


def vllm_router(prefill: Sequence[str], decode: Sequence[str], *, port: int | None = None,
                name: str = "router", decode_policy: str | None = None) -> Served:
    """vllm-router in its vLLM PD mode (``--vllm-pd-disaggregation``) over these URLs,
    round robin (decode: ``decode_policy`` where given)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
           "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]
    if decode_policy:
        cmd += ["--decode-policy", decode_policy]
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    return _spawn(name, port, cmd, {})


def contract_proxy(prefill: Sequence[str], decode: Sequence[str], *, name: str = "contract"
                   ) -> Served:
    """tests/vllm_contract_proxy.py over these URLs (a proxy written to vLLM's NIXL
    contract: NIXL's fixed kv_transfer_params to prefill, a plain uuid X-Request-Id),
    ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.vllm_contract_proxy", "--port", str(port)]
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    proxy = _spawn(name, port, cmd, {"PYTHONPATH": str(ROOT)})
    proxy.wait_ready(timeout=60)
    return proxy


def concurrent_proxy(prefill: Sequence[tuple[Served, DaemonProcess]],
                     decode: Sequence[tuple[Served, DaemonProcess]], *,
                     name: str = "concurrent") -> Served:
    """tests/vllm_concurrent_proxy.py over these servers and their daemons (each request
    to prefill and decode at once, both daemons named: decode reserves while prefill
    computes, what layer-by-layer sends need), ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.vllm_concurrent_proxy", "--port", str(port)]
    for server, daemon in prefill:
        cmd += ["--prefill", f"{server.url}={daemon.address}"]
    for server, daemon in decode:
        cmd += ["--decode", f"{server.url}={daemon.address}"]
    proxy = _spawn(name, port, cmd, {"PYTHONPATH": str(ROOT)})
    proxy.wait_ready(timeout=60)
    return proxy


def vllm_toy_proxy(prefill: Sequence[Served], decode: Sequence[Served]) -> Served:
    """vLLM's own P/D test proxy (its ``toy_proxy_server.py``, unchanged: see
    tests/vllm_upstream.py) over these servers, round robin, ready.

    Raises:
        RuntimeError: the proxy was never fetched into this venv (``make test-vllm`` does).
    """
    from tests.vllm_upstream import TOY_PROXY

    if not TOY_PROXY.exists():
        raise RuntimeError(f"{TOY_PROXY} is missing: python -m tests.vllm_upstream "
                           "(make test-vllm) fetches vLLM's toy proxy")
    port = free_port()
    cmd = [sys.executable, str(TOY_PROXY), "--port", str(port), "--host", "127.0.0.1",
           "--prefiller-hosts", *["127.0.0.1"] * len(prefill),
           "--prefiller-ports", *[str(s.port) for s in prefill],
           "--decoder-hosts", *["127.0.0.1"] * len(decode),
           "--decoder-ports", *[str(s.port) for s in decode]]
    proxy = _spawn("vllm-toy-proxy", port, cmd, {})
    proxy.wait_ready("/healthcheck", timeout=60)
    return proxy


def routed_ids(proxy: Served, since: int = 0) -> list[str]:
    """The X-Request-Ids a contract proxy gave its requests (after output line ``since``),
    once it said it answered each (its output is read by another thread)."""
    end = time.monotonic() + 10
    while True:
        lines = list(proxy.lines[since:])
        routed = [line.split()[1] for line in lines if line.startswith("routed ")]
        answered = {line.split()[1] for line in lines if line.startswith("answered ")}
        if set(routed) <= answered or time.monotonic() > end:
            return routed
        time.sleep(0.05)


@dataclass
class Completion:
    """One completion's generated token ids, finish reason and timings."""

    tokens: list[int]
    finish: str | None
    kv_transfer_params: Any = None
    ttft_s: float = 0.0
    #: Gaps between streamed chunks (one token each), s.
    gaps_s: list[float] = field(default_factory=list)
    status: int = 200
    error: str = ""


def complete(url: str, prompt: Sequence[int], max_tokens: int, *, stream: bool = False,
             kv_transfer_params: Mapping[str, Any] | None = None, timeout: float = 300.0
             ) -> Completion:
    """``POST /v1/completions`` at temperature 0 with ``ignore_eos`` and token ids back."""
    body: dict[str, Any] = {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                            "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return Completion([], None, status=exc.code, error=exc.read().decode(errors="replace"))
    with response:
        if not stream:
            out = json.loads(response.read())
            choice = out["choices"][0]
            return Completion(list(choice.get("token_ids") or []), choice.get("finish_reason"),
                              out.get("kv_transfer_params"), time.monotonic() - t0)
        got = Completion([], None)
        last = t0
        for event in _events(raw.decode().rstrip("\r\n") for raw in response):
            choice = event["choices"][0]
            ids = list(choice.get("token_ids") or [])
            now = time.monotonic()
            if ids:
                if not got.tokens:
                    got.ttft_s = now - t0
                else:
                    got.gaps_s.append(now - last)
                last = now
            got.tokens += ids
            got.finish = choice.get("finish_reason") or got.finish
        return got


def _events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            event: dict[str, Any] = json.loads(line[len("data: "):])
            if event.get("choices"):
                yield event


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples at ``url`` that carry ``labels`` (0 when
    none)."""
    total = 0.0
    want = [f'{k}="{v}"' for k, v in labels.items()]
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if not line.startswith(name) or len(line) == len(name) or line[len(name)] not in " {":
            continue
        sample, value = line.rsplit(" ", 1)
        if all(w in sample for w in want):
            total += float(value)
    return total


@dataclass
class Deployment:
    """A served pair behind vllm-router, its two daemons, and a plain server; with
    ``start_deployment(fleet_extra=N)`` also N more prefill and N more decode servers
    (their daemons named like them) and a second router over every one (prefill round
    robin, decode at random)."""

    plain: Served
    prefill: Served
    decode: Served
    router: Served
    daemons: dict[str, DaemonProcess]
    #: Every prefill server (the pair's first), every decode server, the router over all.
    fleet_prefill: list[Served] = field(default_factory=list)
    fleet_decode: list[Served] = field(default_factory=list)
    fleet_router: Served | None = None

    def landed(self, daemon: str = "decode") -> tuple[float, float]:
        """(transfers that reached Success, bytes landed) on a decode daemon."""
        url = self.metrics(daemon)
        return (metric(url, "kvbeam_transfers_total", state="Success"),
                metric(url, "kvbeam_request_bytes_total"))

    def metrics(self, daemon: str) -> str:
        """A daemon's /metrics URL."""
        return f"http://{self.daemons[daemon].metrics}/metrics"

    def stop(self) -> None:
        servers = [self.router, self.fleet_router, self.plain, *self.fleet_decode,
                   *self.fleet_prefill, self.decode, self.prefill]
        stopped: list[Served] = []
        for s in servers:
            if s is not None and not any(s is t for t in stopped):  # the pair is in the fleet
                s.stop()
                stopped.append(s)
        for d in self.daemons.values():
            d.stop()


def start_deployment(work: Path, serve_args: Sequence[str], deadlines: Sequence[str], *,
                     decode_connector: tuple[str, str] = ("kvbeam.integrations.vllm",
                                                          "KvbeamConnector"),
                     decode_policy: str = "fail", prefill_daemon_args: Sequence[str] = (),
                     prefill_daemon_env: Mapping[str, str] | None = None,
                     fleet_extra: int = 0, fleet_prefill_daemon_args: Sequence[str] = (),
                     fleet_prefill_daemon_env: Mapping[str, str] | None = None,
                     unmapped: Sequence[str] = (),
                     extra: Mapping[str, Mapping[str, Any]] | None = None) -> Deployment:
    """Two ``--pools engine`` daemons, a prefill and a decode ``vllm serve`` with the
    connector, vllm-router in PD mode over them, and a plain ``vllm serve``; all started
    at once, returned once every one answers. ``decode_policy``: decode's
    ``kv_load_failure_policy``; the ``prefill_daemon_*`` go to prefill's daemon (a test's
    ``--enable-fault-injection`` and its ``KVBEAM_FAULT_*`` variables).

    ``fleet_extra``: N more prefill (``prefill2``...) and decode servers (``decode2``...,
    kvbeam's connector, policy ``fail``), each with its own daemon (the extra prefills'
    get the ``fleet_prefill_daemon_*``), started with the others; every prefill's
    ``decode_daemons`` maps every decode server (but those named in ``unmapped``, which
    get no ``decode_daemons``: their sends go to the decode that reserves them), and a
    second router (:attr:`Deployment.fleet_router`) routes over all of them.

    ``extra``: more ``kv_connector_extra_config`` keys of the pair's ``prefill`` and
    ``decode`` server (e.g. staging)."""
    from tests.attach_helpers import start_engine_daemon

    model = write_checkpoint(work / "tiny-llama")
    prefills = ["prefill", *(f"prefill{i + 2}" for i in range(fleet_extra))]
    decodes = ["decode", *(f"decode{i + 2}" for i in range(fleet_extra))]
    sockets = {r: str(work / f"{r}.sock") for r in (*prefills, *decodes)}
    daemons: dict[str, DaemonProcess] = {}
    started: list[Served] = []
    try:
        for name in prefills:
            first = name == "prefill"
            daemons[name] = start_engine_daemon(
                "prefill", sockets[name], deadlines=deadlines,
                extra=prefill_daemon_args if first else fleet_prefill_daemon_args,
                env=dict((prefill_daemon_env if first else fleet_prefill_daemon_env) or {}))
        for name in decodes:
            daemons[name] = start_engine_daemon("decode", sockets[name], deadlines=deadlines)
        ports = {name: free_port() for name in decodes}
        # vllm-router names decode by its HTTP address: its daemon is here.
        decode_daemons = {f"127.0.0.1:{ports[n]}": daemons[n].address for n in decodes}
        servers: dict[str, Served] = {}
        for name in prefills:
            settings: dict[str, Any] = {"daemon": daemons[name].address,
                                        "attach_socket": sockets[name],
                                        **(extra or {}).get(name, {})}
            if name not in unmapped:
                settings["decode_daemons"] = decode_daemons
            servers[name] = vllm_serve(name, model, args=serve_args,
                                       kv_transfer_config=kv_config("prefill", settings))
            started.append(servers[name])
        for name in decodes:
            first = name == "decode"
            servers[name] = vllm_serve(name, model, port=ports[name], args=serve_args,
                                       kv_transfer_config=kv_config(
                                           "decode", {"daemon": daemons[name].address,
                                                      "attach_socket": sockets[name],
                                                      **(extra or {}).get(name, {})},
                                           *(decode_connector if first else
                                             ("kvbeam.integrations.vllm", "KvbeamConnector")),
                                           policy=decode_policy if first else "fail"))
            started.append(servers[name])
        plain = vllm_serve("plain", model, args=serve_args)
        started.append(plain)
        t0 = time.monotonic()
        for s in started:
            s.wait_ready()
        router = vllm_router([servers["prefill"].url], [servers["decode"].url])
        started.append(router)
        fleet_router = None
        if fleet_extra:
            # Round robin on both lists picks them in lockstep (prefill i with decode i);
            # decode at random makes every prefill send to every decode.
            fleet_router = vllm_router([servers[n].url for n in prefills],
                                       [servers[n].url for n in decodes], name="fleet-router",
                                       decode_policy="random")
            started.append(fleet_router)
            fleet_router.wait_ready()
        router.wait_ready()
        log.warning("%d vllm serve and the router(s) up in %.0f s", len(started) - 1
                    - bool(fleet_router), time.monotonic() - t0)
        return Deployment(plain, servers["prefill"], servers["decode"], router, daemons,
                          [servers[n] for n in prefills] if fleet_extra else [],
                          [servers[n] for n in decodes] if fleet_extra else [], fleet_router)
    except BaseException:
        for s in started:
            s.stop()
        for d in daemons.values():
            d.stop()
        raise
