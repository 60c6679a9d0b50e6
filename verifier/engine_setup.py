"""The verifier engine's making (`EngineSetup`, a mixin of VerifierEngine over `SeqMemory`): its
state and callbacks (`__init__`), an engine over a checkpoint or a loaded model with its KV pool
sized (`load`, `for_model`), and its warm-up (`warmup`: rounds that are not traffic, the CUDA
graphs' captures). The round itself is verifier/engine.py's."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Self, TypedDict, Unpack

import torch

from specsplit.cli_flags import CHAIN_MAX_BATCH, CHAIN_MIN_GUESS_RATE
from specsplit.kv_cache import KVCache, pool_num_pages
from specsplit.lookup import LOOKUP_MIN_NGRAM
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import LlamaModel, kv_cache_bytes_per_token, make_kv_cache
from specsplit.model.loader import load_model
from specsplit.model.transfer import on_device
from verifier.accept_graphs import AcceptGraphs
from verifier.ahead_depth import AheadDepth
from verifier.chain_gate import ChainGate
from verifier.hints import HintBook
from verifier.rounds import Launched, VerifierSeq, VerifyRound
from verifier.rule_rows import RuleRows
from verifier.rules_graphs import ENABLED as RULES_GRAPHS
from verifier.rules_graphs import RulesGraphs
from verifier.seq_memory import SeqMemory
from verifier.warmup import GRAPH_QUERY_LENS, PREFILL_QUERY_LENS, graphs_reserve_bytes, warm_up

log = logging.getLogger(__name__)


def check_kv_dtype(
    kv_dtype: torch.dtype | None, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV pool's dtype: the model's, or float16 under a float32 model on the CPU (the C
    layer stores K and V rounded to float16 and widens them as it reads them: half the bytes a
    long context's step streams; the target is then that model with a float16 cache, for
    target-only and speculative rounds alike). Anything else is refused: the GPU's kernels read
    the model's dtype."""
    if kv_dtype is None or kv_dtype == model_dtype:
        return model_dtype
    if kv_dtype == torch.float16 and model_dtype == torch.float32 and device.type == "cpu":
        return kv_dtype
    raise ValueError(
        f"a {kv_dtype} KV cache under a {model_dtype} model on {device.type}: only float16 under"
        " float32 on the CPU"
    )


class EngineOptions(TypedDict, total=False):
    """`EngineSetup.for_model`'s keywords, which `load` passes on (its defaults there)."""

    num_pages: int | None
    page_size: int
    kv_memory_fraction: float
    graph_query_lens: tuple[int, ...]
    max_batch_size: int
    decode_ahead: bool
    decode_ahead_max_batch: int
    synthetic_acceptance: tuple[float, ...] | None
    lookup_min_ngram: int
    kv_dtype: torch.dtype | None


class EngineSetup(SeqMemory):
    # the engine's round (verifier/engine.py), which the warm-up runs
    verify: Callable[[list[VerifyInput]], list[VerifyOutput]]

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        max_context: int,
        vocab_size: int,
        *,
        graph_query_lens: tuple[int, ...] = (),
        prefill_query_lens: tuple[int, ...] = PREFILL_QUERY_LENS,
        max_batch_size: int = 64,
        synthetic_acceptance: tuple[float, ...] | None = None,
        decode_ahead: bool = False,
        decode_ahead_max_batch: int = 64,
        lookup_min_ngram: int = LOOKUP_MIN_NGRAM,
    ) -> None:
        """graph_query_lens: on a GPU, capture CUDA graphs at warm-up for steps of these query
        tokens per sequence and batches up to max_batch_size; () = always eager. With them,
        prefill_query_lens: graphs of these query tokens for batches up to PREFILL_MAX_BATCH.
        synthetic_acceptance: BENCHMARKS ONLY, NOT LOSSLESS: the first child at depth d is
        accepted with probability synthetic_acceptance[d] (the last rate for deeper levels), so
        random-weight models run the whole system at a chosen accepted length; the target's
        logits are bent to that outcome (`round_accept.bend_logits`) and the round's own
        acceptance runs on them (the greedy acceptance graphs where a real greedy round would
        use them), so the bonus token is the target's argmax among the tokens not drafted
        there.
        decode_ahead: after a round of decode steps (no trees, no hidden states), launch
        the same sequences' next decode step before it is asked for (`_launch_ahead`); the next
        round takes it when it is that step, else it is dropped; rounds of more than
        decode_ahead_max_batch sequences run nothing ahead, but for a round's own further
        decode steps (VerifyInput.decode_steps), which always take it.
        lookup_min_ngram: prompt lookup's chains (VerifyInput.lookup) follow suffixes of at
        least this many tokens (specsplit/lookup.py)."""
        self.model = model
        self.kv = kv
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.num_layers = model.config.num_layers  # hidden_state_layers go up to this
        self.device = kv.device
        self.seqs: dict[str, VerifierSeq] = {}
        # each sequence's logit rules' rows kept on the device (verifier/rule_rows.py)
        self.rule_rows = RuleRows(vocab_size, kv.device)
        self.synthetic_acceptance = synthetic_acceptance
        self._synthetic_rng = random.Random(0)
        if synthetic_acceptance is not None:
            log.warning("SYNTHETIC ACCEPTANCE %s: output is not the target's", synthetic_acceptance)
        self.decode_ahead = decode_ahead
        self.decode_ahead_max_batch = decode_ahead_max_batch
        # decode steps run ahead after a round's last step (`--decode-ahead-depth`; 0, auto: as
        # many as cover the trip between rounds, measured)
        self.ahead_depth = AheadDepth(1)
        self._ahead: Launched | None = None  # the decode step launched before it was asked for
        self._in_flight: list[VerifyRound] = []  # launched, not finished (`launch`)
        self.num_ahead_used = 0  # decode steps run ahead that the next round was
        # prompt lookup's drafts in further decode steps (VerifyInput.lookup), and the accepted
        self.num_lookup_drafted = self.num_lookup_accepted = 0
        self.lookup_min_ngram = lookup_min_ngram  # (a sequence's history takes it when created)
        self.num_ahead_dropped_by: Counter[str] = Counter()  # ... and that it was not, by why
        self.on_decode_ahead: Callable[[str], None] | None = None  # "used" / "dropped" each
        self.on_decode_ahead_dropped: Callable[[str], None] | None = None  # and its reason
        # the gateway's hints for rounds in flight (`hint_next`); the rounds run ahead on them
        # that the next round was / was not, and a callback for each
        self.hints = HintBook()
        # launch_on_hint (the service sets it where its calls run on the event loop, as the
        # hints do): `finish` keeps each sequence of its round in `hints.finished`, and their
        # hinted next rounds launch once the answer went out (the caller's `launch_parked`: the
        # answer does not wait for that launch's host work; on two H100s 1.02x / 1.04x the
        # launch inside `finish` at batch 1 / 8, bench/RESULTS.md), or when a late hint comes
        # (`hint_next`), if no round has started since
        self.launch_on_hint = False
        # with launch_on_hint, chain a hinted round on the device behind the round in flight
        # (`_chain`, verifier/chain.py) instead of launching it after that round's answer
        # (`--chain-rounds`), for rounds of at most chain_max_batch sequences. Its host work
        # comes after the hint: where it ends after the round, it holds the round's answer back
        # (on two H100s, 8B target: 1.07x / 1.08x at batch 1, 0.93x at 8, 0.91x at 32)
        self.chain_rounds = False
        # `--chain-rounds auto`: only while a round's device time well exceeds a chain's host
        # work (ChainGate.auto; off: every chain the rest allows)
        self.chain_gate = ChainGate()
        self.chain_max_batch = CHAIN_MAX_BATCH
        # ... and only while the hints' guess rate (`HintBook.guess_rate`) is at least this (a
        # chained round whose outcome was not guessed is dropped after the device ran it)
        self.chain_min_guess_rate = CHAIN_MIN_GUESS_RATE
        self.num_next_used = 0
        self.num_next_dropped = 0
        self.on_round_ahead: Callable[[str], None] | None = None
        # how long the device waits between rounds of the same sequences (`on_wait`, seconds):
        # from a finish with nothing queued behind it (its start, and its sequences) to the next
        # round queued; 0 where a round or decode step run ahead followed
        self.on_wait: Callable[[float], None] | None = None
        self._waiting: tuple[int, set[str]] | None = None
        # that wait's host parts (`on_gap(phase, seconds)`, GAP_PHASES): every finish, and
        # where a hinted round followed, the time until its launch began and the launch
        self.on_gap: Callable[[str, float], None] | None = None
        # on a GPU, the device's idle time before each round's first work where the round
        # launched before it shared a sequence with it (`on_idle(seconds)`), from the two
        # rounds' CUDA event timestamps: what the device saw, whichever way the round launched
        # (after the request, on a hint, chained), where `on_wait` measures from the host
        self.on_idle: Callable[[float], None] | None = None
        # the same for a round's further decode steps alone (`on_step_idle(seconds)`): the
        # device's idle time inside a round of several steps, where the host prepares each step
        self.on_step_idle: Callable[[float], None] | None = None
        self._last_end: tuple[torch.cuda.Event, set[str]] | None = None  # (its end, its ids)
        self._finished_ns = 0  # when the last finish returned
        self._results_ns = 0  # when it read its results (its last step's): the device was done
        # storage each sequence of a round in flight keeps past its commit: the room of the
        # hinted round chained behind it (`_chain`), until that round is taken or dropped
        self._held: dict[str, int] = {}
        self.graph_query_lens = graph_query_lens
        self.prefill_query_lens = prefill_query_lens if graph_query_lens else ()
        self.graphs: CudaGraphRunner | None = None
        self.accept_graphs: AcceptGraphs | None = None  # greedy acceptance's CUDA graphs
        self.rules_graphs: RulesGraphs | None = None  # steady rounds' logit rules' graphs
        if graph_query_lens and self.device.type == "cuda":
            self.graphs = CudaGraphRunner.for_model(
                model,
                kv,
                max_batch_size=max_batch_size,
                max_context=max_context,
                max_query_len=max(graph_query_lens + self.prefill_query_lens),
                greedy=True,
            )
            self.accept_graphs = AcceptGraphs(
                kv,
                self.graphs.batch_sizes,
                self.graphs.batch_sizes[-1] * max(graph_query_lens),
                vocab_size,
            )
            self.rules_graphs = RulesGraphs(self.device) if RULES_GRAPHS else None

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        **options: Unpack[EngineOptions],
    ) -> Self:
        """The model at `model_path` loaded on `device` in `dtype`, then `for_model`'s engine
        over it (`options`: its keywords, with its defaults)."""
        model, _ = load_model(model_path, dtype=dtype, device=device)
        return cls.for_model(model, **options)

    @classmethod
    def for_model(
        cls,
        model: LlamaModel,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        kv_memory_fraction: float = 0.8,
        graph_query_lens: tuple[int, ...] = GRAPH_QUERY_LENS,
        max_batch_size: int = 64,
        decode_ahead: bool = False,
        decode_ahead_max_batch: int = 64,
        synthetic_acceptance: tuple[float, ...] | None = None,
        lookup_min_ngram: int = LOOKUP_MIN_NGRAM,
        kv_dtype: torch.dtype | None = None,
    ) -> Self:
        """An engine over a loaded model, on the model's device and in its dtype. num_pages
        None: 2048 on the CPU; on a GPU, `kv_memory_fraction` of the memory free after loading
        the weights (less room kept for the CUDA graphs' logits). synthetic_acceptance:
        benchmarks only, not lossless (see __init__). kv_dtype: the KV pool's (None: the
        model's); float16 under a float32 model on the CPU only (`check_kv_dtype`)."""
        config, device = model.config, model.device
        dtype = check_kv_dtype(kv_dtype, model.dtype, device)
        num_pages = pool_num_pages(
            num_pages,
            device,
            kv_cache_bytes_per_token(config, dtype) * page_size,
            kv_memory_fraction,
            reserve_bytes=graphs_reserve_bytes(config.vocab_size, graph_query_lens, max_batch_size),
        )
        kv = make_kv_cache(
            config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        log.info(
            "verifier KV cache: %d pages x %d tokens (%.2f GiB)",
            num_pages,
            page_size,
            kv.data.numel() * kv.data.element_size() / 2**30,
        )
        return cls(
            model,
            kv,
            config.max_position_embeddings,
            config.vocab_size,
            graph_query_lens=graph_query_lens,
            max_batch_size=max_batch_size,
            decode_ahead=decode_ahead,
            decode_ahead_max_batch=decode_ahead_max_batch,
            synthetic_acceptance=synthetic_acceptance,
            lookup_min_ngram=lookup_min_ngram,
        )

    def warmup(self) -> None:
        """One prefill + one tree round on a throwaway sequence, then release it; then the CUDA
        graphs (on a GPU). Its rounds are not traffic: the decode-ahead counts start after."""
        report, self.on_decode_ahead = self.on_decode_ahead, None
        report_drop, self.on_decode_ahead_dropped = self.on_decode_ahead_dropped, None
        wait, self.on_wait = self.on_wait, None
        try:
            with on_device(self.device):
                warm_up(self)
        finally:
            self.on_decode_ahead, self.on_wait = report, wait
            self.on_decode_ahead_dropped = report_drop
            self.num_ahead_dropped_by.clear()
            self._waiting = None
            self.num_ahead_used = 0
            self.num_lookup_drafted = self.num_lookup_accepted = 0
            self.num_next_used = self.num_next_dropped = 0
