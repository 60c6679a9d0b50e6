"""A round's logit rules (specsplit/logit_rules.py) on its logits, before the acceptance: every
row of every sequence with rules bent in place, as `bend_row` bends one, in one host-to-device
copy and three indexed ops on the device whatever the batch. The host lists the entries: per
row, the biased tokens; the tokens the repetition penalty divides (the prompt's and the
output's, each row's path beside them); the tokens the frequency and presence penalties lower,
each (row, token) once with its whole count, so that no two entries add to one logit (an
accumulating scatter's order would change its rounding)."""

from __future__ import annotations

import numpy as np
import torch

from specsplit.logit_rules import LogitRules
from specsplit.messages import VerifyInput
from specsplit.model.transfer import to_device
from specsplit.tree import DraftTree


def node_paths(tree: DraftTree) -> list[list[int]]:
    """Per node, the tree's tokens from the root's first child down to the node."""
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append([*(paths[parent] if parent >= 0 else ()), token])
    return paths


def _entries(rules: LogitRules, tree: DraftTree, first_row: int) -> tuple[list[np.ndarray], ...]:
    """One sequence's (rows, tokens, values) for the bias, the repetition and the penalties."""
    p = rules.penalties
    n_rows = len(tree) + 1
    rows = np.arange(first_row, first_row + n_rows, dtype=np.float64)
    paths = [[], *node_paths(tree)]  # per row: the root's, then each node's
    bias, repeat, lower = [], [], []
    if p.bias:
        tokens, values = np.array(p.bias, dtype=np.float64).T
        bias.append(np.stack([np.repeat(rows, len(tokens)), np.tile(tokens, n_rows),
                              np.tile(values, n_rows)]))  # fmt: skip
    path_rows = np.array([rows[j] for j, path in enumerate(paths) for _ in path], np.float64)
    path_tokens = np.array([t for path in paths for t in path], dtype=np.float64)
    if p.repetition != 1:
        seen = np.array(sorted(set(rules.prompt) | {t for t, _ in rules.counts}), np.float64)
        keys_rows = np.concatenate([np.repeat(rows, len(seen)), path_rows])
        keys_tokens = np.concatenate([np.tile(seen, n_rows), path_tokens])
        repeat.append(np.stack([keys_rows, keys_tokens, np.full(len(keys_rows), p.repetition)]))
    if p.presence != 0 or p.frequency != 0:
        counted = np.array(rules.counts, dtype=np.float64).reshape(-1, 2)
        # (row, token, count): the output's on every row, then one per path token
        keys = np.concatenate([
            np.stack([np.repeat(rows, len(counted)), np.tile(counted[:, 0], n_rows),
                      np.tile(counted[:, 1], n_rows)]),
            np.stack([path_rows, path_tokens, np.ones(len(path_rows))]),
        ], axis=1)  # fmt: skip
        pairs, where = np.unique(keys[:2], axis=1, return_inverse=True)
        counts = np.bincount(where.reshape(-1), weights=keys[2], minlength=pairs.shape[1])
        lower.append(np.stack([*pairs, -(p.frequency * counts + p.presence)]))
    return bias, repeat, lower


def bend_by_rules(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] float32 on the device, bent in place
    rows: list[range],  # per sequence its n + 1 rows of `logits`
) -> bool:
    """The rows of the inputs with rules bent by them; whether any were (the logits' argmax
    must then be taken again)."""
    kinds: tuple[list[np.ndarray], ...] = ([], [], [])
    for item, r in zip(inputs, rows, strict=True):
        if item.rules is not None:
            for kind, found in zip(kinds, _entries(item.rules, item.tree, r.start), strict=True):
                kind.extend(found)
    sizes = [sum(e.shape[1] for e in kind) for kind in kinds]
    if not any(sizes):
        return False
    table = np.concatenate([e for kind in kinds for e in kind], axis=1)
    on_device = to_device(torch.from_numpy(table), logits.device)
    row, token = on_device[0].long(), on_device[1].long()
    value = on_device[2].to(logits.dtype)
    a, b = sizes[0], sizes[0] + sizes[1]
    if sizes[0]:  # each (row, token) once per sequence: the scatter adds one value to each
        logits.index_put_((row[:a], token[:a]), value[:a], accumulate=True)
    if sizes[1]:  # a (row, token) listed twice is written twice with one value
        x = logits[row[a:b], token[a:b]]
        logits[row[a:b], token[a:b]] = torch.where(x > 0, x / value[a:b], x * value[a:b])
    if sizes[2]:
        logits.index_put_((row[b:], token[b:]), value[b:], accumulate=True)
    return True
