"""The final model of a sharded full fine-tune (fsdp, 2 gloo processes), streamed one tensor at a time into
size-capped safetensors shards: `from_pretrained` loads it and gives the trained model's logits (the model the
run's last checkpoint holds, read back from its DCP shards) within 1e-5; with a cap smaller than the model
there are several shards and an index naming every weight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.safetensors_stream import SAFE_INDEX
from finetune.train import checkpoint as ck
from tests.conftest import RECIPES, TINY_MODEL, tiny_recipe, write_recipe

pytestmark = pytest.mark.dist


def test_streamed_shards_load_with_from_pretrained_and_give_the_trained_logits(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "run"
    r = tiny_recipe(
        out,
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None, "max_seq_len": 48},
        train={"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3},
        distributed={"strategy": "fsdp", "nproc": 2},
        output={"dir": str(out), "save_every": 2, "max_shard_size": "2MiB"},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(write_recipe(tmp_path / "r.yaml", r))],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    index = json.loads((out / SAFE_INDEX).read_text())
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(files) >= 4 and set(index["weight_map"].values()) == set(files)
    assert all(p.stat().st_size <= 2 * 2**20 + 64 * 1024 for p in out.glob("model*.safetensors"))

    trained = ck.read_weights(out / "checkpoints" / "step-2")
    assert set(index["weight_map"]) == set(trained)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    reference.load_state_dict(trained)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, loaded(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
