"""Protobuf <-> domain dataclasses, the only place the two meet (servicers and clients call it).

Tensors cross as raw little-endian bytes + dtype + shape (specsplit/wire_tensors.py); a round's
sequences travel in columns (specsplit/wire_columns.py). Malformed wire data raises
ServiceError(INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from specsplit.convert_logprobs import fill_asks, fill_logprobs, read_asks, read_logprobs
from specsplit.convert_rules import fill_draft_rules, fill_rules, read_draft_rules, read_rules
from specsplit.errors import invalid
from specsplit.messages import (
    DraftInput,
    DraftOutput,
    SpecParams,
    VerifyInput,
    VerifyOutput,
)
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2
from specsplit.wire_columns import (
    AHEAD_COLUMNS,
    column_of,
    fill_outcomes,
    fill_probs,
    fill_round_probs,
    fill_trees,
    flat_lists,
    indexed,
    nothing_beside,
    probs_from_proto,
    read_outcomes,
    read_round_probs,
    read_trees,
    row_counts,
    rows_of,
    split_flat,
)
from specsplit.wire_tensors import Beside, fill_rows

# -- small messages --------------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unvalidated (callers validate): top_p 0 on the wire means 1 (off); seed optional.

    Floats are float32 on the wire: 0.7 comes back as 0.699999988079071.
    """
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0.0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def spec_to_proto(spec: SpecParams) -> common_pb2.SpecParams:
    return common_pb2.SpecParams(
        num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens
    )


def spec_from_proto(msg: common_pb2.SpecParams) -> SpecParams:
    """Unvalidated. topk 0 on the wire (unset) means 1, a chain."""
    return SpecParams(
        num_steps=msg.num_steps, topk=msg.topk or 1, num_draft_tokens=msg.num_draft_tokens
    )


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    msg = common_pb2.DraftTree()
    _fill_tree(msg, tree)
    return msg


def _fill_tree(msg: common_pb2.DraftTree, tree: DraftTree) -> None:
    msg.tokens.extend(tree.tokens)
    msg.parents.extend(tree.parents)
    if tree.draft_probs is not None:
        fill_probs(msg.draft_probs, tree.draft_probs)


def tree_from_proto(msg: common_pb2.DraftTree, field: str = "tree") -> DraftTree:
    probs = (
        probs_from_proto(msg.draft_probs, f"{field}.draft_probs")
        if msg.HasField("draft_probs")
        else None
    )
    return DraftTree(tokens=list(msg.tokens), parents=list(msg.parents), draft_probs=probs)


# -- drafter ---------------------------------------------------------------------------------

GREEDY = SamplingParams()  # travels as an unset field


def draft_request_to_proto(
    inputs: list[DraftInput], beside: Beside | None = None
) -> drafter_pb2.DraftRequest:
    """beside: the target's feature rows go there (`Beside`), not in the message."""
    msg = drafter_pb2.DraftRequest()
    msg.seq_ids.extend([item.seq_id for item in inputs])
    msg.begin.extend([item.begin for item in inputs])
    msg.start.extend([item.start for item in inputs])
    msg.num_new_tokens.extend([len(item.new_tokens) for item in inputs])
    msg.new_tokens.extend([t for item in inputs for t in item.new_tokens])
    msg.target_kv_committed_len.extend([item.target_kv_committed_len for item in inputs])
    msg.num_steps.extend([item.spec.num_steps for item in inputs])
    msg.topk.extend([item.spec.topk for item in inputs])
    msg.num_draft_tokens.extend([item.spec.num_draft_tokens for item in inputs])
    hidden = [item.target_hidden_states for item in inputs]
    msg.num_target_rows.extend(row_counts(hidden))
    fill_rows(msg.target_hidden_states, hidden, beside)
    for i, item in enumerate(inputs):
        if item.sampling != GREEDY or item.ahead_guesses or item.rules or item.root_allowed:
            options = msg.options.add(index=i)
            if item.sampling != GREEDY:
                options.sampling.CopyFrom(sampling_to_proto(item.sampling))
            if item.ahead_guesses:
                _fill_tree(options.verifying, item.verifying)
                options.ahead_guesses = item.ahead_guesses
            if item.rules is not None:
                fill_draft_rules(options.rules, item.rules)
            options.root_allowed = item.root_allowed
    return msg


def draft_request_from_proto(
    msg: drafter_pb2.DraftRequest, beside: bytearray | memoryview | None = None
) -> list[DraftInput]:
    """beside: the feature rows' bytes that came beside the message (`Beside`)."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    new_tokens = flat_lists(msg, n, "num_new_tokens", "new_tokens")
    rows = rows_of(
        msg.target_hidden_states,
        msg.num_target_rows,
        n,
        "target_hidden_states",
        "num_target_rows",
        beside,
    )
    inputs = [
        DraftInput(seq_id, begin, start, tokens, SpecParams(steps, topk or 1, nodes),
                   GREEDY, committed, hidden)
        for seq_id, begin, start, tokens, steps, topk, nodes, committed, hidden in zip(
            seq_ids,
            column_of(msg.begin, n, "begin"),
            column_of(msg.start, n, "start"),
            new_tokens,
            column_of(msg.num_steps, n, "num_steps"),
            column_of(msg.topk, n, "topk"),
            column_of(msg.num_draft_tokens, n, "num_draft_tokens"),
            column_of(msg.target_kv_committed_len, n, "target_kv_committed_len"),
            rows,
            strict=True,
        )
    ]  # fmt: skip
    for i, options in indexed(msg.options, n, "options").items():
        item = inputs[i]
        if options.HasField("sampling"):
            item.sampling = sampling_from_proto(options.sampling)
        if options.HasField("verifying"):
            item.verifying = tree_from_proto(options.verifying, f"{item.seq_id}.verifying")
        item.ahead_guesses = options.ahead_guesses
        if options.HasField("rules"):
            item.rules = read_draft_rules(options.rules)
        item.root_allowed = options.root_allowed
    return inputs


def draft_response_to_proto(
    outputs: list[DraftOutput], draft_ns: int, beside: Beside | None = None
) -> drafter_pb2.DraftResponse:
    """beside: unused (a draft answer carries no rows); as the other builders take it."""
    msg = drafter_pb2.DraftResponse(draft_ns=draft_ns)
    msg.seq_ids.extend([item.seq_id for item in outputs])
    fill_trees(msg, [item.tree for item in outputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in outputs])
    layers = {item.hidden_state_layers for item in outputs}
    if len(layers) > 1:
        raise ValueError(f"a drafter's outputs name different hidden_state_layers: {layers}")
    msg.hidden_state_layers.extend(layers.pop() if layers else ())
    fill_round_probs(msg.draft_probs, [item.tree for item in outputs])
    # a sampled chain's trees drafted ahead: all of them carry draft probabilities
    ahead_probs = [any(a.tree.draft_probs is not None for a in item.ahead) for item in outputs]
    for i, (item, ahead) in enumerate(zip(outputs, ahead_probs, strict=True)):
        if item.tree.draft_probs is not None or ahead:
            msg.extras.add(
                index=i, has_draft_probs=item.tree.draft_probs is not None, ahead_draft_probs=ahead
            )
    if any(item.ahead for item in outputs):
        fill_outcomes(msg, [item.ahead for item in outputs], AHEAD_COLUMNS)
        fill_round_probs(
            msg.ahead_draft_probs,
            [a.tree for item, ahead in zip(outputs, ahead_probs, strict=True) if ahead
             for a in item.ahead],
        )  # fmt: skip
    return msg


def draft_response_from_proto(
    msg: drafter_pb2.DraftResponse, beside: bytearray | memoryview | None = None
) -> list[DraftOutput]:
    nothing_beside(beside, "DraftResponse")
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    layers = tuple(msg.hidden_state_layers)
    trees = read_trees(msg, n)
    outputs = [
        DraftOutput(seq_id, tree, committed, layers)
        for seq_id, tree, committed in zip(
            seq_ids, trees, column_of(msg.kv_committed_len, n, "kv_committed_len"), strict=True
        )
    ]
    extras_of = indexed(msg.extras, n, "extras")
    with_probs = [i for i, extras in extras_of.items() if extras.has_draft_probs]
    read_round_probs(msg, [outputs[i].tree for i in with_probs])
    if msg.num_outcomes:
        for item, ahead in zip(outputs, read_outcomes(msg, n, AHEAD_COLUMNS), strict=True):
            item.ahead = ahead
    sampled = [i for i, extras in extras_of.items() if extras.ahead_draft_probs]
    trees = [ahead.tree for i in sampled for ahead in outputs[i].ahead]
    read_round_probs(msg, trees, "ahead_draft_probs")
    return outputs


# -- verifier --------------------------------------------------------------------------------


def verify_request_to_proto(
    inputs: list[VerifyInput], beside: Beside | None = None
) -> verifier_pb2.VerifyRequest:
    """Greedy sampling and no draft probabilities travel as no `sampled` entry; decode_steps,
    wants_hidden_states, unhinted and lookup as empty columns when every sequence has the
    default. beside: unused (a Verify request carries no rows)."""
    msg = verifier_pb2.VerifyRequest()
    msg.seq_ids.extend([item.seq_id for item in inputs])
    msg.begin.extend([item.begin for item in inputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in inputs])
    msg.num_pending_tokens.extend([len(item.pending_tokens) for item in inputs])
    msg.pending_tokens.extend([t for item in inputs for t in item.pending_tokens])
    fill_trees(msg, [item.tree for item in inputs])
    steps = [item.decode_steps for item in inputs]
    if any(n != 1 for n in steps):
        msg.decode_steps.extend(steps)
    if any(item.unhinted for item in inputs):
        msg.unhinted.extend([item.unhinted for item in inputs])
    if any(item.lookup for item in inputs):
        msg.lookup.extend([item.lookup for item in inputs])
    fill_asks(msg, inputs)
    fill_rules(msg, inputs)
    layers = {item.hidden_state_layers for item in inputs} - {()}
    if layers:
        if len(layers) > 1:  # the verifier refuses it; the wire cannot carry it
            raise invalid(
                "hidden_state_layers must be the same for every sequence of a round that asks"
                " for hidden states"
            )
        msg.hidden_state_layers.extend(layers.pop())
        msg.wants_hidden_states.extend([bool(item.hidden_state_layers) for item in inputs])
    for i, item in enumerate(inputs):
        has_probs = item.tree.draft_probs is not None
        if item.sampling != GREEDY or has_probs:
            sampled = msg.sampled.add(index=i, has_draft_probs=has_probs)
            if item.sampling != GREEDY:
                sampled.sampling.CopyFrom(sampling_to_proto(item.sampling))
    fill_round_probs(msg.draft_probs, [item.tree for item in inputs])
    return msg


def verify_request_from_proto(
    msg: verifier_pb2.VerifyRequest, beside: bytearray | memoryview | None = None
) -> list[VerifyInput]:
    nothing_beside(beside, "VerifyRequest")
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    pending = flat_lists(msg, n, "num_pending_tokens", "pending_tokens")
    layers = tuple(msg.hidden_state_layers)
    wants = column_of(msg.wants_hidden_states, n, "wants_hidden_states", default=False)
    if any(wants) and not layers:
        raise invalid("wants_hidden_states set with no hidden_state_layers")
    inputs = [
        VerifyInput(seq_id, begin, committed, tokens, tree, GREEDY,
                    layers if wanted else (), steps or 1)
        for seq_id, begin, committed, tokens, tree, wanted, steps in zip(
            seq_ids,
            column_of(msg.begin, n, "begin"),
            column_of(msg.kv_committed_len, n, "kv_committed_len"),
            pending,
            read_trees(msg, n),
            wants,
            column_of(msg.decode_steps, n, "decode_steps", default=1),
            strict=True,
        )
    ]  # fmt: skip
    for item, unhinted in zip(inputs, column_of(msg.unhinted, n, "unhinted", default=False),
                              strict=True):  # fmt: skip
        item.unhinted = unhinted
    for item, lookup in zip(inputs, column_of(msg.lookup, n, "lookup", default=0), strict=True):
        item.lookup = lookup
    read_asks(msg, inputs)
    read_rules(msg, inputs)
    with_probs = []
    for i, sampled in indexed(msg.sampled, n, "sampled").items():
        if sampled.HasField("sampling"):
            inputs[i].sampling = sampling_from_proto(sampled.sampling)
        if sampled.has_draft_probs:
            with_probs.append(i)
    read_round_probs(msg, [inputs[i].tree for i in with_probs])
    return inputs


def verify_response_to_proto(
    outputs: list[VerifyOutput], verify_ns: int, beside: Beside | None = None
) -> verifier_pb2.VerifyResponse:
    """beside: the hidden-state rows go there (`Beside`), not in the message."""
    msg = verifier_pb2.VerifyResponse(verify_ns=verify_ns)
    msg.seq_ids.extend([item.seq_id for item in outputs])
    msg.num_accepted_drafts.extend([len(item.accepted_tokens) for item in outputs])
    msg.num_accepted_tokens.extend([len(item.accepted_tokens) + 1 for item in outputs])
    msg.accepted_tokens.extend([t for item in outputs for t in item.accepted_tokens])
    msg.bonus_token.extend([item.bonus_token for item in outputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in outputs])
    if any(item.decoded_tokens for item in outputs):
        msg.num_decoded_tokens.extend([len(item.decoded_tokens) for item in outputs])
        msg.decoded_tokens.extend([t for item in outputs for t in item.decoded_tokens])
    if any(item.num_lookup_accepted for item in outputs):
        msg.num_lookup_accepted.extend([item.num_lookup_accepted for item in outputs])
    hidden = [item.hidden_states for item in outputs]
    msg.num_hidden_rows.extend(row_counts(hidden))
    fill_rows(msg.hidden_states, hidden, beside)
    fill_logprobs(msg, outputs)
    return msg


def verify_response_from_proto(
    msg: verifier_pb2.VerifyResponse, beside: bytearray | memoryview | None = None
) -> list[VerifyOutput]:
    """beside: the hidden-state rows' bytes that came beside the message (`Beside`)."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    drafts = column_of(msg.num_accepted_drafts, n, "num_accepted_drafts")
    tokens = column_of(msg.num_accepted_tokens, n, "num_accepted_tokens")
    if any(t != d + 1 for d, t in zip(drafts, tokens, strict=True)):
        raise invalid("num_accepted_tokens must be num_accepted_drafts + 1 for every sequence")
    accepted = split_flat(msg.accepted_tokens, drafts, "accepted_tokens", "num_accepted_drafts")
    decoded = flat_lists(msg, n, "num_decoded_tokens", "decoded_tokens", default=0)
    rows = rows_of(
        msg.hidden_states, msg.num_hidden_rows, n, "hidden_states", "num_hidden_rows", beside
    )
    outputs = [
        VerifyOutput(seq_id, drafted, bonus, committed, hidden, steps)
        for seq_id, drafted, bonus, committed, hidden, steps in zip(
            seq_ids,
            accepted,
            column_of(msg.bonus_token, n, "bonus_token"),
            column_of(msg.kv_committed_len, n, "kv_committed_len"),
            rows,
            decoded,
            strict=True,
        )
    ]
    looked_up = column_of(msg.num_lookup_accepted, n, "num_lookup_accepted", default=0)
    for out, accepted_drafts in zip(outputs, looked_up, strict=True):
        if not 0 <= accepted_drafts <= len(out.decoded_tokens):
            raise invalid("num_lookup_accepted must be within num_decoded_tokens")
        out.num_lookup_accepted = accepted_drafts
    read_logprobs(msg, outputs)
    return outputs
