"""The crash simulator (tests/simulation/crash.py) on a few seeds, bounded by operations, not time.

Each seed is a world of tenants putting, reading and deleting on a real daemon, an attacker among them, with
kill -9 at scheduled operations and at fault points, graceful stops, index loss and `kvstore fsck --rebuild`.
The oracle checks after every restart that no block is served with bytes its tenant did not put and that no
acknowledged block is gone without the daemon saying why. A failing seed replays with the command it prints;
`make soak-crash` runs many more."""

from __future__ import annotations

import pytest

from tests.simulation.crash import Simulation

pytestmark = pytest.mark.crash

SEEDS = (1, 2, 3)  # 5-8 s each on 2 quiet cores, 13-15 s while another test run uses them
STEPS = 120


@pytest.mark.parametrize("seed", SEEDS)
def test_no_wrong_bytes_and_no_lost_acknowledged_puts(seed, tmp_path):
    result = Simulation(seed, STEPS, tmp_path).run()
    details = "\n".join([result.line(), *result.wrong[:5], *result.lost[:5], *result.over_capacity[:5],
                         *result.problems, f"replay: {result.replay()}"])
    assert result.crashes > 0 and result.hostile_puts > 0, details
    assert not result.wrong, f"a tenant was served bytes it did not put:\n{details}"
    assert not result.lost, f"acknowledged puts were lost:\n{details}"
    assert not result.over_capacity, f"the segment files passed the capacity:\n{details}"
    assert not result.problems, f"the daemon did not end cleanly:\n{details}"
