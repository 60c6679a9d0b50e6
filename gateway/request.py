"""What a client asks for and what it gets back, as the scheduler sees it (no protobuf), and the
one place a request is validated (`build_request`): the gRPC and the OpenAI HTTP APIs both call it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from jinja2 import TemplateError

from gateway.guides import GuideAsk, GuideCache, token_guide
from gateway.invalid import InvalidField, check_vocab
from specsplit.guide.tokens import TokenGuide
from specsplit.logit_rules import Penalties, distinct
from specsplit.messages import MAX_TOP_LOGPROBS, SpecParams, TokenLogprobs
from specsplit.prompt import apply_chat_template, encode_prompt
from specsplit.sampling import SamplingParams

PromptKind = Literal["text", "chat", "token_ids"]
# the longest prompt whose log-probabilities a request may ask for (GenerationRequest.
# prompt_logprobs): its first round's forward holds [prompt, vocab] float32 logits (~0.8 GB
# for SmolLM2's vocabulary, 2 GB for a 128k one)
MAX_SCORED_PROMPT = 4096
# what chat templates render ("tool": a function's result, in function calling)
CHAT_ROLES = ("system", "user", "assistant", "tool")
# A prompt that fits the context is far below this many bytes per token of context (English
# text: ~4); the default limit on prompt bytes, counted before anything is tokenized.
PROMPT_BYTES_PER_CONTEXT_TOKEN = 32


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    spec: SpecParams | None = None  # None = the gateway's default
    ignore_eos: bool = False
    # A session's turn (gateway/sessions.py): prompt_ids is this turn's prompt alone until the
    # session makes it the whole conversation; turn_prompt is the prompt as sent (the session
    # encodes text and renders chat as a continuation of what it holds).
    session_id: str | None = None
    turn_prompt: tuple[PromptKind, Any] | None = None
    max_new_tokens_default: bool = False  # not given: the rest of the context, up to the limit
    # each generated token's log-probability under the target and this many most likely
    # tokens' beside it (Chunk.logprobs); None: none
    logprobs: int | None = None
    # the prompt's tokens' log-probabilities (each but the first) and this many most likely
    # tokens' beside each, on the first chunk (Chunk.prompt_logprobs); None: none
    prompt_logprobs: int | None = None
    # a logit bias and penalties (specsplit/logit_rules.py); None: none
    penalties: Penalties | None = None
    # no EOS, stop token or stop string ends the generation before this many tokens (the
    # verifier holds the stop tokens back: Penalties.min_tokens)
    min_tokens: int = 0
    include_stop_str: bool = False  # the text ends with the stop string that ended it
    skip_special_tokens: bool = True  # False: special tokens' text is streamed too (not EOS)
    # guided decoding (gateway/guides.py): the output is a match of an automaton's pattern, or
    # made of allowed tokens alone (FixedTokens: allowed_token_ids)
    guide: TokenGuide | None = None


@dataclass
class SpecStats:
    rounds: int = 0  # target steps: a round of several decode steps counts each
    num_accepted_drafts: int = 0
    num_accepted_tokens: int = 0
    num_reused_tokens: int = 0  # a session turn's prompt tokens whose verifier KV was kept

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
    # the request's GenerationRequest.logprobs: one entry per token of token_ids
    logprobs: TokenLogprobs | None = None
    # the first chunk's, where the request asks (GenerationRequest.prompt_logprobs): one entry
    # per prompt token but the first
    prompt_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the target model."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_context: int  # prompt + generated tokens must fit
    eos_token_ids: tuple[int, ...] = ()

    @functools.cached_property
    def guides(self) -> GuideCache:
        """The model's compiled guides (guided decoding)."""
        return GuideCache(self.tokenizer, self.vocab_size)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the gateway (DESIGN.md §8), so that no client spends
    everyone's capacity: draft tree shape, generated tokens, prompt size (bytes of text or chat
    contents, counted before tokenizing; token ids are bounded by the context) and the size of
    a request message as it arrives (gRPC and HTTP)."""

    max_num_steps: int = 16
    max_topk: int = 8
    max_num_draft_tokens: int = 64
    max_new_tokens: int = 4096
    max_prompt_bytes: int | None = None  # None = PROMPT_BYTES_PER_CONTEXT_TOKEN x the context
    max_message_bytes: int = 4 * 1024 * 1024  # a gRPC request or an HTTP body (gRPC's default)

    def prompt_bytes(self, model: ModelInfo) -> int:
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return PROMPT_BYTES_PER_CONTEXT_TOKEN * model.max_context

    def check_spec(self, spec: SpecParams) -> None:
        """INVALID_ARGUMENT naming the field of a tree shape over the limits."""
        for name, value, limit in (
            ("num_steps", spec.num_steps, self.max_num_steps),
            ("topk", spec.topk, self.max_topk),
            ("num_draft_tokens", spec.num_draft_tokens, self.max_num_draft_tokens),
        ):
            if value > limit:
                raise InvalidField(
                    f"spec.{name}", f"spec.{name} = {value} is over this server's limit of {limit}"
                )


DEFAULT_LIMITS = Limits()


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
    limits: Limits = DEFAULT_LIMITS,
    session_id: str | None = None,
    logprobs: int | None = None,
    penalties: Penalties | None = None,
    min_tokens: int = 0,
    include_stop_str: bool = False,
    truncate_prompt_tokens: int | None = None,
    skip_special_tokens: bool = True,
    guide: GuideAsk | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] = (),
    tools: Sequence[Mapping[str, Any]] = (),
    prompt_logprobs: int | None = None,
) -> GenerationRequest:
    """Validate and tokenize; raises InvalidField naming the field. The limits are checked
    first, the prompt's size before it is tokenized. Tokenizes: run it off the event loop.
    truncate_prompt_tokens: the prompt's last this many tokens only (vLLM's; not a session's
    turn). tools: a chat's function tools, as its template renders them
    (specsplit/prompt.py)."""
    if max_new_tokens is not None and max_new_tokens > limits.max_new_tokens:
        raise InvalidField(
            "max_new_tokens",
            f"max_new_tokens = {max_new_tokens} is over this server's limit of "
            f"{limits.max_new_tokens}",
        )
    if spec is not None:
        spec.validate()
        limits.check_spec(spec)
    if not skip_special_tokens and session_id:  # (a session re-reads its replies' text)
        raise InvalidField("skip_special_tokens", "only true in a session's turn")
    if truncate_prompt_tokens is not None:
        if session_id:
            raise InvalidField("truncate_prompt_tokens", "not with a session's turn")
        if not 1 <= truncate_prompt_tokens < model.max_context:
            raise InvalidField(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens = {truncate_prompt_tokens}: must be in [1, "
                f"{model.max_context - 1}] (the context, room for one generated token)",
            )
    truncating = truncate_prompt_tokens is not None
    prompt_ids = checked_prompt_ids(model, prompt_kind, prompt, limits, truncating, tools)
    if truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-truncate_prompt_tokens:]
    check_vocab(stop_token_ids, "stop_token_ids", model.vocab_size)
    max_new_tokens_default = max_new_tokens is None
    if max_new_tokens is None:  # the rest of the context (OpenAI's chat default), up to the limit
        max_new_tokens = min(max(model.max_context - len(prompt_ids), 0), limits.max_new_tokens)
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
    for name, asked in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if asked is not None and not 0 <= asked <= min(MAX_TOP_LOGPROBS, model.vocab_size):
            raise InvalidField(
                name,
                f"{name} = {asked}: the most likely tokens a token comes with, 0 to "
                f"{min(MAX_TOP_LOGPROBS, model.vocab_size)}",
            )
    if prompt_logprobs is not None and session_id:  # (a turn's prompt is the conversation's)
        raise InvalidField("prompt_logprobs", "not with a session's turn")
    if prompt_logprobs is not None and len(prompt_ids) > MAX_SCORED_PROMPT:
        raise InvalidField(
            "prompt_logprobs",
            f"a prompt of {len(prompt_ids)} tokens: at most {MAX_SCORED_PROMPT} (the verifier "
            "holds every prompt row's logits at once)",
        )
    if not 0 <= min_tokens <= max_new_tokens:
        raise InvalidField(
            "min_tokens", f"min_tokens = {min_tokens}: must be in [0, max_new_tokens]"
        )
    if penalties is not None and penalties.min_p and sampling.greedy:
        penalties = replace(penalties, min_p=0.0)  # (the argmax is never cut)
    if min_tokens:  # the stop tokens the verifier holds back until then
        stop_ids = ending_ids(model.eos_token_ids, ignore_eos, stop_token_ids)
        penalties = replace(penalties or Penalties(), min_tokens=min_tokens, stop_ids=stop_ids)
    if penalties is not None:
        try:
            penalties.validate(model.vocab_size)
        except ValueError as err:  # the message starts with the field's name
            raise InvalidField(str(err).split(" ", 1)[0].rstrip(":"), str(err)) from None
    automaton = token_guide(model, guide, allowed_token_ids, bad_words, ignore_eos, min_tokens)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(stop_strings),
        stop_token_ids=tuple(stop_token_ids),
        spec=spec,
        ignore_eos=ignore_eos,
        session_id=session_id or None,
        turn_prompt=_turn_prompt(prompt_kind, prompt) if session_id else None,
        max_new_tokens_default=max_new_tokens_default,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        penalties=penalties if penalties is not None and penalties.active else None,
        min_tokens=min_tokens,
        include_stop_str=include_stop_str,
        skip_special_tokens=skip_special_tokens,
        guide=automaton,
    )


def ending_ids(
    eos_token_ids: Sequence[int], ignore_eos: bool, stop_token_ids: Sequence[int]
) -> tuple[int, ...]:
    """The tokens that end a request's generation (kept, their text not streamed): the model's
    EOS unless it ignores them, and its stop token ids; each once, by id."""
    return distinct((*(() if ignore_eos else eos_token_ids), *stop_token_ids))


def checked_prompt_ids(
    model: ModelInfo,
    kind: PromptKind,
    prompt: str | Sequence[Mapping[str, str]] | Sequence[int],
    limits: Limits = DEFAULT_LIMITS,
    truncating: bool = False,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """A prompt's token ids as a request's generation reads them, its size checked before it is
    tokenized (`check_prompt`); InvalidField("prompt") otherwise. Tokenizes: off the event loop.
    truncating: the caller keeps its last tokens only (token ids past the context allowed)."""
    check_prompt(model, kind, prompt, limits.prompt_bytes(model), truncating)
    return _prompt_ids(model, kind, prompt, tools)


def _turn_prompt(
    kind: PromptKind, prompt: str | Sequence[Mapping[str, str]] | Sequence[int]
) -> tuple[PromptKind, Any]:
    """A session turn's prompt as sent: text, chat messages ({"role", "content"}) or ids."""
    if kind == "text":
        return kind, prompt
    if kind == "chat":
        messages = cast("Sequence[Mapping[str, str]]", prompt)
        return kind, [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    return kind, [int(t) for t in cast("Sequence[int]", prompt)]


def check_prompt(
    model: ModelInfo,
    kind: PromptKind,
    prompt: str | Sequence[Mapping[str, str]] | Sequence[int],
    max_bytes: int,
    truncating: bool = False,
) -> None:
    """What can be checked without the tokenizer, so a huge prompt costs next to nothing: its
    size (UTF-8 bytes of the text or of the chat's roles and contents; the number of token ids,
    unless `truncating`), text a tokenizer cannot take (a lone surrogate), and the chat roles."""
    if kind == "token_ids":
        if len(prompt) >= model.max_context and not truncating:
            raise InvalidField(
                "prompt",
                f"prompt.token_ids has {len(prompt)} tokens: over the model's context of "
                f"{model.max_context} with room for one generated token",
            )
        return
    texts: list[object] = [prompt] if kind == "text" else []
    if kind == "chat":
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping) or message.get("role") not in CHAT_ROLES:
                role = message.get("role") if isinstance(message, Mapping) else None
                roles = ", ".join(CHAT_ROLES)
                raise InvalidField(
                    "prompt", f"chat message {i}: role {role!r} is not one of {roles}"
                )
            texts += [message["role"], message.get("content")]
    what = "prompt.text" if kind == "text" else "the chat messages"
    size = 0
    for text in texts:
        if not isinstance(text, str):
            raise InvalidField("prompt", f"{what}: {type(text).__name__} is not text")
        if len(text) > max_bytes:  # characters <= UTF-8 bytes: no need to encode it
            size = len(text)
            break
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError as err:
            raise InvalidField(
                "prompt", f"{what}: character {err.start} is not valid Unicode ({err.reason})"
            ) from None
    if size > max_bytes:
        raise InvalidField(
            "prompt", f"{what}: over this server's limit of {max_bytes} bytes (at least {size})"
        )


def _prompt_ids(
    model: ModelInfo,
    kind: PromptKind,
    prompt: str | Sequence[Mapping[str, str]] | Sequence[int],
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    if not prompt:
        raise InvalidField("prompt", f"prompt.{kind} is empty")
    if kind == "text":
        assert isinstance(prompt, str)
        ids = encode_prompt(model.tokenizer, prompt)
    elif kind == "chat":
        try:
            ids = apply_chat_template(model.tokenizer, prompt, tools)  # type: ignore[arg-type]
        except TemplateError as err:  # the template's own raise_exception (roles, order)
            raise InvalidField("prompt", f"the model's chat template refused it: {err}") from None
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        check_vocab(ids, "prompt.token_ids", model.vocab_size)
    if not ids:
        raise InvalidField("prompt", f"prompt.{kind} encodes to no tokens")
    return ids
