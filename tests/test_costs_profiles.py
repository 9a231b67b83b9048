"""Device and link profiles load, validate, and carry their sources."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowedge.costs.profiles import list_devices, list_links, load_device, load_link, load_named_device
from flowedge.errors import ConfigError

REQUIRED = {"orin-nano-8gb", "orin-nano-super", "orin-nx-16gb", "agx-orin-64gb", "rpi5-8gb", "x86-cpu"}

MINIMAL = """
name = "toy"
description = "a toy board"
memory_bytes = 1000
bandwidth_Bps = 1.0e9
flops = 1.0e9
default_path = "{default}"
default_link = "1gbe"
sources = ["made up for a test"]

[paths.p]
bytes_per_param = 2.0
eta_bw = {eta}
eta_flops_small = 0.5
eta_flops_large = 0.5
overhead_fwd_s = 0.0
overhead_layer_s = 0.0
"""


def test_every_required_device_loads_with_sources_and_a_valid_default() -> None:
    names = set(list_devices())
    assert REQUIRED <= names
    for name in names:
        dev = load_device(name)
        assert dev.name == name
        assert dev.sources, name
        assert dev.has_path(dev.default_path)
        assert dev.default_link in list_links()
        assert 0 < dev.bandwidth_Bps < 1e12 and 0 < dev.flops < 1e14


@pytest.mark.parametrize("name", ["orin-nano-8gb", "orin-nano-super", "orin-nx-16gb", "agx-orin-64gb"])
def test_jetsons_default_to_flowedges_int4_path_and_keep_the_bnb_family(name: str) -> None:
    dev = load_device(name)
    assert dev.default_path == "torch-int4"   # what flowedge's quant backend runs on sm_87
    assert {"torch-int4", "torch-fp16", "hf-fp16", "hf-bnb4-single", "hf-bnb4-multi", "mlc",
            "llamacpp"} <= set(dev.paths)
    assert dev.paths["torch-int4"].token_tile == 16
    assert dev.paths["torch-int4"].head_path == "torch-fp16"
    assert dev.paths["hf-bnb4-multi"].head_path == "hf-fp16"


def test_links_match_the_brief() -> None:
    expected = {
        "1gbe": (0.25e-3, 940e6),
        "wifi6": (2e-3, 400e6),
        "wifi5": (2e-3, 200e6),
        "shaped-150": (0.25e-3, 141e6),
        "loopback": (0.1e-3, 10e9),
    }
    for name, (latency_s, bps) in expected.items():
        link = load_link(name)
        assert link.latency_s == pytest.approx(latency_s)
        assert link.bandwidth_bps == pytest.approx(bps)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="orin-nano-8gb"):
        load_device("jetson-tx9")
    with pytest.raises(ConfigError, match="1gbe"):
        load_link("carrier-pigeon")
    with pytest.raises(ConfigError):
        load_device("links")  # the links file is not a device


def test_a_name_off_the_wire_never_opens_a_path(tmp_path: Path) -> None:
    """Stages report their device by name; the head must not read a file a peer names."""
    path = tmp_path / "toy.toml"
    path.write_text('name = "toy"\nbandwidth_Bps = 1e9\nflops = 1e9\ndefault_path = "x"\n')
    for bad in (str(path), "../device_profiles/orin-nano-8gb.toml", "links"):
        with pytest.raises(ConfigError, match="unknown device profile"):
            load_named_device(bad)
    assert load_named_device("orin-nano-8gb").name == "orin-nano-8gb"


def test_load_by_path(tmp_path: Path) -> None:
    path = tmp_path / "toy.toml"
    path.write_text(MINIMAL.format(default="p", eta=0.5))
    dev = load_device(path)
    assert dev.name == "toy" and dev.paths["p"].eta_bw == 0.5
    assert dev.sources == ("made up for a test",)


@pytest.mark.parametrize(
    "text",
    [
        MINIMAL.format(default="nope", eta=0.5),  # default path not defined
        MINIMAL.format(default="p", eta=1.5),  # efficiency above 1
        MINIMAL.format(default="p", eta=0.5).replace("flops = 1.0e9\n", ""),  # missing key
        MINIMAL.format(default="p", eta=0.5) + "typo_key = 1\n",  # lands in [paths.p]
        "name = [unclosed",
    ],
)
def test_bad_profiles_raise_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_device(path)


def test_profiles_dir_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toy.toml").write_text(MINIMAL.format(default="p", eta=0.5))
    (tmp_path / "links.toml").write_text("[links.lan]\nlatency_ms = 1.0\nbandwidth_mbps = 100\n")
    monkeypatch.setenv("FLOWEDGE_PROFILES", str(tmp_path))
    assert list_devices() == ["toy"]
    assert list_links() == ["lan"]
    assert load_link("lan").latency_s == pytest.approx(1e-3)
