"""Who may call what: the admin key for the control API, a rollout's own key (and only for its own
rollout) for the model API, with the rollouts read through a bounded cache that control writes clear."""

from __future__ import annotations

from collections import OrderedDict

from starlette.requests import Request

from harnessrl.gateway.errors import APIError
from harnessrl.gateway.http import bearer
from harnessrl.gateway.keys import KeyRing
from harnessrl.schema import Rollout
from harnessrl.store import Store


class RolloutCache:
    """Least-recently-used rollouts by id, at most `size` of them (model calls read their rollout on
    every call; the control API's writes `forget` the rollout they changed). Size 0 caches nothing:
    for a store other gateways write too, whose writes this gateway would not see."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"rollout cache size must be at least 0, not {size}")
        self.size = size
        self._items: OrderedDict[str, Rollout] = OrderedDict()

    def get(self, rollout_id: str) -> Rollout | None:
        """The cached rollout (now the most recently used), or None."""
        rollout = self._items.get(rollout_id)
        if rollout is not None:
            self._items.move_to_end(rollout_id)
        return rollout

    def put(self, rollout: Rollout) -> None:
        """Cache `rollout`, dropping the least recently used one when full."""
        if self.size == 0:
            return
        self._items[rollout.rollout_id] = rollout
        self._items.move_to_end(rollout.rollout_id)
        if len(self._items) > self.size:
            self._items.popitem(last=False)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout (its stored state changed)."""
        self._items.pop(rollout_id, None)

    def __len__(self) -> int:
        return len(self._items)


class Access:
    """Checks the keys of requests against the admin key and the rollout keys of `keys`."""

    def __init__(self, admin_key: str, keys: KeyRing, store: Store, cache_size: int) -> None:
        self.admin_key = admin_key
        self.keys = keys
        self.store = store
        self.rollouts = RolloutCache(cache_size)

    def require_admin(self, request: Request) -> None:
        """Raise 401/403 unless the request carries the admin key."""
        key = bearer(request)
        if key is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <admin key>'")
        if key == self.admin_key:
            return
        if self.keys.verify(key) is not None:
            raise APIError(403, "a rollout key cannot use the control API")
        raise APIError(401, "invalid API key")

    def rollout_for(self, request: Request, path_rollout: str | None) -> Rollout:
        """The rollout a model-API request acts for, checking its key (401), scope (403) and that it
        still takes calls (409)."""
        key = bearer(request)
        if key is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <rollout key>'")
        rollout_id = self.keys.verify(key)
        if rollout_id is None:
            raise APIError(401, "invalid API key: use the key issued for this rollout")
        if path_rollout is not None and path_rollout != rollout_id:
            raise APIError(403, f"this key does not belong to rollout '{path_rollout}'")
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            rollout = self.store.get_rollout(rollout_id)
            if rollout is None:
                raise APIError(401, "the rollout of this key does not exist in this gateway's store")
            self.rollouts.put(rollout)
        if rollout.state.finished:
            raise APIError(409, f"rollout '{rollout_id}' is {rollout.state}; it accepts no more calls")
        return rollout
