"""What a client asks for and what it gets back, as the scheduler sees it (no protobuf), and the
one place a request is validated (`build_request`): the gRPC and the OpenAI HTTP APIs both call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.text import apply_chat_template, encode_prompt
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams

PromptKind = Literal["text", "chat", "token_ids"]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    spec: SpecParams | None = None  # None = the gateway's default
    ignore_eos: bool = False


@dataclass
class SpecStats:
    rounds: int = 0
    num_accepted_drafts: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.num_accepted_tokens / self.rounds if self.rounds else 0.0


@dataclass
class Chunk:
    """One streamed piece of a generation; the last one has finish_reason set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None, "stop" or "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    elapsed_ns: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the target model."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_context: int  # prompt + generated tokens must fit
    eos_token_ids: tuple[int, ...] = ()


class InvalidField(ServiceError):
    """INVALID_ARGUMENT for one request field; `field` is its domain name (max_new_tokens,
    temperature, stop, ...) so each API can report it under its own name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(Code.INVALID_ARGUMENT, message)
        self.field = field


def build_request(
    model: ModelInfo,
    prompt_kind: PromptKind,
    prompt: str | Sequence[Mapping[str, str]] | Sequence[int],
    *,
    max_new_tokens: int | None,
    sampling: SamplingParams,
    stop_strings: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    spec: SpecParams | None = None,
    ignore_eos: bool = False,
) -> GenerationRequest:
    """Validate and tokenize; raises InvalidField naming the field. Tokenizes: run it off the
    event loop."""
    prompt_ids = _prompt_ids(model, prompt_kind, prompt)
    _check_vocab(stop_token_ids, "stop_token_ids", model.vocab_size)
    if max_new_tokens is None:  # the rest of the context (OpenAI's chat default)
        max_new_tokens = max(model.max_context - len(prompt_ids), 0)
    if max_new_tokens <= 0:
        raise InvalidField("max_new_tokens", f"max_new_tokens = {max_new_tokens}: must be > 0")
    total = len(prompt_ids) + max_new_tokens
    if total > model.max_context:
        raise InvalidField(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total}"
            f" exceeds the model's context of {model.max_context} tokens",
        )
    try:
        sampling.validate()
    except ValueError as err:  # the message starts with the field's name
        raise InvalidField(str(err).split(" ", 1)[0], f"sampling.{err}") from None
    for i, stop in enumerate(stop_strings):
        if not stop:
            raise InvalidField("stop", f"stop[{i}] is empty")
    if spec is not None:
        spec.validate()
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(stop_strings),
        stop_token_ids=tuple(stop_token_ids),
        spec=spec,
        ignore_eos=ignore_eos,
    )


def _prompt_ids(
    model: ModelInfo,
    kind: PromptKind,
    prompt: str | Sequence[Mapping[str, str]] | Sequence[int],
) -> list[int]:
    if not prompt:
        raise InvalidField("prompt", f"prompt.{kind} is empty")
    if kind == "text":
        assert isinstance(prompt, str)
        ids = encode_prompt(model.tokenizer, prompt)
    elif kind == "chat":
        ids = apply_chat_template(model.tokenizer, prompt)  # type: ignore[arg-type]
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        _check_vocab(ids, "prompt.token_ids", model.vocab_size)
    if not ids:
        raise InvalidField("prompt", f"prompt.{kind} encodes to no tokens")
    return ids


def _check_vocab(ids: Sequence[int], field: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidField(
                field.split(".")[0],
                f"{field}[{i}] = {token} outside the vocabulary [0, {vocab_size})",
            )
