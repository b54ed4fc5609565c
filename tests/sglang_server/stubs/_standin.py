"""Import-only stand-in packages: every submodule imports, every name raises when used.

``install(package)`` in a stand-in package's ``__init__`` serves any
``package.sub.module`` from a finder on ``sys.meta_path``; each attribute of such a
module is a :class:`StandIn` whose call raises, so a test that reaches one fails loudly
instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

#: What the stand-ins say their version is (transformers compares torchvision's).
VERSION = "0.0.0+kvbeam.standin"


class StandIn:
    """Raises on every call; attribute chains and subclassing work at import time."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> StandIn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{self._name} is an import-only stand-in (tests/sglang_server/"
                           "stubs): the sglang server test reached code it must not use")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __or__(self, other: Any) -> StandIn:  # ``X | tvF.InterpolationMode`` annotations
        return self

    __ror__ = __or__


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(package: types.ModuleType) -> None:
    """Make ``package`` (a stand-in's ``__init__``) a stand-in with stand-in submodules."""
    sys.meta_path.insert(0, _Finder(package.__name__ + "."))
    package.__class__ = _Module
    package.__version__ = VERSION  # type: ignore[attr-defined]
