"""Host <-> device transfers for the engines' per-round inputs: small host tensors to a GPU
without waiting for it (`to_device`, through reused pinned staging buffers), host rows gathered
into one pinned buffer and copied in one go (`HostRows`, `take_rows`, `copy_rows`,
`join_rows`), page-locked buffers (`pinned_bytes`), and the current device for a block
(`on_device`)."""

from __future__ import annotations

import contextlib
import threading

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory and asynchronously on a GPU (a copy from
    pageable memory waits for the GPU to finish everything queued before it); a small one
    through the device's staging buffers (`_Staging`), a larger one through `pin_memory`."""
    if device.type != "cuda":
        return host.to(device)
    if host.numel() * host.element_size() <= STAGE_BYTES:
        stage = _STAGES.get(device)
        if stage is None:
            stage = _STAGES.setdefault(device, _Staging())
        moved = stage.copy(host, device)
        if moved is not None:
            return moved
    return host.pin_memory().to(device, non_blocking=True)


# `to_device`'s staging: STAGE_SLOTS pinned buffers of STAGE_BYTES per device (8 MiB; a chained
# round's placement tables at batch 32 are ~20 KiB, a round's logit rules at batch 32 with
# 512-token prompts ~320 KiB: verifier/round_rules.py)
STAGE_SLOTS, STAGE_BYTES = 16, 1 << 19


class _Staging:
    """Pinned host buffers reused for small copies to one GPU, each free again once the copy
    queued from it has run (its CUDA event). `pin_memory` takes a new pinned block whenever
    the ones it gave out earlier are still queued behind the device's work, and checking and
    pinning a pageable tensor while the GPU runs cost ~0.5 ms each on an H100 host (the chained
    round's placement: bench/hinted_launch.py, bench/RESULTS.md); a staged copy is a memcpy.
    Thread-safe (the engines' calls may run on the loop or a thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        whole = torch.empty(STAGE_SLOTS * STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
        self.buffers = list(whole.split(STAGE_BYTES))
        self.events: list[torch.cuda.Event | None] = [None] * STAGE_SLOTS
        self.next = 0
        self.num_staged = 0  # copies staged (tests)

    def copy(self, host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """`host` (at most STAGE_BYTES) on `device` from a free buffer, queued on the device's
        current stream; None when every buffer's copy is still queued."""
        with self.lock:
            for k in range(STAGE_SLOTS):
                slot = (self.next + k) % STAGE_SLOTS
                event = self.events[slot]
                if event is None or event.query():
                    break
            else:
                return None
            self.next = slot + 1
            flat = host.reshape(-1)
            staged = self.buffers[slot][: flat.numel() * flat.element_size()]
            staged.numpy()[:] = flat.view(torch.uint8).numpy()
            moved = staged.view(host.dtype).view(host.shape).to(device, non_blocking=True)
            if event is None:
                event = self.events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.num_staged += 1
            return moved


_STAGES: dict[torch.device, _Staging] = {}


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def take_rows(host: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """host[rows] for a CPU tensor, by numpy on the bytes: torch's CPU index_select opens an
    OpenMP region, which waits for every worker thread; with the cores busy (the services and
    their engine threads share them) a descheduled worker costs a time slice. 32 rows of
    [64, 1728] on the 2-core VM with both cores busy: 8.4 ms, numpy 0.04 ms (idle: 0.03 and
    0.02 ms)."""
    raw = host.view(_SAME_SIZE_INTS[host.element_size()]).numpy()
    return torch.from_numpy(raw[rows]).view(host.dtype)


def copy_rows(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """dst (a [sum of n_i, width] CPU tensor) = the [n_i, width] CPU parts one after another, by
    numpy on the bytes (numpy has no bfloat16; torch.cat's OpenMP region waits for every worker
    thread, see take_rows)."""
    out = dst.view(torch.uint8).numpy()
    row = 0
    for part in parts:
        out[row : row + part.shape[0]] = part.contiguous().view(torch.uint8).numpy()
        row += part.shape[0]


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, width] CPU tensors of one dtype and width as one [sum of n_i, width]: a view when they
    lie back to back in one storage (one answer's rows split per sequence and sent on in the
    same order), else a copy. ValueError when their widths or dtypes differ."""
    first = parts[0]
    width, dtype = first.shape[1], first.dtype
    for part in parts:
        if part.dim() != 2 or part.shape[1] != width or part.dtype != dtype:
            raise ValueError(
                f"rows to join: {tuple(part.shape)} {part.dtype} after {tuple(first.shape)} "
                f"{dtype} (one width and dtype)"
            )
    if len(parts) == 1:
        return first
    view = _joined_view(parts)
    if view is not None:
        return view
    joined = torch.empty(sum(part.shape[0] for part in parts), width, dtype=dtype)
    copy_rows(joined, parts)
    return joined


def _joined_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """[n_i, width] parts of one width and dtype as one [sum of n_i, width] view of their
    storage when they lie back to back in it (empty parts aside), else None."""
    nonempty = [part for part in parts if part.numel()]
    if not nonempty or not _back_to_back(nonempty):
        return None
    first = nonempty[0]
    width = first.shape[1]
    joined = torch.empty(0, dtype=first.dtype)
    size = (sum(part.shape[0] for part in parts), width)
    return joined.set_(first.untyped_storage(), first.storage_offset(), size, (width, 1))


def _back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the contiguous parts follow each other in the first one's storage: each starts
    where the last ended, and the last ends within that storage (its memory, then, whichever
    tensors they are views of)."""
    storage = parts[0].untyped_storage()
    end = parts[0].data_ptr()
    for part in parts:
        if not part.is_contiguous() or part.data_ptr() != end:
            return False
        end += part.numel() * part.element_size()
    return end <= storage.data_ptr() + storage.nbytes()


def pinned_bytes(num_bytes: int, device: torch.device) -> memoryview:
    """`num_bytes` of page-locked host memory (torch's caching host allocator) as a writable
    buffer that keeps it alive: a tensor made on it (torch.frombuffer) crosses to a GPU
    asynchronously. Its holder must keep it until such a copy has finished (HostRows does).
    Allocated with `device` current (the thread's default, cuda:0, would get a CUDA context
    of its own in a process whose engine is on another GPU)."""
    with on_device(device):
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return memoryview(pinned.numpy().data)


class HostRows:
    """Host tensors' rows joined on a device in one asynchronous copy: rows back to back in one
    pinned buffer straight from it, others gathered by numpy into a reused pinned buffer, not by
    torch.cat, whose OpenMP region waits for every worker thread (4.6 ms for 32 bf16 tensors of
    [2, 12288] on an H100 host, cProfiled; numpy copies are single-threaded). The buffer is
    written again only after its last copy has finished. Rows already page-locked and back to
    back (a verify round's in process; a Draft's read from the round lane into page-locked
    memory, `pinned_bytes`) cross from where they are, and their memory is held until that
    copy has finished (page-locked memory not torch's own tensor's is not tracked by torch's
    host allocator: freed earlier, it could be handed out and written mid-copy)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None
        self.sources: list[torch.Tensor] = []  # page-locked rows the last copy read

    def join(self, parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """[n_i, width] CPU tensors of one dtype -> [sum of n_i, width] on `device`."""
        if device.type != "cuda":
            return torch.cat(parts).to(device)
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.synchronize()  # the last copy is done (at once after a record-less start)
        self.sources = []
        view = _joined_view(parts)
        if view is not None and view.is_pinned():
            out = view.to(device, non_blocking=True)  # no host copy
            self.copied.record(torch.cuda.current_stream(device))
            self.sources = parts
            return out
        total, width, dtype = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0].dtype
        held = self.buffer
        if held is None or held.shape[0] < total or held.shape[1] != width or held.dtype != dtype:
            rows = max(total, 64, 0 if held is None else 2 * held.shape[0])
            self.buffer = held = torch.empty(rows, width, dtype=dtype).pin_memory()
        host = held[:total]
        copy_rows(host, parts)
        out = host.to(device, non_blocking=True)
        self.copied.record(torch.cuda.current_stream(device))
        return out


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The calling thread's current CUDA device set to `device` for the block (Triton launches on
    the current device, and an engine's calls run on worker threads that start on cuda:0: an
    engine on cuda:1 runs its steps inside this); nothing on other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
