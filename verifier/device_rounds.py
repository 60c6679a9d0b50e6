"""A round's work on the verifier's device (`DeviceRounds`, a mixin of VerifierEngine under
`RunAhead`, declaring what it uses of the engine): its sequences as one step, or in parts where
long runs of new tokens would take the whole round off the CUDA graphs (`_graph_groups`);
its forward batch built (decode steps, and
rounds of one tree shape, as arrays; any other round sequence by sequence), the target's forward
(a CUDA graph's replay where one fits) and the acceptance queued on the device with one copy of
the results to the host (`_launch`, `_accept`); then those results read and each sequence's
accepted path committed (`_finish`, `_commit`)."""

from __future__ import annotations

import functools
import random

import torch

from specsplit import metrics
from specsplit.kv_cache import KVCache
from specsplit.messages import NO_LOGPROBS, VerifyInput, VerifyOutput
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.cuda_graphs import CudaGraphRunner, graph_parts, smallest_q, why_eager
from specsplit.model.llama import LlamaModel
from specsplit.step import (
    build_forward_batch,
    causal_step,
    decode_batch,
    same_tree_batch,
    verify_step,
)
from verifier.accept_graphs import AcceptGraphs
from verifier.ahead_depth import AheadDepth
from verifier.chain import Chain, place_accept, place_forward
from verifier.device_waits import DeviceWaits
from verifier.kept_rules import keep_rules
from verifier.lead_in import MIN_LEAD_Q, lead_len, lead_waves, round_news
from verifier.round_accept import (
    accepted_hidden,
    bend_logits,
    hidden_states_out,
    queue_accept,
    to_host,
)
from verifier.round_logprobs import queue_logprobs, queue_prompt, read_logprobs, read_prompt
from verifier.round_rules import bend_by_rules
from verifier.rounds import Launched, PromptRows, VerifierSeq, one_tree_shape
from verifier.rule_rows import RuleRows
from verifier.rules_graphs import RulesGraphs


class DeviceRounds(DeviceWaits):
    # the engine's, which these rounds use
    model: LlamaModel
    kv: KVCache
    device: torch.device
    vocab_size: int
    graphs: CudaGraphRunner | None
    accept_graphs: AcceptGraphs | None
    synthetic_acceptance: tuple[float, ...] | None
    _synthetic_rng: random.Random
    ahead_depth: AheadDepth
    rule_rows: RuleRows
    rules_graphs: RulesGraphs | None
    _held: dict[str, int]
    _last_end: tuple[torch.cuda.Event, set[str]] | None
    # a lead-in's chunk of pending tokens (verifier/lead_in.py); None: on a GPU the largest
    # captured q, none without graphs (tests set it to lead in on the CPU)
    lead_q: int | None = None

    def _device_mark(self) -> torch.cuda.Event | None:
        """On a GPU an event recorded now on the device's stream (timing on), else None."""
        if self.device.type != "cuda":
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def _count_forward(self, eager: bool, batch: ForwardBatch, device_rows: bool) -> None:
        """A forward counted by path, an eager one by why no graph ran it (`why_eager`)."""
        metrics.count_verifier_forward(
            why_eager(self.graphs, batch, device_rows) if eager else None
        )

    def _graph_groups(
        self, inputs: list[VerifyInput], others: list[int], leads: dict[int, int]
    ) -> list[list[int]]:
        """`others` (positions in `inputs`) as one launch, or in parts where long runs of new
        tokens would take the whole round off the CUDA graphs (`graph_parts`), each run counted
        past its lead-in (`leads` by position: `_lead_lens`)."""
        if self.graphs is None or len(others) < 2:
            return [others]
        news = round_news([inputs[i] for i in others], [leads[i] for i in others])
        parts = graph_parts(news, self.graphs.q_sizes, pays=self.graphs.parts_pay)
        return [[others[j] for j in part] for part in parts]

    def _lead_chunk(self) -> int | None:
        """A lead-in's chunk: `lead_q` where set, else on a GPU the largest captured q (a
        prefill graph's); None: no lead-ins."""
        if self.lead_q is not None:
            return self.lead_q
        if self.graphs is None or not self.graphs.q_sizes:
            return None
        q = max(self.graphs.q_sizes)
        return q if q >= MIN_LEAD_Q else None

    def _lead_lens(self, items: list[VerifyInput]) -> list[int]:
        """Per item, how many of its pending tokens lead in ahead of its round
        (verifier/lead_in.py): 0 where its run fits a chunk, and all 0 where the lead-in and the
        round's graph parts would cost more than one eager launch (`parts_pay`: a large model's
        long prompt is the device's work, which every chunk's weight read adds to)."""
        q = self._lead_chunk()
        leads = [0 if q is None else lead_len(item, q) for item in items]
        if q is None or not any(leads) or self.graphs is None:
            return leads
        sizes = self.graphs.q_sizes
        rest = round_news(items, leads)
        waves = [[q] * len(wave) for wave in lead_waves(leads, q, sizes[q][-1])]
        parts = [[rest[i] for i in part] for part in graph_parts(rest, sizes)]
        if any(smallest_q(sizes, len(part), max(part)) is None for part in parts):
            return [0] * len(items)  # the round would run eagerly all the same
        return leads if self.graphs.parts_pay(waves + parts) else [0] * len(items)

    def _lead_in(
        self, items: list[VerifyInput], seqs: list[VerifierSeq], leads: list[int]
    ) -> list[torch.Tensor | None]:
        """Each item's first `leads[i]` pending tokens forwarded and committed ahead of its
        round, a chunk of a few sequences a forward (`lead_waves`): the hidden-state rows of
        those that ask for them (on the host in bfloat16, valid once the round's results are),
        else None."""
        q = self._lead_chunk()
        assert q is not None, leads
        most = len(items) if self.graphs is None else self.graphs.q_sizes[q][-1]
        rows: list[list[torch.Tensor]] = [[] for _ in items]
        for wave in lead_waves(leads, q, most):
            aux = next(
                (items[i].hidden_state_layers for i in wave if items[i].hidden_state_layers), ()
            )
            steps = []
            for i in wave:
                done = seqs[i].kv.kv_committed_len - items[i].kv_committed_len
                chunk = items[i].pending_tokens[done : min(done + q, leads[i])]
                step = causal_step(seqs[i].kv, chunk, [len(chunk) - 1])
                step.hidden_rows = list(range(len(chunk))) if aux else []
                steps.append(step)
            batch, _ = build_forward_batch(steps, self.kv.page_size)
            out = None if self.graphs is None else self.graphs.forward(batch, aux)
            self._count_forward(out is None, batch, device_rows=False)
            if out is None:
                out = self.model(batch.to(self.device), self.kv, aux_layers=aux)
            row = 0  # each step's hidden rows, back to back
            for i, step in zip(wave, steps, strict=True):
                q_len = len(step.input_ids)
                seqs[i].history.put(seqs[i].kv.kv_committed_len, step.input_ids)
                seqs[i].kv.kv_committed_len += q_len
                if items[i].hidden_state_layers:
                    assert out.hidden_states is not None
                    rows[i].append(out.hidden_states[row : row + q_len])
                row += q_len
        return [to_host(torch.cat(r), torch.bfloat16) if r else None for r in rows]

    def _launch(
        self,
        inputs: list[VerifyInput],
        seqs: list[VerifierSeq],
        tokens: torch.Tensor | None = None,
        chain: Chain | None = None,
    ) -> Launched:
        """The round's forward and acceptance queued on the device (their room reserved).
        tokens: the input ids on the device (a decode step run ahead: its inputs' are not known
        yet). chain: `inputs` are a chained round's reference, placed on the device on the
        outcomes that came (verifier/chain.py)."""
        # the layers the sequences that ask for hidden states name (one set: _validate)
        aux = next((item.hidden_state_layers for item in inputs if item.hidden_state_layers), ())
        if not aux and all(len(item.pending_tokens) == 1 and not item.tree for item in inputs):
            tokens_in = [item.pending_tokens[0] for item in inputs]  # decode steps, as arrays
            batch, row_slices = decode_batch([seq.kv for seq in seqs], tokens_in, self.kv.page_size)
        elif one_tree_shape(inputs):  # a round of chains, most often: as arrays too
            roots = [item.pending_tokens[0] for item in inputs]
            trees = [item.tree for item in inputs]
            kvs, page_size = [seq.kv for seq in seqs], self.kv.page_size
            batch, row_slices = same_tree_batch(kvs, roots, trees, page_size, bool(aux))
        else:
            steps = []
            for item, seq in zip(inputs, seqs, strict=True):
                p, n = len(item.pending_tokens), len(item.tree)
                # logits of the root (last pending token) and every tree node (and of every
                # pending token before it where the prompt's log-probabilities are asked for);
                # hidden states of every pending token and node when they are wanted
                first = 0 if item.prompt_logprobs != NO_LOGPROBS else p - 1
                wanted = list(range(first, p + n))
                step = verify_step(seq.kv, item.pending_tokens, item.tree, wanted)
                step.hidden_rows = list(range(p + n)) if aux else []
                steps.append(step)
            batch, row_slices = build_forward_batch(steps, self.kv.page_size)
        place = None if chain is None else functools.partial(place_forward, chain=chain)
        # before the round's first device work, after its host building: the device idles there
        started = self._device_mark()
        out = None
        if self.graphs is not None:
            # (views of the graph's outputs: the acceptance and rows below are queued at once)
            out = self.graphs.forward(batch, aux, tokens=tokens, place=place, views=True)
        self._count_forward(out is None, batch, tokens is not None or place is not None)
        if out is None:
            on_device = batch.to(self.device)
            if tokens is not None:
                on_device.input_ids = tokens.to(torch.int64)
            if place is not None:
                place(on_device)
            out = self.model(on_device, self.kv, aux_layers=aux)
        # per sequence the target's rows [n + 1, vocab]: the root, then each tree node (after
        # a first round's prompt rows where it asks for their log-probabilities)
        rows = [range(r.start, r.stop) for r in row_slices]
        prompt = None
        if any(item.prompt_logprobs != NO_LOGPROBS for item in inputs):
            prompt, rows = self._prompt_rows(inputs, out.logits, rows)
        raw = out.logits  # log-probabilities read the rows as the target gives them
        asks = any(i.logprobs != NO_LOGPROBS for i in inputs)
        if asks and any(i.rules is not None for i in inputs):
            raw = raw.clone()  # (the acceptance's are bent by the rules)
        packed = self._accept(inputs, seqs, out, rows, batch.block_table, chain, tokens)
        hidden = None
        if out.hidden_states is not None:  # queued before the results' copy, whose wait covers it
            hidden = accepted_hidden(inputs, out.hidden_states, packed, self.device)
        logprobs = queue_logprobs(inputs, raw, rows, packed)  # (the same: none if unasked)
        if packed.device.type != "cuda":
            return Launched(inputs, seqs, packed, hidden, logprobs=logprobs, prompt_logprobs=prompt)
        host = to_host(packed)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(torch.cuda.current_stream(self.device))
        ids = {item.seq_id for item in inputs}
        last, self._last_end = self._last_end, (copied, ids)
        idle_from = None if last is None or last[1].isdisjoint(ids) else last[0]
        return Launched(
            inputs, seqs, packed, hidden, host=host, copied=copied, started=started,
            idle_from=idle_from, logprobs=logprobs, prompt_logprobs=prompt,
        )  # fmt: skip

    def _finish(self, launched: Launched, further: bool = False) -> list[VerifyOutput]:
        """Wait for a launched round's results (its one device-to-host copy) and commit them.
        further: a round's further decode step (its idle time reported as such too, unless it
        was launched when the round's request came: `Launched.on_request`)."""
        whole = launched.result_rows()
        if self.ahead_depth.auto and launched.generator_states is not None and not launched.hinted:
            batch_size = len(launched.whole_inputs or launched.inputs)  # a decode step's time
            self.ahead_depth.observe_step(batch_size, launched.device_ns())
        if launched.idle_from is not None and launched.started is not None:
            within = further and not launched.on_request  # (not the trip between rounds)
            self._report_idle(launched.idle_from, launched.started, within)
        rows = whole if launched.rows is None else [whole[i] for i in launched.rows]
        chained = launched.chain_hints is not None  # (room reserved for a tree, placed or not)
        # each row: the number of accepted nodes a, the bonus token, then the a nodes
        results = [
            self._commit(item, seq, row[2 : 2 + row[0]], row[1], trim=chained)
            for item, seq, row in zip(launched.inputs, launched.seqs, rows, strict=True)
        ]
        if launched.hidden is not None:
            starts = launched.hidden_starts(whole)
            hidden_states_out(launched.inputs, launched.hidden, results, starts)
        if launched.logprobs is not None:
            logprobs = read_logprobs(launched.logprobs, len(launched.inputs), rows)
            for out, asked in zip(results, logprobs, strict=True):
                out.logprobs = asked
        for out, queued in zip(results, launched.prompt_logprobs or (), strict=False):
            if queued is not None:
                out.prompt_logprobs = read_prompt(queued)
        if launched.lead_rows is not None:  # the rows of pending tokens that led in come first
            for out, led in zip(results, launched.lead_rows, strict=True):
                if led is not None:
                    assert out.hidden_states is not None
                    out.hidden_states = torch.cat([led, out.hidden_states])
        return results

    def _prompt_rows(
        self, inputs: list[VerifyInput], logits: torch.Tensor, rows: list[range]
    ) -> tuple[list[PromptRows | None], list[range]]:
        """Each asking first round's prompt log-probabilities queued (its rows before the root's:
        `_launch` asked for every pending token's logits), and every input's rows from its root
        on (the acceptance's)."""
        prompt: list[PromptRows | None] = []
        for b, item in enumerate(inputs):
            if item.prompt_logprobs == NO_LOGPROBS:
                prompt.append(None)
                continue
            root = rows[b].start + len(item.pending_tokens) - 1
            before = range(rows[b].start, root)
            prompt.append(queue_prompt(logits, before, item.pending_tokens, item.prompt_logprobs))
            rows[b] = range(root, rows[b].stop)
        return prompt, rows

    def _accept(
        self,
        inputs: list[VerifyInput],
        seqs: list[VerifierSeq],
        out: ForwardOutput,  # the step's: logits [L, vocab] on the device (and their argmax)
        rows: list[range],  # per sequence its n + 1 rows of the logits
        block_table: torch.Tensor,  # [B, max_pages] the step's pages (host)
        chain: Chain | None = None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The round's acceptance queued on the device (`queue_accept`), on logits bent by the
        sequences' rules (verifier/round_rules.py; a decode step run ahead's read its `pending`
        tokens on the device), then to the synthetic acceptance's outcome where that is on
        (benchmarks only); the forward's argmax is then taken again. A chained round's placed
        on the outcomes that came."""
        tokens = None if chain is None else chain.tokens
        logits, argmax = out.logits, out.greedy
        kept = (self.rule_rows, seqs)
        rules_graphs = self.rules_graphs if out.static else None
        no_graphs = "no graphs" if self.rules_graphs is None else "logits"  # (gathered rows)
        bent = bend_by_rules(
            inputs, logits, rows, pending, kept, graphs=rules_graphs, no_graphs=no_graphs
        )
        if bent is not None:
            argmax = bent.argmax
            metrics.count_rules_round(bent.eager)
        if self.synthetic_acceptance is not None and any(item.tree for item in inputs):
            rng, rates = self._synthetic_rng, self.synthetic_acceptance
            bend_logits(inputs, logits, rows, rates, rng, self.device, tokens)
            argmax = None
        graphs, kv = self.accept_graphs, self.kv
        place = None if chain is None else functools.partial(place_accept, chain=chain)
        return queue_accept(
            inputs, seqs, logits, rows, block_table, kv, self.vocab_size, graphs, place, argmax
        )

    def _commit(
        self, item: VerifyInput, seq: VerifierSeq, nodes: list[int], bonus: int, trim: bool
    ) -> VerifyOutput:
        """The accepted path (tree `nodes`, then `bonus`)'s K/V sits right after the pending
        tokens: commit it, free the rest. trim: free it for a round without a tree too (a
        chained round placed plain holds its reference tree's room)."""
        kv = seq.kv
        tokens = item.tree.tokens
        accepted = [tokens[i] for i in nodes]
        seq.history.put(kv.kv_committed_len, [*item.pending_tokens, *accepted])
        kv.kv_committed_len += len(item.pending_tokens) + len(nodes)
        # a round without a tree reserved its pending tokens' room only (and the decode step
        # run ahead may hold the next token's already): nothing to free
        if trim or item.tree:  # (not the room of a round chained behind this one)
            self.kv.trim(kv, max(kv.kv_committed_len, self._held.get(item.seq_id, 0)))
        keep_rules(item, seq, [*accepted, bonus])
        return VerifyOutput(item.seq_id, accepted, bonus, kv.kv_committed_len)
