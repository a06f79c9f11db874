"""The ``finetune`` command line: thin commands that load a recipe and hand off.

Heavy libraries (torch, transformers, peft, datasets) are imported inside the commands that need
them, never here: ``finetune --help`` and ``finetune validate`` stay instant.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from finetune.errors import UserError
from finetune.recipe.locate import shipped_recipes_dir
from finetune.recipe.schema import RecipeError, check_files, load_recipe

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Fine-tune Hugging Face causal LMs from YAML recipes; `finetune plan` predicts memory first.",
)
recipes_app = typer.Typer(add_completion=False, no_args_is_help=False, help="The shipped recipes: ls, cp.")


@app.callback()
def _start() -> None:
    """Before any command: the libraries' chatter silenced (finetune.versions.quiet_library_notes)."""
    from finetune.versions import quiet_library_notes

    quiet_library_notes()


app.add_typer(recipes_app, name="recipes")
err_console = Console(stderr=True, highlight=False)

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a recipe key, value read as YAML: --set train.lr=1e-4 (repeatable)."),
]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Run the Python code a model directory ships (its config's auto_map); off: only transformers' own. "
        "Only this flag turns it on, never a run directory's recipe.",
    ),
]


def _fail(err: Exception) -> None:
    """Print a user error (every line of it) and exit without a traceback."""
    if isinstance(err, RecipeError):
        for p in err.problems:
            err_console.print(f"[bold red]error[/]: {escape(str(p))}", markup=True, soft_wrap=True)
        raise typer.Exit(2)
    # escape: a message may hold brackets (paths, library errors) that rich would read as markup
    err_console.print(f"[bold red]error[/]: {escape(str(err))}", markup=True, soft_wrap=True)
    raise typer.Exit(getattr(err, "exit_code", 2))


@app.command()
def validate(recipe: Annotated[str, typer.Argument(help="Recipe YAML file.")], set_: SetOpt = None) -> None:
    """Check a recipe: schema, types, files. Reports every problem at once (exit code 2)."""
    try:
        loaded = load_recipe(recipe, set_ or [])
        problems = check_files(loaded)
        if problems:
            raise RecipeError(problems)
    except (RecipeError, UserError) as err:
        _fail(err)
    r = loaded.recipe
    typer.echo(f"{loaded.path}: ok (method {r.method}, model {r.model.path}, data {r.data.describe_train()})")


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file.")],
    set_: SetOpt = None,
    nproc: Annotated[
        Optional[int], typer.Option(min=1, help="Processes per node (overrides distributed.nproc).")
    ] = None,
    nnodes: Annotated[
        Optional[int], typer.Option(min=1, help="Number of nodes (default: SLURM's under srun, else 1).")
    ] = None,
    node_rank: Annotated[
        Optional[int], typer.Option(help="This node's rank, 0..nnodes-1 (default: SLURM's node id under srun, else 0).")
    ] = None,
    rdzv_endpoint: Annotated[
        Optional[str],
        typer.Option(
            help="host:port of the rendezvous (node 0) for multi-node runs (default under srun: the first host of "
            "SLURM's node list)."
        ),
    ] = None,
    max_restarts: Annotated[int, typer.Option(help="Restart the job this many times when a worker dies.")] = 0,
    resume: Annotated[
        Optional[str],
        typer.Option(
            help="Resume from a checkpoint directory (checkpoints/step-N); `--resume` alone (or `latest`): the "
            "newest complete one in output.dir; `auto`: that one if there is one, else start the run (a requeued "
            "SLURM job resumes so by itself)."
        ),
    ] = None,
    measure_memory: Annotated[
        bool, typer.Option(help="On CPU, measure peak tensor memory (MemTracker) to compare with the plan.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in an output.dir that holds an earlier run, removing its checkpoints, metrics and model.",
        ),
    ] = False,
    debug_memory: Annotated[
        bool,
        typer.Option(help="On CUDA, record allocations and write a memory snapshot if the run runs out of memory."),
    ] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Never reach the Hugging Face Hub: local files and the cache only.")
    ] = False,
    host_memory: Annotated[
        Optional[str],
        typer.Option(help="Host memory this node gives the run, e.g. 512GiB (default: its MemAvailable)."),
    ] = None,
    ignore_host_memory: Annotated[
        bool,
        typer.Option(
            "--ignore-host-memory",
            help="Run even when the plan needs more host memory per node than the node has.",
        ),
    ] = False,
) -> None:
    """Plan, launch and train: one process, or many through torch.distributed."""
    if offline:
        import os

        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when first imported (below), and by workers
    from finetune.commands.run import LaunchOptions, launch

    options = LaunchOptions(
        nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
        resume=resume, measure_memory=measure_memory, overwrite=overwrite, debug_memory=debug_memory,
        host_memory=host_memory, ignore_host_memory=ignore_host_memory,
    )
    try:
        code = launch(recipe, set_ or [], options)
    except (RecipeError, UserError) as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def merge(
    run_dir: Annotated[
        str,
        typer.Argument(metavar="RUN_OR_ADAPTER_DIR", help="A lora/qlora run's output.dir, or a PEFT adapter directory."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the merged Hugging Face model to.")],
    dtype: Annotated[
        Optional[str], typer.Option(help="bf16, fp16 or fp32 for every floating tensor (default: the base's).")
    ] = None,
    base: Annotated[
        Optional[str], typer.Option(help="Base model directory (default: from the run's recipe.yaml or base/).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    into_dequantized: Annotated[
        bool,
        typer.Option("--into-dequantized", help="QLoRA: fold into the NF4-dequantized weights the run trained against."),
    ] = False,
    push_to_hub: Annotated[
        Optional[str],
        typer.Option("--push-to-hub", metavar="ORG/NAME", help="Upload the merged model with a model card."),
    ] = None,
    public: Annotated[
        bool, typer.Option("--public", help="Create the --push-to-hub repository public (default: private).")
    ] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Fold LoRA/QLoRA adapters into the base weights, streamed shard by shard, into a HF model directory."""
    from finetune.merge import merge as merge_adapter

    try:
        if push_to_hub:
            from finetune.storage.publish import check_push

            check_push("--push-to-hub", push_to_hub)  # before the merge's minutes, not after
        res = merge_adapter(
            run_dir, out, dtype=dtype, base=base, force=force, into_dequantized=into_dequantized,
            trust_remote_code=trust_remote_code,
        )
        if push_to_hub:
            from finetune.storage.publish import push_folder

            card, records = merged_card(Path(run_dir), res.out)
            url = push_folder(
                res.out, push_to_hub, key="--push-to-hub", card=card, files=[*res.files, *records],
                message=f"finetune merge of {Path(run_dir).name}", private=not public,
            )
    except UserError as err:
        _fail(err)
    note = f"; untied {', '.join(res.untied)}" if res.untied else ""
    typer.echo(
        f"merged {res.merged_modules} adapted modules ({res.replaced_tensors} saved tensors) of {run_dir} into "
        f"{res.base}{' (NF4-dequantized)' if res.into_dequantized else ''}: {res.out}, {res.shards} shard(s), "
        f"{res.bytes_written / 2**20:.1f} MiB, dtype {res.dtype}{note}, {res.seconds:.1f}s"
    )
    if push_to_hub:
        typer.echo(f"uploaded to the Hub: {push_to_hub} ({url})")


def merged_card(run_dir: Path, out: Path) -> tuple[str, list[str]]:
    """The merged model's card, and the run's records copied beside it (recipe, plan, memory, metrics) when
    ``run_dir`` is a run's output.dir."""
    import shutil

    from finetune.storage.publish import RUN_RECORDS, model_card

    copied = []
    for name in RUN_RECORDS:
        if (run_dir / name).is_file() and not (out / name).exists():
            shutil.copyfile(run_dir / name, out / name)
            copied.append(name)
    return model_card(out, merged_from=run_dir.name), copied



#: ``chat`` and ``serve``'s model: a run, a merge or any model directory (with --adapter, the base).
RunOrModel = Annotated[
    Optional[str],
    typer.Argument(
        metavar="RUN_OR_MODEL",
        help="A run's output.dir (its model, or its adapter over the base), a merged or any HF model directory; "
        "with --adapter, the base model.",
    ),
]
#: The base the --adapter runs load onto.
AdaptersBase = Annotated[
    Optional[str], typer.Option(help="Base model directory (default: the one the adapters' run trained on).")
]

@app.command()
def chat(
    target: RunOrModel = None,
    adapter: Annotated[
        Optional[list[str]],
        typer.Option(
            "--adapter", "-a", metavar="[NAME=]DIR",
            help="A run or adapter directory to load onto the shared base (repeatable; /adapter NAME switches).",
        ),
    ] = None,
    use: Annotated[
        Optional[str], typer.Option(help="The adapter to start with (default: the first; `base`: none).")
    ] = None,
    base: AdaptersBase = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Answer this one prompt and exit.")] = None,
    input_: Annotated[
        Optional[Path], typer.Option("--input", help="A .jsonl file of prompts to answer (with --output).")
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", help="Write each --input row with its answer here (.jsonl).")
    ] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt (chat templates).")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy (as the run's eval); above: sampled.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: the smallest set of tokens with this mass.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="At most this many tokens per answer.")] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="--input rows per generation batch.")] = 8,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1... (default: cuda when there is one).")] = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Talk to a trained model in the terminal (streamed, with history), or answer --prompt / --input."""
    from finetune.commands.chat import ChatOptions, run_chat

    options = ChatOptions(
        target=target, adapters=list(adapter or []), base=base, use=use, prompt=prompt, input=input_,
        output=output, system=system, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
        seed=seed, batch_size=batch_size, device=device, trust_remote_code=trust_remote_code,
    )
    try:
        code = run_chat(options)
    except UserError as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def serve(
    target: RunOrModel = None,
    adapter: Annotated[
        Optional[list[str]],
        typer.Option(
            "--adapter", "-a", metavar="[NAME=]DIR",
            help="A run or adapter directory to serve over the shared base (repeatable); a request's `model` picks it.",
        ),
    ] = None,
    base: AdaptersBase = None,
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = 8000,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="A request's max_tokens when it gives none.")] = 256,
    engine: Annotated[
        str, typer.Option(help="auto (vLLM where installed with a GPU, else transformers) | transformers | vllm.")
    ] = "auto",
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1... (default: cuda when there is one).")] = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Serve a run or model over OpenAI's chat-completions and completions API (streaming too)."""
    from finetune.commands.serve import ServeOptions, run_serve

    options = ServeOptions(
        target=target, adapters=list(adapter or []), base=base, host=host, port=port, max_new_tokens=max_new_tokens,
        device=device, engine=engine, trust_remote_code=trust_remote_code,
    )
    try:
        code = run_serve(options, say=lambda text: err_console.print(text, markup=False, highlight=False, soft_wrap=True))
    except UserError as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def export(
    run_dir: Annotated[
        str, typer.Argument(metavar="RUN_OR_MODEL", help="A run's output.dir, a merge or a HF model directory.")
    ],
    out: Annotated[Path, typer.Option("--out", help="The .gguf file to write.")],
    format_: Annotated[str, typer.Option("--format", help="gguf (what llama.cpp reads).")] = "gguf",
    dtype: Annotated[str, typer.Option(help="f16 | q8_0 for the weight matrices (norms stay f32).")] = "f16",
    base: Annotated[
        Optional[str], typer.Option(help="Base model directory of an adapter (default: the one its run trained on).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Write a run's model (its LoRA adapters folded in first) as one GGUF file for llama.cpp."""
    from finetune.commands.export import ExportOptions, run_export

    options = ExportOptions(run_dir, out, format_, dtype, base=base, force=force, trust_remote_code=trust_remote_code)
    try:
        result = run_export(options)
    except UserError as err:
        _fail(err)
    typer.echo(result)


@app.command()
def plan(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe YAML file (or use --model).")] = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option(help="Model: catalog name (llama-3.1-8b...), local dir or cached hub id.")] = None,
    method: Annotated[Optional[str], typer.Option(help="auto | full | lora | qlora | prefix | adapter | prompt.")] = None,
    strategy: Annotated[Optional[str], typer.Option(help="auto | single | ddp | zero1 | zero2 | fsdp | hsdp.")] = None,
    tp: Annotated[
        Optional[str], typer.Option(help="Tensor-parallel degree inside a node, or auto (default with --model).")
    ] = None,
    precision: Annotated[Optional[str], typer.Option(help="auto | fp32 | bf16 | fp16 | bf16-pure.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sample (data.max_seq_len).")] = None,
    global_batch_size: Annotated[Optional[int], typer.Option(help="Samples per optimizer step.")] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option(help="Pin the micro-batch size.")] = None,
    lora_r: Annotated[Optional[int], typer.Option(help="LoRA rank.")] = None,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs per node (default: the visible ones).")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(help="Memory per GPU, e.g. 80GiB.")] = None,
    gpu_type: Annotated[Optional[str], typer.Option(help="h100, a100, l4, v100, t4... (memory, bf16 support).")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Number of nodes.")] = None,
    interconnect: Annotated[Optional[str], typer.Option(help="nvlink | pcie | infiniband | ethernet | 200GB/s.")] = None,
    host_memory: Annotated[
        Optional[str], typer.Option(help="Host memory per node, e.g. 512GiB (default: this machine's).")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Predict per-GPU memory of every strategy and pick one by the flowchart (no GPU, no weights)."""
    from finetune.plan.command import PlanOptions, build_plan, without_bitsandbytes
    from finetune.plan.render import plan_json, print_plan

    opts = PlanOptions(
        recipe=recipe, overrides=tuple(set_ or []), model=model, method=method, strategy=strategy,
        precision=precision, seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
        gpus=gpus, gpu_memory=gpu_memory, gpu_type=gpu_type, nodes=nodes, interconnect=interconnect, lora_r=lora_r,
        tp=tp,
        host_memory=host_memory,
    )
    try:
        with without_bitsandbytes():
            result = build_plan(opts)
    except (RecipeError, UserError) as err:
        _fail(err)
    if json_:
        typer.echo(plan_json(result))
    else:
        print_plan(result)


@app.command()
def data(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file.")],
    set_: SetOpt = None,
    show: Annotated[int, typer.Option(min=0, help="Show this many training samples with their trained tokens marked.")] = 2,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON (trained tokens as spans).")] = False,
) -> None:
    """What a run would train on: rows, tokens, trained tokens, truncation, and the first samples with the trained
    tokens marked (tokenizer only: no GPU, no weights)."""
    from finetune.commands.data import DataOptions, run_data

    try:
        code = run_data(DataOptions(recipe, list(set_ or []), show=show, as_json=json_))
    except (RecipeError, UserError) as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def slurm(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file.")],
    nodes: Annotated[int, typer.Option(min=1, help="Nodes of the job.")],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs of each node (one process each).")],
    set_: SetOpt = None,
    time: Annotated[
        Optional[str], typer.Option(help="The job's time limit, e.g. 1-00:00:00 (default: the partition's).")
    ] = None,
    partition: Annotated[Optional[str], typer.Option(help="SLURM partition.")] = None,
    account: Annotated[Optional[str], typer.Option(help="SLURM account the job is charged to.")] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", help="Where to write the script (default: output.dir/slurm.sbatch).")
    ] = None,
    cpus_per_gpu: Annotated[int, typer.Option(min=1, help="CPU cores asked per GPU.")] = 8,
) -> None:
    """Write an sbatch script that trains the recipe on NODES x GPUS: one task per node, checkpoint before the
    time limit (SIGUSR1), requeue and resume."""
    from finetune.commands.slurm import SlurmOptions, run_slurm

    options = SlurmOptions(
        recipe, list(set_ or []), nodes, gpus_per_node, time=time, partition=partition, account=account,
        output=output, cpus_per_gpu=cpus_per_gpu,
    )
    try:
        code = run_slurm(options, say=typer.echo)
    except (RecipeError, UserError) as err:
        _fail(err)
    raise typer.Exit(code)


@app.command()
def report(
    run_dirs: Annotated[list[str], typer.Argument(metavar="RUN_DIR...", help="Output directories of runs (overlaid).")],
    out: Annotated[
        Optional[str],
        typer.Option("--out", help="report.png or report.html (default: RUN_DIR/report.png for one run)."),
    ] = None,
) -> None:
    """Draw loss, eval, learning rate, tokens/s and the plan's memory beside the measured peak (PNG or HTML)."""
    from finetune.commands.report import write_report

    try:
        path = write_report(run_dirs, out)
    except UserError as err:
        _fail(err)
    typer.echo(f"report written to {path}")


@app.command("eval")
def eval_(
    target: Annotated[
        str,
        typer.Argument(
            metavar="RUN_OR_MODEL",
            help="A run's output.dir (a full model or an adapter over its base), an adapter or a model directory.",
        ),
    ],
    tasks: Annotated[
        list[str],
        typer.Option(
            "--tasks", "-t",
            help="Comma-separated, repeatable: run (the run's own eval prompts, exact match), retain (its "
            "eval.retain rows with answers), a YAML task file over local data, or any lm-eval task whose data "
            "is in the local datasets cache.",
        ),
    ],
    baseline: Annotated[
        Optional[str],
        typer.Option(
            help="Also evaluate this model and show the difference per task; `--baseline` alone (or `base`): "
            "the model the run started from."
        ),
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the results as JSON here.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts per forward pass.")] = 16,
    limit: Annotated[
        Optional[int], typer.Option(min=1, help="At most this many documents per task (a quick look).")
    ] = None,
    trust_remote_code: TrustOpt = False,
    allow_task_code: Annotated[
        bool,
        typer.Option(
            "--allow-task-code",
            help="Let task files import code (`!function`) and render their templates outside Jinja's sandbox.",
        ),
    ] = False,
) -> None:
    """Evaluate a run or model with lm-evaluation-harness (and its base with --baseline): table and JSON."""
    from finetune.commands.eval import print_report, run_eval

    console = Console(highlight=False, soft_wrap=True)
    try:
        report = run_eval(
            target, tasks, baseline=baseline, output=output, batch_size=batch_size, limit=limit,
            say=lambda text: console.print(text, markup=False), trust_remote_code=trust_remote_code,
            allow_task_code=allow_task_code,
        )
    except UserError as err:
        _fail(err)
    print_report(report, console)
    if output is not None:
        typer.echo(f"results written to {output}")


@recipes_app.callback(invoke_without_command=True)
def recipes_default(ctx: typer.Context) -> None:
    """List the shipped recipes (same as `finetune recipes ls`)."""
    if ctx.invoked_subcommand is None:
        recipes_ls()


@recipes_app.command("ls")
def recipes_ls() -> None:
    """List the shipped recipes."""
    root = shipped_recipes_dir()
    for p in sorted(root.glob("*.yaml")):
        first = next((ln[1:].strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
        typer.echo(f"{p.stem:28s} {first}")


@recipes_app.command("cp")
def recipes_cp(
    name: Annotated[str, typer.Argument(help="Recipe name (see `finetune recipes ls`).")],
    dest: Annotated[Path, typer.Argument(help="Destination file or directory.")],
) -> None:
    """Copy a shipped recipe to edit it."""
    src = shipped_recipes_dir() / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not src.is_file():
        _fail(UserError(f"no shipped recipe named `{name}`; `finetune recipes ls` lists them"))
    target = dest / src.name if dest.is_dir() else dest
    if target.exists():
        _fail(UserError(f"{target} already exists; choose another destination"))
    if not target.parent.is_dir():
        _fail(UserError(f"{target.parent} is not a directory; create it first or choose another destination"))
    shutil.copyfile(src, target)
    typer.echo(f"copied {src.name} to {target}")


def bare_resume(argv: list[str]) -> list[str]:
    """``--resume`` with no value means ``--resume latest`` (click options cannot take an optional value).

    The value is missing when ``--resume`` is last, or followed by another option or by the recipe file.
    ``finetune eval``'s ``--baseline`` alone, last or followed by another option, means ``--baseline base``.
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        nxt = out[i + 1] if i + 1 < len(out) else None
        if arg == "--resume":
            if nxt is None or nxt.startswith("-") or nxt.endswith((".yaml", ".yml")) or Path(nxt).is_file():
                out[i] = "--resume=latest"
        elif arg == "--baseline" and (nxt is None or nxt.startswith("-")):
            out[i] = "--baseline=base"
    return out


def main() -> None:
    """Entry point of the ``finetune`` console script."""
    argv = bare_resume(sys.argv[1:])
    try:
        app(args=argv)
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as done:
        if argv[:1] == ["plan"]:
            quick_exit(done.code)
        raise


def quick_exit(code: int | str | None) -> None:
    """End the process without the interpreter's teardown of torch and transformers (about 0.9 s of a
    `finetune plan`, a fifth of it). Only for commands that hold no open files, child processes or process
    groups once they have printed: everything written is flushed first."""
    import os

    if isinstance(code, str):  # sys.exit("message") prints the message and exits 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
