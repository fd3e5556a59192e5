"""Shared pytest configuration: the --runslow option, the slow and one_host markers."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    # Fuzz tests (tests/support/fuzz.py) try ten times as many inputs in a --runslow run.
    os.environ["DDICT_FUZZ_SCALE"] = "10" if config.getoption("--runslow") else "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("DDICT_TEST_TWO_HOSTS") == "1":  # tests/test_two_hosts.py runs these
        elsewhere = pytest.mark.skip(
            reason="one_host: asserts that every manager is on this "
            "host (its /dev/shm, its shared-memory path)"
        )
        for item in items:
            if "one_host" in item.keywords:
                item.add_marker(elsewhere)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
