"""sglang's plugin entry point: the ``kvbeam`` backend in every sglang process.

sglang 0.5.23 runs every function registered in the ``sglang.srt.plugins`` entry-point
group (``sglang.srt.plugins.load_plugins``) in each process it starts: the launcher
before it parses the server arguments, and each scheduler, detokenizer and data-
parallel controller it spawns. kvbeam's pyproject.toml registers :func:`load` there,
so an installed kvbeam makes ``--disaggregation-transfer-backend kvbeam`` resolve in
all of them with sglang's own ``python -m sglang.launch_server`` (docs/sglang.md). No
sglang import until sglang calls it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: ``name = value`` of the entry point pyproject.toml declares (tests compare the two).
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "kvbeam = kvbeam.integrations.sglang.plugin:load"


def load() -> None:
    """Register the backend (:func:`~kvbeam.integrations.sglang.select.install`) and
    kvbeam's shareable pool memory (:func:`~kvbeam.integrations.sglang.memory.install`)
    in this process; idempotent.

    Raises:
        SglangMismatch: sglang's internals are not 0.5.23's (sglang logs it and goes on
            without the backend; the flag's choices then lack ``kvbeam``).
    """
    from kvbeam.integrations.sglang import memory, select

    select.install()
    memory.install()
    log.info("kvbeam sglang backend registered (sglang plugin)")
