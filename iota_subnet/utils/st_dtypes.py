"""safetensors dtype codes and torch dtypes (https://github.com/huggingface/safetensors, "Format").

One table for everything that reads or writes safetensors headers itself: the wire codec
(:mod:`iota_subnet.protocol.codec`), streamed checkpoint writes (:mod:`iota_subnet.train.checkpoint`)
and Hugging Face folders read tensor by tensor (:mod:`iota_subnet.model.hf_folder`).
"""
from __future__ import annotations

import torch

#: safetensors dtype code -> torch dtype (the dtypes this project stores or sends).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
#: torch dtype -> safetensors dtype code.
ST_CODES: dict[torch.dtype, str] = {d: code for code, d in ST_DTYPES.items()}
