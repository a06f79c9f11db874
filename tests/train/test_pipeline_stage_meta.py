"""The pipeline stages' static shapes (finetune/train/pipeline.py: stage_meta_args), which let torch's
PipelineStage skip the first step's shape inference (whose autograd.grad the CPU memory probe's hooks refuse)."""

from __future__ import annotations

import torch

from finetune.spec import execution_spec
from finetune.train.pipeline import stage_meta_args


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
