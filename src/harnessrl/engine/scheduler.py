"""Continuous batching: one thread owns the model and the KV cache and runs decode steps.

Between two decode steps the scheduler (1) applies a queued weight load once no sequence is running,
(2) admits waiting sequences (prefill into a free slot, first token sampled), then (3) runs one batched
decode step over every running sequence. Running sequences occupy KV slots 0..B-1 (kept packed, so the
step works on a view); finished sequences leave their KV behind as a prefix cache that a later prompt
starting with the same tokens reuses (multi-turn agent calls extend the previous call's tokens).

Admission also waits while the engine is paused (`paused`, set by the HTTP side) and while its memory
`state` (an `EngineState`: asleep, or awake without weights) does not admit; sleep, wake-up and weight
loads change that state only along `ENGINE_TRANSITIONS`, checked before they touch anything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from harnessrl.engine.detok import TokenText
from harnessrl.engine.model_memory import ModelMemory
from harnessrl.engine.sampling import StepSample, sample_step
from harnessrl.engine.sequence import (
    AdapterLoad,
    EngineSequence,
    GenerationResult,
    Maintenance,
    Stats,
    WeightLoad,
)
from harnessrl.engine.slots import SlotTable
from harnessrl.engine.state import EngineState
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.packed import PackedLinears
from harnessrl.modeling.served_lora import ServedAdapters

log = logging.getLogger(__name__)

# Prompt tokens prefilled between two decode steps while other sequences are decoding: a long prompt is
# prefilled in chunks of this size between decode steps, so it never stalls the running batch for long.
# The one default (EngineConfig.prefill_chunk and the engine's --prefill-chunk use it).
PREFILL_CHUNK = 512
# Prompt tokens packed into one prefill pass when nobody is decoding (bounds a pass's activations).
PREFILL_PASS_TOKENS = 4096


class Scheduler(ModelMemory):
    """Owns the model, the KV cache and the batch; all model calls happen on its thread. Sleep, wake-up
    and weight loads (what the model's memory holds) are `ModelMemory`'s."""

    def __init__(
        self,
        model: CausalLM,
        text: TokenText,
        max_batch: int,
        max_model_len: int,
        eos_ids: set[int],
        prefix_cache: bool = True,
        weight_version: int = 0,
        threads: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        max_cached_tokens: int | None = None,
        packed: PackedLinears | None = None,
        adapters: ServedAdapters | None = None,
    ) -> None:
        self.model, self.text, self.eos_ids = model, text, eos_ids
        self.packed = packed  # oneDNN-packed copies of the linear weights: repacked when weights change
        self.adapters = adapters  # LoRA adapters served per sequence (several policies), or None
        self.prefill_chunk = prefill_chunk
        self.max_cached_tokens = max_cached_tokens or max_batch * max_model_len
        self.max_model_len = max_model_len
        self.threads = threads
        self.device = model.lm_head.weight.device
        self.cache = model.new_cache(max_batch, max_model_len)
        self.slots = SlotTable(self.cache, prefix_cache)
        self.weight_version = weight_version
        self.stats = Stats()
        # admission stopped (running sequences finish); orthogonal to `state` (see harnessrl.engine.state)
        self.paused = False
        self._state = EngineState.AWAKE  # what the memory holds; changed only by `_enter`
        self._waiting: deque[EngineSequence] = deque()
        self._loads: deque[WeightLoad | AdapterLoad | Maintenance] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # --- called from other threads -------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread = threading.Thread(target=self._run, name="harnessrl-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; waiting and running sequences end with finish_reason 'abort'."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, seq: EngineSequence) -> None:
        """Queue a sequence; it joins the batch at the next step boundary."""
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify_all()

    def queue_weight_load(self, load: WeightLoad | AdapterLoad) -> None:
        """Queue a weight swap: admission stops until running sequences finish and the swap is done."""
        with self._cond:
            self._loads.append(load)
            self._cond.notify_all()

    def queue_maintenance(self, op: Maintenance) -> None:
        """Queue `op` to run once running sequences finished (admission waits for it, like a weight load)."""
        with self._cond:
            self._loads.append(op)
            self._cond.notify_all()

    @property
    def state(self) -> EngineState:
        """The memory state (awake, asleep, waiting for weights); see `harnessrl.engine.state`."""
        return self._state

    def _enter(self, target: EngineState) -> None:
        """Move to `target`, which `engine_transition` returned for the current state."""
        with self._cond:
            self._state = target
            self._cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        """Pause (stop admitting; running sequences finish) or resume admission."""
        with self._cond:
            self.paused = paused
            self._cond.notify_all()

    def snapshot(self) -> dict[str, object]:
        """Current counters and queue sizes."""
        with self._cond:
            return {
                **self.stats.__dict__,
                "running": self.slots.n_active,
                "waiting": len(self._waiting),
                "pending_weight_loads": len(self._loads),
                "paused": self.paused,
                "engine_state": str(self._state),
                # the flags clients read, derived from the state
                "sleeping": self._state.sleeping,
                "sleep_level": self._state.sleep_level,
                "needs_weights": self._state.needs_weights,
                "weight_bytes": self.weight_bytes(),
                "kv_cache_bytes": self.cache.nbytes,
                "weight_version": self.weight_version,
            }

    # --- the scheduler thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per calling thread
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stop and not self._has_work():
                        self._cond.wait(0.5)
                    if self._stop:
                        break
                try:
                    self._step()
                except Exception as exc:  # a model failure must not kill the server: fail the batch
                    log.exception("event=step_failed running=%d", self.slots.n_active)
                    self._fail_running(exc)
        self._abort_all()

    def _has_work(self) -> bool:
        return bool(self.slots.n_active or self._loads or (self._waiting and self._may_admit()))

    def _may_admit(self) -> bool:
        return not self.paused and not self._loads and self._state.admits

    def _step(self) -> None:
        self._drop_cancelled()
        if self._loads and self.slots.n_active == 0:
            op = self._loads.popleft()
            if isinstance(op, WeightLoad):
                self._apply_weight_load(op)
            elif isinstance(op, AdapterLoad):
                self._apply_adapter_load(op)
            else:
                self._apply_maintenance(op)
            return
        self._admit()
        if self.slots.n_active:
            self._decode()

    def _admit(self) -> None:
        """One prefill pass: continue chunked prefills, then admit waiting sequences into free slots.

        Many prompts are packed into one pass (one large matrix product per projection). While other
        sequences are decoding, a pass holds at most PREFILL_CHUNK tokens and a longer prompt is split
        into chunks over several steps; otherwise a pass takes up to PREFILL_PASS_TOKENS.
        """
        decoding = any(not s.prefilling for s in self.slots.active())
        budget = self.prefill_chunk if decoding else max(PREFILL_PASS_TOKENS, self.prefill_chunk)
        reserved = sum(self._reservation(s) for s in self.slots.active())
        work: list[tuple[EngineSequence, int, int]] = []  # (sequence, from, to) prompt positions to run
        for seq in self.slots.active():
            if seq.prefilling and budget > 0:
                end = min(len(seq.prompt_ids), seq.kv_len + budget)
                work.append((seq, seq.kv_len, end))
                budget -= end - seq.kv_len
        while budget > 0 and self.slots.n_active < self.cache.max_batch:
            with self._cond:
                if not self._waiting or not self._may_admit():
                    break
                if self._waiting[0].cancelled:
                    seq = self._waiting.popleft()
                    self._finish(seq, "abort", None, leave=False)
                    continue
                if reserved + self._reservation(self._waiting[0]) > self.max_cached_tokens:
                    break  # the KV budget is taken: wait for running sequences to finish
                seq = self._waiting.popleft()
            reserved += self._reservation(seq)
            _, start = self.slots.admit(seq, seq.prompt_ids)
            seq.cached_tokens = seq.kv_len = start
            self.stats.cached_prompt_tokens += start
            end = min(len(seq.prompt_ids), start + budget)
            work.append((seq, start, end))
            budget -= end - start
        if work:
            self.slots.trim_cache(self.max_cached_tokens - reserved)  # the budget bounds the cache too
            self._prefill(work)

    def _reservation(self, seq: EngineSequence) -> int:
        """KV positions a sequence may occupy: its prompt plus everything it may still generate."""
        return min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)

    def _prefill(self, work: list[tuple[EngineSequence, int, int]]) -> None:
        """Run the given prompt spans in one pass; sample the first token of prompts now complete."""
        slot_of = {id(s): i for i, s in enumerate(self.slots.seqs[: self.slots.n_active])}
        items = [
            (torch.tensor(seq.prompt_ids[a:b], dtype=torch.long, device=self.device), slot_of[id(seq)], a)
            for seq, a, b in work
        ]
        t0 = time.perf_counter()
        if self.adapters is not None:  # which packed tokens each adapter applies to
            self.adapters.assign([seq.adapter for seq, _, _ in work], [b - a for _, a, b in work])
        try:
            logits = self.model.prefill_many(items, self.cache)
        except Exception as exc:
            log.exception("event=prefill_failed sequences=%d", len(work))
            for seq, _, b in work:
                self.slots.release(seq, keep=False, written=b)
                seq.on_done(exc)
            return
        self.stats.prefill_seconds += time.perf_counter() - t0
        done = []
        for i, (seq, a, b) in enumerate(work):
            seq.kv_len = b
            self.stats.prefill_tokens += b - a
            if not seq.prefilling:
                done.append(i)
        if done:
            group = [work[i][0] for i in done]
            self._accept(group, self._sample(logits[done], group))

    def _decode(self) -> None:
        """One decode step over slots 0..B-1. A sequence still in chunked prefill rides along with a
        dummy token: its K/V row at `kv_len` is overwritten by its next chunk, its logits are unused."""
        seqs = self.slots.active()
        live = [i for i, s in enumerate(seqs) if not s.prefilling]
        if not live:
            return
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(live))
        ids = [s.output_ids[-1] if not s.prefilling else 0 for s in seqs]
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        lengths = torch.tensor([s.kv_len for s in seqs], device=self.device)
        t0 = time.perf_counter()
        if self.adapters is not None:  # one row per sequence
            self.adapters.assign([s.adapter for s in seqs])
        logits = self.model.decode(tokens, self.cache, lengths)
        running = [seqs[i] for i in live]
        for s in running:
            s.kv_len += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self._accept(running, self._sample(logits if len(live) == len(seqs) else logits[live], running))

    def _sample(self, logits: torch.Tensor, seqs: list[EngineSequence]) -> StepSample:
        t0 = time.perf_counter()
        out = sample_step(logits, [s.params for s in seqs], [s.generator for s in seqs])
        self.stats.sample_seconds += time.perf_counter() - t0
        return out

    def _accept(self, seqs: list[EngineSequence], sample: StepSample) -> None:
        """Append each sequence's new token, then finish those that hit a stop condition."""
        for i, seq in enumerate(seqs):
            tok = sample.tokens[i]
            seq.output_ids.append(tok)
            seq.logprobs.append(sample.logprobs[i])
            seq.top.append(sample.top[i])
            self.stats.generated_tokens += 1
            if seq.on_token is not None:
                seq.on_token(tok, sample.logprobs[i], sample.top[i])
            p = seq.params
            hit = seq.stop_checker.add(tok)
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(seq, "stop", tok if tok in p.stop_token_ids else None)
            elif hit is not None:
                seq.stop_text = hit[0]
                self._finish(seq, "stop", hit[1])
            elif len(seq.output_ids) >= p.max_tokens:
                self._finish(seq, "length", None)

    def _finish(
        self, seq: EngineSequence, reason: str, stop_reason: str | int | None, leave: bool = True
    ) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if leave:
            self.slots.release(seq)
        self.stats.finished += 1
        self.stats.aborted += reason == "abort"
        p = seq.params
        # EOS / a stop token id ends the text but stays in token_ids (it was sampled: the trainer needs it).
        token_end = reason == "stop" and not isinstance(stop_reason, str)
        text_ids = seq.output_ids[:-1] if token_end else seq.output_ids
        text = (
            seq.stop_text if seq.stop_text is not None else self.text.decode(text_ids, p.skip_special_tokens)
        )
        adapter, version = self.served_by(seq)
        seq.on_done(
            GenerationResult(
                prompt_ids=seq.prompt_ids,
                token_ids=list(seq.output_ids),
                logprobs=list(seq.logprobs),
                top_logprobs=list(seq.top),
                text=text,
                finish_reason=reason,
                stop_reason=stop_reason,
                weight_version=version,
                cached_tokens=seq.cached_tokens,
                adapter=adapter,
            )
        )

    def served_by(self, seq: EngineSequence) -> tuple[str | None, int]:
        """(adapter, version) that served `seq`: its LoRA adapter if loaded, else (None, the base's)."""
        if self.adapters is not None and seq.adapter is not None:
            version = self.adapters.version(seq.adapter)
            if version is not None:
                return seq.adapter, version
        return None, self.weight_version

    def _drop_cancelled(self) -> None:
        for seq in self.slots.active():
            if seq.cancelled:
                self._finish(seq, "abort", None)

    def _apply_maintenance(self, op: Maintenance) -> None:
        try:
            result = op.fn()
        except Exception as exc:
            log.exception("event=maintenance_failed op=%s", op.name)
            op.on_done(exc)
            return
        log.info("event=%s", op.name)
        op.on_done(result)

    def _fail_running(self, exc: BaseException) -> None:
        for seq in self.slots.active():
            self.slots.release(seq, keep=False)
            seq.on_done(exc)
        self.slots.clear_cache()

    def _abort_all(self) -> None:
        for seq in self.slots.active():
            self._finish(seq, "abort", None)
        while self._waiting:
            self._finish(self._waiting.popleft(), "abort", None, leave=False)
        while self._loads:
            self._loads.popleft().on_done(RuntimeError("engine is shutting down"))  # type: ignore[arg-type]
