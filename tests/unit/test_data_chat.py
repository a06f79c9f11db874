"""Conversations of agents and reasoning: tool calls, tool results, tools and reasoning reach the chat template,
and the tokens that train are those the template's rendering says, token by token.

The tiny model's tokenizer is byte-level (one token per character, `</s>` is token 2), so each expected label
below is written as the text it stands for.
"""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from finetune.errors import UserError
from finetune.recipe.schema import RecipeError, recipe_with_overrides
from finetune.train.data.formats import Encoder
from tests.support import RECIPES, TINY_MODEL, load, write_jsonl

X = -100
EOS = 2
TEMPLATE = RECIPES / "templates" / "chatml-tools.jinja"
TOOL = {
    "type": "function",
    "function": {"name": "reverse", "description": "Reverse a word.", "parameters": {"type": "object"}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "reverse", "arguments": '{"word": "abc"}'}}
ROW = {
    "tools": [TOOL],
    "messages": [
        {"role": "user", "content": "Reverse abc"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "name": "reverse", "content": "cba"},
        {"role": "assistant", "content": "cba"},
    ],
}
SYSTEM = (
    "<|im_start|>system\n# Tools\n\nYou may call these functions:\n<tools>\n" + json.dumps(TOOL) + "\n</tools>\n\n"
    "To call one, write its name and arguments as JSON inside <tool_call></tool_call>:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
THINK, REASONING, THOUGHT = "<think>\n", "Use the tool.", "\n</think>\n\n"
CALL_TEXT = '<tool_call>\n{"name": "reverse", "arguments": {"word": "abc"}}\n</tool_call><|im_end|>'


def ids(text: str) -> list[int]:
    """Token ids of text under the tiny byte-level tokenizer (`</s>` is the end-of-sequence token)."""
    out: list[int] = []
    for i, part in enumerate(text.split("</s>")):
        out += ([EOS] if i else []) + [{" ": 223, "\n": 201}.get(c, ord(c) - 30) for c in part]
    return out


def expected(*parts: tuple[str, bool]) -> tuple[list[int], list[int]]:
    """Ids and labels of a text given as (piece, trained) pairs."""
    input_ids: list[int] = []
    labels: list[int] = []
    for text, trained in parts:
        t = ids(text)
        input_ids += t
        labels += t if trained else [X] * len(t)
    return input_ids, labels


def rendered(*, reasoning: str, turns: str) -> tuple[list[int], list[int]]:
    """The row under the template, with what trains under data.reasoning and data.assistant_turns."""
    first = turns == "all"
    head = "<|im_start|>user\nReverse abc<|im_end|>\n<|im_start|>assistant\n"
    parts = [(SYSTEM + head, False)]
    if reasoning != "drop":
        parts += [(THINK, first), (REASONING, first and reasoning == "train"), (THOUGHT, first)]
    return expected(
        *parts,
        (CALL_TEXT + "</s>", first),
        ("\n<|im_start|>user\n<tool_response>\ncba\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
        ("cba<|im_end|></s>", True),
        ("\n", False),
    )


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def encoder(tok, template: str | None = None, **options: str) -> Encoder:
    return Encoder(
        tok, "chat", {"messages": "messages", "tools": "tools"}, 4096,
        chat_template=template or TEMPLATE.read_text(), template_name="the test template", **options,
    )


@pytest.mark.parametrize("reasoning", ["train", "mask", "drop"])
@pytest.mark.parametrize("turns", ["all", "last"])
def test_tool_calls_and_reasoning_train_as_the_options_say(tok, reasoning, turns):
    """The call's name and arguments train with the assistant's turn; the tool's result never trains; the
    reasoning trains (train), stays in the context untrained (mask: only its own characters, the <think> marks
    train) or is gone (drop); `last` trains only the final answer."""
    enc = encoder(tok, reasoning=reasoning, assistant_turns=turns).encode(copy.deepcopy(ROW))
    assert (enc.input_ids, enc.labels) == rendered(reasoning=reasoning, turns=turns)


def test_generation_marks_and_prefix_rendering_find_the_same_tokens(tok):
    """Without its generation marks the template's assistant turns are found by rendering prefix by prefix; the
    reasoning by the marker put in its place: the labels are those of the marks."""
    marks = TEMPLATE.read_text()
    plain = marks.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert encoder(tok, marks).generation_marks and not encoder(tok, plain).generation_marks
    for reasoning in ("train", "mask", "drop"):
        for turns in ("all", "last"):
            a = encoder(tok, marks, reasoning=reasoning, assistant_turns=turns).encode(copy.deepcopy(ROW))
            b = encoder(tok, plain, reasoning=reasoning, assistant_turns=turns).encode(copy.deepcopy(ROW))
            assert (a.input_ids, a.labels) == (b.input_ids, b.labels) == rendered(reasoning=reasoning, turns=turns)


def test_the_text_is_transformers_own_rendering(tok):
    """The encoder renders what apply_chat_template renders, tools, tool calls and reasoning included."""
    enc = encoder(tok)
    row = copy.deepcopy(ROW)
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"word": "abc"}
    want = tok.apply_chat_template(row["messages"], tools=row["tools"], chat_template=enc.chat_template, tokenize=False)
    assert tok.decode(enc.encode(copy.deepcopy(ROW)).input_ids) == want


def test_reasoning_spellings_and_layouts_are_one(tok):
    """`thinking` and `reasoning` spell reasoning_content; a flat call {name, arguments} and arguments given as an
    object are the OpenAI layout's call; a flat tool is a function schema."""
    want = encoder(tok, reasoning="mask").encode(copy.deepcopy(ROW))
    for key in ("thinking", "reasoning"):
        row = copy.deepcopy(ROW)
        row["messages"][1][key] = row["messages"][1].pop("reasoning_content")
        row["messages"][1]["tool_calls"] = [{"id": "c1", "name": "reverse", "arguments": {"word": "abc"}}]
        row["tools"] = [TOOL["function"]]
        got = encoder(tok, reasoning="mask").encode(row)
        assert (got.input_ids, got.labels) == (want.input_ids, want.labels)


def test_exact_match_prompts_of_agent_rows(tok):
    """The eval prompt runs up to the last assistant message, tools and tool results included; a row whose last
    message calls a tool or reasons has none (its text is more than its content)."""
    enc = encoder(tok).encode(copy.deepcopy(ROW))
    assert enc.answer == "cba"
    assert tok.decode(enc.prompt_ids) == tok.decode(enc.input_ids)[: -len("cba<|im_end|></s>\n")]
    calls_last = copy.deepcopy(ROW)
    calls_last["messages"] = calls_last["messages"][:2]
    assert encoder(tok).encode(calls_last).prompt_ids == []


BAD = [
    # (what is wrong, the change, the field and the message)
    ("a call without a name", lambda r: r["messages"][1]["tool_calls"][0]["function"].pop("name"),
     "messages[1].tool_calls[0].function.name", "missing: the function's name"),
    ("arguments that are not JSON",
     lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{word: abc}"),
     "messages[1].tool_calls[0].function.arguments",
     "not valid JSON (Expecting property name enclosed in double quotes at column 2); write an object, or the JSON "
     "text of one"),
    ("arguments that are not an object", lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="[1]"),
     "messages[1].tool_calls[0].function.arguments", "expected an object of arguments (or its JSON text), got a list"),
    ("a call of a function the row's tools do not have",
     lambda r: r["messages"][1]["tool_calls"][0]["function"].update(name="rot13"),
     "messages[1].tool_calls[0].function.name", "calls `rot13`, which is not among the row's tools (reverse)"),
    ("a tool message with no call before it", lambda r: r["messages"].insert(1, {"role": "tool", "content": "x"}),
     "messages[1]", "a tool message with no tool call before it; a tool's result follows the assistant message whose "
     "tool_calls asked for it"),
    ("a tool message answering an unknown call", lambda r: r["messages"][2].update(tool_call_id="c9"),
     "messages[2].tool_call_id", "`c9` is not the id of a call of messages[1] waiting for its result (`c1`)"),
    ("two results for one call", lambda r: r["messages"].insert(3, {"role": "tool", "content": "cba"}),
     "messages[3]", "one tool result too many: each of the 1 call(s) of messages[1] already has its result"),
    ("reasoning twice, different", lambda r: r["messages"][1].update(thinking="Other."),
     "messages[1].thinking", "differs from `reasoning_content`; keep one of them"),
    ("reasoning on a user message", lambda r: r["messages"][0].update(reasoning_content="Hm."),
     "messages[0].reasoning_content", "only assistant messages carry reasoning (this one's role is `user`)"),
    ("tools that are not a list", lambda r: r.update(tools={"name": "reverse"}),
     "tools", 'expected a list of function schemas ({"type": "function", "function": {"name", "parameters"}}), got '
     "an object"),
]


@pytest.mark.parametrize(("what", "change", "field", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_agent_rows_name_file_line_and_field(tmp_path, tok, what, change, field, message):
    row = copy.deepcopy(ROW)
    change(row)
    f = write_jsonl(tmp_path / "agent.jsonl", [ROW, row])
    with pytest.raises(UserError) as err:
        load(tmp_path, tok, train=str(f), format="chat", chat_template=str(TEMPLATE))
    assert str(err.value).startswith(f"{f}:2: field `{field}`: {message}")


def test_a_template_that_does_not_render_a_field_is_a_bad_row(tmp_path, tok):
    """tiny-llama's own template renders role and content only: a tool call or reasoning it would drop is an error
    naming the field and the template; with data.reasoning: drop the reasoning is removed first, and trains."""
    call = [*copy.deepcopy(ROW["messages"][:2]), {"role": "assistant", "content": "done"}]
    call[1]["content"] = "calling"
    del call[1]["reasoning_content"]
    thinks = [{"role": "user", "content": "Rev: abc"}, {"role": "assistant", "content": "cba", "thinking": "Backwards."}]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": call}])
    with pytest.raises(UserError) as err:
        load(tmp_path, tok, train=str(f), format="chat")
    assert str(err.value).startswith(
        f"{f}:1: field `messages[1].tool_calls[0].function.name`: the chat template of `{TINY_MODEL}` does not render "
        "tool calls, so this would be lost from training; set data.chat_template to a template that does "
        "(recipes/templates/chatml-tools.jinja renders tools, tool calls and reasoning)"
    )
    f = write_jsonl(tmp_path / "t.jsonl", [{"messages": thinks}])
    with pytest.raises(UserError) as err:
        load(tmp_path, tok, train=str(f), format="chat")
    assert str(err.value).startswith(
        f"{f}:1: field `messages[1].thinking`: the chat template of `{TINY_MODEL}` does not render reasoning"
    )
    assert "; or set data.reasoning: drop to train without it" in str(err.value)
    dropped = load(tmp_path, tok, train=str(f), format="chat", reasoning="drop")
    sample = dropped.samples[0]
    assert tok.decode(sample.input_ids) == "User: Rev: abc\nAssistant: cba</s>\n"


def test_sources_count_every_row_and_trained_tokens(tmp_path, tok):
    """Each source's rows are used + held out + dropped + bad; trained_tokens are the labels the loss counts."""
    bad = copy.deepcopy(ROW)
    bad["messages"][2]["tool_call_id"] = "c9"
    f = write_jsonl(tmp_path / "a.jsonl", [ROW] * 9 + [bad])
    data = load(
        tmp_path, tok, train=str(f), format="chat", chat_template=str(TEMPLATE), on_bad_row="skip",
        eval_fraction=0.25, reasoning="mask", max_seq_len=1024,
    )
    (src,) = data.sources
    assert (src.key, src.name, src.rows, src.rows_used, src.held_out, src.dropped, src.bad, src.truncated) == (
        "data.train", str(f), 10, 7, 2, 0, 1, 0
    )
    per_row = sum(label != X for label in rendered(reasoning="mask", turns="all")[1][1:])
    assert src.trained_tokens == data.stats["trained_tokens"] == 7 * per_row
    assert src.tokens == data.stats["tokens"] == 7 * len(rendered(reasoning="mask", turns="all")[0])
    assert len(data.where) == len(data.samples) == 7 and data.where[0].startswith(f"{f}:")
    assert data.bad == [f"{f}:10: field `messages[2].tool_call_id`: `c9` is not the id of a call of messages[1] "
                        "waiting for its result (`c1`)"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"reasoning": "mask"}, "data: `data.reasoning: mask` chooses what a conversation trains on, but data.format "
         "is instruction; set data.format: chat, or remove data.reasoning"),
        ({"format": "chat", "assistant_turns": "last", "train_on_prompt": True},
         "data: data.train_on_prompt trains every token, so `data.assistant_turns: last` would change nothing; "
         "remove one of them"),
    ],
)
def test_the_chat_options_are_refused_where_they_mean_nothing(data, message):
    raw = {"model": {"path": str(TINY_MODEL)}, "data": {"train": "t.jsonl", **data}}
    with pytest.raises(RecipeError) as err:
        recipe_with_overrides(raw, [])
    assert [str(p) for p in err.value.problems] == [message]


def test_chat_input_rows_are_read_as_training_reads_them(tok):
    """`finetune chat --input` answers an agent row up to its last assistant message, with the prompt its
    evaluation built; a row ending with a call has no expected answer."""
    from finetune.inference import PromptFormat

    enc = encoder(tok)
    fmt = PromptFormat("chat", tok, enc, {"messages": "messages", "tools": "tools"})
    assert fmt.row(copy.deepcopy(ROW), "in.jsonl:1", None) == (enc.encode(copy.deepcopy(ROW)).prompt_ids, "cba")
    calls_last = copy.deepcopy(ROW)
    calls_last["messages"] = calls_last["messages"][:2]
    assert fmt.row(calls_last, "in.jsonl:2", None)[1] is None
    bad = copy.deepcopy(ROW)
    bad["messages"][2]["tool_call_id"] = "c9"
    with pytest.raises(UserError, match=r"^in.jsonl:3: field `messages\[2\].tool_call_id`: `c9` is not the id"):
        fmt.row(bad, "in.jsonl:3", None)
