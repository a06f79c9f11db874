"""DDP's gradients are views into its all-reduce buckets (``gradient_as_bucket_view``): the buckets are the only
copy of the gradients, except under gradient accumulation, where the optimizer's zero_grad(set_to_none=True)
has detached the views and the non-final micro-batches (no_sync) accumulate into tensors of their own.

The planner's accounting on the tiny model (fast), the per-rank memory of real 2-process gloo runs with the
buckets as a copy and as the gradients' storage (scripts/ddp_bucket_memory.py), and the trainer's measured
peak against the plan for the ddp and zero1 rows of scripts/plan_accuracy.py (slow, 2 processes).
"""

from __future__ import annotations

import importlib
import json
import socket
import tempfile
from pathlib import Path

import pytest
from transformers import AutoConfig

from finetune.plan.candidates import evaluate
from finetune.plan.hardware import Hardware
from finetune.plan.request import Request
from finetune.plan.setting import settle
from finetune.plan.types import Config
from tests.support import TINY_MODEL, release_before_destroy

ROOT = Path(__file__).resolve().parents[2]
CFG = AutoConfig.from_pretrained(TINY_MODEL)
PARAMS = 3_037_440  # the tiny model's parameters (fp32: 4 bytes each, its gradients as many)


def states(strategy: str, global_batch: int, precision: str = "fp32", gpus: int = 2):
    """The tiny model's model states (no activations traced) under ``strategy`` at micro-batch 1."""
    req = Request(config=CFG, source="tiny", seq_len=128, packed=True, global_batch_size=global_batch,
                  method="full", precision=precision)
    hw = Hardware("cuda", gpus, 1, 10**12, True, "h100", "nvlink", 300e9, True)
    s = settle(req, hw)
    c = evaluate(s, Config("full", strategy, 1, False), traced=frozenset())
    return c.memory, c.grad_accum_steps


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_buckets_are_the_gradients_without_accumulation(strategy: str, precision: str) -> None:
    mem, accum = states(strategy, global_batch=2, precision=precision)
    assert accum == 1
    assert (mem.params, mem.grads, mem.buffers) == (4 * PARAMS, 4 * PARAMS, 0)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_accumulation_keeps_a_second_copy_beside_the_buckets(strategy: str) -> None:
    mem, accum = states(strategy, global_batch=8)
    assert accum == 4
    assert (mem.grads, mem.buffers) == (4 * PARAMS, 4 * PARAMS)


def test_one_process_has_no_buckets() -> None:
    mem, _ = states("ddp", global_batch=1, gpus=1)
    assert mem.buffers == 0


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch):
    """scripts/ on sys.path for the test (spawned ranks import scripts/ddp_bucket_memory.py by its name)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module


@pytest.mark.slow
@pytest.mark.dist
def test_bucket_views_remove_the_second_copy_at_every_step(scripts) -> None:
    """Two gloo ranks, 43 MiB of fp32 gradients, micro-batches of 32 tokens (activations small next to the
    gradients). With the buckets as a copy each backward adds the gradients' bytes to the resident set; as
    views it adds nothing, at every step after the first (which allocates AdamW's state), and the steady
    peak is lower by most of the gradients' bytes. The losses are the same to the last bit."""
    ddp = scripts("ddp_bucket_memory")
    copy, view = ddp.measure("copy", accum=1), ddp.measure("view", accum=1)
    g = copy["grad_bytes"]
    for c, v in zip(copy["steps"][1:], view["steps"][1:], strict=True):
        assert c["anon_after_backward"] - c["anon_start"] == pytest.approx(g, rel=0.05)
        assert v["anon_after_backward"] - v["anon_start"] < 0.05 * g
    s = ddp.summary(copy, view)
    assert s["max_loss_difference"] == 0.0
    assert 0.7 * g < s["peak_drop"] < 1.1 * g


@pytest.mark.slow
@pytest.mark.dist
def test_under_accumulation_the_views_save_nothing_at_the_peak(scripts) -> None:
    """What the planner counts for gradient accumulation: zero_grad(set_to_none=True) detached the views, so
    the first micro-batch's gradients are a copy beside the buckets and the peak is the copy mode's."""
    ddp = scripts("ddp_bucket_memory")
    s = ddp.summary(ddp.measure("copy", accum=2), ddp.measure("view", accum=2))
    assert abs(s["peak_drop"]) < 0.15 * s["grad_bytes"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "name",
    ["llama full fp32 ddp x2", "llama full fp32 ddp x2 accum2", "llama full fp32 ddp x2 seq32",
     "llama full fp32 zero1 x2", "llama full bf16 zero1 x2"],
)
def test_prediction_matches_the_measured_peak(name: str, scripts) -> None:
    """scripts/plan_accuracy.py's ddp and zero1 rows: the trainer's peak (MemTracker, rank 0) against the
    planner's prediction, within 5%."""
    pa = scripts("plan_accuracy")
    _, arch, change, nproc = next(c for c in pa.CONFIGS if c[0] == name)
    with tempfile.TemporaryDirectory() as tmp:
        r = pa.run_one(name, arch, change, nproc, Path(tmp))
    assert "predicted" in r, r
    assert abs(r["error"]) <= 0.05, r


def _train(rank: int, port: int, bucket_view: bool, out: str) -> None:
    """One rank of a 2-process run of the tiny model: activation checkpointing, fp16 autocast with a
    GradScaler, 2 micro-batches per step (no_sync on the first), clipping at 0.5, fused AdamW, zero_grad
    (set_to_none=True), 3 steps; rank 0 writes the losses, gradient norms and final weights' sums."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from finetune.train.gradients import clip_gradients
    from finetune.train.optimizer import optimizer_class
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import apply_activation_checkpointing, data_parallel, no_sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CFG)
    apply_activation_checkpointing(model)
    ddp = data_parallel(model, DistContext(rank, 2, rank, torch.device("cpu")), bucket_view=bucket_view)
    cls, options = optimizer_class("adamw")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cls(params, lr=1e-3, **options)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1 + rank)
    losses, norms = [], []
    for _ in range(3):
        for i in range(2):
            x = torch.randint(3, 264, (2, 24), generator=gen)
            with no_sync(ddp, enabled=i == 0), torch.autocast("cpu", dtype=torch.float16):
                loss = ddp(input_ids=x, labels=x).loss / 2
            scaler.scale(loss).backward()
            losses.append(float(loss.detach()))
        norms.append(clip_gradients(params, opt, scaler, 0.5))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        weights = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
        Path(out).write_text(json.dumps({"losses": losses, "norms": norms, "weights": weights}))
    dist.barrier()
    del ddp
    release_before_destroy()
    dist.destroy_process_group()


def _run(bucket_view: bool, tmp: Path) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp / f"view-{bucket_view}.json"
    mp.spawn(_train, args=(port, bucket_view, str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.dist
def test_bucket_views_train_exactly_as_the_copies_do(tmp_path: Path) -> None:
    """Gradient accumulation (no_sync), activation checkpointing, fp16 loss scaling and clipping over DDP
    with the gradients as bucket views give the losses, gradient norms and weights of DDP with copies."""
    copy, view = _run(False, tmp_path), _run(True, tmp_path)
    assert len(view["losses"]) == 6 and all(n > 0 for n in view["norms"])
    assert view["losses"] == copy["losses"]
    assert view["norms"] == pytest.approx(copy["norms"], rel=1e-6)
    assert view["weights"] == pytest.approx(copy["weights"], rel=1e-6, abs=1e-6)
    assert view["losses"][-1] != view["losses"][0]  # the weights moved
