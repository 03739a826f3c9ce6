"""Synthetic retrieval samples: deterministic, mixed at the asked ratio, each answer stated before its question, none of
the evaluation's wording, and packed so that a sample never crosses a row boundary."""

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from raven_convert.evaluate import needles
from raven_convert.train.data import build_dataset, cache_key, pack_documents
from raven_convert.train.recipe import DataSettings, apply_overrides, parse_recipe
from raven_convert.train.retrieval_data import (
    FORMATS,
    RESTATED,
    VALUE_KINDS,
    RetrievalMix,
    WholeDocument,
    build_sample,
    make_value,
    mix_retrieval,
)
from tests.conftest import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]


def documents(n=300, seed=0):
    rng = random.Random(seed)
    words = [f"{a}{b}word" for a in "abcdefghij" for b in "klmnopqrst"]
    return [" ".join(rng.choices(words, k=rng.randint(20, 200))) + "." for _ in range(n)]


def test_same_seed_same_samples_and_the_ratio_holds():
    mixed = list(mix_retrieval(documents(), RetrievalMix(ratio=0.25, seed=3), seq_len=512))
    assert mixed == list(mix_retrieval(documents(), RetrievalMix(ratio=0.25, seed=3), seq_len=512))
    assert mixed != list(mix_retrieval(documents(), RetrievalMix(ratio=0.25, seed=4), seq_len=512))
    synthetic = sum(len(d) for d in mixed if isinstance(d, WholeDocument))
    assert abs(synthetic / sum(map(len, mixed)) - 0.25) < 0.03
    assert [d for d in mixed if not isinstance(d, WholeDocument)] == documents()  # the corpus, in order
    assert list(mix_retrieval(documents(), RetrievalMix(ratio=0), seq_len=512)) == documents()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", VALUE_KINDS)
def test_every_answer_is_stated_before_its_question(fmt, kind):
    rng = random.Random(f"{fmt}{kind}")
    words = [f"w{i}ord" for i in range(40)]
    filler = " ".join(rng.choices(["alpha", "beta", "gamma."], k=300))
    sample, answers = build_sample(rng, fmt, kind, words, filler)
    context, question = sample.rsplit("\n\n", 1)
    assert answers and question.endswith(answers[-1])
    assert len(answers) >= 2 if fmt == "multi_query" else len(answers) == 1
    for value in answers:
        assert value in context and value in question


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_samples_answer_is_its_last_characters(fmt):
    rng = random.Random(fmt)
    words = [f"w{i}ord" for i in range(40)]
    for kind in VALUE_KINDS:
        filler = " ".join(rng.choices(["alpha", "beta", "gamma."], k=300))
        sample, answers = build_sample(rng, fmt, kind, words, filler)
        answer = sample[len(sample) - sample.answer_chars :]
        assert (
            answer == " " + answers[0]
            if fmt != "multi_query"
            else answer == " " + "; ".join(f"{key}: {value}" for key, value in re.findall(r"(\w+): ([^;]+)", answer))
        )
        assert all(value in answer for value in answers) and "?" not in answer
    with pytest.raises(ValueError, match="answer_chars = 9 is not allowed; expected 0 to the text's 4"):
        WholeDocument("abcd", answer_chars=9)


def test_packing_marks_each_samples_answer_tokens():
    docs = documents(200)
    tok = Tokenizer(models.BPE())  # byte-level BPE: its tokens part at spaces, as real ones do
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, special_tokens=["</s>"])
    tok.train_from_iterator(docs, bpe)
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    mixed = list(mix_retrieval(docs, RetrievalMix(ratio=0.5, seed=1), 256, lambda t: len(tok(t)["input_ids"])))
    packed = pack_documents(tok, mixed + documents(30, seed=1), seq_len=256)  # plain text last: no sample left out
    ids, answers = packed["input_ids"], packed["answers"]
    found = []
    for row, marks in zip(ids, answers):
        edges = torch.diff(marks.int(), prepend=torch.zeros(1), append=torch.zeros(1)).tolist()
        starts, ends = [i for i, e in enumerate(edges) if e == 1], [i for i, e in enumerate(edges) if e == -1]
        for start, end in zip(starts, ends):
            assert row[end] == tok.eos_token_id  # an answer ends its sample
            found.append(tok.decode(row[start:end]))
    expected = [d[len(d) - d.answer_chars :] for d in mixed if isinstance(d, WholeDocument)]
    left = Counter(expected)
    left.subtract(found)
    assert len(found) > 20 and min(left.values()) >= 0 and left.total() == 0  # each sample's answer, once
    tiny = tiny_tokenizer()  # one that waits for the next row keeps its marks
    waiting = pack_documents(tiny, ["a" * 5, WholeDocument("bbb dd", answer_chars=3), "c" * 13], seq_len=8)
    assert [tiny.decode(r[m]) for r, m in zip(waiting["input_ids"], waiting["answers"]) if m.any()] == [" dd"]


def test_a_kind_listed_twice_is_drawn_twice_as_often():
    def answers(values: tuple[str, ...]) -> list[str]:
        mix = RetrievalMix(ratio=0.5, formats=("single",), values=values)
        samples = [d for d in mix_retrieval(documents(), mix, seq_len=256) if isinstance(d, WholeDocument)]
        return [sample.rsplit(" ", 1)[1] for sample in samples]  # a single fact's question ends with its value

    for values, share in ((("code", "digits"), 0.5), (("code", "code", "code", "digits"), 0.75)):
        found = answers(values)
        assert abs(sum("-" in a for a in found) / len(found) - share) < 0.1, (values, len(found))


def test_values_have_their_kinds_shape():
    rng, words = random.Random(0), ["Apple", "Stone", "River", "Cloud", "Ember"]
    assert re.fullmatch(r"[1-9]\d{2,9}", make_value(rng, "digits", words))
    codes = [make_value(rng, "code", words) for _ in range(200)]
    assert all(re.fullmatch(r"([a-z0-9-]+|[A-Z0-9-]+)", c) for c in codes)
    assert all(2 <= c.count("-") + 1 <= 5 and "" not in c.split("-") for c in codes)
    assert 36 <= max(map(len, codes)) < 40  # as long as a UUID
    assert any(re.fullmatch(r"[0-9a-f-]+", c) and re.search("[a-f]", c) for c in codes)  # hexadecimal ones too
    assert make_value(rng, "word", words) in {w.lower() for w in words}
    assert 2 <= len(make_value(rng, "phrase", words).split()) <= 4


@pytest.mark.parametrize("restated", [0.0, 1.0])
def test_none_of_the_evaluations_wording(restated):
    text = "\n".join(d for d in mix_retrieval(documents(), RetrievalMix(ratio=0.5, restated=restated), seq_len=256))
    for phrase in (needles.NOISE, needles.PASSKEY_INSTRUCTION, "pass key", "special magic", "provided text"):
        assert phrase not in text


def restated_in(question: str) -> bool:
    """Whether a question restates itself before its answer (one of RESTATED's forms, then the value)."""
    return any(re.search(form.format(noun=r"\w+", key=r"\w+") + r" \S+$", question) for form in RESTATED)


@pytest.mark.parametrize("fmt", ["single", "multi"])
def test_questions_are_restated_before_their_answer_as_asked(fmt):
    words = [f"w{i}ord" for i in range(40)]
    filler = " ".join(["alpha", "beta", "gamma."] * 100)
    half = 0
    for i in range(40):
        for restated in (0.0, 1.0, 0.5):
            sample, (value,) = build_sample(random.Random(i), fmt, "digits", words, filler, restated=restated)
            question = sample.rsplit("\n\n", 1)[1]
            assert question.endswith(f" {value}")
            if restated == 0.5:
                half += restated_in(question)
            else:
                assert restated_in(question) == (restated == 1.0), question
    assert 10 <= half <= 30  # about half of 40


def test_restated_is_recorded_only_when_set():
    """Left at 0 it is not in the dumps that key the data cache and the stages' fingerprints (runs and caches made
    before it existed stay valid); set, it is."""
    assert "restated" not in RetrievalMix().model_dump() and "restated" not in RetrievalMix().cache_fields()
    assert RetrievalMix(restated=0.5).model_dump(mode="json")["restated"] == 0.5
    assert RetrievalMix(restated=0.5).cache_fields()["restated"] == 0.5


def test_packing_keeps_every_sample_inside_one_row():
    tok = tiny_tokenizer()
    docs = ["a" * 7, WholeDocument("b" * 5), "c" * 13, WholeDocument("d" * 7), WholeDocument("e" * 12), "f" * 30]
    rows = pack_documents(tok, docs, seq_len=8)
    ids, pos = rows["input_ids"], rows["position_ids"]
    for letter, length in (("b", 5), ("d", 7)):
        token = tok.convert_tokens_to_ids(letter)
        where = (ids == token).nonzero().tolist()
        assert len({r for r, _ in where}) == 1 and len(where) == length  # one row, every token
        row, col = where[0]
        assert pos[row, col] == 0 and ids[row, col + length] == tok.eos_token_id  # starts a segment, ends with EOS
    assert not (ids == tok.convert_tokens_to_ids("e")).any()  # longer than a row: dropped
    plain = [
        i for i in ids.flatten().tolist() if i not in (tok.convert_tokens_to_ids("b"), tok.convert_tokens_to_ids("d"))
    ]
    expected = tok("a" * 7 + "</s>" + "c" * 13 + "</s>" + "f" * 30 + "</s>", add_special_tokens=False)["input_ids"]
    plain = [i for i in plain if i != tok.eos_token_id]
    assert plain == [i for i in expected if i != tok.eos_token_id][: len(plain)]  # the corpus in order


def test_recipe_field_and_cache_key(tmp_path, capsys):
    assert DataSettings(retrieval={"ratio": 0.1}).retrieval == RetrievalMix(ratio=0.1)
    with pytest.raises(ValueError, match="formats"):
        DataSettings(retrieval={"formats": ["single", "needle"]})
    tok, src = tiny_tokenizer(), tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(60)))
    assert cache_key(src, tok, 64, None) == cache_key(src, tok, 64, None, retrieval=RetrievalMix(ratio=0))
    assert cache_key(src, tok, 64, None) != cache_key(src, tok, 64, None, retrieval=RetrievalMix(ratio=0.2))
    plain, _ = build_dataset(src, tok, 256, tmp_path / "cache", validation_fraction=0)
    mixed, _ = build_dataset(src, tok, 256, tmp_path / "cache", validation_fraction=0, retrieval=RetrievalMix())
    assert len(mixed) > len(plain)
    err = capsys.readouterr().err
    assert "dropped" not in err  # sized with the tokenizer: every sample fits a row
    assert "retrieval samples: 20% of the text (0.25x the corpus)" in err  # what the mix will add, said up front


def test_recipe_errors_name_the_field():
    data = yaml.safe_load((ROOT / "recipes" / "smollm2-sse.yaml").read_text())
    data = apply_overrides(data, ["data.retrieval.ratoi=0.2", "data.retrieval.values=[digits,uuid]"])
    with pytest.raises(ValueError) as error:
        parse_recipe(data)
    assert "data.retrieval.ratoi: not a field of data.retrieval; did you mean 'ratio'?" in str(error.value)
    assert "data.retrieval.values.1: Input should be 'digits', 'word', 'code' or 'phrase'" in str(error.value)


@pytest.mark.parametrize("depth", [(0.0, 0.3), (0.7, 1.0)])
def test_facts_go_within_depth(depth):
    words = [f"w{i}ord" for i in range(40)]
    for seed in range(20):
        rng = random.Random(seed)
        filler = " ".join(rng.choices(["alpha", "beta", "gamma."], k=400))
        fmt = ("single", "multi", "kv")[seed % 3]
        sample, (answer,) = build_sample(rng, fmt, "code", words, filler, depth=depth)
        context = sample.rsplit("\n\n", 1)[0]
        where = context.index(answer) / len(filler)  # facts before it lengthen the context: a bound, not a share
        assert depth[0] - 0.01 <= where <= depth[1] + 0.15, (seed, fmt, where)  # 0.01: back to a word start


def test_length_sets_the_samples_share_of_a_row():
    words_of = lambda text: len(text.split())  # noqa: E731 (a tokenizer of whitespace words)
    for length in ((0.125, 0.8), (0.6, 0.9)):
        mix = RetrievalMix(ratio=0.3, length=length)
        sizes = [words_of(d) for d in mix_retrieval(documents(600), mix, 512, words_of) if isinstance(d, WholeDocument)]
        assert sizes and all(d < 512 for d in sizes)
        assert max(sizes) <= length[1] * 512 * 1.2, (length, sizes)
        short = [n for n in sizes if n < length[0] * 512 * 0.8]  # the first: less corpus read than a sample takes
        assert len(short) <= len(sizes) // 10, (length, sizes)


def test_length_and_depth_are_checked_and_keyed_only_when_set(tmp_path):
    with pytest.raises(ValueError, match=r"length\n.*\[0.9, 0.5\] is not a range \[low, high\] with 0.01 <= low"):
        RetrievalMix(length=(0.9, 0.5))
    with pytest.raises(ValueError, match=r"depth\n.*\[-0.1, 0.5\] is not a range"):
        RetrievalMix(depth=(-0.1, 0.5))
    with pytest.raises(ValueError, match="length"):
        RetrievalMix(length=(0.5, 1.0))  # a whole row leaves no room for the question
    assert "length" not in RetrievalMix().cache_fields()  # caches made before the fields existed stay valid
    tok, src = tiny_tokenizer(), tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(10)))
    keys = {
        cache_key(src, tok, 64, None, retrieval=RetrievalMix(**kw))
        for kw in ({}, {"depth": (0, 0.5)}, {"length": (0.5, 0.8)})
    }
    assert len(keys) == 3
