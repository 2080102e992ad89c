"""The run commitment both roles publish (issue 12, items 1, 2 and 9) and the choice of the
validators that coordinate (item 1), as pure functions."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace as NS

import pytest

from iota_subnet.protocol.commitment import (MINER, VALIDATOR, Fingerprints, RunCommitment, StageCommitment,
                                             merge_weights_from_commitments)
from iota_subnet.validator.merge_weights import MergeOversight, decode_commitment
from iota_subnet.validator.peers import alive_blocks_for, coordinating_validators, heartbeat_due, run_fingerprints
from iota_subnet.validator.routing import discover

FP = Fingerprints("0123456789abcdef", "fedcba9876543210")


def test_encode_decode_both_roles_small_and_versioned():
    m = RunCommitment("tiny", MINER, epoch=2, stage=1, fingerprints=FP)
    v = RunCommitment("tiny", VALIDATOR, epoch=2, fingerprints=FP, heartbeat=7, merge_weights={5: 0.0, 9: 0.5})
    for c in (m, v):
        raw = c.encode()
        assert json.loads(raw)["v"] == 2 and len(raw) < 160
        assert RunCommitment.decode(raw) == c
    assert RunCommitment.decode(m.encode()).same_run("tiny", 2) and not RunCommitment.decode(m.encode()).same_run("tiny", 0)
    # version 1 texts still read (epoch 0)
    assert RunCommitment.decode('{"v":1,"run":"r","stage":2}') == RunCommitment("r", MINER, 0, stage=2)
    assert RunCommitment.decode('{"v":1,"kind":"merge_weights","run":"r","w":{"3":0.0}}').merge_weights == {3: 0.0}
    assert StageCommitment.decode(m.encode()) == StageCommitment("tiny", 1)
    assert StageCommitment.decode(v.encode()) is None
    with pytest.raises(ValueError):
        RunCommitment("x" * 3000, MINER, stage=0).encode()


def test_decode_never_raises():
    rng = random.Random(0)
    good = RunCommitment("tiny", VALIDATOR, fingerprints=FP, merge_weights={1: 0.5}).encode()
    samples = [None, "", "null", "[]", "1", '"x"', "{", '{"v":2}', '{"v":2,"r":"","k":"m","s":0}',
               '{"v":2,"r":"a","k":"m"}', '{"v":2,"r":"a","k":"m","s":-1}', '{"v":2,"r":"a","k":"m","s":true}',
               '{"v":2,"r":"a","k":"x"}', '{"v":2,"r":"a","k":"v","t":"XYZ","d":"00"}',
               '{"v":2,"r":"a","k":"v","mw":{"a":1}}', '{"v":2,"r":"a","k":"v","mw":{"1":"nan"}}',
               '{"v":2,"r":"a","k":"v","mw":[1]}', '{"v":2,"r":"a","k":"v","e":-3}', '{"v":3,"r":"a","k":"v"}',
               "[" * 5000, "x" * 5000, '{"v":2,"r":"a","k":"v","hb":1e400}']
    for _ in range(300):
        raw = list(good)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = chr(rng.randrange(32, 127))
        samples.append("".join(raw))
    for raw in samples:
        c = RunCommitment.decode(raw)
        assert c is None or isinstance(c, RunCommitment)
    assert RunCommitment.decode('{"v":2,"r":"a","k":"v","mw":{"a":1}}') is None


def test_merge_weights_ride_in_the_validator_commitment():
    mo = MergeOversight("r")
    assert mo.decided([1, 2, 3], cheaters={2}) == {2: 0.0}
    raw = RunCommitment("r", VALIDATOR, fingerprints=FP, merge_weights=mo.decided([1, 2, 3], {2})).encode()
    assert decode_commitment(raw, "r") == {2: 0.0} and decode_commitment(raw, "other") is None
    neurons = {"v": NS(uid=0, validator_permit=True), "a": NS(uid=1, validator_permit=False),
               "b": NS(uid=2, validator_permit=False)}
    got = merge_weights_from_commitments({"v": raw, "a": RunCommitment("r", MINER, stage=0).encode()}, neurons, "r",
                                         ["a", "b"])
    assert got == {"a": 1.0, "b": 0.0}
    # another epoch's decisions do not count
    assert merge_weights_from_commitments({"v": raw}, neurons, "r", ["b"], run_epoch=1) == {"b": 1.0}


def test_miners_are_discovered_per_run_and_epoch():
    neurons = [NS(uid=u, hotkey=f"hk{u}", axon=f"127.0.0.1:{9000 + u}") for u in range(4)]
    commits = {"hk0": RunCommitment("r", MINER, 0, stage=0).encode(),
               "hk1": RunCommitment("r", MINER, 1, stage=0).encode(),
               "hk2": RunCommitment("r", VALIDATOR, 1).encode(),
               "hk3": RunCommitment("r", MINER, 1, stage=1).encode()}
    assert {s: [r.uid for r in rs] for s, rs in discover(neurons, commits, "r", 2, run_epoch=1).items()} == \
        {0: [1], 1: [3]}
    assert {s: [r.uid for r in rs] for s, rs in discover(neurons, commits, "r", 2).items()} == {0: [0], 1: []}


def _neuron(uid, hk, *, permit=True, text=None, published=-1, last_update=0, stake=1.0):
    c = None if text is None else NS(value=text, block=published)
    return NS(uid=uid, hotkey=hk, validator_permit=permit, last_update=last_update, commitment=c,
              total_stake=NS(rao=int(stake * 1e9)))


def test_only_live_validators_of_the_same_run_coordinate():
    block, alive = 10_000, alive_blocks_for(tempo=100)
    assert alive == 210
    ours = RunCommitment("run", VALIDATOR, 0, fingerprints=FP).encode()
    neurons = [_neuron(0, "me", text=ours, published=block)]
    uid = 1
    for i in range(20):                                  # permit holders running other code, or nothing
        neurons.append(_neuron(uid, f"none{i}", text=None if i % 2 else "some other subnet's text",
                               published=block, last_update=block))
        uid += 1
    for i in range(20):                                  # another run / another epoch of ours
        run, epoch = ("other", 0) if i % 2 else ("run", 1)
        neurons.append(_neuron(uid, f"other{i}", text=RunCommitment(run, VALIDATOR, epoch).encode(),
                               published=block, last_update=block))
        uid += 1
    for i in range(10):                                  # ours but dead: silent for longer than the window
        neurons.append(_neuron(uid, f"dead{i}", text=ours, published=block - alive - 1 - i,
                               last_update=block - alive - 5))
        uid += 1
    for i in range(9):                                   # ours, miners of ours, ours with other data
        neurons.append(_neuron(uid, f"minerish{i}", permit=True,
                               text=RunCommitment("run", MINER, 0, stage=0).encode(), published=block))
        uid += 1
    neurons.append(_neuron(uid, "mismatch", text=RunCommitment("run", VALIDATOR, 0, fingerprints=Fingerprints(
        "1111111111111111", "2222222222222222")).encode(), published=block))
    uid += 1
    neurons.append(_neuron(uid, "alive-by-weights", text=ours, published=block - 5000, last_update=block - 3))
    uid += 1
    neurons.append(_neuron(uid, "alive-by-commitment", text=ours, published=block - 100, last_update=0))
    neurons.append(_neuron(uid + 1, "no-permit", permit=False, text=ours, published=block))
    view = coordinating_validators(neurons, run="run", epoch=0, block=block, alive_blocks=alive, self_hotkey="me",
                                   fingerprints=FP)
    assert view.coordinating == ["alive-by-commitment", "alive-by-weights", "me"]
    assert view.foreign == 20 + 9 and view.other_runs == {"other#0": 10, "run#1": 10}
    assert view.unannounced == 10                         # no commitment at all (a starting validator's view)
    assert len(view.dead) == 10 and set(view.mismatched) == {"mismatch"}
    # the run's fingerprints as the other validators advertise them (the mismatching one has less stake)
    assert run_fingerprints(neurons, run="run", epoch=0, block=block, alive_blocks=alive, exclude="me")[0] == FP


def test_heartbeat_due_when_neither_weights_nor_commitment_are_recent():
    ours = RunCommitment("run", VALIDATOR).encode()
    assert not heartbeat_due([_neuron(0, "me", text=ours, published=900, last_update=0)], "me", 1000, 210)
    assert heartbeat_due([_neuron(0, "me", text=ours, published=800, last_update=0)], "me", 1000, 210)
    assert not heartbeat_due([_neuron(0, "me", text=ours, published=0, last_update=950)], "me", 1000, 210)


def test_relays_in_a_miners_commitment_are_checked_both_ways():
    c = RunCommitment("run", MINER, stage=1, relays=("10.0.0.1:8091", "relay.example.org:443"))
    assert RunCommitment.decode(c.encode()) == c
    for bad in (("10.0.0.1",), ("10.0.0.1:0",), ("10.0.0.1:65536",), (":8091",), ("a:1",) * 5, ("x" * 70 + ":1",)):
        with pytest.raises(ValueError):
            RunCommitment("run", MINER, stage=1, relays=bad).encode()
        raw = json.dumps({"v": 2, "r": "run", "e": 0, "k": "m", "s": 1, "rl": list(bad)})
        assert RunCommitment.decode(raw) is None, bad
    assert RunCommitment.decode(json.dumps({"v": 2, "r": "run", "e": 0, "k": "v", "rh": 2})) is None
    assert RunCommitment.decode(json.dumps({"v": 2, "r": "run", "e": 0, "k": "v", "rh": 1})).relay_host
