"""FSDP2 internals on 2 gloo processes: mixed precision policy, fp16 loss scaling across shards, full state dict.

One spawned pair of processes (no CLI) wraps a 2-block Llama with finetune.train.parallel.parallelize.parallelize for
``fsdp`` + fp16 + activation checkpointing and checks what torch does with it; then a tied-embedding GPT-2
under fp32 fsdp, whose gathered gradients must equal a single process's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from finetune.spec import execution_spec
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import decoder_blocks, full_state_dict, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    spec = execution_spec("full", "fsdp", "fp16", checkpointing=True, world_size=world)
    ctx = DistContext(rank, world, rank, torch.device("cpu")).laid_out(spec)  # FSDP2 over every rank
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full_shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    model = parallelize(model, spec, ctx)
    seen: list[str] = []
    block = decoder_blocks(model)[0]
    block.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    results = []
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if step == 0 and rank == 1:
            params[0].grad.to_local()[0, 0] = math.inf  # only rank 1's shard overflows
        before = [p.detach().to_local().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, params, strict=True))
        results.append({"changed": changed, "scale": scaler.get_scale()})
    state = full_state_dict(model, ctx)
    record = {
        "compute_dtype": seen[0],
        "sharded_dtype": str(params[0].dtype),
        "sharded_rows": params[0].to_local().shape[0],
        "checkpointing": bool(getattr(block, "gradient_checkpointing", False)),
        "steps": results,
        "state_shapes": {k: list(v.shape) for k, v in state.items()},
        "state_dtypes": sorted({str(v.dtype) for v in state.values()}),
        "full_shapes": full_shapes,
    }
    record["gpt2"] = _gpt2_fsdp_grads_match(ctx)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    # Under load, about one spawned process in eight aborted *after* this point, in C++ static destructors at
    # interpreter exit ("terminate called without an active exception", no Python frame): a teardown issue of
    # this mp.spawn + file:// store harness (0 of 8 loaded `finetune run --nproc 2` fsdp runs did it). Every
    # result is written above; leave without the destructors (0 aborts in 16 loaded runs).
    import os

    os._exit(0)


def _gpt2_fsdp_grads_match(ctx) -> dict:
    """GPT-2 (other block class, tied embeddings) under fsdp: the sharded gradients are the average over ranks."""
    import copy

    from transformers import AutoModelForCausalLM, GPT2Config

    from finetune.spec import execution_spec
    from finetune.train.parallel.parallelize import decoder_blocks, parallelize

    torch.manual_seed(1)
    config = GPT2Config(vocab_size=64, n_layer=2, n_head=2, n_embd=32, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)  # no dropout: the two computations must see the same function
    model = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + r)) for r in range(2)]
    ref_loss = sum(reference(input_ids=b, labels=b).loss for b in batches) / 2
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    blocks = [type(b).__name__ for b in decoder_blocks(model)]
    model = parallelize(model, execution_spec("full", "fsdp", "fp32", checkpointing=False, world_size=2), ctx)
    mine = batches[ctx.rank]
    model(input_ids=mine, labels=mine).loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        worst = max(worst, (p.grad.full_tensor() - ref_grads[name]).abs().max().item())
    return {"blocks": blocks, "max_grad_diff": worst}


def test_fsdp_fp16_policy_scaler_and_full_state_dict(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        # Parameters are stored (sharded) in fp32 and gathered in fp16 for compute: MixedPrecisionPolicy.
        assert (r["sharded_dtype"], r["compute_dtype"]) == ("torch.float32", "torch.float16")
        assert r["sharded_rows"] == 32  # the 64-row embedding split over 2 ranks
        assert r["checkpointing"]
        # Rank 1's overflow is seen by both ranks: both skip step 1 and halve the scale; step 2 updates.
        assert r["steps"] == [{"changed": False, "scale": 512.0}, {"changed": True, "scale": 512.0}]
    # The full state dict is gathered on rank 0 (full shapes, fp32 masters) and empty elsewhere.
    assert r0["state_shapes"] == r0["full_shapes"] and r0["state_dtypes"] == ["torch.float32"]
    assert r1["state_shapes"] == {}
    # GPT-2's blocks are found the same way, and FSDP's reduce-scatter averages: the gathered gradients equal
    # one process's gradients of the mean loss over both ranks' batches.
    for r in (r0, r1):
        assert r["gpt2"]["blocks"] == ["GPT2Block", "GPT2Block"]
        assert r["gpt2"]["max_grad_diff"] < 1e-6
