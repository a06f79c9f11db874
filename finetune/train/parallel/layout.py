"""The parallel layout of a run: its degrees, this rank's coordinates, and the one device mesh.

A :class:`ParallelLayout` is built once per rank from the execution spec (:meth:`ParallelLayout.of`) and read by
everything that needs to know where a rank sits: the data (which batch slice it reads), the loss (over how many
replicas it is averaged), tensor, sequence and pipeline parallelism, FSDP2, the final save. It holds five
degrees, outermost first::

    pp  x  dp_replicate  x  dp_shard  x  tp          (ep splits dp_shard: dp_shard = expert_shard x ep)

- ``pp``: pipeline stages (finetune.train.parallel.pipeline), outermost, so that the stages' point-to-point sends are the
  ones that cross nodes;
- ``dp_replicate`` x ``dp_shard`` = ``dp``: the data-parallel replicas, each reading its own slice of the global
  batch. DDP and ZeRO-1 replicate over all of them (``dp_replicate = dp``); zero2 and fsdp shard over all of them
  (``dp_shard = dp``); hsdp replicates over the nodes and shards inside each node;
- ``tp``: tensor parallelism, innermost, so that a TP group is neighbouring ranks of one node;
- ``ep``: expert parallelism, which borrows its ranks from ``dp_shard`` (as torchtitan's does): ``dp_shard`` is
  split into ``expert_shard`` x ``ep``, ep innermost. The experts are sharded over ``ep`` (each rank holds
  ``1/ep`` of them, tokens reach them by all-to-all over the ep mesh) and FSDP2 shards each expert's weights over
  what is left of the data-parallel shard dimension (``expert_fsdp_mesh``: ``expert_shard``, with
  ``dp_replicate`` before it under hsdp); every other weight is sharded over the whole ``dp_shard`` as without
  experts. The batch is still split over all ``dp`` ranks: ep ranks read different slices.

Ranks are numbered with tp fastest, then dp_shard (ep fastest inside it), then dp_replicate, then pp, as torchrun
numbers them node by node: the same numbering the meshes of the strategies had before there was a layout.

The device mesh is built once, on first use (:attr:`world_mesh`), with a dimension for every degree above 1 and
for the dimensions a strategy shards over even at degree 1 (FSDP2 over one rank still needs a mesh); every mesh
the run uses is a view of it (:meth:`submesh`, :attr:`tp_mesh`, :attr:`fsdp_mesh`, :attr:`pp_mesh`,
:attr:`ep_mesh`, :attr:`expert_fsdp_mesh`), so FSDP2 over TP's DTensors, HSDP's 2-D mesh and the pipeline's
groups all share one root mesh. A layout of one process builds none.

Expert parallelism (``distributed.ep``, ``ExecSpec.ep``; its rows in the capability table: a mixture of
experts, ep divides ``dp_shard`` and the experts, a sharded strategy): the experts' all-to-all runs over
:attr:`ep_mesh` and their ``fully_shard`` over :attr:`expert_fsdp_mesh` (finetune/train/parallel/expert_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from finetune.spec import ExecSpec

#: the layout's mesh dimensions, outermost first (under expert parallelism dp_shard is expert_shard x ep)
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits on each dimension of a :class:`ParallelLayout` (0-based)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    expert_shard: int

    def as_dict(self) -> dict[str, int]:
        """Dimension name -> index."""
        return {
            "pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
            "ep": self.ep, "expert_shard": self.expert_shard,
        }


@dataclass(frozen=True)
class ParallelLayout:
    """The degrees of a run's parallelism, this rank's coordinates on them, and the device mesh (see the module
    docstring). Built by :meth:`of` from the execution spec, or :meth:`replicas` before a plan exists."""

    world_size: int
    rank: int = 0
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    #: FSDP2 shards the parameters over dp_shard (zero2, fsdp, hsdp): that dimension is in the mesh at degree 1 too
    fsdp: bool = False
    #: hsdp: FSDP2's mesh is 2-D (dp_replicate, dp_shard), replicated over the first, even at one node
    hybrid: bool = False
    device_type: str = "cpu"
    _built: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        degrees = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "ep": self.ep,
                   "tp": self.tp}
        bad = [f"{k} {v}" for k, v in degrees.items() if v < 1]
        if bad:
            raise ValueError(f"parallel degrees must be at least 1, not {', '.join(bad)}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(
                f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp} = "
                f"{product} ranks, but the world has {self.world_size}"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ep {self.ep} borrows its ranks from dp_shard {self.dp_shard}, which it must divide"
            )
        if self.hybrid and not self.fsdp:
            raise ValueError("a hybrid layout shards over dp_shard: fsdp must be set with hybrid")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def of(
        cls, spec: ExecSpec, *, rank: int = 0, world_size: int | None = None, device_type: str = "cpu"
    ) -> ParallelLayout:
        """The layout the execution spec describes, seen from ``rank`` (``world_size``: the processes that run,
        the spec's by default; the launcher starts the plan's)."""
        world = spec.world_size if world_size is None else world_size
        dp = world // (spec.pp * spec.tp)
        strategy = spec.strategy
        if strategy.hybrid:  # nodes replicate, each node's ranks shard
            replicate, shard = spec.nodes, dp // spec.nodes
        elif strategy.uses_fsdp:
            replicate, shard = 1, dp
        else:  # one process, DDP, ZeRO-1: every data-parallel rank holds a replica
            replicate, shard = dp, 1
        return cls(
            world_size=world, rank=rank, pp=spec.pp, dp_replicate=replicate, dp_shard=shard,
            ep=spec.ep,
            tp=spec.tp, fsdp=strategy.uses_fsdp, hybrid=strategy.hybrid, device_type=device_type,
        )

    @classmethod
    def replicas(cls, world_size: int, rank: int = 0, device_type: str = "cpu") -> ParallelLayout:
        """Every rank a data-parallel replica: a process's place before its plan is read (and DDP's)."""
        return cls(world_size=world_size, rank=rank, dp_replicate=world_size, device_type=device_type)

    # -- degrees --------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel replicas: the slices the global batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_shard(self) -> int:
        """What is left of ``dp_shard`` once ep took its ranks: the ranks FSDP2 shards each expert over."""
        return self.dp_shard // self.ep

    @property
    def batch_copies(self) -> int:
        """Ranks that read the same batch slice (``pp x tp``): a per-replica value summed over every rank counts
        this many times."""
        return self.pp * self.tp

    @property
    def pp_enabled(self) -> bool:
        """The decoder layers run as stages over ``pp`` ranks."""
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        """The decoder blocks' linears are split over ``tp`` ranks."""
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        """The experts are split over ``ep`` ranks."""
        return self.ep > 1

    # -- coordinates ----------------------------------------------------------------------------------------
    def coordinates(self, rank: int | None = None) -> Coordinates:
        """Where ``rank`` (this layout's rank by default) sits on every dimension."""
        r = self.rank if rank is None else rank
        assert 0 <= r < self.world_size, f"rank {r} of {self.world_size}"
        tp, r = r % self.tp, r // self.tp
        shard, r = r % self.dp_shard, r // self.dp_shard
        replicate, pp = r % self.dp_replicate, r // self.dp_replicate
        return Coordinates(
            pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, ep=shard % self.ep,
            expert_shard=shard // self.ep,
        )

    def rank_at(self, *, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (the inverse of :meth:`coordinates`)."""
        return ((pp * self.dp_replicate + dp_replicate) * self.dp_shard + dp_shard) * self.tp + tp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline index."""
        return self.coordinates().pp

    @property
    def tp_rank(self) -> int:
        """This rank's index in its TP group (its rows of the sequence under sequence parallelism)."""
        return self.coordinates().tp

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group."""
        return self.coordinates().ep

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which slice of the global batch it reads."""
        c = self.coordinates()
        return c.dp_replicate * self.dp_shard + c.dp_shard

    @property
    def batch_peers(self) -> tuple[int, ...]:
        """The ranks that read the same batch slice as this one (its pp and tp neighbours, itself included)."""
        c = self.coordinates()
        return tuple(
            self.rank_at(pp=p, dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, tp=t)
            for p in range(self.pp) for t in range(self.tp)
        )

    def group_ranks(self, *names: str) -> tuple[int, ...]:
        """The global ranks of this rank's group over the dimensions ``names`` (the ranks its submesh of those
        dimensions holds, in the submesh's order: the first name outermost)."""
        c = self.coordinates().as_dict()
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
                 "ep": self.ep, "expert_shard": self.expert_shard}
        assert all(n in sizes for n in names), f"unknown dimension in {names}"
        out = []
        for flat in range(math.prod(sizes[n] for n in names)):
            at = dict(c)
            for n in reversed(names):
                at[n], flat = flat % sizes[n], flat // sizes[n]
            if "ep" in names or "expert_shard" in names:  # dp_shard = expert_shard x ep
                at["dp_shard"] = at["expert_shard"] * self.ep + at["ep"]
            out.append(self.rank_at(pp=at["pp"], dp_replicate=at["dp_replicate"], dp_shard=at["dp_shard"], tp=at["tp"]))
        return tuple(out)

    # -- the device mesh ------------------------------------------------------------------------------------
    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, degree) of every dimension of the world mesh, outermost first: each degree above 1, and
        dp_shard (dp_replicate under hsdp) where FSDP2 shards even over one rank. Under expert parallelism
        dp_shard is built as (expert_shard, ep) and flattened back into dp_shard."""
        dims: list[tuple[str, int]] = []
        if self.pp > 1:
            dims.append(("pp", self.pp))
        if self.dp_replicate > 1 or self.hybrid:
            dims.append(("dp_replicate", self.dp_replicate))
        if self.ep > 1:
            dims += [("expert_shard", self.expert_shard), ("ep", self.ep)]
        elif self.dp_shard > 1 or self.fsdp:
            dims.append(("dp_shard", self.dp_shard))
        if self.tp > 1:
            dims.append(("tp", self.tp))
        return tuple(dims)

    @property
    def world_mesh(self) -> Any:
        """The one device mesh of the run (``torch.distributed.device_mesh.DeviceMesh``), built on first use by
        every rank (a collective: every rank must ask for it, in the same order as for any other group)."""
        if "world" not in self._built:
            from torch.distributed.device_mesh import init_device_mesh

            dims = self.mesh_dims
            assert dims, "a layout of one process has no mesh"
            mesh = init_device_mesh(
                self.device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims)
            )
            if self.ep > 1:  # the dense weights shard over the whole of dp_shard, experts over what ep leaves
                mesh["expert_shard", "ep"]._flatten(mesh_dim_name="dp_shard")
            self._built["world"] = mesh
        return self._built["world"]

    def submesh(self, *names: str) -> Any:
        """The view of the world mesh over the dimensions ``names`` (each one of :attr:`mesh_dims`' names or
        ``dp_shard``), in that order."""
        return self.world_mesh[names[0] if len(names) == 1 else names]

    @property
    def tp_mesh(self) -> Any:
        """The TP group's 1-D mesh (tensor and sequence parallelism)."""
        assert self.tp > 1, "no tensor parallelism"
        return self.submesh("tp")

    @property
    def pp_mesh(self) -> Any:
        """The pipeline's 1-D mesh: the ranks of this rank's (dp, tp) position, one per stage."""
        assert self.pp > 1, "no pipeline"
        return self.submesh("pp")

    @property
    def pp_group(self) -> Any:
        """The pipeline's process group (:attr:`pp_mesh`'s)."""
        return self.pp_mesh.get_group()

    @property
    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards every (non-expert) parameter over: ``dp_shard``, or hsdp's 2-D
        ``(dp_replicate, dp_shard)`` (sharded over the second dimension, replicated over the first)."""
        assert self.fsdp, "the strategy does not shard"
        return self.submesh("dp_replicate", "dp_shard") if self.hybrid else self.submesh("dp_shard")

    @property
    def ep_mesh(self) -> Any:
        """The expert-parallel group's 1-D mesh (the experts' all-to-all)."""
        assert self.ep > 1, "no expert parallelism"
        return self.submesh("ep")

    @property
    def expert_fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards each expert's weights over: what ep leaves of dp_shard (with dp_replicate
        before it under hsdp); the whole FSDP mesh without expert parallelism."""
        if self.ep == 1:
            return self.fsdp_mesh
        return self.submesh("dp_replicate", "expert_shard") if self.hybrid else self.submesh("expert_shard")
