"""Sharded loading on 2 gloo processes: built on meta, wrapped by fully_shard, then each rank fills only its
shards. The gathered weights equal today's seeded random init bit for bit, and a pretrained checkpoint cast
per tensor to the storage dtype; tied embeddings stay one parameter; adapters start as peft's defaults
(lora_B zero) identically on every path, and pissa/olora as peft decomposes the whole model."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import RECIPES, micro_model_dir, tiny_recipe, write_recipe

pytestmark = pytest.mark.dist


def _micro(d: Path, tied: bool) -> Path:
    return micro_model_dir(
        d,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
        vocab_size=263,  # 263: uneven shards
    )


def _write(model_dir: Path, out: Path, method: str, init: str, precision: str) -> Path:
    dora = method == "dora"
    lora_init = method if method in ("pissa", "olora") else "default"
    r = tiny_recipe(
        out,
        model={"path": str(model_dir), "init": init},
        method="lora" if dora or lora_init != "default" else method,
        precision=precision,
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None},
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "use_dora": dora, "init": lora_init},
        prefix={"num_virtual_tokens": 4, "projection": True, "projection_hidden": 16},
        adapter={"size": 8, "embeddings": True},  # drawn after the layers' bottlenecks, as the whole load draws
        distributed={"strategy": "fsdp"},
    )
    return write_recipe(out.parent / f"{out.name}.yaml", r)


def _worker(rank: int, store: str, cases: list[tuple[str, str, str, str, str]]) -> None:
    import torch.distributed as dist

    from finetune.model.adapters import LORA_INIT_ATTR
    from finetune.recipe.schema import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.model.build import build_model
    from finetune.train.model.load import build_on_meta, loads_sharded, materialize
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import parallelize

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for recipe, out, method, precision, _ in cases:
        loaded = load_recipe(recipe)
        r = loaded.recipe
        method = r.method
        spec = execution_spec(
            method,
            "fsdp",
            precision,
            checkpointing=False,
            world_size=2,
            quantization=r.quantization,
            lora=r.lora,
            prefix=r.prefix,
            adapter=r.adapter,
        )
        assert loads_sharded(spec, 2)
        ctx = DistContext(rank, 2, rank, torch.device("cpu")).laid_out(spec)
        torch.manual_seed(1234)  # the global generator as the whole-model load below finds it
        model = parallelize(build_on_meta(loaded, spec, ctx.device), spec, ctx)
        # Rank 0 of an adapter run from a random init writes the seeded base, tensor by tensor, as the trainer does.
        keep_base = rank == 0 and method != "full" and loaded.recipe.model.init == "random"
        materialize(model, loaded, spec, ctx.device, Path(out) / "base" if keep_base else None)
        result = {"full": _gathered(model)}
        result["tied"] = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        if method != "full" and Path(out).name.split("-")[0] != "lora":
            # against the whole-model load (transformers' quantizing loader, peft's DoRA magnitudes, the prefix
            # encoder and bottlenecks drawn after loading), sharded afterwards
            torch.manual_seed(1234)
            old = parallelize(build_model(loaded, spec, ctx.device), spec, ctx)
            result["old"] = _gathered(old)
            result["quant_state"] = _quant_states(model)
            result["old_quant_state"] = _quant_states(old)
            ids = torch.arange(2 * 24).reshape(2, 24) % 250 + 3
            result["loss"] = _loss(model, ids)
            result["old_loss"] = _loss(old, ids)
            result["initial"] = getattr(model, LORA_INIT_ATTR, {})
            result["old_initial"] = getattr(old, LORA_INIT_ATTR, {})
        if rank == 0:
            torch.save(result, Path(out) / "gathered.pt")
    dist.destroy_process_group()


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _quant_states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every Linear4bit's quantization constants (absmax, and the double quantization's)."""
    out = {}
    for name, m in model.named_modules():
        qs = getattr(m, "quant_state", None)
        if qs is not None:
            for k, v in qs.as_dict(packed=True).items():
                out[f"{name}.{k}"] = v.clone()
    return out


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return float(model(input_ids=ids, labels=ids).loss)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes: 4-bit codes packed into bf16 can read as NaN, which torch.equal never finds equal."""
    return t.contiguous().view(torch.uint8)


def _seeded(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # what load_base_model does for model.init: random (train.seed 0)
    m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    return {k: v.detach() for k, v in m.named_parameters()}


def test_sharded_load_random_init_pretrained_cast_and_tied(tmp_path: Path) -> None:
    """One pair of processes loads (a) a full fine-tune from a seeded random init, which must equal today's
    seeded init bit for bit (fp32 untied, bf16 tied), (b) a bf16 LoRA base from a pretrained fp32 checkpoint
    with tied embeddings, which must equal the file cast to bf16, stay tied, and get peft's initial adapters,
    and (c) QLoRA from that checkpoint and from a random init: the codes, quantization constants and loss of
    the whole-model quantizing load, and the seeded fp32 base written to ``base/``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    random_dir = _micro(tmp_path / "micro", tied=False)
    tied_dir = _micro(tmp_path / "micro-tied", tied=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tied_dir)).save_pretrained(tied_dir)
    cases = []
    for model_dir, method, init, precision in (
        (random_dir, "full", "random", "fp32"),
        (tied_dir, "lora", "pretrained", "bf16"),
        (tied_dir, "full", "random", "bf16-pure"),
        (tied_dir, "qlora", "pretrained", "bf16"),
        (random_dir, "qlora", "random", "bf16"),
        (tied_dir, "dora", "pretrained", "bf16"),
        (tied_dir, "prefix", "pretrained", "bf16"),
        (tied_dir, "adapter", "pretrained", "bf16"),
        (random_dir, "adapter", "random", "fp32"),
        (tied_dir, "pissa", "pretrained", "bf16"),
        (random_dir, "olora", "random", "fp32"),
    ):
        out = tmp_path / f"{method}-{init}-{precision}-{model_dir.name}"
        out.mkdir()
        cases.append(
            (str(_write(model_dir, out, method, init, precision)), str(out), method, precision, init)
        )
    mp.spawn(_worker, args=(tempfile.mktemp(dir=tmp_path), cases), nprocs=2)

    got = torch.load(Path(cases[0][1]) / "gathered.pt", weights_only=True)["full"]
    want = _seeded(random_dir, torch.float32)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # Tied and bf16: drawn one tensor at a time, the embedding is the seeded one and the head is that parameter.
    res = torch.load(Path(cases[2][1]) / "gathered.pt", weights_only=True)
    want = _seeded(tied_dir, torch.bfloat16)
    assert res["tied"] and res["full"].keys() == want.keys()
    for k in want:
        assert torch.equal(res["full"][k], want[k]), k
    # The QLoRA run from a random init left the fp32 seeded base on rank 0, as the whole-model path saves it.
    base = load_file(str(Path(cases[4][1]) / "base" / "model.safetensors"))
    want = _seeded(random_dir, torch.float32)
    assert base.keys() == want.keys()
    for k in want:
        assert torch.equal(base[k], want[k]), k
    assert AutoConfig.from_pretrained(Path(cases[4][1]) / "base").hidden_size == 64
    assert (Path(cases[4][1]) / "base" / "generation_config.json").is_file()

    on_disk = load_file(str(tied_dir / "model.safetensors"))
    assert "lm_head.weight" not in on_disk  # tied: saved once
    res = torch.load(Path(cases[1][1]) / "gathered.pt", weights_only=True)
    got, prefix = res["full"], "base_model.model."
    assert res["tied"]
    for name, t in got.items():
        if ".lora_A." in name:
            assert t.dtype == torch.float32 and t.abs().sum() > 0
        elif ".lora_B." in name:
            assert t.dtype == torch.float32 and torch.count_nonzero(t) == 0
        else:
            key = name.removeprefix(prefix).replace(".base_layer.", ".")
            assert t.dtype == torch.bfloat16 and torch.equal(t, on_disk[key].to(torch.bfloat16)), name
    assert set(on_disk) == {
        n.removeprefix(prefix).replace(".base_layer.", ".") for n in got if ".lora_" not in n
    }

    # QLoRA: each rank quantized one weight at a time and kept its slice of the codes; gathered, codes, the
    # quantization constants and the loss equal the whole-model quantizing load's, sharded afterwards.
    # DoRA, prefix tuning and bottleneck adapters: every tensor (magnitudes, prefix encoder, bottlenecks,
    # which are initialised from the loaded base or drawn after it) and the loss equal the whole-model load's.
    for case in cases[3:]:
        res = torch.load(Path(case[1]) / "gathered.pt", weights_only=False)
        assert res["full"].keys() == res["old"].keys()
        for name, t in res["full"].items():
            assert torch.equal(_bits(t), _bits(res["old"][name])), name
        assert res["quant_state"].keys() == res["old_quant_state"].keys()
        for name, t in res["quant_state"].items():
            assert torch.equal(t, res["old_quant_state"][name]), name
        assert abs(res["loss"] - res["old_loss"]) <= 1e-6, (case[2], res["loss"], res["old_loss"])
        assert res["tied"] == (case[4] == "pretrained")
        trained = {
            n for n in res["full"] if any(k in n for k in ("magnitude", "prompt_encoder", "bottleneck"))
        }
        if case[2] == "qlora":
            codes = [n for n, t in res["full"].items() if t.dtype == torch.bfloat16 and t.shape[1:] == (1,)]
            assert len(codes) == 2 * 7 and res["quant_state"], (
                codes
            )  # 2 blocks x (q, k, v, o, gate, up, down)
        elif case[2] in ("pissa", "olora"):  # decomposed after the sharded load: B is not zero, A0/B0 kept
            b = [t for n, t in res["full"].items() if ".lora_B." in n]
            assert len(b) == 4 and all(t.abs().sum() > 0 for t in b)
            assert res["initial"].keys() == res["old_initial"].keys() and len(res["initial"]) == 8
            assert all(torch.equal(t, res["old_initial"][n]) for n, t in res["initial"].items())
        else:  # what each method adds, non-trivially initialised
            # adapter: 2 blocks x (attention, MLP) x (down, up) x (weight, bias) + their input gains + the head's, + the embeddings' bottleneck
            assert len(trained) == {"dora": 4, "prefix": 5, "adapter": 21 + 4}[case[2]], trained
            starts_at_zero = ("up.weight", "up.bias", ".gain")
            assert all(res["full"][n].abs().sum() > 0 for n in trained if not n.endswith(starts_at_zero))
            assert all(torch.count_nonzero(res["full"][n]) == 0 for n in trained if n.endswith(".gain"))
