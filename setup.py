"""Package list for the package-dir mapping in pyproject.toml, and the optional compiled helpers.

pyproject.toml cannot list packages found under a mapped folder (``packages.find`` names
them after the folder, ``pools.x``, not ``kvbeam.pools.x``), so this lists them: every
package under each mapped folder, named after its mapping.

``kvbeam.transport.verbs._post`` (transport/verbs/_post.c) posts RDMA WRITE chains from the
prepared WR arrays without Python per WR. It needs <infiniband/verbs.h> (Debian's
libibverbs-dev, in the Makefile's system-deps) and is optional: where it cannot be built
the install goes on and the RDMA transport posts through pyverbs objects instead
(docs/performance.md, "WR posting"). An editable install builds it in place
(transport/verbs/_post.*.so); so does ``python setup.py build_ext --inplace``.

``kvbeam.transport.verbs._dmabuf`` (transport/verbs/_dmabuf.c) registers an engine's dma-buf
(GPU memory) with ``ibv_reg_dmabuf_mr`` on the RDMA transport's PD. It needs
<infiniband/verbs.h> too and resolves libibverbs at run time; without it a dma-buf attach
over RDMA is refused, naming it (docs/gpu.md).

``kvbeam.pools._xxh3`` (pools/_xxh3.c) computes a request's integrity digests in one call
with the GIL released. It needs <xxhash.h> (Debian's libxxhash-dev) and is optional the
same way: without it digests go through python-xxhash (docs/performance.md, "Digests").

``kvbeam.pools._plan`` (pools/_plan.c) builds a request's transfer plan in one call; without
it plans are built in Python and numpy (``kvbeam.pools.plan``), the same blocks.

``kvbeam.transport._blocks`` (transport/_blocks.c) checks a write's blocks against both
sides' regions and slices them, lays out the TCP stream's frames and checks a received
frame's descriptors, one call each; without it numpy does (``kvbeam.transport.core``).

``kvbeam.pools._owners`` (pools/_owners.c) enters and frees decode's claims on its items
(``kvbeam.server.core.decode_pages``), one call each; without it numpy does.

``kvbeam.proto._frames`` (proto/_frames.c) packs and unpacks the engine channel's index
lists (``kvbeam.proto.engine_frames``), one call per frame, on the engine and the daemon;
without it numpy does.
"""

import tomllib
from pathlib import Path

from setuptools import Extension, find_packages, setup

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


# optional: a failed build is a warning, not a failed install (the pyverbs poster remains).
# No libibverbs link: ibv_post_send is an inline of verbs.h, and pyverbs loads the library.
POSTER = Extension("kvbeam.transport.verbs._post", ["transport/verbs/_post.c"],
                   depends=["transport/verbs/_pyverbs_layout.h"], optional=True,
                   extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too: without it a dma-buf attach over RDMA is refused (libibverbs found at run time).
DMABUF = Extension("kvbeam.transport.verbs._dmabuf", ["transport/verbs/_dmabuf.c"],
                   depends=["transport/verbs/_pyverbs_layout.h"], optional=True,
                   extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too: without <xxhash.h> (libxxhash-dev) digests go through python-xxhash.
DIGESTER = Extension("kvbeam.pools._xxh3", ["pools/_xxh3.c", "pools/_xxh3_avx2.c"],
                     depends=["pools/_xxh3_loop.h", "pools/_xxh3_arch.h", "pools/_int64_buffer.h"],
                     optional=True,
                     extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too, and needs nothing but a C compiler: without it plans are built in Python
# and numpy.
PLANNER = Extension("kvbeam.pools._plan", ["pools/_plan.c"],
                    depends=["pools/_int64_buffer.h"], optional=True,
                    extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too, and needs nothing but a C compiler: without it writes are checked,
# sliced and framed with numpy.
BLOCKS = Extension("kvbeam.transport._blocks", ["transport/_blocks.c"], optional=True,
                   extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too: without it decode's claims on its items go through numpy.
OWNERS = Extension("kvbeam.pools._owners", ["pools/_owners.c"],
                   depends=["pools/_int64_buffer.h"], optional=True,
                   extra_compile_args=["-O2", "-std=c11", "-Wall"])

# optional too: without it the engine channel's index lists are coded with numpy.
FRAMES = Extension("kvbeam.proto._frames", ["proto/_frames.c"], optional=True,
                   extra_compile_args=["-O2", "-std=c11", "-Wall"])

setup(packages=mapped_packages(),
      ext_modules=[POSTER, DMABUF, DIGESTER, PLANNER, BLOCKS, OWNERS, FRAMES])
