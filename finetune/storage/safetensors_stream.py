"""Streaming access to a safetensors checkpoint: its headers, and shards written tensor by tensor.

:func:`read_header` is the one reader of a checkpoint's layout (which file holds which tensor, its shape and
dtype), for ``finetune merge`` and the trainer's sharded load alike. A checkpoint is processed one tensor
at a time: reading goes through ``safetensors.safe_open`` (memory-mapped, one shard open at a time);
writing uses :class:`ShardWriter`, because safetensors' own ``save_file`` needs every tensor of a file in
memory at once.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError

if TYPE_CHECKING:
    import torch

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors checkpoint as its file's header describes it (no data read)."""

    file: str  #: the file holding it, relative to the checkpoint directory
    key: str  #: its name in that file
    shape: tuple[int, ...]
    dtype: str  #: safetensors' name of its dtype (``F32``, ``BF16``, ...; :data:`ST_DTYPES`)


def shard_name_problem(name: Any) -> str | None:
    """Why ``name`` (a file an index's weight_map names) is not a plain file name of the model's directory: a path
    with a separator, ``..``, an absolute path, or not a ``.safetensors`` name; None when it is one."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name.startswith("~"):
        return f"`{name}` is a path, not a file name of the model's directory"
    if not name.endswith(".safetensors"):
        return f"`{name}` is not a .safetensors file"
    return None


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> shard file), every shard name
    checked to be a plain file of the index's directory (:func:`shard_name_problem`): an index that names
    ``../x`` or ``/etc/x`` would make a reader open, and a merge write, a file outside the model."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{index} is not readable JSON ({exc}); download or save the model again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index} has no weight_map; download or save the model again")
    for key, name in weight_map.items():
        problem = shard_name_problem(name)
        if problem is not None:
            raise UserError(f"{index}: weight_map places {key} in {problem}; the index is damaged or hostile")
    return weight_map


def read_header(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face safetensors directory, by its stored name, in the checkpoint's order.

    The files are those ``from_pretrained`` reads: the ones ``model.safetensors.index.json`` names, else
    ``model.safetensors``; a directory with neither (written by another tool) is read from all its
    ``*.safetensors`` files, as torch.distributed.checkpoint's reader does. Only the headers are read.
    """
    from safetensors import safe_open

    if (model_dir / SAFE_INDEX).is_file():
        weight_map = read_weight_map(model_dir / SAFE_INDEX)
        file_of: dict[str, str] | None = weight_map
        files = list(dict.fromkeys(weight_map.values()))
    else:
        single = model_dir / SAFE_SINGLE
        files = [SAFE_SINGLE] if single.is_file() else [f.name for f in sorted(model_dir.glob("*.safetensors"))]
        file_of = None
    headers: dict[str, dict[str, StoredTensor]] = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            headers[file] = {}
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                part = f.get_slice(key)
                headers[file][key] = StoredTensor(file, key, tuple(part.get_shape()), part.get_dtype())
    if file_of is None:
        return {key: stored for header in headers.values() for key, stored in header.items()}
    missing = next((k for k, file in file_of.items() if k not in headers[file]), None)
    if missing is not None:
        raise UserError(
            f"{model_dir / SAFE_INDEX} places {missing} in {file_of[missing]}, which does not hold it: "
            "the checkpoint is incomplete; download or save it again"
        )
    return {key: headers[file][key] for key, file in file_of.items()}


def stored_name(name: str, keys: Container[str], prefix: str) -> str | None:
    """The name a checkpoint stores model tensor ``name`` under: ``name`` itself, or, in older checkpoints
    that save the base model without its prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``), ``name``
    without ``prefix`` (the model's ``base_model_prefix``). None when the checkpoint has neither."""
    if name in keys:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in keys:
        return name[len(prefix) + 1 :]
    return None


def shard_map(base: Path) -> tuple[dict[str, list[str]], dict[str, StoredTensor]]:
    """Shard file name -> tensor names in the base checkpoint's order, and each name -> its stored tensor.

    A base saved from a model with peft's layers injected stores ``X.base_layer.weight`` and the adapter's
    own tensors; it is read as the plain model (``X.weight``) and the adapter tensors are left out.
    """
    shards: dict[str, list[str]] = {}
    source: dict[str, StoredTensor] = {}
    for key, stored in read_header(base).items():
        if re.search(r"\.(lora_[A-Za-z_]+|lora_embedding_[AB])\.", key):
            continue
        name = key.replace(".base_layer.", ".")
        shards.setdefault(stored.file, []).append(name)
        source[name] = stored
    return shards, source


#: torch dtype name -> safetensors dtype name.
ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


class ShardWriter:
    """Writes one safetensors file tensor by tensor, from a header computed up front.

    safetensors' own ``save_file`` needs every tensor of the file in memory at once; the format is a
    JSON header of (dtype, shape, byte offsets) followed by the raw bytes, so knowing shapes and output
    dtypes in advance is enough to write each tensor as soon as it is computed.
    """

    def __init__(self, path: Path, specs: list[tuple[str, list[int], torch.dtype]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expected: dict[str, tuple[list[int], torch.dtype, int]] = {}
        for name, shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            st = ST_DTYPES[str(dtype).removeprefix("torch.")]
            header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected[name] = (list(shape), dtype, offset)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.order = [name for name, _, _ in specs]
        self.total = offset
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.data_start = 8 + len(raw)
        self.next = 0
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``name``; tensors must come in the order of the specs."""
        import torch

        shape, dtype, _ = self.expected[name]
        assert self.order[self.next] == name, f"{name} written out of order"
        assert list(tensor.shape) == shape and tensor.dtype == dtype, f"{name}: {tensor.shape} {tensor.dtype}"
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.file.write(data.data)  # the array's buffer as a memoryview
        self.next += 1

    def write_at(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``name`` at its place in the file, in any order (each once; :meth:`close_any_order` after)."""
        import torch

        shape, dtype, offset = self.expected[name]
        assert list(tensor.shape) == shape and tensor.dtype == dtype, f"{name}: {tensor.shape} {tensor.dtype}"
        assert name not in self.written, f"{name} written twice"
        self.file.seek(self.data_start + offset)
        self.file.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
        self.written.add(name)

    def close_any_order(self) -> None:
        """Finish a file written by :meth:`write_at` (every tensor must have been written)."""
        self.file.close()
        assert self.written == set(self.order), "shard closed before every tensor was written"

    def close(self) -> None:
        """Finish the file (every tensor must have been written)."""
        self.file.close()
        assert self.next == len(self.order), "shard closed before every tensor was written"


def plan_shards(
    specs: list[tuple[str, list[int], torch.dtype]], max_bytes: int
) -> list[tuple[str, list[tuple[str, list[int], torch.dtype]]]]:
    """Split tensor specs, in order, into files of at most ``max_bytes`` (a tensor larger than that gets a file
    of its own), named as ``save_pretrained`` names them: ``model.safetensors`` alone, else
    ``model-00001-of-0000N.safetensors``."""
    groups: list[list[tuple[str, list[int], torch.dtype]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * spec[2].itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    if len(groups) == 1:
        return [(SAFE_SINGLE, groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def write_index(out: Path, shards: list[tuple[str, list[tuple[str, list[int], torch.dtype]]]]) -> None:
    """``model.safetensors.index.json`` for several shards (what ``from_pretrained`` reads); nothing for one."""
    if len(shards) < 2:
        return
    total = sum(math.prod(shape) * dtype.itemsize for _, specs in shards for _, shape, dtype in specs)
    weight_map = {name: file for file, specs in shards for name, _, _ in specs}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
