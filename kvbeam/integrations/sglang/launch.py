"""``python -m kvbeam.integrations.sglang.launch [sglang launch_server flags]``.

sglang's ``launch_server`` with the ``kvbeam`` backend registered. The registration
runs at import, so the scheduler processes sglang spawns (which import the main
module again) have it too.
"""

from __future__ import annotations

import runpy

from kvbeam.integrations.sglang.select import install

install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
