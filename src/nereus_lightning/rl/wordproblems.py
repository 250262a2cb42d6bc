"""A small GSM8K-style set of arithmetic word problems, generated here (no downloads), in verl's format.

Each row: ``data_source`` (``"arith_gsm8k"``, so the built-in GSM8K reward scores it), ``prompt``
(one user message asking for the final answer after ``####``, as verl's GSM8K preprocessing
does), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": "<number>"}``) and
``extra_info`` (``split``, ``index``, the worked ``answer``)::

    python -m nereus_lightning.rl.wordproblems --out data/arith --train 256 --test 64
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jun")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards")


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer, result) of one problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 20)
    kind = rng.choice(("add", "sub", "mul", "two_step"))
    if kind == "add":
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return q, f"{a} + {b} = {a + b}", a + b
    if kind == "sub":
        a += b
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        return q, f"{a} - {b} = {a - b}", a - b
    if kind == "mul":
        a = rng.randint(2, 12)
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that?"
        return q, f"{a} * {b} = {a * b}", a * b
    c = rng.randint(1, a)
    q = f"{name} has {a} {item}, buys {b} more, then loses {c}. How many {item} does {name} have?"
    return q, f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}", a + b - c


def make_rows(count: int, split: str, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` problems of ``split`` (seeded, so the same call gives the same rows)."""
    rng = random.Random(f"nereus-wordproblems:{seed}:{split}")
    rows = []
    for index in range(count):
        question, worked, result = _problem(rng)
        rows.append(
            {
                "data_source": "arith_gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": split, "index": index, "answer": f"{worked}\n#### {result}"},
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str) -> str:
    """Write ``rows`` as a parquet file (pyarrow); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv: list[str] | None = None) -> None:
    """Write ``train.parquet`` and ``test.parquet`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/arith", help="output folder")
    parser.add_argument("--train", type=int, default=256, help="training problems")
    parser.add_argument("--test", type=int, default=64, help="test problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, count in (("train", args.train), ("test", args.test)):
        path = write_parquet(make_rows(count, split, args.seed), os.path.join(args.out, f"{split}.parquet"))
        print(f"{path}: {count} problems")


if __name__ == "__main__":
    main()
