"""Package boundaries: what each layer may import, and where errors are defined.

The wire protocol, the pool layouts, the data plane and the public client must work
without the daemons' package (``kvbeam.server``): a scheduler process imports the
client, never the daemons. Each check runs in a fresh interpreter, so a module
another test imported earlier cannot hide (or fake) an import.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import kvbeam
import kvbeam.errors

#: Every package of the distribution: kvbeam/ and the top-level folders that
#: pyproject's package-dir maps below it (walking kvbeam/ alone would miss those).
PACKAGES = ("kvbeam", "kvbeam.pools", "kvbeam.proto", "kvbeam.transport", "kvbeam.server")


def _submodules(package: str) -> list[str]:
    module = importlib.import_module(package)
    return [package, *(m.name for m in pkgutil.walk_packages(module.__path__, f"{package}."))]


def _loaded_after(imports: list[str]) -> set[str]:
    """The module names in sys.modules of a fresh interpreter after importing ``imports``."""
    code = ("import importlib, sys\n"
            f"for name in {imports!r}:\n"
            "    importlib.import_module(name)\n"
            "print('\\n'.join(sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize("imports", [
    _submodules("kvbeam.proto"),
    _submodules("kvbeam.pools"),
    _submodules("kvbeam.transport"),
    ["kvbeam.client", "kvbeam.scheduler", "kvbeam.procs", "kvbeam.states", "kvbeam.rpc_errors",
     "kvbeam.auth", "kvbeam.auth_grpc", "kvbeam.logs", "kvbeam.control_channel"],
], ids=["proto", "pools", "transport", "client"])
def test_layers_below_the_daemons_never_import_them(imports: list[str]) -> None:
    loaded = _loaded_after(imports)
    assert any(name in loaded for name in imports)  # the probe imported something
    assert sorted(n for n in loaded if n.startswith("kvbeam.server")) == []


def test_the_error_hierarchy_imports_no_grpc() -> None:
    loaded = _loaded_after(["kvbeam.errors"])
    assert "kvbeam.errors" in loaded
    assert "grpc" not in loaded
    assert sorted(n for n in loaded if n.startswith("kvbeam.") and n != "kvbeam.errors") == []


def test_the_credentials_import_no_grpc() -> None:
    """Engines read their credentials (kvbeam.auth) without gRPC; only kvbeam.auth_grpc,
    which servers and channels use, imports it."""
    loaded = _loaded_after(["kvbeam.auth"])
    assert "kvbeam.auth" in loaded
    assert "grpc" not in loaded and "kvbeam.auth_grpc" not in loaded
    assert "grpc" in _loaded_after(["kvbeam.auth_grpc"])


def test_every_exception_class_is_defined_in_kvbeam_errors() -> None:
    strays = []
    names = [name for package in PACKAGES for name in _submodules(package)]
    assert "kvbeam.server.core.prefill" in names and "kvbeam.pools.plan" in names
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # The RDMA modules need Debian's pyverbs; the vLLM connector needs vLLM, which
            # lives in its own venv (make test-vllm).
            if (exc.name or "").split(".")[0] in ("pyverbs", "vllm"):
                continue
            raise
        for attr, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == name and name != "kvbeam.errors"):
                strays.append(f"{name}.{attr}")
    assert strays == []


def test_every_kvbeam_error_derives_from_kvbeam_error() -> None:
    classes = [v for v in vars(kvbeam.errors).values()
               if inspect.isclass(v) and issubclass(v, BaseException)
               and v.__module__ == "kvbeam.errors"]
    assert len(classes) > 20
    assert all(issubclass(c, kvbeam.KvbeamError) for c in classes)
