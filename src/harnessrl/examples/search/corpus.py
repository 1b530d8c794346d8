"""A generated knowledge base of fictional entities, its documents, and multi-hop questions over it.

Everything is built offline and deterministically from a seed: invented names (syllables, so no
model has memorised any fact about them), entities of six kinds linked by functional relations (each
entity has exactly one value per relation, so every question has one answer), one short document per
entity stating its own facts, and questions that follow a chain of 1–4 relations, for example

    "In which city was the founder of Zarnok Industries born?"   (company -founder-> person -birthplace-> city)

Answering needs one search per hop: the document of `Zarnok Industries` names its founder, whose
document names the birthplace. Documents state only an entity's own (forward) facts, so no single
document answers a multi-hop question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "", "n", "r", "l", "s", "k", "m"]
OCCUPATIONS = ["chemist", "painter", "engineer", "sailor", "lawyer", "baker", "pilot", "teacher", "doctor"]
COMPANY_SUFFIXES = ["Industries", "Labs", "Holdings", "Works"]

# Names used by the harness's worked examples; never generated for the knowledge base.
RESERVED_WORDS = frozenset({"pelu", "garrow", "frenn", "tesk", "moro", "vint", "quarl", "osta"})


@dataclass(frozen=True)
class KBSize:
    """How many entities of each kind the knowledge base has."""

    countries: int = 8
    seas: int = 6
    rivers: int = 16
    cities: int = 48
    companies: int = 32
    people: int = 80


@dataclass
class Entity:
    """One fictional entity: its kind, name, how text refers to it, relations and attributes."""

    kind: str  # person | company | city | country | river | sea
    name: str  # "Ravel River": the document title and the gold answer
    ref: str  # "the Ravel River": how sentences mention it
    links: dict[str, str] = field(default_factory=dict)  # relation -> name of the entity it points to
    attrs: dict[str, str] = field(default_factory=dict)  # occupation (people), founded (companies)


@dataclass(frozen=True)
class Relation:
    """A hop: from an entity of kind `source` to its `target` (an entity kind, or `attr` for a value)."""

    name: str
    source: str
    target: str  # an entity kind, or "attr"
    phrase: str  # a noun phrase naming the target, with {x} for the source: "the founder of {x}"
    question: str  # a question asking for the target: "Who founded {x}?"


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in [
        Relation("birthplace", "person", "city", "the birthplace of {x}", "In which city was {x} born?"),
        Relation("employer", "person", "company", "the employer of {x}", "Which company does {x} work for?"),
        Relation("occupation", "person", "attr", "", "What is the occupation of {x}?"),
        Relation("founder", "company", "person", "the founder of {x}", "Who founded {x}?"),
        Relation("headquarters", "company", "city", "the headquarters of {x}", "In which city is {x} based?"),
        Relation("founded", "company", "attr", "", "In which year was {x} founded?"),
        Relation("country", "city", "country", "the country of {x}", "In which country is {x}?"),
        Relation("river", "city", "river", "the river of {x}", "Which river flows through {x}?"),
        Relation("mayor", "city", "person", "the mayor of {x}", "Who is the mayor of {x}?"),
        Relation("capital", "country", "city", "the capital of {x}", "What is the capital of {x}?"),
        Relation("mouth", "river", "sea", "the sea that {x} flows into", "Which sea does {x} flow into?"),
    ]
}


@dataclass
class KnowledgeBase:
    """Entities by name and their documents (one per entity, in a fixed order)."""

    entities: dict[str, Entity]

    def documents(self) -> list[tuple[str, str]]:
        """(title, text) of every entity's document."""
        return [(e.name, render_document(e, self)) for e in self.entities.values()]


class _Names:
    """Invented words, each used once in the whole knowledge base."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set(RESERVED_WORDS)

    def word(self, min_syl: int = 2, max_syl: int = 2) -> str:
        """A new capitalised word of `min_syl`–`max_syl` syllables."""
        while True:
            n = self.rng.randint(min_syl, max_syl)
            w = "".join(
                self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS) for _ in range(n)
            )
            if w not in self.used and len(w) >= 4:
                self.used.add(w)
                return w.capitalize()


def build_kb(seed: int = 0, size: KBSize | None = None) -> KnowledgeBase:
    """Generate the knowledge base for `seed` (the same seed always gives the same one)."""
    size = size or KBSize()
    rng = random.Random(f"search-kb-{seed}")
    names = _Names(rng)
    ents: dict[str, Entity] = {}

    def add(e: Entity) -> Entity:
        ents[e.name] = e
        return e

    seas = [add(_sea(names.word(), rng)) for _ in range(size.seas)]
    rivers = [
        add(Entity("river", f"{n} River", f"the {n} River"))
        for n in (names.word() for _ in range(size.rivers))
    ]
    countries = [add(Entity("country", n, n)) for n in (names.word() for _ in range(size.countries))]
    cities = [add(Entity("city", n, n)) for n in (names.word() for _ in range(size.cities))]
    people = [add(Entity("person", f"{names.word()} {names.word()}", "")) for _ in range(size.people)]
    companies = [
        add(Entity("company", f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}", ""))
        for _ in range(size.companies)
    ]
    for p in people + companies:
        p.ref = p.name
    for r in rivers:
        r.links["mouth"] = rng.choice(seas).name
    for i, c in enumerate(cities):
        country = countries[i % len(countries)]  # every country gets cities; the first one is its capital
        c.links["country"] = country.name
        country.links.setdefault("capital", c.name)
        c.links["river"] = rng.choice(rivers).name
    mayors = rng.sample(people, len(cities))  # a person is mayor of at most one city
    for c, m in zip(cities, mayors, strict=True):
        c.links["mayor"] = m.name
    for p in people:
        p.links["birthplace"] = rng.choice(cities).name
        p.links["employer"] = rng.choice(companies).name
        p.attrs["occupation"] = rng.choice(OCCUPATIONS)
    for co in companies:
        co.links["founder"] = rng.choice(people).name
        co.links["headquarters"] = rng.choice(cities).name
        co.attrs["founded"] = str(rng.randint(1820, 2015))
    return KnowledgeBase(ents)


def _sea(word: str, rng: random.Random) -> Entity:
    if rng.random() < 0.5:
        return Entity("sea", f"Sea of {word}", f"the Sea of {word}")
    return Entity("sea", f"{word} Sea", f"the {word} Sea")


def render_document(e: Entity, kb: KnowledgeBase) -> str:
    """The short document of one entity: a few sentences stating its own facts."""
    ref = {k: kb.entities[v].ref for k, v in e.links.items()}
    name = e.ref[0].upper() + e.ref[1:]
    if e.kind == "person":
        return (
            f"{name} is a {e.attrs['occupation']}. {name} was born in {ref['birthplace']}. "
            f"{name} works for {ref['employer']}."
        )
    if e.kind == "company":
        return (
            f"{name} was founded by {ref['founder']}. {name} was founded in {e.attrs['founded']}. "
            f"{name} is based in {ref['headquarters']}."
        )
    if e.kind == "city":
        river = ref["river"][0].upper() + ref["river"][1:]
        return (
            f"{name} is in the country {ref['country']}. {river} flows through {name}. "
            f"The mayor of {name} is {ref['mayor']}."
        )
    if e.kind == "country":
        return f"{name} is a country. The capital of {name} is {ref['capital']}."
    if e.kind == "river":
        return f"{name} flows into {ref['mouth']}."
    return f"{name} is a sea."


@dataclass(frozen=True)
class Question:
    """A multi-hop question, its gold answer and the chain of (entity, relation) hops that reaches it."""

    text: str
    answer: str
    hops: int
    chain: tuple[tuple[str, str], ...]  # ((entity name, relation), ...) in the order they are followed


def follow(kb: KnowledgeBase, start: str, relations: list[str]) -> str:
    """The value reached from entity `start` by following `relations` (an entity name or an attribute)."""
    current = start
    for r in relations:
        e = kb.entities[current]
        current = e.attrs[r] if RELATIONS[r].target == "attr" else e.links[r]
    return current


def make_question(kb: KnowledgeBase, rng: random.Random, hops: int) -> Question | None:
    """A random `hops`-hop question (a random walk over relations), or None if the walk dead-ends or
    revisits an entity (the chain must pass through distinct entities)."""
    start = rng.choice(list(kb.entities.values()))
    current, chain = start, []
    for i in range(hops):
        last = i == hops - 1
        options = [r for r in RELATIONS.values() if r.source == current.kind and (last or r.target != "attr")]
        if not options:
            return None
        rel = rng.choice(options)
        chain.append((current.name, rel.name))
        if rel.target == "attr":
            break
        nxt = kb.entities[current.links[rel.name]]
        if nxt.name in {n for n, _ in chain}:
            return None
        current = nxt
    phrase = start.ref
    for _, r in chain[:-1]:
        phrase = RELATIONS[r].phrase.format(x=phrase)
    text = RELATIONS[chain[-1][1]].question.format(x=phrase)
    answer = follow(kb, start.name, [r for _, r in chain])
    return Question(text[0].upper() + text[1:], answer, len(chain), tuple(chain))


@lru_cache(maxsize=8)
def cached_kb(seed: int) -> KnowledgeBase:
    """`build_kb(seed)`, built once per process."""
    return build_kb(seed)
