"""generate()'s own decoding loop (decode_loop.py) returns the tokens of transformers' loop, and runs only where it
applies."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

import raven_layers.modeling_hybrid as modeling
from raven_convert import build_hybrid, plan_layers
from raven_layers.decode_loop import GreedyTokens, ScoreObserver, applies, chooses_in_step
from tests.conftest import tiny_config

pytestmark = pytest.mark.transformers_api
SETTINGS = {"raven": {"num_slots": 16, "top_k": 4, "chunk_size": 4}, "sila": {"chunk_size": 4}}


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4)).eval()
    return build_hybrid(source, plan_layers([("sila", "0"), ("raven", "2")], 4), SETTINGS).eval()


@pytest.fixture
def loops(monkeypatch):
    """The number of generate() calls that ran decode_loop."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return modeling.decode_loop.__wrapped__(*args, **kwargs)

    counted.__wrapped__ = modeling.decode_loop
    monkeypatch.setattr(modeling, "decode_loop", counted)
    return calls


@pytest.fixture
def in_step(hybrid, monkeypatch):
    """The decode steps that chose their tokens themselves (`next_tokens`)."""
    calls, real = [], type(hybrid).next_tokens
    monkeypatch.setattr(type(hybrid), "next_tokens", lambda *args: calls.append(1) or real(*args))
    return calls


def prompt(rows=3):
    ids = torch.randint(3, 100, (rows, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[-1, :8] = 0  # one real token
    return ids, mask


def both(model, ids, mask, seed=0, **kwargs):
    """generate() in transformers' loop, then in decode_loop, from the same random state."""
    out = []
    for loop in (False, True):
        model.use_decode_loop = loop
        torch.manual_seed(seed)
        with torch.no_grad():
            out.append(
                model.generate(
                    ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, cache_implementation="static", **kwargs
                )
            )
    model.use_decode_loop = True
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": False},
        {"do_sample": False, "prefill_chunk_size": 4},
        {"do_sample": True, "top_k": 20, "temperature": 0.7},
        {"do_sample": True, "top_p": 0.9, "num_return_sequences": 2},
        {"do_sample": False, "repetition_penalty": 1.3, "min_new_tokens": 4},
    ],
    ids=["greedy", "prefill-chunks", "top-k", "top-p-2-sequences", "penalties"],
)
def test_tokens_equal_transformers_loop(hybrid, loops, in_step, settings):
    ids, mask = prompt()
    theirs, ours = both(hybrid, ids, mask, **settings)
    assert loops == [1]
    greedy = not settings["do_sample"] and "repetition_penalty" not in settings  # no processor
    assert len(in_step) == (11 if greedy else 0)  # 12 new tokens: the prompt's, then 11 steps
    assert ours.shape == theirs.shape == (ids.shape[0] * settings.get("num_return_sequences", 1), 21)
    assert torch.equal(ours, theirs)


class Unchanged(LogitsProcessor):
    """A processor that returns the scores as they are, but is not a `ScoreObserver`: the loop calls it."""

    def __call__(self, input_ids, scores):
        return scores


def test_rows_that_stop_early_are_padded_and_the_loop_ends_when_all_have(hybrid, loops, in_step):
    """Greedy, so each step chooses its tokens itself (`GreedyTokens`), and with a processor, in the loop."""
    ids, mask = prompt(rows=2)
    free, _ = both(hybrid, ids, mask)
    eos = [int(free[0, 11]), int(free[1, 13])]  # row 0 stops at its third new token, row 1 at its first (= fifth)
    theirs, ours = both(hybrid, ids, mask, eos_token_id=eos)
    steps = len(in_step)
    assert loops == [1, 1] and steps == 11 + ours.shape[1] - 9  # 11, then one past the last row's last token
    processed, ours_processed = both(hybrid, ids, mask, eos_token_id=eos, logits_processor=[Unchanged()])
    assert torch.equal(ours_processed, processed) and torch.equal(processed, theirs) and len(in_step) == steps
    assert ours.shape[1] < free.shape[1] and torch.equal(ours, theirs)
    assert (ours[0, 12:] == 0).all()
    # the next generate() starts from a clean cache although the loop ran one step past the end
    again, _ = both(hybrid, ids, mask, eos_token_id=eos)
    assert torch.equal(again, theirs)


def test_a_prompt_of_embeddings_returns_the_new_tokens_as_transformers_loop_does(hybrid, loops):
    ids, _ = prompt(rows=2)
    embeds = hybrid.get_input_embeddings()(ids).detach()
    theirs, ours = both(hybrid, None, None, inputs_embeds=embeds)
    assert loops == [1] and ours.shape == (2, 12) and torch.equal(ours, theirs)


def test_transformers_loop_runs_what_decode_loop_does_not_cover(hybrid, loops):
    ids, mask = prompt()
    with torch.no_grad():
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static", num_beams=2)
        hybrid.generate(
            ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static", return_dict_in_generate=True
        )
        hybrid.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="dynamic")
    assert loops == []


def test_applies_reads_the_config_and_the_arguments():
    greedy = GenerationConfig()
    assert applies(greedy, {}) and applies(greedy, {"do_sample": True, "attention_mask": None})
    assert not applies(greedy, {"num_beams": 3})
    assert not applies(GenerationConfig(return_dict_in_generate=True), {})
    assert not applies(greedy, {"streamer": object()})


def test_greedy_tokens_choose_as_transformers_loop_does():
    """The first of equal maxima; finished rows get the pad token and stay finished; `done` once all have; a new
    generation refills the buffers."""
    greedy = GreedyTokens(3, torch.device("cpu"))
    greedy.start(torch.tensor(0), [5, 7])
    logits = torch.zeros(3, 9)
    logits[0, [2, 4]] = 1.0  # a tie: the first
    logits[1, 5] = logits[2, 7] = 1.0  # EOS tokens
    assert greedy(logits).tolist() == [2, 5, 7] and greedy.unfinished.tolist() == [1, 0, 0] and not greedy.done
    logits[0] = 0.0
    logits[0, 7] = 1.0
    assert greedy(logits).tolist() == [7, 0, 0] and greedy.unfinished.tolist() == [0, 0, 0] and greedy.done
    greedy.start(None, [])  # no EOS: no row finishes
    assert greedy(logits).tolist() == [7, 5, 7] and bool(greedy.unfinished.all()) and not greedy.done
    with pytest.raises(ValueError, match="9 EOS tokens"):
        greedy.start(torch.tensor(0), list(range(9)))


def test_chooses_in_step_only_what_transformers_loop_would_choose_alike():
    config = GenerationConfig(max_length=20)
    length, eos = MaxLengthCriteria(20), EosTokenCriteria([1, 2])
    assert chooses_in_step(config, LogitsProcessorList([ScoreObserver()]), StoppingCriteriaList([length, eos]))
    assert chooses_in_step(config, [], [MaxLengthCriteria(30)])  # never stops before the loop's own end
    assert not chooses_in_step(config, [], [MaxLengthCriteria(10)])
    assert not chooses_in_step(config, [RepetitionPenaltyLogitsProcessor(1.2)], [length])
    assert not chooses_in_step(config, [], [length, MaxTimeCriteria(10.0)])
    assert not chooses_in_step(config, [], [EosTokenCriteria(list(range(9)))])
    assert not chooses_in_step(GenerationConfig(max_length=20, do_sample=True), [], [length])


def test_the_compiled_choice_equals_the_eager_one():
    """What a compiled step captures on CUDA (`compiled_choose_greedy`, Inductor's kernels) chooses as the eager
    choice does, and leaves the same buffers, over steps where rows finish."""
    eager, compiled = GreedyTokens(4, torch.device("cpu")), GreedyTokens(4, torch.device("cpu"))
    for greedy in (eager, compiled):
        greedy.start(torch.tensor(0), [3])
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 1, 3] = logits[1, 2, 3] = 10.0  # row 1 finishes at the first step, row 2 at the second
    for step in logits:
        assert torch.equal(eager(step), compiled(step, compiled=True))
        assert torch.equal(eager.unfinished, compiled.unfinished) and bool(eager.done) == bool(compiled.done)
    assert compiled.unfinished.tolist() == [1, 0, 0, 1]
