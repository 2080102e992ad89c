"""A run config naming a ``transformers`` model and a ``datasets`` dataset: read, resolved (FLOP split
written into pipeline.layer_split, absolute paths), round-tripped through the config the neurons read,
and refused before any network work with a message naming the fix (exit code 2 from ``localnet``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from iota_subnet.config import ConfigError, config_from_dict, load_config
from iota_subnet.config_hf import HFDataConfig, HFModelConfig
from iota_subnet.data import build_dataset, fingerprints
from iota_subnet.data.hf_datasets import DatasetFieldError, TokenizerMismatchError
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.model.hf_family import StageSplitError, UnsupportedFamilyError, build_hf_stages, run_stages
from iota_subnet.network.localnet import resolved_config_yaml
from support.hf_run import WIKI, write_run

pytestmark = pytest.mark.skipif(not WIKI.exists(), reason=f"{WIKI} not present")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hfrun")
    write_run(d, vocab_size=2048, layers=4)
    return d


def _edit(run_dir: Path, tmp: Path, fn) -> Path:
    raw = yaml.safe_load((run_dir / "run.yaml").read_text())
    fn(raw)
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_hf_config_loads_resolves_and_round_trips(run_dir, tmp_path):
    cfg = load_config(run_dir / "run.yaml")
    assert isinstance(cfg.model, HFModelConfig) and isinstance(cfg.data, HFDataConfig)
    assert cfg.model.dim == 128 and cfg.model.n_layers == 4 and cfg.data.vocab_size == cfg.model.vocab_size
    assert cfg.pipeline.layer_split is not None and sum(cfg.pipeline.layer_split) == 4
    assert Path(cfg.model.hf).is_absolute() and Path(cfg.data.hf["path"]).is_absolute()
    assert config_from_dict(cfg.to_dict()) == cfg
    p = tmp_path / "resolved.yaml"
    p.write_text(resolved_config_yaml(cfg))
    assert load_config(p) == cfg
    # a relative path is read from the config file's folder
    rel = _edit(run_dir, tmp_path, lambda r: r["model"].update(hf="../" + run_dir.name + "/model"))
    assert load_config(rel).model.hf == cfg.model.hf


def test_hf_config_model_type_with_fields(run_dir, tmp_path):
    def to_type(r):
        folder = json.loads((Path(r["model"]["hf"]) / "config.json").read_text())
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
        r["model"] = {"hf": "qwen2", "config": {k: folder[k] for k in keep}}
    cfg = load_config(_edit(run_dir, tmp_path, to_type))
    assert cfg.model.hf == "qwen2" and cfg.model.transformers_config().model_type == "qwen2"


def test_hf_stage_workers_equal_the_staged_model(run_dir):
    """StageWorkers built from the run config hold the family's stages: their chained loss equals the
    cross-entropy of the in-process staged model built from the same folder and seed."""
    cfg = load_config(run_dir / "run.yaml")
    tok, ds = build_dataset(cfg.data, None, cache_dir=run_dir / "cache")
    tok2, ds2 = build_dataset(cfg.data, None, cache_dir=run_dir / "cache2")
    assert fingerprints(tok, ds) == fingerprints(tok2, ds2)
    ws = [StageWorker(cfg, s) for s in range(3)]
    rows = ds.batch(0, 0, 4)
    x, y = rows[:, :-1], rows[:, 1:]
    h = x
    for w in ws[:-1]:
        h = w.forward("m", h, train=False)["activations"]
    loss = ws[-1].forward("m", h, y, train=False)["loss"]
    ranges = [(s.layer_range.start, s.layer_range.stop) for s in (w.module for w in ws)]
    ref = run_stages(build_hf_stages(cfg.model.hf, 3, layer_ranges=ranges), x)
    want = torch.nn.functional.cross_entropy(ref.reshape(-1, ref.shape[-1]), y.reshape(-1)).item()
    assert abs(loss - want) < 1e-5


@pytest.mark.parametrize("edit, err, match", [
    (lambda r: r["model"].update(hf="gpt2"), UnsupportedFamilyError, "supported: llama, mistral, qwen2, qwen3"),
    (lambda r: r["pipeline"].update(stages=5), StageSplitError, "use at most 4 stages"),
    (lambda r: r["data"]["hf"].update(text_field="body"), DatasetFieldError, "no field 'body'"),
    (lambda r: r["pipeline"].update(compression_ratio=4), ConfigError, "compression_ratio: 1"),
    (lambda r: r["model"].update(config={"tie_word_embeddings": True}), ConfigError, "all-reduce"),
    (lambda r: r["model"].update(config={"vocab_size": 9000}), TokenizerMismatchError, "not this model's tokenizer"),
    (lambda r: r["model"].update(init="pretrained"), ConfigError, "safetensors"),
])
def test_hf_config_refused_with_the_fix(run_dir, tmp_path, edit, err, match):
    with pytest.raises(err, match=match):
        load_config(_edit(run_dir, tmp_path, edit))


def test_localnet_refuses_bad_hf_config_before_network_work(run_dir, tmp_path):
    p = _edit(run_dir, tmp_path, lambda r: r["data"]["hf"].update(text_field="body"))
    out = tmp_path / "ln"
    r = subprocess.run([sys.executable, "-m", "iota_subnet.cli", "localnet", "--config", str(p), "--out", str(out),
                        "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no field 'body'" in r.stderr + r.stdout
    assert not (out / "chain.db").exists()


@pytest.fixture(scope="module")
def masked_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hfmask")
    write_run(d, vocab_size=2048, layers=4, mask=True)
    return d


def test_masked_targets_reach_the_tail_loss(masked_dir):
    """With data.hf.mask_field the tail's targets carry -100 on unmarked tokens (what a tail miner reads):
    the chained StageWorker loss equals the transformers model's cross-entropy ignoring those targets."""
    from transformers import AutoModelForCausalLM

    from iota_subnet.model.hf_family import assemble_state_dict
    cfg = load_config(masked_dir / "run.yaml")
    _, ds = build_dataset(cfg.data, None, cache_dir=masked_dir / "cache")
    assert ds.has_loss_mask
    ws = [StageWorker(cfg, s) for s in range(3)]
    rows, mask, y = ds.batch(0, 0, 4), ds.mask_batch(0, 0, 4), ds.target_batch("train", 0, 0, 4)[:, 1:]
    assert 0 < int(mask[:, 1:].sum()) < mask[:, 1:].numel()
    h = rows[:, :-1]
    for w in ws[:-1]:
        h = w.forward("m", h, train=False)["activations"]
    loss = ws[-1].forward("m", h, y, train=False)["loss"]
    model = AutoModelForCausalLM.from_config(cfg.model.transformers_config())
    model.load_state_dict(assemble_state_dict([w.module for w in ws]))
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    assert abs(loss - ref.item()) < 1e-5


def test_network_evaluation_weighs_micro_batches_by_their_trained_targets(masked_dir, run_dir):
    """The validator's final evaluation (ControlPlane.evaluate) weighs each micro-batch's mean loss by its
    marked targets, so it is the mean over every target as `iota-subnet eval` computes it; unmasked: 1 each."""
    from types import SimpleNamespace

    from iota_subnet.validator.control import ControlPlane
    for d, masked in ((masked_dir, True), (run_dir, False)):
        cfg = load_config(d / "run.yaml")
        _, ds = build_dataset(cfg.data, None, cache_dir=d / "cache")
        plane = SimpleNamespace(dataset=ds, mb=4)
        got = [ControlPlane._eval_weight(plane, i) for i in range(2)]
        if masked:
            assert got == [int((ds.target_batch("val", 0, 4 * i, 4)[:, 1:] != -100).sum()) for i in range(2)]
            assert 0 < got[0] < 4 * cfg.data.seq_len
        else:
            assert got == [1, 1]


@pytest.mark.parametrize("masked", [False, True])
def test_colocated_hf_run_exports_and_evaluates(run_dir, masked_dir, tmp_path, masked):
    """train-colocated on an HF run, export (the family's own class, the tokenizer copied in), and
    `iota-subnet eval` gives the run's own final evaluation (masked too: both average over the marked targets)."""
    from transformers import AutoModelForCausalLM

    from iota_subnet.hf.export import export_run
    from iota_subnet.hf.runtime import evaluate_file
    from iota_subnet.train.colocated import train_colocated
    d = masked_dir if masked else run_dir
    summary = train_colocated(str(d / "run.yaml"), None, 3, tmp_path / "colo", cache_dir=d / "cache")
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] < 9.0
    info = export_run(tmp_path / "colo", tmp_path / "exp")
    assert info["model_class"] == "Qwen2ForCausalLM" and (tmp_path / "exp" / "tokenizer.json").exists()
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp"))
    ev = evaluate_file(tmp_path / "exp", str(d / "corpus.jsonl"), cache_dir=tmp_path / "evcache")
    if masked:
        assert ev["tokens"] < ev["rows"] * ev["seq_len"]                 # only the marked targets
    assert abs(ev["loss"] - summary["val_loss"]) < 1e-4, (ev, summary["val_loss"])
