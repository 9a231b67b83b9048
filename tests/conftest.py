"""Shared fixtures: tiny generated model pairs (seconds to build, cached per session)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from flowedge.models.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def tiny_head(tiny_pair, tmp_path_factory):
    """A draft head self-distilled from the tiny base (tests/head_helpers.py): its file."""
    from head_helpers import train_tiny_head

    return train_tiny_head(tiny_pair[0], tmp_path_factory.mktemp("tiny-head"))


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's `--dist loadgroup` (`make test TEST_WORKERS=2`): a file's tests stay on one
    worker, so a module's cluster fixture starts once; every test on the real pair shares one worker, so one
    fetch and conversion into the shared model cache runs at a time."""
    for item in items:
        group = "real-pair" if item.get_closest_marker("real_model") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
