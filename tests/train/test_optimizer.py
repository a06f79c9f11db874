"""train.optimizer: torch's AdamW (fused on CPU too), bitsandbytes' 8-bit AdamW, and the planner's state bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from finetune.recipe.schema import load_recipe
from finetune.spec import Strategy
from finetune.train.optimizer import build_optimizer
from tests.support import RECIPES, max_rel, step_rows, tiny_recipe, write_recipe


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "paged_adamw8bit"])
def test_each_optimizer_trains_on_cpu(tmp_path, name):
    """Ten steps on a regression task lower the loss; the 8-bit ones keep uint8 moments for large tensors
    (64 x 128 = 8192 values) and fp32 ones for small tensors (the norm)."""
    loaded = load_recipe(
        write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, train={"optimizer": name, "lr": 1e-2}))
    )
    model = _model()
    opt = build_optimizer(model, loaded.recipe.train, Strategy.SINGLE)
    x, y = torch.randn(32, 128), torch.randn(32, 8)
    losses = []
    for _ in range(10):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    big, norm = opt.state[model[0].weight], opt.state[model[1].weight]
    if name == "adamw":
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
        assert big["exp_avg"].dtype == torch.float32
    else:
        assert big["state1"].dtype == torch.uint8 and big["state2"].dtype == torch.uint8
        assert norm["state1"].dtype == torch.float32


def test_fused_adamw_step_holds_no_temporaries(tmp_path):
    """What the planner assumes (plan/memory.py: no step temporaries for AdamW): during ``step()`` the
    optimizer's tensors never exceed its two moments (MemTracker's peak), where foreach would add a
    state-sized temporary and the per-parameter loop two of the largest tensor."""
    from torch.distributed._tools.mem_tracker import MemTracker

    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path)))
    model = _model()
    opt = build_optimizer(model, loaded.recipe.train, Strategy.SINGLE)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the moments now exist
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())
    steps = len(opt.state) * 4  # the per-tensor step counters (fp32 scalars)
    opt_bytes = sum(v for k, v in peak.items() if str(k).endswith("OPT"))
    assert opt_bytes == moments + steps, (opt_bytes, moments, steps)


def test_unknown_optimizer_is_one_sentence(tmp_path, finetune_cmd):
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, train={"optimizer": "adam8"}))
    proc = subprocess.run([*finetune_cmd, "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "train.optimizer" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a CLI subprocess
def test_planner_counts_eight_bit_state(finetune_cmd):
    """Full fine-tuning of the quickstart model: AdamW keeps 2 x 4 bytes per value; the 8-bit one 2 bytes
    plus an fp32 scale per 256 values and a code book per large tensor, fp32 moments for small ones."""
    from finetune.plan.memory import optimizer_state_bytes
    from finetune.plan.shapes import Inventory, Tensor

    inv = Inventory(
        "x",
        "llama",
        2,
        "Block",
        base=[Tensor("w", 65536, True, True, False), Tensor("n", 100, True, False, False)],
    )
    assert optimizer_state_bytes(inv, False, "adamw", 4) == 2 * (2 * 65536 * 4 + 2 * 100 * 4)
    assert optimizer_state_bytes(inv, False, "adamw8bit", 4) == 2 * (
        2 * (65536 + 4 * 256 + 4 * 256) + 2 * 100 * 4
    )

    def plan(opt: str) -> dict:
        cmd = [
            *finetune_cmd,
            "plan",
            str(RECIPES / "quickstart.yaml"),
            "--json",
            "--set",
            f"train.optimizer={opt}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out)["chosen"]["memory"]

    a, b = plan("adamw"), plan("adamw8bit")
    assert 0.25 < b["optimizer"] / a["optimizer"] < 0.3 and b["total"] < a["total"]


# 8-bit moments round each update a little: a looser tolerance than the parity tests' 1e-4 (measured on this
# run: at most 1.7e-5 relative over 8 steps, growing with the steps).
EIGHT_BIT_RTOL = 1e-3


@pytest.mark.slow  # two CLI runs
def test_8bit_adamw_through_the_cli_follows_the_plain_run(tmp_path):
    """`finetune run` with train.optimizer adamw8bit: the plan records it, and each step's loss stays within
    EIGHT_BIT_RTOL of the same run with torch's AdamW (the reference: the launch() the CLI calls, in this
    process)."""
    from finetune.commands.run import LaunchOptions, launch

    losses = {}
    for name in ("adamw", "adamw8bit"):
        out = tmp_path / name
        recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_recipe(out, train={"optimizer": name, "max_steps": 8}))
        if name == "adamw":
            assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
        else:
            proc = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe)], capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((out / "plan.json").read_text())["chosen"]["optimizer"] == name
        losses[name] = [row["loss"] for row in step_rows(out)]
    assert len(losses["adamw8bit"]) == 8
    assert max_rel(losses["adamw8bit"], losses["adamw"]) <= EIGHT_BIT_RTOL, losses
    assert losses["adamw8bit"] != losses["adamw"]  # the 8-bit state really ran


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_eight_bit_step_synchronising_once_updates_as_bitsandbytes_does(name):
    """The trainer's 8-bit AdamW (one device synchronisation per step instead of one per parameter) takes
    bitsandbytes' own updates: after three steps, with a parameter left without a gradient in one of them,
    every weight, 8-bit code, absmax and fp32 moment equals the stock optimizer's, bit for bit."""
    import bitsandbytes as bnb

    from finetune.train.optimizer import optimizer_class

    cls, options = optimizer_class(name)
    stock = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    assert issubclass(cls, stock) and cls.step is not stock.step
    torch.manual_seed(0)
    shapes = [(64, 128), (96, 64), (8,), (300,)]  # 8-bit moments for the matrices, fp32 for the vectors
    params = {k: [torch.nn.Parameter(torch.randn(s)) for s in shapes] for k in ("ours", "stock")}
    for a, b in zip(params["ours"], params["stock"], strict=True):
        b.data.copy_(a.data)
    opts = {
        "ours": cls([{"params": params["ours"][:2], "weight_decay": 0.1}, {"params": params["ours"][2:]}], lr=1e-2, **options),
        "stock": stock([{"params": params["stock"][:2], "weight_decay": 0.1}, {"params": params["stock"][2:]}], lr=1e-2),
    }
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        for key, opt in opts.items():
            for i, (p, g) in enumerate(zip(params[key], grads, strict=True)):
                p.grad = None if (step == 1 and i == 1) else g.clone()
            opt.step()
    for a, b in zip(params["ours"], params["stock"], strict=True):
        assert torch.equal(a, b)
        sa, sb = opts["ours"].state[a], opts["stock"].state[b]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k
    assert opts["ours"].state[params["ours"][0]]["state1"].dtype == torch.uint8
    assert opts["ours"].state[params["ours"][1]]["step"] == 2  # its step without a gradient was skipped


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_eight_bit_step_synchronises_once_where_bitsandbytes_does_per_parameter(name, monkeypatch):
    """Counted through the function bitsandbytes' optimizer synchronises the device with (its ``sync_gpu``,
    still called, a no-op for CPU tensors): per step, the stock step calls it once for every parameter with a
    gradient (a paged optimizer once more after its loop); the trainer's once, for the last parameter updated.
    Over three steps of four parameters, one of them without a gradient in the second step."""
    import bitsandbytes as bnb
    from bitsandbytes.optim import optimizer as bnb_optimizer

    from finetune.train.optimizer import optimizer_class

    real = bnb_optimizer.sync_gpu
    calls: list[torch.Tensor] = []

    def counting(t: torch.Tensor) -> None:
        calls.append(t)
        real(t)

    monkeypatch.setattr(bnb_optimizer, "sync_gpu", counting)
    cls, options = optimizer_class(name)
    stock = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    shapes = [(64, 128), (96, 64), (8,), (300,)]
    counts: dict[str, list[int]] = {}
    for key, kind in (("ours", cls), ("stock", stock)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = kind(params, lr=1e-2, **(options if key == "ours" else {}))
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = None if (step == 1 and i == 1) else torch.randn(p.shape)
            calls.clear()
            opt.step()
            counts.setdefault(key, []).append(len(calls))
            if key == "ours":
                assert calls[0] is params[-1]  # after the last update
    paged = 1 if name == "paged_adamw8bit" else 0
    assert counts["stock"] == [4 + paged, 3 + paged, 4 + paged]
    assert counts["ours"] == [1, 1, 1]


class _LiveBytes:
    """A dispatch mode counting the bytes of the storages made inside it that are still alive, per producing
    operator (``ops`` of interest: their outputs' storages alone are counted) and at most ever."""

    def __init__(self, ops: tuple[str, ...], dtype: torch.dtype = torch.float32) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                if str(func.overloadpacket) in ops:
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        if type(t) is torch.Tensor and t.dtype == dtype:
                            outer._born(t.untyped_storage())
                return out

        self.mode, self.now, self.peak, self._live = Mode(), 0, 0, set()

    def _born(self, storage) -> None:  # type: ignore[no-untyped-def]
        import weakref

        key, n = storage.data_ptr(), storage.nbytes()
        if key in self._live:
            return
        self._live.add(key)
        self.now += n
        self.peak = max(self.peak, self.now)

        def gone() -> None:
            self._live.discard(key)
            self.now -= n

        weakref.finalize(storage, gone)


@pytest.fixture()
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_8bit():
    """Four 128 x 128 linears under FSDP2 (DTensor parameters: 8-bit moments for the weights, fp32 for the
    biases) and the trainer's sharded 8-bit AdamW over them."""
    from torch.distributed.fsdp import fully_shard

    from finetune.recipe.schema import TrainConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, build_optimizer(model, TrainConfig(optimizer="adamw8bit", lr=1e-2), Strategy.FSDP)


def test_eight_bit_checkpoint_holds_one_moment_at_a_time_and_resumes(tmp_path, one_rank_group):
    """Saving the sharded 8-bit AdamW through the checkpointer's DCP path dequantizes its moments one at a
    time (bitsandbytes' dequantization outputs alive at once: one weight's moment, where exporting them all
    first held eight), loading holds one moment's host buffer (and the reader's copy of it), and the loaded
    8-bit state is the saved one: the same codes, each block's absmax within an ulp, the next step's weights
    equal."""
    from finetune.train.checkpoint.checkpointer import ModelState, OptimizerState, load_sharded, save_sharded
    from finetune.train.optimizer import LocalShardOptimizer

    model, opt = _sharded_8bit()
    assert isinstance(opt, LocalShardOptimizer)
    x = torch.randn(8, 128)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    moment = 128 * 128 * 4  # one weight's fp32 moment
    saving = _LiveBytes(("bitsandbytes.dequantize_blockwise",))
    with saving.mode:
        save_sharded({"model": ModelState(model, adapters_only=False), "optimizer": OptimizerState(model, opt)},
                     tmp_path / "state", 1)
    assert saving.peak == moment, saving.peak / moment

    resumed, opt2 = _sharded_8bit()
    loading = _LiveBytes(("aten.empty", "aten.clone", "aten._to_copy", "bitsandbytes.dequantize_blockwise"))
    with loading.mode:
        load_sharded({"model": ModelState(resumed, adapters_only=False), "optimizer": OptimizerState(resumed, opt2)},
                     tmp_path / "state", 1)
    assert 0 < loading.peak <= 2 * moment + 16 * 1024, loading.peak / moment
    for p, q in zip(opt._params(), opt2._params(), strict=True):
        a, b = opt.state[p], opt2.state[q]
        assert a["step"] == b["step"] == 1
        for k in ("state1", "state2"):
            assert torch.equal(a[k], b[k]), k
        for k in ("absmax1", "absmax2"):
            if k in a:
                torch.testing.assert_close(a[k], b[k], rtol=2e-7, atol=0)
    for m, o in ((model, opt), (resumed, opt2)):
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=1e-7)
