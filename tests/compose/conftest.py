"""Session fixtures: a docker engine and the kvbeam image (built offline), once per run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.compose.docker_env import CACHE, IMAGE, Timings, build_image, docker_engine, run


@pytest.fixture(scope="session")
def timings(request: pytest.FixtureRequest) -> Iterator[Timings]:
    """Seconds per step; printed at the end and written to .docker-cache/timings.json."""
    t = Timings({})
    yield t
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = "compose timings (s): " + ", ".join(f"{k} {v}" for k, v in t.steps.items())
    if reporter is not None:
        reporter.write_line(line)
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "timings.json").write_text(json.dumps(t.steps, indent=1) + "\n")


@pytest.fixture(scope="session")
def kvbeam_image(timings: Timings) -> Iterator[str]:
    """The kvbeam image; the engine is started here if none runs (and stopped after).

    KVBEAM_TEST_SKIP_BUILD=1 uses an existing image as is (the soft-RoCE guest run loads
    the image the host built); KVBEAM_TEST_SAVE_IMAGE=FILE saves the image there (docker
    save) before the engine stops, for that guest run."""
    with docker_engine(timings):
        if os.environ.get("KVBEAM_TEST_SKIP_BUILD", "") not in ("", "0"):
            image = IMAGE
        else:
            image = build_image(timings)
        yield image
        save = os.environ.get("KVBEAM_TEST_SAVE_IMAGE", "")
        if save:
            with timings.step("image save"):
                run(["docker", "save", "-o", save, image], timeout=600)
