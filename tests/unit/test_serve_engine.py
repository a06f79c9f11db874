"""Which engine `finetune serve` chooses: transformers where vLLM is not installed or there is no GPU (the line it
prints says why), vLLM where both are; `--engine vllm` refused in one sentence where vLLM cannot serve.

vLLM itself installs on GPU machines only, so the case "installed" is a stand-in package named `vllm` written to a
directory put on sys.path: a real module that Python's import system finds, with the few names the engine uses,
recording what it was given.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="finetune serve needs uvicorn and starlette (pip install -e '.[serve]')")
pytest.importorskip("starlette", reason="finetune serve needs uvicorn and starlette (pip install -e '.[serve]')")

from finetune.commands.serve import Finished, Piece, Sampling, ServeOptions, prepare
from finetune.errors import UserError
from tests.support import micro_model_dir

INSTALLED = importlib.util.find_spec("vllm") is not None

STAND_IN = '''
"""A stand-in for vLLM's asynchronous engine: it answers every prompt with the words "one two three"."""

made = []


class AsyncEngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class TokensPrompt(dict):
    pass


class _Completion:
    def __init__(self, text, token_ids, finish_reason):
        self.text, self.token_ids, self.finish_reason = text, token_ids, finish_reason


class _Output:
    def __init__(self, completion, finished):
        self.outputs, self.finished = [completion], finished


class AsyncLLMEngine:
    @classmethod
    def from_engine_args(cls, args):
        engine = cls()
        engine.args = args
        made.append(engine)
        return engine

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.asked = (dict(prompt), params.kwargs, lora_request)
        words = ["one", " two", " three"]
        for i in range(len(words)):
            yield _Output(_Completion("".join(words[: i + 1]), list(range(i + 1)), None), i == len(words) - 1)
'''

LORA_REQUEST = '''
class LoRARequest:
    def __init__(self, name, number, path):
        self.name, self.number, self.path = name, number, path
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with weights (random), tokenizer and config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = micro_model_dir(tmp_path_factory.mktemp("serve-engine") / "model", num_hidden_layers=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).save_pretrained(d)
    return d


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The stand-in `vllm` package on sys.path (imported fresh, dropped after the test)."""
    package = tmp_path / "site" / "vllm"
    (package / "lora").mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "lora" / "__init__.py").write_text("")
    (package / "lora" / "request.py").write_text(LORA_REQUEST)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("vllm")
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _line(model: Path, tmp_path: Path, engine: str) -> tuple[str, str]:
    service, line = prepare(ServeOptions(target=str(model), device="cpu", engine=engine), tmp_path)
    return service.engine.name, line


def _refusal(model: Path, tmp_path: Path) -> str:
    with pytest.raises(UserError) as err:
        prepare(ServeOptions(target=str(model), device="cpu", engine="vllm"), tmp_path)
    return str(err.value)


@pytest.mark.skipif(INSTALLED, reason="vLLM is installed here")
def test_without_vllm_the_command_serves_with_transformers_and_refuses_engine_vllm(model: Path, tmp_path: Path) -> None:
    name, line = _line(model, tmp_path, "auto")
    assert name == "transformers" and "(transformers engine: vLLM is not installed)" in line
    name, line = _line(model, tmp_path, "transformers")
    assert name == "transformers" and "(transformers engine)" in line
    assert _refusal(model, tmp_path) == (
        "--engine vllm: vLLM is not installed; leave --engine out to serve with transformers"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in package is written for Linux paths")
def test_with_vllm_importable_and_no_gpu_the_command_says_so(model: Path, tmp_path: Path, stand_in, monkeypatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("there is a GPU here: vLLM is chosen (the next test)")
    assert importlib.util.find_spec("vllm").origin == str(tmp_path / "site" / "vllm" / "__init__.py")
    name, line = _line(model, tmp_path, "auto")
    assert name == "transformers" and "(transformers engine: there is no GPU)" in line
    assert _refusal(model, tmp_path) == "--engine vllm: there is no GPU; leave --engine out to serve with transformers"
    assert stand_in.made == []  # never started


def test_with_vllm_and_a_gpu_the_command_serves_with_vllm(model: Path, tmp_path: Path, stand_in) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vLLM serves on a GPU only")
    service, line = prepare(ServeOptions(target=str(model), engine="auto"), tmp_path)
    assert service.engine.name == "vllm" and line.startswith(f"vLLM over {model}")
    [engine] = stand_in.made
    assert engine.args.kwargs == {"model": str(model), "tokenizer": str(model), "trust_remote_code": False}

    async def answer() -> list[object]:
        sampling = Sampling(max_tokens=3, temperature=0.0, top_p=1.0, seed=0, stream=True, include_usage=False)
        return [piece async for piece in service.engine.stream(None, [5, 6, 7], sampling)]

    pieces = asyncio.run(answer())
    assert pieces == [Piece("one"), Piece(" two"), Piece(" three"), Finished("stop", 3)]
    assert engine.asked[0] == {"prompt_token_ids": [5, 6, 7]} and engine.asked[1]["max_tokens"] == 3
