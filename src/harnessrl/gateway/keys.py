"""Per-rollout API keys: `hrl-<rollout_id>-<mac>`, an HMAC of the rollout id under the store's secret.

A key names exactly one rollout and carries no other power. Keys are derived, not stored, so an
idempotent re-create returns the same key and nothing secret sits in the call records.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

_KEY_RE = re.compile(r"^hrl-([a-z0-9]{1,64})-([0-9a-f]{32})$")
_ROLLOUT_ID_RE = re.compile(r"^[a-z0-9]{1,64}$")
VERIFIED_KEYS_KEPT = 65_536  # valid keys remembered (about 10 MB at most); then forgotten at once


def new_secret() -> str:
    """A fresh signing secret for a store."""
    return secrets.token_hex(32)


def new_rollout_id() -> str:
    """A fresh rollout id (lowercase letters and digits only, so it embeds in keys and URLs)."""
    return "ro" + secrets.token_hex(8)


def valid_rollout_id(rollout_id: str) -> bool:
    """True if `rollout_id` has the shape `new_rollout_id` produces."""
    return bool(_ROLLOUT_ID_RE.match(rollout_id))


class KeyRing:
    """Issues and verifies rollout keys with one secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()
        self._verified: dict[str, str] = {}  # keys already checked (a rollout makes many calls)

    def _mac(self, rollout_id: str) -> str:
        return hmac.new(self._secret, rollout_id.encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, rollout_id: str) -> str:
        """The API key of `rollout_id`."""
        return f"hrl-{rollout_id}-{self._mac(rollout_id)}"

    def verify(self, key: str) -> str | None:
        """The rollout id the key belongs to, or None if it is not a valid key."""
        known = self._verified.get(key)
        if known is not None:
            return known
        m = _KEY_RE.match(key)
        if m is None:
            return None
        rollout_id, mac = m.group(1), m.group(2)
        if not hmac.compare_digest(mac, self._mac(rollout_id)):
            return None
        if len(self._verified) >= VERIFIED_KEYS_KEPT:
            self._verified.clear()
        self._verified[key] = rollout_id
        return rollout_id
