"""Validator pure logic: discovery, lanes, SWARM rerouting, cooldowns; scoring; state persistence."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections import Counter
from types import SimpleNamespace as NS

import pytest

from iota_subnet.config import load_config
from iota_subnet.model import PipelineStage
from iota_subnet.validator.lanes import sample_start, steps_of
from iota_subnet.validator.metagraph_view import MetagraphView
from iota_subnet.validator.options import ChainOptions, RunOptions
from iota_subnet.validator.peers import PeerView
from iota_subnet.validator.progress import LaneProgress
from iota_subnet.validator.routing import Replica, Router, discover, parse_commitment, served_endpoint
from iota_subnet.validator.scoring import Ledger, MinerRecord, compute_weights, stage_compute_shares
from iota_subnet.validator.state import StateError, ValidatorState


def c(stage, run="r1", v=1):
    return json.dumps({"v": v, "run": run, "stage": stage})


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def topo(counts: list[int]) -> dict[int, list[Replica]]:
    out, uid = {}, 1
    for s, n in enumerate(counts):
        out[s] = []
        for _ in range(n):
            out[s].append(Replica(uid, f"hk{uid}", f"127.0.0.1:{9000 + uid}", s))
            uid += 1
    return out


# ------------------------------------------------------------------------------------------ routing

def test_parse_commitment_and_endpoints():
    assert parse_commitment(c(1), "r1", 3) == 1
    for bad in (None, "", "{", "[]", c(1, run="other"), c(3), c(-1), c(1, v=2), json.dumps({"v": 1, "run": "r1"}),
                json.dumps({"v": 1, "run": "r1", "stage": True}), json.dumps({"v": 1, "run": "r1", "stage": "1"})):
        assert parse_commitment(bad, "r1", 3) is None, bad
    assert served_endpoint("1.2.3.4:80") == "1.2.3.4:80"
    assert served_endpoint("0.0.0.0:0") is None and served_endpoint("1.2.3.4:0") is None and served_endpoint(None) is None
    assert served_endpoint(NS(ip="10.0.0.1", port=8091)) == "10.0.0.1:8091"


def test_discover_keeps_our_run_sorted_by_uid():
    neurons = [NS(uid=u, hotkey=f"hk{u}", axon=f"127.0.0.1:{9000 + u}") for u in range(8)]
    neurons[6].axon = "0.0.0.0:0"    # committed but not served
    commits = {"hk0": "", "hk1": c(0), "hk2": c(1), "hk3": c(0), "hk4": c(1, run="other"), "hk5": "junk",
               "hk6": c(1), "hk7": c(2)}
    got = discover(neurons, commits, "r1", 3)
    assert {s: [r.uid for r in rs] for s, rs in got.items()} == {0: [1, 3], 1: [2], 2: [7]}
    assert got[0][0] == Replica(1, "hk1", "127.0.0.1:9001", 0)


def test_lanes_are_replica_r_of_each_stage_and_sticky():
    r = Router(3)
    t = topo([2, 3, 2])
    r.update(t)
    r.freeze()                               # the validator drives its first step
    assert r.n_lanes == 2 and r.stage_counts() == [2, 3, 2]
    assert [[x.uid for x in lane] for lane in r.lanes()] == [[1, 3, 6], [2, 4, 7]]
    # uid 4 leaves; the spare uid 5 takes its slot; uid 3 keeps lane 0
    t2 = {0: t[0], 1: [t[1][0], t[1][2]], 2: t[2]}
    r.update(t2)
    assert [[x.uid for x in lane] for lane in r.lanes()] == [[1, 3, 6], [2, 5, 7]]
    # a new lower uid does not reshuffle existing lanes
    t3 = {0: t[0], 1: [Replica(0, "hk0", "x:1", 1)] + t2[1], 2: t[2]}
    r.update(t3)
    assert r.lane_member(0, 1).uid == 3 and r.lane_member(1, 1).uid == 5 and r.lane_member(2, 1).uid == 0
    # a uid re-registered to another hotkey is another replica
    t4 = {0: t[0], 1: [Replica(3, "new", "x:2", 1), t[1][2]], 2: t[2]}
    r.update(t4)
    assert r.lane_member(0, 1).key == (3, "new") and r.lane_member(1, 1).uid == 5
    assert r.get((3, "hk3")) is None
    assert Router(2).n_lanes == 0


def test_validators_that_discovered_miners_in_other_orders_agree_on_the_lanes():
    """Before a validator drives its first step the slots follow the uid order: one that saw each
    stage's second miner first (its first miner's axon came later) forms the same lanes as one that
    saw both at once, so the two do not hand a replica another lane at every step."""
    t = topo([2, 2, 2])                      # uids 1-2 | 3-4 | 5-6
    early = Router(3)
    early.update({s: [rs[1]] for s, rs in t.items()})
    assert [[x.uid for x in lane] for lane in early.lanes()] == [[2, 4, 6]]
    early.update(t)
    late = Router(3)
    late.update(t)
    for r in (early, late):
        r.freeze()
    assert [[x.uid for x in lane] for lane in early.lanes()] == [[1, 3, 5], [2, 4, 6]]
    assert early.slot_table() == late.slot_table()
    # once frozen, a lower uid that appears later does not reshuffle the lanes
    early.update({0: t[0], 1: [Replica(0, "hk0", "x:1", 1)] + t[1], 2: t[2]})
    assert [[x.uid for x in lane] for lane in early.lanes()] == [[1, 3, 5], [2, 4, 6]]
    # a restarted validator's saved table is sticky at once
    back = Router(3)
    back.load_slot_table(early.slot_table())
    back.update(t)
    assert back.slot_table() == late.slot_table()


def test_reroute_cooldown_backoff_and_probe():
    clock = Clock()
    r = Router(2, cooldown_base_s=2.0, cooldown_max_s=10.0, clock=clock, rng=random.Random(0))
    r.update(topo([2, 3]))
    a = r.lane_member(0, 1)
    assert r.is_available(a)
    assert r.record_failure(a, "timeout") == 2.0
    assert not r.is_available(a)
    alt = r.choose(1)                        # the lane's hops of stage 1 go to another replica
    assert alt is not None and alt.key != a.key and alt.stage == 1
    assert r.choose(1, exclude=[x.key for x in r.replicas[1] if x.key != a.key]) is None
    assert r.probe_due() == [] and r.next_probe_in() == pytest.approx(2.0)
    clock.t += 2.0
    assert r.probe_due() == [a]
    assert r.probe_failed(a) == 4.0          # backoff doubles
    clock.t += 1.0
    assert r.record_failure(a) == pytest.approx(3.0)   # a failure inside the cooldown is the same outage
    assert r.health[a.key].consecutive_failures == 2 and r.health[a.key].failures == 3
    clock.t += 3.0
    assert r.record_failure(a) == 8.0
    clock.t += 8.0
    assert r.record_failure(a) == 10.0       # capped
    clock.t += 10.0
    assert r.probe_due() == [a]
    r.probe_failed(a)
    assert r.probe_due() == []
    moved = {s: [dataclasses.replace(x, endpoint="127.0.0.1:9") if x.key == a.key else x for x in rs]
             for s, rs in r.replicas.items()}
    r.update(moved)                          # it served a new endpoint (restarted): probed at once
    assert r.probe_due() == [r.get(a.key)] and r.get(a.key).endpoint == "127.0.0.1:9"
    r.mark_healthy(a)
    assert r.is_available(a) and r.lane_member(0, 1).key == a.key
    r.record_success(a, 100, 1.0)
    assert r.health[a.key].consecutive_failures == 0
    snap = {s["uid"]: s for s in r.snapshot()}
    assert snap[a.uid]["lane"] == 0 and snap[a.uid]["available"]


def test_a_lane_member_down_for_long_gives_its_lane_to_an_available_spare():
    """Churn benchmark, 2026-12-02: members that left for good kept their lanes (their registration
    and axon stay on chain), so those lanes' hops went to alternates, which do not train, for the rest
    of the run, while every miner that joined sat in a lane nobody drives and never merged."""
    clock = Clock()
    r = Router(2, vacate_after_s=120.0, clock=clock)
    r.update(topo([3, 4]))                                  # lanes 0-1 driven; uid 3, 6 and 7 are spares
    r.freeze()
    gone, back = r.lane_member(0, 0), r.lane_member(1, 1)
    r.record_failure(gone, "connection refused")
    r.record_failure(back, "timeout")
    r.record_failure(r.get((6, "hk6")), "timeout")         # one spare of stage 1 is down too
    clock.t += 119.0
    assert r.reassign_vacant(2) == []                      # not for long enough yet
    r.mark_healthy(back)                                   # it came back within the time
    clock.t += 2.0
    swaps = r.reassign_vacant(2)
    assert swaps == [(0, 0, gone.key, (3, "hk3"))]
    assert r.lane_member(0, 0).uid == 3 and r.lane_member(1, 1).key == back.key
    assert r.lane_member(2, 0).key == gone.key             # the departed member is a spare now
    r.record_failure(r.lane_member(1, 1), "timeout")       # uid 5 goes down for long: not the down spare 6, but 7
    clock.t += 121.0
    assert r.reassign_vacant(2) == [(1, 1, (5, "hk5"), (7, "hk7"))]
    r.update(topo([3, 4]))                                 # a metagraph sync keeps the new assignment
    assert [[x.uid for x in lane] for lane in r.lanes()][:2] == [[3, 4], [2, 7]]


def test_a_barred_miner_gets_no_hop_and_its_lane_goes_to_a_spare():
    """A miner flagged as a cheater kept its lane: its lane's other stages trained on what it sent
    and merged that. Barred, it gets no hop, reroute, alternate or probe again; a spare takes its lane
    at once; with no spare its lane's hops go to alternates. It keeps a slot (lanes stay as a
    validator that has not flagged it sees them), and nobody is moved into two lanes."""
    clock = Clock()
    r = Router(2, rng=random.Random(0), clock=clock)
    r.update(topo([3, 2]))                      # stage 0: uids 1-3 (uid 3 spare); stage 1: uids 4-5
    r.freeze()
    cheat, other = r.lane_member(1, 0), r.lane_member(0, 1)
    assert r.bar([cheat.key]) == [cheat.key] and r.bar([cheat.key]) == []
    assert not r.is_available(cheat) and all(r.choose(0).key != cheat.key for _ in range(200))
    assert r.reassign_vacant(2) == [(0, 1, cheat.key, (3, "hk3"))]          # at once, not after 120 s
    assert cheat.uid == 2 and r.lane_member(1, 0).uid == 3 and r.lane_member(2, 0).key == cheat.key
    r.record_failure(cheat, "timeout")
    clock.t += 3600
    assert r.probe_due() == [] and r.next_probe_in() is None               # never probed back
    r.mark_healthy(cheat)
    assert not r.is_available(cheat)
    r.update(topo([3, 2]))                      # a metagraph sync lists it again: still barred
    assert not r.is_available(r.get(cheat.key)) and r.lane_member(1, 0).uid == 3
    r.bar([other.key])                          # no spare in stage 1: its lane's hops go to the other replica
    assert r.reassign_vacant(2) == [] and r.n_lanes == 2 and r.lane_member(0, 1).key == other.key
    assert not r.is_available(r.lane_member(0, 1)) and all(r.choose(1).uid == 5 for _ in range(50))
    assert r.lane_member(1, 1).uid == 5 and r.is_available(r.lane_member(1, 1))
    assert {x["uid"]: x["barred"] for x in r.snapshot()} == {1: False, 2: True, 3: False, 4: True, 5: False}


def test_swarm_choice_is_proportional_to_throughput_ema():
    r = Router(1, ema_alpha=0.5, rng=random.Random(42))
    r.update(topo([3]))
    a, b, c_ = r.replicas[0]
    r.record_success(a, 300, 1.0)
    r.record_success(b, 100, 1.0)
    r.record_success(c_, 100, 1.0)
    r.record_success(c_, 300, 1.0)     # EMA: 0.5*100 + 0.5*300 = 200
    assert r.throughput(c_) == pytest.approx(200.0)
    n = 6000
    counts = Counter(r.choose(0).uid for _ in range(n))
    assert counts[a.uid] / n == pytest.approx(0.5, abs=0.03)
    assert counts[b.uid] / n == pytest.approx(1 / 6, abs=0.03)
    assert counts[c_.uid] / n == pytest.approx(1 / 3, abs=0.03)
    r.record_failure(a)                 # cooling down: never chosen
    assert all(r.choose(0).uid != a.uid for _ in range(200))
    # an unmeasured replica gets the mean of the measured ones as its prior
    r2 = Router(1)
    r2.update(topo([2]))
    r2.record_success(r2.replicas[0][0], 50, 1.0)
    assert r2.throughput(r2.replicas[0][1]) == pytest.approx(50.0)


def test_step_split_between_validators_and_addressing():
    assert list(steps_of(0, 1, 0, 4)) == [0, 1, 2, 3]
    assert list(steps_of(0, 2, 0, 5)) == [0, 2, 4] and list(steps_of(1, 2, 0, 5)) == [1, 3]
    assert list(steps_of(1, 3, 2, 9)) == [4, 7]
    from iota_subnet.validator.lanes import OPEN_ENDED_STEPS
    open_ended = steps_of(1, 3, 2, OPEN_ENDED_STEPS)            # an open-ended run: lazily, no list
    assert open_ended[:3] == range(4, 13, 3) and len(open_ended) > 10**15
    starts = {sample_start(l, k, m, 3, 8, 2) for l in range(3) for k in range(4) for m in range(4)}
    assert starts == set(range(0, 3 * 4 * 8, 2))   # every row once, no overlap between lanes


def test_sample_addressing_matches_colocated_with_one_lane():
    # one lane: step k, micro-batch m reads rows k*B + m*mb, like the co-located trainer
    assert [sample_start(0, k, m, 1, 8, 4) for k in range(2) for m in range(2)] == [0, 4, 8, 12]
    # two lanes interleave whole steps
    assert sample_start(1, 0, 0, 2, 8, 4) == 8 and sample_start(0, 1, 1, 2, 8, 4) == 20


# ------------------------------------------------------------------------------------------ scoring

def test_stage_shares_follow_flops():
    cfg = load_config("configs/tiny.yaml")
    shares = stage_compute_shares(cfg)
    flops = [PipelineStage(cfg.model, cfg.pipeline, s, init=False).flops_per_token(cfg.data.seq_len) for s in range(3)]
    assert sum(shares) == pytest.approx(1.0)
    assert shares == pytest.approx([f / sum(flops) for f in flops])
    assert shares[2] > shares[0]          # the tail carries the LM head
    assert stage_compute_shares([1, 1, float("nan")]) == pytest.approx([0.5, 0.5, 0.0])
    assert stage_compute_shares([0, 0]) == [0.5, 0.5]


def test_weights_per_stage_budget_and_hotkey_change():
    led = Ledger([0.25, 0.25, 0.5])
    for _ in range(3):
        led.credit(1, "a", 0, 100)
        led.credit(2, "b", 1, 100)
        led.credit(3, "c", 2, 100)
    led.credit(4, "d", 2, 100)          # stage 2: uid 3 did 3x uid 4's tokens
    led.forward_ok(5, "e", 0)
    w = led.weights({1: "a", 2: "b", 3: "c", 4: "d", 5: "e"})
    assert w == pytest.approx({1: 0.25, 2: 0.25, 3: 0.375, 4: 0.125})
    assert led.records[(3, "c")].work == pytest.approx(300 * 0.5)
    # uid 1 re-registered to hotkey "z": the old record earns it nothing; budgets renormalise
    w2 = led.weights({1: "z", 2: "b", 3: "c", 4: "d"})
    assert 1 not in w2 and sum(w2.values()) == pytest.approx(1.0)
    assert w2[2] == pytest.approx(0.25 / 0.75)
    # excluded uid (the validator itself) and failures lower reliability
    led.fail(4, "d", 2)
    w3 = led.weights({1: "a", 2: "b", 3: "c", 4: "d"}, exclude_uids=[2])
    assert 2 not in w3 and w3[4] < w[4] * 1.34
    assert led.totals()["failures"] == 1


def test_weights_non_finite_and_empty():
    recs = [MinerRecord(1, "a", 0, completed=1, tokens=float("nan")), MinerRecord(2, "b", 0, completed=1, tokens=10),
            MinerRecord(3, "c", 1, completed=1, tokens=float("inf")), MinerRecord(4, "d", 1, completed=1, tokens=-5),
            MinerRecord(5, "e", 7, completed=1, tokens=10)]
    w = compute_weights(recs, [0.5, 0.5], {1: "a", 2: "b", 3: "c", 4: "d", 5: "e"})
    assert w == {2: 1.0}
    assert compute_weights(recs, [float("nan"), 0.0], {2: "b"}) == {}
    assert compute_weights([], [1.0], {}) == {}
    assert all(math.isfinite(v) for v in w.values())


# ------------------------------------------------------------------------------------------ state

def test_state_persists_progress_ledger_and_log(tmp_path):
    p = tmp_path / "v.sqlite"
    st = ValidatorState(p)
    assert st.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert st.bind_run("run1", 2) == 2
    led = Ledger([0.5, 0.5])
    led.credit(1, "a", 0, 64)
    led.fail(2, "b", 1)
    mb = {"idx": 0, "microbatch_id": "x", "ok": True, "loss": 5.5, "tokens": 64,
          "pathway": [{"stage": 0, "uid": 1, "hotkey": "a"}, {"stage": 1, "uid": 3, "hotkey": "c"}],
          "reroutes": 1, "failures": [{"stage": 1, "uid": 2}], "latency_s": 0.1, "bytes_sent": 10, "bytes_received": 20}
    st.commit_lane_step(0, 0, 1, [mb, {**mb, "idx": 1, "ok": False, "loss": None}], led, 5.5)
    st.commit_lane_step(1, 0, 1, [mb], led, 5.0)
    st.commit_lane_step(0, 1, 2, [mb], led, 4.0)
    st.log_weights(17, [1], [1.0])
    st.close()

    st = ValidatorState(p)
    assert st.bind_run("run1", 5) == 2           # resume keeps the stored lane count
    assert st.next_steps() == {0: 2, 1: 1}
    prog = st.lane_progress()
    assert prog[0]["steps_done"] == 2 and prog[0]["tokens"] == 128 and prog[0]["last_loss"] == 4.0
    log = st.microbatch_log(lane=0)
    assert len(log) == 3 and log[0]["pathway"][1]["uid"] == 3 and log[1]["ok"] is False and log[0]["reroutes"] == 1
    led2 = st.load_ledger([0.5, 0.5])
    assert led2.records[(1, "a")].tokens == 64 and led2.records[(2, "b")].failures == 1
    assert st.weights_blocks() == [17]
    with pytest.raises(StateError, match="run1"):
        st.bind_run("run2", 1)
    st.close()


def test_state_commit_is_atomic(tmp_path):
    st = ValidatorState(tmp_path / "v.sqlite")
    st.bind_run("r", 1)
    bad = {"idx": 0, "microbatch_id": "x", "ok": True, "loss": 1.0, "tokens": "not-a-number"}
    with pytest.raises(ValueError):
        st.commit_lane_step(0, 0, 1, [bad], Ledger([1.0]), 1.0)
    assert st.next_steps() == {} and st.microbatch_log() == []
    st.close()


def test_options_from_flat_names_fill_the_groups():
    from iota_subnet.validator.options import ValidatorOptions
    o = ValidatorOptions.from_flat(steps=3, audits=False, stale_grace=4, port=7, hop_timeout_s=9.0, netuid=2)
    assert (o.run.steps, o.audits.audits, o.scoring.stale_grace, o.outputs.port, o.merges.hop_timeout_s,
            o.chain.netuid) == (3, False, 4, 7, 9.0, 2)
    assert ValidatorOptions().run.steps == 10 and ValidatorOptions().audits.audits
    with pytest.raises(TypeError, match="no option 'nope'"):
        ValidatorOptions.from_flat(nope=1)


def test_scorekeeper_scores_a_ledger_without_the_service():
    from iota_subnet.validator.audit_policy import AuditPolicy
    from iota_subnet.validator.options import ScoringOptions
    from iota_subnet.validator.scorekeeper import ScoreKeeper
    ledger = Ledger([1.0, 1.0])
    for uid, hk, stage in ((1, "a", 0), (2, "b", 1)):
        ledger.record(uid, hk, stage).completed += 10
        ledger.credit(uid, hk, stage, 1000)
    keeper = ScoreKeeper(ScoringOptions(burn_uid=None))
    w = keeper.update(ledger, {0: "v", 1: "a", 2: "b"}, AuditPolicy(), block=5, exclude_uids=[0])
    assert set(w) == {1, 2} and math.isclose(sum(w.values()), 1.0)
    assert {row["uid"] for row in keeper.explained["miners"]} == {1, 2}


def test_lane_progress_unrouted_in_a_bounded_and_an_open_ended_run(tmp_path):
    """Miners of a lane driven to its last step are unrouted by the validator's choice; an open-ended run
    (``steps`` None) finishes no lane (the comparison with None raised before)."""
    reps = {s: [Replica(uid=1 + s * 2 + l, hotkey=f"hk{s}{l}", endpoint=f"127.0.0.1:{9000 + s * 2 + l}", stage=s)
                for l in range(2)] for s in range(2)}
    router = Router(2)
    router.update(reps)
    lp = LaneProgress(tmp_path / "metrics.jsonl")
    lp.next_steps = {0: 5, 1: 3}
    assert lp.unrouted(router, 5, 2) == {router.lane_member(0, s).key for s in range(2)}
    assert lp.unrouted(router, None, 2) == set()


def test_a_starting_validator_waits_for_a_permit_holder_without_a_commitment():
    """Two validators started together: the one that read the metagraph before the other's
    commitment landed waits (syncing) until it lands, so both split the lane steps the same way;
    a permit holder that never publishes costs at most ``wait_peers_s``."""
    async def go(lands_after: int, wait_s: float) -> tuple[int, float]:
        view = MetagraphView(ChainOptions(wait_peers_s=wait_s), RunOptions())
        view.peers = PeerView(["me"], foreign=1, unannounced=1)
        syncs = 0

        async def sync():
            nonlocal syncs
            syncs += 1
            if syncs >= lands_after:
                view.peers = PeerView(["me", "other"])
        t0 = time.monotonic()
        await view.wait_for_peers(asyncio.Event(), sync)
        return syncs, time.monotonic() - t0

    syncs, took = asyncio.run(go(lands_after=2, wait_s=30.0))
    assert syncs == 2 and took < 5.0
    syncs, took = asyncio.run(go(lands_after=10**6, wait_s=2.0))     # never publishes: bounded
    assert 1 <= syncs <= 3 and 1.5 < took < 5.0


def test_barring_a_miner_fails_every_flight_still_running_through_it_at_once():
    """Tickets issued ahead (8 steps) still named a barred head: each waited out a stall timeout
    (3-10 s per lane step) before its re-issue routed around it."""
    import asyncio

    from iota_subnet.protocol import Ticket
    from iota_subnet.validator.flights import FlightBook

    def t(step, route):
        return Ticket(run_id="r", validator="v", lane=0, step=step, index=0, microbatch_id=f"mb-{step}",
                      split="train", seed=0, start=0, rows=2, seq_len=32, width=16, wire_dtype="bf16", train=True,
                      micro_per_step=1, route=route)

    async def main():
        book = FlightBook(clock=lambda: 0.0)
        for step, route in ((5, ("bad", "b", "c")), (6, ("bad", "b", "c")), (7, ("a", "b", "c"))):
            book.open(t(step, route))
        book.flights["mb-5"].done = True
        assert book.fail_through("bad", "barred") == 1
        assert [book.index_state(0, s, 0) for s in (5, 6, 7)] == ["done", "failed", "running"]
        assert book.flights["mb-6"].unreachable == {"bad"}
    asyncio.run(main())
