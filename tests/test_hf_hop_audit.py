"""Hop audits of a ``transformers`` family stage (a tiny Qwen2, 3 stages), replayed by the validator
(:mod:`iota_subnet.audit.replay`): honest hops pass in every direction and wire dtype; an output
scaled by 1.01 or with noise added, a wrong gradient sent upstream, a wrong reported loss and
weights other than the committed version fail; a tail replay takes the loss mask (ignored targets)."""
from __future__ import annotations

import random

import pytest
import torch

from iota_subnet.audit import (HopAuditor, HopProver, LayoutError, Tolerances, TraceLayout, run_local_audit,
                               weights_commitment)
from iota_subnet.audit.commit import wire_root, wire_sha256
from iota_subnet.audit.prover import HopInputs
from iota_subnet.config import PipelineConfig
from iota_subnet.config_hf import hf_model_config
from iota_subnet.model.hf_pipeline import HFPipelineStage
from iota_subnet.protocol import from_wire, to_wire

B, T, MPS = 2, 16, 2
QWEN2 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False}


def qwen2_run(config: dict):
    """A 3-stage Qwen2 of ``config`` (seed 7) and B x T token rows and targets drawn from its vocabulary."""
    torch.set_num_threads(1)
    cfg = hf_model_config({"hf": "qwen2", "config": config})
    pcfg = PipelineConfig(stages=3)
    stages = [HFPipelineStage(cfg, pcfg, i, seed=7) for i in range(3)]
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config["vocab_size"], (B, T + 1), generator=g)
    return cfg, pcfg, stages, rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@pytest.fixture(scope="module")
def run():
    return qwen2_run(QWEN2)


def _wire(t: torch.Tensor, fmt: str):
    if fmt in ("int8", "fp8"):
        data, scales = to_wire(t.detach(), fmt)
        return (data, scales), from_wire(data, scales)
    w = t.detach().to({"bf16": torch.bfloat16, "fp32": torch.float32}[fmt])
    return w, w.float()


def honest_hop(run, stage: int, fmt: str):
    """What the miner of ``stage`` received, computed and sent for one micro-batch (fp32 on the host).
    Returns (HopInputs, loss or None)."""
    cfg, pcfg, stages, tokens, targets = run
    x = tokens
    for s in stages[:stage]:                      # the upstream stages' outputs, as the wire carried them
        x = _wire(s(x), fmt)[1]
    hop = HopInputs(x=x, targets=targets if stage == 2 else None)
    m = stages[stage]
    if stage > 0:
        hop.wire["wire.x"] = _wire(x, fmt)[0]
        x = x.clone().requires_grad_(True)
    if stage == 2:
        loss = m(x, targets)
        hop.wire["wire.dx"] = _wire(torch.autograd.grad(loss / MPS, x)[0], fmt)[0]
        return hop, float(loss.detach())
    out = m(x)
    hop.wire["wire.z"] = _wire(out, fmt)[0]
    if stage == 1:
        dz_w, dz = _wire(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * 1e-3, fmt)
        hop.grad, hop.wire["wire.dz"] = dz, dz_w
        hop.wire["wire.dx"] = _wire(torch.autograd.grad(out, x, grad_outputs=dz)[0], fmt)[0]
    return hop, None


def audit(run, stage: int, direction: str, hop: HopInputs, loss=None, fmt: str = "bf16", commit: str = "root",
          weights=None):
    cfg, pcfg, stages, tokens, targets = run
    lay = TraceLayout.build(cfg, pcfg, stage, batch=B, seq=T, direction=direction, micro_per_step=MPS,
                            wire_format=fmt)
    assert lay.replay and not lay.trace
    wc = weights_commitment(stages[stage].state_dict())
    root = wire_sha256 if commit == "sha256" else wire_root
    roots = {k: root(v) for k, v in hop.wire.items() if k in lay.wire}
    aud = HopAuditor(lay, weights_root=wc.root, wire_roots=roots, tol=Tolerances.for_precision("fp32"),
                     wire_commit=commit, rng=random.Random(1), tokens=tokens if stage == 0 else None,
                     targets=targets if stage == 2 else None, loss=loss)
    prover = HopProver(lay, weights_commitment(weights) if weights is not None else wc, hop)
    return run_local_audit(prover, aud, stage=stage).verdict


CASES = [(0, "forward", "bf16"), (1, "forward", "bf16"), (1, "backward", "bf16"), (2, "backward", "bf16"),
         (1, "backward", "fp32"), (1, "backward", "int8"), (2, "backward", "int8"), (1, "backward", "fp8"),
         (2, "backward", "fp8")]


@pytest.mark.parametrize("stage,direction,fmt", CASES)
def test_honest_hf_hops_pass_the_replay(run, stage, direction, fmt):
    hop, loss = honest_hop(run, stage, fmt)
    v = audit(run, stage, direction, hop, loss, fmt)
    assert v.ok, v.failures
    assert v.checks >= B * T


def test_honest_hop_passes_against_flat_sha256_receipts(run):
    hop, _ = honest_hop(run, 1, "bf16")
    v = audit(run, 1, "backward", hop, commit="sha256")
    assert v.ok, v.failures


def _tamper(hop: HopInputs, name: str, fn) -> HopInputs:
    out = HopInputs(x=hop.x, targets=hop.targets, grad=hop.grad, wire=dict(hop.wire))
    out.wire[name] = fn(hop.wire[name].float()).to(hop.wire[name].dtype)
    return out


def _noise(t: torch.Tensor) -> torch.Tensor:
    return t + 0.01 * t.std() * torch.randn(t.shape, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("stage,name,fn,link", [
    (0, "wire.z", lambda t: t * 1.01, "output"),
    (1, "wire.z", _noise, "output"),
    (1, "wire.dx", lambda t: t * 1.01, "grad_in"),
    (2, "wire.dx", _noise, "grad_in"),
])
def test_a_wrong_output_or_gradient_fails(run, stage, name, fn, link):
    hop, loss = honest_hop(run, stage, "bf16")
    bad = _tamper(hop, name, fn)
    v = audit(run, stage, "forward" if stage == 0 else "backward", bad, loss)
    assert not v.ok and link in v.failed_links, (v.failures, dict(v.errors))


def test_one_wrong_token_row_fails(run):
    hop, _ = honest_hop(run, 1, "bf16")
    v = audit(run, 1, "forward", _tamper(hop, "wire.z", lambda t: t.index_put_((torch.tensor([1]), torch.tensor([9])),
                                                                              t[1, 9] * 1.05)))
    assert not v.ok and "output" in v.failed_links


def test_a_wrong_reported_loss_fails(run):
    hop, loss = honest_hop(run, 2, "bf16")
    v = audit(run, 2, "backward", hop, loss * 1.01)
    assert not v.ok and "loss" in v.failed_links


def test_weights_other_than_the_receipts_version_fail(run):
    hop, _ = honest_hop(run, 1, "bf16")
    other = {k: v + 1e-3 for k, v in run[2][1].state_dict().items()}
    v = audit(run, 1, "forward", hop, weights=other)
    assert not v.ok and "weight roots" in v.reason


def test_masked_targets_replay_and_a_project_request_is_refused(run):
    cfg, pcfg, stages, tokens, targets = run
    masked = targets.clone()
    masked[:, : T // 2] = -100                     # the loss mask: only the second half is trained
    mrun = (cfg, pcfg, stages, tokens, masked)
    hop, loss = honest_hop(mrun, 2, "bf16")
    assert audit(mrun, 2, "backward", hop, loss).ok
    assert not audit(run, 2, "backward", hop, loss).ok          # the same hop against unmasked targets
    lay = TraceLayout.build(cfg, pcfg, 1, batch=B, seq=T, direction="forward", wire_format="bf16")
    prover = HopProver(lay, weights_commitment(stages[1].state_dict()), honest_hop(run, 1, "bf16")[0])
    prover.commit()
    with pytest.raises(LayoutError):
        prover.project(bytes(32))
