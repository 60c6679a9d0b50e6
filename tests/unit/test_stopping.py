"""Stop rules applied to a round's new tokens: EOS / stop ids, max tokens, stop strings."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence

import pytest
from transformers import PreTrainedTokenizerBase

from gateway.stopping import FinishReason, StopChecker, StopOutcome
from gateway.text import IncrementalDetokenizer
from specsplit.prompt import apply_chat_template

EOS_ID = 2  # <|im_end|>
ENDOFTEXT_ID = 0  # <|endoftext|>
THE, QUICK, BROWN, FOX, JUMPS, RED = 378, 2365, 6354, 16438, 27003, 2382  # " The", " quick"...
PERIOD = 30  # "."
HI, EXCLAMATION = 21041, 17  # " Hi", "!"
EMOJI_IDS = [40303, 218]  # " 😀" split across two byte-level tokens

MakeChecker = Callable[..., StopChecker]  # (max_new_tokens, stop_token_ids, stop_strings)


@pytest.fixture
def prompt_ids(smollm2_tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "Hi"}])


@pytest.fixture
def make_checker(smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> MakeChecker:
    def make(
        max_new_tokens: int = 100,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> StopChecker:
        return StopChecker(
            IncrementalDetokenizer(smollm2_tokenizer, prompt_ids),
            eos_token_ids=[EOS_ID],
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            stop_strings=stop_strings,
            min_tokens=min_tokens,
        )

    return make


def test_no_stop_streams_all_tokens(make_checker: MakeChecker) -> None:
    checker = make_checker()
    assert checker.commit([THE, QUICK]) == StopOutcome(" The quick", 2, None)
    assert checker.commit([BROWN]) == StopOutcome(" brown", 1, None)
    assert checker.num_generated_tokens == 3
    assert checker.finish_reason is None


def test_eos_mid_round_drops_following_tokens(make_checker: MakeChecker) -> None:
    checker = make_checker()
    outcome = checker.commit([THE, QUICK, EOS_ID, BROWN, FOX])
    assert outcome == StopOutcome(" The quick", 3, FinishReason.STOP)  # EOS kept, not streamed
    assert checker.num_generated_tokens == 3
    assert checker.finish_reason is FinishReason.STOP


def test_eos_first_token_of_round(make_checker: MakeChecker) -> None:
    checker = make_checker()
    assert checker.commit([THE]) == StopOutcome(" The", 1, None)
    assert checker.commit([EOS_ID, QUICK]) == StopOutcome("", 1, FinishReason.STOP)


def test_stop_id(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_token_ids=[PERIOD])
    outcome = checker.commit([THE, QUICK, PERIOD, BROWN])
    assert outcome == StopOutcome(" The quick", 3, FinishReason.STOP)  # "." kept, not streamed


def test_special_token_other_than_eos_does_not_stop(make_checker: MakeChecker) -> None:
    checker = make_checker()
    assert checker.commit([THE, ENDOFTEXT_ID, QUICK]) == StopOutcome(" The quick", 3, None)


def test_max_tokens_mid_round(make_checker: MakeChecker) -> None:
    checker = make_checker(max_new_tokens=4)
    assert checker.commit([THE, QUICK]) == StopOutcome(" The quick", 2, None)
    outcome = checker.commit([BROWN, FOX, JUMPS, PERIOD])
    assert outcome == StopOutcome(" brown fox", 2, FinishReason.LENGTH)
    assert checker.num_generated_tokens == 4


def test_max_tokens_at_round_end(make_checker: MakeChecker) -> None:
    checker = make_checker(max_new_tokens=2)
    assert checker.commit([THE, QUICK]) == StopOutcome(" The quick", 2, FinishReason.LENGTH)


def test_eos_as_last_allowed_token_finishes_with_stop(make_checker: MakeChecker) -> None:
    checker = make_checker(max_new_tokens=3)
    assert checker.commit([THE, QUICK, EOS_ID, FOX]) == StopOutcome(
        " The quick", 3, FinishReason.STOP
    )


def test_eos_after_max_tokens_is_dropped(make_checker: MakeChecker) -> None:
    checker = make_checker(max_new_tokens=2)
    assert checker.commit([THE, QUICK, EOS_ID]) == StopOutcome(" The quick", 2, FinishReason.LENGTH)


def test_stop_string_spanning_tokens(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["k brown f"])
    outcome = checker.commit([THE, QUICK, BROWN, FOX, JUMPS])
    assert outcome == StopOutcome(" The quic", 4, FinishReason.STOP)  # through " fox"


def test_stop_string_spanning_rounds(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["quick brown"])
    assert checker.commit([THE, QUICK]) == StopOutcome(" The ", 2, None)  # "quick" held back
    assert checker.commit([BROWN, FOX]) == StopOutcome("", 1, FinishReason.STOP)
    assert checker.num_generated_tokens == 3


def test_partial_stop_string_held_back_then_released(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["quick brown"])
    assert checker.commit([THE, QUICK]) == StopOutcome(" The ", 2, None)
    assert checker.commit([RED, FOX]) == StopOutcome("quick red fox", 2, None)


def test_partial_stop_string_released_at_eos(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["quick brown"])
    assert checker.commit([THE, QUICK]) == StopOutcome(" The ", 2, None)
    assert checker.commit([EOS_ID]) == StopOutcome("quick", 1, FinishReason.STOP)


def test_partial_stop_string_released_at_length(make_checker: MakeChecker) -> None:
    checker = make_checker(max_new_tokens=2, stop_strings=["quick brown"])
    assert checker.commit([THE, QUICK, BROWN]) == StopOutcome(" The quick", 2, FinishReason.LENGTH)


def test_stop_string_inside_one_token_cuts_its_text(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["ui"])
    assert checker.commit([THE, QUICK, BROWN]) == StopOutcome(" The q", 2, FinishReason.STOP)


def test_first_token_completing_a_stop_string_ends_the_sequence(make_checker: MakeChecker) -> None:
    # "The quick brown" starts first but completes later than "quick".
    checker = make_checker(stop_strings=["The quick brown", "quick"])
    assert checker.commit([THE, QUICK, BROWN]) == StopOutcome(" The ", 2, FinishReason.STOP)


def test_stop_strings_completed_by_the_same_token_cut_at_the_earliest(
    make_checker: MakeChecker,
) -> None:
    checker = make_checker(stop_strings=["ick", "qu"])
    assert checker.commit([THE, QUICK]) == StopOutcome(" The ", 2, FinishReason.STOP)


def test_stop_string_before_eos_in_the_same_round(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["quick"])
    assert checker.commit([THE, QUICK, EOS_ID]) == StopOutcome(" The ", 2, FinishReason.STOP)


def test_stop_string_multibyte_char_split_across_tokens(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["😀"])
    assert checker.commit([HI, EMOJI_IDS[0]]) == StopOutcome(" Hi", 2, None)
    assert checker.commit([EMOJI_IDS[1], EXCLAMATION]) == StopOutcome(" ", 1, FinishReason.STOP)


def test_commit_after_finish_is_an_error(make_checker: MakeChecker) -> None:
    checker = make_checker()
    checker.commit([EOS_ID])
    with pytest.raises(AssertionError):
        checker.commit([THE])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_strings": [""]}, "non-empty")],
)
def test_invalid_arguments(
    make_checker: MakeChecker, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_checker(**kwargs)


def _reference(
    tokenizer: PreTrainedTokenizerBase, generated_ids: list[int], stop_strings: list[str]
) -> tuple[str, int, FinishReason | None]:
    """Plain decoding's answer, one token at a time: (text, num tokens, finish reason)."""
    for n in range(1, len(generated_ids) + 1):
        text = str(tokenizer.decode(generated_ids[:n], skip_special_tokens=True))
        starts = [i for s in stop_strings if (i := text.find(s)) >= 0]
        if starts:
            return text[: min(starts)], n, FinishReason.STOP
    text = str(tokenizer.decode(generated_ids, skip_special_tokens=True))
    return text, len(generated_ids), None


@pytest.mark.parametrize("seed", range(30))
def test_stop_strings_match_token_by_token_decoding(
    smollm2_tokenizer: PreTrainedTokenizerBase, make_checker: MakeChecker, seed: int
) -> None:
    rng = random.Random(seed)
    text = "The quick brown fox jumps over the lazy dog. 日本語 😀 über das Meer, déjà vu!"
    generated_ids = smollm2_tokenizer.encode(text)
    stop_strings = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text))
        stop_strings.append(text[start : start + rng.randint(1, 8)])
    if seed % 3 == 0:
        stop_strings = ["never in the text"]
    expected = _reference(smollm2_tokenizer, generated_ids, stop_strings)

    checker = make_checker(max_new_tokens=len(generated_ids) + 1, stop_strings=stop_strings)
    streamed, num_kept, i = "", 0, 0
    while i < len(generated_ids) and checker.finish_reason is None:
        n = rng.randint(1, 6)
        outcome = checker.commit(generated_ids[i : i + n])
        streamed += outcome.text
        num_kept += outcome.num_kept_tokens
        i += n
    if checker.finish_reason is None:  # the text ran out: end it as EOS would
        outcome = checker.commit([EOS_ID])
        streamed += outcome.text
        num_kept += outcome.num_kept_tokens
        expected = (expected[0], expected[1] + 1, FinishReason.STOP)
    assert (streamed, num_kept, checker.finish_reason) == expected


@pytest.mark.parametrize("seed", range(12))
def test_token_rules_then_text_equal_commit_without_stop_strings(
    smollm2_tokenizer: PreTrainedTokenizerBase, make_checker: MakeChecker, seed: int
) -> None:
    """The scheduler's split commit (commit_tokens now, text_of once the next round's RPC is
    out) keeps and streams exactly what commit() does: EOS, stop ids and max tokens anywhere
    in a round, multi-byte characters split across rounds."""
    rng = random.Random(seed)
    text = "The quick brown fox. 日本語 😀 über das Meer, déjà vu!"
    ids = smollm2_tokenizer.encode(text)
    stop_ids = [ids[rng.randrange(len(ids))]] if seed % 3 == 1 else []
    if seed % 3 == 2:
        ids.insert(rng.randrange(len(ids)), EOS_ID)
    max_new_tokens = rng.randint(1, len(ids) + 2)
    whole = make_checker(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    split = make_checker(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    assert not split.reads_text
    rounds, i = [], 0
    while i < len(ids) + 2 and whole.finish_reason is None:
        n = rng.randint(1, 5)
        rounds.append((ids + [EOS_ID, EOS_ID])[i : i + n])
        i += n
    for new_ids in rounds:
        if whole.finish_reason is not None:
            break
        expected = whole.commit(new_ids)
        rules = split.commit_tokens(new_ids)
        assert rules.num_kept_tokens == expected.num_kept_tokens
        assert rules.finish_reason == expected.finish_reason == split.finish_reason
        text_ids = new_ids[: rules.num_text_tokens]
        assert split.text_of(text_ids, rules.finish_reason is not None) == expected.text
    assert whole.finish_reason is not None


def test_commit_tokens_refuses_stop_strings(make_checker: MakeChecker) -> None:
    checker = make_checker(stop_strings=["fox"])
    assert checker.reads_text
    with pytest.raises(AssertionError):
        checker.commit_tokens([THE])


def test_would_finish_reads_the_token_rules_and_changes_nothing(make_checker: MakeChecker) -> None:
    """Draft-ahead's hints skip an outcome that would finish the sequence: by length, by an EOS
    or stop token id; the checker's state is as it was."""
    checker = make_checker(max_new_tokens=4, stop_token_ids=[QUICK])
    checker.commit([THE])
    assert not checker.would_finish([THE, THE])
    assert checker.would_finish([THE, THE, THE])  # the fourth token: the length
    assert checker.would_finish([EOS_ID]) and checker.would_finish([THE, QUICK])
    assert checker.num_generated_tokens == 1 and checker.finish_reason is None
    assert checker.commit([THE, THE]) == StopOutcome(" The The", 2, None)


def test_would_finish_agrees_with_what_commit_would_do(make_checker: MakeChecker) -> None:
    """would_finish (read for every outcome a hint names) is the commit's finish, every list
    of ids and every point of the sequence's life, without running the rules."""
    rng = random.Random(5)
    checker = make_checker(max_new_tokens=6, stop_token_ids=[QUICK])
    for committed in range(5):
        for _ in range(50):
            ids = [rng.choice([THE, QUICK, EOS_ID, BROWN]) for _ in range(rng.randint(1, 7))]
            before = copy.deepcopy(checker)
            assert checker.would_finish(ids) == (before.commit(ids).finish_reason is not None)
        checker.commit([THE])
        assert checker.num_generated_tokens == committed + 1


def test_min_tokens_no_stop_token_among_the_first(make_checker: MakeChecker) -> None:
    """A stop token among the first min_tokens tokens ends nothing (the verifier holds them
    back; were one there, it is text like any); the first after them does."""
    checker = make_checker(stop_token_ids=[FOX], min_tokens=3)
    assert not checker.would_finish([THE, FOX, QUICK])
    assert checker.commit_tokens([THE, FOX]).finish_reason is None
    assert checker.would_finish([QUICK, FOX])
    outcome = checker.commit_tokens([QUICK, FOX, BROWN])
    assert (outcome.num_kept_tokens, outcome.finish_reason) == (2, FinishReason.STOP)


def test_min_tokens_no_stop_string_before_them(make_checker: MakeChecker) -> None:
    """A stop string completed before the output holds min_tokens tokens is text; one completed
    at or after it ends the sequence there."""
    checker = make_checker(stop_strings=[" quick"], min_tokens=3)
    assert checker.commit([THE, QUICK]) == StopOutcome(" The quick", 2, None)
    outcome = checker.commit([BROWN, QUICK, FOX])
    assert outcome == StopOutcome(" brown", 2, FinishReason.STOP)


def test_include_stop_str_ends_the_text_with_it(
    make_checker: MakeChecker, smollm2_tokenizer
) -> None:
    """vLLM's include_stop_str_in_output: the text streamed ends with the stop string that
    ended the sequence, and nothing after it (the rest of its token's text is cut)."""
    checker = StopChecker(
        IncrementalDetokenizer(smollm2_tokenizer, []),
        eos_token_ids=[EOS_ID],
        max_new_tokens=100,
        stop_strings=[" qu", " fox"],
        include_stop_str=True,
    )
    outcome = checker.commit([THE, QUICK, BROWN])
    assert outcome == StopOutcome(" The qu", 2, FinishReason.STOP)
    plain = make_checker(stop_strings=[" qu", " fox"])
    assert plain.commit([THE, QUICK, BROWN]) == StopOutcome(" The", 2, FinishReason.STOP)
