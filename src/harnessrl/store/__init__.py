"""Store: the durable record of rollouts, attempts, calls and rewards."""

from harnessrl.store.base import Conflict, NotFound, Store, StoreError
from harnessrl.store.sqlite import SQLiteStore

__all__ = ["Conflict", "NotFound", "SQLiteStore", "Store", "StoreError"]
