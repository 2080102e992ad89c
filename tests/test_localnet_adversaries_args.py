"""Where ``localnet --adversary KIND[,KIND]`` puts each kind, what a miner built for a bad-output kind
is made of, and ``--spares``' refusals (no network; under 1 s)."""
from __future__ import annotations

import pytest

from iota_subnet.config import ConfigError, load_config
from iota_subnet.miner.dataplane.transport import HttpDataPlaneTransport
from iota_subnet.miner.parts import MinerParts
from iota_subnet.network.localnet import LocalNet
from iota_subnet.network.localnet_args import adversary_positions
from iota_subnet.sim.adversary import AdversaryError, adversary_parts, check_kind
from iota_subnet.sim.bad_output import BAD_OUTPUT_KINDS, CorruptingTransport, NanLossTransport


def test_positions_of_cheaters_bad_heads_and_colluding_tails():
    assert adversary_positions(None, 3, 3) == {}
    assert adversary_positions("copy", 3, 3) == {(1, 2): "copy"}
    assert adversary_positions("bad-inf,nan-loss", 3, 3) == {(0, 0): "bad-inf", (2, 1): "nan-loss"}
    assert adversary_positions("bad-hash", 4, 2) == {(0, 0): "bad-hash"}
    with pytest.raises(ConfigError, match="unknown --adversary 'bad-zero'"):
        adversary_positions("bad-zero", 3, 3)
    with pytest.raises(ConfigError, match="same miner"):
        adversary_positions("bad-inf,bad-nan", 3, 3)


def test_a_bad_output_kind_is_an_honest_miner_with_a_corrupting_transport():
    cfg = load_config("configs/tiny.yaml")
    for kind in BAD_OUTPUT_KINDS:
        check_kind(kind)
        parts = adversary_parts(kind, cfg)
        assert parts.status == {"adversary": kind}
        honest = MinerParts()
        assert parts.make_worker is honest.make_worker and parts.make_merge_engine is honest.make_merge_engine
        want = NanLossTransport if kind == "nan-loss" else CorruptingTransport
        assert parts.make_dataplane_transport.func is want and issubclass(want, HttpDataPlaneTransport)
    with pytest.raises(AdversaryError):
        check_kind("bad-zero")


@pytest.mark.parametrize("spares", [-1, 3])
def test_spares_must_leave_a_lane(spares, tmp_path):
    with pytest.raises(ConfigError, match="--spares must be between 0 and --replicas - 1"):
        LocalNet(replicas=3, spares=spares, validators=1, config="configs/tiny.yaml", data=None, steps=2,
                 out=tmp_path / "ln")
