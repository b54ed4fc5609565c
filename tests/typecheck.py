"""mypy over the package as installed: ``python -m tests.typecheck [mypy arguments]``.

pyproject.toml maps top-level folders into the package (``package-dir``: ``pools/`` is
``kvbeam.pools``). mypy names a file after the folders it sits in (``pools/plan.py`` would
be ``pools.plan``) and cannot follow setuptools' editable import hook, so plain ``mypy``
does not find ``kvbeam.pools``. This runs mypy with every file under each mapped folder
given under its installed name; the other arguments and the ``[tool.mypy]`` settings
(``files``: the tests) are mypy's own. `make lint` runs it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build, util
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def package_dir() -> dict[str, str]:
    """pyproject's ``[tool.setuptools] package-dir``: package name -> folder."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return mapping


def mapped_sources() -> list[BuildSource]:
    """Every module under each mapped folder, named as installed (a stub over its .py)."""
    sources = []
    for package, folder in package_dir().items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            if path.suffix == ".py" and path.with_suffix(".pyi").exists():
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join([package, *parts])
            sources.append(BuildSource(str(path.relative_to(ROOT)), module))
    return sources


def _under_mapped_folder(source: BuildSource) -> bool:
    """Whether mypy found this file under a mapped folder (it would name it wrongly)."""
    if source.path is None:
        return False
    path = Path(source.path).resolve()
    return any(path.is_relative_to(ROOT / folder) for folder in package_dir().values())


def main(args: list[str]) -> int:
    """Run mypy; the exit status is mypy's (0 clean, 1 errors, 2 a blocking error)."""
    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache, require_targets=False)
    sources = [s for s in sources if not _under_mapped_folder(s)] + mapped_sources()
    messages: list[str] = []

    def flush_errors(_file: str | None, new: list[str], serious: bool) -> None:
        messages.extend(new)
        out = sys.stderr if serious else sys.stdout
        for message in new:
            out.write(message + "\n")

    blockers = False
    try:
        build.build(sources, options, None, flush_errors, fscache, sys.stdout, sys.stderr)
    except CompileError:
        blockers = True
    n_errors, _notes, n_files = util.count_stats(messages)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    if n_errors or blockers:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
        return 2 if blockers else 1
    print(formatter.format_success(len(sources)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
