"""generate()'s decoding loop over a `StaticHybridCache`, without waiting on the GPU at every token.

transformers' loop asks after each token whether every row has finished (`unfinished_sequences.max() == 0` read on
the host), so the host waits for the GPU to finish the step before it prepares the next one, and the GPU waits while
it does: at batch 1 that host time (about half a millisecond) is added to every replayed decode step. This loop
queues the next step before it reads the flag of the last token, so the GPU always has a step to run; when every
row has finished it has computed one step too many, whose result it drops. Everything else is transformers' own:
generate() prepares the inputs, the logits processors and the stopping criteria, and `_prefill` runs the prompt.

    tokens = model.generate(ids, max_new_tokens=64)   # this loop where `applies`, transformers' loop otherwise

The tokens are those of transformers' loop: the same processors and criteria are called with the same inputs, in
the same order (sampling draws the same random numbers). The cache is not returned, so the extra step it holds is
never seen.

Greedy decoding whose logits processors only observe (`ScoreObserver`) and whose only stopping criteria are the
maximum length and EOS tokens, generate()'s defaults, chooses each token inside the decode step instead
(`GreedyTokens`, captured in the step's CUDA graph by `next_tokens`): between two replays the host then writes the
token and reads one flag, where the general loop launches about 15 small kernels (the logits as float32, the
argmax, the finished rows, the criteria).
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .cache import output_cache


def applies(config: GenerationConfig, kwargs: dict) -> bool:
    """Whether generate(**kwargs) under `config` may run `decode_loop`: greedy decoding or sampling, returning only
    the tokens, with nothing that reads every step as it happens (a streamer, synced GPUs)."""
    merged = copy.copy(config)  # set, not updated: update() validates, and generate() warns about the flags already
    for key, value in kwargs.items():
        if hasattr(merged, key):
            setattr(merged, key, value)
    return (
        hasattr(GenerationMixin, "_prefill")
        and merged.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
        and not merged.return_dict_in_generate
        and not any(kwargs.get(key) for key in ("streamer", "synced_gpus", "assistant_model", "custom_generate"))
    )


class ScoreObserver(LogitsProcessor):
    """A logits processor that changes no score, only observes each token (a clock, a counter): it must return the
    scores it is given. Where every processor is one, greedy decoding chooses its tokens inside the decode step,
    and calls them once a token with the tokens so far and `scores=None` (the prompt's token: its logits)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None) -> torch.FloatTensor | None:
        return scores


def choose_greedy(logits, unfinished, done, pad, eos) -> torch.Tensor:
    """logits [B, V] -> the tokens chosen [B]: the argmax (the first of equal maxima, as on float32 scores), `pad`
    for rows no longer `unfinished` [B] long, and those that chose a token of `eos` [E] finish (in place, as `done`:
    whether all have)."""
    chosen = torch.argmax(logits, dim=-1)
    chosen = chosen * unfinished + pad * (1 - unfinished)
    unfinished.copy_(unfinished & ~(chosen[:, None] == eos).any(-1))  # isin, without a sort
    done.copy_(unfinished.max() == 0)
    return chosen


@functools.cache
def compiled_choose_greedy():
    """`choose_greedy` compiled by torch.compile (made at the first use, compiled at its first call): its dozen
    small kernels as one or two, for a compiled step captured in a CUDA graph."""
    return torch.compile(choose_greedy, fullgraph=True, dynamic=False)


class GreedyTokens:
    """The next tokens of greedy decoding from a step's logits, as transformers' loop chooses them under
    `chooses_in_step`: the argmax, the pad token for rows that have finished, and rows that finish on an EOS
    token. All of it is device work over buffers of its own, so a decode step that ends in it can be captured in
    one CUDA graph. One per static cache (its graph captures these buffers); `start` refills them for a generate()."""

    EOS_SLOTS = 8  # EOS tokens it holds; -1 fills the rest (no token id is negative)

    def __init__(self, batch_size: int, device: torch.device):
        self.unfinished = torch.ones(batch_size, dtype=torch.long, device=device)  # [B], 1: still generating
        self.done = torch.zeros((), dtype=torch.bool, device=device)  # every row has finished
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.eos = torch.full((self.EOS_SLOTS,), -1, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.unfinished.shape[0]

    def start(self, pad: torch.Tensor | None, eos: list[int]) -> None:
        """A new generation: every row unfinished, `pad` (a scalar tensor; None where no row stops on EOS) for
        finished rows, rows finishing on the tokens `eos` (at most EOS_SLOTS)."""
        if len(eos) > self.EOS_SLOTS:
            raise ValueError(f"{len(eos)} EOS tokens; GreedyTokens holds at most {self.EOS_SLOTS}")
        self.unfinished.fill_(1)
        self.done.fill_(False)
        self.pad.fill_(0 if pad is None else pad)
        self.eos.copy_(torch.tensor(eos + [-1] * (self.EOS_SLOTS - len(eos))))

    def __call__(self, logits: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """logits [B, V] -> the tokens chosen [B] (`choose_greedy`; `compiled`: torch.compile's)."""
        choose = compiled_choose_greedy() if compiled else choose_greedy
        return choose(logits, self.unfinished, self.done, self.pad, self.eos)


def chooses_in_step(config: GenerationConfig, logits_processor, stopping_criteria) -> bool:
    """Whether `GreedyTokens` chooses what transformers' loop would: greedy decoding, processors that only observe,
    and no criterion but the maximum length (at or past the config's) and up to EOS_SLOTS EOS tokens."""

    def covered(criterion) -> bool:
        if type(criterion) is MaxLengthCriteria:
            return criterion.max_length >= config.max_length  # never stops before this loop's own end
        return type(criterion) is EosTokenCriteria

    return (
        not config.do_sample
        and all(isinstance(processor, ScoreObserver) for processor in logits_processor)
        and all(covered(criterion) for criterion in stopping_criteria)
        and len(eos_tokens(stopping_criteria)) <= GreedyTokens.EOS_SLOTS
    )


def eos_tokens(stopping_criteria) -> list[int]:
    """The EOS tokens of the criteria that stop a row on one (transformers' `EosTokenCriteria`)."""
    return [int(t) for c in stopping_criteria if hasattr(c, "eos_token_id") for t in c.eos_token_id.reshape(-1)]


def decode_loop(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor:
    """generate()'s `custom_generate` for what `applies` admits: the prompt [B, P] -> prompt and new tokens [B, L],
    rows that finished early padded with the pad token, as transformers' loop returns them."""
    B, length = input_ids.shape
    max_length = generation_config.max_length
    tokens = input_ids.new_empty(B, max(max_length, length + 1))  # [B, max_length]; tokens[:, :length] so far
    tokens[:, :length] = input_ids
    pad = generation_config._pad_token_tensor
    stops_at_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)
    finished = torch.zeros((), dtype=torch.bool, pin_memory=input_ids.device.type == "cuda")
    selected = torch.Event(device=input_ids.device) if input_ids.device.type == "cuda" else None

    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    cache = output_cache(outputs)
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)  # [B, V]
    del outputs  # the prompt's logits may be large
    greedy = None  # where set, each step chooses its own tokens (GreedyTokens), after the prompt's
    if chooses_in_step(generation_config, logits_processor, stopping_criteria):
        greedy = model.greedy_tokens(cache)
        greedy.start(pad if stops_at_eos else None, eos_tokens(stopping_criteria))
    while True:
        scores = logits_processor(tokens[:, :length], logits)  # greedy: observers, and None after the prompt's
        if greedy is not None:
            if scores is not None:  # the prompt's token; the steps chose the others
                chosen = greedy(scores)  # [B]
        else:
            if generation_config.do_sample:
                chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)  # [B]
            else:
                chosen = torch.argmax(scores, dim=-1)  # [B]
            if stops_at_eos:
                chosen = chosen * unfinished + pad * (1 - unfinished)
        tokens[:, length] = chosen
        length += 1
        if greedy is None:
            unfinished = unfinished & ~stopping_criteria(tokens[:, :length], None)
        if length >= max_length:
            break
        finished.copy_(greedy.done if greedy is not None else unfinished.max() == 0, non_blocking=True)
        if selected is not None:
            selected.record()
        # queued before the flag is read: while the host waits for this token's flag, the GPU runs the next step
        if greedy is not None:
            chosen, logits = model.next_tokens(chosen[:, None], cache, greedy), None
        else:
            logits = model.next_token_logits(chosen[:, None], cache)  # [B, V] float32
        if selected is not None:
            selected.synchronize()
        if finished.item():
            break
    return tokens[:, :length]
