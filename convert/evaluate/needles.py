"""Retrieval prompts: passkey, RULER's needle-in-a-haystack tasks and SILA's NIAH-Word, sized in tokens.

Prompt sizing. A sample of length L holds exactly what the model reads: L is counted in tokens of the given tokenizer
over the whole prompt (instruction, haystack, needles, question, answer prefix, chat markup), tokenised as
`run_retrieval` tokenises it. The haystack text is tokenised once per sample (with character offsets); a candidate
haystack of B tokens is the text up to the end of its B-th token, the needles are inserted, the prompt is tokenised
once, and B is corrected by the miss (L - n). Tokens nearly add up across the cut, so this settles in one to three
rounds, at most a few tokens off (a token or two when whitespace at the cut is trimmed).

Needle placement. Depth d is the fraction of haystack tokens before the needle (0 = start, 1 = end). The target
token round(d * B) is moved to the nearest sentence start within 2.5% of the haystack (else the nearest word start);
the depth actually reached is measured on the final prompt (`meta["depth_actual"]`), and so is how many tokens
back the nearest needle holding an answer ends (`meta["needle_distance"]`: 1 at the prompt's last token; every
answer of a prompt whose distance exceeds W lies outside a W-token attention window). Tasks with several needles
put the first one (the one asked about, or the first value) at the requested depth and the others at depths drawn
from the sample's RNG.

Haystacks. Noise tasks (passkey, niah_single_1) repeat RULER's five sentences. Essay tasks read every `*.txt` in
`haystack_dir` (Paul Graham's essays), split them into paragraphs and, following SILA Section 3.2, shuffle the
paragraphs afresh for every sample. "TASK@NAME" is an essay task with its essays replaced by the named haystack, any
folder of `*.txt` (`haystacks={NAME: folder}`), with the same needles at the same depths as TASK. A text haystack
must hold at least the longest prompt's tokens, so that no prompt repeats its text. All randomness comes from
string-seeded `random.Random`s: the same seed gives the same prompts, and the paragraph order of a sample depends on
(seed, length, depth, index) only, so tasks and variants built with one seed read the same text, each cut to its own
size (paired comparisons, as SILA's NIAH-2 vs NIAH-Word). Depths 0 and 1 are exact: before the first and after the
last haystack token.

Variants (SILA Appendix C.1): "standard" states the kind of value before the context (RULER); "no_inst" gives no
instruction before the context, only the question after it; "strong_inst" names the key (or the pass key) before the
context, so a model may skip what does not match.

Chat templates. With a template (`chat_template=None` uses the tokenizer's when it has one) the instruction, context
and question are the user message, rendered with `add_generation_prompt=True` (and `enable_thinking=False`, which
templates without thinking ignore), and the answer prefix ("The pass key is") is prefilled as the start of the
assistant's reply, as RULER does, so that both base and chat models answer with the value at once
(`prefill_answer=False` leaves the reply to the model). Chat prompts are tokenised without extra special tokens
(the template writes its own); plain prompts end "<question> <answer prefix>" and are tokenised with them.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from raven_layers.common import did_you_mean

HAYSTACK_ENV = "RAVEN_HAYSTACK_DIR"
BUILT_IN_HAYSTACKS = ("noise", "essay")  # TaskSpec.haystack; named haystacks take other names
VARIANTS = ("standard", "no_inst", "strong_inst")
MIN_HAYSTACK_TOKENS = 32  # below this a depth means little: lengths must leave at least this much haystack
SNAP_FRACTION = 0.025  # a needle moves at most this fraction of the haystack to reach a sentence start

# RULER's noise haystack (niah_single_1), also the passkey filler of Mohtashami & Jaggi (2023)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_STRONG_INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key there."
)

# Keys are adjective-noun pairs (RULER's "tested-formal"); NIAH-Word values are two-word phrases of VALUE_WORDS.
ADJECTIVES = """able active bitter blue bold brave bright broad busy calm careful cheap clean clever cold cool
curious dark deep dry eager early easy empty fair fancy fast fierce flat fresh friendly full gentle giant glad golden
grand great green happy heavy high honest huge humble kind large late lazy light little lively long loud lucky mild
modern narrow neat new nice noble odd old pale plain polite poor proud quick quiet rapid rare rich rough round royal
sharp short shy silent silver simple slow small smart smooth soft solid sour spare steady steep strange strict strong
sweet swift tall tame tender thick thin tidy tiny tough usual vast warm weak wet whole wide wild wise young""".split()
NOUNS = """acorn anchor apple arrow autumn badge bakery banana barn basket beach beacon bell bicycle blanket bottle
branch bread breeze brick bridge bucket butter button cabin cactus camera candle canoe canvas carpet castle cedar
chair cherry chimney circle cliff clock cloud coast coffee comet copper cotton county crystal cupboard curtain
daisy desert diamond dolphin door dragon drum eagle engine falcon feather fence field finger flag flame forest
fountain fox garden garlic glacier glove goat guitar hammer harbor harvest helmet hill honey horizon island jacket
jungle kettle kitchen ladder lake lantern lemon letter library lighthouse lily lion marble market meadow mirror
mountain needle ocean olive onion orange orchard owl paddle palace panther paper parrot pebble pencil pepper piano
pillow pine planet pocket pond potato puzzle quarry rabbit radio rainbow river rocket saddle sail salmon sandal
scarf shadow shell shelter shovel signal silk sketch sparrow spider spoon squirrel stable stone storm stream sugar
summer sunset swan table teapot temple thunder ticket tiger timber tower tractor trumpet tunnel turtle valley
velvet village violin wagon walnut window winter wizard wolf yacht""".split()
KEY_NOUNS, VALUE_WORDS = NOUNS[::2], NOUNS[1::2]  # disjoint: a key never shares a word with a value


@dataclass
class Sample:
    """One retrieval prompt and the values a correct answer contains."""

    task: str
    prompt: str  # exactly what the model reads (chat markup and answer prefix included)
    answers: list[str]  # all must appear in the prediction for a score of 1
    length: int  # target prompt length in tokens (meta["n_tokens"] is the length reached)
    depth: float  # requested needle depth, 0..1 of the haystack
    variant: str = "standard"
    meta: dict = field(default_factory=dict)  # ids, n_tokens, needle spans, depth_actual, chat, answer_prefix, ...


@dataclass(frozen=True)
class TaskSpec:
    """A task as data: which haystack, what the needle values are, how many keys and values."""

    name: str
    haystack: str  # one of BUILT_IN_HAYSTACKS
    value_kind: str  # "passkey" (5 digits) | "number" (7 digits) | "uuid" | "phrase" (two English words)
    num_keys: int = 1  # keys in the haystack; the first num_queries are asked about, the others distract
    num_values: int = 1  # values of each asked key; all must be returned
    num_queries: int = 1  # keys asked about in one question (RULER's multi-query)
    description: str = ""

    @property
    def num_answers(self) -> int:
        return self.num_queries * self.num_values

    def make_needles(self, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
        """(the asked keys as the question names them, [(key, value)] with the asked keys' num_answers values
        first); the passkey has the key ""."""
        if self.value_kind == "passkey":
            return "", [("", str(rng.randint(10000, 99999)))]
        keys: list[str] = []
        while len(keys) < self.num_keys:
            key = f"{rng.choice(ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"
            keys += [key] if key not in keys else []
        values: list[str] = []
        while len(values) < self.num_answers + self.num_keys - self.num_queries:
            value = self._value(rng)
            values += [value] if value not in values else []
        asked = keys[: self.num_queries]
        pairs = [(k, values[i * self.num_values + j]) for i, k in enumerate(asked) for j in range(self.num_values)]
        pairs += list(zip(keys[self.num_queries :], values[self.num_answers :]))
        names = asked[0] if len(asked) == 1 else f"{', '.join(asked[:-1])} and {asked[-1]}"
        return names, pairs

    def _value(self, rng: random.Random) -> str:
        if self.value_kind == "number":
            return str(rng.randint(1_000_000, 9_999_999))
        if self.value_kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return " ".join(rng.sample(VALUE_WORDS, 2))

    @property
    def noun(self) -> str:  # what the value is called in the prompt
        return {"number": "number", "uuid": "uuid", "phrase": "phrase"}.get(self.value_kind, "pass key")

    def needle(self, key: str, value: str) -> str:
        if self.value_kind == "passkey":
            return f"The pass key is {value}. Remember it. {value} is the pass key."
        return f"One of the special magic {self.noun}s for {key} is: {value}."

    def texts(self, variant: str, key: str) -> tuple[str | None, str, str]:
        """(instruction before the context or None, question after it, answer prefix)."""
        if self.value_kind == "passkey":
            inst = PASSKEY_STRONG_INSTRUCTION if variant == "strong_inst" else PASSKEY_INSTRUCTION
            return (None if variant == "no_inst" else inst), "What is the pass key?", "The pass key is"
        t, about = self.noun, f" for {key}" if variant == "strong_inst" else ""
        if self.num_keys == self.num_values == self.num_answers == 1:  # SILA Appendix C.1, word for word
            inst = f"A special magic {t} is hidden within the following text. Make sure to memorize it. "
            inst += f"I will quiz you about the {t}{about} afterwards."
        else:  # RULER's plural form: several needles are hidden
            inst = f"Some special magic {t}s are hidden within the following text. Make sure to memorize them. "
            inst += f"I will quiz you about the {t}{'s' if self.num_answers > 1 else ''}{about} afterwards."
        if self.num_answers > 1:
            question = f"What are all the special magic {t}s for {key} mentioned in the provided text?"
            prefix = f"The special magic {t}s for {key} mentioned in the provided text are"
        else:
            question = f"What is the special magic {t} for {key} mentioned in the provided text?"
            prefix = f"The special magic {t} for {key} mentioned in the provided text is"
        return (None if variant == "no_inst" else inst), question, prefix


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec("passkey", "noise", "passkey", description="Mohtashami & Jaggi's pass key in repeated noise"),
        TaskSpec("niah_single_1", "noise", "number", description="RULER: 7-digit number in repeated noise"),
        TaskSpec("niah_single_2", "essay", "number", description="RULER: 7-digit number in essays"),
        TaskSpec("niah_single_3", "essay", "uuid", description="RULER: UUID in essays"),
        TaskSpec("niah_multikey", "essay", "number", num_keys=4, description="RULER: 4 keys, one asked"),
        TaskSpec("niah_multivalue", "essay", "number", num_values=4, description="RULER: one key, 4 values"),
        TaskSpec(
            "niah_multiquery", "essay", "number", num_keys=4, num_queries=4, description="RULER: 4 keys, all asked"
        ),
        TaskSpec(
            "niah_multikey_word",
            "essay",
            "phrase",
            num_keys=4,
            description="4 keys with English-phrase values, one asked",
        ),
        TaskSpec("niah_word", "essay", "phrase", description="SILA NIAH-Word: an English phrase in essays"),
    ]
}


def split_task(task: str, haystacks: Collection[str] | None = None) -> tuple[TaskSpec, str | None]:
    """A task string, TASK or TASK@NAME -> (TASK's spec, NAME or None); a ValueError names the bad part and the
    allowed ones. `haystacks`: the names @NAME may take (None: any, checked where the names are known)."""
    name, at, haystack = task.partition("@")
    if name not in TASKS:
        raise ValueError(f"unknown task {task!r}; {did_you_mean(name, TASKS)}allowed: {', '.join(TASKS)}")
    if at and TASKS[name].haystack == "noise":
        texts = [t.name for t in TASKS.values() if t.haystack != "noise"]
        raise ValueError(
            f"task {task!r}: {name} hides its needles in repeated noise, not in a text haystack; @NAME applies to "
            f"the essay tasks: {', '.join(texts)}"
        )
    if at and haystacks is not None and haystack not in haystacks:
        defined = ", ".join(haystacks) or "none"
        raise ValueError(
            f"task {task!r}: no haystack named {haystack!r}; {did_you_mean(haystack, haystacks)}defined: {defined} "
            "(haystacks: NAME -> folder of *.txt)"
        )
    return TASKS[name], haystack or None


def essay_folder(
    task: str, haystack_dir: str | Path | None, haystacks: dict[str, str | Path] | None = None
) -> tuple[str | Path, str] | None:
    """(folder, what names it) of the haystack an essay task hides its needles in: its @NAME's, else haystack_dir,
    else $RAVEN_HAYSTACK_DIR; None for a task on repeated noise. ValueError where an essay task has none."""
    spec, named = split_task(task, haystacks or {})
    if spec.haystack == "noise":
        return None
    if named:
        return haystacks[named], f"haystack {named!r}"
    if haystack_dir:
        return haystack_dir, "haystack_dir"
    if os.environ.get(HAYSTACK_ENV):
        return os.environ[HAYSTACK_ENV], f"${HAYSTACK_ENV}"
    raise ValueError(
        f"task {task!r} needs an essay haystack: pass haystack_dir=DIR or set ${HAYSTACK_ENV} to a folder of "
        f"*.txt files (RULER's Paul Graham essays, e.g. ../shared/data/pg_essays)"
    )


def haystack_files(folder: str | Path, what: str = "haystack_dir") -> list[Path]:
    """The *.txt files of a haystack folder, sorted; FileNotFoundError naming `what` (the field or flag) if none."""
    if not Path(folder).expanduser().is_dir():
        raise FileNotFoundError(f"{what} {folder}: no such directory")
    files = sorted(Path(folder).expanduser().glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{what} {folder}: no *.txt files in it")
    return files


def load_essay_paragraphs(haystack_dir: str | Path, what: str = "haystack_dir") -> list[str]:
    """Paragraphs of every *.txt file in the folder, hard line wraps undone.

    RULER's copy of the essays lost most paragraph breaks ("accelerating.We wouldn't"): a sentence end, footnote
    mark ("[1]No one") or date line ("July 2010What") glued to a capital letter is taken as a paragraph break too.
    Other texts (papers with equations, tables and numbers) rarely match these and keep their own paragraphs.
    """
    paragraphs = []
    for file in haystack_files(haystack_dir, what):
        text = file.read_text(encoding="utf-8", errors="replace")
        text = re.sub(r"Want to start a startup\?\s*Get funded by\s*Y Combinator\.", "\n\n", text)
        text = re.sub(r"([a-z][.!?][\"')]?|\]|\b(?:%s) \d{4})(?=[A-Z\[])" % _MONTHS, "\\1\n\n", text)
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if len(block) > 1:
                paragraphs.append(block)
    return paragraphs


_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"


@dataclass
class _Haystack:
    """Haystack text with its token offsets and the places where a needle may go."""

    text: str
    starts: list[int]  # [n_tokens] character where each token starts
    ends: list[int]  # [n_tokens] character where each token ends
    sentence_tokens: list[int]  # sorted token indices at which a sentence starts
    sentence_chars: list[int]  # the characters they start at
    word_tokens: list[int]
    word_chars: list[int]

    @classmethod
    def build(cls, tokenizer, text: str) -> "_Haystack":
        spans = _offsets(tokenizer, text) or [(0, 0)]
        hay = cls(text, [s for s, _ in spans], [e for _, e in spans], [], [], [], [])
        for pattern, toks, chars in [
            (r"(?:^|[.!?][\"')\]]?\s+|\n\s*)(?=\S)", hay.sentence_tokens, hay.sentence_chars),
            (r"(?:^|\s)(?=\S)", hay.word_tokens, hay.word_chars),
        ]:
            for m in re.finditer(pattern, text):
                tok = bisect.bisect_right(hay.starts, m.end()) - 1  # token holding the boundary character
                if not toks or tok > toks[-1]:
                    toks.append(max(tok, 0))
                    chars.append(m.end())
        return hay

    def __len__(self) -> int:
        return len(self.starts)

    def place(self, target: int, budget: int) -> int:
        """Character at which a needle aimed at token `target` of a `budget`-token haystack goes."""
        if target >= budget:  # depth 1: after the last haystack token
            return self.ends[budget - 1]
        window = max(2, round(SNAP_FRACTION * budget))
        for toks, chars in [(self.sentence_tokens, self.sentence_chars), (self.word_tokens, self.word_chars)]:
            i = bisect.bisect_left(toks, target)
            near = [j for j in (i - 1, i) if 0 <= j < len(toks) and toks[j] < budget]
            best = min(near, key=lambda j: abs(toks[j] - target), default=None)
            if best is not None and abs(toks[best] - target) <= window:
                return chars[best]
        return self.starts[target]


def _offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character span of every token of `text` (no special tokens)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [tuple(span) for span in enc["offset_mapping"]]
    spans = []  # slow tokenizers: tokenise word by word, each token spanning its word (approximate)
    words = list(re.finditer(r"\S+\s*|\s+", text))
    ids = tokenizer([m.group() for m in words], add_special_tokens=False, verbose=False)["input_ids"]
    for m, word_ids in zip(words, ids):
        spans += [(m.start(), m.end())] * len(word_ids)
    return spans


def _essay_haystack(tokenizer, paragraphs: list[str], rng: random.Random, n_tokens: int, chars_per_token: float):
    """A fresh haystack of at least `n_tokens` tokens: the paragraphs in an order drawn from `rng`."""
    text, pool = "", []
    want_chars = int(n_tokens * chars_per_token * 1.2) + 200
    while True:
        while len(text) < want_chars:
            if not pool:
                pool = rng.sample(paragraphs, len(paragraphs))  # a new permutation whenever one runs out
            text += ("\n\n" if text else "") + pool.pop()
        hay = _Haystack.build(tokenizer, text)
        if len(hay) >= n_tokens:
            return hay
        want_chars = int(len(text) * 1.3 * n_tokens / max(len(hay), 1)) + 200


def _check_size(tokenizer, paragraphs: list[str], length: int, what: str) -> None:
    """Refuse a haystack holding fewer tokens than the longest prompt: its text would repeat within a prompt."""
    n, chunk = 0, 64
    for start in range(0, len(paragraphs), chunk):  # counted until enough: a large haystack costs one prompt
        n += count_tokens(tokenizer, "\n\n".join(paragraphs[start : start + chunk]), False)
        if n >= length:
            return
    raise ValueError(
        f"{what} holds {n:,} tokens of text, fewer than the longest length asked, {length:,}: add *.txt files to it "
        "or ask shorter lengths"
    )


def count_tokens(tokenizer, text: str, add_special_tokens: bool) -> int:
    return len(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def _assemble(spec, variant, tokenizer, chat, prefill, hay: _Haystack, budget, depths, needles, key):
    """Prompt text with a `budget`-token haystack, plus the character spans of context and needles in it."""
    cut = hay.ends[budget - 1] if budget > 0 else 0
    places = [hay.place(round(d * budget), budget) if budget > 0 else 0 for d in depths]
    context, spans, last = "", [], 0
    for n, (place, (k, v)) in sorted(enumerate(zip(places, needles)), key=lambda x: (x[1][0], x[0])):
        before = hay.text[last:place]
        context += before + (" " if before and not before[-1].isspace() else "")
        spans.append((n, len(context)))
        context += spec.needle(k, v) + " "
        last = place
    context = (context + hay.text[last:cut]).strip()
    inst, question, prefix = spec.texts(variant, key)
    head = f"{inst}\n" if inst else ""
    body = f"{head}{context}\n{question}"
    if chat:
        messages = [{"role": "user", "content": body}]
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        shift = prompt.find(body)
        if shift < 0:
            raise ValueError("the chat template rewrote the user message; cannot locate the needles in the prompt")
        prompt += prefix if prefill else ""
    else:
        prompt, shift = f"{body} {prefix}", 0
    shift += len(head)
    needle_spans = [None] * len(needles)
    for n, start in spans:
        needle_spans[n] = (shift + start, shift + start + len(spec.needle(*needles[n])))
    return prompt, (shift, shift + len(context)), needle_spans


def _token_index(tokenizer, prompt: str, add_special_tokens: bool, chars: list[int]) -> list[int]:
    """Index of the token holding each character of `chars` in the tokenised prompt."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(prompt, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
        starts = [s if e > s else math.inf for s, e in enc["offset_mapping"]]  # special tokens hold no text
        starts = [s if s != math.inf else (starts[i - 1] if i else -1) for i, s in enumerate(starts)]
        return [bisect.bisect_right(starts, c) - 1 for c in chars]
    return [count_tokens(tokenizer, prompt[:c], add_special_tokens) for c in chars]


def _make_sample(task, spec, variant, tokenizer, chat, prefill, length, depth, index, seed, hay_source) -> Sample:
    add_special = not chat
    needle_rng = random.Random(f"needles:{seed}:{spec.name}:{length}:{depth!r}:{index}")
    key, needles = spec.make_needles(needle_rng)
    depths = [depth] + [needle_rng.random() for _ in needles[1:]]

    def build(hay, budget):
        return _assemble(spec, variant, tokenizer, chat, prefill, hay, budget, depths, needles, key)

    empty = count_tokens(tokenizer, build(_Haystack("", [0], [0], [], [], [], []), 0)[0], add_special)
    if length - empty < MIN_HAYSTACK_TOKENS:
        raise ValueError(
            f"length {length} is too short for task {task!r} ({variant}) with this tokenizer: instruction, "
            f"needles and question take {empty} tokens; use lengths of at least {empty + MIN_HAYSTACK_TOKENS}"
        )
    hay = hay_source(length, depth, index)  # [>= length tokens]
    best, tried = None, set()

    def attempt(budget):
        nonlocal best
        budget = min(max(budget, 1), len(hay))
        if budget not in tried:
            tried.add(budget)
            prompt, ctx, needle_spans = build(hay, budget)
            n = count_tokens(tokenizer, prompt, add_special)
            if best is None or abs(n - length) < abs(best[0] - length):
                best = (n, budget, prompt, ctx, needle_spans)
        return best[0] == length

    budget = length - empty
    for _ in range(6):  # correct the haystack size by the miss: converges in a few rounds
        if attempt(budget):
            break
        budget = best[1] + length - best[0]
    for step in (1, -1, 2, -2, 3, -3):  # the miss may oscillate where a needle hops between sentence starts
        if best[0] == length or attempt(best[1] + step):
            break
    n, budget, prompt, ctx, needle_spans = best
    # first and last character of the context and of every needle -> the tokens holding them
    chars = [ctx[0], ctx[1] - 1] + [c for s, e in needle_spans for c in (s, e - 1)]
    edges = _token_index(tokenizer, prompt, add_special, chars)
    tok_spans = [(edges[i], edges[i + 1] + 1) for i in range(2, len(edges), 2)]  # [start, end) per needle
    hay_tokens = (edges[1] + 1 - edges[0]) - sum(e - s for s, e in tok_spans)
    needle_meta = []
    for (k, v), (cs, ce), (ts, te) in zip(needles, needle_spans, tok_spans):
        before = ts - edges[0] - sum(e - s for s, e in tok_spans if e <= ts)  # haystack tokens before it
        needle_meta.append(
            dict(key=k, value=v, char_span=[cs, ce], token_span=[ts, te], depth=round(before / max(hay_tokens, 1), 4))
        )
    meta = dict(id=f"{task}/{variant}/{length}/{depth:g}/{index}", seed=seed, index=index, n_tokens=n, key=key)
    meta |= dict(chat=chat, add_special_tokens=add_special, prefilled=prefill or not chat)
    meta |= dict(answer_prefix=spec.texts(variant, key)[2], needle_token_span=tok_spans[0])
    meta |= dict(depth_actual=needle_meta[0]["depth"], haystack_tokens=hay_tokens, context_char_span=list(ctx))
    meta["needles"] = needle_meta
    # how far back the nearest answer lies: 1 when a needle ends at the prompt's last token
    meta["needle_distance"] = min(n - end + 1 for _, end in tok_spans[: spec.num_answers])
    return Sample(
        task=task,
        prompt=prompt,
        answers=[v for _, v in needles[: spec.num_answers]],
        length=length,
        depth=depth,
        variant=variant,
        meta=meta,
    )


def build_samples(
    task: str,
    tokenizer,
    lengths,
    depths,
    samples_per_cell: int,
    seed: int,
    variant: str = "standard",
    haystack_dir: str | Path | None = None,
    chat_template: bool | None = None,
    prefill_answer: bool = True,
    haystacks: dict[str, str | Path] | None = None,
) -> list[Sample]:
    """Samples for every (length, depth) cell, `samples_per_cell` each, in length-depth-index order.

    task: a name of TASKS, or "TASK@NAME" for an essay task on the haystack `haystacks[NAME]` (a folder of *.txt).
    lengths: prompt lengths in tokens of `tokenizer`; depths: needle depths in [0, 1]. `haystack_dir` (essay tasks
    only) defaults to $RAVEN_HAYSTACK_DIR. `chat_template`: True wraps prompts in the tokenizer's chat template, False
    never does, None does when the tokenizer has one. See the module docstring for sizing, depths and prefilling.
    """
    haystacks = haystacks or {}
    spec, named = split_task(task, haystacks)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)}")
    lengths, depths = [int(x) for x in lengths], [float(d) for d in depths]
    if not lengths or not depths or samples_per_cell < 1:
        raise ValueError("need at least one length, one depth and samples_per_cell >= 1")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {depths}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    chat = has_template if chat_template is None else bool(chat_template)

    if spec.haystack == "noise":  # one haystack for all samples: only the needles differ
        n_max = max(lengths) + 64
        reps = n_max // max(count_tokens(tokenizer, NOISE, False), 1) + 2
        noise = _Haystack.build(tokenizer, " ".join([NOISE] * reps))

        def hay_source(length, depth, index):
            return noise
    else:
        folder, what = essay_folder(task, haystack_dir, haystacks)
        paragraphs = load_essay_paragraphs(folder, what)
        _check_size(tokenizer, paragraphs, max(lengths), f"{what} ({folder})")
        probe = "\n\n".join(paragraphs)[:20000]
        chars_per_token = len(probe) / max(count_tokens(tokenizer, probe, False), 1)

        def hay_source(length, depth, index):  # sample-level shuffling (SILA 3.2)
            rng = random.Random(f"haystack:{seed}:{length}:{depth!r}:{index}")
            return _essay_haystack(tokenizer, paragraphs, rng, length + 64, chars_per_token)

    return [
        _make_sample(task, spec, variant, tokenizer, chat, prefill_answer, length, depth, i, seed, hay_source)
        for length in sorted(lengths)
        for depth in depths
        for i in range(samples_per_cell)
    ]
