"""``iota-subnet export`` of a run whose model is a ``transformers`` family (``model: {hf: ...}``).

The stages' state dicts (read as for any run, :func:`iota_subnet.hf.export.read_run`) are loaded into
:class:`~iota_subnet.model.hf_pipeline.HFPipelineStage` modules and assembled into the family's
``*ForCausalLM`` state dict (:func:`~iota_subnet.model.hf_family.assemble_state_dict`). The folder is:

* a run that started from a checkpoint folder (``init: pretrained``, no ``model.config`` overrides):
  that folder's layout (:func:`~iota_subnet.model.hf_folder.export_stages`: the same ``config.json``,
  tensor names, shapes, dtypes and files);
* otherwise ``save_pretrained`` of the family's ``AutoModelForCausalLM`` built from the run's
  ``transformers`` config, holding the trained weights (float32).

Either way the tokenizer folder's files (``data.tokenizer``) are copied in and ``iota_export.json``
records where it came from and ``auto_tokenizer_matches``: whether ``AutoTokenizer`` on the folder
tokenizes as the run did (:func:`auto_tokenizer_matches`; false, with a warning, where the family's
tokenizer class rebuilds its own text pipeline, e.g. ``qwen2`` over a GPT-2-style BPE:
:mod:`iota_subnet.sdk.corpus`). ``iota-subnet eval`` and ``generate`` read ``tokenizer.json`` as saved either way. Loads with ``AutoModelForCausalLM.from_pretrained(out)``, no remote code.
The folder is written next to ``out`` and renamed into place at the end.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.model.hf_family import StageWeightsError, assemble_state_dict
from iota_subnet.model.hf_pipeline import HFPipelineStage
from iota_subnet.utils.atomic import atomic_folder


def family_stages(cfg: RunConfig, stages: list[dict[str, torch.Tensor]]) -> list[HFPipelineStage]:
    """The run's stage modules holding the given per-stage state dicts (stage-local names). Raises
    :class:`StageWeightsError` when a state dict does not fit its stage."""
    out = []
    for s, sd in enumerate(stages):
        m = HFPipelineStage(cfg.model, cfg.pipeline, s, init=False)
        try:
            m.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise StageWeightsError(f"stage {s}'s checkpoint does not fit the run's model ({e}); export from an "
                                    "untouched run folder") from None
        out.append(m)
    return out


#: Text whose ids tell text pipelines apart: digits (grouped by GPT-2's pre-tokenizer, one by one by
#: Qwen2's), contractions, punctuation runs, newlines, a decomposed accent (changed by NFC).
PROBE_TEXT = ("In 1987 the 12,345 visitors didn't come; they'd gone -- 'twas \"odd\"!!\n\n  Cafe\u0301 "
              "costs $3.50\tor 2x more... Zürich's ÉCOLE 2024-12-05\r\nend")


def auto_tokenizer_matches(folder: Path):
    """Whether ``AutoTokenizer.from_pretrained(folder)`` tokenizes as the folder's ``tokenizer.json`` does
    (the run's tokenizer): the same normalizer and pre-tokenizer and the same ids of :data:`PROBE_TEXT`.
    None when the folder has no ``tokenizer.json`` or AutoTokenizer cannot load it."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    f = folder / "tokenizer.json"
    if not f.exists():
        return None
    try:
        auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - reported as unknown, the export itself is fine
        logger.warning(f"AutoTokenizer cannot load {folder} ({e.__class__.__name__}: {e})")
        return None
    run, mine = Tokenizer.from_file(str(f)), getattr(auto, "backend_tokenizer", None)
    if mine is None:
        return False

    def state(x):
        return None if x is None else json.loads(x.__getstate__())
    return (state(mine.normalizer) == state(run.normalizer) and state(mine.pre_tokenizer) == state(run.pre_tokenizer)
            and auto(PROBE_TEXT, add_special_tokens=False)["input_ids"] == run.encode(PROBE_TEXT, add_special_tokens=False).ids)


def export_family_run(cfg: RunConfig, stages: list[dict[str, torch.Tensor]], prov: dict, run: Path, out: Path) -> dict:
    """Write the ``transformers`` folder ``out`` (see the module docstring); returns ``iota_export.json``'s
    content. Raises :class:`StageWeightsError` / ``CheckpointFolderError`` naming the fix."""
    from transformers import AutoModelForCausalLM
    mods = family_stages(cfg, stages)
    m = cfg.model
    out.parent.mkdir(parents=True, exist_ok=True)
    if m.init == "pretrained" and not m.hf_config:
        from iota_subnet.model.hf_folder import export_stages
        export_stages(mods, m.hf, out, force=True)
        cls = json.loads((out / "config.json").read_text()).get("architectures", ["?"])[0]
        params = sum(t.numel() for t in assemble_state_dict(mods).values())
    else:
        with atomic_folder(out, "export-") as tmp:
            model = AutoModelForCausalLM.from_config(m.transformers_config())
            state = assemble_state_dict(mods)
            model.load_state_dict(state, strict=not mods[0].tied)
            model.save_pretrained(str(tmp))
            cls, params = type(model).__name__, sum(t.numel() for t in state.values())
    tok = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if tok is not None and tok.is_dir():
        for f in tok.iterdir():
            if f.is_file() and not (out / f.name).exists():
                shutil.copyfile(f, out / f.name)
    same = auto_tokenizer_matches(out)
    if same is False:
        logger.warning(f"AutoTokenizer.from_pretrained({str(out)!r}) builds another text pipeline than the run's "
                       "tokenizer.json (the family's tokenizer class rebuilds the normalizer and pre-tokenizer): "
                       "it tokenizes text differently from the run. Load the run's tokenizer with "
                       f"PreTrainedTokenizerFast(tokenizer_file={str(out / 'tokenizer.json')!r}), or train the "
                       "tokenizer with the family's pipeline (iota_subnet.sdk.corpus.write_tokenizer_folder)")
    info = {"format": 1, "exported_at": time.time(), "source": str(run.resolve()), **prov, "model_class": cls,
            "auto_tokenizer_matches": same, "trust_remote_code": False, "seq_len": cfg.data.seq_len, "val_fraction": cfg.data.val_fraction,
            "eval_rows": cfg.train.eval_batches * cfg.train.micro_batch, "data_max_tokens": cfg.data.max_tokens,
            "run_config": cfg.to_dict(), "params": params}
    (out / "iota_export.json").write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    logger.info(f"exported {run} ({prov['kind']}, {params:,} parameters, {cls}) -> {out}")
    return info
