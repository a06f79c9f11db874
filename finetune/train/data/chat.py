"""The chat format: a row's conversation checked and put in one layout for the chat template, and the characters
of the rendered text that train.

A conversation is a list of messages in OpenAI's layout:

- ``{"role": "system" | "user" | ..., "content": str}``;
- ``{"role": "assistant", "content": str | null, "tool_calls": [...], "reasoning_content": str}``: a tool call is
  ``{"type": "function", "function": {"name", "arguments"}, "id"}`` (or ``{"name", "arguments"}``), its arguments
  an object or the JSON text of one; the reasoning may be spelled ``thinking`` or ``reasoning``;
- ``{"role": "tool", "content": str, "tool_call_id", "name"}``: the result of a call made by the assistant message
  before it;

and the row's ``tools`` (``data.columns.tools``) are the function schemas the template shows the model. Each is
checked, a bad one named by its field (``messages[2].tool_calls[0].function.arguments``), and handed to the template
in one layout: tool calls nested under ``function`` with their arguments as an object, tools as
``{"type": "function", "function": {...}}``, reasoning as ``reasoning_content`` (transformers shows it to templates
as ``thinking`` too).

What trains is found by rendering, never by guessing token ids: an assistant message's characters are its
``{% generation %}`` block when the template has those marks, else the text between the conversation before it
(with the generation prompt) and the conversation up to it. Under ``data.reasoning: mask`` a message's reasoning is
found by rendering the conversation once more with a marker in its place: the characters the marker stands for.
A token trains when it overlaps a trained span and no masked one.

A template that does not render something a row holds (a tool call's name or arguments, a tool's result, a tool
schema, the reasoning) would drop it from training without a word. So each of them is rendered once with a marker
in its place, and a marker missing from the text is a bad row naming the field and the template.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from finetune.objectives.loss import IGNORE_INDEX
from finetune.train.data.rows import BadRow, describe, list_value

#: The spellings of an assistant message's reasoning, the first one present wins.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
#: A template's marks around what the assistant writes.
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: The shipped template that renders every field of a conversation.
FULL_TEMPLATE = "recipes/templates/chatml-tools.jinja"


def _marker(i: int) -> str:
    """A stand-in for a field's text: letters and digits, which tojson, trim and escaping leave as they are."""
    return f"ftmark{i}q"


@dataclass
class Conversation:
    """A row's messages as the template sees them, its tools, and the names of the row's fields (for errors)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    column: str  # data.columns.messages
    tools_column: str  # data.columns.tools
    reasoning_keys: dict[int, str] = field(default_factory=dict)  # message index -> the row's spelling

    @property
    def assistants(self) -> list[int]:
        """Indices of the assistant messages."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def read_conversation(
    row: dict[str, Any], column: str, tools_column: str, *, reasoning: str, need_assistant: bool
) -> Conversation:
    """The row's conversation, checked message by message (raises :class:`BadRow`); under ``reasoning``
    ``drop`` the assistant messages' reasoning is left out."""
    if column not in row:
        raise BadRow(column, "missing (set data.columns.messages if your data names it differently)")
    msgs = list_value(row[column])
    if not isinstance(msgs, list):
        raise BadRow(column, f"expected a list of {{role, content}} messages, got {describe(msgs)}")
    if not msgs:
        raise BadRow(column, "the conversation is empty")
    conv = Conversation([], _tools(row, tools_column), column, tools_column)
    declared = {t["function"]["name"] for t in conv.tools or []}
    waiting: list[dict[str, Any]] = []  # the calls of the last assistant message that have no result yet
    caller: int | None = None  # that message's index
    made = 0  # how many calls it made
    for i, m in enumerate(msgs):
        where = f"{column}[{i}]"
        if not isinstance(m, dict):
            raise BadRow(where, f"expected an object with role and content, got {describe(m)}")
        if "role" not in m:
            raise BadRow(f"{where}.role", "missing")
        role = m["role"]
        if not isinstance(role, str):
            raise BadRow(f"{where}.role", f"expected a string, got {describe(role)}")
        if role == "assistant":
            msg, key = _assistant(m, where, reasoning, declared, conv.tools_column)
            if key is not None:
                conv.reasoning_keys[i] = key
            waiting, caller = list(msg.get("tool_calls", [])), i
            made = len(waiting)
        elif role == "tool":
            msg = _tool_result(m, where, waiting, None if caller is None else f"{column}[{caller}]", made)
        else:
            for key in ("tool_calls", *REASONING_KEYS):
                if m.get(key) is not None:
                    what = "tool calls" if key == "tool_calls" else "reasoning"
                    raise BadRow(f"{where}.{key}", f"only assistant messages carry {what} (this one's role is `{role}`)")
            msg = {"role": role, "content": _content(m, where)}
            waiting, caller = [], None
        conv.messages.append(msg)
    if need_assistant and not conv.assistants:
        raise BadRow(column, "the conversation has no assistant message, so nothing to learn from")
    return conv


def _content(m: dict[str, Any], where: str) -> str:
    if "content" not in m:
        raise BadRow(f"{where}.content", "missing")
    if not isinstance(m["content"], str):
        raise BadRow(f"{where}.content", f"expected a string, got {describe(m['content'])}")
    return m["content"]


def _assistant(
    m: dict[str, Any], where: str, reasoning: str, declared: set[str], tools_column: str
) -> tuple[dict[str, Any], str | None]:
    """An assistant message in the template's layout, and the key its reasoning was under (None: none)."""
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls", declared, tools_column)
    # a message that only calls tools may have no content (OpenAI writes null)
    content = "" if calls and m.get("content") is None else _content(m, where)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    found = [(k, m[k]) for k in REASONING_KEYS if m.get(k) is not None]
    for k, v in found:
        if not isinstance(v, str):
            raise BadRow(f"{where}.{k}", f"expected the reasoning as a string, got {describe(v)}")
    if len({v for _, v in found}) > 1:
        raise BadRow(f"{where}.{found[1][0]}", f"differs from `{found[0][0]}`; keep one of them")
    if not found or not found[0][1]:
        return msg, None
    if reasoning != "drop":
        msg["reasoning_content"] = found[0][1]
    return msg, found[0][0]


def _function(value: dict[str, Any], where: str, what: str) -> tuple[dict[str, Any], str]:
    """The function object of a tool call or a tool (nested under ``function``, or the object itself) and its
    field's name."""
    kind = value.get("type", "function")
    if kind != "function":
        raise BadRow(f"{where}.type", f"expected `function`, got {describe(kind)}")
    if "function" in value:
        fn, at = value["function"], f"{where}.function"
        if not isinstance(fn, dict):
            raise BadRow(at, f"expected an object with the function's name, got {describe(fn)}")
    elif "name" in value:
        fn, at = value, where
    else:
        raise BadRow(f"{where}.function", f"missing: {what}")
    name = fn.get("name")
    if name is None:
        raise BadRow(f"{at}.name", "missing: the function's name")
    if not isinstance(name, str) or not name.strip():
        raise BadRow(f"{at}.name", f"expected the function's name, got {describe(name)}")
    return fn, at


def _tool_calls(value: Any, where: str, declared: set[str], tools_column: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, each as ``{"type": "function", "function": {"name", "arguments": {...}}}``
    (with its ``id`` when it has one)."""
    if value is None:
        return []
    value = list_value(value)
    if not isinstance(value, list):
        raise BadRow(where, f"expected a list of tool calls, got {describe(value)}")
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise BadRow(
                at, f'expected a tool call ({{"type": "function", "function": {{"name", "arguments"}}}}), got {describe(call)}'
            )
        fn, fat = _function(call, at, 'a tool call names its function and arguments: {"function": {"name", "arguments"}}')
        if declared and fn["name"] not in declared:
            raise BadRow(
                f"{fat}.name",
                f"calls `{fn['name']}`, which is not among the row's {tools_column} ({', '.join(sorted(declared))})",
            )
        if "arguments" not in fn:
            raise BadRow(f"{fat}.arguments", "missing: the call's arguments, an object ({} for none)")
        args = fn["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                raise BadRow(
                    f"{fat}.arguments",
                    f"not valid JSON ({exc.msg} at column {exc.colno}); write an object, or the JSON text of one",
                ) from None
        if not isinstance(args, dict):
            raise BadRow(f"{fat}.arguments", f"expected an object of arguments (or its JSON text), got {describe(args)}")
        done: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise BadRow(f"{at}.id", f"expected a string, got {describe(call['id'])}")
            done["id"] = call["id"]
        out.append(done)
    return out


def _tool_result(
    m: dict[str, Any], where: str, waiting: list[dict[str, Any]], caller: str | None, made: int
) -> dict[str, Any]:
    """A tool message: the result of one of ``waiting``, the calls of the assistant message ``caller`` (which made
    ``made`` calls) that have no result yet; the call answered is taken off the list."""
    content = _content(m, where)
    if caller is None or not made:
        before = "" if caller is None else f" ({caller} made none)"
        raise BadRow(where, f"a tool message with no tool call before it{before}; a tool's result follows the "
                     "assistant message whose tool_calls asked for it")
    if not waiting:
        raise BadRow(where, f"one tool result too many: each of the {made} call(s) of {caller} already has its result")
    msg: dict[str, Any] = {"role": "tool", "content": content}
    answered = waiting[0]
    cid = m.get("tool_call_id")
    if cid is not None:
        if not isinstance(cid, str):
            raise BadRow(f"{where}.tool_call_id", f"expected a string, got {describe(cid)}")
        ids = [c["id"] for c in waiting if "id" in c]
        if ids:
            match = next((c for c in waiting if c.get("id") == cid), None)
            if match is None:
                raise BadRow(
                    f"{where}.tool_call_id",
                    f"`{cid}` is not the id of a call of {caller} waiting for its result "
                    f"({', '.join(f'`{i}`' for i in ids)})",
                )
            answered = match
        msg["tool_call_id"] = cid
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise BadRow(f"{where}.name", f"expected a string, got {describe(name)}")
        if cid is None:  # without ids, the result of the first waiting call of that function
            answered = next((c for c in waiting if c["function"]["name"] == name), answered)
        if answered["function"]["name"] != name:
            names = ", ".join(f"`{c['function']['name']}`" for c in waiting)
            raise BadRow(f"{where}.name", f"`{name}` is not the function of a call of {caller} waiting for its result ({names})")
        msg["name"] = name
    waiting.remove(answered)
    return msg


def _tools(row: dict[str, Any], column: str) -> list[dict[str, Any]] | None:
    """The row's function schemas, each as ``{"type": "function", "function": {"name", ...}}`` (None: none)."""
    value = row.get(column)
    if value is None:
        return None
    value = list_value(value)
    if not isinstance(value, list):
        raise BadRow(
            column, f'expected a list of function schemas ({{"type": "function", "function": {{"name", "parameters"}}}}), '
            f"got {describe(value)}"
        )
    out = []
    for j, tool in enumerate(value):
        at = f"{column}[{j}]"
        if not isinstance(tool, dict):
            raise BadRow(at, f"expected a function schema (an object), got {describe(tool)}")
        fn, fat = _function(tool, at, 'a tool is a function schema: {"function": {"name", "description", "parameters"}}')
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRow(f"{fat}.parameters", f"expected a JSON schema (an object), got {describe(params)}")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if k != "type"}})
    return out or None


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


@dataclass
class ChatTemplate:
    """A chat template and its tokenizer's special tokens; ``name`` says which template it is in messages."""

    tokenizer: Any
    text: str
    name: str

    @property
    def marks(self) -> bool:
        """Whether the template marks what the assistant writes with ``{% generation %}``."""
        return bool(GENERATION_MARK.search(self.text))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
        add_generation_prompt: bool = False,
    ) -> str:
        """The conversation as text (``apply_chat_template(tokenize=False)``'s text, an empty conversation too)."""
        return self._render(messages, tools, add_generation_prompt, False)[0]

    def render_marked(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and the character span of each ``{% generation %}`` block in it."""
        return self._render(messages, tools, False, True)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: bool, marked: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        # apply_chat_template's own renderer, with the special tokens it passes; it also renders the generation
        # prompt of an empty conversation (the text before a first assistant message)
        from transformers.utils.chat_template_utils import render_jinja_template

        schemas: Any = tools
        rendered: Any = render_jinja_template(  # annotated as str, returns (texts, generation spans)
            conversations=[messages], tools=schemas, chat_template=self.text, add_generation_prompt=prompt,
            return_assistant_tokens_mask=marked, **self.tokenizer.special_tokens_map,
        )
        texts, blocks = rendered
        return texts[0], [(int(a), int(b)) for a, b in blocks[0]] if marked else []


def render_checked(t: ChatTemplate, conv: Conversation) -> str:
    """The conversation as text; a template that refuses it names the first message it refuses."""
    try:
        return t.render(conv.messages, conv.tools)
    except Exception as exc:  # a template raises what it likes (raise_exception, a type error in its own code)
        for j in range(1, len(conv.messages) + 1):
            try:
                t.render(conv.messages[:j], conv.tools)
            except Exception:
                raise BadRow(
                    f"{conv.column}[{j - 1}].role",
                    f"{t.name} refuses this message (role `{conv.messages[j - 1]['role']}`: {exc})",
                ) from None
        raise BadRow(conv.column, f"{t.name} refuses the conversation ({exc})") from None


def check_rendered(t: ChatTemplate, conv: Conversation) -> None:
    """Every tool call's name and arguments, tool result, tool schema and reasoning of the conversation shows in
    the template's text; the first that does not is a :class:`BadRow` naming it."""
    msgs, tools = copy.deepcopy(conv.messages), copy.deepcopy(conv.tools)
    fields: list[tuple[str, str]] = []  # (the field, what it is), the i-th stood for by _marker(i)

    def mark(field: str, what: str) -> str:
        fields.append((field, what))
        return _marker(len(fields) - 1)

    col = conv.column
    for i, m in enumerate(msgs):
        for j, call in enumerate(m.get("tool_calls", [])):
            fn = call["function"]
            fn["name"] = mark(f"{col}[{i}].tool_calls[{j}].function.name", "tool calls")
            fn["arguments"] = {mark(f"{col}[{i}].tool_calls[{j}].function.arguments", "tool calls' arguments"): 0}
        if m["role"] == "tool":
            m["content"] = mark(f"{col}[{i}].content", "tool results")
        if "reasoning_content" in m:
            m["reasoning_content"] = mark(f"{col}[{i}].{conv.reasoning_keys[i]}", "reasoning")
    for j, tool in enumerate(tools or []):
        tool["function"]["name"] = mark(f"{conv.tools_column}[{j}].function.name", "tools")
    if not fields:
        return
    try:
        text = t.render(msgs, tools)
    except Exception as exc:
        raise BadRow(col, f"{t.name} fails when its tool calls, tool results and reasoning are checked ({exc})") from None
    for i, (name, what) in enumerate(fields):
        if _marker(i) not in text:
            drop = "; or set data.reasoning: drop to train without it" if what == "reasoning" else ""
            raise BadRow(
                name,
                f"{t.name} does not render {what}, so this would be lost from training; set data.chat_template to "
                f"a template that does ({FULL_TEMPLATE} renders tools, tool calls and reasoning){drop}",
            )


def assistant_spans(t: ChatTemplate, conv: Conversation, text: str, turns: list[int]) -> list[tuple[int, int]]:
    """The character spans of the assistant messages ``turns`` in ``text`` (the conversation rendered)."""
    if not turns:
        return []
    if t.marks:
        marked, blocks = t.render_marked(conv.messages, conv.tools)
        assert marked == text, "rendering with and without the generation tracker gives one text"
        if turns == conv.assistants:
            return blocks
        if len(blocks) != len(conv.assistants):
            raise BadRow(
                conv.column,
                f"data.assistant_turns: last needs one {{% generation %}} block per assistant message, and {t.name} "
                f"renders {len(blocks)} for {len(conv.assistants)}",
            )
        block = dict(zip(conv.assistants, blocks, strict=True))
        return [block[k] for k in turns]
    spans = []
    for k in turns:
        before = t.render(conv.messages[:k], conv.tools, add_generation_prompt=True)
        upto = t.render(conv.messages[: k + 1], conv.tools)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise BadRow(
                conv.column,
                f"{t.name} does not render this conversation prefix by prefix, so the assistant tokens cannot be "
                "found; mark them with {% generation %}...{% endgeneration %} in data.chat_template",
            )
        spans.append((len(before), len(upto.rstrip())))
    return spans


def reasoning_spans(t: ChatTemplate, conv: Conversation, text: str, turns: list[int]) -> list[tuple[int, int]]:
    """The character spans of the reasoning of the assistant messages ``turns`` in ``text``: the conversation is
    rendered once per reasoning with a marker in its place, and the reasoning is what the marker stands for."""
    spans = []
    for k in turns:
        if "reasoning_content" not in conv.messages[k]:
            continue
        field = f"{conv.column}[{k}].{conv.reasoning_keys[k]}"
        msgs = list(conv.messages)
        msgs[k] = {**msgs[k], "reasoning_content": _marker(0)}
        marked = t.render(msgs, conv.tools)
        at = marked.find(_marker(0))
        if at < 0:  # check_rendered has found it rendered with the other messages as they are
            raise BadRow(field, f"{t.name} renders this reasoning only beside some other messages")
        if marked.find(_marker(0), at + 1) >= 0:
            raise BadRow(field, f"{t.name} renders the reasoning twice, so which copy to mask cannot be told")
        before, after = marked[:at], marked[at + len(_marker(0)) :]
        if not (text.startswith(before) and text.endswith(after) and len(before) + len(after) <= len(text)):
            raise BadRow(
                field,
                f"{t.name} renders the rest of the conversation differently for another reasoning, so the reasoning's "
                "tokens cannot be found",
            )
        spans.append((len(before), len(text) - len(after)))
    return spans


def span_labels(
    ids: list[int], offsets: list[tuple[int, int]], trained: list[tuple[int, int]], masked: list[tuple[int, int]]
) -> list[int]:
    """Labels of the tokens at character ``offsets``: the token where it overlaps a ``trained`` span and no
    ``masked`` one, else IGNORE_INDEX."""

    def overlaps(a: int, b: int, spans: list[tuple[int, int]]) -> bool:
        return any(a < e and s < b for s, e in spans)

    return [
        t if b > a and overlaps(a, b, trained) and not overlaps(a, b, masked) else IGNORE_INDEX
        for t, (a, b) in zip(ids, offsets, strict=True)
    ]
