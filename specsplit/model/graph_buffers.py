"""The fixed inputs and outputs of a model's CUDA graphs of one (q, aux_layers)
(specsplit/model/cuda_graphs.py): the step's metadata filled into one pinned host buffer and
moved in one copy, its outputs' wanted rows taken from the graphs' output buffers."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from specsplit.kernels.argmax import argmax_rows
from specsplit.model.batch import ForwardBatch, ForwardOutput

# pinned host mirrors a graph's inputs are filled into in turn. A mirror is free again once its
# copy to the device has run, and that copy is stream-ordered behind every step queued before
# it: with one mirror a step's launch waited until the device had finished the step before the
# last, so the host could not queue more than ~one step ahead (--decode-ahead-depth 2-3 did not:
# at depth 3 a further step's launch took 0.87 ms at 8 streams on an H200 host, ~a step's device
# time, against 0.42 ms at depth 1-2; fifty-seventh session). The verifier queues a round's step
# and up to 3 run ahead behind it (MAX_AHEAD_DEPTH), and a hinted round beside them: up to five
# mirrors leave every launch free of waiting
HOST_MIRRORS = 5

M = TypeVar("M")


def next_mirror(turn: int, copied: list[torch.cuda.Event], add: Callable[[], None]) -> int:
    """The host mirror to fill after mirror `turn` (mirrors taken in turn, each's last copy's
    event in `copied`): the next one, or while its copy has not run and fewer than
    HOST_MIRRORS exist a new one (`add` appends it and its event); once its last copy has run."""
    turn = (turn + 1) % len(copied)
    if len(copied) < HOST_MIRRORS and not copied[turn].query():
        add()  # steps queued ahead: one more mirror
        turn = len(copied) - 1
    copied[turn].synchronize()  # this mirror is free again
    return turn


class CaptureStream:
    """The one side stream every capture of a set of graphs runs on, made at the first. The
    graphs' shared memory pool caches its blocks per stream: a fresh stream a capture could not
    reuse what earlier captures freed, and each took new memory (the verifier's sampled
    acceptance graphs on SmolLM2, 48 of them at batch 64: 6.5 GiB held, 3.3 on one stream;
    bench/RESULTS.md, ninety-fourth session)."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def __call__(self, device: torch.device | str) -> torch.cuda.Stream:
        """The stream, after the device's current stream's work queued so far."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return self._stream


class HostMirrors(Generic[M]):
    """A graph's pinned host mirrors (each what `make` returns), taken in turn as `next_mirror`
    says: `take` waits until the next one's last copy has run (or makes one more while fewer
    than HOST_MIRRORS exist) and gives it; `copied` records, once its copy to the device is
    queued, that the mirror `take` gave is in flight."""

    def __init__(self, make: Callable[[], M], first: int = 2) -> None:
        self._make = make
        self.mirrors: list[M] = []
        self._copied: list[torch.cuda.Event] = []  # each mirror's last copy
        self.turn = 0  # the mirror `take` gave last
        for _ in range(first):
            self._add()

    def _add(self) -> None:
        self.mirrors.append(self._make())
        self._copied.append(torch.cuda.Event())

    def take(self) -> M:
        self.turn = next_mirror(self.turn, self._copied, self._add)
        return self.mirrors[self.turn]

    @property
    def current(self) -> M:
        """The mirror `take` gave last."""
        return self.mirrors[self.turn]

    @property
    def event(self) -> torch.cuda.Event:
        """The event of the mirror `take` gave last (its last copy's)."""
        return self._copied[self.turn]

    def copied(self, device: torch.device) -> None:
        self._copied[self.turn].record(torch.cuda.current_stream(device))


class GraphBuffers:
    """Fixed inputs and outputs of the graphs of one (q, aux_layers). The inputs are views of
    one packed device tensor with pinned host mirrors (HOST_MIRRORS, taken in turn): a step
    fills a mirror and moves it in one asynchronous copy (a pageable copy would wait for the GPU
    each time). The outputs are sized from the first (largest) warm-up run."""

    def __init__(
        self,
        max_bs: int,
        q: int,
        max_pages: int,
        features: tuple[int, torch.dtype] | None,  # (width, dtype) of a features input
        device: torch.device,
        greedy: bool = False,  # each run also takes its logits rows' argmax (`greedy`)
    ) -> None:
        t = max_bs * q
        self.q, self.max_bs, self.max_pages = q, max_bs, max_pages
        # one pinned host mirror and its device copy, bytes seen as three arrays (a step moves
        # them in one copy, ~10 us of host work each): int64, each [max_bs * q]: input_ids,
        # positions, slot_mapping, the step's logit rows, its hidden-state rows, and every row
        # (an arange: what the graphs compute); int32: cu_seqlens_q [max_bs + 1], kv_lens,
        # prefix_lens [max_bs], block_table; the bool mask [max_bs, q, q] (copied where q > 1)
        sizes = [6 * t * 8, (1 + 3 * max_bs + max_bs * max_pages) * 4, max_bs * q * q]
        # each array 256-byte aligned, as an allocation of its own would be (kernels' loads)
        ends = list(itertools.accumulate(-(-size // 256) * 256 for size in sizes))
        # (the mask's bytes are copied only where q > 1: the two arrays before it are all of a
        # step's inputs otherwise)
        num_copied = ends[-1] if q > 1 else ends[1]
        self._layout = (sizes, ends, num_copied)
        # the host mirrors, made as launches find the next one still waiting for its copy (one
        # where nothing is queued ahead: a long context's page tables make each several MB)
        self.mirrors = HostMirrors(self._new_mirror, first=1)  # (bytes to copy, views)
        self.host_copied, self.host = self.mirrors.current
        self.dev_bytes = torch.zeros(ends[-1], dtype=torch.uint8, device=device)
        self.dev_bytes[:num_copied].copy_(self.host_copied)
        self.dev_copied = self.dev_bytes[:num_copied]
        self.dev: dict[str, Any] = self._views(*self._arrays(self.dev_bytes, sizes, ends))
        self.causal = np.tril(np.ones((q, q), dtype=bool))
        self.features = (
            None
            if features is None
            else torch.zeros(t, features[0], dtype=features[1], device=device)
        )
        self.logits: torch.Tensor | None = None  # [max_bs * q, vocab] float32
        self.hidden_states: torch.Tensor | None = None  # [max_bs * q, width] when there are any
        # [max_bs * q] int64: each logits row's argmax (greedy acceptance's and decoding's), in
        # the graph beside the logits (argmax_rows: ~10 us less a step than torch.argmax after)
        self.greedy = torch.zeros(t, dtype=torch.int64, device=device) if greedy else None

    def _new_mirror(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """Another pinned host mirror (its bytes to copy, its numpy views), its constant arrays
        filled: every row (an arange) and the full buckets' cu_seqlens_q."""
        sizes, ends, num_copied = self._layout
        t, q = self.max_bs * self.q, self.q
        data = torch.zeros(ends[-1], dtype=torch.uint8).pin_memory()
        host64, host32, host_mask = self._arrays(data, sizes, ends)
        host64[5 * t :] = torch.arange(t)
        host32[: self.max_bs + 1] = torch.arange(0, t + 1, q, dtype=torch.int32)
        # views made once: numpy ones of the mirrors (a step fills them at numpy's cost, ~1 us
        # a slice, not torch's ~5 us)
        views = {
            name: None if view is None else view.numpy()
            for name, view in self._views(host64, host32, host_mask).items()
        }
        return data[:num_copied], views

    def keep(self, out: ForwardOutput) -> None:
        """Copy a run's outputs (all rows) into the fixed output buffers, made on the first."""
        t = out.logits.shape[0]
        if self.logits is None:  # the first run: the largest bucket
            self.logits = torch.zeros_like(out.logits, dtype=torch.float32)
            if out.hidden_states is not None:
                self.hidden_states = torch.zeros_like(out.hidden_states)
        self.logits[:t].copy_(out.logits)
        if self.hidden_states is not None and out.hidden_states is not None:
            self.hidden_states[:t].copy_(out.hidden_states)
        if self.greedy is not None:
            argmax_rows(self.logits[:t], out=self.greedy[:t])

    def _arrays(
        self, data: torch.Tensor, sizes: list[int], ends: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int64, int32 and mask arrays in `data`'s bytes (pieces of `sizes` bytes, each
        starting where the one before ends, `ends`)."""
        starts = [0, *ends[:-1]]
        pieces = [data[a : a + size] for a, size in zip(starts, sizes, strict=True)]
        mask = pieces[2].view(torch.bool).view(self.max_bs, self.q, self.q)
        return pieces[0].view(torch.int64), pieces[1].view(torch.int32), mask

    def _views(
        self, packed64: torch.Tensor, packed32: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        t, n = self.max_bs * self.q, self.max_bs
        ids, positions, slots, rows, hidden_rows, all_rows = packed64.split(t)
        cu, kv_lens, prefix_lens, table = packed32.split([n + 1, n, n, n * self.max_pages])
        return dict(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            rows=rows,
            hidden_rows=hidden_rows,
            all_rows=all_rows,
            cu_seqlens_q=cu,
            kv_lens=kv_lens,
            prefix_lens=prefix_lens,
            block_table=table.view(n, self.max_pages),
            tree_mask=mask if self.q > 1 else None,
        )

    def batch(self, bs: int, page_size: int) -> ForwardBatch:
        """Device views of the first `bs` sequences: the graph of bucket `bs` reads these."""
        v, q = self.dev, self.q
        t = bs * q
        return ForwardBatch(
            input_ids=v["input_ids"][:t],
            positions=v["positions"][:t],
            slot_mapping=v["slot_mapping"][:t],
            cu_seqlens_q=v["cu_seqlens_q"][: bs + 1],
            kv_lens=v["kv_lens"][:bs],
            prefix_lens=v["prefix_lens"][:bs],
            block_table=v["block_table"][:bs],
            tree_mask=None if v["tree_mask"] is None else v["tree_mask"][:bs],
            logit_indices=v["all_rows"][:t],  # fixed memory the graph may read
            max_q_len=q,
            page_size=page_size,
        )

    def fill(
        self,
        batch: ForwardBatch,
        bucket: int,
        scratch_page: int,
        scratch_slot: int,
        features: torch.Tensor | None = None,  # [T, width] on the device
        tokens: torch.Tensor | None = None,  # [T] on the device: the input ids, not the host's
    ) -> None:
        """Write `batch` (host tensors) and padding up to `bucket` into the host mirrors, then
        move them to the device (asynchronously, after the last move has finished); features go
        device to device (the padding rows keep what they held). A sequence with fewer than q
        query tokens is padded at its end with rows that read its first new token and write
        the scratch slot (CudaGraphRunner.plan). Each fill writes the next of the host mirrors
        (HOST_MIRRORS, made while the next one's copy has not run), waiting only until that
        one's last copy has run."""
        self.host_copied, self.host = self.mirrors.take()
        v, q, bs = self.host, self.q, batch.num_seqs
        t, t_pad = bs * q, bucket * q
        cu = batch.cu_seqlens_q.numpy()
        q_lens = np.diff(cu)
        ragged = bool((q_lens != q).any())
        dst: Any = slice(0, t)  # where each token's row goes: in order, or at b * q + i
        if ragged:
            seq = np.repeat(np.arange(bs), q_lens)  # [T] the sequence of each token
            dst = seq * q + np.arange(cu[-1]) - cu[:-1][seq]
            v["input_ids"][:t] = 0
            v["positions"][:t] = 0
            v["slot_mapping"][:t] = scratch_slot
        v["input_ids"][dst] = batch.input_ids.numpy()
        v["positions"][dst] = batch.positions.numpy()
        v["slot_mapping"][dst] = batch.slot_mapping.numpy()
        rows = batch.logit_indices.numpy()
        v["rows"][: rows.shape[0]] = dst[rows] if ragged else rows
        if batch.hidden_indices is not None:
            rows = batch.hidden_indices.numpy()
            v["hidden_rows"][: rows.shape[0]] = dst[rows] if ragged else rows
        v["kv_lens"][:bs] = batch.kv_lens.numpy()
        v["prefix_lens"][:bs] = batch.prefix_lens.numpy()
        width = batch.block_table.shape[1]
        v["block_table"][:bs, :width] = batch.block_table.numpy()
        if v["tree_mask"] is not None:
            self._fill_mask(batch, q_lens, ragged)
        # padding sequences: q causal tokens on the scratch page
        v["input_ids"][t:t_pad] = 0
        v["positions"][t:t_pad] = 0
        v["slot_mapping"][t:t_pad] = scratch_slot
        v["kv_lens"][bs:bucket] = q
        v["prefix_lens"][bs:bucket] = 0
        v["block_table"][bs:bucket] = scratch_page
        if v["tree_mask"] is not None:
            v["tree_mask"][bs:bucket] = self.causal
        self.dev_copied.copy_(self.host_copied, non_blocking=True)
        if features is not None:
            assert self.features is not None, "this graph takes no features"
            self.features[:t].copy_(features)
        if tokens is not None:  # over the host's input ids, in stream order
            self.dev["input_ids"][:t].copy_(tokens)
        self.mirrors.copied(self.dev_bytes.device)

    def rows(self, out: torch.Tensor, name: str, num: int, views: bool) -> torch.Tensor:
        """The first `num` rows named `name` ("rows", "hidden_rows": filled by the last `fill`)
        of the step's outputs `out` ([t, width]): `out` itself where `views` allows it and they
        are its rows 0..t-1 in order (`in_order`), else gathered."""
        if views and self.in_order(name, num, out.shape[0]):
            return out
        return self.gather(out, name, num)

    def in_order(self, name: str, num: int, t: int) -> bool:
        """Whether the first `num` rows named `name` are the step's rows 0..t-1 in order."""
        return num == t and np.array_equal(self.host[name][:num], self.host["all_rows"][:num])

    def gather(self, out: torch.Tensor, name: str, num: int) -> torch.Tensor:
        """The first `num` rows named `name` of `out`, gathered on the device."""
        return out.index_select(0, self.dev[name][:num])

    def _fill_mask(self, batch: ForwardBatch, q_lens: np.ndarray, ragged: bool) -> None:
        """Each sequence's [q, q] mask among its new tokens: the batch's tree mask or causal
        (query i sees the new tokens up to its own), padding rows see the first new token."""
        mask, bs = self.host["tree_mask"], batch.num_seqs
        num_new = batch.kv_lens.numpy() - batch.prefix_lens.numpy()  # (numpy: ~10 us less)
        tree = None if batch.tree_mask is None else batch.tree_mask.numpy()
        if not ragged and (num_new == self.q).all():
            mask[:bs] = self.causal if tree is None else tree
            return
        mask[:bs] = False
        for b in range(bs):
            q_len, new = int(q_lens[b]), int(num_new[b])
            if tree is None:
                mask[b, :q_len, :new] = np.tri(q_len, new, new - q_len, dtype=bool)
            else:
                mask[b, :q_len, :new] = tree[b, :q_len, :new]
            mask[b, q_len:, 0] = True
