"""The engine: a model, its tokenizer and a scheduler thread, behind async methods for the HTTP layer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from harnessrl.chat import ChatFormat
from harnessrl.chat.format import config_eos_ids
from harnessrl.engine.config import EngineConfig
from harnessrl.engine.detok import TokenText
from harnessrl.engine.sampling import SamplingParams
from harnessrl.engine.scheduler import Scheduler
from harnessrl.engine.sequence import AdapterLoad, EngineSequence, GenerationResult, Maintenance, WeightLoad
from harnessrl.engine.state import EngineOp, EngineState, engine_transition
from harnessrl.modeling.hf_generic import generic_prefill_chunk, is_generic
from harnessrl.modeling.loading import (
    check_state_dict,
    load_model,
    load_state_dict_file,
    load_tokenizer,
    read_weights,
    resolve_model,
)
from harnessrl.modeling.lora import LoraSpec, is_peft_dir, read_peft
from harnessrl.modeling.lora_swap import LoraSwap
from harnessrl.modeling.memory import release_freed_memory
from harnessrl.modeling.packed import choose_matmul
from harnessrl.modeling.served_lora import ServedAdapters
from harnessrl.modeling.weight_shm import read_shared
from harnessrl.modeling.weight_stream import MEDIA_TYPE, Entry, StreamReceiver

log = logging.getLogger(__name__)


class EngineError(ValueError):
    """A request the engine cannot serve as asked (HTTP 400); names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Engine:
    """Loads the model and runs generation; every method is safe to call from the event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        # Load and probe on one torch thread: only the scheduler thread may start an OpenMP team of
        # `num_threads`. A second team in the process (this thread's) makes libgomp throttle its
        # spin-waits, and then each of a decode step's ~1,000 parallel regions wakes its workers through
        # the kernel: 34 -> 45 ms per step at batch 16 on two cores. (The server's `main` leaves its
        # main thread, and so the threads it starts later, at one thread for the same reason.)
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.model = load_model(self.model_dir, dtype=config.torch_dtype, device=config.device)
            # served adapters hook each layer's own product: no fused q/k/v, gate/up then
            self.packed, self.matmul = (
                (None, "aten (transformers path)")
                if is_generic(self.model)
                else (
                    choose_matmul(
                        self.model, config.matmul, torch.device(config.device), fuse=not config.lora_adapters
                    )
                )
            )
            if self.packed is not None:  # the packed copies serve state dict, loads and sleep from now on
                freed = self.packed.release_originals()
                release_freed_memory()
                log.info("event=packed_originals_released mb=%.0f", freed / 2**20)
        finally:
            torch.set_num_threads(previous)
        if config.lora_adapters and is_generic(self.model):
            raise ValueError("--lora-adapters: per-request adapters are served on the builtin path only")
        self.adapters = ServedAdapters(self.model) if config.lora_adapters else None
        # the LoRA adapter merged into the weights served (None: they are a full load's, e.g. the base);
        # a LoRA sync swaps it for the new one in memory (`_read_weights`)
        self.merged_adapter: tuple[LoraSpec, dict[str, torch.Tensor]] | None = None
        self._upload = asyncio.Lock()  # one weights body received at a time: at most one copy held
        self.tokenizer = load_tokenizer(self.model_dir)
        self.text = TokenText(self.tokenizer)
        self.served_model_name = config.served_model_name or config.model
        self.max_model_len = self._max_model_len(config, self.model.config.max_position_embeddings)
        self.kv_budget = config.kv_budget(self.max_model_len)
        # the model's own chat template, tool-call format and end-of-turn tokens (harnessrl.chat.format)
        self.chat = ChatFormat.from_folder(self.model_dir, config.tool_parser, config.chat_template_kwargs)
        self.eos_ids = {self.model.config.eos_token_id} | config_eos_ids(self.model_dir) | self.chat.stop_ids
        self.scheduler = Scheduler(
            self.model,
            self.text,
            max_batch=config.max_batch,
            max_model_len=self.max_model_len,
            eos_ids=self.eos_ids,
            prefix_cache=config.prefix_cache,
            weight_version=config.weight_version,
            threads=config.num_threads,
            prefill_chunk=generic_prefill_chunk(self.model, config.prefill_chunk, self.kv_budget),
            max_cached_tokens=self.kv_budget,
            packed=self.packed,
            adapters=self.adapters,
        )
        log.info(
            "event=engine_ready model=%s dir=%s threads=%d max_batch=%d max_model_len=%d kv_budget=%d "
            "rope_scaling=%s matmul=%r",
            config.model,
            self.model_dir,
            config.num_threads,
            config.max_batch,
            self.max_model_len,
            self.kv_budget,
            self.model.config.rope_scaling,
            self.matmul,
        )

    @staticmethod
    def _max_model_len(config: EngineConfig, model_positions: int) -> int:
        """The context served: the flag, capped at (and by default) the model's max_position_embeddings."""
        if config.max_model_len is None:
            return model_positions
        if config.max_model_len > model_positions:
            log.warning(
                "event=max_model_len_capped requested=%d model_max_position_embeddings=%d "
                "note=serve a RoPE-scaled model (e.g. smollm2-16k) for a longer context",
                config.max_model_len,
                model_positions,
            )
            return model_positions
        return config.max_model_len

    def start(self) -> None:
        """Start the scheduler thread."""
        self.scheduler.start()

    def shutdown(self) -> None:
        """Stop the scheduler thread (unfinished requests end with finish_reason 'abort')."""
        self.scheduler.shutdown()

    @property
    def weight_version(self) -> int:
        """Version of the weights serving new sequences."""
        return self.scheduler.weight_version

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text (special-token markup such as <|im_start|> maps to its id)."""
        return list(self.tokenizer.encode(text).ids)

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render messages (+ tools) with the model's chat format and tokenize the prompt."""
        text = self.chat.render(messages, tools, add_generation_prompt, **(template_kwargs or {}))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str = "max_tokens") -> int:
        """Validate prompt + completion against max_model_len; return the effective max_tokens."""
        limit = self.max_model_len
        if n_prompt == 0:
            raise EngineError("the prompt is empty; send at least one token", "prompt")
        if max_tokens is None:
            max_tokens = limit - n_prompt
        if max_tokens < 1 or n_prompt + max_tokens > limit:
            raise EngineError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max(max_tokens, 1)} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                f"completion). Reduce the prompt or {param}.",
                param,
                "context_length_exceeded",
            )
        return max_tokens

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one completion; cancelling the await aborts the sequence."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", "prompt")
        fut, on_done = self._future()
        seq = EngineSequence(prompt_ids, params, on_done, self.text, self.model.lm_head.weight.device)
        self.scheduler.submit(seq)
        try:
            return await fut
        except asyncio.CancelledError:
            seq.cancelled = True
            raise

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_done: Callable[[GenerationResult | BaseException], None],
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> EngineSequence:
        """Queue a sequence with callbacks (run on the scheduler thread); for streaming."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", "prompt")
        seq = EngineSequence(
            prompt_ids, params, on_done, self.text, self.model.lm_head.weight.device, on_token
        )
        self.scheduler.submit(seq)
        return seq

    async def load_weights(self, path: str, version: int, adapter: str | None = None) -> int:
        """Swap in the weights at `path` between steps, once no sequence is running. They are read then,
        after the prefix cache (stale after the swap) is given back, so its memory and the read weights
        are never held together; a request arriving meanwhile waits and is served by the new weights.
        With `adapter`, `path` is a PEFT folder served (unmerged) as that adapter at `version`."""
        if not Path(path).exists():
            raise EngineError(f"weights path {path} does not exist", "path")
        fut, on_done = self._future()
        if adapter is not None:
            if self.adapters is None:
                raise EngineError(
                    "this engine serves no per-request adapters; start it with --lora-adapters", "adapter"
                )
            if not is_peft_dir(path):
                raise EngineError(f"{path} is not a LoRA adapter folder (no adapter_config.json)", "path")
            self.scheduler.queue_weight_load(AdapterLoad(adapter, lambda: read_peft(path), version, on_done))
        else:
            self.scheduler.queue_weight_load(WeightLoad(lambda: self._read_weights(path), version, on_done))
        return int(await fut)

    async def load_weights_stream(self, body: AsyncIterator[bytes], version: int, length: int | None) -> int:
        """Swap in the weights of a safetensors-format `body` (the trainer's memory sync, no file) as
        `version`, as `load_weights` swaps a folder's. The header is checked against the model before
        any tensor is kept (a wrong name or shape: 400); the tensors are received while the old weights
        keep serving, converted one by one to the engine's dtype, and queued for the swap only once the
        body is whole, so a body that ends early or runs long leaves the old weights untouched. Extra
        memory: the tensors received (one model in the engine's dtype) plus one tensor as sent."""
        engine_transition(self.scheduler.state, EngineOp.LOAD_WEIGHTS)  # asleep at level 2: 409 now
        async with self._upload:
            receiver = StreamReceiver(self._check_sent, self.model.lm_head.weight.dtype, length)
            try:
                async for chunk in body:
                    receiver.feed(chunk)
                state = receiver.finish()
            except ValueError as exc:  # StreamError, or check_state_dict's name/shape mismatch
                raise EngineError(f"weights body: {exc}", "body") from exc
        log.info("event=weights_received version=%d bytes=%d tensors=%d", version, receiver.total, len(state))

        def read() -> dict[str, torch.Tensor]:  # popped: the swap frees (and trims) every tensor received
            return self._full_state({k: state.pop(k) for k in list(state)})

        fut, on_done = self._future()
        self.scheduler.queue_weight_load(WeightLoad(read, version, on_done))
        return int(await fut)

    async def load_weights_shared(self, name: str, version: int) -> int:
        """Swap in the weights the trainer wrote into the shared-memory segment `name` (same machine) as
        `version`: its header is checked against the model, its tensors are read as views of the
        segment (no copy here unless the engine's dtype differs: then one tensor at a time, on the
        scheduler thread) and swapped as `load_weights` swaps a folder's."""
        engine_transition(self.scheduler.state, EngineOp.LOAD_WEIGHTS)  # asleep at level 2: 409 now
        try:
            sent = read_shared(name, self._check_sent)
        except FileNotFoundError as exc:
            raise EngineError(f"no shared-memory segment {name!r} on the engine's machine; send the weights "
                              f"as the body instead (Content-Type {MEDIA_TYPE})", "shm") from exc  # fmt: skip
        except ValueError as exc:  # StreamError, or check_state_dict's name/shape mismatch
            raise EngineError(f"shared-memory segment {name!r}: {exc}", "shm") from exc
        dtype = self.model.lm_head.weight.dtype

        def read() -> dict[str, torch.Tensor]:  # popped as converted: no view outlives the swap
            return self._full_state({k: sent.pop(k).to(dtype) for k in list(sent)})

        fut, on_done = self._future()
        self.scheduler.queue_weight_load(WeightLoad(read, version, on_done))
        log.info("event=weights_mapped version=%d shm=%s tensors=%d", version, name, len(sent))
        return int(await fut)

    def _check_sent(self, entries: list[Entry]) -> None:
        """A weights body's header against the model: the names and shapes `check_state_dict` wants."""
        sent = {name: torch.empty(shape, device="meta") for name, _, shape, _ in entries}
        check_state_dict(self.model, sent)

    def _full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """(scheduler thread) A full state received whole: no LoRA adapter is merged in it any more."""
        self.merged_adapter = None
        return check_state_dict(self.model, state)

    def adapter_for(self, model: str | None) -> str | None:
        """The served adapter a request's `model` names (None: the base weights serve it)."""
        if self.adapters is None or model is None or model == self.served_model_name:
            return None
        return model

    def _read_weights(self, path: str) -> dict[str, torch.Tensor] | LoraSwap:
        """(scheduler thread, nothing running) What to swap in: a model folder's weights, or for a LoRA
        adapter folder (a few MB) a `LoraSwap` that serves it in place of the adapter served until now
        (modeling/lora_swap.py: the base is not read again, only what the adapters touch changes). Only
        when a level-2 sleep discarded the weights is the base read from disk once, the adapter then
        served on it."""
        p = Path(path)
        if not p.exists():
            raise EngineError(f"weights path {path} does not exist", "path")
        dtype = self.model.lm_head.weight.dtype
        try:
            if is_generic(self.model):  # transformers' loading: the folder's names are its business
                return check_state_dict(self.model, read_weights(self.model, p))
            if is_peft_dir(p):
                adapter = read_peft(p)
                if not self.scheduler.state.needs_weights:
                    swap = LoraSwap(adapter, self.merged_adapter)
                    swap.check({k: v.shape for k, v in self.model.state_dict(keep_vars=True).items()})
                    log.info("event=lora_adapter_merged path=%s r=%d alpha=%g layers=%d from=memory",
                             p, adapter[0].r, adapter[0].alpha, len(adapter[1]) // 2)  # fmt: skip
                    self.merged_adapter = adapter
                    return swap
                self.merged_adapter = adapter  # served on the base read again, as a sync from memory would
                return LoraSwap(
                    adapter,
                    None,
                    base=check_state_dict(self.model, load_state_dict_file(self.model_dir, dtype)),
                )
            else:
                state = load_state_dict_file(p, dtype)
                self.merged_adapter = None
            return check_state_dict(self.model, state)
        except (FileNotFoundError, ValueError) as exc:
            raise EngineError(f"cannot load weights from {path}: {exc}", "path") from exc

    async def sleep(self, level: int = 1) -> EngineState:
        """Give memory to a collocated trainer once running sequences finish (see `Scheduler.sleep` for
        the levels). Requests that arrive meanwhile wait until `wake_up` (level 2: and a weight load).
        Returns the engine's state then."""
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, not {level}", "level")
        fut, on_done = self._future()
        op = Maintenance(EngineOp.sleep(level).value, lambda: self.scheduler.sleep(level), on_done)
        self.scheduler.queue_maintenance(op)
        return EngineState(await fut)

    async def wake_up(self) -> EngineState:
        """Take the memory back (KV cache; weights unless they were discarded) and admit requests (after
        a weight load if they were). Returns the engine's state then."""
        fut, on_done = self._future()
        self.scheduler.queue_maintenance(Maintenance(EngineOp.WAKE.value, self.scheduler.wake, on_done))
        return EngineState(await fut)

    def pause(self) -> None:
        """Stop admitting new sequences; running ones finish. Independent of sleep: a paused engine can
        sleep, wake up and load weights, and stays paused until `resume`."""
        self.scheduler.set_paused(True)

    def resume(self) -> None:
        """Admit new sequences again."""
        self.scheduler.set_paused(False)

    def stats(self) -> dict[str, object]:
        """Scheduler counters (batch sizes seen, tokens, queue sizes, version) and the matmul path."""
        return {**self.scheduler.snapshot(), "matmul": self.matmul}

    @staticmethod
    def _future() -> tuple[asyncio.Future[Any], Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(value: object) -> None:
            if fut.done():
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        def on_done(value: object) -> None:
            try:
                loop.call_soon_threadsafe(settle, value)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
                pass

        return fut, on_done
