"""Shared fixtures: real kvstore-server daemons on loopback, started and stopped per test."""

from __future__ import annotations

import os

import pytest

from kvstore.server.process import DaemonProcess
from tests.clean_stop import stop_clean


def pytest_runtest_setup(item):
    """Under `--dist loadgroup` every test of an `xdist_group` must carry its group in its node id: that is how
    pytest-xdist keeps a group on one worker. When an upgrade breaks it, groups scatter silently (a real-model
    server built on every worker, the suite slower), so each grouped test fails and says why."""
    if (getattr(item.config.option, "loadgroup", False)  # set in the workers, whose collections xdist tags
            and item.get_closest_marker("xdist_group") and "@" not in item.nodeid):
        pytest.fail("--dist loadgroup left this grouped test untagged: this pytest and pytest-xdist disagree on "
                    "node ids (see the pin in pyproject.toml)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory):
    """Speculative decoding is on by default and measures an SPS profile per model and machine at start-up
    (engine/speculative/profile.py): the tests and the processes they start keep theirs in one folder of
    this run (shared by the xdist workers), never in the user's ~/.cache."""
    folder = tmp_path_factory.getbasetemp().parent / "profiles"
    previous = os.environ.get("KVSTORE_PROFILE_CACHE")
    os.environ["KVSTORE_PROFILE_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("KVSTORE_PROFILE_CACHE", None)
    else:
        os.environ["KVSTORE_PROFILE_CACHE"] = previous


@pytest.fixture
def daemons(tmp_path, request):
    """daemons(n, *args) starts n daemons; all are stopped at the end of the test, and each must exit with 0 and
    leave no traceback in its log. A test that kills a daemon on purpose and leaves it dead is marked
    `kills_daemons`: the exit code of such a daemon is not checked, its log still is; nor is the exit code of a
    daemon whose start raised (the test saw that)."""
    started: list[DaemonProcess] = []
    refused: set[int] = set()  # daemons whose start raised: the test was told, and expected it or failed

    def start(n: int = 1, *args: str, env: dict[str, str] | None = None) -> list[DaemonProcess]:
        new = []
        for _ in range(n):
            daemon = DaemonProcess(tmp_path / f"daemon{len(started)}", tmp_path, list(args), env)
            started.append(daemon)
            try:
                new.append(daemon.start())
            except Exception:
                refused.add(id(daemon))
                raise
        return new

    yield start
    killed_on_purpose = request.node.get_closest_marker("kills_daemons") is not None
    problems = [problem for daemon in started
                for problem in stop_clean(daemon, killed_on_purpose=killed_on_purpose or id(daemon) in refused)]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory):
    """As `daemons`, for a module's tests to share: a daemon start (about half a second) per test adds up where
    the tests only need a daemon that serves, and leave nothing another test reads. The daemons must stop as
    `daemons`' do, at the module's end."""
    base = tmp_path_factory.mktemp("module-daemons")
    started: list[DaemonProcess] = []

    def start(n: int = 1, *args: str, env: dict[str, str] | None = None) -> list[DaemonProcess]:
        new = [DaemonProcess(base / f"daemon{len(started) + i}", base, list(args), env) for i in range(n)]
        started.extend(new)
        return [daemon.start() for daemon in new]

    yield start
    problems = [problem for daemon in started for problem in stop_clean(daemon)]
    assert not problems, "\n".join(problems)
