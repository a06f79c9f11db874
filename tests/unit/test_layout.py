"""The parallel layout (finetune/train/parallel/layout.py): degrees from the execution spec, every rank's coordinates over
a matrix of layouts, the mesh's dimensions and its validation; the mesh itself built in a real gloo world of 1.

The coordinates are checked against the numbering torchrun gives and the strategies' meshes used: tp fastest,
then the data-parallel shard, then its replicas, then the pipeline stages (so a TP group is neighbouring ranks of
one node, and ``rank // tp`` is the data-parallel index without a pipeline).
"""

from __future__ import annotations

import pytest
import torch

from finetune.spec import execution_spec
from finetune.train.parallel.layout import ParallelLayout

#: (world, pp, dp_replicate, dp_shard, tp)
MATRIX = [
    (1, 1, 1, 1, 1),
    (2, 1, 2, 1, 1),
    (2, 1, 1, 2, 1),
    (2, 1, 1, 1, 2),
    (2, 2, 1, 1, 1),
    (4, 1, 2, 2, 1),
    (4, 2, 1, 2, 1),
    (4, 2, 1, 1, 2),
    (4, 1, 1, 2, 2),
    (8, 2, 1, 2, 2),
    (8, 2, 2, 2, 1),
    (16, 2, 2, 2, 2),
    (12, 3, 1, 2, 2),
]


@pytest.mark.parametrize("world,pp,rep,shard,tp", MATRIX)
def test_every_rank_has_one_place_and_the_numbering_of_torchrun(world: int, pp: int, rep: int, shard: int, tp: int) -> None:
    layouts = [ParallelLayout(world, r, pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp) for r in range(world)]
    places = {(c.pp, c.dp_replicate, c.dp_shard, c.tp) for c in (lay.coordinates() for lay in layouts)}
    assert len(places) == world  # a bijection between ranks and coordinates
    for lay in layouts:
        c, r = lay.coordinates(), lay.rank
        assert lay.rank_at(pp=c.pp, dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, tp=c.tp) == r
        dp = world // (pp * tp)
        assert lay.dp == dp == rep * shard
        # the formulas the trainer, the pipeline's context and the strategies' meshes used
        assert lay.tp_rank == r % tp
        assert lay.pp_rank == r // (world // pp)
        assert lay.dp_rank == (r // tp) % dp
        assert lay.batch_copies == pp * tp
        if rep > 1 and shard > 1:  # hsdp's (nodes, processes per node) rows
            assert (c.dp_replicate, c.dp_shard) == divmod(r // tp % dp, shard)


@pytest.mark.parametrize("world,pp,rep,shard,tp", MATRIX)
def test_batch_peers_read_one_slice_and_groups_hold_their_neighbours(
    world: int, pp: int, rep: int, shard: int, tp: int
) -> None:
    layouts = [ParallelLayout(world, r, pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp) for r in range(world)]
    for lay in layouts:
        peers = lay.batch_peers
        assert len(peers) == pp * tp and lay.rank in peers
        assert {layouts[p].dp_rank for p in peers} == {lay.dp_rank}
        # every rank of another data-parallel index reads another slice
        assert all(layouts[q].dp_rank != lay.dp_rank for q in range(world) if q not in peers)
        tp_group = lay.group_ranks("tp")
        assert tp_group == tuple(range(lay.rank - lay.tp_rank, lay.rank - lay.tp_rank + tp))
        pp_group = lay.group_ranks("pp")
        assert len(pp_group) == pp and [layouts[q].pp_rank for q in pp_group] == list(range(pp))
        assert all(layouts[q].dp_rank == lay.dp_rank and layouts[q].tp_rank == lay.tp_rank for q in pp_group)
        both = lay.group_ranks("dp_replicate", "dp_shard")
        assert [layouts[q].dp_rank for q in both] == list(range(rep * shard))


def test_experts_borrow_from_the_shard_dimension() -> None:
    """ep splits dp_shard into (expert_shard, ep), ep innermost: each ep group is neighbouring shard ranks, the
    experts' FSDP groups take one rank of each, and the batch is still split over every data-parallel rank."""
    world = 8
    layouts = [ParallelLayout(world, r, dp_replicate=2, dp_shard=4, ep=2, fsdp=True, hybrid=True) for r in range(world)]
    lay = layouts[5]  # replica 1, shard 1
    assert (lay.expert_shard, lay.ep_rank, lay.dp_rank) == (2, 1, 5)
    assert lay.group_ranks("ep") == (4, 5)
    assert lay.group_ranks("expert_shard") == (5, 7)
    assert lay.group_ranks("dp_replicate", "expert_shard") == (1, 3, 5, 7)
    assert lay.group_ranks("dp_shard") == (4, 5, 6, 7)
    assert [n for n, _ in lay.mesh_dims] == ["dp_replicate", "expert_shard", "ep"]
    assert sorted(x.dp_rank for x in layouts) == list(range(world))


def test_the_spec_decides_the_degrees() -> None:
    """Each strategy's degrees, read from the execution spec (the enum's properties, not its name)."""

    def of(strategy: str, world: int, **kw: int) -> ParallelLayout:
        nodes = kw.pop("nodes", 1)
        spec = execution_spec("full", strategy, "fp32", checkpointing=False, world_size=world, nodes=nodes, **kw)
        return ParallelLayout.of(spec, rank=world - 1)

    def degrees(lay: ParallelLayout) -> tuple[int, ...]:
        return (lay.pp, lay.dp_replicate, lay.dp_shard, lay.ep, lay.tp)

    assert degrees(of("single", 1)) == (1, 1, 1, 1, 1) and of("single", 1).mesh_dims == ()
    assert degrees(of("ddp", 4)) == (1, 4, 1, 1, 1) and not of("ddp", 4).fsdp
    assert degrees(of("zero1", 4)) == (1, 4, 1, 1, 1)
    assert degrees(of("zero2", 4)) == (1, 1, 4, 1, 1) and of("zero2", 4).fsdp
    assert degrees(of("fsdp", 4, tp=2)) == (1, 1, 2, 1, 2)
    hsdp = of("hsdp", 8, nodes=2)
    assert degrees(hsdp) == (1, 2, 4, 1, 1) and hsdp.hybrid
    assert degrees(of("fsdp", 8, pp=2, tp=2, pp_layers=(2, 2))) == (2, 1, 2, 1, 2)
    # ddp with one replica per stage: no data-parallel dimension in the mesh, only pp and tp
    assert of("ddp", 4, pp=2, tp=2, pp_layers=(2, 2)).mesh_dims == (("pp", 2), ("tp", 2))
    # FSDP2 over one rank still needs its dimension; hsdp's 2-D mesh stays 2-D on one node
    assert of("fsdp", 2, pp=2, pp_layers=(2, 2)).mesh_dims == (("pp", 2), ("dp_shard", 1))
    assert of("hsdp", 2, nodes=1).mesh_dims == (("dp_replicate", 1), ("dp_shard", 2))
    # distributed.ep borrows from dp_shard: 4 fsdp ranks as 2 expert shards x ep 2; a replicating strategy has none
    ep = of("fsdp", 4, ep=2)
    assert degrees(ep) == (1, 1, 4, 2, 1) and ep.mesh_dims == (("expert_shard", 2), ("ep", 2))
    assert (ep.ep_rank, ep.coordinates().expert_shard) == (1, 1)
    assert degrees(of("ddp", 4, ep=2)) == (1, 4, 1, 1, 1)


@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"world_size": 4, "dp_shard": 2}, "= 2 ranks, but the world has 4"),
        ({"world_size": 4, "pp": 2, "tp": 3, "dp_shard": 1}, "= 6 ranks, but the world has 4"),
        ({"world_size": 4, "dp_shard": 4, "ep": 3, "fsdp": True}, "ep 3 borrows its ranks from dp_shard 4"),
        ({"world_size": 2, "dp_replicate": 2, "hybrid": True}, "fsdp must be set with hybrid"),
        ({"world_size": 1, "tp": 0}, "at least 1, not tp 0"),
        ({"world_size": 2, "rank": 2, "dp_replicate": 2}, "rank 2 is not in a world of 2"),
    ],
)
def test_an_inconsistent_layout_is_refused(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        ParallelLayout(**kwargs)


def test_a_layout_never_changes_and_its_context_neither() -> None:
    """A context is built once: the plan's layout is a new context over the same process, never an edit."""
    import dataclasses

    from finetune.train.parallel.distributed import DistContext

    ctx = DistContext(1, 4, 1, torch.device("cpu"))
    assert (ctx.layout.dp, ctx.layout.dp_rank) == (4, 1)  # every rank a replica before the plan
    spec = execution_spec("full", "fsdp", "fp32", checkpointing=False, world_size=4, tp=2)
    laid = ctx.laid_out(spec)
    assert (laid.layout.dp, laid.layout.dp_rank, laid.layout.tp_rank) == (2, 0, 1)
    assert ctx.layout.dp == 4  # the first context is as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        laid.rank = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        laid.layout.tp = 1  # type: ignore[misc]


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory: pytest.TempPathFactory):
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_mesh_is_built_once_and_every_submesh_is_a_view_of_it(gloo_world_of_one: None) -> None:
    """In a real gloo world of one: FSDP2's mesh of one rank (hsdp's 2-D one too) is a view of the world mesh,
    built on first use and then handed out again; a layout without a data-parallel dimension has no mesh."""
    for fsdp, hybrid, names in ((True, False, ("dp_shard",)), (True, True, ("dp_replicate", "dp_shard"))):
        lay = ParallelLayout(1, fsdp=fsdp, hybrid=hybrid)
        world = lay.world_mesh
        assert world is lay.world_mesh  # built once
        assert world.mesh_dim_names == names
        mesh = lay.fsdp_mesh
        assert mesh.mesh_dim_names == names and mesh.mesh.flatten().tolist() == [0]
        assert mesh._get_root_mesh() is world and lay.expert_fsdp_mesh.mesh_dim_names == names
    with pytest.raises(AssertionError, match="one process has no mesh"):
        ParallelLayout(1).world_mesh  # noqa: B018
    with pytest.raises(AssertionError, match="the strategy does not shard"):
        ParallelLayout(1).fsdp_mesh  # noqa: B018
