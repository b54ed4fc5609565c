"""A docker engine, the offline base image, the wheelhouse and the kvbeam image for tests.

Everything here works without a registry: the base image comes from ``debootstrap
--variant=minbase bookworm`` plus ``docker import``, the Python packages from a
wheelhouse filled from the machine's pip configuration (torch's CPU wheel). Caches
live in ``.docker-cache/`` (ignored by git): the base rootfs tarball and the wheels.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVBEAM_DOCKER_CACHE", REPO / ".docker-cache"))
BASE_IMAGE = os.environ.get("KVBEAM_TEST_BASE_IMAGE", "kvbeam-base:bookworm")
IMAGE = os.environ.get("KVBEAM_TEST_IMAGE", "kvbeam:compose-test")
DEBIAN_MIRROR = os.environ.get("KVBEAM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: The packages the image needs, pinned like pyproject.toml's dependencies.
#: The image pins torch to the CPU wheel this machine has (an unpinned torch pulls CUDA).
TORCH_PIN = "torch==2.13.0"


def wheel_requirements() -> list[str]:
    """Everything the image installs: kvbeam's own dependencies and build requirements,
    read from pyproject.toml (one list to keep), with torch pinned."""
    with (REPO / "pyproject.toml").open("rb") as f:
        meta = tomllib.load(f)
    deps = [d for d in meta["project"]["dependencies"] if not d.startswith("torch")]
    return [TORCH_PIN, *deps, *meta["build-system"]["requires"]]


class DockerSetupError(RuntimeError):
    """The docker engine, base image, wheelhouse or image could not be prepared."""


def run(cmd: Sequence[str], *, timeout: float = 600, check: bool = True,
        env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output; on failure raise with the output attached."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd, check=False)
    if check and proc.returncode != 0:
        raise DockerSetupError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                               f"--- stdout ---\n{proc.stdout[-4000:]}\n"
                               f"--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def engine_up() -> bool:
    """True when ``docker info`` reaches an engine."""
    try:
        return run(["docker", "info"], timeout=20, check=False).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


@dataclass
class Timings:
    """Seconds each preparation step took (printed by the tests, quoted in the docs)."""

    steps: dict[str, float]

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the block as ``name``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.steps[name] = round(time.monotonic() - t0, 1)


@contextmanager
def docker_engine(timings: Timings) -> Iterator[None]:
    """Use the running engine, or start dockerd, and at the end stop it by its PID and
    undo its iptables and ip_forward changes."""
    if engine_up():
        log.info("using the running docker engine")
        yield
        return
    if shutil.which("dockerd") is None:
        raise DockerSetupError("dockerd is not installed: apt-get install docker.io containerd "
                               "runc iptables docker-compose debootstrap (make system-deps)")
    rules = run(["iptables-save"], check=False).stdout
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    CACHE.mkdir(parents=True, exist_ok=True)
    logfile = (CACHE / "dockerd.log").open("w")
    with timings.step("dockerd start"):
        proc = subprocess.Popen(["dockerd"], stdout=logfile, stderr=subprocess.STDOUT,
                                start_new_session=True)
        end = time.monotonic() + 60
        while not engine_up():
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                raise DockerSetupError(f"dockerd did not come up (exit {proc.poll()}); "
                                       f"see {CACHE / 'dockerd.log'}")
            time.sleep(0.5)
    log.info("started dockerd, PID %d", proc.pid)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        logfile.close()
        restore_network(rules, forward)
        log.info("stopped dockerd (PID %d), restored iptables and ip_forward", proc.pid)


def restore_network(saved_rules: str, ip_forward: str) -> None:
    """Undo dockerd's host changes: the iptables rules as saved before it started (tables
    it added are emptied, FORWARD's policy back to ACCEPT), ip_forward, the docker0 bridge."""
    if saved_rules.strip():
        subprocess.run(["iptables-restore"], input=saved_rules, text=True, check=False)
    for table in ("filter", "nat"):
        if f"*{table}" not in saved_rules:
            steps = [["-F"], ["-X"]] + ([["-P", "FORWARD", "ACCEPT"]] if table == "filter" else [])
            for args in steps:
                subprocess.run(["iptables", "-t", table, *args], capture_output=True, check=False)
    Path("/proc/sys/net/ipv4/ip_forward").write_text(ip_forward + "\n")
    subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True, check=False)


def image_exists(name: str) -> bool:
    """True when the engine has image ``name``."""
    return run(["docker", "image", "inspect", name], check=False).returncode == 0


def ensure_base_image(timings: Timings) -> str:
    """The local Debian bookworm base image: imported from the cached rootfs tarball,
    made with debootstrap the first time (about a minute)."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    tarball = CACHE / "base-bookworm.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            raise DockerSetupError("debootstrap is not installed (make system-deps)")
        rootfs = CACHE / "rootfs.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        with timings.step("debootstrap"):
            run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR],
                timeout=900)
            run(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".tmp", "."])
            os.replace(str(tarball) + ".tmp", tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
    with timings.step("base import"):
        run(["docker", "import", str(tarball), BASE_IMAGE])
    return BASE_IMAGE


def ensure_wheelhouse(timings: Timings) -> Path:
    """``.docker-cache/wheels``: every wheel the image installs, fetched once through the
    machine's pip configuration (here: torch's CPU wheel from the local find-links)."""
    wheels = CACHE / "wheels"
    wanted = wheel_requirements()
    stamp = wheels / "requirements.txt"  # what the cached wheels were fetched for
    if stamp.is_file() and stamp.read_text().split() == wanted:
        return wheels
    wheels.mkdir(parents=True, exist_ok=True)
    pip = REPO / ".venv/bin/pip"
    with timings.step("wheelhouse"):
        run([str(pip), "download", "-q", "--only-binary=:all:", "-d", str(wheels), *wanted],
            timeout=900)
    stamp.write_text("\n".join(wanted) + "\n")
    return wheels


def build_image(timings: Timings) -> str:
    """Build the kvbeam image offline (docker/Dockerfile) from the local base and wheels."""
    base = ensure_base_image(timings)
    wheels = ensure_wheelhouse(timings)
    with timings.step("image build"):
        run(["docker", "build", "-q", "-f", "docker/Dockerfile", "-t", IMAGE,
             "--build-arg", f"BASE_IMAGE={base}",
             "--build-arg", f"WHEELHOUSE={wheels.relative_to(REPO)}", "."], timeout=1800)
    return IMAGE
