"""Per-role links of ``iota-subnet localnet``: ``--link`` for every neuron, ``--validator-link`` and
``--relay-link`` for those roles, and ``--relay-rate`` (the per-relayed-miner cap): how they are checked,
which command line each neuron gets, and what the summary records (no network; about 1 s)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from iota_subnet.config import ConfigError
from iota_subnet.entry.miner import build_parser as miner_parser
from iota_subnet.entry.relay import build_parser as relay_parser
from iota_subnet.entry.validator import build_parser as validator_parser
from iota_subnet.network.localnet import LocalNet
from iota_subnet.network.localnet_args import checked_link, relay_rate_argv, role_links
from iota_subnet.transport.shaping import LinkSpec

PARSERS = {"miner": miner_parser, "validator": validator_parser, "relay": relay_parser}


def _net(tmp_path, **kw) -> LocalNet:
    """A localnet with its children built (no wallets, chain or processes: argv only)."""
    kw = {"stages": 2, "replicas": 2, "validators": 1, **kw}
    net = LocalNet(config="configs/tiny.yaml", data="x.txt", steps=2, out=tmp_path / "ln", **kw)
    net.miner_wallets = {(s, r): None for s in range(net.stages) for r in range(net.replicas)}
    net.val_wallets = [None] * net.n_validators
    # a standalone relay's wallet: only its hotkey is read
    net.relay_wallets = [SimpleNamespace(hotkey=SimpleNamespace(ss58_address="5Relay"))] * net.n_relays
    net.relay_ports = list(range(9000, 9000 + net.n_relays))
    net._make_children()
    return net


def _parsed(net: LocalNet) -> dict[str, list]:
    """role -> the parsed command line of each of its neurons (after ``python -m module``)."""
    out: dict[str, list] = {}
    for c in net.children:
        out.setdefault(c.kind, []).append(PARSERS[c.kind]().parse_args(c.argv[3:]))
    return out


def test_role_links_default_to_link_and_keep_asymmetric_specs():
    assert role_links("20mbit:100ms") == {"miner": "20mbit:100ms", "validator": "20mbit:100ms", "relay": "20mbit:100ms"}
    assert role_links("20MBIT/100mbit:100ms", "1gbit:10ms", "1gbit/1gbit:5ms", relays=1, home_replicas=1) == {
        "miner": "20mbit/100mbit:100ms", "validator": "1gbit:10ms", "relay": "1gbit/1gbit:5ms"}
    assert role_links("loopback", "100mbit/1gbit:50ms")["validator"] == "100mbit/1gbit:50ms"
    assert checked_link("--link", None) == "loopback"


@pytest.mark.parametrize("kw, match", [
    ({"link": "fast"}, r"^--link 'fast': bad rate"),
    ({"validator_link": "1gbit:10"}, r"^--validator-link '1gbit:10': bad delay"),
    ({"validator_link": "20mbit/0mbit:1ms"}, r"^--validator-link .*downlink rate must be > 0"),
    ({"relay_link": "1gbps:10ms", "relays": 1}, r"^--relay-link '1gbps:10ms': bad rate"),
    ({"relay_link": "1gbit:10ms", "home_replicas": 1}, r"--relay-link needs standalone relays .*--validator-link"),
    ({"relay_link": "1gbit:10ms"}, r"--relay-link needs standalone relays .*--home-replicas N --relays K"),
])
def test_bad_role_links_name_their_flag(kw, match):
    kw = {"link": "loopback", **kw}
    with pytest.raises(ConfigError, match=match):
        role_links(kw.pop("link"), kw.pop("validator_link", None), kw.pop("relay_link", None), **kw)


def test_relay_rate_is_checked_and_scaled_like_the_links():
    assert relay_rate_argv(None, relays=0, home_replicas=0, time_scale=2.0) == ([], [])
    assert relay_rate_argv(4e6, relays=0, home_replicas=1, time_scale=2.0) == (["--relay-rate", "2000000.0"], [])
    assert relay_rate_argv(4e6, relays=2, home_replicas=1, time_scale=1.0) == ([], ["--rate", "4000000.0"])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--relay-rate .* must be > 0"):
            relay_rate_argv(bad, relays=0, home_replicas=1, time_scale=1.0)
    with pytest.raises(ConfigError, match="--relay-rate needs --home-replicas"):
        relay_rate_argv(1e6, relays=0, home_replicas=0, time_scale=1.0)


def test_the_validator_hosting_the_relay_gets_its_own_link(tmp_path):
    """Home miners through the validators' relay: miners on the asymmetric home link, the validator (the
    relay) on ``--validator-link`` with ``--relay-host`` and the per-peer cap; the summary records both."""
    net = _net(tmp_path, link="20mbit/100mbit:100ms", validator_link="1gbit:10ms", home_replicas=1,
               time_scale=2.0, relay_rate=5e6)
    p = _parsed(net)
    assert len(p["miner"]) == 4 and len(p["validator"]) == 1 and "relay" not in p
    for a in p["miner"]:
        assert a.link == LinkSpec(20e6, 0.1, 100e6) and a.time_scale == 2.0
    (v,) = p["validator"]
    assert v.link == LinkSpec(1e9, 0.01) and v.time_scale == 2.0
    assert v.relay_host and v.relay_rate == 2.5e6                 # 5 MB/s emulated at time scale 2
    assert sorted(a.relay for a in p["miner"] if a.relay) == [["auto"], ["auto"]]
    assert net.link == "20mbit/100mbit:100ms"
    assert net.links == {"miner": "20mbit/100mbit:100ms", "validator": "1gbit:10ms", "relay": "20mbit/100mbit:100ms"}
    summary = net.summarize(1.0)
    assert summary["links"] == net.links and summary["link"] == "20mbit/100mbit:100ms"
    assert summary["relay_rate"] == 5e6
    assert json.loads((tmp_path / "ln" / "summary.json").read_text())["links"]["validator"] == "1gbit:10ms"


def test_standalone_relays_get_the_relay_link(tmp_path):
    net = _net(tmp_path, link="20mbit:100ms", relay_link="1gbit/1gbit:10ms", home_replicas=1, relays=2,
               relay_rate=1e6)
    p = _parsed(net)
    assert [a.link for a in p["relay"]] == [LinkSpec(1e9, 0.01, 1e9)] * 2
    assert [a.rate for a in p["relay"]] == [1e6, 1e6] and [a.time_scale for a in p["relay"]] == [1.0, 1.0]
    (v,) = p["validator"]
    assert v.link == LinkSpec(20e6, 0.1) and not v.relay_host and v.relay_rate is None
    # no role flag: every neuron, relays included, on --link
    plain = _parsed(_net(tmp_path / "plain", link="100mbit:50ms", home_replicas=1, relays=1))
    assert {str(a.link) for role in plain.values() for a in role} == {"100mbit:50ms"}
    assert plain["relay"][0].rate is None


@pytest.mark.parametrize("argv, message", [
    (["--validator-link", "fast"], "--validator-link 'fast': bad rate"),
    (["--relay-link", "1gbit:10ms"], "--relay-link needs standalone relays"),
    (["--relay-rate", "0", "--home-replicas", "1"], "--relay-rate 0.0 must be > 0"),
])
def test_the_cli_refuses_bad_role_links_with_exit_2(argv, message, tmp_path, capsys):
    from iota_subnet.cli import main
    assert main(["localnet", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "ln"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ln").exists()                     # refused before anything was set up
