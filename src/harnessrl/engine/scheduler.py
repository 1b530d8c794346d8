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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harnessrl.engine.detok import StopChecker, TokenText
from harnessrl.engine.sampling import SamplingParams, StepSample, make_generator, sample_step
from harnessrl.engine.slots import SlotTable
from harnessrl.engine.state import EngineOp, EngineState, InvalidEngineTransition, engine_transition
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_weights_into
from harnessrl.modeling.memory import release_freed_memory
from harnessrl.modeling.packed import PackedLinears

log = logging.getLogger(__name__)

# Prompt tokens prefilled between two decode steps while other sequences are decoding: a long prompt is
# prefilled in chunks of this size between decode steps, so it never stalls the running batch for long.
# The one default (EngineConfig.prefill_chunk and the engine's --prefill-chunk use it).
PREFILL_CHUNK = 512
# Prompt tokens packed into one prefill pass when nobody is decoding (bounds a pass's activations).
PREFILL_PASS_TOKENS = 4096


@dataclass
class GenerationResult:
    """A finished sequence: exact token ids, their logprobs, and the text."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None
    weight_version: int
    cached_tokens: int


class EngineSequence:
    """One request being generated; `on_done` is called from the scheduler thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_done: Callable[[GenerationResult | BaseException], None],
        text: TokenText,
        device: torch.device,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> None:
        self.prompt_ids, self.params, self.on_done = prompt_ids, params, on_done
        self.on_token = on_token  # streaming: called from the scheduler thread for every sampled token
        self.generator = make_generator(params.seed, device)
        self.stop_checker = StopChecker(text, params.stop, params.skip_special_tokens)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stop_text: str | None = None
        self.cached_tokens = 0
        self.kv_len = 0  # positions of this sequence's slot holding valid K/V
        self.cancelled = False

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the KV cache yet (chunked prefill in progress)."""
        return self.kv_len < len(self.prompt_ids)

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose K/V are in the cache (the last sampled token is not fed yet)."""
        return (self.prompt_ids + self.output_ids)[: self.kv_len]


def _release_device_memory(device: torch.device) -> None:
    """Hand cached allocator blocks back to the driver, so another process (the trainer) can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class WeightLoad:
    """A queued weight swap, applied when no sequence is running: `read` returns the state dict then."""

    read: Callable[[], dict[str, torch.Tensor]]
    version: int
    on_done: Callable[[int | BaseException], None]


@dataclass
class Maintenance:
    """Work that must run while no sequence is in flight (sleep, wake-up); queued like a weight load."""

    name: str
    fn: Callable[[], object]
    on_done: Callable[[object], None]


@dataclass
class Stats:
    """Counters exposed at GET /admin/stats."""

    max_batch_seen: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    weight_loads: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sample_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)


class Scheduler:
    """Owns the model, the KV cache and the batch; all model calls happen on its thread."""

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
    ) -> None:
        self.model, self.text, self.eos_ids = model, text, eos_ids
        self.packed = packed  # oneDNN-packed copies of the linear weights: repacked when weights change
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
        self._loads: deque[WeightLoad | Maintenance] = deque()
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

    def queue_weight_load(self, load: WeightLoad) -> None:
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

    def sleep(self, level: int = 1) -> EngineState:
        """(scheduler thread, nothing running) Give memory to a collocated trainer; admission waits until
        `wake`. Level 1: free the KV cache and, on an accelerator, move the weights to CPU memory. Level 2:
        also discard the weights (their storage is freed; shapes kept) — after `wake` a weight load must
        come before anything is admitted (the trainer is about to publish new weights anyway). Asleep at
        level 2 already, a level-1 request keeps the deeper sleep. Returns the new state."""
        target = engine_transition(self._state, EngineOp.sleep(level))
        level = target.sleep_level
        self.slots.clear_cache()
        self.cache.free()
        # on CPU the packed copies are the weights (nothing to offload them to): level 1 keeps them
        if self.packed is not None and (level == 2 or not self.packed.released):
            self.packed.drop()
        for p in self.model.parameters():  # tied weights are one Parameter, seen once
            if level == 2:
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            elif self.device.type != "cpu":
                p.data = p.data.to("cpu")
        _release_device_memory(self.device)
        self._enter(target)
        return target

    def wake(self) -> EngineState:
        """(scheduler thread) Take the memory back: weights to the device (level 1) or allocated empty
        (level 2: admission waits for a weight load), then the KV cache. Returns the new state."""
        current = self._state
        target = engine_transition(current, EngineOp.WAKE)
        if current is EngineState.ASLEEP_2:
            kept = self._kept_parameters()
            for p in self.model.parameters():
                if id(p) in kept:
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        elif current.sleep_level == 1 and self.device.type != "cpu":
            for p in self.model.parameters():
                p.data = p.data.to(self.device)
        # without weights (level 2, or slept while waiting for them) the load that must come next packs
        if self.packed is not None and current is EngineState.ASLEEP_1 and not self.packed.active:
            self.packed.refresh()
        self.cache.allocate()
        self._enter(target)
        return target

    def _kept_parameters(self) -> set[int]:
        """ids of the parameters that hold their weights (not released to packed copies)."""
        released = self.packed.released if self.packed is not None else set()
        return {id(p) for name, p in self.model.named_parameters() if name not in released}

    def weight_bytes(self) -> int:
        """Bytes of weights held on the engine's device, packed copies included (0 while asleep at level
        2 or offloaded)."""
        params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                  for p in self.model.parameters() if p.device == self.device}  # fmt: skip
        return sum(params.values()) + (self.packed.nbytes if self.packed is not None else 0)

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
                "kv_cache_bytes": self.cache.kv.numel() * self.cache.kv.element_size(),
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
        seq.on_done(
            GenerationResult(
                prompt_ids=seq.prompt_ids,
                token_ids=list(seq.output_ids),
                logprobs=list(seq.logprobs),
                top_logprobs=list(seq.top),
                text=text,
                finish_reason=reason,
                stop_reason=stop_reason,
                weight_version=self.weight_version,
                cached_tokens=seq.cached_tokens,
            )
        )

    def _drop_cancelled(self) -> None:
        for seq in self.slots.active():
            if seq.cancelled:
                self._finish(seq, "abort", None)

    def _apply_weight_load(self, load: WeightLoad) -> None:
        t0 = time.monotonic()
        try:  # refused before anything is touched (asleep at level 2: EngineAsleep)
            target = engine_transition(self._state, EngineOp.LOAD_WEIGHTS)
        except InvalidEngineTransition as exc:
            load.on_done(exc)
            return
        self.slots.clear_cache()  # first: the cached K/V are stale either way, and their memory is freed
        try:
            self._swap_weights(load.read())
        except Exception as exc:
            log.exception("event=weight_load_failed version=%d", load.version)
            load.on_done(exc)
            return
        self.weight_version = load.version
        self._enter(target)
        self.stats.weight_loads += 1
        log.info("event=weights_swapped version=%d seconds=%.2f", load.version, time.monotonic() - t0)
        load.on_done(load.version)

    def _swap_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy (or pack) `state` into the model, then give the read copy's memory back to the OS."""
        if self.packed is not None:
            self.packed.load(state)
        else:
            load_weights_into(self.model, state)
        state.clear()
        release_freed_memory()

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
