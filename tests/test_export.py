"""The model out of the network: a co-located run exported to a Hugging Face folder loads with
``transformers`` and gives the same logits as the project's own model; ``eval`` gives the run's own
held-out loss on the same rows; ``generate`` samples text; bad inputs fail with the fix."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from iota_subnet.cli import main as cli_main
from iota_subnet.config import config_from_dict
from iota_subnet.data import build_dataset
from iota_subnet.hf import ExportError, evaluate_file, export_run, generate_text
from iota_subnet.model import StagedModel, build_stages
from iota_subnet.train.checkpoint import read_checkpoint
from iota_subnet.train.colocated import evaluate, train_colocated

pytestmark = pytest.mark.timeout(600)
transformers = pytest.importorskip("transformers")

SMALL = {"model": {"name": "tiny", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                   "vocab_size": 512, "max_seq_len": 64},
         "pipeline": {"stages": 3, "compression_ratio": 4, "layer_split": [2, 1, 1]},
         "data": {"vocab_size": 512, "seq_len": 32},
         "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 2, "eval_batches": 3}}


def _run(tmp_path, wikitext_path, cache_dir, name, cfg, steps=6):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = tmp_path / name
    summary = train_colocated(str(p), str(wikitext_path), steps, out, cache_dir=cache_dir, progress=False)
    return out, summary


def _own_model(run):
    cfg = config_from_dict(json.loads((run / "config.json").read_text()))
    model = StagedModel(build_stages(cfg))
    tensors, _ = read_checkpoint(run / "checkpoint.safetensors")
    model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}, strict=True)
    return cfg, model.eval()


@pytest.fixture(scope="module")
def bottleneck_run(tmp_path_factory, wikitext_path, cache_dir):
    tmp = tmp_path_factory.mktemp("export")
    run, summary = _run(tmp, wikitext_path, cache_dir, "resbm", SMALL)
    out = tmp / "hf"
    info = export_run(run, out, cache_dir=cache_dir)
    return run, out, summary, info


def test_bottleneck_export_loads_with_transformers_and_matches_our_logits(bottleneck_run):
    run, out, _, info = bottleneck_run
    assert info["trust_remote_code"] and info["model_class"] == "IotaForCausalLM"
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_iota.py", "configuration_iota.py",
            "iota_export.json"} <= {p.name for p in out.iterdir()}
    cfg, ours = _own_model(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert type(hf).__name__ == "IotaForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == ours.param_count()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = ours(tokens)                                  # the tail without targets: logits [B, T, V]
        b = hf(input_ids=tokens).logits
    assert a.shape == b.shape == (2, cfg.data.seq_len, cfg.model.vocab_size)
    assert (a - b).abs().max().item() < 1e-5
    # the exported bottlenecks really act: dropping them changes the logits
    with torch.no_grad():
        for bn in hf.model.bottlenecks.values():
            bn.decoder.proj.weight.zero_()
        c = hf(input_ids=tokens).logits
    assert (a - c).abs().max().item() > 1e-3
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "The tower is 324 metres tall."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_eval_matches_the_runs_own_evaluation_on_the_same_rows(bottleneck_run, wikitext_path, cache_dir):
    run, out, summary, info = bottleneck_run
    got = evaluate_file(out, str(wikitext_path), cache_dir=cache_dir)
    assert got["rows"] == info["eval_rows"] == 3 * 4
    assert abs(got["loss"] - summary["val_loss"]) < 1e-3, (got["loss"], summary["val_loss"])
    # and the project's evaluation recomputed here on the same weights and rows
    cfg, ours = _own_model(run)
    _, ds = build_dataset(cfg.data, str(wikitext_path), cache_dir)
    assert abs(evaluate(ours, ds, cfg, torch.device("cpu")) - got["loss"]) < 1e-3
    assert got["perplexity"] == pytest.approx(torch.tensor(got["loss"]).exp().item(), rel=1e-6)


def test_generate_samples_text_and_the_cli_prints_it(bottleneck_run, capsys):
    _, out, _, _ = bottleneck_run
    a = generate_text(out, "The history of", max_new_tokens=12, seed=1)
    b = generate_text(out, "The history of", max_new_tokens=12, seed=1)
    assert a == b and a.startswith("The history of") and len(a) > len("The history of")
    assert cli_main(["generate", "--model", str(out), "--prompt", "In 1990 ,", "--max-new-tokens", "8",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("In 1990 ,")


def test_eval_cli_prints_loss_and_perplexity(bottleneck_run, wikitext_path, cache_dir, capsys):
    _, out, summary, _ = bottleneck_run
    assert cli_main(["eval", "--model", str(out), "--data", str(wikitext_path), "--cache-dir", str(cache_dir),
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert abs(r["loss"] - summary["val_loss"]) < 1e-3 and r["perplexity"] > 1


def test_no_bottleneck_exports_a_plain_llama(tmp_path, wikitext_path, cache_dir):
    cfg = {**SMALL, "pipeline": {"stages": 2, "compression_ratio": 1}}
    run, _ = _run(tmp_path, wikitext_path, cache_dir, "plain", cfg, steps=3)
    out = tmp_path / "hf-plain"
    info = export_run(run, out, cache_dir=cache_dir)
    assert not info["trust_remote_code"] and not (out / "modeling_iota.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()       # no remote code
    assert type(hf).__name__ == "LlamaForCausalLM"
    c, ours = _own_model(run)
    tokens = torch.randint(0, c.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item() < 1e-4


def test_bad_inputs_fail_with_the_fix(tmp_path, bottleneck_run, capsys):
    run, out, _, _ = bottleneck_run
    with pytest.raises(ExportError, match="--force"):
        export_run(run, out)                                          # would overwrite
    with pytest.raises(ExportError, match="neither a co-located run"):
        export_run(tmp_path, tmp_path / "x")
    with pytest.raises(ExportError, match="drop --lane"):
        export_run(run, tmp_path / "y", lane=1)
    # the CLI turns them into one line and exit code 2
    assert cli_main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "z")]) == 2
    assert cli_main(["eval", "--model", str(tmp_path), "--data", "x.txt"]) == 2
    # a run folder without its tokenizer and without --data
    (tmp_path / "copy").mkdir()
    for f in ("config.json", "checkpoint.safetensors"):
        (tmp_path / "copy" / f).write_bytes((run / f).read_bytes())
    with pytest.raises(ExportError, match="--data"):
        export_run(tmp_path / "copy", tmp_path / "w", cache_dir=tmp_path / "empty-cache")
    assert not list(tmp_path.glob(".w.export-*"))                     # nothing half-written left behind
