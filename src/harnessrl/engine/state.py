"""The engine's memory state (awake, asleep at level 1 or 2, waiting for weights) and its legal moves.

`EngineState` says what the engine's memory holds and so what it can do; the operations that change it
(`EngineOp`: sleep at level 1 or 2, wake up, load weights) move it along `ENGINE_TRANSITIONS`, and
`engine_transition` is the one check, made before an operation touches anything (as
`harnessrl.schema.check_transition` is for a rollout). The table is keyed by operation rather than
listing allowed target states as `ROLLOUT_TRANSITIONS` does: two operations can lead to the same
state (waking an awake engine and loading weights into it both leave it awake), and a refused
operation has no target to name.

Pause is not part of the state. It only stops admission (running sequences finish), is set from the
HTTP side at any moment, and is independent of the memory state in every combination: a paused engine
can be put to sleep, woken and given weights, and waking it leaves the pause as it was. So the
scheduler keeps it as its own `paused` flag next to the state, and admits while
`not paused and state.admits`; folding it in would double the five states and give every memory move
a paused twin.

Pure (no torch): imported by the scheduler, the routes and the unit tests alike.
"""

from __future__ import annotations

from enum import StrEnum


class EngineState(StrEnum):
    """What the engine's memory holds; legal moves are listed in `ENGINE_TRANSITIONS`."""

    AWAKE = "awake"  # weights and KV cache on the device: admits sequences (unless paused)
    ASLEEP_1 = "asleep_1"  # level 1: KV cache freed, weights kept (moved to CPU memory on an accelerator)
    ASLEEP_2 = "asleep_2"  # level 2: KV cache freed, weights discarded (shapes kept)
    NEEDS_WEIGHTS = "needs_weights"  # woken from level 2: memory allocated, nothing admitted before a load
    # put to sleep at level 1 while waiting for weights: a load may come while asleep (-> ASLEEP_1)
    ASLEEP_1_NEEDS_WEIGHTS = "asleep_1_needs_weights"

    @property
    def sleep_level(self) -> int:
        """0 while awake, else the level of the sleep (the `sleep_level` of /admin/stats)."""
        return _SLEEP_LEVEL[self]

    @property
    def sleeping(self) -> bool:
        """Asleep at either level (the `sleeping` of /admin/stats)."""
        return self.sleep_level > 0

    @property
    def needs_weights(self) -> bool:
        """The weights were discarded and no load came since (the `needs_weights` of /admin/stats)."""
        return self in _NO_WEIGHTS

    @property
    def admits(self) -> bool:
        """The memory state lets sequences in (the pause and queued weight loads are checked apart)."""
        return self is EngineState.AWAKE


_SLEEP_LEVEL = {
    EngineState.AWAKE: 0,
    EngineState.NEEDS_WEIGHTS: 0,
    EngineState.ASLEEP_1: 1,
    EngineState.ASLEEP_1_NEEDS_WEIGHTS: 1,
    EngineState.ASLEEP_2: 2,
}
_NO_WEIGHTS = frozenset({EngineState.ASLEEP_2, EngineState.NEEDS_WEIGHTS, EngineState.ASLEEP_1_NEEDS_WEIGHTS})


class EngineOp(StrEnum):
    """An operation that moves the engine's state (sleep and wake-up log their value as the event name)."""

    SLEEP_1 = "engine_sleep_level_1"
    SLEEP_2 = "engine_sleep_level_2"
    WAKE = "engine_wake"
    LOAD_WEIGHTS = "load_weights"

    @staticmethod
    def sleep(level: int) -> EngineOp:
        """The sleep operation of `level` (1 or 2)."""
        ops = {1: EngineOp.SLEEP_1, 2: EngineOp.SLEEP_2}
        if level not in ops:
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        return ops[level]


_S = EngineState
_O = EngineOp
ENGINE_TRANSITIONS: dict[EngineState, dict[EngineOp, EngineState]] = {
    _S.AWAKE: {
        _O.SLEEP_1: _S.ASLEEP_1,
        _O.SLEEP_2: _S.ASLEEP_2,
        _O.WAKE: _S.AWAKE,
        _O.LOAD_WEIGHTS: _S.AWAKE,
    },
    # a load while asleep at level 1 swaps the offloaded weights; wake-up brings the new ones back
    _S.ASLEEP_1: {
        _O.SLEEP_1: _S.ASLEEP_1,
        _O.SLEEP_2: _S.ASLEEP_2,
        _O.WAKE: _S.AWAKE,
        _O.LOAD_WEIGHTS: _S.ASLEEP_1,
    },
    # no load: there is no storage to load into before wake-up allocates it (EngineAsleep, HTTP 409);
    # a level-1 request keeps the deeper sleep (the memory is given back either way)
    _S.ASLEEP_2: {_O.SLEEP_1: _S.ASLEEP_2, _O.SLEEP_2: _S.ASLEEP_2, _O.WAKE: _S.NEEDS_WEIGHTS},
    _S.NEEDS_WEIGHTS: {
        _O.SLEEP_1: _S.ASLEEP_1_NEEDS_WEIGHTS,
        _O.SLEEP_2: _S.ASLEEP_2,
        _O.WAKE: _S.NEEDS_WEIGHTS,
        _O.LOAD_WEIGHTS: _S.AWAKE,
    },
    _S.ASLEEP_1_NEEDS_WEIGHTS: {
        _O.SLEEP_1: _S.ASLEEP_1_NEEDS_WEIGHTS,
        _O.SLEEP_2: _S.ASLEEP_2,
        _O.WAKE: _S.NEEDS_WEIGHTS,
        _O.LOAD_WEIGHTS: _S.ASLEEP_1,
    },
}


class InvalidEngineTransition(RuntimeError):
    """An operation that the engine's current state does not allow (HTTP 409 with `code`)."""

    code = "invalid_engine_state"


class EngineAsleep(InvalidEngineTransition):
    """An operation refused because the engine sleeps (a weight load at level 2): wake it up first."""

    code = "engine_asleep"


def engine_transition(current: EngineState, op: EngineOp) -> EngineState:
    """The state `op` leads to from `current`; raise `EngineAsleep` (asleep) or `InvalidEngineTransition`
    when `ENGINE_TRANSITIONS` does not allow it."""
    target = ENGINE_TRANSITIONS[current].get(op)
    if target is not None:
        return target
    allowed = ", ".join(ENGINE_TRANSITIONS[current]) or "none"
    detail = f"(state {current} refuses {op}; allowed: {allowed})"
    if current.sleeping:
        discarded = " (weights discarded)" if current.needs_weights else ""
        raise EngineAsleep(
            f"the engine sleeps at level {current.sleep_level}{discarded}: wake it up first {detail}"
        )
    raise InvalidEngineTransition(f"the engine cannot {op} now {detail}")
