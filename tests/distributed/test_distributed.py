"""Multi-process training through the real CLI on gloo: loss parity of every strategy, multi-node, failure.

The proof of the distributed feature is loss parity: the same recipe (fp32, same global batch,
10 steps) run as one process and as 2 processes under ddp / zero1 / zero2 / fsdp gives the same per-step
losses, gradient norms and saved weights. Runs are shared between assertions (module-scoped, cached by
key), and the model is a 2-block Llama (hidden 64) built from a config with random weights, so that each
2-process run costs little more than its startup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, failure_message, first_cause, launch, torchrun_args
from finetune.errors import UserError
from finetune.train.parallel.distributed import available_cores, threads_per_process
from finetune.train.parallel.parallelize import decoder_blocks
from tests.support import (
    LOSS_RTOL,
    RECIPES,
    STEPS,
    WEIGHT_ATOL,
    clean_env,
    finetune_run,
    free_port,
    max_rel,
    max_weight_diff,
    micro_model_dir,
    parity_recipe,
    step_rows,
    tiny_recipe,
    write_recipe,
)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer with a 2-block, 64-wide config (random weights from the seed)."""
    return micro_model_dir(
        tmp_path_factory.mktemp("micro-llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )


class Runs:
    """Runs of the CLI, each made once per module and shared by the assertions that need it."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self.done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def get(self, method: str, strategy: str, nproc: int = 1) -> tuple[Path, subprocess.CompletedProcess]:
        """(output dir, process) of ``method`` under ``strategy`` on ``nproc`` processes."""
        key = f"{method}-{strategy}-{nproc}"
        if key not in self.done:
            out = self.root / key
            recipe = write_recipe(self.root / f"{key}.yaml", parity_recipe(self.model_dir, out, method, strategy))
            if nproc == 1:  # the reference: the same launch() the CLI calls, in this process (no startup)
                assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
                proc = subprocess.CompletedProcess([], 0, "", "")
            else:
                proc = finetune_run(recipe, "--nproc", str(nproc))
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            self.done[key] = (out, proc)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, micro_model: Path) -> Runs:
    return Runs(tmp_path_factory.mktemp("dist-runs"), micro_model)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_full_finetune_parity_with_single_process(runs: Runs, strategy: str) -> None:
    single, _ = runs.get("full", "single", 1)
    dist, proc = runs.get("full", strategy, 2)
    want, got = step_rows(single), step_rows(dist)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in got], [r["loss"] for r in want]) <= LOSS_RTOL
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    # The loss moved: parity of a run that learns nothing would prove little.
    assert got[-1]["loss"] < 0.8 * got[0]["loss"]
    assert max_weight_diff(dist / "model.safetensors", single / "model.safetensors") <= WEIGHT_ATOL
    # The same Hugging Face directory a single process writes (FSDP's class prefix is not saved).
    assert json.loads((dist / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    plan = json.loads((dist / "plan.json").read_text())["chosen"]
    assert (plan["strategy"], plan["nproc"], plan["grad_accum_steps"]) == (strategy, 2, 2)
    # Rank 0 alone prints: one progress line per step and one summary, not two.
    assert proc.stdout.count("done:") == 1
    assert sum(line.startswith(f"step {STEPS}/{STEPS}") for line in proc.stdout.splitlines()) == 1


def test_lora_under_fsdp_parity(runs: Runs) -> None:
    single, _ = runs.get("lora", "single", 1)
    dist, _ = runs.get("lora", "fsdp", 2)
    assert max_rel([r["loss"] for r in step_rows(dist)], [r["loss"] for r in step_rows(single)]) <= LOSS_RTOL
    # The adapter directory, gathered from the shards: only the LoRA weights, as a single run saves them.
    a = load_file(dist / "adapter_model.safetensors")
    assert len(a) == 2 * 2 * 2 and all("lora_" in k for k in a)  # 2 blocks x (q, v) x (A, B)
    assert max_weight_diff(dist / "adapter_model.safetensors", single / "adapter_model.safetensors") <= WEIGHT_ATOL
    assert not (dist / "model.safetensors").exists()


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_qlora_parity(runs: Runs, strategy: str) -> None:
    """QLoRA under ddp, and under zero2 and fsdp, where the 4-bit weights themselves are sharded and
    all-gathered (one storage rule for every FSDP2 strategy: the execution spec's)."""
    single, _ = runs.get("qlora", "single", 1)
    dist, _ = runs.get("qlora", strategy, 2)
    losses = [r["loss"] for r in step_rows(dist)]
    assert len(losses) == STEPS
    assert max_rel(losses, [r["loss"] for r in step_rows(single)]) <= LOSS_RTOL
    assert max_weight_diff(dist / "adapter_model.safetensors", single / "adapter_model.safetensors") <= WEIGHT_ATOL


def _assert_step_parity(runs: Runs, method: str, strategy: str) -> tuple[Path, Path]:
    """The 2-process run's losses and gradient norms equal the single process's, and the loss went down;
    returns (single, distributed) output directories."""
    single, _ = runs.get(method, "single", 1)
    dist, _ = runs.get(method, strategy, 2)
    got, want = step_rows(dist), step_rows(single)
    assert len(got) == STEPS
    assert max_rel([r["loss"] for r in got], [r["loss"] for r in want]) <= LOSS_RTOL
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    assert got[-1]["loss"] < got[0]["loss"]
    return single, dist


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", ["prefix", "adapter"])
def test_prefix_and_bottleneck_adapter_parity(runs: Runs, method: str, strategy: str) -> None:
    """Prefix tuning (its encoder in FSDP's root unit) and bottleneck adapters (inside each decoder layer's
    unit) give the single process's losses and trained weights under ddp and fsdp on 2 processes."""
    single, dist = _assert_step_parity(runs, method, strategy)
    weights = "adapter_model.safetensors" if method == "prefix" else "bottleneck_adapter.safetensors"
    assert max_weight_diff(dist / weights, single / weights) <= WEIGHT_ATOL


def test_prompt_tuning_parity_under_fsdp(runs: Runs) -> None:
    """Prompt tuning (its virtual token embeddings in FSDP's root unit, gathered for the save) gives the single
    process's losses, saved embeddings, eval loss and greedy answers under fsdp on 2 processes: generation's
    forward runs through the root unit's gather."""
    single, dist = _assert_step_parity(runs, "prompt", "fsdp")
    adapter = "adapter_model.safetensors"
    assert list(load_file(dist / adapter)) == ["prompt_embeddings"]
    assert max_weight_diff(dist / adapter, single / adapter) <= WEIGHT_ATOL

    def final_eval(out: Path) -> dict:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "eval_exact_match" in r][-1]

    got, want = final_eval(dist), final_eval(single)
    assert max_rel([got["eval_loss"]], [want["eval_loss"]]) <= LOSS_RTOL
    assert got["eval_exact_match"] == want["eval_exact_match"]


# olora under ddp (each rank decomposes the whole model, rank 0's result is broadcast), pissa under fsdp (built
# on meta, each weight gathered and decomposed once after the sharded load; zero2 loads the same way): one row
# per load path, each init once (scripts/pissa_parity.py runs every pair).
@pytest.mark.parametrize(("init", "strategy"), [("olora", "ddp"), ("pissa", "fsdp")])
def test_pissa_and_olora_parity(runs: Runs, init: str, strategy: str) -> None:
    """lora.init pissa/olora on 2 processes give the single process's losses and the same saved plain LoRA
    (rank 2r) of the original base."""
    single, dist = _assert_step_parity(runs, init, strategy)
    assert json.loads((dist / "adapter_config.json").read_text())["r"] == 8  # [A; A0], [B, -B0]
    adapter = "adapter_model.safetensors"
    assert max_weight_diff(dist / adapter, single / adapter) <= WEIGHT_ATOL


def test_pissa_under_fsdp_merges_onto_the_original_base_and_resumes_exactly(
    runs: Runs, tmp_path: Path
) -> None:
    """The fsdp run's saved adapter (gathered from the shards, with the kept initial adapter) merged onto the
    original base gives the single-process run's merged logits; and a resume from its step-5 checkpoint,
    which redoes the decomposition (the initial adapter is not in the checkpoint), saves the same adapter."""
    from finetune.merge import merge

    single, _ = runs.get("pissa", "single", 1)
    dist, _ = runs.get("pissa", "fsdp", 2)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7, 3, 42], [2, 8, 16, 32, 64, 120, 4, 11, 19, 27]])

    def logits(model_dir: Path) -> torch.Tensor:
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits

    merge(dist, tmp_path / "merged-fsdp")
    merge(single, tmp_path / "merged-single")
    merged = logits(tmp_path / "merged-fsdp")
    assert (merged - logits(tmp_path / "merged-single")).abs().max().item() <= 1e-4
    assert (merged - logits(dist / "base")).abs().max().item() > 1e-3  # the training changed the model

    resumed = tmp_path / "resumed"
    shutil.copytree(dist, resumed)
    from finetune.train.checkpoint import checkpointer as ck

    assert [s for s, _ in ck.list_checkpoints(resumed)] == [5, 10]
    shutil.rmtree(dict(ck.list_checkpoints(resumed))[10])
    (resumed / "adapter_model.safetensors").unlink()
    recipe = parity_recipe(runs.model_dir, resumed, "pissa", "fsdp")
    proc = finetune_run(write_recipe(tmp_path / "resume.yaml", recipe), "--nproc", "2", "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resumed from" in proc.stdout + proc.stderr
    assert max_rel([r["loss"] for r in step_rows(resumed)], [r["loss"] for r in step_rows(dist)]) <= 1e-6
    assert max_weight_diff(resumed / "adapter_model.safetensors", dist / "adapter_model.safetensors") <= 1e-6


def _decompose_and_broadcast(rank: int, port: int, out: Path) -> None:
    """One rank of test_ddp_ranks_share_rank_0s_decomposition: rank 1 holds another valid decomposition."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.model.adapters import LORA_INIT_ATTR
    from finetune.model.methods import inject
    from finetune.spec import AdapterSpec
    from finetune.train.model.build import broadcast_decomposed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    spec = AdapterSpec(kind="lora", r=2, alpha=4.0, target_modules=("q_proj", "v_proj"), init="pissa")
    model = inject(LlamaForCausalLM(config), spec)
    initial = getattr(model, LORA_INIT_ATTR)
    if rank == 1:  # the SVD's sign ambiguity: -u, -v is as valid; and a residual off in its last bit
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in initial:
                    p.neg_()
                    initial[name].neg_()
                elif "base_layer" in name:
                    p.mul_(1 + 1e-7)
    broadcast_decomposed(model)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n or "base_layer" in n}
    state.update({f"initial.{n}": t for n, t in initial.items()})
    torch.save(state, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ddp_ranks_share_rank_0s_decomposition(tmp_path: Path) -> None:
    """Under ddp every rank decomposes its own copy; after broadcast_decomposed (real gloo, 2 processes) the
    residual base weights, A, B and the kept initial adapter are bit-identical to rank 0's, even where rank 1
    had another valid decomposition (opposite singular-vector signs) and a residual off in its last bit."""
    import torch.multiprocessing as mp

    mp.spawn(_decompose_and_broadcast, args=(free_port(), tmp_path), nprocs=2)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0.keys() == r1.keys() and len(r0) == 2 * 2 * 5  # 2 layers x (q, v) x (base, A, B, initial A, B)
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert any(r0[k].abs().max() > 0 for k in r0 if ".lora_B." in k)  # pissa's B is not zero


def test_two_nodes_on_localhost_match_one_node(runs: Runs, tmp_path: Path) -> None:
    """Two launchers (--nnodes 2 --nproc 1) rendezvous on 127.0.0.1 and train as one 2-process node does."""
    one_node, _ = runs.get("full", "ddp", 2)
    out = tmp_path / "two-nodes"
    recipe = write_recipe(tmp_path / "r.yaml", parity_recipe(runs.model_dir, out, "full", "ddp"))
    endpoint = f"127.0.0.1:{free_port()}"
    env = clean_env(OMP_NUM_THREADS="1")  # two launchers share this machine's cores
    cmd = [sys.executable, "-m", "finetune", "run", str(recipe), "--nnodes", "2", "--nproc", "1",
           "--rdzv-endpoint", endpoint]
    nodes = [
        subprocess.Popen([*cmd, "--node-rank", str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
        for k in (0, 1)
    ]
    outputs = [p.communicate(timeout=600) for p in nodes]
    for p, (o, e) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    got = [r["loss"] for r in step_rows(out)]
    assert len(got) == STEPS
    assert max_rel(got, [r["loss"] for r in step_rows(one_node)]) <= LOSS_RTOL
    assert max_weight_diff(out / "model.safetensors", one_node / "model.safetensors") <= WEIGHT_ATOL
    assert sum(o.count("done:") for o, _ in outputs) == 1  # one rank 0 over both nodes


def _processes_with_env(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def test_failing_rank_ends_the_job_with_its_message(runs: Runs, tmp_path: Path) -> None:
    """Rank 1 raises at step 2 while rank 0 waits in a collective: the job ends at once, naming rank 1."""
    recipe = write_recipe(tmp_path / "r.yaml", parity_recipe(runs.model_dir, tmp_path / "out", "full", "fsdp"))
    marker = f"FINETUNE_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = clean_env(FINETUNE_FAIL_RANK="1", FINETUNE_FAIL_AT_STEP="2", **{key: value})
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    first_step_at = None
    for line in proc.stdout:  # rank 0's progress: step 1 is done, rank 1 fails as step 2 starts
        if line.startswith("step 1/"):
            first_step_at = time.monotonic()
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    ended_at = time.monotonic()
    assert first_step_at is not None, stderr[-4000:]
    assert proc.returncode == 1
    assert ended_at - first_step_at < 15, f"took {ended_at - first_step_at:.1f}s to stop"
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: rank 1 failed: InjectedFailure: injected failure at step 2 (FINETUNE_FAIL_RANK=1)"]
    assert not _processes_with_env(marker)  # no worker left behind
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_user_error_on_every_rank_reports_one_line_exit_2(tmp_path: Path, micro_model: Path) -> None:
    """A bad recipe value found inside the workers is one user error (exit 2), not a traceback per rank."""
    rows = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:20]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([*rows[:13], '{"instruction": "Reverse", "input": "ab"}', *rows[13:]]) + "\n")
    rec = parity_recipe(micro_model, tmp_path / "out", "full", "ddp")
    rec["data"]["train"] = str(data)
    proc = finetune_run(write_recipe(tmp_path / "r.yaml", rec), "--nproc", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank "), proc.stderr[-3000:]
    assert "train.jsonl:14" in errors[0] and "output" in errors[0]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ no processes


def test_torchrun_arguments_and_flag_errors(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    args = torchrun_args(spec, LaunchOptions(nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="host0:29500", max_restarts=3),
                         run_id="x")
    for want in ("--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=host0:29500", "--max-restarts=3", "--rdzv-id=x"):
        assert want in args
    assert "--rdzv-conf=is_host=false,join_timeout=300" in args
    assert args[-3:] == ["-m", "finetune.train.runtime.worker", str(spec)]
    with pytest.raises(UserError, match="--rdzv-endpoint: a run on several nodes needs"):
        torchrun_args(spec, LaunchOptions(nproc=1, nnodes=2, node_rank=0, rdzv_endpoint=None, max_restarts=0), run_id="x")
    with pytest.raises(UserError, match=r"--node-rank: 2 is not in 0\.\.1"):
        torchrun_args(spec, LaunchOptions(nproc=1, nnodes=2, node_rank=2, rdzv_endpoint="h:1", max_restarts=0), run_id="x")


def test_threads_share_the_cores() -> None:
    cores = available_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert threads_per_process(1) == cores
    assert threads_per_process(2) == max(1, cores // 2)
    assert threads_per_process(4 * cores) == 1


def test_first_cause_prefers_the_rank_that_recorded_an_error(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    err = tmp_path / "err1.json"
    err.write_text(json.dumps({"message": {"message": "UserError: data.train: bad row 3",
                                           "extraInfo": {"py_callstack": "", "timestamp": "100"}}}))
    lost_peer = ProcessFailure(local_rank=0, pid=10, exitcode=75, error_file=str(tmp_path / "none.json"))
    cause = ProcessFailure(local_rank=1, pid=11, exitcode=2, error_file=str(err))
    rank, failure = first_cause({0: lost_peer, 1: cause})
    assert rank == 1 and failure_message(failure) == "data.train: bad row 3"
    assert failure_message(lost_peer) == "exited with code 75 (its output above has the details)"


def test_a_rank_killed_after_recording_an_agreed_error_keeps_its_exit_status(tmp_path: Path) -> None:
    """Every rank records an agreed error (a failed checkpoint save); the agent SIGTERMs rank 0 after it
    recorded and before it exited, while rank 1 exited with 2: `finetune run` exits 2, as one process would."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from finetune.commands.run import failure_exit_code

    def recorded(rank: int, exitcode: int, message: str) -> ProcessFailure:
        err = tmp_path / f"err{rank}.json"
        err.write_text(json.dumps({"message": {"message": f"UserError: {message}",
                                               "extraInfo": {"py_callstack": "", "timestamp": "100"}}}))
        return ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=exitcode, error_file=str(err))

    failures = {0: recorded(0, -15, "output.dir: disk full"), 1: recorded(1, 2, "output.dir: disk full")}
    rank, failure = first_cause(failures)
    assert rank == 0 and failure_exit_code(failure, failures) == 2
    other = {0: failures[0], 1: recorded(1, 3, "another error")}
    assert failure_exit_code(other[0], other) == 1  # no rank exited with this error by itself


def test_decoder_blocks_found_for_any_architecture() -> None:
    """FSDP units come from _no_split_modules: Llama, Qwen2, GPT-2 and Gemma2 blocks, no per-model table."""
    from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig, Qwen2Config

    small = {"vocab_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
             "hidden_size": 32, "intermediate_size": 64, "head_dim": 16}
    configs = {
        "LlamaDecoderLayer": LlamaConfig(**small),
        "Qwen2DecoderLayer": Qwen2Config(**small),
        "Gemma2DecoderLayer": Gemma2Config(**small),
        "GPT2Block": GPT2Config(vocab_size=64, n_layer=3, n_head=2, n_embd=32),
    }
    for block_class, config in configs.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        blocks = decoder_blocks(model)
        assert [type(b).__name__ for b in blocks] == [block_class] * 3


def test_single_strategy_on_two_processes_is_refused(tmp_path: Path, micro_model: Path) -> None:
    """`single` on 2 processes would train two unsynchronised models: refused before any worker starts."""
    recipe = write_recipe(tmp_path / "r.yaml", parity_recipe(micro_model, tmp_path / "out", "full", "single"))
    with pytest.raises(UserError, match=r"distributed.strategy: `single` trains one process but 2 were asked"):
        launch(str(recipe), [], LaunchOptions(nproc=2))
    assert not (tmp_path / "out").exists()


def test_fsdp_saves_the_trained_weights_after_an_evaluation(tmp_path: Path, micro_model: Path) -> None:
    """The final evaluation's forward leaves FSDP2's root unit (embeddings, final norm, head) gathered; the saved
    model still holds the trained weights, equal to one process's."""
    saved = {}
    for strategy, nproc in (("single", "1"), ("fsdp", "2")):
        out = tmp_path / strategy
        recipe = tiny_recipe(out, model={"path": str(micro_model), "init": "random"}, distributed={"strategy": strategy})
        recipe["train"]["max_steps"] = 2
        proc = finetune_run(write_recipe(tmp_path / f"{strategy}.yaml", recipe), "--nproc", nproc)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "final eval" in proc.stdout
        saved[strategy] = out / "model.safetensors"
    assert max_weight_diff(saved["single"], saved["fsdp"]) <= WEIGHT_ATOL
