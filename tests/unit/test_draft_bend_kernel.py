"""The drafter's bend kernel (`specsplit.kernels.draft_bend`) under the Triton interpreter bends
every row exactly as torch's ops do (bit for bit): rows of sequences with each kind of rule side
by side (bias, presence and frequency, repetition, min_tokens' stops, all of them), rows of no
rules (slot 0), a guide's root mask on the roots' rows only, int32 and int64 slots, the
tables over a head's own columns; the root rows' kernel (a round's guide masks unpacked, or
cleared) writes them as torch's ops; the wrappers refuse what the kernels cannot read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.draft_rules import RuleTables
from drafter.types import DraftJob, DraftSeq
from specsplit.kernels.draft_bend import (
    DraftTables,
    bend_drafts,
    bend_drafts_reference,
    write_roots,
    write_roots_reference,
)
from specsplit.logit_rules import pack_mask
from specsplit.messages import DraftRules, SpecParams
from specsplit.sampling import SamplingParams
from tests.unit.test_draft_rules import EACH_RULE, PROMPT

# past one program's block of columns under the interpreter (64): four blocks, the last ragged
VOCAB = 200

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def _tables(columns: str) -> tuple[RuleTables, np.ndarray, list[DraftJob]]:
    """Tables holding a sequence of each rule (and one guided without rules), their slots 1..n."""
    scored = np.arange(VOCAB) if columns == "target" else np.arange(1, VOCAB, 2)
    ids = None if columns == "target" else torch.from_numpy(scored)
    tables = RuleTables(VOCAB, ids, torch.device("cpu"), slots=8)
    rng = np.random.default_rng(2)
    jobs = []
    for i, penalties in enumerate([*EACH_RULE.values(), None]):
        seq = DraftSeq(f"s{i}", PROMPT + rng.integers(0, VOCAB, 7).tolist())
        seq.rules = None if penalties is None else DraftRules(penalties, len(PROMPT))
        job = DraftJob(seq, SpecParams(3, 1, 3), SamplingParams())
        if i % 2 or penalties is None:  # (a guide's root mask on every other one)
            job.root_allowed = pack_mask(rng.random(VOCAB) < 0.5).tobytes()
        jobs.append(job)
    tables.take(jobs)
    return tables, scored, jobs


@pytest.mark.parametrize("slot_type", [torch.int32, torch.int64])
@pytest.mark.parametrize("root", [False, True], ids=["step", "root"])
@pytest.mark.parametrize("columns", ["target", "head"])
def test_the_kernel_bends_as_torchs_ops(columns: str, root: bool, slot_type: torch.dtype) -> None:
    tables, scored, jobs = _tables(columns)
    slots = [job.rule_slot for job in jobs]
    assert 0 not in slots
    slots = torch.tensor([0, *slots, *slots[::-1], 0], dtype=slot_type)  # (rows of no rules too)
    logits = torch.randn(len(slots), len(scored), generator=torch.Generator().manual_seed(1)) * 5
    want = bend_drafts_reference(logits, slots, tables.tables, root)
    got = bend_drafts(logits, slots, tables.tables, root, kernel=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got[0], logits[0]) and torch.isinf(got).any() and not torch.isnan(got).any()
    # a tree step's rows: each root's slot expanded over its k children (a stride of 0)
    roots = slots[1:2]
    expanded = roots[:, None].expand(1, len(slots)).reshape(-1)
    assert expanded.stride() == (0,)
    want = bend_drafts_reference(logits, expanded, tables.tables, root)
    got = bend_drafts(logits, expanded, tables.tables, root, kernel=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_wrapper_refuses_what_the_kernel_cannot_read() -> None:
    tables, scored, _ = _tables("target")
    t = tables.tables
    slots = torch.tensor([1, 2])
    logits = torch.zeros(2, len(scored))
    with pytest.raises(ValueError, match="logits must be 2-D float32"):
        bend_drafts(logits.half(), slots, t, kernel=True)
    with pytest.raises(ValueError, match="slots must be"):
        bend_drafts(logits, slots.float(), t, kernel=True)
    with pytest.raises(ValueError, match="columns"):
        bend_drafts(torch.zeros(2, 5), slots, t, kernel=True)
    with pytest.raises(ValueError, match="params must be"):
        bend_drafts(logits, slots, DraftTables(*t[:4], t.params[:, :2]), kernel=True)
    with pytest.raises(ValueError, match="prompt must be"):
        bend_drafts(
            logits, slots, DraftTables(t.bias, t.counts, t.bias, t.root, t.params), kernel=True
        )


def _roots_table(rng: np.random.Generator, kinds: str) -> torch.Tensor:
    """A root table of rows of `kinds` ("m": masked by a random mask, "c": cleared), slots 1..n
    in a shuffled order; without a masked row no words at all."""
    words = -(-VOCAB // 32) if "m" in kinds else 0
    table = np.zeros((len(kinds), 2 + words), dtype=np.int32)
    table[:, 0] = rng.permutation(len(kinds)) + 1
    for r, kind in enumerate(kinds):
        if kind == "m":
            table[r, 1] = 1
            table[r, 2:] = np.frombuffer(pack_mask(rng.random(VOCAB) < 0.5).tobytes(), "<i4")
    return torch.from_numpy(table)


@pytest.mark.parametrize("kinds", ["m", "mcm", "cc"], ids=["masked", "mixed", "cleared"])
@pytest.mark.parametrize("columns", ["target", "head"])
def test_the_roots_kernel_writes_as_torchs_ops(columns: str, kinds: str) -> None:
    """A round's root rows (masked ones and cleared ones, over the target's or a head's columns)
    written by the kernel equal torch's ops' bit for bit; other slots' rows stay."""
    tables, scored, _ = _tables(columns)
    rng = np.random.default_rng(len(kinds))
    table = _roots_table(rng, kinds)
    start = torch.randn(8, len(scored), generator=torch.Generator().manual_seed(3))
    want, got = start.clone(), start.clone()
    write_roots_reference(want, table, tables.word_of, tables.bit_of)
    write_roots(got, table, tables.word_of, tables.bit_of, kernel=True)
    assert torch.equal(got, want)
    written = table[:, 0].long()
    assert ((want[written] == 0) | (want[written] == -torch.inf)).all()
    assert torch.isinf(want[written]).any() == ("m" in kinds)
    others = [s for s in range(8) if s not in written.tolist()]
    assert torch.equal(got[others], start[others])


def test_the_roots_wrapper_refuses_what_the_kernel_cannot_read() -> None:
    tables, scored, _ = _tables("target")
    table, root = _roots_table(np.random.default_rng(0), "mc"), torch.zeros(8, len(scored))
    word_of, bit_of = tables.word_of, tables.bit_of
    with pytest.raises(ValueError, match="root must be"):
        write_roots(root.double(), table, word_of, bit_of, kernel=True)
    with pytest.raises(ValueError, match="table must be"):
        write_roots(root, table.long(), word_of, bit_of, kernel=True)
    with pytest.raises(ValueError, match="word_of must be"):
        write_roots(root, table, word_of[:-1], bit_of, kernel=True)
    with pytest.raises(ValueError, match="bit_of must be"):
        write_roots(root, table, word_of, bit_of.long(), kernel=True)
