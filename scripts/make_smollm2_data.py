"""Chat data for recipes/smollm2-135m-lora.yaml: pull a person's name, age and city out of a sentence, as JSON.

SmolLM2-135M-Instruct answers such requests with prose or malformed JSON (0% exact match before training);
a few minutes of LoRA on CPU teach it the exact format, which it then applies to unseen names and cities.
Deterministic (seeded); writes recipes/data/extract-json/{train,eval}.jsonl.

    python scripts/make_smollm2_data.py [--train 2000] [--eval 100]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [
    "Alice",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
    "Mateo",
    "Nadia",
    "Oscar",
    "Priya",
    "Quentin",
    "Rosa",
    "Sven",
    "Tariq",
    "Ursula",
    "Viktor",
    "Wanda",
    "Xavier",
    "Yara",
    "Zoltan",
    "Amara",
    "Bjorn",
    "Camille",
    "Diego",
    "Esther",
    "Felix",
    "Gwen",
    "Hassan",
    "Ivy",
    "Jamal",
    "Keiko",
    "Luis",
    "Mira",
    "Nils",
    "Olga",
    "Pablo",
    "Rania",
    "Sofia",
    "Tomas",
    "Uma",
    "Vera",
    "Wei",
    "Yusuf",
    "Zara",
]
CITIES = [
    "Lyon",
    "Porto",
    "Kyoto",
    "Lagos",
    "Quito",
    "Oslo",
    "Perth",
    "Cusco",
    "Tunis",
    "Hanoi",
    "Turin",
    "Leeds",
    "Gdansk",
    "Malmo",
    "Bergen",
    "Dakar",
    "Austin",
    "Denver",
    "Seville",
    "Krakow",
    "Nantes",
    "Geneva",
    "Ghent",
    "Bilbao",
    "Zagreb",
    "Tartu",
    "Split",
    "Brno",
    "Basel",
    "Cork",
    "Galway",
    "Graz",
    "Lille",
    "Bari",
    "Pune",
]
TEMPLATES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, who lives in {city}, turned {age} last week.",
    "Last year {name} moved to {city}; {name} is now {age}.",
    "At {age}, {name} still enjoys walking around {city}.",
    "Meet {name} from {city}, aged {age}.",
    "{city} has been home to {name} ({age}) for a decade.",
]
QUESTION = 'Extract the person as JSON with keys "name", "age" and "city".\n{sentence}'


def sample(rng: random.Random, names: list[str], cities: list[str]) -> dict:
    """One conversation: the request and its exact JSON answer."""
    name, city, age = rng.choice(names), rng.choice(cities), rng.randint(18, 90)
    sentence = rng.choice(TEMPLATES).format(name=name, age=age, city=city)
    answer = json.dumps({"name": name, "age": age, "city": city})
    return {
        "messages": [
            {"role": "user", "content": QUESTION.format(sentence=sentence)},
            {"role": "assistant", "content": answer},
        ]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "recipes/data/extract-json"
    )
    args = ap.parse_args()
    rng = random.Random(0)
    # Held-out names and cities: the eval measures the format learnt, not memorised pairs.
    names, cities = NAMES[:], CITIES[:]
    rng.shuffle(names)
    rng.shuffle(cities)
    eval_names, train_names = names[:10], names[10:]
    eval_cities, train_cities = cities[:7], cities[7:]
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n, ns, cs in (
        ("train", args.train, train_names, train_cities),
        ("eval", args.eval, eval_names, eval_cities),
    ):
        with open(args.out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps(sample(rng, ns, cs)) + "\n")
    print(f"wrote {args.out}/train.jsonl ({args.train}) and eval.jsonl ({args.eval})")


if __name__ == "__main__":
    main()
