"""``python -m kvbeam.integrations.sglang.launch [sglang launch_server flags]``.

sglang's ``launch_server`` with the ``kvbeam`` backend registered. The registration
runs when this module is the main one, and again in the scheduler processes sglang
spawns (they import the main module as ``__mp_main__``). Importing it otherwise
does nothing.
"""

from __future__ import annotations

import runpy

from kvbeam.integrations.sglang.select import install

if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
