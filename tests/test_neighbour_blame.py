"""A miner slowed by another miner's fault keeps its share.

A stage-1 miner becomes a black hole (accepts connections, never answers) in the middle of a run.
Traffic is routed around it and both lanes finish, but its upstream neighbour waited on it: its
lane stalled, its hops timed out. Pay follows verified work per opportunity the validator gave, so
the neighbour's weight must be at least 0.9 x its twin's (the first-stage miner of the healthy lane)
x their verified-work ratio. (Before the fix: 0.03 against 0.23 at 269 vs 219 units in a local
network. Here, before the fix, the neighbour's lag grew while its hops timed out, and its rate was
its work over every tempo from its first to its last, the stalled ones included: about 0.6 x its
twin's weight at equal work.)

A real :class:`ControlPlane`, :class:`Router`, :class:`Ledger` and :class:`Scoreboard`; the miners
are scripted (:mod:`support.blackhole`); a tempo is ``TEMPO_S`` of wall time (a window long
enough to hold the whole run); the rules themselves are checked on their own below.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from bittensor.sp_core import Keypair

from iota_subnet.config import load_config
from iota_subnet.validator.control import ControlOptions, ControlPlane
from iota_subnet.validator.hindrance import Hindrances
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger, Scoreboard
from support.blackhole import ScriptedNet
from support.dataplane_net import OVR

TEMPO_S = 0.05
STEPS = 24
HOLE_AT = 10         # lane step of the healthy run after which the stage-1 miner of lane 0 stops answering


def _run(steps: int = STEPS, hole_at: int = HOLE_AT):
    cfg = load_config("configs/tiny.yaml", OVR)
    n = cfg.pipeline.stages
    reps = {s: [Replica(uid=1 + s * 2 + l, hotkey=Keypair.create_from_uri(f"//nb{s}-{l}").ss58_address,
                        endpoint=f"127.0.0.1:{9100 + s * 2 + l}", stage=s) for l in range(2)] for s in range(n)}
    router = Router(n, cooldown_base_s=0.25, cooldown_max_s=2.0)
    router.update(reps)
    hole, slowed, twin = reps[1][0], reps[0][0], reps[0][1]
    assert router.lane_member(0, 1) is hole and router.lane_member(0, 0) is slowed and router.lane_member(1, 0) is twin
    net = ScriptedNet(set(), hop_timeout_s=1.0, compute_s=0.01)
    ledger, board = Ledger([1.0] * n), Scoreboard(window=256)
    cp = ControlPlane(cfg, router=router, client=net, keypair=Keypair.create_from_uri("//nbv"),
                      dataset=SimpleNamespace(n_val_rows=8), ledger=ledger,
                      opts=ControlOptions(run_id="nb", n_lanes=2, stall_s=0.6, min_stall_s=0.6, max_attempts=6,
                                          pace_every=0, lookahead=4, reissue_backoff_s=0.05))
    net.cp = cp
    done: dict[int, bool] = {0: False, 1: False}
    steps_done = [0]

    def on_step(res, next_step):
        steps_done[0] += 1
        if res.lane == 0 and res.step + 1 == hole_at:
            net.black_holes.add(hole.hotkey)
        if next_step >= steps:
            done[res.lane] = True

    seen = [None]

    def tempo():          # what the validator service does at each weights round
        unrouted = {router.lane_member(l, s).key for l, d in done.items() if d for s in range(n)}
        stalled = not all(done.values()) and seen[0] is not None and steps_done[0] <= seen[0]
        seen[0] = steps_done[0]
        board.update(ledger, unrouted=unrouted, lanes_stalled=stalled, **_blocked(cp))

    async def tempos(stop: asyncio.Event):
        while not stop.is_set():
            await asyncio.sleep(TEMPO_S)
            tempo()

    async def probes(stop: asyncio.Event):      # the service's sync loop probes failed miners too
        while not stop.is_set():
            await asyncio.sleep(2 * TEMPO_S)
            await cp.probe()

    async def main():
        stop = asyncio.Event()
        loops = [asyncio.create_task(tempos(stop)), asyncio.create_task(probes(stop))]
        await asyncio.wait_for(cp.run({0: 0, 1: 0}, steps, on_step), timeout=120)
        await asyncio.sleep(2 * TEMPO_S)      # late receipts
        stop.set()
        await asyncio.gather(*loops)
        await asyncio.sleep(router.next_probe_in() or 0.0)     # the sync loop's next probe of the black hole
        await cp.probe()
        tempo()
        await net.close()

    t0 = time.perf_counter()
    asyncio.run(main())
    current = {r.uid: r.hotkey for rs in reps.values() for r in rs}
    weights = board.weights(ledger.shares, current)
    return SimpleNamespace(weights=weights, board=board, ledger=ledger, hole=hole, slowed=slowed, twin=twin,
                           wall_s=time.perf_counter() - t0)


def _blocked(cp) -> dict:
    """What the validator service passes on about miners blocked by another's fault (nothing before the fix)."""
    take = getattr(cp, "take_blocked", None)
    return {"blocked": take(), "at": cp.clock()} if take is not None else {}


def test_a_neighbour_slowed_by_a_black_hole_keeps_its_share_of_verified_work():
    r = _run()
    work = {k: rec.work for k, rec in r.ledger.records.items()}
    w_slowed, w_twin = r.weights.get(r.slowed.uid, 0.0), r.weights.get(r.twin.uid, 0.0)
    ratio = work[r.slowed.key] / work[r.twin.key]
    why = {k: (e.rate, e.lag, e.freshness, e.why) for k, e in r.board.entries.items()}
    assert work[r.slowed.key] > 0 and w_twin > 0, (work, r.weights)
    assert w_slowed >= 0.9 * w_twin * ratio, (w_slowed, w_twin, ratio, why)
    # the black hole itself did less and is charged: it does not keep a share it did not work for
    assert r.ledger.records[r.hole.key].failures > 0
    assert r.weights.get(r.hole.uid, 0.0) < w_slowed


# ------------------------------------------------------------------ the rules, one by one

class _Ledger(Ledger):
    def __init__(self):
        super().__init__([1.0])


class _Tempos:
    """Weights rounds 10 s apart over one ledger and board: ``tempo({key: work}, blocked)``."""

    def __init__(self, board: Scoreboard):
        self.ledger, self.board, self.t = _Ledger(), board, 0.0

    def __call__(self, work: dict, blocked=None) -> None:
        self.t += 10.0
        for key, w in work.items():
            self.ledger.credit(*key, 0, w)
        self.board.update(self.ledger, blocked=blocked, at=self.t)


def test_blocked_tempos_take_back_lag_and_leave_the_rate_at_the_unblocked_pace():
    tempo = _Tempos(Scoreboard(grace=1))
    board = tempo.board
    slowed, twin, gone = (1, "a"), (2, "b"), (3, "c")

    for _ in range(3):
        tempo({slowed: 100, twin: 100, gone: 100})
    start = tempo.t                                   # then its neighbour stops answering (and `gone` leaves)
    for _ in range(3):
        tempo({twin: 100})
    assert board.entries[slowed].lag == 3 and board.entries[slowed].freshness < 1
    tempo({slowed: 20, twin: 100}, blocked={slowed: start + 1.0})     # the fault is known: retroactively
    e = board.entries[slowed]
    assert e.lag == 0 and e.freshness == 1.0 and e.blocked == [4, 5, 6, 7]
    assert e.rate == 320 / (3 + 0.2)            # 4 blocked tempos count as 20/100 of a tempo
    assert board.entries[twin].rate == 100
    tempo({slowed: 100, twin: 100}, blocked={slowed: tempo.t - 5.0})        # blocked, yet at full pace: counts 1
    assert board.entries[slowed].rate == 420 / 4.2
    for _ in range(3):
        tempo({slowed: 100, twin: 100})
    assert board.entries[slowed].rate == 720 / 7.2 == board.entries[twin].rate
    g = board.entries[gone]                      # never blocked: it goes stale as before
    assert g.lag == 8 and g.freshness < 0.1 and not g.blocked
    w = board.weights([1.0], {1: "a", 2: "b", 3: "c"})
    assert abs(w[1] - w[2]) < 1e-9 and w[3] < 0.01 * w[1]
    assert Scoreboard.from_dict(board.to_dict()).to_dict() == board.to_dict()


def test_a_claim_excuses_only_once_the_validator_found_the_culprit_down_and_never_a_charged_member():
    t = [100.0]
    h = Hindrances(clock=lambda: t[0])
    keys = {hk: (i, hk) for i, hk in enumerate("abcxyz")}
    h.worked("a", 104.0)
    h.note(["a", "x", "c"], ["x"], since=102.0)           # a receipt names x unreachable: a claim
    assert h.take(keys) == {}
    t[0] = 110.0
    h.down("x")                                          # the validator's own probe of x failed
    assert h.take(keys) == {keys["a"]: 104.0, keys["c"]: 102.0}     # a worked until 104
    assert h.take(keys) == {}
    h.note(["b", "y"], ["y"], since=110.0)
    h.up("y")                                            # y answers: the claim against it excuses nobody
    h.down("y")
    assert h.take(keys) == {}
    h.note(["b", "z", "c"], ["z"], since=111.0, proven=True)     # seen by the validator: at once
    t[0] = 112.0
    h.charged("c")                                       # c failed itself meanwhile: not excused
    assert h.take(keys) == {keys["b"]: 111.0}


def test_a_miner_is_excused_in_at_most_half_the_window():
    """A colluding neighbour that keeps failing cannot keep a miner's rate up for a whole window: after
    ``window // 2`` excused tempos, tempos without its work count against it again (lag, span)."""
    tempo = _Tempos(Scoreboard(window=8, grace=1))
    board = tempo.board
    idler, twin = (1, "a"), (2, "b")

    for _ in range(2):
        tempo({idler: 100, twin: 100})
    start = tempo.t
    for i in range(6):                           # "blocked" every tempo from here on, doing nothing
        tempo({twin: 100}, blocked={idler: start + 1.0})
        e = board.entries[idler]
        if i < 4:                                # 4 = window // 2 tempos are excused
            assert e.lag == 0 and e.freshness == 1.0 and len(e.blocked) == i + 1, (i, e.why)
        else:
            assert e.lag == i - 3 and len(e.blocked) == 4, (i, e.lag, e.why)
    assert any("already excused in 4 tempo(s)" in w for w in board.entries[idler].why)
    assert board.entries[idler].freshness < 1.0      # lag 2 > grace 1: it goes stale as the twin keeps working
    w = board.weights([1.0], {1: "a", 2: "b"})
    assert w[1] < 0.6 * w[2], w
    capped = Scoreboard(window=8, grace=1, max_excused=0)
    assert capped.excuse_cap() == 0 and Scoreboard(window=8).excuse_cap() == 4


def test_blocks_and_claims_survive_a_validator_restart_and_a_corrupt_save_is_ignored():
    t = [100.0]
    keys = {hk: (i, hk) for i, hk in enumerate("abcxyz")}
    before = Hindrances(clock=lambda: t[0])
    before.note(["a", "x"], ["x"], since=101.0, proven=True)     # confirmed block of a
    before.note(["b", "y"], ["y"], since=102.0)                  # a claim, not yet confirmed
    before.charged("c")
    saved = before.to_json()                                    # saved with the scores; the process dies
    after = Hindrances(clock=lambda: t[0])
    assert after.load_json(saved)
    t[0] = 105.0
    after.down("y")                                             # the claim is confirmed in the new process
    after.note(["c", "z"], ["z"], since=99.0, proven=True)      # c was charged at 100: not excused
    assert after.take(keys) == {keys["a"]: 101.0, keys["b"]: 102.0}
    for bad in ("{not json", '{"blocked": {"a": "soon"}}', '{"pending": {"x": [[1]]}}', "[1, 2]"):
        fresh = Hindrances(clock=lambda: t[0])
        assert not fresh.load_json(bad)
        assert fresh.take(keys) == {}
