"""The Python SDK's spec (``iota_subnet.sdk``): a RunSpec built from a ``transformers`` config object
writes the YAML the CLI's loader reads, resolving as a hand-written config of the same run; save / load
keeps its hash and any changed field changes it; refused specs raise before any neuron starts."""
from __future__ import annotations

import json

import pytest
import yaml
from transformers import GPT2Config, Qwen2Config

from iota_subnet.config import ConfigError, load_config
from iota_subnet.data.sources import DataError
from iota_subnet.model.hf_family import StageSplitError, UnsupportedFamilyError
from iota_subnet.network.localnet import LocalNet
from iota_subnet.sdk import DataSpec, LocalRun, RunSpec, config_hash, launch_local
from iota_subnet.sdk.spec import canonical_yaml
from support.hf_run import WIKI, qwen2_config, write_jsonl, write_run, write_tokenizer

pytestmark = pytest.mark.skipif(not WIKI.exists(), reason=f"{WIKI} not present")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdk")
    corpus = write_jsonl(d, max_docs=100)
    tok, n = write_tokenizer(d, 1024)
    return d, corpus, tok, n


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))


def _spec(files, **over) -> RunSpec:
    _, corpus, tok, n = files
    fields = {k: v for k, v in qwen2_config(n, layers=6).items() if k != "model_type"}
    kw = dict(model=Qwen2Config(**fields), data=DataSpec(corpus, tokenizer=tok), stages=3, seq_len=32,
              batch_size=8, micro_batch_size=4, lr=3e-3, warmup_steps=2, eval_batches=2, steps=20, merge_every=5)
    return RunSpec(**{**kw, **over})


def test_spec_from_a_config_object_resolves_as_a_hand_written_config(files, tmp_path):
    d, corpus, tok, n = files
    spec = _spec(files)
    path = spec.save(tmp_path / "run.yaml")
    written = yaml.safe_load(path.read_text())
    assert written["model"]["hf"] == str(tmp_path / "run-model")                 # save_pretrained's folder
    assert json.loads((tmp_path / "run-model" / "config.json").read_text())["model_type"] == "qwen2"
    cfg = load_config(path)                                                       # the CLI's loader accepts it
    # the same run written by hand (support/hf_run.py: a config folder, the same data and knobs)
    (tmp_path / "hand").mkdir()
    hand = load_config(write_run(tmp_path / "hand", stages=3, seq_len=32, vocab_size=1024, layers=6,
                                 data_over={"path": str(corpus)}, extra={"merge": {"every_steps": 5},
                                                                         "train": {"total_steps": 20}}))
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta",
              "norm_eps", "tie_embeddings", "init", "name"):
        assert getattr(cfg.model, k) == getattr(hand.model, k), k
    assert cfg.model.transformers_config().to_dict() | {"_name_or_path": ""} == \
        hand.model.transformers_config().to_dict() | {"_name_or_path": ""}
    assert cfg.pipeline == hand.pipeline and cfg.pipeline.layer_split is not None
    assert cfg.data.hf == {**hand.data.hf} and cfg.data.tokenizer != hand.data.tokenizer    # hand: its own tokenizer
    assert (cfg.data.seq_len, cfg.train, cfg.merge) == (hand.data.seq_len, hand.train, hand.merge)
    # its hash is the content address: the hand-written run with this spec's tokenizer has the same one
    same = load_config(path, {"data": {"tokenizer": str(tok)}})
    assert spec.spec_hash() == config_hash(cfg) == config_hash(same)
    assert "run-model" not in canonical_yaml(cfg)                    # named by content, not by folder


def test_save_load_round_trip_and_the_hash_follows_every_field(files, tmp_path):
    spec = _spec(files)
    h = spec.spec_hash()
    assert len(h) == 64 and spec.spec_hash() == h
    back = RunSpec.load(spec.save(tmp_path / "a" / "run.yaml"))
    assert isinstance(back.model, str) and back.spec_hash() == h
    assert back.stages == 3 and back.merge_every == 5 and back.data.text_field == "text"
    assert RunSpec.load(back.save(tmp_path / "b" / "other.yaml")).spec_hash() == h      # written elsewhere: same
    changed = [spec.replace(lr=1e-3), spec.replace(stages=2), spec.replace(seq_len=64), spec.replace(merge_every=0),
               spec.replace(model_config={"num_attention_heads": 8}), spec.replace(extra={"train": {"schedule": "wsd"}}),
               spec.replace(precision="bf16")]
    hashes = {c.spec_hash() for c in changed}
    assert h not in hashes and len(hashes) == len(changed)
    # a model_type name with its fields is the same model as the config object
    fields = {k: v for k, v in spec.model.to_dict().items() if k in qwen2_config(files[3])}
    by_name = spec.replace(model="qwen2", model_config={k: v for k, v in fields.items() if k != "model_type"})
    assert by_name.to_config().model.transformers_config().num_hidden_layers == 6


@pytest.mark.parametrize("over, error", [
    ({"model": GPT2Config(n_layer=2, n_embd=64, n_head=2)}, UnsupportedFamilyError),
    ({"stages": 8}, StageSplitError),                                              # 6 layers
    ({"data": "no text field"}, DataError),
    ({"model_config": {"tie_word_embeddings": True}}, ConfigError),
    ({"data": "no tokenizer"}, ConfigError),
])
def test_refused_specs_raise_before_any_process_starts(files, tmp_path, tmp_home, over, error):
    _, corpus, tok, _ = files
    if over.get("data") == "no text field":
        over = {"data": DataSpec(corpus, text_field="body", tokenizer=tok)}
    elif over.get("data") == "no tokenizer":
        over = {"data": DataSpec(corpus)}
    spec = _spec(files, **over)
    with pytest.raises(error) as e:
        spec.to_config()
    assert str(e.value)
    out = tmp_path / "run"
    with pytest.raises(error):
        launch_local(spec, replicas=2, out=out)
    # nothing of a network: no chain, no wallets, no neuron logs or folders
    assert sorted(p.name for p in out.iterdir()) == ["spec-model", "spec.yaml"]
    for name in ("logs", "chain.db", "wallets", "miners", "validators"):
        assert not (out / name).exists(), name


def test_bad_spec_values_are_clear_errors(files, tmp_path):
    with pytest.raises(ConfigError, match="RunSpec.model"):
        _spec(files, model=3).save(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="extra"):
        _spec(files, extra={"train": 3}).to_config()
    with pytest.raises(ConfigError, match="unknown section"):
        _spec(files, extra={"bogus": {"a": 1}}).to_config()
    with pytest.raises(ConfigError, match="steps"):
        launch_local(_spec(files, steps=None, extra={"train": {"schedule": "constant"}}), out=tmp_path / "o")
    with pytest.raises(ConfigError, match="transformers model"):
        RunSpec.load(_write(tmp_path / "tiny.yaml", "model: tiny\n"))


def _write(path, text):
    path.write_text(text)
    return path


def test_progress_of_a_network_not_started_is_empty(files, tmp_path):
    spec = _spec(files)
    path = spec.save(tmp_path / "spec.yaml")
    net = LocalNet(stages=3, replicas=2, validators=1, config=str(path), data=None, steps=20, out=tmp_path / "ln",
                   progress=False)
    p = LocalRun(net, spec, path).progress()
    assert (p.steps_done, p.steps_total, p.loss, p.tokens_per_s, p.miners_live, p.miners_total, p.miners) == \
        (0, 20, None, 0.0, 0, 6, ())
    assert not p.running and p.ended is None
    assert net._progress_line([]) == "loss - tok/s 0 miners 0/6 reroutes 0"
    assert not (tmp_path / "ln").exists()
