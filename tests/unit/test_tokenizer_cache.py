"""specsplit/model/tokenizer_cache.py: a GGUF file's tokenizer converted once, then read from
its cache entry, the same tokenizer either way; a changed file or a new converter makes a new
entry; a cache that cannot be written, or an entry that cannot be read, never fails a load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from specsplit.model import tokenizer_cache
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from specsplit.model.tokenizer_cache import ENTRY_FILE, cached_tokenizer, entry_dir

TEXTS = [
    "Hello world!",
    "Write a haiku about the sea 🌊, über café, naïve résumé.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # code",
]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    for text in TEXTS:
        ids = a(text).input_ids
        assert ids == b(text).input_ids, text
        assert a.decode(ids) == b.decode(ids)
    chat = [{"role": "user", "content": "Name a planet."}]
    assert a.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        b.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (
        b.eos_token_id, b.bos_token_id, b.pad_token_id,
    )  # fmt: skip


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_second_load_reads_the_entry_and_equals_the_converted_tokenizer(cache: Path) -> None:
    path = embedded_default_model_path()
    converted = load_tokenizer(path)  # (converted, and kept)
    entry = entry_dir(path)
    assert entry.parent.parent == cache and (entry / ENTRY_FILE).is_file()
    calls = []

    def convert() -> Any:
        calls.append(1)
        return converted

    read = cached_tokenizer(path, convert)
    assert calls == [] and read is not converted
    _same(read, converted)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # (no staging left)


def test_a_changed_file_or_converter_gets_a_new_entry(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    first = entry_dir(str(model))
    os.utime(model, ns=(1, 1))
    assert entry_dir(str(model)) != first
    touched = entry_dir(str(model))
    real_version = tokenizer_cache.importlib.metadata.version
    monkeypatch.setattr(
        tokenizer_cache.importlib.metadata, "version", lambda name: real_version(name) + ".post1"
    )
    assert entry_dir(str(model)) != touched


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECSPLIT_CACHE_DIR", str(blocker / "cache"))  # (under a file)
    tokenizer = object()
    assert cached_tokenizer(embedded_default_model_path(), lambda: tokenizer) is tokenizer


def test_a_broken_entry_is_converted_again_and_replaced(cache: Path) -> None:
    path = embedded_default_model_path()
    entry = entry_dir(path)
    entry.mkdir(parents=True)
    (entry / ENTRY_FILE).write_text("{ not json")
    converted = load_tokenizer(path)
    assert (entry / ENTRY_FILE).read_text() != "{ not json"
    _same(cached_tokenizer(path, lambda: pytest.fail("the entry was not read")), converted)
