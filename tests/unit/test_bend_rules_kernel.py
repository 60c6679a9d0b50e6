"""The logit rules' kernels (`specsplit.kernels.bend_rules`) under the Triton interpreter bend
every row exactly as torch's ops and the one-row reference do (bit for bit): every kind of rule
alone and all together, on trees whose paths repeat tokens, sequences with different rules side
by side, a guide's masks with and without penalties, the kept rows through fifteen rounds of
commits (deltas counted in by atomics, the tables grown), and a step run ahead's pending token;
on the CPU `bend_rows` runs the references; the wrapper refuses tensors the kernels cannot
read."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.bend_rules import Layout, bend_rows
from specsplit.logit_rules import Penalties
from tests.unit import test_rule_rows, test_verify_guide, test_verify_rules
from tests.unit.test_verify_rules import EACH_RULE

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


@pytest.mark.parametrize("penalties", EACH_RULE)
def test_each_rule_bends_as_the_reference(penalties: Penalties) -> None:
    test_verify_rules.test_bent_rows_are_the_reference_rows(penalties, "cpu", kernel=True)


def test_sequences_of_different_rules_side_by_side() -> None:
    test_verify_rules.test_each_sequence_is_bent_by_its_own_rules_alone("cpu", kernel=True)


@pytest.mark.parametrize(
    "penalties", [None, Penalties(presence=1.0, min_p=0.2)], ids=["alone", "with-penalties"]
)
def test_a_guides_masks_as_the_reference(penalties: Penalties | None) -> None:
    test_verify_guide.test_masked_rows_are_the_reference_rows(penalties, "cpu", kernel=True)


def test_kept_rows_through_rounds_of_commits() -> None:
    test_rule_rows.test_rounds_count_only_what_their_commits_appended(kernel=True)


def test_a_step_run_aheads_pending_token() -> None:
    test_rule_rows.test_a_step_run_ahead_counts_its_pending_token_and_its_commit_follows(
        kernel=True
    )


def test_the_wrapper_refuses_what_the_kernels_cannot_read() -> None:
    layout = Layout((0,) * 9, 1, 1, 0, False, False, False, False)
    kept = (torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bool))
    table = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="logits must be 2-D float32"):
        bend_rows(torch.zeros(2, 8, dtype=torch.float16), table, layout, kept, kernel=True)
    with pytest.raises(ValueError, match="table must be"):
        bend_rows(torch.zeros(2, 8), table.long(), layout, kept, kernel=True)
    with pytest.raises(ValueError, match="kept rows must be"):
        bend_rows(torch.zeros(2, 8), table, layout, (kept[0], kept[1], kept[1]), kernel=True)
    with pytest.raises(ValueError, match="pending must be"):
        bend_rows(torch.zeros(2, 8), table, layout, kept, torch.zeros(2), kernel=True)
