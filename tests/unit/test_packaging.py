"""One name per module: the top-level folders are installed as ``kvbeam.*`` and only that.

pyproject's ``package-dir`` maps ``pools/`` to ``kvbeam.pools`` (and proto/, transport/,
server/ likewise). A second path to the same file (a symlink ``kvbeam/pools``, an
``import pools`` that works because the repository is on sys.path) would load the module
twice, with its own classes and enums, and ``isinstance`` would fail across the two.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAPPED_FOLDERS = ("pools", "proto", "transport", "server")
SKIP_DIRS = {"build", "dist", "__pycache__"}


def _package_dir() -> dict[str, str]:
    with (REPO / "pyproject.toml").open("rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return mapping


def _python_files() -> list[Path]:
    files = []
    for top, dirs, names in os.walk(REPO):
        # Not into a venv, caches or build output (CI's venv is .venv in the checkout).
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        files += [Path(top, n) for n in names if n.endswith(".py")]
    return files


def _import_all() -> list[str]:
    """Import every module of every mapped package; the names imported."""
    names = []
    for package in _package_dir():
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                # The RDMA modules need Debian's pyverbs (make setup links it) and the vLLM
                # connector needs vLLM (its own venv, make test-vllm); nothing else may be missing.
                if (exc.name or "").split(".")[0] not in ("pyverbs", "vllm"):
                    raise
                continue
            names.append(info.name)
    return names


def test_package_dir_maps_each_top_level_folder() -> None:
    expected = {"kvbeam": "kvbeam"} | {f"kvbeam.{f}": f for f in MAPPED_FOLDERS}
    assert _package_dir() == expected


def test_no_symlinks_in_the_package_folders() -> None:
    for folder in _package_dir().values():
        links = [p for p in (REPO / folder).rglob("*") if p.is_symlink()]
        assert not links, f"symlinks give modules a second path: {links}"


def test_each_package_is_imported_from_its_folder_in_this_tree() -> None:
    # Also catches an install of another checkout answering for part of the package.
    for package, folder in _package_dir().items():
        module = importlib.import_module(package)
        assert module.__file__ is not None
        assert Path(module.__file__).resolve() == REPO / folder / "__init__.py", package


def test_every_module_is_loaded_once_under_one_name() -> None:
    imported = _import_all()
    assert "kvbeam.pools.plan" in imported and "kvbeam.proto.kvbeam.v1.kvbeam_pb2" in imported
    # Only the package's own folders: the venv may live inside the checkout (.venv).
    folders = [REPO / folder for folder in _package_dir().values()]
    by_file: dict[Path, list[str]] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and any(Path(file).resolve().is_relative_to(f) for f in folders):
            by_file.setdefault(Path(file).resolve(), []).append(name)
    twice = {str(f): names for f, names in by_file.items() if len(names) > 1}
    assert not twice, f"modules loaded under two names: {twice}"
    shadows = [name for name in sys.modules if name.split(".")[0] in MAPPED_FOLDERS]
    assert not shadows, f"mapped folders imported as top-level packages: {shadows}"


def test_no_code_imports_a_mapped_folder_as_a_top_level_package() -> None:
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {m}" for m in modules
                          if m.split(".")[0] in MAPPED_FOLDERS]
    assert not offenders, "import kvbeam.<folder> instead:\n" + "\n".join(offenders)


def test_wheel_holds_each_file_once_under_its_package_name(tmp_path: Path) -> None:
    # Built from a copy: a build writes build/ and *.egg-info next to setup.py.
    src = tmp_path / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    for folder in _package_dir().values():
        shutil.copytree(REPO / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "wheel").glob("kvbeam-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if ".dist-info/" not in n]
    assert len(names) == len(set(names))
    expected = set()
    for package, folder in _package_dir().items():
        prefix = package.replace(".", "/")
        for path in (src / folder).rglob("*"):
            if path.suffix in (".py", ".pyi", ".proto") or path.name == "py.typed":
                expected.add(f"{prefix}/{path.relative_to(src / folder).as_posix()}")
    # The compiled helpers, built by the wheel's own build (setup.py; libibverbs-dev,
    # libxxhash-dev; the planner and the blocks helper need only the compiler), and
    # their sources (an extension's sources are package data to setuptools).
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    expected |= {"kvbeam/transport/verbs/_post" + suffix, "kvbeam/transport/verbs/_post.c",
                 "kvbeam/transport/verbs/_dmabuf" + suffix, "kvbeam/transport/verbs/_dmabuf.c",
                 "kvbeam/transport/verbs/_pyverbs_layout.h",
                 "kvbeam/pools/_xxh3" + suffix, "kvbeam/pools/_xxh3.c",
                 "kvbeam/pools/_xxh3_avx2.c", "kvbeam/pools/_xxh3_loop.h",
                 "kvbeam/pools/_xxh3_arch.h",
                 "kvbeam/pools/_plan" + suffix, "kvbeam/pools/_plan.c",
                 "kvbeam/pools/_owners" + suffix, "kvbeam/pools/_owners.c",
                 "kvbeam/pools/_int64_buffer.h",
                 "kvbeam/transport/_blocks" + suffix, "kvbeam/transport/_blocks.c",
                 "kvbeam/proto/_frames" + suffix, "kvbeam/proto/_frames.c"}
    assert set(names) == expected
    assert {"kvbeam/py.typed", "kvbeam/pools/plan.py", "kvbeam/proto/kvbeam/v1/kvbeam.proto",
            "kvbeam/proto/kvbeam/v1/kvbeam_pb2.pyi"} <= set(names)
