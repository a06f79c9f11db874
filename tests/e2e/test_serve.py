"""`finetune serve` answered by the official `openai` client: two LoRA adapters over one base, chosen by the
request's `model`, giving at temperature 0 the text `finetune chat --prompt` prints, streamed in several chunks;
the completions API; bad requests as OpenAI-style errors; the real CLI in its own process.

The adapters are peft LoRA adapters with random (non-zero) factors on a seeded tiny Llama (whose head never
prefers the end of sequence, so every answer has text), so each one answers differently from the other and from
the base without training; one of them is a run's output.dir (a recipe.yaml
beside it) of the instruction format, the other a bare adapter prompted through the tokenizer's chat template.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytest.importorskip("uvicorn", reason="finetune serve needs uvicorn and starlette (pip install -e '.[serve]')")
pytest.importorskip("starlette", reason="finetune serve needs uvicorn and starlette (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the serve tests talk through the openai client (pip install openai)")

from tests.support import clean_env, free_port, micro_model_dir  # noqa: E402

PROMPT = "Reverse the letters.\nhello"
MAX_NEW = 12


@dataclass
class Models:
    base: Path
    rev: Path  # a run's output.dir: recipe.yaml (instruction format) and its adapter
    up: Path  # a bare peft adapter: the tokenizer's chat template


def lora(base: Path, out: Path, seed: int) -> Path:
    """A peft LoRA adapter of ``base`` with random A and B (its update is not zero), saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("serve")
    base = micro_model_dir(d / "base", num_hidden_layers=2, initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    with torch.no_grad():  # a zero logit for the end of sequence: answers run to max_tokens, not to a first `</s>`
        model.lm_head.weight[model.config.eos_token_id] = 0
    model.save_pretrained(base)
    rev = lora(base, d / "run-rev", 1)
    (rev / "recipe.yaml").write_text(yaml.safe_dump(
        {"model": {"path": str(base)}, "method": "lora", "data": {"format": "instruction"}}
    ))
    return Models(base, rev, lora(base, d / "up", 2))


@dataclass
class Server:
    url: str
    service: object


@pytest.fixture(scope="module")
def server(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server of `finetune serve --adapter rev=RUN --adapter up=DIR`, in this process on a free port."""
    import uvicorn

    from finetune.commands.serve import ServeOptions, build_app, prepare

    opts = ServeOptions(adapters=[f"rev={models.rev}", f"up={models.up}"], device="cpu", engine="auto")
    service, _ = prepare(opts, tmp_path_factory.mktemp("serve-scratch"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(service), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield Server(f"http://127.0.0.1:{port}", service)
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def client(server: Server) -> object:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_prints(models: Models, adapter: str) -> str:
    """What `finetune chat --adapter rev=... --adapter up=... --use ADAPTER --prompt PROMPT` prints on stdout."""
    from typer.testing import CliRunner

    from finetune.cli import app

    result = CliRunner().invoke(app, [
        "chat", "--adapter", f"rev={models.rev}", "--adapter", f"up={models.up}", "--use", adapter,
        "--prompt", PROMPT.replace("\n", "\\n"), "--max-new-tokens", str(MAX_NEW), "--device", "cpu",
    ])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_chat_completions_are_what_chat_prints_streamed_in_chunks(models: Models, client) -> None:
    for name in ("rev", "up"):
        printed = chat_prints(models, name)
        done = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_NEW,
        )
        answer = done.choices[0].message.content
        assert answer and printed == answer + "\n"  # chat streams the same pieces, then a line break
        assert done.model == name and done.object == "chat.completion"
        assert done.choices[0].finish_reason in ("stop", "length")
        assert done.usage.completion_tokens >= 1 and done.usage.prompt_tokens > 5
        chunks = list(client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_NEW,
            stream=True, stream_options={"include_usage": True},
        ))
        texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(texts) >= 3 and "".join(texts) == answer
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [done.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    rev = client.chat.completions.create(model="rev", messages=[{"role": "user", "content": PROMPT}],
                                         temperature=0, max_tokens=MAX_NEW).choices[0].message.content
    up = client.chat.completions.create(model="up", messages=[{"role": "user", "content": PROMPT}],
                                        temperature=0, max_tokens=MAX_NEW).choices[0].message.content
    base = client.chat.completions.create(model="base", messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, max_tokens=MAX_NEW).choices[0].message.content
    assert len({rev, up, base}) == 3  # the request's model chose the adapter (or none)


def test_models_lists_the_adapters_and_the_base(client) -> None:
    assert [m.id for m in client.models.list().data] == ["rev", "up", "base"]


def test_completions_continue_the_rendered_chat_prompt(client, server: Server) -> None:
    """A completion of the chat template's text is the chat answer of that conversation (the same token ids)."""
    fmt = server.service.formats["up"]
    messages = [{"role": "user", "content": PROMPT}]
    rendered = fmt.encoder.render(messages, add_generation_prompt=True)
    assert fmt.text(rendered) == fmt.conversation(messages, "messages")
    chat = client.chat.completions.create(model="up", messages=messages, temperature=0, max_tokens=MAX_NEW)
    done = client.completions.create(model="up", prompt=rendered, temperature=0, max_tokens=MAX_NEW)
    assert done.object == "text_completion" and done.choices[0].text == chat.choices[0].message.content
    streamed = list(client.completions.create(model="up", prompt=rendered, temperature=0, max_tokens=MAX_NEW,
                                              stream=True))
    texts = [c.choices[0].text for c in streamed if c.choices[0].text]
    assert len(texts) >= 3 and "".join(texts) == done.choices[0].text
    sampled = [client.completions.create(model="up", prompt="abc", temperature=1.5, max_tokens=8, seed=s)
               .choices[0].text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # a seed draws the same tokens


@pytest.mark.parametrize(("request_kwargs", "status", "param", "code"), [
    ({"model": "nope"}, 404, "model", "model_not_found"),
    ({"temperature": 5}, 400, "temperature", "invalid_value"),
    ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"n": 3}, 400, "n", "unsupported"),
    ({"max_tokens": 600}, 400, "messages", "context_length_exceeded"),
])
def test_a_bad_request_gets_an_openai_error(client, request_kwargs: dict, status: int, param: str, code: str) -> None:
    args = {"model": "rev", "messages": [{"role": "user", "content": "hi"}], **request_kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**args)
    err = caught.value
    assert err.status_code == status
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["code"] == code
    assert body["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in body["error"]["message"] and body["error"]["message"].strip()


def test_bodies_that_are_not_requests(server: Server) -> None:
    import httpx

    bad_json = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    route = httpx.get(f"{server.url}/v1/embeddings", timeout=30)
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"
    method = httpx.get(f"{server.url}/v1/chat/completions", timeout=30)
    assert method.status_code == 405 and method.json()["error"]["code"] == "method_not_allowed"


def test_a_directory_that_is_not_a_model_is_refused_before_loading(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from finetune.cli import app

    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--port", str(free_port())])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: RUN_OR_MODEL {tmp_path} is neither a run nor a model directory")


@pytest.mark.slow
def test_the_cli_serves_until_interrupted(models: Models) -> None:
    """`finetune serve RUN` in its own process: bound to 127.0.0.1, answers, and stops on Ctrl-C (uvicorn shuts
    down, then the interrupt ends the command with 130, as it ends every command)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "serve", str(models.rev), "--port", str(port), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                names = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.5)
        assert names == ["run-rev", "base"]
        done = client.chat.completions.create(model="run-rev", messages=[{"role": "user", "content": PROMPT}],
                                              temperature=0, max_tokens=MAX_NEW)
        assert done.choices[0].message.content
        with socket.socket() as s:  # not on the machine's other addresses
            s.settimeout(2)
            other = socket.gethostbyname(socket.gethostname())
            if not other.startswith("127."):
                assert s.connect_ex((other, port)) != 0
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Shutting down" in out and "transformers engine" in out and "models: run-rev, base" in out and f"127.0.0.1:{port}" in out
    assert "Traceback" not in out
