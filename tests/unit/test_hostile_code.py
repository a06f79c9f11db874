"""No code from artifacts: a planted checkpoint metadata pickle, a task file's ``!function`` or template, a model
directory's own code that a received run directory asks to run, an index naming files outside its model, an
upload of files outside the folder. Each planted payload would write a marker file; none does.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from finetune.cli import app
from finetune.errors import UserError
from finetune.train.checkpoint import checkpointer as ck
from finetune.train.checkpoint.lock import LOCK_NAME, OutputLock
from tests.support import TINY_MODEL, micro_model_dir, tiny_recipe, write_recipe


class _Payload:
    """A pickle that calls ``fn(*args)`` when loaded (what a planted .metadata would hold)."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, bytes]:
    shell = f"touch {marker}"
    return {
        "os.system": pickle.dumps(_Payload(os.system, shell)),
        "subprocess.Popen": pickle.dumps(_Payload(subprocess.Popen, ["touch", str(marker)])),
        "builtins.exec": pickle.dumps(_Payload(exec, f"open({str(marker)!r}, 'w').write('x')")),
        "builtins.eval": pickle.dumps(_Payload(eval, f"open({str(marker)!r}, 'w')")),
        # getattr(__import__("os"), "system")(shell), written as opcodes (pickle.dumps cannot produce it)
        "builtins.getattr": b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'"
        + shell.encode() + b"'\ntR.",
        "torch.load": pickle.dumps(_Payload(torch.load, str(marker))),  # torch, but not a dtype or a size
        "a Metadata wrapping one": pickle.dumps({"state": _Payload(os.system, shell)}),
    }


def _real_metadata(tmp: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"state.w.step": torch.tensor(3.0), "param_groups.w.lr": 0.1,
                           "param_groups.w.betas": (0.9, 0.99), "param_groups.w.params": ["w"]}}
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    return tmp


def test_dcp_metadata_of_a_real_save_loads_through_the_restricted_unpickler(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = _real_metadata(tmp_path / "state")
    metadata = ck.safe_reader(saved).read_metadata()
    assert set(metadata.state_dict_metadata) >= {"model.w", "model.b", "optimizer.param_groups.w.lr"}
    assert metadata.state_dict_metadata["model.b"].properties.dtype == torch.bfloat16
    out = {"model": {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
           "optimizer": {"state.w.step": torch.tensor(0.0), "param_groups.w.lr": 0.0,
                         "param_groups.w.betas": (0.0, 0.0), "param_groups.w.params": []}}
    dcp.load(out, storage_reader=ck.safe_reader(saved), planner=ck._SafeLoadPlanner(), no_dist=True)
    assert out["optimizer"]["param_groups.w.lr"] == 0.1 and out["optimizer"]["param_groups.w.betas"] == (0.9, 0.99)
    assert torch.equal(out["model"]["b"], torch.zeros(2, dtype=torch.bfloat16))


def test_planted_metadata_runs_nothing_and_is_one_sentence(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = tmp_path / "checkpoints" / "step-2"
    _real_metadata(ckpt / ck.STATE_DIR)
    for name, data in _payloads(marker).items():
        with pytest.raises(ck.RefusedMetadata):
            ck.read_dcp_metadata(data)
        (ckpt / ck.STATE_DIR / ".metadata").write_bytes(data)
        with pytest.raises(ck.RefusedMetadata):
            ck.safe_reader(ckpt / ck.STATE_DIR).read_metadata()
        with pytest.raises(UserError) as info:
            ck.check_safe_to_load(ckpt)
        message = str(info.value)
        assert message.startswith(f"--resume: {ckpt / ck.STATE_DIR / '.metadata'} names ") and (
            "which no checkpoint's metadata holds: it was not written by finetune (or was changed since), and "
            "loading it could run code; nothing of it was loaded. Choose a checkpoint this run wrote"
        ) in message, (name, message)
        assert not marker.exists(), name
    pickle.loads(_payloads(marker)["os.system"])  # what a plain unpickler (DCP's own reader) does with it
    assert marker.exists()


def test_load_sharded_reads_the_metadata_through_the_restricted_unpickler(tmp_path: Path) -> None:
    """What --resume and the sharded helpers load with: a real save loads, a planted .metadata runs nothing."""
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp_path / "marker"
    state = _real_metadata(tmp_path / "state")
    out = {"model": {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}}
    ck.load_sharded(out, state, 1)
    assert torch.equal(out["model"]["b"], torch.zeros(2, dtype=torch.bfloat16)) and out["model"]["w"].abs().sum() > 0
    (state / ".metadata").write_bytes(_payloads(marker)["os.system"])
    with pytest.raises((ck.RefusedMetadata, CheckpointException)) as info:
        ck.load_sharded(out, state, 1)
    assert "system" in str(info.value)  # the refused global, as DCP reports its reader's failure
    assert not marker.exists()


def test_a_planted_trainer_state_or_a_garbled_meta_json_is_one_sentence(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = tmp_path / "checkpoints" / "step-2"
    _real_metadata(ckpt / ck.STATE_DIR)
    (ckpt / "trainer.pt").write_bytes(_payloads(marker)["os.system"])
    with pytest.raises(UserError) as info:
        ck.check_safe_to_load(ckpt)
    assert str(info.value).startswith(f"--resume: {ckpt / 'trainer.pt'} cannot be read as plain tensors and numbers (")
    assert str(info.value).endswith("nothing of it was loaded: choose a checkpoint this run wrote")
    assert not marker.exists()
    for text, reason in (("{not json", "JSONDecodeError"), ("[1, 2]", "a JSON list, not an object"),
                         ('{"step": ' + "9" * 5000 + "}", "ValueError")):
        (ckpt / ck.META).write_text(text)
        with pytest.raises(UserError) as info:
            ck.resolve_resume(str(ckpt), tmp_path) and ck.read_meta(ckpt)
        assert str(info.value) == (
            f"{ckpt / ck.META} is not a checkpoint's meta.json ({reason}); the checkpoint is damaged: choose another"
        )


def test_early_stoppings_best_weights_load_through_the_restricted_unpickler(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    best = tmp_path / "checkpoints" / "step-4"
    _real_metadata(best / ck.STATE_DIR)
    model = {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    ck.Checkpointer(tmp_path, 0, 1, {"model": model}, files=None).load_weights(best)  # type: ignore[arg-type]
    assert torch.equal(model["b"], torch.zeros(2, dtype=torch.bfloat16)) and model["w"].abs().sum() > 0
    (best / ck.STATE_DIR / ".metadata").write_bytes(_payloads(marker)["os.system"])
    with pytest.raises(UserError) as info:
        ck.Checkpointer(tmp_path, 0, 1, {"model": model}, files=None).load_weights(best)  # type: ignore[arg-type]
    assert str(info.value).startswith(f"train.early_stopping: the best checkpoint {best} cannot be loaded (")
    assert "system" in str(info.value) and "nothing of it was loaded" in str(info.value)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ task files


def _task(tmp: Path, marker: Path, *, included: bool) -> Path:
    (tmp / "utils.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n\ndef docs(d):\n    return d\n")
    (tmp / "rows.jsonl").write_text('{"q": "a", "a": "b"}\n')
    body = textwrap.dedent("""\
        task: planted
        dataset_path: json
        dataset_kwargs: {data_files: {test: rows.jsonl}}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{q}}"
        doc_to_target: "{{a}}"
        process_docs: !function utils.docs
        metric_list: [{metric: exact_match}]
        """)
    if not included:
        (tmp / "task.yaml").write_text(body)
        return tmp / "task.yaml"
    (tmp / "base.yaml").write_text(body)
    (tmp / "task.yaml").write_text("include: base.yaml\ntask: planted2\n")
    return tmp / "task.yaml"


@pytest.mark.parametrize("included", [False, True])
def test_a_task_files_function_is_refused_unless_allowed(tmp_path: Path, included: bool) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    from finetune.commands.eval import yaml_task

    marker = tmp_path / "marker"
    path = _task(tmp_path, marker, included=included)
    with pytest.raises(UserError) as info:
        yaml_task(path)
    where = tmp_path / ("base.yaml" if included else "task.yaml")
    assert str(info.value) == (
        f"--tasks {where.resolve()}:8: `!function utils.docs` would run code from beside the task file; pass "
        "--allow-task-code if you trust the task's author, or remove it"
    )
    assert not marker.exists()
    yaml_task(path, allow_code=True)  # the user's word: lm-eval imports it
    assert marker.read_text() == "imported"


def test_a_task_file_with_a_python_tag_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    from finetune.commands.eval import task_code

    (tmp_path / "t.yaml").write_text("task: x\nclass: !!python/name:os.system\n")
    assert task_code(tmp_path / "t.yaml") == (f"{(tmp_path / 't.yaml').resolve()}:2", "the tag `tag:yaml.org,2002:python/name:os.system`")
    (tmp_path / "ok.yaml").write_text("task: x\ndoc_to_text: '{{q}}'\nlist: [1, 2.5, true, null]\n")
    assert task_code(tmp_path / "ok.yaml") is None


def test_task_templates_render_in_jinja_s_sandbox() -> None:
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    import lm_eval.utils as lm_utils
    from jinja2.exceptions import SecurityError

    from finetune.commands.eval import sandboxed_templates

    reach = "{{ cycler.__init__.__globals__.os.getpid() }}"
    assert lm_utils.apply_template(reach, {}) == str(os.getpid())  # lm-eval's own environment reaches Python
    with sandboxed_templates(True):
        with pytest.raises(SecurityError):
            lm_utils.apply_template(reach, {})
        assert lm_utils.apply_template("{{ q | upper }}: {{ a.split(',')[0] }}", {"q": "x", "a": "b,c"}) == "X: b"
    with sandboxed_templates(False):
        assert lm_utils.apply_template(reach, {}) == str(os.getpid())


# ------------------------------------------------------------------------------------------------ remote code


def _evil_model(tmp: Path, marker: Path) -> Path:
    """A model directory whose config names its own code (auto_map), which writes ``marker`` when imported."""
    d = micro_model_dir(tmp / "evil")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="evil_net", architectures=["EvilModel"],
               auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                         "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    planted = f"open({str(marker)!r}, 'w').write('ran')\n"
    (d / "configuration_evil.py").write_text(
        planted + "from transformers import LlamaConfig\n\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil_net'\n"
    )
    (d / "modeling_evil.py").write_text(
        planted + "from transformers import LlamaForCausalLM\n\nclass EvilModel(LlamaForCausalLM):\n    pass\n"
    )
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(256)}, str(d / "model.safetensors"))
    return d


def _received_run(tmp: Path, model: Path, **recipe: object) -> Path:
    """A run directory someone sent: its recipe turns remote code on."""
    run = tmp / "received"
    shutil.copytree(model, run)
    r = tiny_recipe(run, model={"path": str(model), "init": "pretrained", "trust_remote_code": True}, **recipe)
    (run / "recipe.yaml").write_text(yaml.safe_dump(r))
    return run


def test_chat_eval_serve_export_and_merge_never_take_remote_code_from_a_run_directory(tmp_path: Path) -> None:
    from finetune.commands.serve import ServeOptions
    from finetune.commands.serve import prepare as prepare_serve
    from finetune.inference import select

    marker = tmp_path / "marker"
    model = _evil_model(tmp_path, marker)
    run = _received_run(tmp_path, model)
    says = (
        "its config names model code of its own (auto_map), which finetune runs only when you pass "
        "--trust-remote-code; pass it if you trust the model's author, or use a model transformers implements"
    )
    res = CliRunner().invoke(app, ["chat", str(run), "--prompt", "hi", "--max-new-tokens", "1"])
    assert res.exit_code == 2 and res.output.strip() == f"error: {run}: {says}", res.output
    with pytest.raises(UserError) as info:
        select(str(run), [], None, tmp_path)  # what `finetune eval` loads
    assert str(info.value) == f"{run}: {says}"
    with pytest.raises(UserError) as info:
        prepare_serve(ServeOptions(target=str(run)), tmp_path)
    assert str(info.value) == f"{run}: {says}"
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "m.gguf")])
    if "needs the gguf package" not in res.output:  # the export extra
        assert res.exit_code == 2 and res.output.strip() == f"error: {run}: {says}", res.output
    assert not (tmp_path / "m.gguf").exists()
    # a LoRA adapter over that base, merged: the base's config is read without its code
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "base_model_name_or_path": str(model),
    }))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 256),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(256, 2)},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "recipe.yaml").write_text(yaml.safe_dump(
        tiny_recipe(adapter, method="lora", model={"path": str(model), "init": "pretrained", "trust_remote_code": True})
    ))
    res = CliRunner().invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged")])
    assert res.exit_code == 2 and res.output.strip() == f"error: {model}: {says}", res.output
    assert not marker.exists() and not (tmp_path / "merged").exists()


def test_a_run_directory_recipe_read_by_chat_eval_serve_export_and_merge_has_remote_code_off(tmp_path: Path) -> None:
    from finetune.storage.rundir import read_run, with_user_trust

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": {"path": "x", "trust_remote_code": True}}))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    recipe = read_run(str(tmp_path)).recipe
    assert recipe is not None and recipe["model"] == {"path": "x", "trust_remote_code": False}
    # what a random init is rebuilt from: the user's word, whatever the directory said
    assert with_user_trust(recipe, True)["model"] == {"path": "x", "trust_remote_code": True}
    assert with_user_trust({"model": {"trust_remote_code": True}}, False)["model"] == {"trust_remote_code": False}


# ------------------------------------------------------------------------------------------------ shard names


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors", "sub/x.safetensors",
                                  "..", "model.bin"])
def test_an_index_naming_a_file_outside_its_model_is_refused(tmp_path: Path, name: str) -> None:
    from safetensors.torch import save_file

    from finetune.storage.safetensors_stream import SAFE_INDEX, read_header

    model = micro_model_dir(tmp_path / "model")
    save_file({"model.norm.weight": torch.ones(256)}, str(tmp_path / "outside.safetensors"))
    (model / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": name}}))
    with pytest.raises(UserError) as info:
        read_header(model)
    assert str(info.value).startswith(f"{model / SAFE_INDEX}: weight_map places model.norm.weight in ")
    assert str(info.value).endswith("the index is damaged or hostile")
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", model={"path": str(model), "init": "pretrained"}))
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 2 and ": model.path: " in res.output and "weight_map places" in res.output, res.output


# ------------------------------------------------------------------------------------------------ the lock


def _holder(out: Path) -> subprocess.Popen:
    """Another process holding ``out``'s lock (it prints `held` once it does, and waits for stdin to close)."""
    code = (
        "import sys; from finetune.train.checkpoint.lock import OutputLock\n"
        f"lock = OutputLock({str(out)!r}); lock.acquire(); print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_output_dir_is_refused_naming_its_holder_and_a_dead_ones_lock_is_taken(tmp_path: Path) -> None:
    import socket

    out = tmp_path / "out"
    holder = _holder(out)
    try:
        with pytest.raises(UserError) as info:
            OutputLock(out).acquire()
        message = str(info.value)
        assert message.startswith(
            f"output.dir: {out} is in use by another run (pid {holder.pid} on {socket.gethostname()} (this host), since "
        ), message
        assert message.endswith(f"lock file {out / LOCK_NAME}); wait for it to finish or stop it, or choose another output.dir")
    finally:
        holder.communicate("")
    # the holder is gone (killed runs release their flock with their process); its record is taken over
    (out / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "started": "then"}))
    with OutputLock(out):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert (out / LOCK_NAME).read_text() == ""  # released: emptied, not removed


def test_without_flock_the_written_holder_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that cannot flock (ENOLCK): a live holder on this host, or one on another host, keeps the
    directory; a dead one on this host is stale. flock itself is what this machine's filesystem would refuse."""
    import errno
    import fcntl
    import socket

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid, host, refused in ((sleeper.pid, socket.gethostname(), True), (1234, "node-elsewhere", True)):
            (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host, "started": "then"}))
            with pytest.raises(UserError) as info:
                OutputLock(out).acquire()
            assert f"in use by another run (pid {pid} on {host}" in str(info.value) and refused
            assert ("on another host, so if that run is over, remove the file" in str(info.value)) == (host != socket.gethostname())
    finally:
        sleeper.kill()
        sleeper.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": "then"}))
    with OutputLock(out):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()


# ------------------------------------------------------------------------------------------------ the final save


def test_a_failed_final_save_leaves_the_earlier_model_whole(tmp_path: Path) -> None:
    from finetune.train.checkpoint.save import FinalStaging
    from finetune.train.parallel.distributed import DistContext

    out = tmp_path / "out"
    out.mkdir()
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json", "keep.txt"):
        (out / name).write_text(f"earlier {name}")
    with pytest.raises(OSError), FinalStaging(out, ctx) as where:
        (where / "model.safetensors").write_text("new, half")
        raise OSError(28, "No space left on device")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "keep.txt", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ]
    staging = FinalStaging(out, ctx)
    with staging as where:
        (where / "model.safetensors").write_text("new")
        (where / "config.json").write_text("new config")
    assert staging.files == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "keep.txt", "model.safetensors"]
    assert (out / "config.json").read_text() == "new config" and (out / "keep.txt").read_text() == "earlier keep.txt"


def test_an_upload_sends_only_plain_files_of_its_folder(tmp_path: Path) -> None:
    from finetune.storage.publish import upload_list

    (tmp_path / "model.safetensors").write_text("w")
    (tmp_path / "README.md").write_text("card")
    (tmp_path / "secret.txt").write_text("not the run's")
    os.symlink(TINY_MODEL / "config.json", tmp_path / "config.json")
    assert upload_list(tmp_path, ["model.safetensors"]) == ["model.safetensors", "README.md"]
    for name, says in (("../secret.txt", "is not a file of the folder"), ("config.json", "leads outside")):
        with pytest.raises(UserError) as info:
            upload_list(tmp_path, [name])
        assert says in str(info.value) and str(info.value).endswith("nothing was uploaded")


# ------------------------------------------------------------------------------------------------ between ranks


def test_finetune_sends_nothing_between_ranks_that_is_unpickled() -> None:
    """No object collective (they unpickle what a peer sends) in finetune's own code: the rank checks, memory
    figures, RNG states and pipeline shapes travel as JSON (finetune.train.parallel.distributed.all_gather_json)."""
    import re

    import finetune

    root = Path(finetune.__file__).parent
    collective = re.compile(r"\b(all_gather_object|gather_object|broadcast_object_list|scatter_object_list)\(")
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if collective.search(line)]
    assert found == []


def test_rng_states_travel_as_json_and_restore_the_same_streams() -> None:
    import random

    import numpy as np

    from finetune.train.checkpoint.checkpointer import (
        rng_state,
        rng_state_from_json,
        rng_state_to_json,
        set_rng_state,
    )

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.randn()  # numpy keeps a cached gaussian: its state has one
    state = rng_state()
    sent = json.loads(json.dumps(rng_state_to_json(state)))
    back = rng_state_from_json(sent)
    assert back["python"] == state["python"] and isinstance(back["python"][1], tuple)
    assert torch.equal(back["torch"], state["torch"]) and back["torch"].dtype == torch.uint8
    assert torch.equal(back["numpy"]["keys"], state["numpy"]["keys"]) and back["numpy"]["keys"].dtype == torch.int64
    assert {k: v for k, v in back["numpy"].items() if k != "keys"} == {
        k: v for k, v in state["numpy"].items() if k != "keys"
    } and state["numpy"]["has_gauss"] == 1
    drawn = (random.random(), np.random.rand(), torch.rand(3).tolist())
    set_rng_state(back)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == drawn
