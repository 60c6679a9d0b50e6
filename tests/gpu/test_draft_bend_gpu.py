"""The drafter's bend kernel (specsplit/kernels/draft_bend.py) on a CUDA device: at real
vocabularies (an EAGLE head's 32,000 columns of a 128,256-token target, SmolLM2's whole 49,152)
its rows equal torch's ops bit for bit, for sequences of every rule kind with and without a
guide's root mask, and replayed from a CUDA graph as launched eagerly. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.draft_rules import RuleTables
from drafter.types import DraftJob, DraftSeq
from specsplit.kernels.draft_bend import bend_drafts, bend_drafts_reference
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
