"""The storage daemon and the admin CLI run without torch; only the client's device path needs it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_the_daemon_and_the_cli_do_not_import_torch():
    code = ("import sys, kvstore.server.main, kvstore.cli, kvstore.client, kvstore.demo; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
