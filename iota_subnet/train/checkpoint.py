"""Checkpoints in safetensors: model weights, optimizer state and JSON metadata in one file.

Layout of the tensor names: ``model/<param name>`` and ``optim/<param name>/<state key>``
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``). The header metadata holds ``meta``: a JSON
object with at least ``step``, ``config_fingerprint`` and ``config``.

Writes are atomic (temporary file, fsync, rename): a process killed while saving leaves the
previous checkpoint intact (and a temporary file that :func:`sweep_stray_temporaries` removes at the
next start), and a truncated file is refused on load with :class:`CheckpointError`.

Integrity: the header metadata also holds ``sha256``, a JSON object tensor name -> sha256 of the
tensor's stored bytes; :func:`read_checkpoint` recomputes every one from the file and refuses a
checkpoint whose bytes changed (a flipped bit in the tensor data would otherwise load silently).
Checkpoints written before the hashes existed load without that check.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from iota_subnet.utils.atomic import atomic_write_with, sweep_temporaries
from iota_subnet.utils.st_dtypes import ST_CODES
from iota_subnet.errors import UserError

#: Header metadata key of the per-tensor hashes.
HASHES_KEY = "sha256"


def sweep_stray_temporaries(folder: str | Path) -> list[Path]:
    """Remove the temporary files of checkpoint (and other atomic) writes that a killed process left
    in ``folder``; call at start, before anything is saved there. Returns the removed paths."""
    return sweep_temporaries(folder)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes as safetensors stores them (C order, little endian)."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message says why and what to do."""


def config_fingerprint(model_cfg, pipeline_cfg, stage: Optional[int] = None) -> str:
    """Short hash of everything that decides tensor shapes (model shape, split, bottleneck)."""
    import dataclasses
    blob = json.dumps({"model": dataclasses.asdict(model_cfg), "pipeline": dataclasses.asdict(pipeline_cfg),
                       "stage": stage}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key in seen:   # tied weight: stored once
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def checkpoint_tensors(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint by name (``model/<name>``, ``optim/<param>/<key>``; CPU, contiguous:
    no copy of a CPU tensor that already is). A scalar optimizer entry (AdamW's ``step``) is a 0-d
    float32 tensor; tied weights are stored once."""
    tensors = {f"model/{k}": v for k, v in _unique_state(module).items()}
    if optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        for p, state in optimizer.state.items():
            n = names.get(id(p))
            if n is None:
                continue
            for k, v in state.items():
                t = v if torch.is_tensor(v) else torch.tensor(float(v))
                tensors[f"optim/{n}/{k}"] = t.detach().contiguous().cpu()
    return tensors


def checkpoint_bytes(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], meta: dict) -> bytes:
    """Serialise ``module`` (and ``optimizer``) with ``meta`` to safetensors bytes (in memory: state
    sync answers; files are written by :func:`save_checkpoint`, streamed)."""
    return tensors_bytes(checkpoint_tensors(module, optimizer), meta)


def tensors_bytes(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """safetensors bytes of ``tensors`` (contiguous CPU tensors) with ``meta`` and per-tensor sha256."""
    hashes = {k: tensor_sha256(v) for k, v in tensors.items()}
    return st_save(tensors, metadata=_metadata(meta, hashes))


def _metadata(meta: dict, hashes: dict[str, str]) -> dict[str, str]:
    return {"meta": json.dumps(meta, sort_keys=True, default=str), HASHES_KEY: json.dumps(hashes, sort_keys=True)}


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write ``tensors`` (contiguous CPU tensors) with ``meta`` and per-tensor sha256 as one safetensors
    file, atomically and streamed: the header, then each tensor's bytes straight from its storage,
    so no serialised copy of the file is built in host memory (a memory-mapped tensor, e.g. a spilled
    update-store copy, is read page by page from the page cache). Same format as
    :func:`tensors_bytes` (8-byte little-endian header length, JSON header padded with spaces to a
    multiple of 8, data ordered by element size then name so every tensor is aligned); loads with
    ``safetensors`` and :func:`read_checkpoint`. Raises ValueError for a dtype safetensors lacks,
    OSError from the disk."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": _metadata(meta, {k: tensor_sha256(tensors[k]) for k in order})}
    off = 0
    for k in order:
        t = tensors[k]
        if t.dtype not in ST_CODES:
            raise ValueError(f"tensor {k!r}: dtype {t.dtype} cannot be stored in a safetensors checkpoint")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for k in order:
                t = tensors[k].detach()
                if t.numel():
                    f.write(memoryview(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
    return atomic_write_with(path, write)


def save_checkpoint(path: str | Path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    meta: dict) -> Path:
    """Write a checkpoint atomically and streamed (:func:`write_tensors`: no serialised copy of it in
    host memory). Returns the path."""
    return write_tensors(path, checkpoint_tensors(module, optimizer), meta)


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read (tensors, meta). Raises CheckpointError for a missing, truncated or corrupt file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    try:
        tensors = st_load(data)
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        extra = header.get("__metadata__", {}) or {}
        meta = json.loads(extra.get("meta", "{}"))
        hashes = json.loads(extra[HASHES_KEY]) if HASHES_KEY in extra else None
    except (SafetensorError, ValueError, json.JSONDecodeError, OverflowError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({e}); delete it to start over, "
            "or restore the previous good copy") from e
    if "step" not in meta:
        raise CheckpointError(f"checkpoint {path} has no metadata (step); it was not written by iota-subnet")
    if hashes is not None:
        _verify_hashes(path, data, 8 + n, header, hashes)
    return tensors, meta


def _verify_hashes(path: Path, data: bytes, base: int, header: dict, hashes: Any) -> None:
    """Recompute the sha256 of every tensor's stored bytes; CheckpointError names the first that differs."""
    names = [k for k in header if k != "__metadata__"]
    if not isinstance(hashes, dict) or set(hashes) != set(names):
        raise CheckpointError(f"checkpoint {path}: its tensor hashes do not list exactly its tensors; the file was "
                              "altered. Delete it to start over, or restore the previous good copy")
    view = memoryview(data)
    for name in sorted(names):
        start, end = header[name]["data_offsets"]
        if hashlib.sha256(view[base + start:base + end]).hexdigest() != hashes[name]:
            raise CheckpointError(
                f"checkpoint {path}: tensor {name!r} does not match its stored sha256 (the file's bytes changed "
                "after it was written: disk or copy corruption). Delete it to start over (a miner then syncs "
                "from a replica), or restore the previous good copy")


def restore(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], tensors: dict, meta: dict,
            expect_fingerprint: Optional[str] = None, path: str = "checkpoint") -> None:
    """Load weights (and optimizer state) into ``module`` / ``optimizer``.

    Raises CheckpointError when the checkpoint was written for another config (fingerprint or
    tensor shapes differ); nothing is modified in that case.
    """
    if expect_fingerprint and meta.get("config_fingerprint") != expect_fingerprint:
        raise CheckpointError(
            f"{path} was written for another config ({meta.get('config_summary', meta.get('config_fingerprint'))}); "
            "use the config it was trained with, or point --out at a new folder")
    model_sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    own = module.state_dict()
    for k, v in own.items():
        if k not in model_sd:
            if any(v.data_ptr() == o.data_ptr() for kk, o in own.items() if kk in model_sd):
                continue   # tied
            raise CheckpointError(f"{path} lacks tensor {k}; it was written for another config")
        if model_sd[k].shape != v.shape:
            raise CheckpointError(f"{path}: tensor {k} has shape {tuple(model_sd[k].shape)}, this config expects "
                                  f"{tuple(v.shape)}; use the config the checkpoint was trained with")
    extra = set(model_sd) - set(own)
    if extra:
        raise CheckpointError(f"{path} holds tensors this config lacks (e.g. {sorted(extra)[:3]}); wrong config")
    module.load_state_dict(model_sd, strict=False)
    if optimizer is not None:
        by_name = dict(module.named_parameters())
        for key, v in tensors.items():
            if not key.startswith("optim/"):
                continue
            pname, skey = key[len("optim/"):].rsplit("/", 1)
            p = by_name.get(pname)
            if p is None:
                continue
            optimizer.state[p][skey] = v.to(p.device) if skey != "step" else v.clone()
