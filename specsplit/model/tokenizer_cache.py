"""A GGUF file's tokenizer kept as transformers saves one (`cached_tokenizer`), so that a service
starting again reads it in ~0.2 s instead of converting the file's vocabulary again (~3.3 s
for the embedded SmolLM2 on the 2-core VM: transformers parses the whole metadata with
`gguf.GGUFReader` and builds the fast tokenizer from it; bench/RESULTS.md).

An entry is keyed by the file (its real path, size and modification time) and the versions of
transformers and tokenizers that converted it, under $SPECSPLIT_CACHE_DIR (default
$XDG_CACHE_HOME/specsplit or ~/.cache/specsplit; the image sets the `compile-cache` volume's
/var/cache/specsplit). Written to a temporary directory and renamed into place, so a reader
never sees half an entry; a cache that cannot be written or read is skipped (logged), never an
error: the tokenizer then comes from the file, as before.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENTRY_FILE = "tokenizer_config.json"  # present once an entry is whole


def cache_root() -> Path:
    explicit = os.environ.get("SPECSPLIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specsplit"


def entry_dir(path: str) -> Path:
    """Where `path`'s tokenizer is kept: a digest of the file's identity and the converters'
    versions (a changed file or an upgraded transformers makes a new entry)."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")]
    key = "\0".join([real, str(stat.st_size), str(stat.st_mtime_ns), *versions])
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def cached_tokenizer(path: str, convert: Callable[[], Any]) -> Any:
    """`path`'s tokenizer from its cache entry, else `convert()`'s, saved as the entry."""
    from transformers import AutoTokenizer

    entry = entry_dir(path)
    broken = False
    if (entry / ENTRY_FILE).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except (OSError, ValueError) as err:
            log.warning("tokenizer cache %s unreadable (%s): converting %s again", entry, err, path)
            broken = True
    tokenizer = convert()
    _save(tokenizer, entry, broken)
    return tokenizer


def _save(tokenizer: Any, entry: Path, broken: bool) -> None:
    """Keep `tokenizer` as `entry` (replacing it where `broken`; else an entry another
    process kept meanwhile stays)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=entry.parent)
    except OSError as err:
        log.info("tokenizer cache %s not writable (%s): not kept", entry.parent, err)
        return
    try:
        tokenizer.save_pretrained(staging)
        if not broken and (entry / ENTRY_FILE).is_file():  # another process kept it first
            return
        if entry.exists():  # a broken or half-removed entry
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(staging, entry)
        log.info("tokenizer kept in %s", entry)
    except OSError as err:
        log.info("tokenizer cache %s not written (%s)", entry, err)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
