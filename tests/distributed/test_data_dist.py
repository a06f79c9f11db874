"""load_data in a real 2-process gloo job: local rank 0 tokenizes into the cache first, rank 1 reads it back,
and both get the same data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.support import RECIPES, TINY_MODEL

pytestmark = pytest.mark.dist  # a 2-process gloo job


def _worker(rank: int, tmp: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from finetune.recipe.schema import recipe_from_dict
    from finetune.train.data import load_data

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        raw = {
            "model": {"path": str(TINY_MODEL)},
            "data": {
                "train": f"{tmp}/train.jsonl",
                "max_seq_len": 48,
                "packing": True,
                "cache_dir": f"{tmp}/cache",
            },
        }
        data = load_data(recipe_from_dict(raw), AutoTokenizer.from_pretrained(TINY_MODEL))
        out = {
            "stats": data.stats,
            "first": list(data.train[0].input_ids),
            "rows": [len(e.input_ids) for e in data.train],
        }
        Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_rank_zero_fills_the_cache_then_the_others_read_it(tmp_path):
    lines = (RECIPES / "data/uppercase/train.jsonl").read_text().splitlines()[:300]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["stats"]["cached_sources"], r1["stats"]["cached_sources"]) == (0, 1)
    assert r0["first"] == r1["first"] and r0["rows"] == r1["rows"]
    assert r0["stats"]["train_samples"] == 300
    assert len(list((tmp_path / "cache").glob("tokenized-*.arrow"))) == 1
