"""Synthetic retrieval samples mixed into the align and train data, so that the mixers learn to store and fetch facts.

    documents = mix_retrieval(load_documents(source), RetrievalMix(ratio=0.2, seed=0), seq_len=2048)

A sample is a stretch of the corpus itself (the documents read just before it) with facts inserted at random depths,
then a question about some of them and its answer. Formats: one fact ("single"); several facts with distinct keys,
one asked ("multi"); several asked at once ("multi_query"); a block of key-value lines at one depth, one key looked up
("kv"). Values: digit strings of 3 to 10 digits ("digits"), one corpus word ("word"), dash-separated codes of 2 to 5
groups of 2 to 19 characters, under 40 in all, lowercase alphanumeric or hexadecimal or uppercase ("code",
the long ones as hard to hold as UUIDs), two to four corpus words ("phrase"). Keys are corpus words too, so every run
draws its own.

Nothing here is the evaluation's (convert/evaluate/needles.py): no noise sentences, essay haystack, instructions,
question wording, key lists or value formats of it, so retrieval measured there is not a template learned here. The
wording of facts and questions varies over several phrasings of each; `restated` (off by default) has a share of
one-fact questions restate themselves before the answer ("... The code of Amber is 4821"), as a prompt ending in
an answer's first words asks.

Everything is decided by `random.Random(f"retrieval:{seed}")` and the corpus order: the same seed and data give the
same samples. The ratio is counted in characters (a proxy for tokens): about `ratio` of the mixed text is synthetic.
Samples are `WholeDocument`s of under seq_len tokens, which `pack_documents` keeps inside one row, so that a
question never loses its facts to a row boundary. `length` sets their size as a share of a row, `depth` where
their facts go: `length: [0.7, 0.95], depth: [0, 0.25]` puts the facts in the first quarter of samples of most of
a row (in 8K rows, 4 asked facts in 5 lie over 4K tokens before their question: past a 4K sliding window, so only
a mixer's state can answer).
"""

from __future__ import annotations

import random
import re
import string
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from raven_convert.train.schema import omit_at_default

FORMATS = ("single", "multi", "multi_query", "kv")
VALUE_KINDS = ("digits", "word", "code", "phrase")
CODE_ALPHABETS = (string.ascii_lowercase + string.digits, string.hexdigits[:16], string.ascii_uppercase + string.digits)
CHARS_PER_TOKEN = 3.5  # characters per token assumed without a tokenizer (English text, on the low side)
ESTIMATE_CHARS = 200_000  # corpus characters tokenised to measure the characters per token
WORD = re.compile(r"[A-Za-z]{4,12}")
POOL_SIZE = 5000  # distinct corpus words kept for keys and values
MIN_WORDS = 32  # no sample before the corpus has given this many (a kv block takes up to 24 keys)
LENGTH = (0.125, 0.8)  # a sample's size, as a share of the row: an eighth to 0.8
DEPTH = (0.0, 1.0)  # facts anywhere in the filler
DEFAULTS = {"length": LENGTH, "depth": DEPTH}
RANGES = {"length": (0.01, 0.95), "depth": (0.0, 1.0)}  # a sample leaves room in its row for the question and EOS

FACTS = (
    "The {key} {noun} is {value}.",
    "Remember that the {noun} for {key} is {value}.",
    "Write this down: {key} has {noun} {value}.",
    "Note: {key}'s {noun} = {value}.",
    "For the record, the {noun} of {key} reads {value}.",
)
QUESTIONS = (
    "What is the {noun} of {key}?",
    "Which {noun} was given for {key}?",
    "Recall the {key} {noun}.",
    "Earlier a {noun} was noted for {key}. What was it?",
)
NOUNS = ("code", "value", "number", "label", "entry", "tag")
KV_HEADS = ("Reference table:", "Lookup list (name: value):", "Registry entries:")
KV_QUESTIONS = ("In the table above, {key} maps to what?", "Look up {key} in the list. Its value is")
RESTATED = ("The {noun} of {key} is", "{key}'s {noun} is", "For {key}, the {noun} is", "The {noun} noted for {key} was")


class WholeDocument(str):
    """A document that packing must keep inside one row (see data.pack_documents), ending in `answer_chars`
    characters of answer (" 4821"; 0: none), whose tokens packing marks so a loss can weight them
    (TrainConfig.answer_weight)."""

    answer_chars: int = 0

    def __new__(cls, text: str, answer_chars: int = 0):
        if not 0 <= answer_chars <= len(text):
            raise ValueError(f"answer_chars = {answer_chars} is not allowed; expected 0 to the text's {len(text)}")
        document = super().__new__(cls, text)
        document.answer_chars = answer_chars
        return document


class RetrievalMix(BaseModel):
    """How much synthetic retrieval text to mix in, and of which kinds (recipe field data.retrieval)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    ratio: float = Field(0.2, ge=0, le=0.9, description="share of the mixed text's characters that is synthetic")
    seed: int = 0
    formats: tuple[Literal[FORMATS], ...] = Field(FORMATS, min_length=1, description="drawn from, one per sample")
    values: tuple[Literal[VALUE_KINDS], ...] = Field(
        VALUE_KINDS, min_length=1, description="drawn from, one per sample: a kind listed twice is twice as likely"
    )
    length: tuple[float, float] = Field(LENGTH, description="a sample's size as a share of a row, drawn in this range")
    depth: tuple[float, float] = Field(DEPTH, description="where facts go, as a share of the filler from its start")
    restated: float = Field(
        0.0, ge=0, le=1, description="share of one-fact questions answered after restating them ('The code of X is')"
    )

    @field_validator("length", "depth")
    @classmethod
    def _range(cls, value: tuple[float, float], info) -> tuple[float, float]:
        low, top = RANGES[info.field_name]
        if not low <= value[0] <= value[1] <= top:
            raise ValueError(f"{list(value)} is not a range [low, high] with {low} <= low <= high <= {top}")
        return value

    _dump = omit_at_default("restated")  # the recipes' fingerprints and data caches from before it stay valid

    def cache_fields(self) -> dict:
        """The fields that decide the samples, as the data cache keys them: length and depth only where they differ
        from their defaults, so caches made before they existed stay valid."""
        return self.model_dump(exclude={k for k in ("length", "depth") if getattr(self, k) == DEFAULTS[k]})


def make_value(rng: random.Random, kind: str, words: list[str]) -> str:
    if kind == "digits":
        return str(rng.randrange(10 ** (n := rng.randint(3, 10)) // 10, 10**n))
    if kind == "word":
        return rng.choice(words).lower()
    if kind == "code":
        chars, groups = rng.choice(CODE_ALPHABETS), rng.randint(2, 5)
        return "-".join("".join(rng.choices(chars, k=rng.randint(2, 40 // groups - 1))) for _ in range(groups))
    return " ".join(w.lower() for w in rng.sample(words, rng.randint(2, 4)))


def insert_at_depths(rng: random.Random, filler: str, pieces: list[str], depth: tuple[float, float] = DEPTH) -> str:
    """filler with each piece inserted at its own random depth within `depth` (shares of the filler from its start),
    at a word boundary."""
    low, high = int(depth[0] * len(filler)), int(depth[1] * len(filler))
    cuts = sorted(rng.randint(low, high) for _ in pieces)
    cuts = [filler.rfind(" ", 0, c) + 1 if c < len(filler) else c for c in cuts]  # back to a word start
    out, last = [], 0
    for cut, piece in zip(cuts, pieces):
        out += [filler[last:cut], piece, " "]
        last = cut
    out.append(filler[last:])
    return "".join(out)


def build_sample(
    rng: random.Random,
    fmt: str,
    kind: str,
    words: list[str],
    filler: str,
    max_facts: int = 24,
    depth: tuple[float, float] = DEPTH,
    restated: float = 0.0,
) -> tuple[WholeDocument, list[str]]:
    """One sample, filler with facts inserted (within `depth`, see insert_at_depths) then the question and its
    answer (its `answer_chars`: a space and the answer), and the values it answers with. At most `max_facts` facts
    (at least 2 where the format asks about several). A one-fact question ("single", "multi") is restated before
    its answer with probability `restated`."""
    noun = rng.choice(NOUNS)
    count = {"single": 1, "multi": rng.randint(2, 6), "multi_query": rng.randint(2, 6), "kv": rng.randint(6, 24)}[fmt]
    count = min(count, max(max_facts, 1 if fmt == "single" else 2))
    keys = [k.capitalize() for k in rng.sample(words, count)]
    values = [make_value(rng, kind, words) for _ in keys]
    if fmt == "multi_query":
        asked = sorted(rng.sample(range(count), rng.randint(2, count)))
    else:
        asked = [rng.randrange(count)]
    if fmt == "kv":
        block = rng.choice(KV_HEADS) + "\n" + "\n".join(f"{k}: {v}" for k, v in zip(keys, values)) + "\n"
        text = insert_at_depths(rng, filler, [block], depth)
        i = asked[0]
        return _answered(f"{text}\n\n{rng.choice(KV_QUESTIONS).format(key=keys[i])}", values[i]), [values[i]]
    facts = [rng.choice(FACTS).format(key=k, noun=noun, value=v) for k, v in zip(keys, values)]
    text = insert_at_depths(rng, filler, facts, depth)
    if fmt == "multi_query":
        names = ", ".join(keys[i] for i in asked[:-1]) + f" and {keys[asked[-1]]}"
        answer = "; ".join(f"{keys[i]}: {values[i]}" for i in asked)
        return _answered(f"{text}\n\nGive the {noun} of {names}.", answer), [values[i] for i in asked]
    i = asked[0]
    question = rng.choice(QUESTIONS).format(key=keys[i], noun=noun)
    if restated and rng.random() < restated:  # as a prompt ending "... is" asks; no draw at 0 (same samples)
        question += " " + rng.choice(RESTATED).format(key=keys[i], noun=noun)
    return _answered(f"{text}\n\n{question}", values[i]), [values[i]]


def _answered(prompt: str, answer: str) -> WholeDocument:
    """prompt, a space and answer, as one sample whose answer is the space and answer."""
    return WholeDocument(f"{prompt} {answer}", answer_chars=len(answer) + 1)


def mix_retrieval(
    texts: Iterable[str], mix: RetrievalMix, seq_len: int, count_tokens: Callable[[str], int] | None = None
) -> Iterator[str]:
    """The documents of `texts` in order, with a synthetic sample (a WholeDocument) after a document whenever the
    synthetic share of the characters so far falls below mix.ratio. A sample's filler is cut from the documents
    read before it, for a sample of mix.length's share of a row (an eighth to 0.8 by default), its facts within
    mix.depth of the filler. With `count_tokens` (the tokenizer's length of a
    text) the characters per token are measured on the first ESTIMATE_CHARS of the corpus, and a sample that still
    comes out longer than seq_len tokens is rebuilt shorter; without it CHARS_PER_TOKEN is assumed."""
    if mix.ratio == 0:
        yield from texts
        return
    rng = random.Random(f"retrieval:{mix.seed}")
    seen: dict[str, None] = {}  # corpus words in order of first use, at most POOL_SIZE
    recent: deque[str] = deque()  # the latest documents' text, for filler
    recent_chars = real = synthetic = 0
    measured = [0, 0]  # characters and tokens of the corpus measured so far
    for text in texts:
        yield text
        real += len(text)
        if count_tokens is not None and measured[0] < ESTIMATE_CHARS:
            measured[0] += len(text)
            measured[1] += count_tokens(text)
        chars_per_token = measured[0] / measured[1] if measured[1] else CHARS_PER_TOKEN
        recent.append(text)
        recent_chars += len(text)
        while recent_chars - len(recent[0]) > 2 * seq_len * chars_per_token:
            recent_chars -= len(recent.popleft())
        if len(seen) < POOL_SIZE:
            seen.update(dict.fromkeys(w for w in WORD.findall(text)[: POOL_SIZE - len(seen)]))
        while synthetic < mix.ratio * (real + synthetic) and len(seen) >= MIN_WORDS:
            corpus = " ".join(" ".join(recent).split())
            fmt, kind = rng.choice(mix.formats), rng.choice(mix.values)
            share = rng.randint(int(mix.length[0] * seq_len), int(mix.length[1] * seq_len))
            size, facts = int(share * chars_per_token), 24
            for _ in range(6):
                size = min(len(corpus), size)
                start = rng.randint(0, len(corpus) - size)
                filler = corpus[start : start + size]
                sample, _ = build_sample(rng, fmt, kind, list(seen), filler, facts, mix.depth, mix.restated)
                tokens = 0 if count_tokens is None else count_tokens(sample)
                if tokens < seq_len:  # packing adds the EOS
                    break
                size, facts = int(size * 0.5 * seq_len / tokens), facts // 2  # the facts alone may not fit
            synthetic += len(sample)  # counted even if still too long, so the loop ends; packing drops it
            yield sample
