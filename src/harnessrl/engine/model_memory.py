"""What the engine's memory holds, and changing it: sleep (free the KV cache, offload or discard the
weights for a collocated trainer), wake-up, and weight loads. Every change moves the memory `state`
only along `ENGINE_TRANSITIONS` (harnessrl.engine.state), checked before anything is touched. The
scheduler runs these on its own thread while no sequence is running (a mixin of `Scheduler`)."""

from __future__ import annotations

import functools
import logging
import time

import torch

from harnessrl.engine.sequence import AdapterLoad, Stats, WeightLoad
from harnessrl.engine.slots import SlotTable
from harnessrl.engine.state import EngineOp, EngineState, InvalidEngineTransition, engine_transition
from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_weights_into
from harnessrl.modeling.lora_swap import LoraSwap, adapter_terms, add_terms_
from harnessrl.modeling.memory import release_freed_memory
from harnessrl.modeling.packed import PackedLinears
from harnessrl.modeling.served_lora import ServedAdapters

log = logging.getLogger(__name__)


def _release_device_memory(device: torch.device) -> None:
    """Hand cached allocator blocks back to the driver, so another process (the trainer) can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ModelMemory:
    """The model's weights and KV cache as a memory state (the scheduler's base class)."""

    model: CausalLM
    packed: PackedLinears | None
    adapters: ServedAdapters | None
    device: torch.device
    cache: KVCache
    slots: SlotTable
    stats: Stats
    weight_version: int
    _state: EngineState

    def _enter(self, target: EngineState) -> None:
        """Move to `target` (the scheduler also wakes the threads waiting on its state)."""
        raise NotImplementedError

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

    def _apply_adapter_load(self, load: AdapterLoad) -> None:
        """Add or replace one served LoRA adapter (the base weights, their version and the memory state
        stay: adapters are kept apart from them); the prefix cache is cleared (K/V computed with the old
        adapter are stale)."""
        try:
            if self.adapters is None:
                raise ValueError("this engine serves no per-request adapters (start it with --lora-adapters)")
            spec, tensors = load.read()
            self.slots.clear_cache()
            self.adapters.put(load.name, spec, tensors, load.version)
        except Exception as exc:
            log.exception("event=adapter_load_failed name=%s version=%d", load.name, load.version)
            load.on_done(exc)
            return
        self.stats.weight_loads += 1
        load.on_done(load.version)

    def _swap_weights(self, state: dict[str, torch.Tensor] | LoraSwap) -> None:
        """Copy (or pack) `state` into the model, then give the read copy's memory back to the OS; a
        `LoraSwap` changes only what the adapters touch (`_swap_lora`), after loading its base if any."""
        if isinstance(state, LoraSwap):
            if state.base is not None:
                self._swap_weights(state.base)
            self._swap_lora(state)
            return
        if self.packed is not None:
            self.packed.load(state)
        else:
            load_weights_into(self.model, state)
        state.clear()
        release_freed_memory()

    def _swap_lora(self, swap: LoraSwap) -> None:
        """Serve `swap.new` in place of `swap.old` (modeling/lora_swap.py): unmerged on the packed products
        (their weights untouched), merged in place into every other targeted weight."""
        shapes = {name: t.shape for name, t in self.model.state_dict(keep_vars=True).items()}
        terms = swap.check(shapes)
        if self.packed is None:
            for name, items in terms.items():
                add_terms_(self.model.get_parameter(name), items)
            log.info("event=lora_swapped merged=%d unmerged=0", len(terms))
            return
        unmerged = self.packed.lora_names()
        given = self.packed.set_lora({n: t for n, t in adapter_terms(swap.new).items() if n in unmerged})
        merged = {n: functools.partial(add_terms_, terms=t) for n, t in terms.items() if n not in unmerged}
        repacked = self.packed.update(merged)
        log.info(
            "event=lora_swapped merged=%d repacked=%d unmerged_products=%d", len(merged), repacked, given
        )
