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
records where it came from. Loads with ``AutoModelForCausalLM.from_pretrained(out)``, no remote code.
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
    info = {"format": 1, "exported_at": time.time(), "source": str(run.resolve()), **prov, "model_class": cls,
            "trust_remote_code": False, "seq_len": cfg.data.seq_len, "val_fraction": cfg.data.val_fraction,
            "eval_rows": cfg.train.eval_batches * cfg.train.micro_batch, "data_max_tokens": cfg.data.max_tokens,
            "run_config": cfg.to_dict(), "params": params}
    (out / "iota_export.json").write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    logger.info(f"exported {run} ({prov['kind']}, {params:,} parameters, {cls}) -> {out}")
    return info
