"""Prompt encoding, chat templates and streaming detokenization on SmolLM2's tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from gateway.text import IncrementalDetokenizer
from specsplit.prompt import apply_chat_template, encode_prompt

# SmolLM2 (byte-level BPE): " 😀" is two tokens, " 日本語" seven, each char split across pieces.
EMOJI_IDS = [40303, 218]  # " \xf0\x9f\x98", "\x80"
CJK_IDS = [17097, 241, 115, 40993, 179, 120, 248]  # " 日" = 3 tokens, "本" = 1, "語" = 3
THE_QUICK_IDS = [378, 2365]  # " The", " quick"
EOS_ID = 2  # <|im_end|>
SURROGATES = range(0xD800, 0xE000)  # code points that are not text
# The template's system prompt, then "Hi", then the assistant generation prompt.
CHAT_HI_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


@pytest.fixture
def prompt_ids(smollm2_tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "Hi"}])


def test_encode_prompt_adds_no_bos(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    assert encode_prompt(smollm2_tokenizer, "hello world") == [28120, 905]


def test_chat_template_matches_tokenizer(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    ids = apply_chat_template(smollm2_tokenizer, messages)
    assert ids == CHAT_HI_IDS
    rendered = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids == smollm2_tokenizer.encode(rendered, add_special_tokens=False)


def test_multibyte_char_split_across_tokens(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    assert detok.add(EMOJI_IDS[:1]) == ""  # 3 of the emoji's 4 bytes: held back
    assert detok.add(EMOJI_IDS[1:]) == " 😀"
    assert detok.flush() == ""


def test_cjk_chars_split_across_tokens_one_token_per_round(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    assert [detok.add([t]) for t in CJK_IDS] == ["", "", " 日", "本", "", "", "語"]


def test_round_ending_mid_char_emits_the_complete_chars(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    assert detok.add([*THE_QUICK_IDS, *CJK_IDS[:5]]) == " The quick 日本"
    assert detok.add(CJK_IDS[5:]) == "語"


def test_flush_emits_incomplete_char_as_replacement(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    assert detok.add([THE_QUICK_IDS[0], EMOJI_IDS[0]]) == " The"
    assert detok.flush() == " \ufffd"
    assert smollm2_tokenizer.decode(EMOJI_IDS[:1]) == " \ufffd"


def test_special_tokens_are_skipped(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    assert detok.add([EOS_ID]) == ""
    assert detok.add(THE_QUICK_IDS) == " The quick"
    kept = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids, skip_special_tokens=False)
    assert kept.add([EOS_ID, *THE_QUICK_IDS]) == "<|im_end|> The quick"


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    """All deltas of `ids` fed in rounds of 1..6 tokens, then the flush."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    return "".join(deltas) + detok.flush()


@pytest.mark.parametrize("seed", range(20))
def test_deltas_concatenate_to_full_decode(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    vocab_size = len(smollm2_tokenizer)
    # Uniform ids (special tokens, byte pieces that form no valid UTF-8 included), then text
    # dense in multi-byte chars, tokenized normally.
    random_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))]
    codepoints = (rng.randrange(0x20, 0x2FFFF) for _ in range(8))
    chars = "aé€😀日本語🎉ß ,\n" + "".join(chr(c) for c in codepoints if c not in SURROGATES)
    text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 40)))
    text_ids = smollm2_tokenizer.encode(text)
    for generated_ids in (random_ids, text_ids, random_ids + text_ids):
        detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
        expected = smollm2_tokenizer.decode(generated_ids, skip_special_tokens=True)
        assert _stream(detok, generated_ids, rng) == expected


def test_deltas_never_end_with_a_broken_char(
    smollm2_tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
) -> None:
    text = "日本語 😀🎉 emoji ünïcödé " * 4
    ids = smollm2_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_first_token_decoded_in_prompt_context() -> None:
    # SentencePiece-style decoders drop the leading space of a decode's first token: the stream
    # keeps it, as the text that follows the prompt (decode(prompt + generated) - decode(prompt)).
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tokenizer.decode([2, 3]) == "world!"
    assert tokenizer.decode([1, 2, 3]) == "Hello world!"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1])
    assert [detok.add([2]), detok.add([3]), detok.flush()] == [" world", "!", ""]


class _OwnDecode(PreTrainedTokenizerFast):
    """A tokenizer class with its own decode: the detokenizer must call it."""

    def decode(self, token_ids, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        return "<own>"


def test_fast_tokenizers_decode_in_their_backend_with_the_same_text(
    smollm2_tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detokenizer asks a fast tokenizer's backend directly: the same text as transformers'
    decode (special tokens skipped, no clean-up) on random ids, specials and split characters
    among them; a class that overrides decode is asked through it."""
    from gateway.text import _decoder

    rng = random.Random(0)
    decode = _decoder(smollm2_tokenizer, skip_special_tokens=True)
    transformers_decode = PreTrainedTokenizerBase.decode
    with monkeypatch.context() as patch:  # the backend's decode, not transformers'
        patch.setattr(PreTrainedTokenizerBase, "decode", None)
        assert decode(THE_QUICK_IDS) == " The quick"
    assert PreTrainedTokenizerBase.decode is transformers_decode
    special = [EOS_ID, 1, 0]
    for _ in range(200):
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randrange(12))]
        ids += rng.sample(special + EMOJI_IDS + CJK_IDS, 3)
        rng.shuffle(ids)
        want = smollm2_tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert decode(ids) == want
    with_specials = _decoder(smollm2_tokenizer, skip_special_tokens=False)
    assert with_specials([EOS_ID, *THE_QUICK_IDS]) == "<|im_end|> The quick"
    own = _OwnDecode(tokenizer_object=smollm2_tokenizer.backend_tokenizer)
    assert _decoder(own, skip_special_tokens=True)(THE_QUICK_IDS) == "<own>"
