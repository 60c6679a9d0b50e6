"""A session's turn as a continuation of the session (gateway/sessions.py runs the turns): its
whole conversation, the KV it keeps of the session's, and what a taken-back turn carries back.

Continuations (what "the whole conversation" is for each prompt kind):
- token ids: the session's tokens + the ids;
- text: the session's tokens + the text encoded on its own, special tokens added only on a
  session's first turn;
- chat: the chat template over the session's earlier messages, each earlier reply as the
  assistant message the client received (its streamed text), then the new messages. The KV of
  the longest common prefix with the session's tokens is kept: normally all of them, less where
  the rendering differs from what was generated (a reply cut by a stop string, a reply the
  tokenizer encodes differently).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from gateway.request import GenerationRequest, InvalidField
from gateway.sequence import Sequence
from gateway.session_state import Session
from specsplit.prompt import apply_chat_template


def continuation(
    tokenizer: PreTrainedTokenizerBase, session: Session, request: GenerationRequest
) -> tuple[list[int], list[dict[str, str]] | None]:
    """A turn's whole conversation (its tokens, and its chat messages for a chat turn): see the
    module docstring. Runs the tokenizer: off the event loop."""
    kind, prompt = request.turn_prompt or ("token_ids", request.prompt_ids)
    held = session.tokens
    if kind == "token_ids":
        return held + request.prompt_ids, None
    if kind == "text":
        if not held:
            return list(request.prompt_ids), None
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        if not ids:
            raise InvalidField("prompt", "prompt.text encodes to no tokens")
        return held + ids, None
    if held and session.messages is None:
        raise InvalidField(
            "prompt",
            "this session holds text or token-id turns: a chat turn continues only a session of "
            "chat turns (send text or token ids, or open a new session)",
        )
    messages = [*(session.messages or []), *prompt]
    return apply_chat_template(tokenizer, messages), messages


def carry(turn: Sequence, last: Sequence) -> None:
    """A taken-back turn's service state, truncated to where it began, onto the session's last
    completed turn (the two agree up to there)."""
    last.verifier_begun, last.drafter_begun = turn.verifier_begun, turn.drafter_begun
    last.hidden_state_layers = turn.hidden_state_layers
    last.verifier_kv_committed_len = turn.verifier_kv_committed_len
    last.features = turn.features
    last.features_gap = turn.features_gap
    last.drafter_num_tokens = turn.drafter_num_tokens
    if not turn.verifier_begun:
        last.forget_verifier()
    if not turn.drafter_begun:
        last.forget_drafter()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
