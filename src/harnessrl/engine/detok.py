"""Token ids to text: per-token bytes/strings for logprobs, and completion text with stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable char standing for each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Maps token ids to their exact bytes (byte-level BPE) and decodes id lists to text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added = {i: t.content for i, t in added.items()}
        self._byte_level = self._is_byte_level()
        self._dec = _byte_decoder()
        self._cache: dict[int, bytes] = {}

    def _is_byte_level(self) -> bool:
        decoder = self.tokenizer.decoder
        return decoder is not None and type(decoder).__name__ == "ByteLevel"

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text)."""
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            out = self._added[token_id].encode()
        elif self._byte_level:
            piece = self.tokenizer.id_to_token(token_id) or ""
            out = bytes(self._dec.get(ch, 0) for ch in piece)
        else:
            out = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        self._cache[token_id] = out
        return out

    def token_str(self, token_id: int) -> str:
        """A token's text as logprobs report it (invalid UTF-8 pieces replaced)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text (byte-level: concatenated token bytes as UTF-8, as the tokenizer does)."""
        if not self._byte_level:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        skip = self.special_ids if skip_special_tokens else frozenset()
        data = b"".join(self.token_bytes(i) for i in ids if i not in skip)
        return data.decode("utf-8", errors="replace")


class StopChecker:
    """Incrementally decodes a completion and finds the first stop string in it."""

    def __init__(self, text: TokenText, stop: list[str], skip_special_tokens: bool) -> None:
        self.text, self.stop = text, [s for s in stop if s]
        self.skip = text.special_ids if skip_special_tokens else frozenset()
        self._buf = bytearray()
        self._checked = 0  # characters of decoded text already searched
        self.longest = max((len(s) for s in self.stop), default=0)

    def add(self, token_id: int) -> tuple[str, str] | None:
        """Append a token; return (text before the stop string, the stop string) once one appears."""
        if token_id not in self.skip:
            self._buf += self.text.token_bytes(token_id)
        if not self.stop:
            return None
        decoded = bytes(self._buf).decode("utf-8", errors="replace")
        # Re-search a margin: a partial UTF-8 character at the end decoded as up to 3 replacement chars.
        start = max(0, self._checked - self.longest - 3)
        hits = [(pos, s) for s in self.stop if (pos := decoded.find(s, start)) >= 0]
        self._checked = len(decoded)
        if not hits:
            return None
        pos, s = min(hits)
        return decoded[:pos], s
