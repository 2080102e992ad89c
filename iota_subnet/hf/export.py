"""``iota-subnet export``: a trained run's stages as one Hugging Face model folder.

Sources (``--run DIR``):

* a co-located run (``train-colocated --out DIR``): ``DIR/config.json`` and
  ``DIR/checkpoint.safetensors`` (every stage, tensor names ``model/stages.{s}.<name>``);
* a local network (``localnet --out DIR``): ``DIR/config.yaml`` and each miner's stage checkpoint
  ``DIR/miners/<name>/stage{s}.safetensors``; ``lane`` picks replica ``lane`` of every stage
  (replicas of a stage ordered by folder name), ``merged=True`` takes each stage's merged weights
  (the DiLoCo anchor of the replica with the newest merge, ``stage{s}.merge.safetensors``) instead.

The folder holds ``config.json``, ``model.safetensors`` (float32), ``generation_config.json``, the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) and
``iota_export.json`` (where it came from, the data settings that ``iota-subnet eval`` needs).
Without a bottleneck (``compression_ratio`` 1, or one stage) it is a plain ``LlamaForCausalLM``;
with one it is ``IotaForCausalLM`` whose code (``modeling_iota.py``, ``configuration_iota.py``)
is copied in, loaded with ``trust_remote_code=True``.

The folder is written next to ``out`` and renamed into place at the end (a killed export leaves
no half folder behind; leftovers ``.<name>.export-*`` are swept at the next export).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger
from safetensors.torch import save_file

from iota_subnet.config import RunConfig, config_from_dict, load_config
from iota_subnet.model import bottleneck_dims, split_layers
from iota_subnet.train.checkpoint import config_fingerprint, read_checkpoint
from iota_subnet.errors import UserError
from iota_subnet.utils.atomic import atomic_folder

REMOTE = Path(__file__).resolve().parent / "remote"
EXPORT_FORMAT = 1


class ExportError(UserError, RuntimeError):
    """The run cannot be exported as asked; the message says what to do."""


# ---------------------------------------------------------------------------------- reading runs
def _stage_names(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def read_colocated(run: Path) -> tuple[RunConfig, list[dict[str, torch.Tensor]], dict]:
    """(config, per-stage state dicts, provenance) of a co-located run folder."""
    cfg = config_from_dict(json.loads((run / "config.json").read_text()))
    tensors, meta = read_checkpoint(run / "checkpoint.safetensors")
    fp = config_fingerprint(cfg.model, cfg.pipeline)
    if meta.get("config_fingerprint") not in (None, fp):
        raise ExportError(f"{run / 'checkpoint.safetensors'} does not match {run / 'config.json'} "
                          "(config fingerprints differ); export from an untouched run folder")
    stages = [_stage_names(f"model/stages.{s}.", tensors) for s in range(cfg.pipeline.stages)]
    if not all(stages):
        raise ExportError(f"{run / 'checkpoint.safetensors'} lacks the weights of some stages")
    return cfg, stages, {"kind": "colocated", "step": int(meta["step"]), "tokenizer": meta.get("tokenizer")}


def _replicas(run: Path, stage: int, suffix: str) -> list[Path]:
    return sorted(p for p in (run / "miners").glob(f"*/stage{stage}{suffix}") if p.is_file())


def read_localnet(run: Path, lane: int = 0, merged: bool = False) -> tuple[RunConfig, list[dict], dict]:
    """(config, per-stage state dicts, provenance) of a local network's folder: replica ``lane`` of
    every stage, or each stage's merged weights."""
    cfg = load_config(run / "config.yaml")
    stages, steps, picked = [], [], []
    for s in range(cfg.pipeline.stages):
        reps = _replicas(run, s, ".safetensors")
        if not reps:
            raise ExportError(f"no checkpoint of stage {s} under {run / 'miners'} (stage{s}.safetensors); "
                              "miners write one every --checkpoint-every inner steps and when they stop")
        if merged:
            sd, step = _merged_stage(run, cfg, s)
            stages.append(sd)
            steps.append(step)
            picked.append(f"stage{s}: merged anchor")
            continue
        if not 0 <= lane < len(reps):
            raise ExportError(f"--lane {lane}: stage {s} has {len(reps)} replica checkpoint(s) "
                              f"({', '.join(p.parent.name for p in reps)}); use --lane 0..{len(reps) - 1}")
        tensors, meta = read_checkpoint(reps[lane])
        expect = config_fingerprint(cfg.model, cfg.pipeline, s)
        if meta.get("config_fingerprint") not in (None, expect):
            raise ExportError(f"{reps[lane]} was written for another config or stage than {run / 'config.yaml'} "
                              f"says (stage {s}); export from an untouched run folder")
        stages.append(_stage_names("model/", tensors))
        steps.append(int(meta["step"]))
        picked.append(str(reps[lane].relative_to(run)))
    if max(steps) - min(steps) > 1:
        logger.warning(f"the stages of lane {lane} are at different inner steps {steps}: the exported model mixes "
                       "them (export after the run finished for a consistent model)")
    return cfg, stages, {"kind": "localnet", "lane": None if merged else lane, "merged": merged,
                         "stage_steps": steps, "checkpoints": picked}


def _merged_stage(run: Path, cfg: RunConfig, s: int) -> tuple[dict[str, torch.Tensor], int]:
    from iota_subnet.merge import ModuleParams
    from iota_subnet.model import make_stage
    best = None
    for p in _replicas(run, s, ".merge.safetensors"):
        tensors, meta = _read_merge_state(p)
        if best is None or meta["merged_epoch"] > best[1]["merged_epoch"]:
            best = (tensors, meta)
    if best is None or best[1]["merged_epoch"] < 0:
        raise ExportError(f"stage {s} has no merged weights under {run / 'miners'} (stage{s}.merge.safetensors); "
                          "the run did not merge replicas: export one lane with --lane instead")
    module = make_stage(cfg.model, cfg.pipeline, s, init=False)
    ModuleParams(module).write(best[0]["anchor"])
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, int(best[1].get("step", 0))


def _read_merge_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise ExportError(f"{path} is unreadable ({e}); export one lane with --lane instead") from None
    if "anchor" not in tensors or "merged_epoch" not in meta:
        raise ExportError(f"{path} is not a merge state file")
    return tensors, meta


def read_run(run: str | Path, lane: int = 0, merged: bool = False) -> tuple[RunConfig, list[dict], dict]:
    run = Path(run)
    if (run / "checkpoint.safetensors").exists() and (run / "config.json").exists():
        if merged or lane:
            raise ExportError(f"{run} is a co-located run (one set of weights): drop --lane / --merged")
        return read_colocated(run)
    if (run / "config.yaml").exists() and (run / "miners").is_dir():
        return read_localnet(run, lane, merged)
    raise ExportError(f"{run} is neither a co-located run (config.json + checkpoint.safetensors) nor a local "
                      "network (config.yaml + miners/); pass the --out folder of train-colocated or localnet")


# ---------------------------------------------------------------------------------- mapping
def hf_state_dict(cfg: RunConfig, stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stage state dicts (global layer names) -> Hugging Face names (see ``modeling_iota.py``)."""
    out: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(stages):
        for name, t in sd.items():
            t = t.detach().to(torch.float32).contiguous()
            if name.startswith("bottleneck_out."):
                out[f"model.bottlenecks.{s}.encoder.{name[len('bottleneck_out.'):]}"] = t
            elif name.startswith("bottleneck_in."):
                out[f"model.bottlenecks.{s - 1}.decoder.{name[len('bottleneck_in.'):]}"] = t
            elif name.startswith(("embed_tokens.", "layers.", "norm.")):
                out[f"model.{name}"] = t
            elif name.startswith("lm_head."):
                out[name] = t
            else:
                raise ExportError(f"stage {s} holds an unexpected tensor {name!r}; this export does not know it")
    return out


def uses_bottleneck(cfg: RunConfig) -> bool:
    return cfg.pipeline.stages > 1 and int(cfg.pipeline.compression_ratio) > 1


def hf_config(cfg: RunConfig, eos_id: int, tied: bool) -> dict:
    m, p = cfg.model, cfg.pipeline
    common = {"vocab_size": m.vocab_size, "hidden_size": m.dim, "intermediate_size": m.ffn_dim,
              "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
              "num_key_value_heads": m.n_kv_heads, "max_position_embeddings": m.max_seq_len,
              "rms_norm_eps": m.norm_eps, "tie_word_embeddings": tied, "eos_token_id": eos_id,
              "pad_token_id": eos_id, "bos_token_id": None, "torch_dtype": "float32", "use_cache": False}
    if not uses_bottleneck(cfg):
        rope = {"rope_type": "llama3", **m.rope_scaling} if m.rope_scaling else None
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common, "rope_theta": m.rope_theta,
                "rope_scaling": rope, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                "head_dim": m.head_dim}
    b, r = bottleneck_dims(m, p)
    return {"model_type": "iota_resbm", "architectures": ["IotaForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_iota.IotaConfig",
                         "AutoModelForCausalLM": "modeling_iota.IotaForCausalLM"},
            **common, "iota_rope_theta": m.rope_theta, "iota_rope_scaling": m.rope_scaling,
            "layer_split": [len(rg) for rg in split_layers(m.n_layers, p.stages, p.layer_split)],
            "compression_ratio": int(p.compression_ratio), "bottleneck_width": b, "identity_rank": r}


# ---------------------------------------------------------------------------------- tokenizer
def find_tokenizer(run: Path, cfg: RunConfig, *, tokenizer: Optional[str], data: Optional[str],
                   expect_fingerprint: Optional[str], cache_dir: Optional[Path] = None):
    """The run's tokenizer (:class:`~iota_subnet.data.TextTokenizer`): ``tokenizer`` (a
    tokenizer.json), else ``run/tokenizer.json``, else the one ``data`` builds (from the cache),
    else the cached tokenizer whose fingerprint the checkpoint names. Raises ExportError."""
    from tokenizers import Tokenizer

    from iota_subnet.data import TextTokenizer, default_cache_dir, iter_documents, load_tokenizer, source_key
    cands: list[tuple[str, Any]] = []
    if tokenizer:
        cands.append((tokenizer, lambda: TextTokenizer(Tokenizer.from_file(tokenizer), Path(tokenizer).stem)))
    if (run / "tokenizer.json").exists():
        f = run / "tokenizer.json"
        cands.append((str(f), lambda: TextTokenizer(Tokenizer.from_file(str(f)), "run")))
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if data:
        cands.append((f"--data {data}", lambda: load_tokenizer(cfg.data.tokenizer, lambda: iter_documents(data),
                                                               cfg.data.vocab_size, cache / "tokenizers",
                                                               source_key(data))))
    for what, make in cands:
        tok = make()
        if expect_fingerprint and tok.fingerprint != expect_fingerprint:
            raise ExportError(f"the tokenizer from {what} (fingerprint {tok.fingerprint}) is not the one the run "
                              f"trained with ({expect_fingerprint}); pass the run's --data or --tokenizer")
        return tok, what
    if expect_fingerprint:
        for f in sorted((cache / "tokenizers").glob("*.json")):
            try:
                tok = TextTokenizer(Tokenizer.from_file(str(f)), f.stem)
            except Exception:  # noqa: BLE001 - not a tokenizer file
                continue
            if tok.fingerprint == expect_fingerprint:
                return tok, str(f)
    raise ExportError(f"cannot find the tokenizer of {run}: pass --data (the run's text source) or --tokenizer "
                      "FILE (a tokenizer.json)")


def _tokenizer_files(tok, max_len: int) -> dict[str, str]:
    eos = tok.tokenizer.id_to_token(tok.eos_id)
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                             "pad_token": eos, "model_max_length": max_len,
                                             "clean_up_tokenization_spaces": False}, indent=2),
        "special_tokens_map.json": json.dumps({"eos_token": eos, "pad_token": eos}, indent=2),
    }


# ---------------------------------------------------------------------------------- export
def _sweep(out: Path) -> None:
    for p in out.parent.glob(f".{out.name}.export-*"):
        shutil.rmtree(p, ignore_errors=True)


def export_run(run: str | Path, out: str | Path, *, lane: int = 0, merged: bool = False,
               tokenizer: Optional[str] = None, data: Optional[str] = None, cache_dir: Optional[Path] = None,
               force: bool = False) -> dict:
    """Export ``run`` to the Hugging Face folder ``out``; returns ``iota_export.json``'s content.
    Raises ExportError (and CheckpointError / ConfigError / DataError) with the fix."""
    run, out = Path(run), Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty; pass --force to replace it or choose another --out")
    cfg, stages, prov = read_run(run, lane, merged)
    if getattr(cfg.model, "hf", None) is not None:        # a transformers family: its own class and folder
        from iota_subnet.hf.export_family import export_family_run
        _sweep(out)
        return export_family_run(cfg, stages, prov, run, out)
    tok, tok_from = find_tokenizer(run, cfg, tokenizer=tokenizer, data=data, expect_fingerprint=prov.get("tokenizer"),
                                   cache_dir=cache_dir)
    tensors = hf_state_dict(cfg, stages)
    tied = "lm_head.weight" not in tensors
    if tied and not cfg.model.tie_embeddings:
        raise ExportError("the checkpoint has no LM head (lm_head.weight); it is not a complete model")
    conf = hf_config(cfg, tok.eos_id, tied)
    info = {"format": EXPORT_FORMAT, "exported_at": time.time(), "source": str(run.resolve()), **prov,
            "tokenizer_fingerprint": tok.fingerprint, "tokenizer_from": tok_from, "model_class": conf["architectures"][0],
            "trust_remote_code": uses_bottleneck(cfg), "seq_len": cfg.data.seq_len,
            "val_fraction": cfg.data.val_fraction, "eval_rows": cfg.train.eval_batches * cfg.train.micro_batch,
            "data_max_tokens": cfg.data.max_tokens, "run_config": cfg.to_dict(),
            "params": sum(t.numel() for t in tensors.values())}
    _sweep(out)
    with atomic_folder(out, "export-") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        files = {"config.json": json.dumps(conf, indent=2),
                 "generation_config.json": json.dumps({"eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id,
                                                       "use_cache": False, "do_sample": True, "temperature": 0.8,
                                                       "top_k": 50, "max_new_tokens": 64}, indent=2),
                 "iota_export.json": json.dumps(info, indent=2, default=str),
                 **_tokenizer_files(tok, cfg.model.max_seq_len)}
        for name, text in files.items():
            (tmp / name).write_text(text + "\n", encoding="utf-8")
        if uses_bottleneck(cfg):
            for f in ("configuration_iota.py", "modeling_iota.py"):
                shutil.copyfile(REMOTE / f, tmp / f)
    logger.info(f"exported {run} ({prov['kind']}, {info['params']:,} parameters, {conf['architectures'][0]}) "
                f"-> {out}")
    return info
