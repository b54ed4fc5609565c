"""docker-compose projects for the tests: run, inspect, tear down (docker/compose.yaml)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from tests.compose.docker_env import REPO, run

#: The RDMA variant (inside the soft-RoCE guest): the override file and the rxe netdev.
RDMA = os.environ.get("KVBEAM_COMPOSE_RDMA", "") not in ("", "0")
SOFTROCE_IFACE = os.environ.get("KVBEAM_COMPOSE_SOFTROCE", "rxenet0")
#: The shared control-plane token of this test session (compose.yaml requires one).
AUTH_TOKEN = secrets.token_hex(16)


@dataclass
class Compose:
    """One compose project of docker/compose.yaml (plus the RDMA override in RDMA mode)."""

    project: str
    image: str
    env: dict[str, str] = field(default_factory=dict)
    #: Test-only compose files added after the others (``-f``), relative to the repo.
    overrides: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """The compose files, as -f arguments."""
        names = (["docker/compose.yaml"] + (["docker/compose.rdma.yaml"] if RDMA else [])
                 + self.overrides)
        return [arg for name in names for arg in ("-f", name)]

    @property
    def environment(self) -> dict[str, str]:
        """The variables the compose file reads."""
        base = {"KVBEAM_IMAGE": self.image, "KVBEAM_AUTH_TOKEN": AUTH_TOKEN}
        if RDMA:
            base |= {"KVBEAM_SOFTROCE": SOFTROCE_IFACE}
        return base | self.env

    def __call__(self, *args: str, timeout: float = 600,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", self.project, *self.files, *args], timeout=timeout,
                   check=check, env=self.environment, cwd=REPO)

    def container(self, service: str) -> str:
        """The container id of ``service`` (running or exited)."""
        cid = self("ps", "-a", "-q", service).stdout.strip()
        assert cid, f"no container for service {service}"
        return cid

    def logs(self, service: str) -> str:
        """stdout and stderr of ``service``, without compose's prefixes."""
        proc = run(["docker", "logs", self.container(service)], check=False)
        return proc.stdout + proc.stderr

    def stdout(self, service: str) -> str:
        """Only the stdout of ``service`` (the scheduler's table or JSON)."""
        return run(["docker", "logs", self.container(service)], check=False).stdout

    def health(self, service: str) -> str:
        """Docker's health status of ``service`` (healthy, unhealthy, starting)."""
        return run(["docker", "inspect", "--format", "{{.State.Health.Status}}",
                    self.container(service)]).stdout.strip()

    def wait_exit(self, service: str, timeout: float) -> int:
        """Wait for ``service``'s container to exit; its exit code."""
        return int(run(["docker", "wait", self.container(service)], timeout=timeout)
                   .stdout.strip())

    def wait_log(self, service: str, needle: str, count: int, timeout: float) -> None:
        """Wait until ``needle`` appears ``count`` times in ``service``'s log."""
        end = time.monotonic() + timeout
        while self.logs(service).count(needle) < count:
            assert time.monotonic() < end, \
                f"{service}: {needle!r} not {count} times in {timeout} s:\n{self.logs(service)}"
            time.sleep(0.5)

    def down(self) -> None:
        """Remove the project's containers and network, whatever state they are in."""
        self("down", "--remove-orphans", "-v", "-t", "5", timeout=120, check=False)


def scheduler_json(text: str) -> list[dict[str, Any]]:
    """The scheduler's ``kvbeam drive --json`` output."""
    start = text.index("[")
    results: list[dict[str, Any]] = json.loads(text[start:])
    return results
