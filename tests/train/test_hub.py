"""The Hub through huggingface_hub against a local stand-in (tests/hub_server.py, 127.0.0.1 only): a model and a
dataset downloaded by id, pickles refused, the offline and unreachable sentences, and uploads with a model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hub_server import HubServer
from tests.support import RECIPES, TINY_MODEL

pytestmark = pytest.mark.slow


def _weights(tmp: Path) -> dict[str, bytes]:
    """The tiny model's files with seeded weights in safetensors, as a Hub repository holds them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    out = tmp / "weights"
    model.save_pretrained(out, safe_serialization=True)
    files = {f.name: f.read_bytes() for f in TINY_MODEL.iterdir() if f.name != "config.json"}
    files.update({f.name: f.read_bytes() for f in out.iterdir()})
    return files


def _cli(args: list[str], env: dict[str, str], code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "finetune", *args]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "1000",
            **env,
        },
    )


@pytest.fixture
def hub(tmp_path: Path):
    with HubServer() as server:
        server.env = {  # type: ignore[attr-defined]
            "HF_ENDPOINT": server.url,
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_TOKEN": "hf_test",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        yield server


def _recipe(tmp: Path, **sections: dict) -> Path:
    r = {
        "model": {"path": "acme/tiny-llama"},
        "method": "full",
        "data": {"train": "acme/reverse", "eval": "validation", "max_seq_len": 48},
        "train": {"max_steps": 2, "global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"max_samples": 8, "max_new_tokens": 4, "batch_size": 8},
        "output": {"dir": str(tmp / "run"), "log_every": 1},
    }
    for k, v in sections.items():
        if isinstance(v, dict):
            r.setdefault(k, {}).update(v)
        else:
            r[k] = v
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def _reverse_rows(n: int, start: int = 0) -> bytes:
    rows = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[start : start + n]
    return ("\n".join(rows) + "\n").encode()


def test_run_downloads_then_pushes_and_merge_pushes_with_cards(hub: HubServer, tmp_path: Path) -> None:
    """A LoRA run on a Hub model and a Hub dataset pushes its adapter; merging it pushes the merged model, from
    the cache (nothing downloaded again), and its untouched tensors are the Hub's weights bit for bit."""
    files = _weights(tmp_path)
    files["pytorch_model.bin"] = b"a pickle a run must not fetch when safetensors exist"
    hub.state.add("model", "acme/tiny-llama", files)
    hub.state.add(
        "dataset",
        "acme/reverse",
        {
            "data/train.jsonl": _reverse_rows(32),
            "data/validation.jsonl": _reverse_rows(8, 100),
            "README.md": b"#",
        },
    )
    recipe = _recipe(tmp_path, method="lora", model={"path": "acme/tiny-llama", "revision": "v1"},
                     output={"push_to_hub": "acme/tiny-reverse"})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine, not the run's")  # in output.dir before the run
    res = _cli(["run", str(recipe)], hub.env)
    assert res.returncode == 0, res.stderr[-500:] + str(hub.state.unknown)
    # model.revision pins the download: v1 is asked for, and every file of the model at the commit it names
    assert "/api/models/acme/tiny-llama/revision/v1" in hub.state.paths
    commit = hub.state.sha("model", "acme/tiny-llama")
    model_files = [p for p in hub.state.paths if p.startswith("/acme/tiny-llama/resolve/")]
    assert model_files and all(p.startswith(f"/acme/tiny-llama/resolve/{commit}/") for p in model_files), model_files
    cached = tmp_path / "hf-home" / "hub" / "models--acme--tiny-llama"
    assert (cached / "refs" / "v1").read_text() == commit and not (cached / "refs" / "main").exists()
    got = set(hub.state.downloads)
    assert "model:acme/tiny-llama/model.safetensors" in got and "model:acme/tiny-llama/config.json" in got
    assert not any(d.endswith(".bin") for d in got)
    assert {"dataset:acme/reverse/data/train.jsonl", "dataset:acme/reverse/data/validation.jsonl"} <= got
    out = tmp_path / "run"
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["model"]["path"] == "acme/tiny-llama"
    assert saved["data"]["train"].endswith("data/train.jsonl")
    assert saved["data"]["eval"].endswith("data/validation.jsonl")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]

    # The upload: one commit with the adapter, tokenizer, run files and the card; no checkpoints, nothing the run
    # did not write; a private repository.
    assert len(hub.state.commits) == 1
    assert hub.state.created[("model", "acme/tiny-reverse")]["visibility"] == "private"
    pushed = hub.state.repos[("model", "acme/tiny-reverse")]
    assert "notes.txt" not in pushed and ".finetune.lock" not in pushed
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "recipe.yaml",
        "plan.json",
        "README.md",
    } <= set(pushed)
    assert not any(p.startswith("checkpoints/") for p in pushed)
    assert pushed["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
    card = pushed["README.md"].decode()
    assert card.startswith("---\nlibrary_name: peft\n")
    assert "base_model: acme/tiny-llama" in card
    assert (out / "recipe.yaml").read_text().strip() in card
    last = {k: v for r in rows for k, v in r.items()}
    assert f"| loss | {last['loss']:.6g} |" in card and f"| eval_loss | {last['eval_loss']:.6g} |" in card
    assert "| method | lora |" in card and "| strategy | single |" in card
    assert "uploaded to the Hub: acme/tiny-reverse" in res.stdout

    before = len(hub.state.downloads)
    merged = tmp_path / "merged"
    res = _cli(["merge", str(out), "--out", str(merged), "--push-to-hub", "acme/merged", "--public"], hub.env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(hub.state.downloads) == before  # the base came from the cache
    assert hub.state.created[("model", "acme/merged")]["visibility"] == "public"  # asked for
    pushed = hub.state.repos[("model", "acme/merged")]
    assert "model.safetensors" in pushed and "adapter_config.json" not in pushed
    card = pushed["README.md"].decode()
    assert (
        card.startswith("---\nlibrary_name: transformers\n") and "merged from the adapter run `run`" in card
    )
    assert "| method | lora |" in card and "```yaml" in card
    from safetensors.torch import load

    served, uploaded = load(files["model.safetensors"]), load(pushed["model.safetensors"])
    assert all(uploaded[k].equal(served[k]) for k in ("model.embed_tokens.weight", "model.norm.weight"))
    assert not uploaded["model.layers.0.self_attn.q_proj.weight"].equal(
        served["model.layers.0.self_attn.q_proj.weight"]
    )


def test_pickle_only_model_is_refused_unless_allowed(hub: HubServer, tmp_path: Path) -> None:
    files = {f.name: f.read_bytes() for f in TINY_MODEL.iterdir()}
    files["pytorch_model.bin"] = b"pickled weights"
    hub.state.add("model", "acme/pickled", files)
    hub.state.add("dataset", "acme/reverse", {"train.jsonl": _reverse_rows(16)})
    recipe = _recipe(tmp_path, model={"path": "acme/pickled"}, data={"eval": None})
    res = _cli(["run", str(recipe)], hub.env)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: model.path: `acme/pickled` has only pickled weights (pytorch_model.bin), which can run code when "
        "loaded; set model.allow_pickle: true if you trust its author, or use a safetensors copy"
    )
    assert hub.state.downloads == []
    # Planning needs only the config: `finetune plan --model` fetches config.json and nothing else.
    res = _cli(["plan", "--model", "acme/pickled", "--seq-len", "64", "--json"], hub.env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"]["source"] == "hub:acme/pickled"
    assert hub.state.downloads == ["model:acme/pickled/config.json"]
    code = "import sys; from finetune.recipe.locate import download_model; print(download_model(sys.argv[1], allow_pickle=True))"
    res = _cli(["acme/pickled"], hub.env, code=code)
    assert res.returncode == 0, res.stderr
    assert (Path(res.stdout.strip()) / "pytorch_model.bin").read_bytes() == b"pickled weights"


def test_offline_and_unreachable_are_one_sentence(hub: HubServer, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None})
    res = _cli(["run", str(recipe), "--offline"], hub.env)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: {recipe}:2: model.path: `acme/tiny-llama` is neither a local directory nor a model in the Hugging "
        "Face cache, and downloads are off (HF_HUB_OFFLINE=1 or --offline); unset it to download, or give a local "
        "model directory"
    )
    dead = {**hub.env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # the discard port: nothing listens
    res = _cli(["run", str(recipe)], dead)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert err.startswith(
        "error: model.path: could not download `acme/tiny-llama` from the Hugging Face Hub at "
        "http://127.0.0.1:9 ("
    )
    assert err.endswith("set HF_HUB_OFFLINE=1 (--offline) to use only local files and the cache")
    assert "Traceback" not in res.stderr and len(err.splitlines()) == 1
