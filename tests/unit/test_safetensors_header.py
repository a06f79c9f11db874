"""The checkpoint layout reader, the prefix lookup and the directory swap that merge and the trainer share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune.errors import UserError
from finetune.storage.safetensors_stream import (
    SAFE_INDEX,
    SAFE_SINGLE,
    StoredTensor,
    read_header,
    stored_name,
)
from finetune.storage.swap import swap_in


def _sharded(tmp_path: Path) -> Path:
    """A two-shard checkpoint whose index lists the tensors in an order of its own."""
    d = tmp_path / "sharded"
    d.mkdir()
    save_file({"b.weight": torch.zeros(3, 2), "a.bias": torch.zeros(5, dtype=torch.bfloat16)}, str(d / "m-1.safetensors"))
    save_file({"c.weight": torch.zeros(4, 4, dtype=torch.int8)}, str(d / "m-2.safetensors"))
    weight_map = {"c.weight": "m-2.safetensors", "a.bias": "m-1.safetensors", "b.weight": "m-1.safetensors"}
    (d / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_read_header_follows_the_index_with_each_tensor_s_file_shape_and_dtype(tmp_path: Path) -> None:
    header = read_header(_sharded(tmp_path))
    assert list(header) == ["c.weight", "a.bias", "b.weight"]
    assert header["c.weight"] == StoredTensor("m-2.safetensors", "c.weight", (4, 4), "I8")
    assert header["a.bias"] == StoredTensor("m-1.safetensors", "a.bias", (5,), "BF16")
    assert header["b.weight"] == StoredTensor("m-1.safetensors", "b.weight", (3, 2), "F32")


def test_read_header_of_a_single_file_ignores_other_safetensors_files(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2, 7, dtype=torch.float16)}, str(tmp_path / SAFE_SINGLE))
    save_file({"base_model.model.w.lora_A.weight": torch.zeros(1)}, str(tmp_path / "adapter_model.safetensors"))
    assert read_header(tmp_path) == {"w": StoredTensor(SAFE_SINGLE, "w", (2, 7), "F16")}


def test_read_header_without_index_or_model_file_reads_every_safetensors_file(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(1)}, str(tmp_path / "part-b.safetensors"))
    save_file({"y": torch.zeros(2)}, str(tmp_path / "part-a.safetensors"))
    assert {k: (t.file, t.shape) for k, t in read_header(tmp_path).items()} == {
        "y": ("part-a.safetensors", (2,)),
        "x": ("part-b.safetensors", (1,)),
    }


def test_an_index_naming_a_tensor_its_file_lacks_is_one_sentence(tmp_path: Path) -> None:
    d = _sharded(tmp_path)
    index = json.loads((d / SAFE_INDEX).read_text())
    index["weight_map"]["d.weight"] = "m-2.safetensors"
    (d / SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"places d\.weight in m-2\.safetensors, which does not hold it"):
        read_header(d)


def test_stored_name_drops_only_the_model_s_own_prefix() -> None:
    keys = {"h.0.attn.weight", "transformer.wte.weight"}
    assert stored_name("transformer.wte.weight", keys, "transformer") == "transformer.wte.weight"
    assert stored_name("transformer.h.0.attn.weight", keys, "transformer") == "h.0.attn.weight"
    assert stored_name("model.h.0.attn.weight", keys, "transformer") is None  # another prefix is not dropped
    assert stored_name("lm_head.weight", keys, "transformer") is None
    assert stored_name("transformer.h.0.attn.weight", keys, "") is None


def test_swap_in_replaces_a_directory_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    final, staged = tmp_path / "out", tmp_path / ".out.staged"
    for d, text in ((final, "old"), (staged, "new")):
        d.mkdir()
        (d / "f.txt").write_text(text)
    (final / "only-in-old.txt").write_text("gone")
    swap_in(staged, final, aside_prefix=".old-out-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in final.iterdir()) == ["f.txt"] and (final / "f.txt").read_text() == "new"
    staged.mkdir()
    (staged / "g.txt").write_text("first")
    swap_in(staged, tmp_path / "fresh")  # nothing to replace: a plain rename
    assert (tmp_path / "fresh" / "g.txt").read_text() == "first" and not staged.exists()
