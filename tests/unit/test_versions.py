"""The dependency floors in pyproject.toml are true: the installed versions satisfy them, the APIs the code
relies on at every version from the floor up exist (a failing assertion names the API and the floor), and
finetune.versions picks the spelling of those a later release renamed. scripts/check_versions.sh runs this
file and the CLI in a venv with exactly the floors, and the fast tier with the newest releases.

Where a floor comes from (checked against the released packages):

- torch 2.11: FSDP2 and DTensor under their public names, ``FSDPModule``'s prefetch and gradient-sync
  setters, ``nn.Module.compile()`` in place; 2.13's ``DistributedDataParallel(forward_sync_buffers=)`` is
  detected (``broadcast_buffers=`` before it).
- transformers 5.17: ``transformers.initialization``'s init guards, ``create_causal_mask``'s signature, the
  KV cache's layers; 5.24's rename of the KV cache (``past_key_values`` -> ``cache``) is detected.
- peft 0.19: prefix tuning moves the caller's ``position_ids`` past its virtual tokens (greedy generation
  relies on it); 0.18 drops them.
- bitsandbytes 0.50: CPU kernels for the 8-bit optimizers (``train.optimizer: adamw8bit`` on CPU).
- datasets 4.0: the ``datasets.List`` feature of the tokenized cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support import release_before_destroy

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
PINNED = ("torch", "transformers", "peft", "bitsandbytes", "datasets")


def floors() -> dict[str, Requirement]:
    """pyproject.toml's requirement of each of the pinned libraries, by name."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = {r.name: r for r in map(Requirement, deps)}
    return {name: reqs[name] for name in PINNED}


def floor(name: str) -> str:
    """``name>=X`` as pyproject.toml writes it (for assertion messages)."""
    return str(floors()[name])


def _tiny_llama(vocab: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("name", PINNED)
def test_installed_version_satisfies_the_floor(name: str) -> None:
    req = floors()[name]
    installed = Version(version(name))
    assert req.specifier, f"pyproject.toml names {name} without a floor"
    assert req.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is installed; {req} is required"
    )


def test_torch_apis() -> None:
    # FSDP2 and DTensor under their public names, and the distributed state-dict helpers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: F401
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401

    for method in (
        "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch",
        "set_requires_gradient_sync",
    ):
        assert hasattr(FSDPModule, method), f"FSDPModule.{method} needs {floor('torch')}"
    block = torch.nn.Linear(2, 2)
    block.compile()
    assert block._compiled_call_impl is not None, f"nn.Module.compile() in place needs {floor('torch')}"


def test_ddp_is_built_with_the_buffer_keyword_this_torch_has(tmp_path: Path) -> None:
    """data_parallel asks DDP not to sync buffers before every forward under the keyword the installed torch
    takes (no deprecation warning), and the wrapped model's gradients are the plain model's (world size 1)."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import data_parallel
    from finetune.versions import ddp_has_forward_sync_buffers, ddp_no_buffer_sync

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    chosen = ddp_no_buffer_sync()
    assert list(chosen) == (["forward_sync_buffers"] if "forward_sync_buffers" in params else ["broadcast_buffers"])
    assert ddp_has_forward_sync_buffers() == ("forward_sync_buffers" in params) and chosen == {next(iter(chosen)): False}
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    plain.register_buffer("table", torch.arange(3.0))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin.load_state_dict(plain.state_dict(), strict=False)
    twin.register_buffer("table", torch.arange(3.0))
    x = torch.randn(5, 4)
    plain(x).square().sum().backward()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the deprecated spelling warns on torch >= 2.13
            ddp = data_parallel(twin, DistContext(0, 1, 0, torch.device("cpu")))
        assert ddp.forward_sync_buffers is False if hasattr(ddp, "forward_sync_buffers") else not ddp.broadcast_buffers
        ddp(x).square().sum().backward()
    finally:
        ddp = None  # before the group (below: release_before_destroy)
        release_before_destroy()
        dist.destroy_process_group()
    for a, b in zip(plain.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)


def _ddp_buffers_worker(rank: int, store: str, result: str) -> None:
    """Both spellings of data_parallel's buffer keyword on 2 gloo processes (the detected one, then the one a
    torch without ``forward_sync_buffers`` gets): each rank's buffer after the wrap and after a forward, the
    gradients of the first backward, and a plain model's gradients of the same global batch."""
    import copy

    import torch.distributed as dist

    import finetune.versions as versions
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import data_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    detected = versions.ddp_has_forward_sync_buffers
    out = {}
    try:
        for branch in ("detected", "without forward_sync_buffers"):
            if branch != "detected":
                versions.ddp_has_forward_sync_buffers = lambda: False  # what torch < 2.13 answers
            torch.manual_seed(0)
            plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
            twin = copy.deepcopy(plain)
            twin.register_buffer("table", torch.full((3,), float(rank)))  # a rank's own value
            xs = torch.randn(2, 5, 4)  # every rank draws both halves of the global batch; it trains on its own
            (sum(plain(x).square().sum() for x in xs) / 2).backward()  # DDP averages the ranks' gradients
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated on torch >= 2.13
                ddp = data_parallel(twin, DistContext(rank, 2, rank, torch.device("cpu")))
            wrapped = twin.table.clone()
            ddp(xs[rank]).square().sum().backward()
            grads = [p.grad.clone() for p in twin.parameters()]
            twin.table.fill_(10.0 + rank)
            ddp(xs[rank]).square().sum().backward()  # a second step's forward: the buffers broadcast again?
            out[branch] = {
                "keyword": versions.ddp_no_buffer_sync(), "wrapped": wrapped, "forward": twin.table.clone(),
                "grads": grads, "plain": [p.grad for p in plain.parameters()],
            }
    finally:
        versions.ddp_has_forward_sync_buffers = detected
        ddp = None
        release_before_destroy()
        dist.destroy_process_group()
    torch.save(out, f"{result}.{rank}")


@pytest.mark.dist
def test_ddp_without_forward_sync_buffers_syncs_no_buffers(tmp_path: Path) -> None:
    """On 2 gloo processes, data_parallel as a torch without ``forward_sync_buffers`` (torch 2.11, 2.12) builds
    it: ``broadcast_buffers=False``, and each rank keeps its own buffer at the wrap and through every forward.
    With the detected keyword (``forward_sync_buffers=False`` on torch >= 2.13) the wrap broadcasts rank 0's
    buffers once, and no forward does. Either way the gradients are a plain model's over the global batch."""
    import tempfile

    import torch.multiprocessing as mp

    from finetune.versions import ddp_has_forward_sync_buffers

    result = str(tmp_path / "result")
    mp.spawn(_ddp_buffers_worker, args=(tempfile.mktemp(dir=tmp_path), result), nprocs=2)
    new = ddp_has_forward_sync_buffers()
    for rank in range(2):
        got = torch.load(f"{result}.{rank}", weights_only=False)
        old = got["without forward_sync_buffers"]
        assert old["keyword"] == {"broadcast_buffers": False}
        assert torch.equal(old["wrapped"], torch.full((3,), float(rank)))  # not synced at the wrap
        detected = got["detected"]
        assert detected["keyword"] == ({"forward_sync_buffers": False} if new else {"broadcast_buffers": False})
        assert torch.equal(detected["wrapped"], torch.full((3,), 0.0 if new else float(rank)))
        for branch in (old, detected):
            assert torch.equal(branch["forward"], torch.full((3,), 10.0 + rank))  # nor before a forward
            for g, want in zip(branch["grads"], branch["plain"], strict=True):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_the_kv_cache_goes_in_and_out_under_this_transformers_name() -> None:
    """finetune.versions names the KV cache as the installed transformers does (the models' keyword, the
    masks' keyword, the outputs' field), and a cached greedy continuation equals the uncached one."""
    import warnings

    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaModel

    from finetune.model.generation import greedy_tokens
    from finetune.versions import kv_cache_kwarg, kv_cache_name, output_cache

    need = floor("transformers")
    name = kv_cache_name()
    assert name in inspect.signature(LlamaModel.forward).parameters, f"model({name}=...) with {need}"
    assert name in inspect.signature(create_causal_mask).parameters, f"create_causal_mask({name}=...) with {need}"
    from transformers.modeling_outputs import CausalLMOutputWithPast

    assert name in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    model = _tiny_llama().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name would warn
        first = model(input_ids=ids, use_cache=True, **kv_cache_kwarg(None))
        layer = output_cache(first).layers[0]  # what finetune.model.adapters reads for prefix.init: text
        assert layer.keys.shape == layer.values.shape == (1, 1, 4, 16), f"cache.layers[i].keys with {need}"
        step = model(input_ids=torch.tensor([[5]]), use_cache=True, **kv_cache_kwarg(output_cache(first)))
        assert output_cache(step).get_seq_length() == 5, f"passing the cache back as `{name}=` with {need}"
        cached = greedy_tokens(model, ids, torch.ones_like(ids), 5, contextlib.nullcontext)
        seq = ids
        for _ in range(5):  # the same continuation recomputing the whole sequence at every step
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq[:, 4:])
    from transformers.initialization import guard_torch_init_functions, no_tie_weights  # noqa: F401


def test_peft_lora_inits_and_prefix_config() -> None:
    from peft import LoraConfig, PrefixTuningConfig

    need = floor("peft")
    for init in ("pissa", "olora", "gaussian"):
        cfg = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=init, task_type="CAUSAL_LM")
        assert cfg.init_lora_weights == init, f"LoraConfig(init_lora_weights={init!r}) needs {need}"
    LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, use_rslora=True)
    cfg = PrefixTuningConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=3,
        prefix_projection=True,
        encoder_hidden_size=8,
        num_layers=2,
    )
    assert cfg.encoder_hidden_size == 8, f"PrefixTuningConfig(encoder_hidden_size=) needs {need}"


def test_peft_prefix_offsets_position_ids_by_its_virtual_tokens() -> None:
    """finetune.model.generation passes the tokens' own positions; peft puts them after the prefix."""
    from peft import PrefixTuningConfig, get_peft_model

    virtual = 3
    model = get_peft_model(
        _tiny_llama(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=virtual)
    )
    seen: dict[str, torch.Tensor] = {}

    def record(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        seen["position_ids"] = kwargs.get("position_ids")

    model.get_base_model().model.register_forward_pre_hook(record, with_kwargs=True)
    positions = torch.tensor([[0, 1, 2, 3]])
    with torch.no_grad():
        model(
            input_ids=torch.tensor([[1, 2, 3, 4]]),
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            position_ids=positions,
        )
    got = seen.get("position_ids")
    assert got is not None and torch.equal(got, positions + virtual), (
        f"prefix tuning offsetting position_ids by num_virtual_tokens needs {floor('peft')} (got {got})"
    )


def test_bitsandbytes_cpu_layers_and_8bit_adamw() -> None:
    import bitsandbytes as bnb

    need = floor("bitsandbytes")
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    lin4 = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    lin4.load_state_dict(torch.nn.Linear(64, 64, bias=False).state_dict())
    lin4 = lin4.to("cpu")
    assert torch.isfinite(lin4(x)).all(), f"bitsandbytes Linear4bit on CPU needs {need}"
    lin8 = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
    lin8.load_state_dict(torch.nn.Linear(64, 64, bias=False).state_dict())
    lin8 = lin8.to("cpu")
    assert torch.isfinite(lin8(x.half())).all(), f"bitsandbytes Linear8bitLt on CPU needs {need}"
    # big enough for 8-bit state (min_8bit_size 4096) and a small one (32-bit state): both update on CPU
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(8))
    opt = bnb.optim.AdamW8bit([big, small], lr=1e-2)
    before = big.detach().clone()
    (big.sum() + small.sum()).backward()
    try:
        opt.step()
    except Exception as exc:  # older releases have no CPU kernel and raise from inside the step
        pytest.fail(f"8-bit AdamW on CPU needs {need}: {type(exc).__name__}: {exc}"[:500])
    assert opt.state[big]["state1"].dtype == torch.uint8, f"8-bit AdamW state needs {need}"
    assert not torch.equal(big.detach(), before), f"8-bit AdamW updates on CPU with {need}"


def test_datasets_list_feature() -> None:
    import datasets

    assert hasattr(datasets, "List"), f"datasets.List needs {floor('datasets')}"
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64"))})
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}, features=features)
    assert ds.features["input_ids"] == datasets.List(datasets.Value("int64"))
