"""A ``transformers`` checkpoint folder in and out of pipeline stages (:class:`~.hf_family.HFStage`).

Input: a local folder as ``save_pretrained`` writes it (never the hub): ``config.json`` of a supported
family (:data:`~.hf_family.FAMILIES`) and the weights as ``model.safetensors`` or as shards listed by
``model.safetensors.index.json``. :func:`load_stage_from_folder` builds one stage and reads only the
tensors that stage holds (``safetensors.safe_open`` per file, one ``get_tensor`` per name), so a host
never reads the whole model; a tied model without ``lm_head.weight`` gives the last stage a copy of
``model.embed_tokens.weight``. Stage parameters are float32 (master weights) whatever the file's dtype.

Output: :func:`export_stages` writes the trained stages as a folder that
``AutoModelForCausalLM.from_pretrained(folder)`` loads without ``trust_remote_code``: the input's
``config.json`` (copied byte for byte), the same safetensors files (same names, tensor names, shapes
and dtypes, each tensor cast back to its input dtype; a tied model saves ``lm_head.weight`` only when
the input did), the input's shard index, ``generation_config.json`` and tokenizer files when present. Every tensor of
the input must be one the stages hold (save for :data:`KEPT_SUFFIXES` buffers, copied unchanged).
The folder is written as ``.<name>.export-*`` next to ``out`` and renamed into place at the end.

Errors: :class:`CheckpointFolderError` (no config / no safetensors / a file lacking a listed tensor),
and the :class:`~.hf_family.HFFamilyError` subclasses of building stages (unsupported family, bad
split, misshaped tensors, drifted tied copies).

Sources: ``transformers.modeling_utils.PreTrainedModel.save_pretrained`` (file and index names);
``safetensors`` ``safe_open`` / ``save_file``.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from iota_subnet.model.hf_family import (
    HFFamilyError,
    HFStage,
    StageWeightsError,
    assemble_state_dict,
    build_hf_stage,
    load_hf_config,
    load_stage_state,
    split_hf_layers,
)
from iota_subnet.utils.st_dtypes import ST_DTYPES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Files copied from the input folder into an export when present (tokenizer and generation settings).
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                "chat_template.json")
#: Tensors of a checkpoint that stages do not hold and an export copies unchanged (buffers older
#: ``transformers`` versions saved).
KEPT_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointFolderError(HFFamilyError):
    """A checkpoint folder cannot be read as a ``transformers`` safetensors checkpoint; the message
    names the missing piece and the fix."""


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each tensor of a checkpoint folder lives: ``weight_map`` tensor name -> file name (relative
    to ``folder``), ``dtypes`` / ``shapes`` per tensor name as stored, ``files`` in order, ``sharded``
    when an index file lists them."""
    folder: Path
    weight_map: dict[str, str]
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]
    files: tuple[str, ...]
    sharded: bool


def read_layout(folder: str | Path) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of ``folder`` (reads headers only, no tensor data).
    Raises :class:`CheckpointFolderError` when there is no ``config.json``, no safetensors weights
    (e.g. only ``pytorch_model.bin``), or a file lacks a tensor its index lists."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointFolderError(f"no config.json in {folder}; give a folder written by save_pretrained")
    if (folder / INDEX_FILE).is_file():
        weight_map = dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
        sharded = True
    elif (folder / SINGLE_FILE).is_file():
        weight_map, sharded = {}, False
    else:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        raise CheckpointFolderError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (found: {others or 'no weight files'}); save the model "
            "with model.save_pretrained(folder) (safetensors is the default) or convert its .bin weights to "
            "safetensors first")
    files = sorted(set(weight_map.values())) if sharded else [SINGLE_FILE]
    dtypes, shapes = {}, {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointFolderError(f"{INDEX_FILE} in {folder} lists {name}, which is missing; copy every shard")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtypes[key], shapes[key] = ST_DTYPES[sl.get_dtype()], tuple(sl.get_shape())
                if not sharded:
                    weight_map[key] = name
    missing = sorted(k for k in weight_map if k not in dtypes)
    if missing:
        raise CheckpointFolderError(f"{INDEX_FILE} in {folder} lists tensors no shard holds: {missing[:5]}; "
                                    "the shards are from another save; copy the folder again")
    return CheckpointLayout(folder, weight_map, dtypes, shapes, tuple(files), sharded)


def _stage_sources(stage: HFStage, layout: CheckpointLayout) -> dict[str, str]:
    """Stage-local parameter name -> checkpoint tensor name (the embedding for a tied head the file lacks)."""
    out = {}
    for local in stage.state_dict():
        name = stage.hf_name(local)
        if name not in layout.weight_map and stage.tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name not in layout.weight_map:
            raise StageWeightsError(f"{name!r} (stage {stage.index}) is not in the checkpoint at {layout.folder}; "
                                    "the weights do not belong to this config.json")
        out[local] = name
    return out


def read_stage_tensors(stage: HFStage, layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """The tensors ``stage`` holds, by ``transformers`` name, read from their files (only those names)."""
    wanted = sorted(set(_stage_sources(stage, layout).values()))
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(layout.weight_map[name], []).append(name)
    out = {}
    for file, names in by_file.items():
        with safe_open(str(layout.folder / file), framework="pt", device="cpu") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def load_stage_from_folder(folder: str | Path, index: int, n_stages: int, *, seq_len: int = 2048,
                           layer_ranges: Sequence | None = None, attn_implementation: str | None = None,
                           layout: CheckpointLayout | None = None) -> HFStage:
    """Stage ``index`` of ``n_stages`` of the checkpoint in ``folder`` (split as
    :func:`~.hf_family.split_hf_layers`), float32 parameters on the CPU, holding the file's weights.
    Raises :class:`CheckpointFolderError` and the :class:`~.hf_family.HFFamilyError` subclasses."""
    layout = layout or read_layout(folder)
    stage = build_hf_stage(load_hf_config(Path(folder), attn_implementation), index, n_stages, seq_len=seq_len,
                           layer_ranges=layer_ranges, init_seed=None)
    tensors = read_stage_tensors(stage, layout)
    load_stage_state(stage, tensors)
    return stage


def load_stages_from_folder(folder: str | Path, n_stages: int, *, seq_len: int = 2048,
                            layer_ranges: Sequence | None = None,
                            attn_implementation: str | None = None) -> list[HFStage]:
    """Every stage of the checkpoint in ``folder`` (see :func:`load_stage_from_folder`), in order."""
    cfg = load_hf_config(Path(folder), attn_implementation)
    layout = read_layout(folder)
    split_hf_layers(cfg, n_stages, seq_len=seq_len, layer_ranges=layer_ranges)
    return [load_stage_from_folder(folder, i, n_stages, seq_len=seq_len, layer_ranges=layer_ranges,
                                   attn_implementation=attn_implementation, layout=layout) for i in range(n_stages)]


def _file_metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return f.metadata()


def _write_folder(stages: Sequence[HFStage], layout: CheckpointLayout, tmp: Path) -> None:
    state = assemble_state_dict(stages)
    src = layout.folder
    extra = sorted(k for k in state if k not in layout.weight_map and not (k == "lm_head.weight" and stages[0].tied))
    lacking = sorted(k for k in layout.weight_map if k not in state and not k.endswith(KEPT_SUFFIXES))
    if extra or lacking:
        raise StageWeightsError(f"the stages hold tensors {src} lacks ({extra[:3]}) or lack tensors it holds "
                                f"({lacking[:3]}); export to the folder they came from")
    for file in layout.files:
        names = [k for k, f in layout.weight_map.items() if f == file]
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(src / file), framework="pt", device="cpu") as f:
            for name in names:
                if name in state:
                    t = state[name]
                    if tuple(t.shape) != layout.shapes[name]:
                        raise StageWeightsError(f"{name!r} has shape {tuple(t.shape)} in the stages but "
                                                f"{layout.shapes[name]} in {src}; export to the folder they came from")
                    tensors[name] = t.detach().to("cpu", layout.dtypes[name], copy=True).contiguous()
                else:                                          # a legacy buffer (KEPT_SUFFIXES): kept as read
                    tensors[name] = f.get_tensor(name)
        save_file(tensors, str(tmp / file), metadata=_file_metadata(src / file))
        del tensors
    names = ["config.json"] + ([INDEX_FILE] if layout.sharded else []) + list(COPIED_FILES)
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)


def export_stages(stages: Sequence[HFStage], source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write ``stages`` (every stage of one pipeline, loaded from ``source``) as a ``transformers`` folder
    at ``out``, laid out as ``source`` (see the module docstring). ``force`` replaces an existing
    non-empty ``out``. Returns ``out``. Raises :class:`CheckpointFolderError` for a non-empty ``out``
    without ``force`` or an unreadable ``source``, :class:`~.hf_family.StageWeightsError` for stages that
    do not fit ``source`` or tied copies that drifted apart."""
    layout = read_layout(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointFolderError(f"{out} exists and is not empty; pass force=True to replace it or choose another folder")
    if out.resolve() == layout.folder.resolve():
        raise CheckpointFolderError(f"{out} is the source folder; export to another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=str(out.parent)))
    old = None
    try:
        _write_folder(stages, layout, tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
