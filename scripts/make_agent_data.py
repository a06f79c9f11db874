"""Generate the agent conversations of recipes/agent-tools.yaml from the reverse task's words (deterministic).

    python scripts/make_agent_data.py

recipes/data/agent-tools/{train,eval}.jsonl: one conversation per word of recipes/data/reverse/{train,eval}.jsonl
(the held-out words stay held out), in OpenAI's layout: the row's ``tools`` (one function, ``reverse``), the user's
request, the assistant's reasoning and its call of the tool (an id, the arguments as JSON text), the tool's result,
and the assistant's answer. One conversation in three goes on: the user asks for the result in capitals, and the
assistant answers without a tool. Every answer can be checked exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "recipes" / "data"
SOURCE, OUT = ROOT / "reverse", ROOT / "agent-tools"
N_TRAIN = 600  # conversations of ~800 byte tokens each
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "reverse",
            "description": "Reverse the letters of a word.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]


def conversation(word: str, n: int, rng: random.Random) -> dict:
    """The conversation of one word: a tool call and its result, then (one in three) a follow-up without tools."""
    call_id = f"call_{n}"
    messages = [
        {"role": "user", "content": f"Reverse the letters: {word}"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": f"{word} has {len(word)} letters. The reverse tool spells it backwards.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "reverse", "arguments": json.dumps({"word": word})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "reverse", "content": word[::-1]},
        {"role": "assistant", "content": word[::-1]},
    ]
    if rng.random() < 1 / 3:
        messages += [
            {"role": "user", "content": "Now in capitals."},
            {
                "role": "assistant",
                "reasoning_content": "No tool is needed: the same letters in upper case.",
                "content": word[::-1].upper(),
            },
        ]
    return {"tools": TOOLS, "messages": messages}


def words(path: Path) -> list[str]:
    """The words of a reverse-task file (the input of each row)."""
    return [json.loads(line)["input"] for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for split, limit in (("train", N_TRAIN), ("eval", 50)):
        rows = [conversation(w, i, rng) for i, w in enumerate(words(SOURCE / f"{split}.jsonl")[:limit])]
        with (OUT / f"{split}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{OUT / split}.jsonl: {len(rows)} conversations")


if __name__ == "__main__":
    main()
