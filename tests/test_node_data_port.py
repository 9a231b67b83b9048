"""node/data_port.py: a stage's data port listens on the interface the head is reached through (not
0.0.0.0), on a port or range the config pins; real sockets."""
from __future__ import annotations

import pytest

from cluster_helpers import flowedge_home, free_port_pair
from flowedge.errors import ConfigError
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.node.data_port import bind_data_port
from flowedge.node.node_config import NodeConfig
from flowedge.node.roots import build_stage
from flowedge.transport.zmq_link import ZmqLink


def test_a_stage_of_a_loopback_cluster_listens_on_loopback_only(tmp_path):
    with flowedge_home(tmp_path):
        node = build_stage(NodeConfig(role="stage", head="127.0.0.1:5999", insecure=True, node_id="s"))
        try:
            bound = node.data_in.address
            assert bound.startswith("tcp://127.0.0.1:"), bound   # was tcp://0.0.0.0:PORT
            assert node.data_addr == bound
        finally:
            node.close()


@pytest.fixture
def link():
    made = ZmqLink(insecure=True)
    yield made
    made.close()


def _bind(link, cfg: NodeConfig, head_host: str) -> str:
    return bind_data_port(link, cfg, head_host)[1]


def test_a_pinned_range_gives_each_stage_the_first_free_port_then_one_clear_error(link):
    p = free_port_pair()
    cfg = NodeConfig(role="stage", head="127.0.0.1:5999", data_port=f"{p}-{p + 1}")
    assert _bind(link, cfg, "127.0.0.1") == f"tcp://127.0.0.1:{p}"
    assert _bind(link, cfg, "127.0.0.1") == f"tcp://127.0.0.1:{p + 1}"
    with pytest.raises(ConfigError, match=f"any port of {p}-{p + 1}"):
        _bind(link, cfg, "127.0.0.1")
    one = NodeConfig(role="stage", head="127.0.0.1:5999", data_port=p)
    with pytest.raises(ConfigError, match=f"port {p}:"):
        _bind(link, one, "127.0.0.1")


def test_advertise_names_the_interface_when_it_is_ours_and_every_interface_behind_a_nat(link):
    ours, announced = bind_data_port(link, NodeConfig(role="stage", advertise="127.0.0.1"), "10.0.0.1")
    assert announced.startswith("tcp://127.0.0.1:") and ours.address.startswith("tcp://127.0.0.1:")
    nat, announced = bind_data_port(link, NodeConfig(role="stage", advertise="203.0.113.7"), "127.0.0.1")
    assert announced.startswith("tcp://203.0.113.7:")   # TEST-NET-3: not an address of this host
    assert nat.address.startswith("tcp://0.0.0.0:")


@pytest.mark.parametrize("value,want", [(0, (0, 0)), ("0", (0, 0)), (5560, (5560, 5560)), ("5560", (5560, 5560)),
                                        ("5560-5569", (5560, 5569)), (" 5560-5560 ", (5560, 5560))])
def test_data_port_is_a_port_or_a_range(value, want):
    assert NodeConfig(data_port=value).data_ports() == want


@pytest.mark.parametrize("value", ["5569-5560", "x", "5560-", "-5", 70000, "0-10", True, 55.5, [1]])
def test_a_bad_data_port_is_a_config_error(value):
    with pytest.raises(ConfigError, match="data_port must be"):
        NodeConfig(data_port=value)


def test_up_wants_a_port_per_stage_in_its_range():
    LocalClusterSpec(nodes=3, data_port="5560-5561")
    with pytest.raises(ConfigError, match="3 stages need as many ports"):
        LocalClusterSpec(nodes=4, data_port="5560-5561")
