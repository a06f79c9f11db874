"""``finetune serve RUN_OR_MODEL``: OpenAI's chat-completions and completions API over what a run trained.

    POST /v1/chat/completions   messages -> the run's prompt format -> an answer (``stream``: server-sent events)
    POST /v1/completions        prompt -> its continuation (``stream`` too)
    GET  /v1/models             the models a request's ``model`` may name

What is served is what ``finetune chat`` loads (:mod:`finetune.inference`): a run's model, its adapter over its
base, a merge or any model directory; with several ``--adapter [NAME=]DIR`` the base is loaded once and each
request's ``model`` picks the adapter (``base``: none). A conversation becomes the prompt the run was trained on
(its chat template, or for an instruction run its evaluation's instruction prompt), so at temperature 0 an
answer is the text ``finetune chat --prompt`` prints.

The engine: vLLM where it is installed and a GPU is there (``--engine auto``), for a whole model or LoRA
adapters over a 16-bit base; everywhere else the transformers engine, which runs the project's own generation
loop (one request at a time: a lock holds the model). The HTTP side is Starlette on uvicorn, bound to
127.0.0.1 unless ``--host`` says otherwise. A bad request is answered as OpenAI answers it: a status and
``{"error": {"message", "type", "param", "code"}}``, never a traceback.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError

INSTALL = "pip install 'uvicorn>=0.30' 'starlette>=0.40' (or pip install -e '.[serve]' in a checkout)"
#: The request fields the server reads; others (``user``, ``frequency_penalty`` at 0 ...) are accepted and ignored.
_UNSUPPORTED = {"n": 1, "logprobs": None, "top_logprobs": None, "tools": None, "functions": None, "stop": None,
                "best_of": 1, "suffix": None, "echo": False, "response_format": None}


@dataclass
class ServeOptions:
    """What ``finetune serve`` was asked (the CLI's flags)."""

    target: str | None = None
    adapters: list[str] = field(default_factory=list)
    base: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_new_tokens: int = 256  # the default max_tokens of a request
    device: str | None = None
    engine: str = "auto"  # auto | transformers | vllm
    trust_remote_code: bool = False


def require_server() -> None:
    """One sentence with the command that installs the server when uvicorn or starlette is missing."""
    missing = [m for m in ("uvicorn", "starlette") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"finetune serve needs {' and '.join(missing)}, which is not installed; {INSTALL}")


class RequestError(Exception):
    """A request the API refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API gives with an error."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------------------------------
# What a request asks
# --------------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    """A request's generation settings, checked."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"`{key}` must be a number, not {json.dumps(value)}", key, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise RequestError(400, f"`{key}` is {value}; it must be in {side}{low}, {high}]", key, "invalid_value")
    return float(value)


def sampling(body: dict[str, Any], default_max: int) -> Sampling:
    """The settings of a request's body, each checked (an OpenAI-style 400 naming the field otherwise)."""
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in (neutral, None, [], ""):
            raise RequestError(400, f"`{key}` is not supported by finetune serve; leave it out", key, "unsupported")
    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    raw = body.get(limit_key)
    if raw is None:
        max_tokens = default_max
    elif isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise RequestError(400, f"`{limit_key}` must be a positive integer, not {json.dumps(raw)}", limit_key,
                           "invalid_value")
    else:
        max_tokens = raw
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RequestError(400, f"`seed` must be an integer, not {json.dumps(seed)}", "seed", "invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"`stream` must be true or false, not {json.dumps(stream)}", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    return Sampling(
        max_tokens,
        _number(body, "temperature", 0.0, 0, 2),  # greedy unless asked, as `finetune chat`
        _number(body, "top_p", 1.0, 0, 1, low_open=True), seed, stream,
        bool(isinstance(options, dict) and options.get("include_usage")),
    )


def messages_of(body: dict[str, Any]) -> list[dict[str, str]]:
    """A chat request's ``messages`` as ``{role, content}`` texts (content parts of type text joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "`messages` must be a non-empty list of {role, content} objects", "messages",
                           "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise RequestError(400, f"`{where}.role` must be system, user or assistant", f"{where}.role",
                               "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(400, f"`{where}.content` may hold text parts only", f"{where}.content",
                                   "invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"`{where}.content` must be a string", f"{where}.content", "invalid_type")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """A piece of an answer's text as it is generated."""

    text: str


@dataclass
class Finished:
    """How an answer ended: ``stop`` or ``length``, and how many tokens it took."""

    finish: str
    tokens: int


class TransformersEngine:
    """The project's generation loop on the loaded model (:func:`finetune.inference.generate`), one request
    at a time; pieces reach the event loop through a queue as the worker thread generates them."""

    name = "transformers"

    def __init__(self, session: Any) -> None:
        self.session = session
        self.lock = threading.Lock()

    def stream(self, model: str | None, ids: list[int], s: Sampling) -> AsyncIterator[Piece | Finished]:
        """The answer to ``ids`` from adapter ``model`` (None: the base; "" a whole model), piece by piece."""
        import torch

        from finetune.inference import generate

        out: queue.Queue[Any] = queue.Queue()
        cancelled = threading.Event()

        def put(text: str) -> None:
            if cancelled.is_set():
                raise _Cancelled
            out.put(Piece(text))

        def work() -> None:
            try:
                with self.lock:
                    if model != "":
                        self.session.use(model)
                    answer = generate(self.session, [ids], max_new_tokens=s.max_tokens, temperature=s.temperature,
                                      top_p=s.top_p, generator=torch.Generator().manual_seed(s.seed), stream=put)[0]
                out.put(Finished(answer.finish, answer.tokens))
            except _Cancelled:
                out.put(None)
            except BaseException as err:  # reaches the client as a server error, never a traceback
                out.put(err)

        async def pieces() -> AsyncIterator[Piece | Finished]:
            threading.Thread(target=work, name="finetune-serve-generate", daemon=True).start()
            try:
                while True:
                    item = await asyncio.to_thread(out.get)
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if isinstance(item, Finished):
                        return
            finally:
                cancelled.set()  # a client that went away stops the generation at its next token

        return pieces()


class _Cancelled(Exception):
    pass


class VllmEngine:
    """vLLM's asynchronous engine over the base (or whole model), LoRA adapters as its LoRA requests; the
    prompts are the same token ids the transformers engine generates from."""

    name = "vllm"

    def __init__(self, model_dir: Path, adapters: dict[str, Path], eos: int | None, ranks: list[int],
                 trust_remote_code: bool = False) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine
        from vllm.lora.request import LoRARequest

        # the model's own code runs on the user's --trust-remote-code only, as with the transformers engine
        args: dict[str, Any] = {"model": str(model_dir), "tokenizer": str(model_dir),
                                "trust_remote_code": trust_remote_code}
        if adapters:
            args.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=max(ranks))
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**args))
        self.loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
        self.eos = eos

    def stream(self, model: str | None, ids: list[int], s: Sampling) -> AsyncIterator[Piece | Finished]:
        """The answer to ``ids`` from adapter ``model`` (None: the base), piece by piece."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=s.seed,
                                stop_token_ids=[self.eos] if self.eos is not None else None)
        lora = self.loras.get(model) if model else None

        async def pieces() -> AsyncIterator[Piece | Finished]:
            shown = ""
            request = uuid.uuid4().hex
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=ids), params, request,
                                                  lora_request=lora):
                done = out.outputs[0]
                if len(done.text) > len(shown):
                    yield Piece(done.text[len(shown):])
                    shown = done.text
                if out.finished:
                    yield Finished("length" if done.finish_reason == "length" else "stop", len(done.token_ids))
                    return

        return pieces()


def vllm_problem(selection: Any) -> str | None:
    """Why vLLM cannot serve ``selection`` here (None: it can)."""
    import torch

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    if not torch.cuda.is_available():
        return "there is no GPU"
    for a in selection.adapters:
        if a.peft_type != "LORA" or a.quantized_base:
            return f"{a.name} is a {a.method} adapter (vLLM serves LoRA adapters over a 16-bit base)"
    return None


# --------------------------------------------------------------------------------------------------
# The service: requests into prompts, answers into OpenAI's objects
# --------------------------------------------------------------------------------------------------


@dataclass
class Service:
    """What the HTTP routes call: the models by id, how each is prompted, and the engine."""

    engine: Any
    formats: dict[str, Any]  # model id -> PromptFormat
    adapter_of: dict[str, str | None]  # model id -> the session's adapter name ("" a whole model, None the base)
    max_positions: int | None
    default_max_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    def model(self, body: dict[str, Any]) -> str:
        """The request's ``model``, one of :meth:`models`."""
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise RequestError(400, "`model` is required: one of " + ", ".join(self.adapter_of), "model", "missing")
        if name not in self.adapter_of:
            raise RequestError(404, f"The model `{name}` does not exist; this server has "
                               + ", ".join(self.adapter_of) + " (GET /v1/models)", "model", "model_not_found")
        return name

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "finetune"}
            for name in self.adapter_of
        ]}

    def check_room(self, ids: list[int], s: Sampling, key: str) -> None:
        """The prompt and the answer must fit in the model's positions."""
        if self.max_positions is not None and len(ids) + s.max_tokens > self.max_positions:
            raise RequestError(
                400, f"This model reads {self.max_positions} positions; the prompt is {len(ids)} tokens and "
                f"max_tokens asks {s.max_tokens} more. Shorten the {key} or lower max_tokens.", key,
                "context_length_exceeded",
            )

    def chat_prompt(self, body: dict[str, Any]) -> tuple[str, list[int], Sampling]:
        """A chat request's model, prompt token ids and settings."""
        name = self.model(body)
        messages = messages_of(body)
        s = sampling(body, self.default_max_tokens)
        try:
            ids = self.formats[name].conversation(messages, "messages")
        except UserError as err:
            raise RequestError(400, str(err), "messages", "invalid_value") from None
        self.check_room(ids, s, "messages")
        return name, ids, s

    def completion_prompt(self, body: dict[str, Any]) -> tuple[str, list[int], Sampling]:
        """A completion request's model, prompt token ids and settings."""
        name = self.model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            ids = self.formats[name].text(prompt)
        else:
            raise RequestError(400, "`prompt` must be a string (or one list of token ids); batches of prompts are "
                               "not supported", "prompt", "invalid_value")
        s = sampling({"max_tokens": 16, **body}, 16)
        self.check_room(ids, s, "prompt")
        return name, ids, s


def _chunk(kind: str, rid: str, created: int, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(service: Service) -> Any:
    """The Starlette application: the three routes, OpenAI-style errors for every failure."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def read(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(400, f"The body is not valid JSON ({err})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "The body must be a JSON object", None, "invalid_json")
        return body

    async def answer(kind: str, rid: str, name: str, ids: list[int], s: Sampling,
                     shape: Callable[[str, str | None], dict[str, Any]]) -> Any:
        adapter = service.adapter_of[name]
        pieces = service.engine.stream(adapter, ids, s)
        if not s.stream:
            text, end = "", Finished("stop", 0)
            async for item in pieces:
                if isinstance(item, Piece):
                    text += item.text
                else:
                    end = item
            body = {"id": rid, "object": kind, "created": int(time.time()), "model": name,
                    "choices": [shape(text, end.finish)], "usage": _usage(len(ids), end.tokens)}
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            created = int(time.time())
            chunk_kind = f"{kind}.chunk" if kind == "chat.completion" else kind
            if kind == "chat.completion":
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield f"data: {json.dumps(_chunk(chunk_kind, rid, created, name, first))}\n\n"
            try:
                async for item in pieces:
                    if isinstance(item, Piece):
                        if item.text:
                            choice = shape(item.text, None)
                            yield f"data: {json.dumps(_chunk(chunk_kind, rid, created, name, choice))}\n\n"
                        continue
                    last = _chunk(chunk_kind, rid, created, name, shape("", item.finish))
                    yield f"data: {json.dumps(last)}\n\n"
                    if s.include_usage:
                        usage = {"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [],
                                 "usage": _usage(len(ids), item.tokens)}
                        yield f"data: {json.dumps(usage)}\n\n"
            except Exception as err:  # the stream has started: the error is its last event
                failed = RequestError(500, f"generation failed: {type(err).__name__}: {err}", None, "internal_error",
                                      "server_error")
                yield f"data: {json.dumps(failed.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chat_completions(request: Request) -> Any:
        try:
            name, ids, s = service.chat_prompt(await read(request))
        except RequestError as err:
            return error(err)

        def shape(text: str, finish: str | None) -> dict[str, Any]:
            if not s.stream:
                return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": None, "finish_reason": finish}
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                    "finish_reason": finish}

        return await answer("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", name, ids, s, shape)

    async def completions(request: Request) -> Any:
        try:
            name, ids, s = service.completion_prompt(await read(request))
        except RequestError as err:
            return error(err)

        def shape(text: str, finish: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        return await answer("text_completion", f"cmpl-{uuid.uuid4().hex}", name, ids, s, shape)

    async def models(request: Request) -> Any:
        return JSONResponse(service.models())

    async def not_found(request: Request, exc: Exception) -> Any:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        what = "method not allowed" if status == 405 else "no such route"
        return error(RequestError(status, f"{request.method} {request.url.path}: {what}; the API is POST "
                                  "/v1/chat/completions, POST /v1/completions, GET /v1/models", None,
                                  "not_found" if status == 404 else "method_not_allowed"))

    async def failed(request: Request, exc: Exception) -> Any:
        return error(RequestError(500, f"the server failed: {type(exc).__name__}: {exc}", None, "internal_error",
                                  "server_error"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: failed})


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def prepare(opts: ServeOptions, scratch: Path) -> tuple[Service, str]:
    """Check, load and wrap what ``opts`` names: the service and the line that says what it serves."""
    from finetune.inference import device_of, load, prompt_format, select

    if opts.engine not in ("auto", "transformers", "vllm"):
        raise UserError(f"--engine {opts.engine} is not one of auto, transformers, vllm")
    selection = select(opts.target, opts.adapters, opts.base, scratch, trust_remote_code=opts.trust_remote_code)
    device = device_of(opts.device)
    tokenizers = selection.tokenizers(opts.trust_remote_code)
    if selection.model is not None:
        ids: dict[str, str | None] = {selection.model.name: ""}
        formats = {selection.model.name: prompt_format(selection.model, tokenizers[""])}
    else:
        ids = {a.name: a.name for a in selection.adapters}
        formats = {a.name: prompt_format(a, tokenizers[a.name]) for a in selection.adapters}
        if selection.adapters[0].kind == "peft":
            ids["base"] = None
            formats["base"] = formats[selection.adapters[0].name]
    problem = vllm_problem(selection) if opts.engine != "transformers" else "--engine transformers"
    if opts.engine == "vllm" and problem is not None:
        raise UserError(f"--engine vllm: {problem}; leave --engine out to serve with transformers")
    if problem is None:
        ranks = [int(a.adapter_config.get("r", 8)) for a in selection.adapters]
        eos = next(iter(tokenizers.values())).eos_token_id
        engine: Any = VllmEngine(selection.model_dir, {a.name: a.path for a in selection.adapters}, eos, ranks,
                                 opts.trust_remote_code)
        what = f"vLLM over {selection.model_dir}"
    else:
        session = load(selection, device=device, trust_remote_code=opts.trust_remote_code)
        engine = TransformersEngine(session)
        what = f"{session.description} (transformers engine{'' if opts.engine == 'transformers' else ': ' + problem})"
    service = Service(engine, formats, ids, selection.max_positions(), opts.max_new_tokens)
    return service, f"{what}; models: {', '.join(ids)}"


def run_serve(opts: ServeOptions, say: Callable[[str], None] = print) -> int:
    """``finetune serve``: load, then answer on ``opts.host:opts.port`` until interrupted. Returns the exit
    code."""
    require_server()
    import uvicorn

    if not 0 < opts.port < 65536:
        raise UserError(f"--port {opts.port} is not a TCP port (1-65535)")
    with tempfile.TemporaryDirectory(prefix="finetune-serve-") as scratch:
        service, what = prepare(opts, Path(scratch))
        say(what)
        server = uvicorn.Server(uvicorn.Config(build_app(service), host=opts.host, port=opts.port, log_level="info"))
        try:
            server.run()
        except SystemExit as stop:  # uvicorn exits 1 when it cannot bind the address
            raise UserError(f"--host {opts.host} --port {opts.port}: the server could not listen there (in use, "
                            "or not an address of this machine); choose another --port") from stop
        return 0 if server.started else 2
