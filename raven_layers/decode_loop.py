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
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

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
    while True:
        scores = logits_processor(tokens[:, :length], logits)
        if generation_config.do_sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)  # [B]
        else:
            chosen = torch.argmax(scores, dim=-1)  # [B]
        if stops_at_eos:
            chosen = chosen * unfinished + pad * (1 - unfinished)
        tokens[:, length] = chosen
        length += 1
        unfinished = unfinished & ~stopping_criteria(tokens[:, :length], None)
        if length >= max_length:
            break
        finished.copy_(unfinished.max() == 0, non_blocking=True)
        if selected is not None:
            selected.record()
        # queued before the flag is read: while the host waits for this token's flag, the GPU runs the next step
        logits = model.next_token_logits(chosen[:, None], cache)  # [B, V] float32
        if selected is not None:
            selected.synchronize()
        if finished.item():
            break
    return tokens[:, :length]
