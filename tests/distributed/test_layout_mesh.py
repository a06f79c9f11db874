"""The layout's one device mesh on 4 gloo processes: every submesh it hands out holds the ranks its coordinates
say (the pipeline's, TP's, FSDP2's, hsdp's 2-D mesh and expert parallelism's, whose dp_shard is flattened from
(expert_shard, ep)), its process groups reduce over exactly those ranks, and the context's sums count each
data-parallel replica once.

One spawn of 4 processes (no CLI, no model) for every layout; the trainings over these meshes are the other
distributed tests' (tensor parallelism, hsdp, the pipeline).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist

WORLD = 4
#: name -> (ParallelLayout keywords, the submeshes to check)
LAYOUTS: dict[str, tuple[dict, list[tuple[str, ...]]]] = {
    "pp2 x tp2": ({"pp": 2, "tp": 2}, [("pp",), ("tp",)]),
    "pp2 x fsdp2": ({"pp": 2, "dp_shard": 2, "fsdp": True}, [("pp",), ("dp_shard",)]),
    "hsdp 2x2": ({"dp_replicate": 2, "dp_shard": 2, "fsdp": True, "hybrid": True}, [("dp_replicate", "dp_shard")]),
    "fsdp2 x tp2": ({"dp_shard": 2, "tp": 2, "fsdp": True}, [("dp_shard",), ("tp",)]),
    "fsdp4 ep2": ({"dp_shard": 4, "ep": 2, "fsdp": True}, [("dp_shard",), ("ep",), ("expert_shard",)]),
    "hsdp 2x2 ep2": (
        {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "fsdp": True, "hybrid": True},
        [("dp_replicate", "dp_shard"), ("ep",), ("dp_replicate", "expert_shard")],
    ),
}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    found = {}
    for name, (kwargs, submeshes) in LAYOUTS.items():
        layout = ParallelLayout(WORLD, rank, **kwargs)
        ctx = DistContext(rank, WORLD, rank, torch.device("cpu"), layout)
        rows = {}
        for dims in submeshes:
            mesh = layout.submesh(*dims)
            total = torch.tensor(float(rank))
            for d in range(mesh.ndim):  # over each dimension in turn: the sum over the whole submesh
                dist.all_reduce(total, group=mesh.get_group(d))
            rows["/".join(dims)] = {
                "ranks": mesh.mesh.flatten().tolist(), "want": list(layout.group_ranks(*dims)),
                "sum": float(total), "root": mesh._get_root_mesh() is layout.world_mesh,
            }
        found[name] = {
            "submeshes": rows,
            # a per-replica value held by every rank of its slice: summed once per replica
            "data_sum": float(ctx.data_sum(float(layout.dp_rank + 1))),
            "want_sum": float(sum(range(1, layout.dp + 1))),
        }
        if layout.pp_enabled:  # the last stage's value on every rank of a pipeline
            found[name]["from_last"] = float(ctx.from_last_stage(torch.tensor(float(rank))))
            found[name]["last"] = float(layout.group_ranks("pp")[-1])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_every_submesh_holds_the_ranks_its_coordinates_say(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(found) == sorted(LAYOUTS)
        for name, result in found.items():
            for dims, row in result["submeshes"].items():
                assert row["ranks"] == row["want"], (rank, name, dims)
                assert row["sum"] == sum(row["want"]), (rank, name, dims)  # its group is those ranks
                assert row["root"], (rank, name, dims)  # a view of the one world mesh
            assert result["data_sum"] == result["want_sum"], (rank, name)
            if "from_last" in result:
                assert result["from_last"] == result["last"], (rank, name)
