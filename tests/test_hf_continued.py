"""Continued pretraining of a transformers checkpoint folder as in-process pipeline stages
(iota_subnet.model.hf_folder + iota_subnet.train.hf_trainer), on a tiny Qwen2 (hidden 64, 4 layers,
vocab 320, q/k/v biases), tied and untied, random weights written with save_pretrained.

* step-0 loss through 3 stages (fp32 wire, fp32 compute, eager attention) equals the transformers
  model's own ``loss`` (``labels = input_ids``, shifted inside the model) within 1e-4;
* wire bounds (measured on these models: bf16 ~5e-4 nats, int8 ~1e-4..6e-4 nats of a ~6.5 nats loss,
  two boundaries): the loss through a bf16 wire is within 2e-3 nats of the fp32 wire, through an int8
  wire (per-token absmax scales) within 3e-3 nats;
* a few AdamW steps lower the loss; the exported folder has the input's config.json (except
  transformers_version), the same tensor names / shapes / dtypes, tied stays tied, and loads with
  AutoModelForCausalLM.from_pretrained (no trust_remote_code) giving the trained stages' logits within
  1e-5 relative;
* each stage reads only its own tensors; sharded and bf16 checkpoints round-trip; bad folders raise
  typed errors naming the fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel,
                          PreTrainedTokenizerFast)

from iota_subnet.data import train_bpe
from iota_subnet.data.hf_datasets import build_hf_dataset

from iota_subnet.model.hf_family import StageWeightsError, UnsupportedFamilyError, build_hf_stage
from iota_subnet.model.hf_folder import (
    CheckpointFolderError,
    export_stages,
    load_stages_from_folder,
    read_layout,
    read_stage_tensors,
)
from iota_subnet.train.hf_trainer import HFPipelineTrainer, HFTrainOptions, continue_pretraining, dataset_batches
from iota_subnet.train.wire_boundary import through_wire, wire_round_trip

WIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
VOCAB, SEQ, STAGES = 320, 32, 3
BF16_WIRE_BOUND, INT8_WIRE_BOUND = 2e-3, 3e-3


def _save_model(folder, tied: bool, dtype=torch.float32, num_hidden_layers: int = 4, **save_kw):
    """A tiny Qwen2 with O(1) logits (weights N(0, 0.15), norms and biases randomised) saved to ``folder``."""
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.15)
    model.to(dtype).save_pretrained(folder, **save_kw)
    return model


def _rows(seed: int = 1, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _tensor_specs(folder) -> dict[str, tuple]:
    layout = read_layout(folder)
    return {k: (layout.shapes[k], layout.dtypes[k]) for k in layout.weight_map}


def _config_json(folder) -> dict:
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("transformers_version", None)
    return raw


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_continue_pretraining_round_trip(tmp_path, tied):
    src, out = tmp_path / "in", tmp_path / "out"
    model = _save_model(src, tied)
    (src / "tokenizer.json").write_text("{}")                   # stands for the tokenizer files
    assert ("lm_head.weight" in _tensor_specs(src)) is not tied
    rows = _rows()
    with torch.no_grad():
        ref = model(input_ids=rows, labels=rows).loss.item()
    stages = load_stages_from_folder(src, STAGES, attn_implementation="eager")
    trainer = HFPipelineTrainer(stages, HFTrainOptions(lr=3e-3, wire_dtype="int8"))
    assert trainer.loss(rows, wire_dtype="fp32") == pytest.approx(ref, abs=1e-4)
    assert abs(trainer.loss(rows, wire_dtype="bf16") - ref) < BF16_WIRE_BOUND
    assert abs(trainer.loss(rows, wire_dtype="int8") - ref) < INT8_WIRE_BOUND
    mask = torch.ones_like(rows, dtype=torch.bool)
    losses = trainer.train(((rows, mask) for _ in range(5)), 5)
    assert abs(losses[0] - ref) < INT8_WIRE_BOUND              # step 0 trains on the loaded weights
    assert losses[-1] < losses[0] - 1.0, losses
    if tied:                                                   # the two copies got the same updates
        assert torch.equal(stages[0].embed_tokens.weight, stages[-1].lm_head.weight)

    export_stages(stages, src, out)
    assert _config_json(out) == _config_json(src)
    assert _tensor_specs(out) == _tensor_specs(src)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert not list(tmp_path.glob(".out.export-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    head, emb = loaded.lm_head.weight, loaded.model.embed_tokens.weight
    assert (head is emb or head.data_ptr() == emb.data_ptr()) is tied
    ids = rows[:, :-1]
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    want = trainer.logits(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert not torch.allclose(got, model(input_ids=ids).logits.detach())    # the trained weights were saved


def test_stage_reads_only_its_tensors(tmp_path):
    _save_model(tmp_path, tied=True)
    layout = read_layout(tmp_path)
    stage = build_hf_stage(AutoConfig.from_pretrained(tmp_path), 1, STAGES, init_seed=None)
    names = set(read_stage_tensors(stage, layout))
    assert names == {stage.hf_name(k) for k in stage.state_dict()}
    assert all(n.startswith("model.layers.") for n in names)
    last = build_hf_stage(AutoConfig.from_pretrained(tmp_path), STAGES - 1, STAGES, init_seed=None)
    assert "model.embed_tokens.weight" in read_stage_tensors(last, layout)   # the tied head's source


def test_sharded_bf16_checkpoint_keeps_layout_and_dtypes(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    _save_model(src, tied=False, dtype=torch.bfloat16, max_shard_size="100KB")
    layout = read_layout(src)
    assert layout.sharded and len(layout.files) > 1
    stages = load_stages_from_folder(src, 2)
    assert all(p.dtype == torch.float32 for s in stages for p in s.parameters())
    HFPipelineTrainer(stages, HFTrainOptions(lr=1e-3, wire_dtype="bf16")).train_step(_rows(batch=2))
    export_stages(stages, src, out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(layout.files)
    assert _tensor_specs(out) == _tensor_specs(src)
    assert all(dt == torch.bfloat16 for _, dt in _tensor_specs(out).values())
    for file in layout.files:
        with safe_open(str(out / file), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in layout.weight_map.items() if v == file}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded.model.layers[3].mlp.down_proj.weight.float(),
                       stages[1].layers[-1].mlp.down_proj.weight.detach().to(torch.bfloat16).float())
    with pytest.raises(CheckpointFolderError, match="force=True"):
        export_stages(stages, src, out)
    export_stages(stages, src, out, force=True)
    assert not list(tmp_path.glob(".out.*"))
    other = tmp_path / "other"
    _save_model(other, tied=False, num_hidden_layers=5)
    with pytest.raises(StageWeightsError, match="folder they came from"):
        export_stages(stages, other, tmp_path / "bad")            # other has a layer the stages lack
    with pytest.raises(StageWeightsError, match="folder they came from"):
        export_stages(load_stages_from_folder(other, 2), src, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))


def test_bad_folders_raise_typed_errors(tmp_path):
    no_weights = tmp_path / "cfg-only"
    _save_model(no_weights, tied=True)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointFolderError, match="save_pretrained"):
        load_stages_from_folder(no_weights, 2)
    with pytest.raises(CheckpointFolderError, match="config.json"):
        read_layout(tmp_path)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(gpt2)
    with pytest.raises(UnsupportedFamilyError, match="supported: llama, mistral, qwen2, qwen3"):
        load_stages_from_folder(gpt2, 2)


@pytest.mark.parametrize("wire", ["bf16", "int8", "fp8"])
def test_wire_rounds_hidden_and_gradient(wire):
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(2, 5, 16)
    y = through_wire(x, wire)
    (y * g).sum().backward()
    assert torch.equal(y.detach(), wire_round_trip(x.detach(), wire))
    assert torch.equal(x.grad, wire_round_trip(g, wire))
    assert not torch.equal(x.grad, g)
    assert through_wire(x, "fp32") is x


def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    _save_model(tmp_path, tied=True)
    rows = _rows(batch=2)
    fp32 = HFPipelineTrainer(load_stages_from_folder(tmp_path, 2), HFTrainOptions(lr=1e-3))
    bf16 = HFPipelineTrainer(load_stages_from_folder(tmp_path, 2), HFTrainOptions(lr=1e-3, precision="bf16"))
    assert bf16.train_step(rows) == pytest.approx(fp32.train_step(rows), abs=5e-2)
    assert all(p.dtype == torch.float32 for s in bf16.stages for p in s.parameters())


def test_continue_pretraining_on_a_dataset(tmp_path):
    """From a checkpoint folder holding its tokenizer and a jsonl file to a trained folder, as the docs show."""
    if not WIKI.exists():
        pytest.skip(f"{WIKI} not present")
    with open(WIKI, encoding="utf-8") as f:
        docs = [ln.strip() for ln, _ in zip(f, range(300)) if ln.strip()]
    src, out = tmp_path / "in", tmp_path / "out"
    _save_model(src, tied=True)
    PreTrainedTokenizerFast(tokenizer_object=train_bpe(docs, VOCAB - 8), eos_token="<|endoftext|>").save_pretrained(src)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    _, ds = build_hf_dataset({"path": str(data)}, src, AutoConfig.from_pretrained(src), SEQ)
    losses = continue_pretraining(src, out, dataset_batches(ds, 4), 8, 2, HFTrainOptions(lr=3e-3, wire_dtype="bf16"))
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert AutoTokenizer.from_pretrained(out)("a b").input_ids == AutoTokenizer.from_pretrained(src)("a b").input_ids
    AutoModelForCausalLM.from_pretrained(out)
