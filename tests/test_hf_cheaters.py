"""The cheater suite on ``transformers`` families: tiny random-weight Qwen2, Qwen3 (q/k norms, free
``head_dim``) and Mistral (``sliding_window`` a quarter of the sequence, so that it binds), 3 stages of
one decoder layer each, real StageWorkers trained two steps on wikitext-2 bytes (so biases and norms
have left their initial values) before the cheater is armed for the audited micro-batch.

Audit level, for every family: the validator's exact replay (:mod:`iota_subnet.audit.replay`) fails
the hops of ``random``, ``zero``, ``copy`` and the family's own cheat (``drop-bias``, ``skip-qk-norm``,
``full-attention``: :mod:`iota_subnet.sim.family_cheats`) on the middle stage (output and gradient
sent), and ``random`` / ``zero`` / ``copy`` on the tail too (loss and gradient); ``lazy`` (no decoder
layer: the stage holds one) and ``precision`` (bf16 autocast, the last layer without its MLP) on both
stages, in an fp32 run and (``precision``) a bf16 one; the honest hop passes; the update audit fails
``noisy-update`` on every step. The network level (weights) is
tests/test_hf_cheaters_net.py."""
from __future__ import annotations

import random

import pytest
import torch
import yaml

from iota_subnet.audit import Tolerances
from iota_subnet.config import ConfigError, load_config
from iota_subnet.sim.adversary import CheatingStageWorker, adversary_parts
from iota_subnet.validator.update_audit import UpdateAuditor
from support.audit import WIKITEXT, audit_many, make_chain
from support.hf_run import write_jsonl, write_tokenizer

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not WIKITEXT.exists(), reason=f"{WIKITEXT} not present")]

SEQ = 32
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}
#: family -> (its config fields, its own cheat)
FAMILIES = {"qwen2": ({}, "drop-bias"),
            "qwen3": ({"head_dim": 32}, "skip-qk-norm"),
            "mistral": ({"sliding_window": SEQ // 4}, "full-attention")}
GENERIC = ("random", "zero", "copy")
#: generic cheats a family stage does with a twin (:data:`iota_subnet.sim.family_cheats.TWIN_KINDS`)
TWIN = ("lazy", "precision")


def data_files(folder) -> dict:
    """The ``data`` section of a run reading wikitext-2 paragraphs (jsonl) with a 512-id BPE trained
    here (:mod:`support.hf_run`); its files under ``folder`` (written once)."""
    corpus = folder / "corpus.jsonl"
    if not corpus.exists():
        write_jsonl(folder)
    tok = folder / "tokenizer"
    if not tok.exists():
        tok, n = write_tokenizer(folder, 512)
        assert n <= BASE["vocab_size"], n
    return {"hf": {"path": str(corpus), "text_field": "text"}, "tokenizer": str(tok), "seq_len": SEQ}


def pretrained_folder(folder, family: str):
    """A ``transformers`` folder (config and safetensors) of the tiny ``family`` model with random
    weights whose biases and norm weights are away from their initial 0 and 1, as in a trained
    checkpoint (Qwen2's q/k biases are large)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    fields, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **BASE, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    out = folder / f"{family}-model"
    model.save_pretrained(str(out))
    return out


def family_run(folder, family: str, *, pretrained: bool = False, **train) -> dict:
    """The run config (a dict, as ``run.yaml`` holds it) of a tiny 3-stage ``family`` model (files
    under ``folder``); ``pretrained``: initialised from :func:`pretrained_folder`, else from scratch."""
    fields, _ = FAMILIES[family]
    model = ({"hf": str(pretrained_folder(folder, family)), "init": "pretrained"} if pretrained
             else {"hf": family, "config": {**BASE, **fields}})
    return {"model": model,
            "pipeline": {"stages": 3, "compression_ratio": 1, "layer_split": [1, 1, 1]},
            "data": data_files(folder),
            "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 40, "lr": 3e-3,
                      "eval_batches": 2, **train}}


def family_config(folder, family: str, **train):
    p = folder / f"{family}{''.join(f'-{k}-{v}' for k, v in train.items())}.yaml"
    p.write_text(yaml.safe_dump(family_run(folder, family, **train), sort_keys=False))
    return load_config(p)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("hfcheat")


@pytest.fixture(scope="module")
def configs(folder):
    return {f: family_config(folder, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def honest(configs):
    """Per family: the honest chain (trained two steps, then one recorded micro-batch)."""
    return {f: make_chain(cfg=c) for f, c in configs.items()}


def _failed(chain, stage, links):
    v = audit_many(chain, chain.hops[stage], "backward", 1, seed0=77)[0]
    assert not v.ok, (stage, v.failures)
    for link in links:
        assert link in v.failed_links, (link, v.failures[:3])


@pytest.mark.parametrize("family", FAMILIES)
def test_honest_family_hops_pass_the_replay(honest, family):
    ch = honest[family]
    for stage in (1, 2):
        v = audit_many(ch, ch.hops[stage], "backward", 1, seed0=77)[0]
        assert v.ok, (stage, v.failures)


@pytest.mark.parametrize("family", FAMILIES)
def test_generic_and_family_cheats_fail_the_replay(honest, family):
    own = FAMILIES[family][1]
    for kind in GENERIC + (own,):
        ch = make_chain(base=honest[family], kinds={1: kind})
        _failed(ch, 1, ("output", "grad_in"))
    for kind in GENERIC:
        ch = make_chain(base=honest[family], kinds={2: kind})
        _failed(ch, 2, ("loss", "grad_in"))


@pytest.mark.parametrize("kind", TWIN)
@pytest.mark.parametrize("family", FAMILIES)
def test_lazy_and_precision_fail_the_replay(honest, family, kind):
    """Max row errors measured (fp32 run, tolerance 1e-4): lazy ~0.8 (output), precision 5e-2 to 8e-2
    (output and grad_in; bf16 autocast alone: ~2.3e-3, 23x the tolerance; the tail's loss 3.6e-4 to 6e-4)."""
    for stage, links in ((1, ("output", "grad_in")), (2, ("loss", "grad_in"))):
        ch = make_chain(base=honest[family], kinds={stage: kind})
        w = ch.workers[stage]
        assert w.on_twin and len(w.module.layers) == 1      # /state holds the stage's one layer
        if kind == "lazy":
            assert len(w.twin.layers) == 0
        else:
            assert w.precision == "bf16" and type(w.twin.layers[-1].mlp).__name__ == "NoMLP"
        _failed(ch, stage, links)


@pytest.mark.parametrize("family", FAMILIES)
def test_precision_fails_the_replay_of_a_bf16_run(folder, family):
    """In a bf16 run (tolerance 2e-2, honest hops pass) the MLP it skips still shows: max row error
    5e-2 to 1.1e-1 (the middle stage's output and grad_in, the tail's grad_in)."""
    honest = make_chain(cfg=family_config(folder, family, precision="bf16"))
    tol = Tolerances.for_precision("bf16")
    for stage, links in ((1, ("output", "grad_in")), (2, ("grad_in",))):
        assert audit_many(honest, honest.hops[stage], "backward", 1, seed0=77, tol=tol)[0].ok
        ch = make_chain(base=honest, kinds={stage: "precision"})
        v = audit_many(ch, ch.hops[stage], "backward", 1, seed0=77, tol=tol)[0]
        assert not v.ok and set(links) <= set(v.failed_links), (stage, v.failures[:3])


def train(worker, steps: int, seed: int = 0) -> None:
    """``steps`` inner steps of a middle stage on random hidden states [2, SEQ, d]."""
    g = torch.Generator().manual_seed(seed)
    for k in range(steps * worker.micro_per_step):
        x = torch.randn(2, SEQ, worker.spec.in_width, generator=g)
        out = worker.forward(f"mb{k}", x)
        worker.backward(f"mb{k}", torch.randn(out["activations"].shape, generator=g) * 1e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_noisy_update_fails_the_update_audit(configs, family):
    c = configs[family]
    w = CheatingStageWorker(c, 1, kind="noisy-update", seed=0, total_steps=c.train.total_steps, audit_window=2)
    train(w, 2)
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=1, rng=random.Random(0))
    for s in w.updates.steps()[-2:]:
        commit = w.updates.commitment(s, timeout_s=10)
        req = auditor.plan(1, commit)
        chk = auditor.check(1, commit, req, w.updates.open(req.inner_step, req.merges, req.rows, req.kinds))
        assert not chk.ok and "AdamW recomputed" in chk.reason, chk


def test_a_family_cheat_needs_its_family(configs, tmp_path):
    with pytest.raises(ConfigError, match="applies to qwen2"):
        adversary_parts("drop-bias", configs["qwen3"])
    with pytest.raises(ConfigError, match="applies to qwen3"):
        CheatingStageWorker(configs["mistral"], 1, kind="skip-qk-norm")
    with pytest.raises(ConfigError, match="transformers family"):
        adversary_parts("full-attention", load_config("configs/tiny.yaml"))
    no_window = family_run(tmp_path, "qwen2")               # a Qwen2 without sliding layers
    p = tmp_path / "q.yaml"
    p.write_text(yaml.safe_dump(no_window))
    with pytest.raises(ConfigError, match="sliding-window layers"):
        adversary_parts("full-attention", load_config(p))
