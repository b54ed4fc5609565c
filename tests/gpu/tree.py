"""Run kvbeam from the source tree with no install: a temporary symlink farm (stdlib only).

The package-dir mapping (pyproject.toml: ``kvbeam.pools`` is ``pools/``, ...) means the
repository itself is not importable as ``kvbeam``: an install (editable or wheel) maps
it. A machine that has only a copy of the tree and a system Python (the GPU machine
the GPU check runs on) gets :func:`farm`: a temporary directory whose ``kvbeam/`` is the
mapping made of real directories and symlinks to the tree's files, put first on
``sys.path`` and on ``PYTHONPATH`` (so the daemons and engines this process starts
import the same code). The layout of the repository is not touched.

The compiled helpers (setup.py's extensions) are linked from the tree when they were
built for this interpreter, else built into the farm with ``setup.py build_ext``
(setuptools and a C compiler; each helper is optional: one that does not build is
replaced by its Python path, and the check says so). Wheels that travel with the tree
(``make gpu-wheels``: what the machine's Python may lack) are unpacked into the farm and
come after the tree on the paths, before the machine's own packages.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP = {"__pycache__"}


def package_dir() -> dict[str, str]:
    """pyproject.toml's package-dir: package name -> folder."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping: dict[str, str] = data["tool"]["setuptools"]["package-dir"]
    return mapping


def _mirror(src: Path, dst: Path, suffix: str) -> None:
    """Real directories, a symlink per file; compiled modules only for this interpreter."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name in SKIP or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            _mirror(entry, dst / entry.name, suffix)
        elif entry.suffix == ".so" and not entry.name.endswith(suffix):
            continue  # built for another interpreter
        else:
            (dst / entry.name).symlink_to(entry)


def _missing_helpers(root: Path, suffix: str) -> list[str]:
    """setup.py's extensions with no module for this interpreter in the farm."""
    text = (REPO / "setup.py").read_text()
    names = [line.split('Extension("', 1)[1].split('"', 1)[0]
             for line in text.splitlines() if 'Extension("' in line]
    return [n for n in names if not (root / (n.replace(".", "/") + suffix)).exists()]


def _build(root: Path, missing: list[str]) -> str:
    """Build the compiled helpers into the farm; one line saying what happened."""
    if importlib.util.find_spec("setuptools") is None:
        return (f"compiled helpers: not built (no setuptools): {', '.join(missing)} run "
                "their Python paths")
    temp = tempfile.mkdtemp(prefix="kvbeam-build-")
    try:
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                               str(root), "--build-temp", temp, "-j", str(os.cpu_count() or 2)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "compiled helpers: build timed out after 300 s: their Python paths run"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    still = _missing_helpers(root, sysconfig.get_config_var("EXT_SUFFIX"))
    built = [n for n in missing if n not in still]
    line = f"compiled helpers: built {', '.join(built) or 'none'}"
    if still:
        why = [w for w in (proc.stderr + proc.stdout).splitlines() if "error" in w.lower()]
        line += (f"; not built (their Python paths run): {', '.join(still)}"
                 + (f" ({why[0].strip()[:160]})" if why else ""))
    return line


def farm(wheels: str = "", build: bool = False) -> tuple[Path, list[str]]:
    """Make the farm, put it (and ``wheels``' pure wheels) on the import paths; returns it
    and the lines to print. ``build``: build every compiled helper into it even when the
    tree has them (what a fresh copy of the tree does). The caller removes the farm at
    exit (:func:`remove`)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    root = Path(tempfile.mkdtemp(prefix="kvbeam-tree-"))
    for package, folder in sorted(package_dir().items()):
        _mirror(REPO / folder, root / package.replace(".", "/"),
                "(none: build them)" if build else suffix)
    lines = [f"kvbeam from the tree {REPO} through {root} (no install)"]
    missing = _missing_helpers(root, suffix)
    lines.append(_build(root, missing) if missing else
                 "compiled helpers: the tree's own, built for this interpreter")
    paths = [str(root), str(REPO)]
    if wheels:
        paths.append(str(root / "wheels"))
        lines.append(unpack_wheels(Path(wheels), root / "wheels"))
    use_paths(paths)
    return root, lines


def unpack_wheels(folder: Path, into: Path) -> str:
    """Unpack every wheel in ``folder`` into ``into`` (a wheel is a zip of what its
    install puts in site-packages; compiled ones need this interpreter's tag)."""
    found = sorted(folder.glob("*.whl"))
    into.mkdir(parents=True, exist_ok=True)
    for whl in found:
        with zipfile.ZipFile(whl) as z:
            z.extractall(into)
    return f"wheels from {folder}: {', '.join(w.name for w in found) or 'none'}"


def use_paths(paths: list[str]) -> None:
    """``paths`` first on this process's ``sys.path`` and its children's ``PYTHONPATH``."""
    for p in reversed(paths):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])


def remove(root: Path) -> None:
    """Remove the farm."""
    shutil.rmtree(root, ignore_errors=True)
