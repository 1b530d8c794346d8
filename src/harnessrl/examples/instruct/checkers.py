"""Deterministic checkers of the `instruct` example: one per constraint kind, each with the sentence
that states the constraint in a prompt, so what the prompt asks and what the checker tests live together.

A constraint is a plain JSON dict, `{"kind": <name>, **params}`, so tasks serialise as they are.

Which checker does the work:

- from `if-verifiable` (its IFEval instruction classes, called as they ship; imported lazily):
  `words_max`, `words_min` (`NumberOfWords`), `keywords_include` (`KeywordChecker`),
  `keywords_exclude` (`ForbiddenWords`), `bullets` (`BulletListChecker`), `sections` (`SectionChecker`),
  `end_phrase` (`EndChecker`), `no_commas` (`CommaChecker`), `title` (`TitleChecker`),
  `postscript` (`PostscriptChecker`).
- our own, where if-verifiable's does not work offline or is not deterministic:
  `sentences_max` (its `NumberOfSentences` needs NLTK's `punkt_tab` data, which is not installed and
  cannot be downloaded here), `lowercase` / `uppercase` (its casing checkers also require
  `langdetect` to call the text English, and `langdetect` is random unless a global seed is set),
  `json_keys` (its `JsonFormat` accepts any JSON value; we need an object with given keys) and
  `start_word` (no IFEval equivalent).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

Constraint = dict[str, Any]

IF_VERIFIABLE = "if-verifiable"
OWN = "own"


@functools.cache
def _ifeval() -> ModuleType:
    """if-verifiable's IFEval instruction module (imported on first use: it pulls in `datasets`)."""
    try:
        from if_verifiable.ifeval import instructions
    except ImportError as e:
        raise ImportError(
            "the instruct example's checkers need the package 'if-verifiable': "
            "pip install 'harnessrl[examples]' (or: pip install if-verifiable)"
        ) from e
    return instructions


def _ifeval_check(class_name: str, text: str, **args: Any) -> bool:
    """Run one if-verifiable IFEval checker, built with explicit arguments (never its random defaults)."""
    checker = getattr(_ifeval(), class_name)(class_name)
    checker.build_description(**args)
    return bool(checker.check_following(text))


# --- our own checkers ---------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_FIRST_WORD = re.compile(r"[A-Za-z']+")


def count_sentences(text: str) -> int:
    """Sentences: pieces split after `.`, `!` or `?` followed by space, or at line breaks; a piece
    counts if it holds a letter or digit (so a bare list marker or `...` is not a sentence)."""
    return sum(1 for piece in _SENTENCE_END.split(text.strip()) if re.search(r"\w", piece))


def json_object(text: str) -> dict[str, Any] | None:
    """The response parsed as one JSON object (a surrounding ``` fence is allowed), or None."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _has_letters(text: str) -> bool:
    return any(c.isalpha() for c in text)


def _sentences_max(text: str, c: Constraint) -> bool:
    return 0 < count_sentences(text) <= int(c["n"])


def _lowercase(text: str, c: Constraint) -> bool:
    return _has_letters(text) and text == text.lower()


def _uppercase(text: str, c: Constraint) -> bool:
    return _has_letters(text) and text == text.upper()


def _json_keys(text: str, c: Constraint) -> bool:
    obj = json_object(text)
    return obj is not None and all(k in obj for k in c["keys"])


def _start_word(text: str, c: Constraint) -> bool:
    first = _FIRST_WORD.search(text)
    return (
        first is not None
        and text[: first.start()].strip() in ("", '"', "'")
        and first.group().lower() == str(c["word"]).lower()
    )


# --- the table of kinds --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One constraint kind: how a prompt states it, how a response is checked, and what it cannot be
    combined with (same `group`, or named in `conflicts` by either side)."""

    name: str
    source: str  # IF_VERIFIABLE or OWN
    describe: Callable[[Constraint], str]
    check: Callable[[str, Constraint], bool]
    group: str | None = None
    conflicts: frozenset[str] = frozenset()


def _quoted(words: list[str]) -> str:
    q = [f'"{w}"' for w in words]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "words_max", IF_VERIFIABLE,
            lambda c: f"Answer in fewer than {c['n']} words.",
            lambda t, c: _ifeval_check("NumberOfWords", t, num_words=c["n"], relation="less than"),
            group="length",
        ),
        Kind(
            "words_min", IF_VERIFIABLE,
            lambda c: f"Answer with at least {c['n']} words.",
            lambda t, c: _ifeval_check("NumberOfWords", t, num_words=c["n"], relation="at least"),
            group="length",
        ),
        Kind(
            "sentences_max", OWN,
            lambda c: f"Use at most {c['n']} sentences.",
            _sentences_max,
            group="length",
            conflicts=frozenset({"bullets", "sections", "json_keys"}),
        ),
        Kind(
            "keywords_include", IF_VERIFIABLE,
            lambda c: f"Include the word{'s' if len(c['words']) > 1 else ''} {_quoted(c['words'])}.",
            lambda t, c: _ifeval_check("KeywordChecker", t, keywords=list(c["words"])),
        ),
        Kind(
            "keywords_exclude", IF_VERIFIABLE,
            lambda c: f"Do not use the word{'s' if len(c['words']) > 1 else ''} {_quoted(c['words'])}.",
            lambda t, c: _ifeval_check("ForbiddenWords", t, forbidden_words=list(c["words"])),
        ),
        Kind(
            "bullets", IF_VERIFIABLE,
            lambda c: f'Format your answer as a bullet list of exactly {c["n"]} items, each line starting with "* ".',
            lambda t, c: _ifeval_check("BulletListChecker", t, num_bullets=c["n"]),
            group="format",
            conflicts=frozenset({"start_word"}),
        ),
        Kind(
            "json_keys", OWN,
            lambda c: f"Reply with only a JSON object that has the keys {_quoted(c['keys'])}.",
            _json_keys,
            group="format",
            conflicts=frozenset({"uppercase", "no_commas", "end_phrase", "start_word", "title", "postscript"}),
        ),
        Kind(
            "sections", IF_VERIFIABLE,
            lambda c: f"Split your answer into {c['n']} sections, each starting with a header line "
            f'"SECTION X" (SECTION 1, SECTION 2, ...).',
            lambda t, c: _ifeval_check("SectionChecker", t, section_spliter="SECTION", num_sections=c["n"]),
            group="format",
            conflicts=frozenset({"lowercase", "start_word", "title"}),
        ),
        Kind(
            "lowercase", OWN,
            lambda c: "Write your whole answer in lowercase letters, with no capital letters at all.",
            _lowercase,
            group="case",
            conflicts=frozenset({"postscript"}),
        ),
        Kind(
            "uppercase", OWN,
            lambda c: "Write your whole answer in capital letters only.",
            _uppercase,
            group="case",
        ),
        Kind(
            "end_phrase", IF_VERIFIABLE,
            lambda c: f'End your answer with the exact phrase "{c["phrase"]}", with nothing after it.',
            lambda t, c: _ifeval_check("EndChecker", t, end_phrase=c["phrase"]),
            conflicts=frozenset({"postscript"}),
        ),
        Kind(
            "no_commas", IF_VERIFIABLE,
            lambda c: "Do not use any commas.",
            lambda t, c: _ifeval_check("CommaChecker", t),
        ),
        Kind(
            "title", IF_VERIFIABLE,
            lambda c: "Give your answer a title in double angle brackets, like <<my title>>.",
            lambda t, c: _ifeval_check("TitleChecker", t),
            conflicts=frozenset({"start_word"}),
        ),
        Kind(
            "postscript", IF_VERIFIABLE,
            lambda c: f'At the end, add a postscript starting with "{c["marker"]}".',
            lambda t, c: _ifeval_check("PostscriptChecker", t, postscript_marker=c["marker"]),
        ),
        Kind(
            "start_word", OWN,
            lambda c: f'Start your answer with the word "{c["word"]}".',
            _start_word,
        ),
    )
}  # fmt: skip


def kind_of(constraint: Constraint) -> Kind:
    """The kind of a constraint; the error names the known kinds."""
    name = constraint.get("kind")
    if name not in KINDS:
        raise ValueError(f"unknown constraint kind {name!r}; known: {', '.join(sorted(KINDS))}")
    return KINDS[name]


def describe(constraint: Constraint) -> str:
    """The sentence a prompt uses to state the constraint."""
    return kind_of(constraint).describe(constraint)


def check(text: str, constraint: Constraint) -> bool:
    """Whether `text` meets the constraint."""
    return kind_of(constraint).check(text, constraint)


def compatible(a: str, b: str) -> bool:
    """Whether constraints of kinds `a` and `b` can be asked of one response."""
    ka, kb = KINDS[a], KINDS[b]
    if a == b or (ka.group is not None and ka.group == kb.group):
        return False
    return b not in ka.conflicts and a not in kb.conflicts
