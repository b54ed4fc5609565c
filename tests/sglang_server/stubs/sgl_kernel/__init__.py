"""Import-only stand-in for sgl_kernel (tests/sglang_server/stubs/README.md)."""

import sys

import _standin

_standin.install(sys.modules[__name__])
