"""The bundled self-distillation prompt set (specsplit/data/train_prompts.jsonl): its format,
its split, no overlap with the eval prompts, and that scripts/make_train_prompts.py rebuilds it
byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN_PROMPTS = ROOT / "specsplit" / "data" / "train_prompts.jsonl"
EVAL_PROMPTS = ROOT / "specsplit" / "data" / "prompts.jsonl"
GENERATOR = ROOT / "scripts" / "make_train_prompts.py"


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    with TRAIN_PROMPTS.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def contents(rows: list[dict[str, Any]]) -> list[str]:
    return [row["messages"][0]["content"] for row in rows]


def test_bundled_file_parses_with_one_user_message_and_a_split(
    rows: list[dict[str, Any]],
) -> None:
    assert len(rows) >= 2500
    assert TRAIN_PROMPTS.stat().st_size < 1_500_000
    for row in rows:
        assert set(row) == {"messages", "split"}
        assert row["split"] in {"train", "heldout"}
        assert len(row["messages"]) == 1
        (message,) = row["messages"]
        assert set(message) == {"role", "content"}
        assert message["role"] == "user"
        assert isinstance(message["content"], str) and message["content"].strip()


def test_prompt_lengths_within_5_to_80_words(contents: list[str]) -> None:
    assert all(5 <= len(c.split()) <= 80 for c in contents)


def test_no_duplicate_contents(contents: list[str]) -> None:
    assert len(set(contents)) == len(contents)
    assert len({normalize(c) for c in contents}) == len(contents)


def test_heldout_share_between_5_and_15_percent(rows: list[dict[str, Any]]) -> None:
    heldout = sum(row["split"] == "heldout" for row in rows)
    assert 0.05 <= heldout / len(rows) <= 0.15


def test_no_overlap_with_eval_prompts(contents: list[str]) -> None:
    with EVAL_PROMPTS.open(encoding="utf-8") as f:
        eval_prompts = [
            m["content"] for line in f if line.strip() for m in json.loads(line)["messages"]
        ]
    assert eval_prompts
    assert not {normalize(p) for p in eval_prompts} & {normalize(c) for c in contents}


def test_generator_reproduces_bundled_file(tmp_path: Path) -> None:
    out = tmp_path / "train_prompts.jsonl"
    subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.read_bytes() == TRAIN_PROMPTS.read_bytes()
