"""A decoder whose layers each keep the source attention or run a linear-time mixer in its place.

The model reuses the source architecture's own `transformers` classes (decoder layer, RMSNorm, rotary embedding;
see architectures.py) and swaps `layer.self_attn` for a mixer where `config.layer_mixers` says so. Weight names are
the source's, so a hybrid with no mixers computes exactly what the source model computes.

This file and its siblings are copied next to every exported model, so that
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` needs only `transformers`.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .architectures import get_architecture, layer_windows
from .backend import preload
from .cache import OUTPUT_CACHE_FIELD, HybridCache, cache_argument, output_cache
from .common import Mixer, one_cache, recompile_limits
from .configuration_hybrid import HybridConfig, HybridConfigError
from .decode_attention import KERNELS, decode_attention
from .decode_graph import DecodeGraph
from .decode_loop import GreedyTokens, applies, decode_loop
from .masks import attention_mask, find_packed_documents
from .sinks import sink_writes
from .static_cache import StaticHybridCache


@dataclass
class HybridModelOutput(BaseModelOutputWithPast):
    """`aux_loss`: the sum of the mixers' auxiliary losses (e.g. SSE's balance loss), already weighted."""

    aux_loss: torch.Tensor | None = None


@dataclass
class HybridCausalLMOutput(CausalLMOutputWithPast):
    """`loss` includes `aux_loss` when labels are given."""

    aux_loss: torch.Tensor | None = None


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _skip_keys_device_placement = ["cache", "past_key_values"]

    def __init__(self, config: HybridConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._no_split_modules = [get_architecture(config.base_model_type).prefix + "DecoderLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Mixer):
            module.reset_mixer_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # mixers keep recurrent states, so forward() creates a HybridCache instead

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except RuntimeError as err:  # transformers' "ignore_mismatched_sizes" refusal, after a table on the log
            problem = "ignore_mismatched_sizes" in str(err) and mismatched_weights(cls, pretrained_model_name_or_path)
            if not problem:
                raise
            raise HybridConfigError(problem) from None


def mismatched_weights(cls, folder) -> str | None:
    """Why the weights saved in the local `folder` do not fit the model its config.json builds (the first weight
    whose shape differs, its layer's mixer and that mixer's settings), or None where none differs or `folder` is not
    local: the usual cause is a mixer setting edited after the weights were saved."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    config = HybridConfig.from_pretrained(folder)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in cls(config).state_dict().items()}
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                saved = tuple(weights.get_slice(name).get_shape())
                if name in expected and expected[name] != saved:
                    layer = re.search(r"layers\.(\d+)\.", name)
                    kind = config.layer_mixers[int(layer.group(1))] if layer else None
                    where = f"layer {layer.group(1)} ({kind})" if layer else "the model"
                    settings = f" under mixer_settings.{kind} = {config.mixer_settings.get(kind, {})}" if kind else ""
                    return (
                        f"{folder}: {name} of {where} is {list(saved)} in {file.name} but {list(expected[name])} as "
                        f"config.json builds it{settings}; config.json was changed after the weights were saved: "
                        "set it back to the values the model was converted with"
                    )
    return None


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig):
        super().__init__(config)
        arch = get_architecture(config.base_model_type)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        layer_cls = arch.cls("DecoderLayer")
        self.cache_argument = cache_argument(layer_cls.forward)  # "cache" from transformers 5.24
        self.layers = nn.ModuleList()
        for i, kind in enumerate(config.layer_mixers):
            layer = layer_cls(config, i)
            if kind != "attention":
                layer.self_attn = config.mixer_spec(kind).layer(config, i, config.settings_for(kind), arch.qk_norm)
            self.layers.append(layer)
        self.norm = arch.cls("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = arch.cls("RotaryEmbedding")(config=config)
        self.windows = layer_windows(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: HybridCache | None = None,
        packed_documents: tuple[torch.Tensor, torch.Tensor] | bool | None = None,
        **kwargs,
    ) -> HybridModelOutput:
        """The generation cache comes as `cache` (transformers >= 5.24) or `past_key_values` (before); both work.
        `packed_documents`: find_packed_documents(position_ids) found ahead, False where it found none (a training
        loop finds them in the host's copy of the batch, so that the forward never reads the position ids back)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        cache = one_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = HybridCache(self.config)
        if cache is not None and not isinstance(cache, HybridCache):
            raise TypeError(f"the generation cache must be a HybridCache, got {type(cache).__name__}")
        past = cache.get_seq_length() if cache is not None else 0
        static = isinstance(cache, StaticHybridCache)
        if static:
            cache.check_room(B, T)
            if T == 1 and past > 0:  # a decode step: positions and masks come from the cache's own buffers
                hidden_states = self.decode_step(inputs_embeds, cache)
                cache.advance(1)
                return HybridModelOutput(last_hidden_state=hidden_states, **{OUTPUT_CACHE_FIELD: cache})

        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(
                f"attention_mask must be a 2D padding mask of shape [batch, past + new tokens] = [{B}, {past + T}], "
                f"got {tuple(attention_mask.shape)}"
            )
        packed = None
        if attention_mask is None and position_ids is not None and past == 0 and T > 1:
            if packed_documents is None:
                packed = find_packed_documents(position_ids.expand(B, -1))  # transformers' convention for packing
            else:
                packed = packed_documents or None
            if packed is not None:  # rows of several documents have no single continuation to cache
                cache, use_cache, static = None, False, False
        if attention_mask is not None and T > 1 and bool(attention_mask.all()):
            attention_mask = None  # no padding: every layer can take its fast path (not checked per decode step)
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device).expand(B, -1)
            else:  # left padding: count positions from each sequence's first real token
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        padding_mask = attention_mask[:, -T:].bool() if attention_mask is not None else None
        sinks = self.sinks()
        if cache is not None and sinks:
            cache.sink_writes = sink_writes(position_ids, padding_mask, sinks)
        if static:
            cache.record_prefill(attention_mask, T, position_ids)

        documents = packed[0] if packed is not None else None
        masks = {
            window: self._attention_mask(attention_mask, T, past, window, inputs_embeds, documents, position_ids)
            for window in self.attention_windows()
        }
        mixer_kwargs = {"padding_mask": padding_mask}
        if packed is not None:
            mixer_kwargs["cu_seqlens"] = packed[1]
        hidden_states = self.run_layers(inputs_embeds, position_ids, masks, cache, use_cache, mixer_kwargs, **kwargs)
        if static:
            cache.advance(T)
        aux = [
            layer.self_attn.aux_loss
            for layer, kind in zip(self.layers, self.config.layer_mixers)
            if kind != "attention" and layer.self_attn.aux_loss is not None
        ]
        return HybridModelOutput(
            last_hidden_state=hidden_states,
            aux_loss=torch.stack(aux).sum() if aux else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )

    def attention_windows(self) -> set[int | None]:
        """The windows of the kept attention layers (None: full attention): one mask is built per window."""
        return {window for kind, window in zip(self.config.layer_mixers, self.windows) if kind == "attention"}

    def sinks(self) -> int:
        """The attention sinks of the windowed kept layers (sinks.py); 0 where no kept layer is windowed."""
        windowed = any(window is not None for window in self.attention_windows())
        return getattr(self.config, "attention_sinks", 0) if windowed else 0

    def run_layers(self, hidden_states, position_ids, masks, cache, use_cache, mixer_kwargs, **kwargs):
        """The decoder layers and the final norm: [B, T, hidden] -> [B, T, hidden]."""
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer, kind, window in zip(self.layers, self.config.layer_mixers, self.windows):
            hidden_states = layer(
                hidden_states,
                attention_mask=masks.get(window),
                position_ids=position_ids,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **{self.cache_argument: cache},
                **({} if kind == "attention" else mixer_kwargs),
                **kwargs,
            )
        return self.norm(hidden_states)

    def decode_step(self, inputs_embeds: torch.Tensor, cache: StaticHybridCache) -> torch.Tensor:
        """One real token per row, [B, 1, hidden] -> [B, 1, hidden], over a static cache."""
        with cache.decoding_step(), decode_attention(self.config):
            return self.decode_layers(inputs_embeds, cache)

    def decode_layers(self, inputs_embeds: torch.Tensor, cache: StaticHybridCache) -> torch.Tensor:
        """`decode_step` within its context (`cache.decoding_step()`, `decode_attention(config)`): only device
        operations on the cache's buffers (no host sync, nothing kept from the host), so a CUDA graph can capture
        it and torch.compile can trace it whole."""
        position_ids = cache.begin_step()  # [B, 1]
        masks = {window: cache.decode_slots(window) for window in self.attention_windows()}
        hidden_states = self.run_layers(inputs_embeds, position_ids, masks, cache, True, {})
        cache.end_step()
        return hidden_states

    def _attention_mask(self, padding, T: int, past: int, window: int | None, like: torch.Tensor, documents, positions):
        """masks.attention_mask for this model's attention implementation and sinks."""
        impl = self.config._attn_implementation
        sinks = self.sinks() if window is not None else 0
        return attention_mask(impl, padding, T, past, window, sinks, like, documents, positions)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.model = HybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.use_decode_graphs = True  # replay decode steps over a static cache on CUDA as CUDA graphs
        self.compile_decode = True  # and compile the step they capture (see decode_function)
        self.use_decode_loop = True  # generate() over a static cache in decode_loop, which never waits per token
        self._decode_compile_options: dict | None = None  # Inductor options of that compilation; None: the default
        self._compiled_decode = None
        self._static_cache: StaticHybridCache | None = None  # kept for the next generate() that fits it
        self._decode_weights: tuple[int, ...] | None = None  # where the weights were when the step was made
        self.post_init()

    def static_cache(self, batch_size: int, max_length: int) -> StaticHybridCache:
        """A static cache for `batch_size` rows of up to `max_length` tokens on the model's device and dtype: the
        last one made if it fits (its buffers and captured graph are reused), else a new one in its place."""
        cache = self._static_cache
        if cache is None or not cache.fits(batch_size, max_length, self.device, self.dtype):
            self._static_cache = cache = None  # free the old buffers before making the new ones
            cache = StaticHybridCache(self.config, batch_size, max_length, device=self.device, dtype=self.dtype)
            self._static_cache = cache
        cache.reset()
        return cache

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """`GenerationMixin.generate` with the hybrid's own cache: every argument of transformers' generate() works.

        `cache_implementation="static"` (the default on CUDA) preallocates a `StaticHybridCache` for the whole
        generation (attention keys in place, sliding windows as rings, mixer states updated in place) and replays
        each decode step as a CUDA graph; `"dynamic"` (the default elsewhere) keeps the growing `HybridCache`, the
        eager reference. A cache passed in is used as it is. `model.use_decode_graphs = False` keeps the static
        cache but decodes eagerly. Greedy decoding and sampling that return only the tokens run in decode_loop.py's
        loop, which does not wait on the GPU at every token (`model.use_decode_loop = False`: transformers' loop).
        """
        config = generation_config if generation_config is not None else self.generation_config
        given = one_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
        choice = kwargs.pop("cache_implementation", None) or getattr(config, "cache_implementation", None)
        if choice is None:
            choice = "static" if self.device.type == "cuda" else "dynamic"
        if choice not in ("static", "dynamic"):
            raise ValueError(
                f"cache_implementation={choice!r} is not supported by hybrid models; use 'static' or 'dynamic'"
            )
        kwargs["cache_implementation"] = None  # decided here: transformers must not build a cache of its own
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        if given is not None or use_cache is False:
            return super().generate(inputs, generation_config, **kwargs)
        if choice == "dynamic":  # made here, not in forward(): a chunked prefill (prefill_chunk_size) needs it first
            return super().generate(
                inputs, generation_config, **{OUTPUT_CACHE_FIELD: HybridCache(self.config)}, **kwargs
            )
        prompt = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if prompt is None:
            raise ValueError("generate() with a static cache needs the prompt: input_ids or inputs_embeds")
        rows = max(kwargs.get("num_beams", config.num_beams) or 1, kwargs.get("num_return_sequences", 1) or 1)
        new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
        if new_tokens is not None:
            max_length = prompt.shape[1] + new_tokens
        else:
            max_length = kwargs.get("max_length", config.max_length)
        max_length = max(max_length, getattr(config, "max_cache_len", None) or 0)
        self.refresh_decode_step()
        cache = self.static_cache(prompt.shape[0] * rows, -(-max_length // 128) * 128)  # rounded: reuse across calls
        if self.use_decode_loop and applies(config, kwargs):
            kwargs["custom_generate"] = decode_loop
        return super().generate(inputs, generation_config, **{OUTPUT_CACHE_FIELD: cache}, **kwargs)

    def set_attention_window(
        self, window: int | None, layers: Collection[int] | None = None, sinks: int | None = None
    ) -> None:
        """Make every kept attention layer (or those of `layers`, the other kept ones then full causal attention)
        attend within the last `window` tokens (None: full causal attention), and to the first `sinks` tokens of each
        sequence besides (attention sinks, sinks.py; None keeps the model's count).

        Mixer layers are unchanged. With a window at most the source's trained context, the kept layers never see
        a RoPE distance they were not trained on, the configuration the Raven paper found to generalise in length.
        Takes effect for the next forward pass and the caches made after it; saving the model keeps it.
        """
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"attention window {window!r} not allowed; expected an integer >= 1 or None")
        if sinks is not None and (isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0):
            raise ValueError(f"attention sinks {sinks!r} not allowed; expected an integer >= 0 or None")
        kinds = self.config.layer_mixers
        kept = [i for i, kind in enumerate(kinds) if kind == "attention"]
        chosen = set(kept if layers is None else layers)
        if chosen - set(kept):
            raise ValueError(
                f"attention window on layers {sorted(chosen - set(kept))}: only kept attention layers take one "
                f"(this model keeps {kept})"
            )
        self.config.attention_windows = [window if i in chosen else None for i in range(len(kinds))]
        if sinks is not None:
            self.config.attention_sinks = sinks
        self.model.windows = layer_windows(self.config)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: HybridCache | None = None,
        **kwargs,
    ) -> HybridCausalLMOutput:
        cache = one_cache(cache, past_key_values)
        if self._graph_step(cache, input_ids, labels, kwargs):
            logits = self._replay(input_ids, cache).clone()  # the caller may keep it past the next replay
            return HybridCausalLMOutput(logits=logits, **{OUTPUT_CACHE_FIELD: cache})
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache=cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if outputs.aux_loss is not None:
                loss = loss + outputs.aux_loss
        return HybridCausalLMOutput(
            loss=loss, logits=logits, aux_loss=outputs.aux_loss, **{OUTPUT_CACHE_FIELD: output_cache(outputs)}
        )

    def _replay(self, input_ids: torch.Tensor, cache: StaticHybridCache, choose: GreedyTokens | None = None):
        """A decode step as a replayed CUDA graph (see decode_graph.py): token ids [B, 1] -> logits [B, 1, V], or
        with `choose` the tokens it picks from them [B], in the graph's buffer, which the next step overwrites."""
        cache.check_room(input_ids.shape[0], 1)
        step = self.decode_function()
        key = step if choose is None else (step, choose)
        graph = cache.graph if choose is None else cache.token_graph
        if graph is None or key != (cache.graph_step if choose is None else cache.token_graph_step):
            eager = self.decode_logits  # another model, or its step recompiled: captured anew

            def captured(run, compiled: bool):  # the step, then with `choose` its choice of tokens
                if choose is None:
                    return run

                def tokens(ids: torch.Tensor) -> torch.Tensor:  # written where the next step reads: no copy between
                    return ids.copy_(choose(run(ids)[:, -1], compiled)[:, None])[:, 0]  # [B]

                return tokens

            fallback = captured(lambda ids: eager(ids, cache), False) if self.compile_decode else None
            graph = DecodeGraph(
                captured(lambda ids: step(ids, cache), self.compile_decode), cache.batch_size, cache.device, fallback
            )
            if choose is None:
                cache.graph, cache.graph_step = graph, key
            else:
                cache.token_graph, cache.token_graph_step = graph, key
            self._decode_weights = self.weight_addresses()
        with cache.decoding_step(), decode_attention(self.config):
            out = graph(input_ids)
        cache.advance(1)
        return out

    def greedy_tokens(self, cache: StaticHybridCache) -> GreedyTokens:
        """The cache's `GreedyTokens` (made for its batch on first use), which `next_tokens` ends a step with."""
        if cache.greedy is None or cache.greedy.batch_size != cache.batch_size:
            cache.greedy = GreedyTokens(cache.batch_size, cache.device)
        return cache.greedy

    def next_tokens(self, input_ids: torch.Tensor, cache: StaticHybridCache, choose: GreedyTokens) -> torch.Tensor:
        """A decode step that ends in `choose`, for decode_loop's greedy decoding: token ids [B, 1] -> the next
        tokens [B]. Replayed as one CUDA graph with the choice inside where the step is graphed (the result is then
        the graph's input buffer, which the next replay reads as it is and overwrites), eager otherwise."""
        if self._graph_step(cache, input_ids, None, {}):
            return self._replay(input_ids, cache, choose)
        return choose(self(input_ids=input_ids, cache=cache, use_cache=True).logits[:, -1])

    def next_token_logits(self, input_ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """A decode step's logits as decode_loop takes them, float32 [B, V] in a tensor of their own: a replayed
        graph's buffer is converted straight into it, one copy per token, not forward's copy and then another."""
        if self._graph_step(cache, input_ids, None, {}):
            logits = self._replay(input_ids, cache)
        else:
            logits = self(input_ids=input_ids, cache=cache, use_cache=True).logits
        return logits[:, -1].to(torch.float32, copy=True)

    def decode_logits(self, input_ids: torch.Tensor, cache: StaticHybridCache) -> torch.Tensor:
        """One decode step, token ids [B, 1] -> logits [B, 1, V], within `cache.decoding_step()` and
        `decode_attention(config)`: what the decode graphs capture."""
        return self.lm_head(self.model.decode_layers(self.model.embed_tokens(input_ids), cache))

    @property
    def decode_compile_options(self) -> dict:
        """torch.compile's Inductor `options` for the decode step: decode_fusion.default_decode_options() (the
        projections fused in place, a small batch's as reductions, combo kernels) until set; {} compiles with
        Inductor's own defaults."""
        if self._decode_compile_options is None:
            from .decode_fusion import default_decode_options  # Inductor's pass API: imported when asked for

            return default_decode_options()
        return dict(self._decode_compile_options)

    @decode_compile_options.setter
    def decode_compile_options(self, options: dict) -> None:
        """New options drop the compiled step: the next decode step compiles with them (and is captured anew)."""
        if options:
            from .decode_fusion import check_decode_options  # Inductor's pass API: imported when options are set

            check_decode_options(options)
        self._decode_compile_options = dict(options)
        self._compiled_decode = None

    def weight_addresses(self) -> tuple[int, ...]:
        """Where every parameter's data is: a replaced tensor (`param.data = ...`, a conversion) moves it."""
        return tuple(p.data_ptr() for p in self.parameters())

    def refresh_decode_step(self) -> None:
        """Drop the compiled decode step and the captured graph if a weight moved since they were made (a graph
        replays the addresses it captured; SHARED_PROJECTIONS reads weights laid out one after another); the next
        step compiles and captures anew. generate() calls it; changes made in place need nothing."""
        if self._decode_weights is not None and self._decode_weights != self.weight_addresses():
            self._compiled_decode, self._decode_weights = None, None
            if self._static_cache is not None:
                self._static_cache.drop_graphs()

    def decode_function(self):
        """`decode_logits`, compiled by torch.compile when `compile_decode` is set (Inductor fuses the norms, rotary
        embeddings, gates and routing around the kernels, which run as custom ops) with `decode_compile_options`;
        compiled once per model and options."""
        if not self.compile_decode:
            return self.decode_logits
        if self._compiled_decode is None:
            from .decode_fusion import kernel_launches, prepare_weights  # Inductor's pass API: imported when compiling

            options = self.decode_compile_options
            prepare_weights(self, options)
            self._decode_weights = self.weight_addresses()
            mixers = {self.config.mixer_spec(kind) for kind in set(self.config.layer_mixers) - {"attention"}}
            preload([KERNELS, *(spec.kernels for spec in mixers if spec.kernels)])
            extra = {"options": options} if options else {}  # only Inductor takes options: the CPU tests use others
            compiled = torch.compile(self.decode_logits, fullgraph=True, dynamic=False, **extra)
            config, patches = torch._dynamo.config, recompile_limits(1 << 20)
            if options.get("freezing"):  # dynamo hands Inductor the weights as parameters to fold, not as inputs
                patches["prepare_freezing"] = True

            def step(input_ids: torch.Tensor, cache: StaticHybridCache) -> torch.Tensor:
                # each (model, batch, cache length) compiles once and is then replayed as a graph, never traced
                # again; dynamo's default of 8 compilations per function would run the 9th one eager, silently
                with config.patch(**patches), kernel_launches(options, input_ids):
                    return compiled(input_ids, cache)

            self._compiled_decode = step
        return self._compiled_decode

    def _graph_step(self, cache, input_ids, labels, kwargs) -> bool:
        """Whether this forward is a decode step to replay as a CUDA graph (see decode_graph.py)."""
        return (
            isinstance(cache, StaticHybridCache)
            and self.use_decode_graphs
            and cache.device.type == "cuda"
            and cache.num_tokens > 0
            and input_ids is not None
            and input_ids.shape[1] == 1
            and labels is None
            and not self.training
            and not torch.is_grad_enabled()
            and not kwargs.get("output_attentions")
            and not kwargs.get("output_hidden_states")
        )
