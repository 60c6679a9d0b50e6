"""Entry point of the verifier service (`specsplit serve-verifier`)."""

from __future__ import annotations

from functools import partial

from specsplit.convert import torch_dtype
from specsplit.server import serve as serve_host
from specsplit.tls import TLSFiles
from verifier.engine import VerifierEngine
from verifier.servicer import VerifierServicer


async def serve(
    address: str,
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    num_pages: int | None = None,
    page_size: int = 16,
    grace: float = 5.0,
    tls: TLSFiles | None = None,
) -> None:
    """Listen on `address`, load the target model off the event loop, SERVING once warm;
    return after SIGTERM / SIGINT and a graceful stop. tls: mutual TLS (specsplit.tls), None =
    plaintext."""
    sizes = {"page_size": page_size} | ({} if num_pages is None else {"num_pages": num_pages})
    load = partial(
        VerifierEngine.load, model_path, device=device, dtype=torch_dtype(dtype), **sizes
    )
    await serve_host(VerifierServicer(load), address, grace=grace, tls=tls)
