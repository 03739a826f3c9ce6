"""Retrieval evaluation: prompt sizing and needle depth per task and variant, seeds, scoring, batched generation."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert.evaluate import retrieval as R
from tests.conftest import SMOLLM2_ENV, tiny_config, tiny_tokenizer

PARAGRAPHS = [
    "The river bends twice before it reaches the town. Boats wait at the mill. Nobody hurries here. "
    "In spring the water rises and the fields turn soft.",
    "Most programs start small. A few grow into systems that nobody fully understands. "
    "Good names help. So do tests that run fast.",
    "My grandmother kept bees for forty years. She said they knew her by her walk. "
    "I never learned whether that was true.",
    "Cities change faster than maps. A street that was quiet last year now has six cafes. "
    "The old bakery is a bank. The bank is empty.",
    "Writing is rewriting. The first draft tells you what you think. "
    "The second tells you what you should have said. The third is for the reader.",
    "Mountains make their own weather. Clouds gather at noon and break by evening. "
    "Hikers learn to start before dawn and to turn back early.",
]
# a second haystack, as papers are: equations, numbers, tables (ASCII: the tiny tokenizer's characters)
PAPER = [
    "Lemma 2. For every $x_i \\in [0, 1]$ the update $S_t = \\lambda S_{t-1} + k_t v_t^T$ stays below 3.75.",
    "Table 4 reports 41.2, 38.9 and 44.5 on three benchmarks; the gate (Eq. 7) adds 0.6 points at 16K tokens.",
    "| model | state | 8k | 16k |\n| GLA | 128 x 128 | 92.1 | 40.7 |\n| Raven | 64 slots | 99.8 | 94.2 |",
    "We train for 20B tokens with a learning rate of 3e-4, warmup over 2,000 steps and a cosine decay to 10%.",
]
PAPERS_ENV = "RAVEN_PAPERS_DIR"  # the project's papers (../shared/papers), a real second haystack
LENGTHS = (800, 1200)  # character-level tokens: every task fits with room for a haystack
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
LENGTH_TOLERANCE = 3  # tokens
DEPTH_TOLERANCE = 0.05  # fraction of the haystack
# a larger initialisation than the default 0.02, so that a random model's greedy answers depend on the prompt
LOUD = dict(max_position_embeddings=1024, initializer_range=0.3)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def hay_dir(tmp_path_factory) -> Path:
    """Three small 'essays', each its two paragraphs twelve times: text for the longest prompt (4,000 characters,
    2,000 SmolLM2 tokens)."""
    root = tmp_path_factory.mktemp("essays")
    for i in range(3):
        (root / f"essay{i}.txt").write_text("\n\n".join(PARAGRAPHS[2 * i : 2 * i + 2] * 12) + "\n")
    return root


@pytest.fixture(scope="module")
def paper_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("papers")
    (root / "paper.txt").write_text("\n\n".join(PAPER * 12))
    return root


def n_tokens(tokenizer, sample: R.Sample) -> int:
    ids = tokenizer(sample.prompt, add_special_tokens=sample.meta["add_special_tokens"])["input_ids"]
    return len(ids)


def haystack_depth(sample: R.Sample) -> float:
    """Fraction of haystack characters (context minus every needle) before the asked needle."""
    ctx_start, ctx_end = sample.meta["context_char_span"]
    spans = [n["char_span"] for n in sample.meta["needles"]]
    hay_chars = (ctx_end - ctx_start) - sum(e - s for s, e in spans)
    first = spans[0][0]
    before = (first - ctx_start) - sum(e - s for s, e in spans if e <= first)
    return before / hay_chars


def strip_needles(sample: R.Sample) -> str:
    ctx_start, ctx_end = sample.meta["context_char_span"]
    text = sample.prompt[ctx_start:ctx_end]
    for n in sample.meta["needles"]:
        text = text.replace(sample.prompt[n["char_span"][0] : n["char_span"][1]], "")
    return " ".join(text.split())


@pytest.mark.parametrize("variant", R.VARIANTS)
@pytest.mark.parametrize("task", sorted(R.TASKS))
def test_prompt_length_depth_and_variant(task, variant, tok, hay_dir):
    samples = R.build_samples(task, tok, LENGTHS, DEPTHS, 1, seed=3, variant=variant, haystack_dir=hay_dir)
    assert [(s.length, s.depth) for s in samples] == [(n, d) for n in LENGTHS for d in DEPTHS]
    spec = R.TASKS[task]
    for s in samples:
        assert (s.task, s.variant) == (task, variant)
        assert n_tokens(tok, s) == s.meta["n_tokens"]
        assert abs(s.meta["n_tokens"] - s.length) <= LENGTH_TOLERANCE, s.meta["id"]
        assert len(s.answers) == spec.num_answers
        assert len(s.meta["needles"]) == spec.num_keys + spec.num_answers - spec.num_queries
        # every needle sits at its recorded character and token span, holding its value
        ids = tok(s.prompt, add_special_tokens=s.meta["add_special_tokens"])["input_ids"]
        for needle in s.meta["needles"]:
            (cs, ce), (ts, te) = needle["char_span"], needle["token_span"]
            text = s.prompt[cs:ce]
            assert text == spec.needle(needle["key"], needle["value"])
            assert tok.decode(ids[ts:te]) == text
            assert cs == s.meta["context_char_span"][0] or s.prompt[cs - 1].isspace()  # at a word start at least
        assert all(a in s.prompt[slice(*s.meta["needles"][0]["char_span"])] for a in s.answers[:1])
        # the distance counts back to the last token of the nearest needle holding an answer (1: the last token)
        answer_ends = [n["token_span"][1] for n in s.meta["needles"] if n["value"] in s.answers]
        assert s.meta["needle_distance"] == len(ids) - max(answer_ends) + 1 >= 1
        assert abs(haystack_depth(s) - s.depth) <= DEPTH_TOLERANCE, s.meta["id"]
        assert abs(s.meta["depth_actual"] - s.depth) <= DEPTH_TOLERANCE
        # variants: what comes before the context
        head = s.prompt[: s.meta["context_char_span"][0]]
        key = s.meta["key"] or "pass key"
        if variant == "no_inst":
            assert head == ""
        elif variant == "strong_inst":
            assert key in head
        else:
            assert "hidden" in head and key not in head
        assert s.prompt.endswith(s.meta["answer_prefix"])


def test_multi_query_asks_every_key_and_wants_every_value(tok, hay_dir):
    for s in R.build_samples("niah_multiquery", tok, [1500], [0.3], 2, seed=1, haystack_dir=hay_dir):
        keys = [n["key"] for n in s.meta["needles"]]
        assert len(set(keys)) == 4 and s.answers == [n["value"] for n in s.meta["needles"]]
        question = s.prompt.rsplit("\n", 1)[-1]
        assert f"{', '.join(keys[:3])} and {keys[3]}" in s.meta["answer_prefix"] and "are" in question
        assert R.score(", ".join(s.answers[:2]), s.answers) == 0.5  # half the keys answered: half the score
    distracted = R.build_samples("niah_multikey_word", tok, [1500], [0.3], 1, seed=1, haystack_dir=hay_dir)[0]
    assert len(distracted.meta["needles"]) == 4 and len(distracted.answers) == 1
    assert distracted.answers[0] == distracted.meta["needles"][0]["value"] and " " in distracted.answers[0]


def test_needles_at_sentence_starts(tok, hay_dir):
    """With a haystack long against its sentences (as with real tokenizers), needles start sentences."""
    for task in ("passkey", "niah_single_2", "niah_multikey"):
        for s in R.build_samples(task, tok, [4000], [0.1, 0.35, 0.6, 0.9], 1, seed=0, haystack_dir=hay_dir):
            for needle in s.meta["needles"]:
                before = s.prompt[: needle["char_span"][0]].rstrip()
                assert before.endswith((".", "?", "!")), before[-40:]


def test_seeds_and_sample_level_shuffling(tok, hay_dir):
    def build(seed, task="niah_single_2"):
        return R.build_samples(task, tok, [900], [0.5], 4, seed=seed, haystack_dir=hay_dir)

    a, b, c = build(7), build(7), build(8)
    assert [s.prompt for s in a] == [s.prompt for s in b] and [s.answers for s in a] == [s.answers for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    haystacks = [strip_needles(s) for s in a]
    assert len(set(haystacks)) == len(haystacks)  # every sample its own paragraph order
    # the paragraphs appear in different orders, not only at other offsets
    orders = {tuple(sorted(range(len(PARAGRAPHS)), key=lambda i, h=h: h.find(PARAGRAPHS[i][:40]))) for h in haystacks}
    assert len(orders) > 1
    # noise tasks: one haystack, fresh needles
    noise = R.build_samples("passkey", tok, [500], [0.5], 3, seed=1)
    assert len({tuple(s.answers) for s in noise}) == 3


def starts(paragraphs: list[str]) -> list[str]:
    """The first 40 characters of each paragraph, whitespace as strip_needles leaves it."""
    return [" ".join(p.split())[:40] for p in paragraphs]


def test_a_named_haystack_replaces_the_essays_under_the_same_needles(tok, hay_dir, paper_dir):
    def build(task):
        haystacks = {"papers": paper_dir}
        return R.build_samples(task, tok, [900], [0.0, 0.5, 1.0], 2, seed=4, haystack_dir=hay_dir, haystacks=haystacks)

    essays, papers = build("niah_multikey"), build("niah_multikey@papers")
    for e, p in zip(essays, papers, strict=True):
        assert (e.task, p.task) == ("niah_multikey", "niah_multikey@papers")
        assert p.meta["id"] == "niah_multikey@papers" + e.meta["id"].removeprefix("niah_multikey")
        assert p.answers == e.answers and p.meta["needles"][0]["value"] == e.meta["needles"][0]["value"]  # paired
        assert [n["key"] for n in p.meta["needles"]] == [n["key"] for n in e.meta["needles"]]
        assert abs(n_tokens(tok, p) - 900) <= LENGTH_TOLERANCE and abs(haystack_depth(p) - p.depth) <= DEPTH_TOLERANCE
        text, essay_text = strip_needles(p), strip_needles(e)
        assert any(start in text for start in starts(PAPER)) and not any(start in text for start in starts(PARAGRAPHS))
        assert any(start in essay_text for start in starts(PARAGRAPHS)) and "Lemma" not in essay_text


def test_a_haystack_shorter_than_the_longest_prompt_is_refused(tok, tmp_path):
    (tmp_path / "short.txt").write_text("\n\n".join(PAPER))
    held = sum(len(" ".join(p.split())) for p in PAPER) + 2 * (len(PAPER) - 1)  # characters: the tiny tokenizer's
    message = rf"haystack 'short' \({re.escape(str(tmp_path))}\) holds {held} tokens of text, fewer than the "
    with pytest.raises(ValueError, match=message + r"longest length asked, 1,200: add \*.txt files"):
        R.build_samples("niah_single_2@short", tok, [300, 1200], [0.5], 1, seed=0, haystacks={"short": tmp_path})
    assert R.build_samples("niah_single_2@short", tok, [held], [0.5], 1, seed=0, haystacks={"short": tmp_path})


def test_validation_errors(tok, hay_dir, monkeypatch):
    with pytest.raises(ValueError, match="niah_single_1"):
        R.build_samples("niah_single_9", tok, [500], [0.5], 1, seed=0)
    with pytest.raises(ValueError, match="strong_inst"):
        R.build_samples("passkey", tok, [500], [0.5], 1, seed=0, variant="strong")
    with pytest.raises(ValueError, match=r"'passkey@papers': passkey hides its needles in repeated noise"):
        R.build_samples("passkey@papers", tok, [500], [0.5], 1, seed=0, haystacks={"papers": hay_dir})
    with pytest.raises(ValueError, match=r"no haystack named 'paper'; did you mean 'papers'\? defined: papers"):
        R.build_samples("niah_word@paper", tok, [500], [0.5], 1, seed=0, haystacks={"papers": hay_dir})
    with pytest.raises(FileNotFoundError, match=r"haystack 'papers' .*: no \*.txt files in it"):
        R.build_samples("niah_word@papers", tok, [500], [0.5], 1, seed=0, haystacks={"papers": hay_dir.parent})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        R.build_samples("passkey", tok, [500], [1.5], 1, seed=0)
    with pytest.raises(ValueError, match="at least") as err:
        R.build_samples("niah_multikey", tok, [100], [0.5], 1, seed=0, haystack_dir=hay_dir)
    minimum = int(re.search(r"at least (\d+)", str(err.value)).group(1))
    sample = R.build_samples("niah_multikey", tok, [minimum + 2], [0.5], 1, seed=0, haystack_dir=hay_dir)[0]
    assert abs(sample.meta["n_tokens"] - (minimum + 2)) <= LENGTH_TOLERANCE
    monkeypatch.delenv(R.HAYSTACK_ENV, raising=False)
    with pytest.raises(ValueError, match=R.HAYSTACK_ENV):
        R.build_samples("niah_single_2", tok, [500], [0.5], 1, seed=0)
    assert R.build_samples("niah_single_1", tok, [500], [0.5], 1, seed=0)  # noise haystack: no folder needed
    monkeypatch.setenv(R.HAYSTACK_ENV, str(hay_dir))
    assert R.build_samples("niah_single_2", tok, [500], [0.5], 1, seed=0)
    with pytest.raises(ValueError, match="no chat template"):
        R.build_samples("passkey", tok, [500], [0.5], 1, seed=0, chat_template=True)


def test_chat_template(hay_dir):
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    for task in ("passkey", "niah_multivalue"):
        chat = R.build_samples(task, tok, [900], [0.0, 0.5, 1.0], 1, seed=0, haystack_dir=hay_dir)
        for s in chat:
            assert s.meta["chat"] and not s.meta["add_special_tokens"]
            assert s.prompt.startswith("<|user|>\n")
            assert s.prompt.endswith("<|assistant|>\n" + s.meta["answer_prefix"])  # prefilled reply
            assert abs(n_tokens(tok, s) - 900) <= LENGTH_TOLERANCE
            assert abs(haystack_depth(s) - s.depth) <= DEPTH_TOLERANCE
        free = R.build_samples(task, tok, [900], [0.5], 1, seed=0, haystack_dir=hay_dir, prefill_answer=False)[0]
        assert free.prompt.endswith("<|assistant|>\n") and not free.meta["prefilled"]
        plain = R.build_samples(task, tok, [900], [0.5], 1, seed=0, haystack_dir=hay_dir, chat_template=False)[0]
        assert not plain.meta["chat"] and "<|user|>" not in plain.prompt
        assert plain.prompt.endswith("? " + plain.meta["answer_prefix"])


def test_score():
    assert R.score("The pass key is 68432.", ["68432"]) == 1.0
    assert R.score("", ["68432"]) == 0.0
    assert R.score("1111111, 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert R.score("It is Tractor\nSunset.", ["tractor sunset"]) == 1.0
    assert R.score("a tractors sunset", ["tractor sunset"]) == 0.0  # words match whole words
    assert R.score("ID 8C1B2D3E-0000-4000-8000-000000000000", ["8c1b2d3e-0000-4000-8000-000000000000"]) == 1.0


class EchoModel:
    """Stands in for a causal LM: answers with the needle values found in each (left-padded) prompt.

    It decodes every row of the batch it is given, so it sees exactly what run_retrieval tokenised; it returns
    prompt + answer + EOS, right-padded to a common length, as generate() does.
    """

    device = torch.device("cpu")

    def __init__(self, tokenizer, empty=False):
        self.tokenizer, self.empty, self.batches, self.pads = tokenizer, empty, [], []

    def answer(self, prompt: str) -> str:
        if "pass key" in prompt.split("\n")[-1]:
            return ", ".join(re.findall(r"The pass key is (\d+)\. Remember it", prompt))
        asked = re.findall(r"magic \w+ for (.+?) mentioned in the provided text", prompt)[-1]
        keys = re.split(r", | and ", asked)  # multi-query: "k1, k2, k3 and k4"
        return ", ".join(v for k in keys for v in re.findall(rf"for {re.escape(k)} is: (.+?)\.(?=\s|$)", prompt))

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        assert kwargs["do_sample"] is False
        self.batches.append(tuple(input_ids.shape))
        self.pads.append(int((attention_mask == 0).sum(1).max()))
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            n_pad = int((mask == 0).sum())
            assert mask[n_pad:].all() and (ids[:n_pad] == pad_token_id).all()  # left padding
            prompt = self.tokenizer.decode(ids[n_pad:])
            answer = "" if self.empty else self.answer(prompt)
            new = self.tokenizer(answer, add_special_tokens=False)["input_ids"][: max_new_tokens - 1]
            rows.append(new + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


@pytest.fixture(scope="module")
def mixed_samples(tok, hay_dir):
    samples = []
    for task, variant in [
        ("passkey", "standard"),
        ("niah_multivalue", "no_inst"),
        ("niah_word", "strong_inst"),
        ("niah_multikey", "standard"),
        ("niah_single_3", "standard"),
        ("niah_multiquery", "standard"),
        ("niah_multikey_word", "no_inst"),
    ]:
        samples += R.build_samples(task, tok, [700, 1000], [0.2, 0.8], 1, seed=5, variant=variant, haystack_dir=hay_dir)
    return samples


def test_run_retrieval_echo_and_empty(tok, mixed_samples, capsys):
    model = EchoModel(tok)
    results = R.run_retrieval(model, tok, mixed_samples, batch_size=3)
    assert [r["id"] for r in results] == [s.meta["id"] for s in mixed_samples]  # input order kept
    assert all(r["score"] == 1.0 for r in results), [r for r in results if r["score"] < 1]
    assert sum(b[0] for b in model.batches) == len(mixed_samples) and max(b[0] for b in model.batches) == 3
    # sorted by length: batches pad a token or two, but for the one batch holding both 700- and 1000-token prompts
    assert max(model.pads) > 0 and sum(pad > 10 for pad in model.pads) == 1
    lengths = [shape[1] for shape in model.batches]  # longest first: the first static cache serves the rest
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert "28/28 samples" in capsys.readouterr().err
    assert tok.padding_side == "right"  # restored
    empty = R.run_retrieval(EchoModel(tok, empty=True), tok, mixed_samples, batch_size=4, progress=False)
    assert all(r["score"] == 0.0 and r["prediction"] == "" for r in empty)
    summary = R.summarize(results + empty)
    assert summary["accuracy"] == 0.5 and summary["n"] == 56


def test_run_retrieval_tiny_llama(tok):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **LOUD)).eval()
    tok = tiny_tokenizer()
    tok.pad_token = None  # falls back to EOS for the run, restored afterwards
    samples = R.build_samples("passkey", tok, [350, 420], [0.5], 3, seed=0)
    batched = R.run_retrieval(model, tok, samples, batch_size=4, max_new_tokens=6, progress=False)
    assert tok.pad_token is None and tok.padding_side == "right"
    assert len(batched) == 6 and all(isinstance(r["prediction"], str) and 0 <= r["score"] <= 1 for r in batched)
    assert {r["n_tokens"] for r in batched} == {s.meta["n_tokens"] for s in samples}
    single = R.run_retrieval(model, tok, samples, batch_size=1, max_new_tokens=6, progress=False)
    assert [r["prediction"] for r in batched] == [r["prediction"] for r in single]  # left padding changes nothing
    assert len({r["prediction"] for r in batched}) > 1  # answers that depend on the prompt: the check has teeth
    default = R.run_retrieval(model, tok, samples[:2], batch_size=2, progress=False)  # max_new_tokens from answers
    assert all(len(r["prediction"]) <= len(samples[0].answers[0]) + 4 + 16 for r in default)


def test_run_retrieval_hybrid(tok):
    """A converted hybrid (Raven and SILA layers) answers the same batched, left-padded, as one by one."""
    from raven_convert import build_hybrid

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", **LOUD)).eval()
    kinds = ["raven", "attention", "sila", "attention"]
    hybrid = build_hybrid(source, kinds, {"raven": {"num_slots": 16, "top_k": 4}, "sila": {}}).eval()
    samples = R.build_samples("niah_single_1", tok, [330, 400], [0.5], 2, seed=0, variant="no_inst")
    batched = R.run_retrieval(hybrid, tok, samples, batch_size=4, max_new_tokens=5, progress=False)
    single = R.run_retrieval(hybrid, tok, samples, batch_size=1, max_new_tokens=5, progress=False)
    assert [r["prediction"] for r in batched] == [r["prediction"] for r in single]
    assert len({r["prediction"] for r in batched}) > 1


def test_past_window_splits_by_how_far_back_the_answers_lie(tok, mixed_samples):
    results = R.run_retrieval(EchoModel(tok), tok, mixed_samples, batch_size=8, progress=False)
    distances = [r["needle_distance"] for r in results]
    assert distances == [s.meta["needle_distance"] for s in mixed_samples]
    window = sorted(distances)[len(distances) // 2]
    for r in results:  # right exactly when the answer lies inside the window
        r["score"] = float(r["needle_distance"] <= window)
    split = R.past_window(results, window)
    past = sum(d > window for d in distances)
    assert split == {
        "window": window,
        "past": {"accuracy": 0.0, "n": past},
        "inside": {"accuracy": 1.0, "n": len(results) - past},
    }
    assert 0 < past < len(results)
    assert R.format_past_window(split) == (
        f"needles past the {window}-token attention window: 0.0% of {past}; inside it: 100.0% of {len(results) - past}"
    )
    wide = R.past_window(results, 10**6)
    assert wide["past"]["n"] == 0 and wide["inside"]["n"] == len(results)
    assert "window: none; inside it: " in R.format_past_window(wide)
    with pytest.raises(ValueError, match="window must be a number of tokens >= 1, got 0"):
        R.past_window(results, 0)
    old = [{k: v for k, v in r.items() if k != "needle_distance"} for r in results]
    with pytest.raises(ValueError, match="28 results have no needle_distance .*scripts/lab/needle_distances.py"):
        R.past_window(old, window)


def test_summary_table_plot_and_json(tok, mixed_samples, tmp_path):
    results = R.run_retrieval(EchoModel(tok), tok, mixed_samples, batch_size=8, progress=False)
    results[0]["score"] = 0.0  # passkey, 700 tokens, depth 0.2
    summary = R.summarize(results)
    passkey = summary["tasks"]["passkey/standard"]
    assert passkey["n"] == 4 and passkey["accuracy"] == 0.75
    assert passkey["by_length"] == {"700": 0.5, "1000": 1.0}
    assert passkey["by_length_depth"]["700"] == {"0.2": 0.0, "0.8": 1.0}
    table = R.format_table(summary)
    assert "passkey/standard" in table and "20%" in table and "all" in table and "700" in table
    png = R.plot_niah_heatmap([r for r in results if r["task"] == "passkey"], tmp_path / "plots" / "p.png", "passkey")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = R.save_results(results, summary, tmp_path / "res.json")
    data = json.loads(out.read_text())
    assert data["summary"]["tasks"]["passkey/standard"]["accuracy"] == 0.75 and len(data["results"]) == 28
    zipped = R.save_results(results, summary, tmp_path / "res.json.gz")  # as archive_run.py keeps them
    assert R.load_results(out) == R.load_results(zipped) == data
    assert zipped.read_bytes() == R.gzip_scores(out.read_bytes())  # the plain file's bytes, gzipped
    assert zipped.read_bytes()[4:8] == b"\0\0\0\0"  # no timestamp in it: the same scores, the same bytes
    (tmp_path / "res.json.gz").unlink()
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["res.json"]  # no temporary file left behind


def test_real_essays(tok):
    essays = os.environ.get(R.HAYSTACK_ENV)
    if not essays:
        pytest.skip(f"set {R.HAYSTACK_ENV} to the Paul Graham essays folder (e.g. ../shared/data/pg_essays)")
    samples = R.build_samples("niah_word", tok, [3000], [0.0, 0.5, 1.0], 2, seed=0, variant="no_inst")
    for s in samples:
        assert abs(n_tokens(tok, s) - 3000) <= LENGTH_TOLERANCE
        assert abs(haystack_depth(s) - s.depth) <= DEPTH_TOLERANCE
        assert "Want to start a startup?" not in s.prompt  # the essays' boilerplate is dropped
    assert len({strip_needles(s) for s in samples}) == len(samples)


def test_real_papers(tok):
    """The project's papers (markdown, LaTeX, tables, numbers) as a second haystack, and how much text they hold."""
    papers = os.environ.get(PAPERS_ENV)
    if not papers:
        pytest.skip(f"set {PAPERS_ENV} to the papers folder (e.g. ../shared/papers)")
    haystacks = {"papers": papers}
    samples = R.build_samples("niah_multikey@papers", tok, [3000], [0.0, 0.5, 1.0], 2, seed=0, haystacks=haystacks)
    for s in samples:
        assert abs(n_tokens(tok, s) - 3000) <= LENGTH_TOLERANCE
        assert abs(haystack_depth(s) - s.depth) <= DEPTH_TOLERANCE
    assert len({strip_needles(s) for s in samples}) == len(samples)
    with pytest.raises(ValueError, match=r"haystack 'papers' .* holds [\d,]+ tokens of text, fewer than .* 10,000,000"):
        R.build_samples("niah_single_2@papers", tok, [10_000_000], [0.5], 1, seed=0, haystacks=haystacks)


def test_real_tokenizer(hay_dir):
    """SmolLM2's BPE tokenizer and chat template: sizes within a few tokens, needles where recorded."""
    gguf = os.environ.get(SMOLLM2_ENV)
    if not gguf or not Path(gguf).is_file():
        pytest.skip(f"real SmolLM2 not available: set {SMOLLM2_ENV} to the GGUF file (.ci/run does)")
    from raven_convert import Source

    tok = Source.resolve(gguf).load_tokenizer()
    for chat in (False, True):
        for task in ("niah_single_3", "niah_multikey", "passkey"):
            for s in R.build_samples(
                task, tok, [600, 2000], [0.0, 0.5, 1.0], 1, seed=0, haystack_dir=hay_dir, chat_template=chat
            ):
                assert abs(n_tokens(tok, s) - s.length) <= LENGTH_TOLERANCE and s.meta["chat"] == chat
                ids = tok(s.prompt, add_special_tokens=s.meta["add_special_tokens"])["input_ids"]
                ts, te = s.meta["needle_token_span"]
                assert s.answers[0] in tok.decode(ids[ts:te])
                assert abs(s.meta["depth_actual"] - s.depth) <= DEPTH_TOLERANCE
