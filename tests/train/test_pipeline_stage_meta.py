"""The pipeline stages' static shapes (finetune/train/parallel/pipeline.py: stage_meta_args), which let torch's
PipelineStage skip the first step's shape inference (whose autograd.grad the CPU memory probe's hooks refuse)."""

from __future__ import annotations

import torch

from finetune.spec import execution_spec
from finetune.train.parallel.pipeline import stage_meta_args


def _spec(method: str, precision: str, tp: int = 1, sequence_parallel: bool = False):
    return execution_spec(method, "fsdp", precision, checkpointing=False, world_size=4 * tp, tp=tp, pp=2,
                          pp_layers=(2, 2), sequence_parallel=sequence_parallel)


def test_first_stage_takes_ids_and_the_last_gives_the_loss() -> None:
    spec = _spec("full", "fp32")
    first, last = stage_meta_args(spec, 0, 2, 4, 128, 256), stage_meta_args(spec, 1, 2, 4, 128, 256)
    assert first["input_args"].shape == (4, 128) and first["input_args"].dtype == torch.long
    assert first["output_args"].shape == (4, 128, 256) and first["output_args"].dtype == torch.float32
    assert first["output_args"].requires_grad  # its gradient comes back from the next stage
    assert last["input_args"].shape == (4, 128, 256) and last["output_args"].shape == ()
    assert all(t.device.type == "meta" for a in (first, last) for t in a.values())


def test_hidden_states_are_the_tp_ranks_rows_in_the_residual_streams_dtype() -> None:
    sp = stage_meta_args(_spec("full", "bf16", tp=2, sequence_parallel=True), 1, 3, 2, 128, 256)
    assert sp["input_args"].shape == (2, 64, 256) and sp["output_args"].shape == (2, 64, 256)
    whole = stage_meta_args(_spec("full", "bf16", tp=2), 1, 3, 2, 128, 256)
    assert whole["input_args"].shape == (2, 128, 256)
    # FSDP2 computes bf16 full fine-tuning in bf16 (fp32 masters): the residual stream crosses the stages in bf16
    assert sp["input_args"].dtype == torch.bfloat16
    assert stage_meta_args(_spec("full", "fp32"), 1, 2, 1, 8, 16)["input_args"].dtype == torch.float32


def test_row_buckets_halve_the_widest_and_keep_sequence_shards_even() -> None:
    from finetune.train.parallel.pipeline import row_buckets

    assert row_buckets(2048, 1) == (2048,)
    assert row_buckets(2048, 4) == (256, 512, 1024, 2048)
    assert row_buckets(100, 3, multiple=4) == (28, 52, 100)  # ceil(25) -> 28, ceil(50) -> 52: multiples of tp 4
    assert row_buckets(5, 8) == (1, 2, 3, 5)  # no width twice


def test_a_step_is_padded_to_the_narrowest_width_that_holds_its_rows() -> None:
    """Token ids with the pad id and labels ignored, every micro-batch of a step to one width; padding then
    shifting is shifting then padding (the stages' targets are one process's); packed rows are refused."""
    import pytest

    from finetune.errors import UserError
    from finetune.objectives.loss import IGNORE_INDEX, shifted_labels
    from finetune.train.parallel.pipeline import Pipeline, row_buckets

    pipe = Pipeline(torch.nn.Identity(), [0], 2, None, row_buckets(88, 2), pad_id=7, sequence_parallel=False)  # type: ignore[arg-type]

    def mb(width: int, rows: int = 2) -> dict[str, torch.Tensor]:
        ids = torch.arange(rows * width).reshape(rows, width) + 10
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    narrow = pipe.pad([mb(43), mb(30)])
    assert [m["input_ids"].shape for m in narrow] == [(2, 44), (2, 44)]
    wide = pipe.pad([mb(45), mb(12)])
    assert [m["input_ids"].shape[1] for m in wide] == [88, 88]
    short = wide[1]
    assert (short["input_ids"][:, 12:] == 7).all() and (short["labels"][:, 12:] == IGNORE_INDEX).all()
    original = mb(12)
    assert torch.equal(short["input_ids"][:, :12], original["input_ids"])
    padded_then_shifted = shifted_labels(short)
    shifted_then_padded = torch.nn.functional.pad(shifted_labels(original), (0, 76), value=IGNORE_INDEX)
    assert torch.equal(padded_then_shifted, shifted_then_padded)
    packed = {**mb(20), "position_ids": torch.arange(20).repeat(2, 1)}
    with pytest.raises(UserError, match=r"data\.packing: packed rows cannot cross pipeline stages"):
        pipe.pad([packed])
