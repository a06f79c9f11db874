"""Expert parallelism in the planner: under ``distributed.ep: 2`` a rank gathers half of a mixture's routed
experts (and reduces half of their gradients), sends its routed rows by all-to-all (bytes and seconds in the
plan), and holds the dispatch's buffers; the walk says what ep does, or would do."""

from __future__ import annotations

from transformers import AutoConfig

from finetune.plan.candidates import evaluate
from finetune.plan.expert_parallel import all_to_all_bytes
from finetune.plan.hardware import Hardware
from finetune.plan.request import Request
from finetune.plan.setting import settle
from finetune.plan.types import Config
from tests.support import arch_model_dir

GPUS = 8


def _setting(tmp_path, ep: int, log: list | None = None):
    model = arch_model_dir(tmp_path / "qwen3_moe", "qwen3_moe")
    config = AutoConfig.from_pretrained(model)
    hw = Hardware("cuda", GPUS, 1, 80 << 30, True, "h100", "nvlink", 450e9, True, gpu_type="h100")
    req = Request(config=config, source=str(model), method="full", strategy="fsdp", precision="bf16", seq_len=64,
                  global_batch_size=16, micro_batch_size=2, ep=ep)
    return settle(req, hw, log)


def test_ep_2_halves_the_experts_a_rank_gathers_and_adds_the_all_to_all(tmp_path) -> None:
    one, two = _setting(tmp_path, 1), _setting(tmp_path, 2)
    plain = evaluate(one, Config("full", "fsdp", 2, False), traced=frozenset())
    split = evaluate(two, Config("full", "fsdp", 2, False), traced=frozenset())
    assert (plain.ep, split.ep) == (1, 2) and split.to_dict()["ep"] == 2
    # the tiny Qwen3-MoE: 2 layers of 8 experts, each expert 3 x 32 x 64 values, gathered in bf16
    experts = 2 * 8 * 3 * 32 * 64 * 2
    assert plain.expert_bytes_per_rank == experts and split.expert_bytes_per_rank == experts // 2
    # every micro-batch (2 rows of 64 tokens, top-2) sends 1/2 of its 256 routed rows of 64 bf16 values off the
    # rank, 4 times (dispatch and combine, forward and backward), in each of the 2 layers; accumulation 1
    rows = 2 * 64 * 2
    assert split.grad_accum_steps == 1
    assert split.ep_comm_bytes_per_step == 4 * (rows * 64 * 2 // 2) * 2 == all_to_all_bytes(
        two.inv.moe, 2, 128, 1, 2, False
    )
    assert plain.ep_comm_bytes_per_step == 0 and split.time.communication > 0
    # the dispatch's sorted, received and returned rows of one layer, in the buffers
    assert split.ep_dispatch_bytes == 3 * rows * 64 * 2
    # FSDP stores 1/8 of every weight either way; what ep halves is the experts' all-gathers and reduce-scatters
    assert split.memory.params == plain.memory.params
    assert split.comm_bytes_per_step < plain.comm_bytes_per_step


def test_the_walk_says_what_ep_does_or_would_do(tmp_path) -> None:
    log: list = []
    _setting(tmp_path, 2, log)
    said = [s.render() for s in log if type(s).__name__ == "ExpertParallelism"]
    assert said and "each rank holds 4 of the 8 routed experts" in said[0]
    log = []
    _setting(tmp_path, 1, log)
    would = [s.render() for s in log if type(s).__name__ == "ExpertParallelism"]
    assert would and would[0].startswith("distributed.ep: 8 would split the 8 routed experts")
