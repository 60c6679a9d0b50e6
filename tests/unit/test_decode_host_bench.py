"""bench/decode_host.py: its stubbed engine decodes every round's steps (each bonus token the
stub's favourite) and accepts its chains, its timing is of whole rounds, and it gives every page
back."""

from __future__ import annotations

from pathlib import Path

from bench import decode_host
from specsplit.messages import VerifyInput, VerifyOutput
from verifier.engine import VerifierEngine


def recorded(engine: VerifierEngine) -> list[list[VerifyOutput]]:
    """Every round's results of `engine.verify` from now on, in order."""
    rounds: list[list[VerifyOutput]] = []
    verify = engine.verify

    def recording(inputs: list[VerifyInput]) -> list[VerifyOutput]:
        outputs = verify(inputs)
        rounds.append(outputs)
        return outputs

    engine.verify = recording  # type: ignore[method-assign]
    return rounds


def test_the_stubbed_engine_decodes_each_rounds_steps_and_frees_its_pages(tmp_path: Path) -> None:
    engine = decode_host.engine_with_stub(tmp_path, max_batch=4)
    rounds = recorded(engine)
    ms = decode_host.ms_a_step(engine, batch=3, steps=4, rounds=2)
    assert ms > 0
    assert len(rounds) == 1 + 3 + 2  # the prompts', the warm-up's, the timed ones
    for outputs in rounds[1:]:  # 4 steps a round: 3 decoded tokens, then the bonus
        assert [out.decoded_tokens + [out.bonus_token] for out in outputs] == [[7] * 4] * 3
    assert [out.kv_committed_len for out in rounds[-1]] == [decode_host.PROMPT_LEN + 5 * 4] * 3
    assert engine.num_pages_used == 0 and not engine.seqs


def test_the_chain_rounds_accept_all_but_the_last_draft_and_carry_hidden_states(
    tmp_path: Path,
) -> None:
    engine = decode_host.engine_with_stub(tmp_path, max_batch=4)
    rounds = recorded(engine)
    ms = decode_host.ms_a_chain_round(engine, batch=3, chain=3, layers=(0, 1), rounds=2)
    assert ms > 0
    assert len(rounds) == 1 + 3 + 2  # the prompts', the warm-up's, the timed ones
    for outputs in rounds[1:]:  # drafts 7, 7, 5: two accepted, then the bonus 7
        assert [out.accepted_tokens + [out.bonus_token] for out in outputs] == [[7, 7, 7]] * 3
        for out in outputs:  # the pending token's row and the two accepted drafts', 2 layers
            assert out.hidden_states is not None
            assert tuple(out.hidden_states.shape) == (3, 2 * 64)  # (the tiny model's width)
    assert [out.kv_committed_len for out in rounds[-1]] == [decode_host.PROMPT_LEN + 5 * 3] * 3
    assert engine.num_pages_used == 0 and not engine.seqs
