"""Packing (logits of each packed document == logits of the document alone), collation, and the deterministic
batch stream (order a pure function of (seed, epoch); union over ranks == the single-process global batch)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from finetune.errors import UserError
from finetune.objectives.loss import IGNORE_INDEX, causal_lm_loss
from finetune.train.data import BatchStream, Example, collate, pack
from tests.support import TINY_MODEL


def docs(lengths: list[int], seed: int = 0) -> list[Example]:
    """Documents of the given lengths with random ids; labels on every token but the first two."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(3, 259) for _ in range(n)]
        out.append(Example(ids, [IGNORE_INDEX, IGNORE_INDEX, *ids[2:]]))
    return out


def test_pack_keeps_every_token_and_restarts_positions():
    samples = docs([30, 5, 12, 64, 7, 40, 3, 20, 33, 9])
    rows = pack(samples, 64)
    assert all(len(r.input_ids) <= 64 for r in rows)
    assert len(rows) == 4  # 223 tokens in 64-token rows: best-fit decreasing reaches the minimum
    pieces = []
    for r in rows:
        starts = [i for i, p in enumerate(r.position_ids) if p == 0] + [len(r.input_ids)]
        for a, b in itertools.pairwise(starts):
            assert r.position_ids[a:b] == list(range(b - a))
            pieces.append((r.input_ids[a:b], r.labels[a:b]))
    assert sorted(pieces) == sorted((s.input_ids, s.labels) for s in samples)
    assert pack(samples, 64) == rows  # deterministic


def test_collate_padded_and_packed():
    a, b = docs([3, 5])
    padded = collate([a, b], pad_id=0)
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert padded["input_ids"][0].tolist() == [*a.input_ids, 0, 0]
    assert padded["labels"][0].tolist() == [*a.labels, IGNORE_INDEX, IGNORE_INDEX]
    row = pack([a, b], 16)[0]
    short = pack(docs([2]), 16)[0]
    batch = collate([row, short], pad_id=0)
    assert set(batch) == {"input_ids", "labels", "position_ids", "num_tokens"}  # no attention mask: packed
    assert int(batch["num_tokens"]) == 3 + 5 + 2 and int(padded["num_tokens"]) == 3 + 5  # padding not counted
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert batch["labels"][1, 2:].tolist() == [IGNORE_INDEX] * 6


def tiny_model(attn: str, arch: str = "llama") -> torch.nn.Module:
    if arch == "qwen2":
        config = Qwen2Config(
            vocab_size=264,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        config = LlamaConfig(**json.loads((TINY_MODEL / "config.json").read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("attn,arch", [("sdpa", "llama"), ("eager", "llama"), ("sdpa", "qwen2")])
def test_packed_logits_equal_each_document_alone(attn, arch):
    """Attention never crosses a document boundary inside a packed row (tiny Llama, random init, fp32)."""
    from transformers.masking_utils import find_packed_sequence_indices

    model = tiny_model(attn, arch)
    samples = docs([7, 12, 5, 9], seed=1)
    row = pack(samples, 40)[0]
    assert len(row.input_ids) == 33
    batch = collate([row, pack(docs([20]), 40)[0]], pad_id=0)  # second row: padded to 33
    assert find_packed_sequence_indices(batch["position_ids"]) is not None  # transformers sees the packing
    with torch.no_grad():
        assert_documents_apart(model, batch, row)


def assert_documents_apart(model: torch.nn.Module, batch: dict, row) -> torch.Tensor:
    """The packed logits of ``batch``'s first row (``row``) equal each of its documents run alone within 1e-5,
    and differ from the same row without restarting positions (so the check can fail); returns the logits."""
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
    for a, b in itertools.pairwise(starts):
        alone = model(input_ids=torch.tensor([row.input_ids[a:b]]), use_cache=False).logits
        torch.testing.assert_close(packed[0, a:b], alone[0], atol=1e-5, rtol=1e-5)
    mixed = model(input_ids=batch["input_ids"][:1], use_cache=False).logits
    assert (mixed[0, starts[1] : starts[2]] - packed[0, starts[1] : starts[2]]).abs().max() > 1e-2
    return packed


@pytest.mark.parametrize(
    "path",
    [
        "cpu-training",  # finetune's CPU path: the BlockMask evaluated densely by sdpa (finetune.model.flex)
        # torch's compiled CPU kernel, forward only (compiling takes about a minute)
        pytest.param("compiled-kernel", marks=pytest.mark.slow),
    ],
)
def test_flex_packed_logits_equal_each_document_alone(path, monkeypatch):
    """flex_attention: transformers' document BlockMask from the packed position ids keeps documents apart."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    from finetune.model import flex

    flex.install()
    if path == "compiled-kernel":  # transformers' own flex attention (no gradients: none on CPU)
        monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention", flex_attention_forward)
    model = tiny_model("flex_attention")
    samples = docs([7, 12, 5, 9], seed=1)
    row = pack(samples, 40)[0]
    batch = collate([row, pack(docs([20]), 40)[0]], pad_id=0)
    grad = path == "cpu-training"
    for p in model.parameters():
        p.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        packed = assert_documents_apart(model, batch, row)
        # the second row (one document, padded): causal inside it, like the same document alone
        alone = model(input_ids=batch["input_ids"][1:, :20], use_cache=False).logits
        torch.testing.assert_close(packed[1, :20], alone[0], atol=1e-5, rtol=1e-5)
    if grad:  # and the gradient flows through the CPU path
        packed.float().pow(2).mean().backward()
        assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_packed_loss_equals_the_sum_of_losses_alone():
    model = tiny_model("sdpa")
    samples = docs([7, 12, 5, 9], seed=2)
    with torch.no_grad():
        loss_packed, n_packed = causal_lm_loss(model, collate(pack(samples, 40), pad_id=0))
        loss_padded, n_padded = causal_lm_loss(model, collate(samples, pad_id=0))
    assert int(n_packed) == int(n_padded) == sum(n - 2 for n in (7, 12, 5, 9))  # labels from token 2 on
    torch.testing.assert_close(loss_packed, loss_padded, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------------ the stream


def numbered(n: int, packed: bool = False) -> list[Example]:
    """Samples whose first id is their index, so a batch's content can be read back."""
    return [Example([i, 1, 2], [i, 1, 2], [0, 1, 2] if packed else None) for i in range(n)]


def sample_ids(micro_batches: list[dict]) -> list[int]:
    return [int(x) for mb in micro_batches for x in mb["input_ids"][:, 0]]


def test_order_is_a_pure_function_of_seed_and_epoch():
    s1, s2 = BatchStream(numbered(50), 8, seed=3, pad_id=0), BatchStream(numbered(50), 8, seed=3, pad_id=0)
    assert s1.steps_per_epoch == 6
    assert s1.order(0) == s2.order(0) and s1.order(1) == s2.order(1)
    assert s1.order(0) != s1.order(1)
    assert BatchStream(numbered(50), 8, seed=4, pad_id=0).order(0) != s1.order(0)
    assert sorted(s1.order(0)) == list(range(50))
    first = sample_ids(s1.micro_batches(1, 2, rank=0, world_size=1, micro_batch_size=8))
    assert first == s1.order(1)[16:24]


@pytest.mark.parametrize("world_size,micro", [(2, 2), (4, 1), (8, 1)])
def test_union_over_ranks_is_the_single_process_batch(world_size, micro):
    stream = BatchStream(numbered(40), 8, seed=0, pad_id=0)
    for epoch in (0, 1):
        for step in range(stream.steps_per_epoch):
            single = sample_ids(stream.micro_batches(epoch, step, rank=0, world_size=1, micro_batch_size=8))
            union = []
            for rank in range(world_size):
                mbs = stream.micro_batches(
                    epoch, step, rank=rank, world_size=world_size, micro_batch_size=micro
                )
                assert len(mbs) == 8 // world_size // micro
                union += sample_ids(mbs)
            assert union == single


def test_packed_stream_gives_position_ids_and_padding_fraction():
    stream = BatchStream(numbered(16, packed=True), 4, seed=0, pad_id=0)
    mb = stream.micro_batches(0, 0, rank=1, world_size=2, micro_batch_size=2)[0]
    assert set(mb) == {"input_ids", "labels", "position_ids", "num_tokens"}
    assert stream.padding_fraction(micro_batch_size=2) == 0.0
    uneven = [Example([1] * n, [1] * n) for n in (2, 4, 2, 4)]
    # micro-batches of 2 padded to 4: 4 of 16 tokens are padding, in any order
    assert BatchStream(uneven, 4, seed=0, pad_id=0).padding_fraction(micro_batch_size=4) == 0.25


def test_position_state_round_trip_and_refusal():
    stream = BatchStream(numbered(40), 8, seed=0, pad_id=0)
    state = json.loads(json.dumps(stream.position_state(3, 2)))
    again = BatchStream(numbered(40), 8, seed=0, pad_id=0)
    assert again.restore_position(state) == (3, 2)
    with pytest.raises(UserError, match="--resume: the training data"):
        BatchStream(numbered(40), 8, seed=1, pad_id=0).restore_position(state)
    with pytest.raises(UserError, match="--resume: the training data"):
        BatchStream(numbered(41), 8, seed=0, pad_id=0).restore_position(state)


def test_batch_errors():
    with pytest.raises(UserError, match=r"train.global_batch_size: 8 is larger than the 5 packed rows"):
        BatchStream(numbered(5, packed=True), 8, seed=0, pad_id=0)
    with pytest.raises(UserError, match=r"train.global_batch_size: 8 is not divisible by the 3 processes"):
        BatchStream(numbered(16), 8, seed=0, pad_id=0).micro_batches(
            0, 0, rank=0, world_size=3, micro_batch_size=1
        )
