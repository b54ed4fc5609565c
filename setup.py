"""Package list for the package-dir mapping in pyproject.toml (everything else is there).

pyproject.toml cannot list packages found under a mapped folder (``packages.find`` names
them after the folder, ``pools.x``, not ``kvbeam.pools.x``), so this lists them: every
package under each mapped folder, named after its mapping.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]


def mapped_packages() -> list[str]:
    """Every package under each mapped folder, named after its mapping (``kvbeam.pools.x``)."""
    packages = []
    for name, folder in PACKAGE_DIR.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    # kvbeam/ itself holds no mapped folder any more; a nested name would be listed twice.
    return sorted(set(packages))


setup(packages=mapped_packages())
