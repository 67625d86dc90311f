"""Chaos fixtures: one fleet (redis-server, two workers, a router, all real processes) shared by the
scenarios of this folder, and the soak option.

    .venv/bin/python -m pytest -q -s tests/chaos                 # the bounded run CI does (2-5 min on 2 cores)
    .venv/bin/python -m pytest -q -s tests/chaos --soak 30       # each scenario runs for 30 minutes

The option is only known when pytest is pointed at this folder (or a file in it), since a
conftest below the test root is loaded after the command line is read.
"""

from __future__ import annotations

import pytest

from .fleet import Fleet


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", type=float, default=0.0, metavar="MINUTES",
                     help="chaos tests: send hostile traffic for MINUTES and repeat each other scenario in "
                          "rounds until MINUTES have passed (default 0: the bounded CI run)")


@pytest.fixture(scope="session")
def soak_s(request: pytest.FixtureRequest) -> float:
    """Seconds each scenario should last beyond its bounded run; 0 unless --soak was given."""
    return 60.0 * (request.config.getoption("soak", default=0.0) or 0.0)


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    fleet = Fleet(tmp_path_factory.mktemp("chaos-redis")).start()
    yield fleet
    fleet.stop()
