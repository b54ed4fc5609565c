"""Throwaway certificate authorities and certificates for the mTLS tests (``openssl`` CLI).

No Python dependency: the ``openssl`` binary makes a CA and certificates signed
by it, with ``subjectAltName`` ``localhost``/``127.0.0.1`` and both server and
client key usage (a daemon presents the same certificate in both roles).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvbeam.auth import Security

#: The names every test certificate carries unless told otherwise (loopback daemons).
LOOPBACK_SANS = "DNS:localhost,IP:127.0.0.1"
_EXT = ("subjectAltName={sans}\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n")
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pki:
    """One CA and the files of certificates it signed."""

    dir: Path
    ca: Path

    def issue(self, name: str, sans: str = LOOPBACK_SANS) -> tuple[Path, Path]:
        """A certificate and key for ``name`` (CN) naming ``sans`` (openssl's
        subjectAltName syntax), signed by this CA: ``(cert, key)``."""
        key, csr, cert = (self.dir / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
                 cwd=self.dir)
        ext = self.dir / "ext.cnf"
        ext.write_text(_EXT.format(sans=sans))
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey",
                 str(self.dir / "ca.key"), "-CAcreateserial", "-out", str(cert), "-days", "2",
                 "-extfile", str(ext), cwd=self.dir)
        return cert, key

    def flags(self, name: str, sans: str = LOOPBACK_SANS) -> list[str]:
        """The ``--tls-cert/--tls-key/--tls-ca`` flags presenting a fresh certificate for
        ``name`` (daemons and client commands take the same)."""
        cert, key = self.issue(name, sans)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca)]

    def security(self, name: str, sans: str = LOOPBACK_SANS, **kw: object) -> Security:
        """A :class:`Security` presenting a fresh certificate for ``name`` and trusting this CA."""
        cert, key = self.issue(name, sans)
        return Security(tls_cert=str(cert), tls_key=str(key), tls_ca=str(self.ca),
                        **kw)  # type: ignore[arg-type]


def make_pki(directory: Path, name: str = "kvbeam-test-ca") -> Pki:
    """A fresh self-signed CA in ``directory``."""
    if shutil.which("openssl") is None:  # a missing tool must fail the mTLS tests, not skip them
        raise RuntimeError("the openssl CLI is needed to make test certificates "
                           "(apt-get install openssl; make system-deps)")
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=directory)
    return Pki(directory, directory / "ca.pem")
