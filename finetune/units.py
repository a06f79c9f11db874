"""Units shared by the whole package: byte counts for people (and read back from them), and the recipe's dtype
names.

No torch at import time (the CLI imports this).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from finetune.errors import UserError

if TYPE_CHECKING:
    import torch


def fmt_bytes(n: float) -> str:
    """Binary units with one decimal: 1536 -> '1.5 KiB', 225710096 -> '215.3 MiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_bytes(text: str | int | float) -> int:
    """'80GiB', '80GB', '24 G', '512MiB', 85899345920 -> bytes (GB and G are read as GiB, as GPUs are sold)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"cannot read `{text}` as a memory size; write e.g. 80GiB or 24GB")
    value, unit = float(m.group(1)), m.group(2).upper()
    return int(value * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit])


def compact_bytes(n: float) -> str:
    """Bytes for narrow table columns: '31.0G', '62M', '12K'."""
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}" if unit == "G" else f"{n / size:.0f}{unit}"
    return f"{n:.0f}B"


#: Recipe dtype names (precision, model.dtype, quantization.compute_dtype, --dtype) to torch's names.
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "bf16-pure": "bfloat16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a recipe dtype name: 'bf16' -> torch.bfloat16 ('bf16-pure' computes in bf16 too)."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def checkpoint_bytes(saved_weight_bytes: int, trainable_params: int, moment_bytes: int = 4) -> int:
    """Predicted size of one checkpoint: the saved weights' bytes (all weights for full fine-tuning, the
    adapter for lora/qlora) + the optimizer's two moments per trainable parameter (``moment_bytes`` each:
    AdamW keeps them in the trained values' dtype, the 8-bit optimizers' checkpoints in fp32) + ~64 KiB of
    small files.

    E.g. full fine-tuning of N fp32 parameters: 12·N bytes; a 7B model: ~84 GB per checkpoint.
    """
    return saved_weight_bytes + trainable_params * 2 * moment_bytes + 64 * 1024
