"""Each data format end to end into Examples, with the label masks asserted token by token.

The tiny model's tokenizer is byte-level: printable ASCII character c is token ord(c) - 30, space is 223,
newline 201, </s> is 2; so every expected id below can be checked by hand.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from finetune.errors import UserError
from finetune.train.data.formats import Encoder
from tests.support import CONVERSATION, TINY_MODEL, load, write_jsonl

X = -100
EOS = 2


def ids(text: str) -> list[int]:
    """Token ids of ASCII text under the tiny byte-level tokenizer."""
    return [{" ": 223, "\n": 201}.get(c, ord(c) - 30) for c in text]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)






def test_byte_ids_match_the_tokenizer(tok):
    assert tok("Ab c\n", add_special_tokens=False)["input_ids"] == [35, 68, 223, 69, 201] == ids("Ab c\n")
    assert tok.eos_token_id == EOS


def test_instruction_labels_only_the_output(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "t.jsonl",
        [{"instruction": "Rev", "input": "ab", "output": "ba"}, {"instruction": "Hi", "output": "yo"}],
    )
    data = load(tmp_path, tok, train=str(f), eval=str(f), format="instruction")
    prompt = ids("Rev\nab\nAnswer: ")
    assert data.train[0].input_ids == prompt + ids("ba") + [EOS]
    assert data.train[0].labels == [X] * len(prompt) + ids("ba") + [EOS]
    # no input: no input line
    prompt2 = ids("Hi\nAnswer: ")
    assert data.train[1].input_ids == prompt2 + ids("yo") + [EOS]
    assert data.train[1].labels == [X] * len(prompt2) + ids("yo") + [EOS]
    assert [(p.prompt_ids, p.answer) for p in data.eval_prompts] == [(prompt, "ba"), (prompt2, "yo")]
    on_prompt = load(tmp_path, tok, train=str(f), format="instruction", train_on_prompt=True)
    assert on_prompt.train[0].labels == on_prompt.train[0].input_ids


def test_instruction_custom_columns(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"q": "Rev", "ctx": "ab", "a": "ba"}])
    data = load(
        tmp_path,
        tok,
        train=str(f),
        format="instruction",
        columns={"instruction": "q", "input": "ctx", "output": "a"},
    )
    assert data.train[0].input_ids == [*ids("Rev\nab\nAnswer: ba"), EOS]


def test_text_every_token_counts(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"body": "hi there"}])
    data = load(tmp_path, tok, train=str(f), format="text", columns={"text": "body"})
    assert data.train[0].input_ids == [*ids("hi there"), EOS]
    assert data.train[0].labels == [*ids("hi there"), EOS]
    assert data.eval_prompts == []




def expected_chat() -> tuple[list[int], list[int]]:
    parts = [
        ("System: Be brief.\nUser: Rev: abc\nAssistant: ", False),
        ("cba", True),
        ("</s>", True),
        ("\nUser: x\nAssistant: ", False),
        ("y", True),
        ("</s>", True),
        ("\n", False),
    ]
    input_ids: list[int] = []
    labels: list[int] = []
    for text, counts in parts:
        t = [EOS] if text == "</s>" else ids(text)
        input_ids += t
        labels += t if counts else [X] * len(t)
    return input_ids, labels


def test_chat_labels_only_assistant_turns(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    data = load(tmp_path, tok, train=str(f), eval=str(f), format="chat")
    want_ids, want_labels = expected_chat()
    assert data.train[0].input_ids == want_ids
    assert data.train[0].labels == want_labels
    # the eval prompt: everything up to the last assistant turn, with the generation prompt
    p = data.eval_prompts[0]
    assert p.prompt_ids == [
        *ids("System: Be brief.\nUser: Rev: abc\nAssistant: cba"),
        EOS,
        *ids("\nUser: x\nAssistant: "),
    ]
    assert p.answer == "y"


def test_chat_mask_without_generation_marks_agrees(tmp_path, tok):
    """A template without {% generation %} marks: assistant turns found by rendering prefix by prefix."""
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    enc_marks = Encoder(tok, "chat", {"messages": "messages"}, 512, chat_template=tok.chat_template)
    enc_plain = Encoder(tok, "chat", {"messages": "messages"}, 512, chat_template=plain)
    assert enc_marks.generation_marks and not enc_plain.generation_marks
    a = enc_marks.encode({"messages": CONVERSATION})
    b = enc_plain.encode({"messages": CONVERSATION})
    assert (a.input_ids, a.labels) == (b.input_ids, b.labels) == expected_chat()


def test_chat_template_from_recipe_file(tmp_path, tok):
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{{ m['role'][0] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}a>{% endif %}"
    )
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION[1:3]}])
    data = load(tmp_path, tok, train=str(f), format="chat", chat_template="t.jinja")
    assert data.train[0].input_ids == [*ids("u>Rev: abc\na>cba"), EOS, *ids("\n")]
    assert data.train[0].labels == [X] * len(ids("u>Rev: abc\na>")) + ids("cba") + [EOS, X]


def test_chat_without_template_is_a_clear_error(tmp_path):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = None
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(UserError, match=r"data.chat_template: the tokenizer of .* has no chat template"):
        load(tmp_path, tok, train=str(f), format="chat")


def test_tokenized_rows_pass_through(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "k.jsonl",
        [{"input_ids": [5, 6, 7, 2], "labels": [X, X, 7, 2]}, {"input_ids": [9, 10, 2]}],
    )
    data = load(tmp_path, tok, train=str(f), format="tokenized")
    assert (data.train[0].input_ids, data.train[0].labels) == ([5, 6, 7, 2], [X, X, 7, 2])
    assert (data.train[1].input_ids, data.train[1].labels) == ([9, 10, 2], [9, 10, 2])


def test_shipped_tokenized_data_equals_instruction_encoding(tmp_path, tok):
    """scripts/make_data.py's pre-tokenized rows are exactly what the instruction format makes of the same rows."""
    root = TINY_MODEL.parent.parent / "data"
    first_tok = json.loads((root / "uppercase-tokenized/train.jsonl").open().readline())
    first_row = json.loads((root / "uppercase/train.jsonl").open().readline())
    enc = Encoder(
        tok, "instruction", {"instruction": "instruction", "input": "input", "output": "output"}, 512
    )
    e = enc.encode(first_row)
    assert (first_tok["input_ids"], first_tok["labels"]) == (e.input_ids, e.labels)


def test_reworded_reversal_is_the_reversal_data_under_another_instruction():
    """The prefix quickstart's data is the quickstart's rows (words, split, answers) with only the instruction
    changed, so its held-out words are held out from the base's training too."""
    root = TINY_MODEL.parent.parent / "data"
    for split in ("train.jsonl", "eval.jsonl"):
        plain = [json.loads(line) for line in (root / "reverse" / split).open()]
        reworded = [json.loads(line) for line in (root / "reverse-reworded" / split).open()]
        assert [{**r, "instruction": "Spell it backwards."} for r in plain] == reworded
    train = {json.loads(line)["input"] for line in (root / "reverse/train.jsonl").open()}
    held_out = {json.loads(line)["input"] for line in (root / "reverse-reworded/eval.jsonl").open()}
    assert len(held_out) == 200 and not held_out & train


def test_truncation_and_drop_long_counted_once(tmp_path, tok):
    rows = [{"text": "ab"}, {"text": "x" * 20}, {"text": "y" * 30}]
    f = write_jsonl(tmp_path / "t.jsonl", rows)
    data = load(tmp_path, tok, train=str(f), format="text", max_seq_len=10)
    assert data.stats["truncated"] == 2 and data.stats["dropped"] == 0
    assert [len(e.input_ids) for e in data.train] == [3, 10, 10]
    assert data.train[1].input_ids == ids("x" * 10)
    assert data.notes == ["2 samples were longer than data.max_seq_len=10 and were truncated"]
    dropped = load(tmp_path, tok, train=str(f), format="text", max_seq_len=10, drop_long=True)
    assert dropped.stats["dropped"] == 2 and dropped.stats["truncated"] == 0
    assert [e.input_ids for e in dropped.train] == [[*ids("ab"), EOS]]


def test_truncation_that_leaves_no_answer_drops_the_sample(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "t.jsonl",
        [{"instruction": "a long instruction", "output": "z"}, {"instruction": "i", "output": "z"}],
    )
    data = load(tmp_path, tok, train=str(f), format="instruction", max_seq_len=12)
    # the first sample's prompt alone is longer than 12 tokens: dropped (not counted as truncated-and-kept)
    assert data.stats["dropped"] == 1 and data.stats["truncated"] == 0
    assert data.train[0].input_ids == [*ids("i\nAnswer: z"), EOS]
