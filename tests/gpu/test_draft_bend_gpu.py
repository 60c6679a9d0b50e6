"""The drafter's bend kernel (specsplit/kernels/draft_bend.py) on a CUDA device: at real
vocabularies (an EAGLE head's 32,000 columns of a 128,256-token target, SmolLM2's whole 49,152)
its rows equal torch's ops bit for bit, for sequences of every rule kind with and without a
guide's root mask, and replayed from a CUDA graph as launched eagerly; the root rows' kernel
writes a round's masks as torch's ops. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.draft_rules import RuleTables
from drafter.types import DraftJob, DraftSeq
from specsplit.kernels.draft_bend import (
    bend_drafts,
    bend_drafts_reference,
    write_roots,
    write_roots_reference,
)
from specsplit.logit_rules import Penalties, pack_mask
from specsplit.messages import DraftRules, SpecParams
from specsplit.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RULES = [
    Penalties(((3, 2.5), (900, -100.0)), presence=0.5, frequency=0.25),
    Penalties(repetition=1.3, min_tokens=50, stop_ids=(2, 31999)),
    Penalties(((7, 1.5),), 1.0, -0.5, 0.8, min_tokens=2, stop_ids=(0,)),
    None,
]


@pytest.mark.parametrize(("vocab", "columns"), [(128256, 32000), (49152, 49152)])
def test_the_kernel_bends_real_vocabularies_as_torchs_ops(vocab: int, columns: int) -> None:
    rng = np.random.default_rng(0)
    scored = None
    if columns < vocab:
        scored = torch.from_numpy(np.sort(rng.choice(vocab, columns, replace=False))).cuda()
    tables = RuleTables(vocab, scored, torch.device("cuda"), slots=16)
    jobs = []
    for i, penalties in enumerate(RULES):
        seq = DraftSeq(f"s{i}", rng.integers(0, vocab, 600).tolist())
        seq.rules = None if penalties is None else DraftRules(penalties, 500)
        job = DraftJob(seq, SpecParams(3, 1, 3), SamplingParams())
        if i % 2 or penalties is None:
            job.root_allowed = pack_mask(rng.random(vocab) < 0.3).tobytes()
        jobs.append(job)
    tables.take(jobs)
    slots = torch.tensor([0] + [job.rule_slot for job in jobs] * 3, device="cuda")
    logits = torch.randn(len(slots), columns, device="cuda") * 6
    for root in (False, True):
        want = bend_drafts_reference(logits, slots, tables.tables, root)
        got = bend_drafts(logits, slots, tables.tables, root)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # replayed from a graph: the same rows (the slots and tables read where they lie)
    static = logits.clone()
    got = bend_drafts(static, slots, tables.tables, True)  # (compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bend_drafts(static, slots, tables.tables, True)
    static.copy_(logits.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    want = bend_drafts_reference(logits.flip(0), slots, tables.tables, True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize(("vocab", "columns"), [(128256, 32000), (49152, 49152)])
def test_the_roots_kernel_writes_real_vocabularies_as_torchs_ops(vocab: int, columns: int) -> None:
    """A round's root rows (two masked, one cleared) at real vocabularies: the kernel's equal
    torch's ops' bit for bit, launched without a host sync (sync debug mode "error")."""
    rng = np.random.default_rng(1)
    scored = None
    if columns < vocab:
        scored = torch.from_numpy(np.sort(rng.choice(vocab, columns, replace=False))).cuda()
    tables = RuleTables(vocab, scored, torch.device("cuda"), slots=16)
    words = -(-vocab // 32)
    table = np.zeros((3, 2 + words), dtype=np.int32)
    table[:, 0] = [5, 2, 9]
    table[[0, 2], 1] = 1
    for r in (0, 2):
        table[r, 2:] = np.frombuffer(pack_mask(rng.random(vocab) < 0.3).tobytes(), "<i4")
    on_device = torch.from_numpy(table).cuda()
    start = torch.randn(17, columns, device="cuda")
    want, got = start.clone(), start.clone()
    write_roots_reference(want, on_device, tables.word_of, tables.bit_of)
    write_roots(got, on_device, tables.word_of, tables.bit_of)  # (compiled)
    got.copy_(start)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_roots(got, on_device, tables.word_of, tables.bit_of)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    assert torch.isinf(got[[5, 9]]).any() and (got[2] == 0).all()
