"""The cheater suite on ``transformers`` families in a network (weights): per family (tiny
random-weight Qwen2, Qwen3, Mistral with ``sliding_window`` a quarter of the sequence; configs of
tests/test_hf_cheaters.py), 3 stages x 2 replicas of real MinerServices and a real ValidatorService on a
devnet in one process (:class:`support.dataplane_net.P2PNet`, signed HTTP on 127.0.0.1), the middle
stage's second replica cheating: ``random``, ``zero``, ``noisy-update``, ``copy``, ``lazy``, ``precision``
and the family's own cheat (``drop-bias``, ``skip-qk-norm``, ``full-attention``). The validator's audits flag it (hop
audits by exact replay; ``noisy-update`` by the update audit): its weight is 0 and honest miners hold
>= 95 % of the weights. 21 network runs of ~15-20 s each on 2 cores."""
from __future__ import annotations

import pytest
import yaml

from support.dataplane_net import cheater_run, run
from test_hf_cheaters import FAMILIES, family_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


async def family_cheater_run(tmp_path, wikitext_path, cache_dir, family: str, kind: str, steps: int = 14):
    cfg = tmp_path / "run.yaml"
    # Qwen2 from a checkpoint whose biases are not 0: a drop-bias cheater whose biases stayed at
    # their initial 0 computes what an honest miner computes with its weights (the limit in
    # iota_subnet/sim/family_cheats.py)
    run_cfg = family_run(tmp_path, family, pretrained=family == "qwen2")
    cfg.write_text(yaml.safe_dump(run_cfg, sort_keys=False))
    return await cheater_run(tmp_path, wikitext_path, cache_dir, kind, steps, config=cfg)


#: kind -> the audits that may flag it (``copy``: its hops are a peer's computation and its own weights
#: never get a gradient, so either audit fails it first; tests/test_audit_wire.py's CAUGHT_BY)
CAUGHT_BY = {"random": ("hop",), "zero": ("hop",), "copy": ("hop", "update"), "noisy-update": ("update",),
             "lazy": ("hop",), "precision": ("hop",), **{own: ("hop",) for _, own in FAMILIES.values()}}
CASES = [(f, k) for f, (_, own) in FAMILIES.items() for k in ("random", "zero", "noisy-update", "copy", "lazy", "precision", own)]


@pytest.mark.parametrize("family,kind", CASES)
def test_cheater_caught_in_the_data_plane(tmp_home, tmp_path, wikitext_path, cache_dir, family, kind):
    vali, adv, honest, _ = run(family_cheater_run(tmp_path, wikitext_path, cache_dir, family, kind), timeout=380)
    flagged = {k[0] for k in vali.audits.flagged()}
    assert flagged == {adv.uid}, (flagged, [(r.uid, r.kind, r.raw, r.detail) for r in vali.auditing.records])
    reasons = " ".join(vali.audits.stats[(adv.uid, adv.hotkey)].reasons)
    want = [{"hop": "hop audit failed", "update": "update audit failed"}[a] for a in CAUGHT_BY[kind]]
    assert any(x in reasons for x in want), (want, reasons)
    w = vali.weights.last_weights
    assert w.get(adv.uid, 0.0) == 0.0, w
    assert sum(v for u, v in w.items() if u in honest) >= 0.95 * sum(w.values()) > 0, w
