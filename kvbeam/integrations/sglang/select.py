"""Make ``--disaggregation-transfer-backend kvbeam`` resolve to kvbeam's classes.

sglang's backends are a closed ``TransferBackend`` enum resolved
by ``get_kv_class()`` (``sglang.srt.disaggregation.utils``), and the flag's choices
are a list (``sglang.srt.arg_groups.choices``). :func:`install` adds ``KVBEAM =
"kvbeam"`` to the enum and the choices, and wraps ``get_kv_class`` (also where
modules already imported it by name), in the current process. It checks every
internal it touches first and raises :class:`SglangMismatch`, naming the sglang
version this was written against, when one moved. It must run before sglang builds its
server args, in every process that resolves the backend: sglang's plugin loader calls
it in each of them through kvbeam's entry point
(:mod:`kvbeam.integrations.sglang.plugin`, docs/sglang.md).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvbeam.errors import SglangMismatch

#: the sglang release these internals were read from and tested against
EXPECTED_SGLANG = "0.5.23"
BACKEND = "kvbeam"
__all__ = ["BACKEND", "EXPECTED_SGLANG", "SglangMismatch", "install"]
_CLASS_TYPES = ("KVARGS", "MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # any failure means "unknown"
        return "unknown"


def _fail(what: str) -> SglangMismatch:
    return SglangMismatch(
        f"kvbeam's sglang backend selection expects sglang {EXPECTED_SGLANG} (found "
        f"{_version()}): {what}; pin sglang=={EXPECTED_SGLANG} or update "
        "kvbeam/integrations/sglang/select.py")


def _check(utils: ModuleType) -> tuple[type[enum.Enum], Any, Callable[..., Any]]:
    backend = getattr(utils, "TransferBackend", None)
    if not (isinstance(backend, type) and issubclass(backend, enum.Enum)
            and "MOONCAKE" in backend.__members__):
        raise _fail(f"{utils.__name__}.TransferBackend is not the backend enum")
    class_type = getattr(utils, "KVClassType", None)
    if class_type is None or any(n not in class_type.__members__ for n in _CLASS_TYPES):
        raise _fail(f"{utils.__name__}.KVClassType lacks one of {', '.join(_CLASS_TYPES)}")
    get = getattr(utils, "get_kv_class", None)
    if not callable(get):
        raise _fail(f"{utils.__name__}.get_kv_class is missing")
    return backend, class_type, get


def _add_member(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add ``name = value`` to an existing enum (what third-party backends do)."""
    if value in cls._value2member_map_:
        return cls._value2member_map_[value]
    member = object.__new__(cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)  # enum's own __setattr__ refuses new members
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def install(utils: ModuleType | None = None, choices: list[str] | None = None) -> None:
    """Register the ``kvbeam`` backend in sglang (idempotent).

    Args:
        utils: ``sglang.srt.disaggregation.utils`` (imported when None).
        choices: the flag's choice list (``DISAGG_TRANSFER_BACKEND_CHOICES`` when None).

    Raises:
        SglangMismatch: an internal moved or changed shape.
    """
    if utils is None:
        import sglang.srt.disaggregation.utils as sglang_utils

        utils = sglang_utils
    backend_enum, class_type, original = _check(utils)
    if choices is None:
        try:
            from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
        except ImportError as exc:
            raise _fail(f"no sglang.srt.arg_groups.choices ({exc})") from exc
        choices = DISAGG_TRANSFER_BACKEND_CHOICES
    if getattr(original, "_kvbeam", False):
        return
    member = _add_member(backend_enum, BACKEND.upper(), BACKEND)
    if BACKEND not in choices:
        choices.append(BACKEND)

    def get_kv_class(transfer_backend: Any, class_type_: Any) -> Any:
        if transfer_backend is member and class_type_ is not class_type.KVARGS:
            from kvbeam.integrations.sglang import conn

            return {class_type.MANAGER: conn.KvbeamKVManager,
                    class_type.SENDER: conn.KvbeamKVSender,
                    class_type.RECEIVER: conn.KvbeamKVReceiver,
                    class_type.BOOTSTRAP_SERVER: conn.KvbeamKVBootstrapServer,
                    }.get(class_type_)
        return original(transfer_backend, class_type_)

    get_kv_class._kvbeam = True  # type: ignore[attr-defined]
    get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
    # prefill.py, decode.py and disagg_service import get_kv_class by name. Read each
    # module's own namespace: a lazy module's __getattr__ (transformers') would import.
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("get_kv_class") is original:
            module.get_kv_class = get_kv_class  # type: ignore[attr-defined]
    vars(utils)["get_kv_class"] = get_kv_class
