"""The package's layers by audience, read from every module's own imports.

pyproject's package-dir maps the top-level folders (pools/, proto/, transport/,
server/) below ``kvbeam``, so the folders alone do not show who may import whom. This
test reads every module of the distribution (the mapping taken from pyproject, each
file's ``import`` statements by AST, those inside functions and ``TYPE_CHECKING``
included) and checks each kvbeam import against the table below, bottom to top:

- **base**: errors, states, logs, threads, the selector loop, compiled helpers: imports
  only base.
- **transport** (the data plane), **pools** (layouts, plans, digests), **proto** (the
  wire): each only what is below it.
- **api**: the scheduler-facing client and the gRPC helpers it shares with the daemons
  (credentials, channels, RPC errors).
- **engine**: the engine SDK (attach channel, staging); no gRPC, no client.
- **integrations** (vLLM, sglang) and **refengine** (the reference engine): over the
  engine SDK; refengine drives its requests through the client as a scheduler would.
- **server.state**: the data the cores keep (the transfer table, the verified peers and
  their connections, decode's slots, the handshake's verified peer): below the cores.
- **server.core**: the cores, their drivers and their request checks: pools, transport
  and the state, never the peer side, the engine side, an adapter, the wire or gRPC.
- **server.engines**: the daemon's side of its engine (attach socket, memory, engine
  channel): over the cores, no gRPC.
- **server.peers**: the daemon's side of the other daemons (handshake client, peer
  channel, the cores' peer calls): over the cores, the daemon's settings and metrics.
- **server.api**: the gRPC adapters (control server, servicers): over all of the above.
- **server**: the daemon itself (runtime, settings, metrics, executor, faults, end log).
- **cli**: the command line, which starts daemons and drives requests.

Runtime checks of the same boundaries in fresh interpreters (what a scheduler or an
engine process really loads) are in test_import_boundary.py and test_engine_requests.py.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (layer, module prefixes): the first layer whose prefix matches a module holds it, so
#: the more specific prefixes come first.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("server.state", ("kvbeam.server.state",)),
    ("server.core", ("kvbeam.server.core",)),
    ("server.engines", ("kvbeam.server.engines",)),
    ("server.peers", ("kvbeam.server.peers",)),
    ("server.api", ("kvbeam.server.api",)),
    ("server", ("kvbeam.server",)),
    ("transport", ("kvbeam.transport",)),
    ("pools", ("kvbeam.pools",)),
    ("proto", ("kvbeam.proto",)),
    ("api", ("kvbeam.auth", "kvbeam.auth_grpc", "kvbeam.control_channel", "kvbeam.rpc_errors",
             "kvbeam.client", "kvbeam.fleet", "kvbeam.scheduler", "kvbeam.procs")),
    ("engine", ("kvbeam.engine",)),
    ("integrations", ("kvbeam.integrations",)),
    ("refengine", ("kvbeam.refengine",)),
    ("cli", ("kvbeam.cli", "kvbeam.commands")),
    ("base", ("kvbeam.errors", "kvbeam.states", "kvbeam.logs", "kvbeam.threads", "kvbeam.loop",
              "kvbeam.compiled", "kvbeam")),
)

_LOW = ("base", "transport", "pools", "proto")
#: What each layer may import (besides itself).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "transport": frozenset({"base"}),
    "pools": frozenset({"base", "transport"}),
    "proto": frozenset({"base", "transport", "pools"}),
    "api": frozenset(_LOW),
    "engine": frozenset({"base", "pools", "proto"}),
    # kvbeam.auth only: the engines' credentials, which import no gRPC (a runtime test).
    "integrations": frozenset({"base", "pools", "proto", "engine", "api:kvbeam.auth"}),
    "refengine": frozenset({*_LOW, "api", "engine"}),
    # The handshake's verified peer is data the cores keep; it checks layouts (pools).
    "server.state": frozenset({"base", "transport", "pools", "proto"}),
    "server.core": frozenset({"base", "transport", "pools", "server.state"}),
    "server.engines": frozenset({"base", "transport", "pools", "proto", "server.state",
                                 "server.core"}),
    "server.peers": frozenset({*_LOW, "api", "server.state", "server.core",
                               "server:kvbeam.server.settings",
                               "server:kvbeam.server.metrics"}),
    "server.api": frozenset({*_LOW, "api", "server.state", "server.core", "server.engines",
                             "server.peers", "server"}),
    "server": frozenset({*_LOW, "api", "server.state", "server.core", "server.engines",
                         "server.peers", "server.api"}),
    "cli": frozenset({*_LOW, "api", "engine", "refengine", "server", "server.state",
                      "server.core", "server.engines", "server.peers", "server.api"}),
}

#: Third-party packages only some layers may import: gRPC is the API's, the wire's
#: service stubs' and the daemon's adapters'.
GRPC_LAYERS = frozenset({"api", "proto", "server", "server.api", "server.peers", "cli"})


def _package_dirs() -> dict[str, Path]:
    """pyproject's package-dir: installed package name -> folder."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def _modules() -> Iterator[tuple[str, Path]]:
    """(module name, file) of every Python module of the distribution."""
    dirs = _package_dirs()
    seen: set[Path] = set()
    # The longest package first: kvbeam.pools owns pools/, not kvbeam (were they nested).
    for package, folder in sorted(dirs.items(), key=lambda item: -len(item[0])):
        for path in sorted(folder.rglob("*.py")):
            if path in seen or path.name.endswith("_pb2.py") or path.name.endswith(
                    "_pb2_grpc.py"):
                continue
            seen.add(path)
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def layer_of(module: str) -> str:
    """The layer that holds ``module``."""
    for layer, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _imports(module: str, path: Path, modules: set[str]) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in the file, relative ones resolved;
    ``from package import module`` counts as the module, not its package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in modules else target


def _allowed(layer: str, target: str) -> bool:
    target_layer = layer_of(target)
    if target_layer == layer:
        return True
    rules = MAY_IMPORT[layer]
    return target_layer in rules or any(
        rule == f"{target_layer}:{target}" or (rule.startswith(f"{target_layer}:")
                                               and target.startswith(rule.partition(":")[2] + "."))
        for rule in rules)


def test_every_module_is_in_a_layer_and_the_walk_found_the_mapped_folders() -> None:
    modules = dict(_modules())
    layers = {layer_of(m) for m in modules}
    assert layers == set(MAY_IMPORT), layers ^ set(MAY_IMPORT)
    # The mapped folders were walked (not only kvbeam/).
    for name in ("kvbeam.pools.plan", "kvbeam.proto.peer_frames", "kvbeam.transport.host",
                 "kvbeam.server.core.prefill", "kvbeam.engine.requests"):
        assert name in modules, name


def test_every_import_goes_down_the_layers() -> None:
    modules = dict(_modules())
    names = set(modules)
    wrong = []
    for module, path in modules.items():
        layer = layer_of(module)
        for line, target in _imports(module, path, names):
            if target.split(".")[0] == "grpc" and layer not in GRPC_LAYERS:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports grpc")
            if target not in names:  # a third-party or standard module
                continue
            if not _allowed(layer, target):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {layer} ({module}) imports "
                             f"{layer_of(target)} ({target})")
    assert wrong == [], "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize(("module", "target", "allowed"), [
    ("kvbeam.server.core.prefill", "kvbeam.server.peers.calls", False),
    ("kvbeam.server.core.prefill", "kvbeam.server.state.peers", True),
    ("kvbeam.server.core.prefill", "kvbeam.server.api.prefill", False),
    ("kvbeam.server.engines.channel", "kvbeam.server.peers.channel", False),
    ("kvbeam.server.peers.calls", "kvbeam.server.runtime", False),
    ("kvbeam.server.state.lifecycle", "kvbeam.server.core.prefill", False),
    ("kvbeam.engine.requests", "kvbeam.client", False),
    ("kvbeam.integrations.vllm.connector", "kvbeam.auth", True),
    ("kvbeam.integrations.vllm.connector", "kvbeam.auth_grpc", False),
    ("kvbeam.pools.plan", "kvbeam.proto.side", False),
    ("kvbeam.client", "kvbeam.server.settings", False),
    ("kvbeam.commands.prefill", "kvbeam.server.settings", True),
])
def test_the_rules_refuse_what_they_should(module: str, target: str, allowed: bool) -> None:
    """The table's verdicts on known cases (negative controls for the walk above)."""
    assert _allowed(layer_of(module), target) is allowed
