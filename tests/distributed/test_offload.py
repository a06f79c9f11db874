"""train.offload: FSDP2's CPU offload (optimizer under zero2, parameters under fsdp), what the capability table
refuses, and what the planner counts for it.

The fast tier checks the table's sentences, the offload policy the trainer passes to ``fully_shard``, the process
group a worker joins (gloo beside NCCL; one process training through it on gloo), and the planner's arithmetic
(device bytes, host bytes per node, bytes over the host link). The slow tier trains a 2-block Llama on 2 gloo
processes through the real CLI with offload and compares every step's loss and gradient norm with the same run
without offload and with one process (the parity tolerance of tests/distributed/test_distributed.py: 1e-4
relative), checks that the state the trainer really keeps on the host is the
planner's ``offloaded_bytes``, and that the planner's peak is within 5% of the measured one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from finetune.plan.job import job_figures, offloaded_per_rank
from finetune.plan.memory import (
    Setup,
    candidate_memory,
    offload_bytes_per_step,
    offloaded_bytes,
    optimizer_state_bytes,
    pinned_block,
)
from finetune.recipe.capabilities import Cell, first_refusal
from finetune.spec import execution_spec
from finetune.train.runtime.allocator import ALLOC_CONF_VARS
from tests.support import RECIPES, ROOT, TINY_MODEL, micro_model_dir, tiny_recipe, write_recipe

# tests/distributed/test_distributed.py's parity tolerance (relative, on every step's loss and gradient norm)
LOSS_RTOL = 1e-4


# -- the capability table ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cell", "refused_by"),
    [
        (Cell(strategy="zero2", processes=2, offload="optimizer"), None),
        (Cell(strategy="fsdp", processes=2, offload="parameters"), None),
        (Cell(strategy="zero2", processes=2, offload="optimizer", optimizer="adamw8bit"), None),
        (Cell(method="lora", strategy="fsdp", processes=2, offload="parameters"), None),
        (Cell(strategy="single", processes=1, offload="optimizer"), "offload-unsharded"),
        (Cell(strategy="ddp", processes=2, offload="parameters"), "offload-unsharded"),
        (Cell(strategy="zero1", processes=2, offload="optimizer"), "offload-unsharded"),
        (Cell(strategy="fsdp", processes=2, offload="optimizer"), "offload-optimizer-fsdp"),
        (Cell(strategy="zero2", processes=2, offload="parameters"), "offload-parameters-zero2"),
        (Cell(strategy="fsdp", processes=4, tp=2, offload="parameters"), "offload-tp"),
        (Cell(strategy="fsdp", processes=2, offload="parameters", optimizer="paged_adamw8bit"), "offload-paged"),
        (Cell(strategy=None, processes=2, offload=None), None),  # auto: nothing decided yet
    ],
)
def test_the_table_admits_offload_under_zero2_and_fsdp_only(cell: Cell, refused_by: str | None) -> None:
    found = first_refusal(cell)
    assert (found.rule.name if found else None) == refused_by, found


def test_an_offload_refusal_names_the_key_and_what_to_write() -> None:
    found = first_refusal(Cell(strategy="ddp", processes=2, offload="optimizer"))
    assert found is not None
    text = str(found)
    assert text.startswith("train.offload: optimizer runs FSDP2's CPU offload policy")
    assert "distributed.strategy ddp does not shard them" in text and "use strategy zero2" in text
    found = first_refusal(Cell(strategy="fsdp", processes=2, offload="optimizer"))
    assert found is not None and "write train.offload: parameters with fsdp" in str(found)


# -- the policy the trainer passes to fully_shard ---------------------------------------------------------------
def test_offload_policy_pins_host_memory_only_for_a_gpu() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from finetune.train.parallel.parallelize import offload_policy

    plain = execution_spec("full", "zero2", "fp32", checkpointing=False, world_size=2)
    off = execution_spec("full", "zero2", "fp32", checkpointing=False, world_size=2, offload="optimizer")
    assert not isinstance(offload_policy(plain, torch.device("cpu")), CPUOffloadPolicy)
    on_cpu = offload_policy(off, torch.device("cpu"))
    on_gpu = offload_policy(off, torch.device("cuda", 0))
    assert isinstance(on_cpu, CPUOffloadPolicy) and on_cpu.pin_memory is False
    assert isinstance(on_gpu, CPUOffloadPolicy) and on_gpu.pin_memory is True


# -- the process group the trainer asks for ---------------------------------------------------------------------
def test_offload_asks_for_gloo_beside_nccl() -> None:
    """FSDP2's CPU offload keeps gradients and optimizer state as CPU DTensors, whose collectives (clipping's
    full_tensor, the loss scaler, the final save's gather) an NCCL-only group refuses: the trainer asks for
    ``cuda:nccl,cpu:gloo`` when the run offloads, plain nccl otherwise, gloo on CPU."""
    from finetune.train.parallel.distributed import process_group_backend

    gpu = torch.device("cuda", 0)
    assert process_group_backend(gpu, offload=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(gpu) == "nccl"
    assert process_group_backend(torch.device("cpu"), offload=True) == process_group_backend(torch.device("cpu")) == "gloo"


class _Joined(Exception):
    """Raised in place of joining the process group, once its arguments are recorded."""


@pytest.mark.parametrize(
    ("offload", "world", "want"),
    [("optimizer", 1, "cuda:nccl,cpu:gloo"), ("parameters", 2, "cuda:nccl,cpu:gloo"), ("none", 2, "nccl"),
     ("none", 1, None)],
)
def test_a_gpu_worker_joins_the_group_its_offload_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offload: str, world: int, want: str | None
) -> None:
    """The worker's own start (run_worker: the request read, DistContext.from_env with offloads(request)) on a
    machine whose torch sees a GPU: what it passes to init_process_group. An offloading run asks for gloo beside
    NCCL on the GPU it set, a single offloading process included (alone: a store of its own); a plain run on
    several GPUs for NCCL alone; a plain single process for no group. Only what a CPU machine cannot have is
    stood in for: CUDA's availability, its set_device, and NCCL's group (the call is recorded, then stopped)."""
    import torch.distributed as dist

    from finetune.recipe.schema import load_recipe
    from finetune.train.runtime import worker

    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", *ALLOC_CONF_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # the worker sets this process's threads
    devices: list[int] = []
    joined: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)

    def init_process_group(**kwargs: object) -> None:
        joined.append(kwargs)
        raise _Joined

    def next_call(*args: object) -> None:
        raise _Joined

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    train = {"offload": offload} if offload != "none" else {}
    strategy = {"optimizer": "zero2", "parameters": "fsdp"}.get(offload, "ddp" if world > 1 else "single")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", train=train,
                                                           distributed={"strategy": strategy}))
    request = worker.RunRequest(
        recipe=load_recipe(str(recipe)).recipe.model_dump(mode="json"), plan={"execution": {"offload": offload}},
        base_dir=str(tmp_path),
    ).write(tmp_path / "request.json")
    if want is None:  # a single process without offload joins nothing: the run goes on (stopped at its next call)
        monkeypatch.setattr("finetune.train.parallel.nodes.agree_with_node0", next_call)
    with pytest.raises(_Joined):
        worker.run_worker(str(request))
    assert devices == [0]
    if want is None:
        assert joined == [] and not dist.is_initialized()
        return
    assert len(joined) == 1 and joined[0]["backend"] == want, joined
    assert joined[0]["device_id"] == torch.device("cuda", 0)
    if world == 1:  # no torchrun rendezvous: a group of one over a store in this process
        assert (joined[0]["rank"], joined[0]["world_size"]) == (0, 1)
        assert isinstance(joined[0]["store"], dist.HashStore)


@pytest.mark.parametrize(
    ("execution", "recipe_offload", "env", "want"),
    [
        ({"offload": "optimizer"}, "optimizer", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, True),
        ({"offload": "none"}, "auto", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, False),
        ({"offload": "none"}, "none", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, False),
        # several nodes run node 0's plan, which may offload where this node's does not
        ({"offload": "none"}, "auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, True),
    ],
)
def test_a_worker_asks_for_the_host_backend_when_its_run_may_offload(
    monkeypatch: pytest.MonkeyPatch, execution: dict, recipe_offload: str, env: dict, want: bool
) -> None:
    from finetune.train.runtime.worker import RunRequest, offloads

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    request = RunRequest(recipe={"train": {"offload": recipe_offload}}, plan={"execution": execution}, base_dir=".")
    assert offloads(request) is want


def test_offload_on_one_process_through_the_trainers_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1 through DistContext.from_env(offload=True), the trainer's initialisation: a group of one
    rank (FSDP2 needs one), zero2 with CPUOffloadPolicy, then the trainer's loss, clipping (the gradient
    norm's full_tensor on CPU DTensors) and AdamW for two steps, and every weight gathered whole: the
    losses, the norms and the weights are the unsharded model's."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.objectives.loss import causal_lm_loss
    from finetune.train.gradients import clip_grad_norm
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import apply_fsdp, decoder_blocks

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(
        TINY_MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,
    )
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sharded = copy.deepcopy(plain)
    ctx = DistContext.from_env(offload=True)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and not ctx.distributed
        spec = execution_spec("full", "zero2", "fp32", checkpointing=False, world_size=1, offload="optimizer")
        apply_fsdp(sharded, spec, ctx.laid_out(spec))
        policy = decoder_blocks(sharded)[0]._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy)
        ids = torch.arange(2 * 24).reshape(2, 24) % 200 + 3
        batch = {"input_ids": ids, "labels": ids.clone()}
        figures: dict[str, list[tuple[float, float]]] = {}
        for name, model in (("plain", plain), ("sharded", sharded)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(2):
                s, _ = causal_lm_loss(model, batch)
                s.backward()
                norm = clip_grad_norm([p for p in model.parameters() if p.requires_grad], opt, None, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                figures.setdefault(name, []).append((float(s.detach()), float(norm)))
        for (loss, norm), (want_loss, want_norm) in zip(figures["sharded"], figures["plain"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
        assert figures["plain"][0][1] > 0.5  # clipping clipped
        whole = {n: p.full_tensor() for n, p in sharded.named_parameters()}
        for n, p in plain.named_parameters():
            torch.testing.assert_close(whole[n], p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        ctx.close()
    assert not dist.is_initialized()


# -- the planner's arithmetic -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inv():
    from transformers import AutoConfig

    from finetune.plan.shapes import build_inventory

    return build_inventory(AutoConfig.from_pretrained(TINY_MODEL), str(TINY_MODEL), None)


def _setup(strategy: str, offload: str, device: str, optimizer: str = "adamw", accum: int = 1) -> Setup:
    spec = execution_spec(
        "full", strategy, "bf16", checkpointing=False, world_size=2, offload=offload, optimizer=optimizer
    )
    return Setup(spec, 1, accum, 2, device, optimizer)


def test_pinned_blocks_round_up_to_a_power_of_two() -> None:
    assert [pinned_block(n) for n in (0, 1, 4096, 4097, 3 * 2**20)] == [0, 1, 4096, 8192, 4 * 2**20]


@pytest.mark.parametrize(("strategy", "offload"), [("zero2", "optimizer"), ("fsdp", "parameters")])
def test_offload_empties_the_gpu_of_model_states_but_not_a_cpu(inv, strategy: str, offload: str) -> None:
    """On a GPU the shards of parameters, gradients and optimizer state leave the device; the gathered units
    stay (plus one unit's shard staged for its all-gather). On a CPU device nothing moves: the prediction is
    the plain one."""
    plain_gpu, _ = candidate_memory(inv, None, _setup(strategy, "none", "cuda"))
    off_gpu, _ = candidate_memory(inv, None, _setup(strategy, offload, "cuda"))
    assert plain_gpu.params > 0 and plain_gpu.optimizer > 0
    assert (off_gpu.params, off_gpu.grads, off_gpu.optimizer) == (0, 0, 0)
    staged = -(-inv.storage(_setup(strategy, offload, "cuda").spec).block_param_bytes // 2)
    assert off_gpu.buffers == plain_gpu.buffers + staged
    plain_cpu, _ = candidate_memory(inv, None, _setup(strategy, "none", "cpu"))
    off_cpu, _ = candidate_memory(inv, None, _setup(strategy, offload, "cpu"))
    assert off_cpu == plain_cpu


def test_offloaded_bytes_are_the_rank_shards_of_parameters_gradients_and_state(inv) -> None:
    """Unpinned (a CPU device): each fp32 shard padded to ceil(rows / 2) rows, the same for the gradients,
    and half of AdamW's two fp32 moments."""
    s = _setup("zero2", "optimizer", "cpu")
    params = sum(
        (-(-t.rows // 2) * (t.numel // t.rows) if t.rows > 1 else -(-t.numel // 2)) * 4
        * (inv.num_layers if t.in_block else 1)
        for t in inv.base
    )
    opt = -(-optimizer_state_bytes(inv, False, "adamw", 4) // 2)
    assert offloaded_bytes(inv, s) == 2 * params + opt
    assert opt == -(-2 * inv.n_params * 4 // 2)
    assert offloaded_bytes(inv, _setup("zero2", "none", "cpu")) == 0
    # pinned on a GPU machine: never less, and 8-bit moments shrink the host's share
    assert offloaded_bytes(inv, _setup("zero2", "optimizer", "cuda")) >= offloaded_bytes(inv, s)
    eight = offloaded_bytes(inv, _setup("zero2", "optimizer", "cpu", optimizer="adamw8bit"))
    assert eight == 2 * params + -(-optimizer_state_bytes(inv, False, "adamw8bit", 4) // 2) < offloaded_bytes(inv, s)


def test_host_link_bytes_per_step(inv) -> None:
    """Each micro-batch copies every fp32 shard to the GPU for the forward (fsdp: the blocks again for the
    backward); the fp32 gradient shards come back once per step. No link on a CPU device."""
    s = _setup("fsdp", "parameters", "cuda", accum=3)
    sb = inv.storage(s.spec)
    forward, blocks = -(-sb.param_bytes // 2), sb.block_param_bytes * inv.num_layers
    assert offload_bytes_per_step(inv, s) == 3 * -(-(sb.param_bytes + blocks) // 2) + -(-inv.n_params * 4 // 2)
    z2 = _setup("zero2", "optimizer", "cuda")
    assert offload_bytes_per_step(inv, z2) == forward + -(-inv.n_params * 4 // 2)
    assert offload_bytes_per_step(inv, _setup("zero2", "optimizer", "cpu")) == 0
    assert offload_bytes_per_step(inv, _setup("zero2", "none", "cuda")) == 0


def test_job_figures_hold_the_offloaded_state_in_host_memory_per_node(inv) -> None:
    """On a GPU machine each of the node's 8 ranks adds its offloaded state to the saving phases and its
    parameter shard to loading; on a CPU device the state is the step's own memory (no change)."""
    plain = execution_spec("full", "fsdp", "bf16", checkpointing=False, world_size=8)
    off = execution_spec("full", "fsdp", "bf16", checkpointing=False, world_size=8, offload="parameters")
    a, b = job_figures(inv, plain, 8, 8, "cuda"), job_figures(inv, off, 8, 8, "cuda")
    per_rank = offloaded_per_rank(inv, off, 8, "cuda")
    assert per_rank == offloaded_bytes(inv, Setup(off, 1, 1, 8, "cuda", "adamw")) > 0
    assert b.host_offload_per_node == 8 * per_rank
    assert b.host_checkpoint_per_node - a.host_checkpoint_per_node == 8 * per_rank
    assert b.host_final_save_per_node - a.host_final_save_per_node == 8 * per_rank
    assert b.host_loading_per_node - a.host_loading_per_node == 8 * -(-inv.storage(off).param_bytes // 8)
    assert job_figures(inv, off, 8, 8, "cpu") == job_figures(inv, plain, 8, 8, "cpu")


# -- training through the CLI on 2 gloo processes ----------------------------------------------------------------
STEPS = 4


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 blocks, 64 wide: the MLP and q/o matrices (>= 4096 values) get 8-bit moments, k/v and the norms fp32."""
    return micro_model_dir(
        tmp_path_factory.mktemp("micro-llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )


def _recipe(model: Path, out: Path, strategy: str, **train: str) -> dict:
    """fp32, global batch 8 in micro-batches of 2, eval off; ``train``: more keys of the train section."""
    return {
        "model": {"path": str(model), "init": "random"},
        "method": "full",
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3,
                  "warmup_steps": 1, "max_grad_norm": 1.0, "seed": 0, **train},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1},
    }


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


class Runs:
    """Each run once per module; train.offload and train.optimizer given as --set overrides. The 2-process runs
    through the CLI; the single-process reference through the same launch() the CLI calls, in this process (no
    interpreter start, as tests/distributed/test_distributed.py's references)."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.done = root, model, {}

    def get(self, strategy: str, offload: str, optimizer: str = "adamw") -> Path:
        key = f"{strategy}-{offload}-{optimizer}"
        if key not in self.done:
            out = self.root / key
            recipe = write_recipe(self.root / f"{key}.yaml", _recipe(self.model, out, strategy))
            overrides = [f"train.offload={offload}", f"train.optimizer={optimizer}"]
            if strategy == "single":
                from finetune.commands.run import LaunchOptions, launch

                assert launch(str(recipe), overrides, LaunchOptions(nproc=1)) == 0
            else:
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                proc = subprocess.run(
                    [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "2",
                     *(arg for o in overrides for arg in ("--set", o))],
                    capture_output=True, text=True, timeout=900, env=env,
                )
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, micro: Path) -> Runs:
    return Runs(tmp_path_factory.mktemp("offload"), micro)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("strategy", "offload", "optimizer"),
    [("zero2", "optimizer", "adamw"), ("fsdp", "parameters", "adamw"), ("zero2", "optimizer", "adamw8bit")],
)
def test_offloaded_run_trains_like_the_plain_run(runs: Runs, strategy: str, offload: str, optimizer: str) -> None:
    """Every step's loss and gradient norm of the offloaded 2-process run equal the same run without offload
    and the single process's (same optimizer), within the parity tolerance; the plan says what ran."""
    off = runs.get(strategy, offload, optimizer)
    plan = json.loads((off / "plan.json").read_text())
    assert (plan["chosen"]["offload"], plan["chosen"]["optimizer"]) == (offload, optimizer)
    assert (plan["execution"]["offload"], plan["execution"]["optimizer"]) == (offload, optimizer)
    got = _rows(off)
    for want in (_rows(runs.get(strategy, "none", optimizer)), _rows(runs.get("single", "none", optimizer))):
        assert _max_rel([r["loss"] for r in got], [r["loss"] for r in want]) <= LOSS_RTOL
        assert _max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    assert got[-1]["loss"] < got[0]["loss"]


def _worker(rank: int, store: str, recipe: str, plan_dict: dict, result: str) -> None:
    import torch.distributed as dist

    from finetune.plan.types import Plan
    from finetune.recipe.schema import load_recipe
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import decoder_blocks, unwrap
    from finetune.train.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        plan = Plan.from_dict(plan_dict)
        trainer = Trainer(load_recipe(recipe), plan, DistContext(rank, 2, rank, torch.device("cpu")))
        trainer.setup()
        model = unwrap(trainer.model)
        # FSDP2's own record of the policy each unit was sharded with
        policies = [type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                    for m in [*decoder_blocks(model), model]]
        pinned = [p.to_local().is_pinned() for p in model.parameters()]
        ids = torch.arange(2 * 16).reshape(2, 16) % 200 + 3
        model(input_ids=ids, labels=ids).loss.backward()

        def local_bytes(ts: list[torch.Tensor]) -> int:
            """Bytes of the distinct storages under ``ts`` (a unit's gradient shards share its reduce-scatter
            output; each parameter shard is a view of its padded shard)."""
            storages = {}
            for t in ts:
                st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            return sum(storages.values())

        grads = local_bytes([p.grad for p in model.parameters()])
        trainer.optimizer.step()
        params = local_bytes(list(model.parameters()))
        state = local_bytes([v for s in trainer.optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0])
        torch.save({"policies": policies, "pinned": pinned, "params": params, "grads": grads, "state": state},
                   f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("strategy", "offload"), [("zero2", "optimizer"), ("fsdp", "parameters")])
def test_trainer_shards_with_the_offload_policy_and_keeps_what_the_planner_counts(
    tmp_path: Path, micro: Path, strategy: str, offload: str
) -> None:
    """Through the trainer's own setup on 2 gloo processes: every unit is sharded with CPUOffloadPolicy,
    nothing is pinned (no accelerator), and the bytes of this rank's parameter shards, gradient shards and
    AdamW state equal the planner's offloaded_bytes."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    from finetune.plan.flowchart import plan_for_run
    from finetune.plan.shapes import build_inventory
    from finetune.recipe.schema import load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", _recipe(micro, tmp_path / "out", strategy, offload=offload))
    plan = plan_for_run(load_recipe(str(recipe)), nproc=2, nnodes=1, device="cpu")
    assert plan.execution is not None and plan.execution.offload == offload
    result = str(tmp_path / "result")
    mp.spawn(_worker, args=(tempfile.mktemp(dir=tmp_path), str(recipe), plan.to_dict(), result), nprocs=2)
    inv = build_inventory(AutoConfig.from_pretrained(micro), str(micro), None)
    want = offloaded_bytes(inv, Setup(plan.execution, 2, 2, 2, "cpu", "adamw"))
    for rank in range(2):
        got = torch.load(f"{result}.{rank}", weights_only=False)
        assert set(got["policies"]) == {"CPUOffloadPolicy"}, got
        assert not any(got["pinned"]), got
        assert got["params"] + got["grads"] + got["state"] == want, (rank, got, want)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "name",
    ["llama full fp32 zero2 x2 offload optimizer", "llama full fp32 fsdp x2 offload parameters",
     "llama full fp32 zero2 x2 offload adamw8bit", "llama full fp32 mb1 adamw8bit"],
)
def test_prediction_matches_the_measured_peak(name: str) -> None:
    """scripts/plan_accuracy.py's offload and 8-bit rows: the real run's peak (MemTracker, rank 0) against the
    planner's prediction, within 5%."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    _, arch, change, nproc = next(c for c in plan_accuracy.CONFIGS if c[0] == name)
    with tempfile.TemporaryDirectory() as tmp:
        r = plan_accuracy.run_one(name, arch, change, nproc, Path(tmp))
    assert "predicted" in r, r
    assert abs(r["error"]) <= 0.05, r
