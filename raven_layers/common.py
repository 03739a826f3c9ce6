"""What every mixer shares: the attention-shaped base module, validated settings, the declaration that registers a
mixer (`MixerSpec`), RMSNorm, fresh-parameter init.

Copied next to every exported model with the mixers; it must import nothing but torch.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

_INF = float("inf")


def did_you_mean(value: str, allowed, aliases: dict[str, str] | None = None) -> str:
    """The hint "did you mean 'x'? " when one of `allowed` is close to `value` (a typo), else "". `aliases` maps
    names people bring from elsewhere to allowed ones (learning_rate -> lr)."""
    names = {name: name for name in allowed} | {a: n for a, n in (aliases or {}).items() if n in allowed}
    close = difflib.get_close_matches(str(value), list(names), n=1, cutoff=0.6)
    return f"did you mean {names[close[0]]!r}? " if close else ""


# a router's initial rows: "random" (small random scores), "centred" (fitted to the layer's inputs: Mixer.calibrate)
ROUTER_INITS = ("random", "centred")


class MixerSettings:
    """Base of the mixers' frozen settings dataclasses. Subclasses set NAME ("raven") and LABEL ("Raven")."""

    NAME = "mixer"
    LABEL = "mixer"

    def fail(self, name: str, allowed: str):
        value = getattr(self, name)
        why = " (not a finite number)" if self.is_non_finite(value) else ""
        raise ValueError(f"{self.NAME}.{name} = {value!r} is not allowed{why}; expected {allowed}")

    @staticmethod
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    @staticmethod
    def is_non_finite(value) -> bool:
        return isinstance(value, float) and not -_INF < value < _INF  # nan fails both comparisons

    @classmethod
    def is_number(cls, value) -> bool:
        """A finite int or float (not a bool): inf and nan are never a valid setting."""
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not cls.is_non_finite(value)

    def check_positive_ints(self, *names: str):
        for name in names:
            if not self.is_int(getattr(self, name)) or getattr(self, name) < 1:
                self.fail(name, "an integer >= 1")

    def check_bools(self, *names: str):
        for name in names:
            if not isinstance(getattr(self, name), bool):
                self.fail(name, "true or false")

    def check_choice(self, name: str, allowed: tuple[str, ...], aliases: dict[str, str] | None = None):
        """`name` one of `allowed`, else an error listing them, with a suggestion for a typo (or an alias's name)."""
        value = getattr(self, name)
        if value not in allowed:
            hint = did_you_mean(value, allowed, aliases).rstrip()
            self.fail(name, f"one of {list(allowed)}" + (f"; {hint}" if hint else ""))

    @classmethod
    def from_dict(cls, values: dict):
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            guesses = {u: did_you_mean(u, allowed) for u in unknown}
            hint = "".join(f" {u!r}: {guess}" for u, guess in guesses.items() if guess).rstrip()
            raise ValueError(f"unknown {cls.LABEL} setting(s) {unknown};{hint} allowed: {allowed}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 like the Llama/Qwen norms it may be initialised from."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@torch.no_grad()
def init_fresh_parameters(module: nn.Module, inits: dict[str, Callable[[torch.Tensor], object]]):
    """Apply `inits[name]` to each parameter of `module` that exists and was not loaded from a checkpoint
    (transformers flags those `_is_hf_initialized`; they are never overwritten)."""
    for name, init in inits.items():
        param = getattr(module, name, None)
        if param is not None and not getattr(param, "_is_hf_initialized", False):
            init(param)


_COMPILED: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile, built once per function: a mixer's layers pass themselves as its first argument,
    their parameters become the graph's inputs, and all of them share the graphs traced for the first."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def recompile_limits(limit: int) -> dict[str, int]:
    """torch._dynamo.config values that let a compiled function compile `limit` times (shapes, modes) before dynamo
    runs it eager (by default, silently, from the 9th); for `torch._dynamo.config.patch(**...)`."""
    config = torch._dynamo.config
    return {n: limit for n in ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, n)}


class Mixer(nn.Module):
    """Base of the mixers: the source attention's head layout, its projections under their names and shapes (so
    conversion copies the teacher's weights into them), the optional output gate, and the decode-state plumbing.

    Subclasses build their own parameters after `super().__init__`, and implement `reset_mixer_parameters`,
    `fresh_parameter_names`, `state_numel` and `mix(hidden_states, cache, padding_mask, cu_seqlens)`; without a
    kernel that takes `cu_seqlens`, `mix` hands packed input to `forward_packed`. `forward` takes the calling
    convention of whichever transformers release runs the decoder layer around it. `mix` calls the PyTorch work
    around its kernels (projections, routing, gates, the read-out) through `glue`, which compiles it while
    `compile_glue` is set.
    """

    aux_loss: torch.Tensor | None = None  # an auxiliary loss of the last forward, summed by the model
    # set while training (convert/train/compiling.py): the many small operations around the kernels, fused by
    # torch.compile, launch a few kernels instead of dozens per layer, forward and backward
    compile_glue: bool = False
    # a subclass's other weights whose bias-free products read the layer's input (beside q/k/v and the output gate;
    # a 3-D weight [n, r, in] as its n r rows)
    input_weights: tuple[str, ...] = ()

    # a subclass's weight whose rows score the routes of the layer's input ([routes, hidden]): the one its setting
    # `router_init` "centred" fits to the teacher's inputs (`calibrate`)
    router_weight_name: str | None = None

    @property
    def calibrates(self) -> bool:
        """Whether `calibrate` fits anything: align then runs the teacher on its first batch to call it."""
        return self.router_weight_name is not None and self.settings.router_init == "centred"

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Fit the layer's data-dependent initial parameters to x [N, hidden], the teacher's inputs to this layer at
        N real tokens of align's first batch; `mean` averages a statistic over the processes of a launch (so that
        every process fits the same values).

        router_init "centred": every router row W_i made orthogonal to the inputs' mean mu, then scaled so that its
        score W_i x_t spreads over the tokens with a standard deviation of 1 (Gumbel(0, 1) noise: 1.28). A decoder
        layer's inputs share most of their direction (mu): random rows then give every token the same per-route
        offsets W mu, larger than the scores' spread across tokens, and top-k sends every token the same few ways.
        Without mu in W, where a token goes depends on what is its own.
        """
        if not self.calibrates:
            return
        weight = getattr(self, self.router_weight_name)
        x = x.float()  # [N, hidden]
        mu = mean(x.mean(0))  # [hidden], over every process's tokens
        unit = mu / mu.norm().clamp_min(1e-12)
        w = weight.detach().float().to(x.device)  # [routes, hidden]
        w = w - (w @ unit)[:, None] * unit[None, :]
        spread = mean(((x - mu) @ w.T).pow(2).mean(0)).sqrt()  # [routes]: each score's spread over the tokens
        weight.copy_(w / spread.clamp_min(1e-12)[:, None])

    def step_state_share(self) -> float:
        """The share of its cached state one decode step moves: (bytes read + bytes written) / (2 x the state's
        bytes). All of it both ways unless a mixer touches less; the bandwidth floor of a decode step counts a
        state's bytes by it (raven_convert.evaluate.decode_bench.step_bytes)."""
        return 1.0

    @property
    def shared_input_weights(self) -> tuple[tuple[str, ...], ...]:
        """The weights whose products read the layer's input: a compiled decode step reads them as one product
        (raven_layers/decode_fusion.py)."""
        gate = ("gate_weight",) if self.settings.output_gate else ()
        return (("q_proj.weight", "k_proj.weight", "v_proj.weight", *self.input_weights, *gate),)

    def __init__(self, config, layer_idx: int, settings, qk_head_dim: int | None = None, kv_heads: int | None = None):
        """`kv_heads`: the layer's key/value heads where they are not the source's (a memory per query head: SILA's
        state_heads), k and v then as many heads wide."""
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.settings = settings
        self.num_heads = config.num_attention_heads
        self.source_kv_heads = config.num_key_value_heads
        self.num_kv_heads = kv_heads or self.source_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or bool(getattr(config, "qkv_bias", False))
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        dqk = qk_head_dim or d  # features per head of q and k (the attention's head_dim unless a mixer differs)
        self.q_proj = nn.Linear(hidden, H * dqk, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, Hkv * dqk, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, Hkv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(H * d, hidden, bias=bias)
        if settings.output_gate:  # o * 2 sigmoid(W_g x): zero-initialised, the gate starts as the identity
            self.gate_weight = nn.Parameter(torch.empty(H * d, hidden))

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [B, T, hidden] -> ([B, T, hidden], None). Decoder layers pass the generation cache as
        `cache` from transformers 5.24 and as `past_key_values` before; either is taken (see `one_cache`)."""
        return self.mix(hidden_states, one_cache(cache, past_key_values), padding_mask, cu_seqlens)

    def load_state(self, cache):
        """This layer's decode state, or None (no cache, or nothing seen yet)."""
        return cache.get_mixer_state(self.layer_idx) if cache is not None else None

    def save_state(self, cache, state: tuple[torch.Tensor, ...], num_tokens: int):
        if cache is not None:
            cache.set_mixer_state(self.layer_idx, state, num_tokens=num_tokens)

    def forward_packed(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The mixer run on each packed document on its own, so that no state crosses a document boundary.

        hidden_states [B, T, hidden] holds documents back to back; cu_seqlens [S + 1] are their offsets in the
        flattened [B * T] stream (see modeling_hybrid.find_packed_documents). The documents are re-batched as
        [S, L_max] rows with right padding, which writes nothing: the general path, for the PyTorch forms.
        Kernels take cu_seqlens directly.
        """
        rows, mask, where = to_rows(hidden_states, cu_seqlens)  # [S, L, hidden], [S, L]
        out, _ = self(rows, padding_mask=mask)
        return from_rows(out, where, hidden_states.shape[:2]), None

    def glue(self, method: Callable) -> Callable:
        """`method`, a method of this mixer free of kernels and host syncs, as `mix` should call it: compiled
        (`compiled`, shared by the mixer's layers) while `compile_glue` is set, else as it is."""
        return partial(compiled(method.__func__), self) if self.compile_glue else method

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Output gate and o_proj: o [B, T, H * d] -> ([B, T, hidden], None), the attention's return shape."""
        if self.settings.output_gate:
            o = o * 2 * torch.sigmoid(F.linear(x, self.gate_weight))
        return self.o_proj(o), None

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The read o [B, T, ..., d] of hidden states x [B, T, hidden], in the recurrence's dtype -> the layer's
        output ([B, T, hidden], None) in x's dtype (`project_out`)."""
        return self.project_out(o.to(x.dtype).reshape(*x.shape[:2], -1), x)


@dataclass(frozen=True)
class MixerSpec:
    """The declaration of one mixer: everything the toolkit knows about it. Its module declares it once, as
    `MIXER = MixerSpec(...)`, and registry.py finds it by name (see registry.py for mixers from outside the package).

    Fields:
        settings: its frozen `MixerSettings` dataclass, whose NAME names the mixer (`--mixer NAME`, the config's
            layer kind, the prefix of its `--NAME-FIELD` flags) and whose fields, defaults and `__post_init__`
            checks are the schema of its settings (CLI flags, recipes' mixer_settings, config.json).
        layer: its `Mixer` subclass, built as layer(config, layer_idx, settings, source_has_qk_norm). Its module
            is the file an exported model carries for it.
        state: its decode state per key/value head, as people read it ("2 x [M, d]"); the bytes of a layer's
            state come from `layer.state_numel()`.
        kernels: the module of its Triton kernels, imported by `backend.kernel_module` where they can run; None:
            the PyTorch forms only.
        references: its PyTorch forms, the references its kernels are tested against.
        pictures: "module:function" drawing the evaluation report's pictures of one of its layers (see
            convert/evaluate/pictures.py); imported only by the report, so the model never depends on it.
        graph_safe: its training forward and backward on packed documents (with its kernels, on CUDA) read nothing
            back to the host and size nothing from the data but the shapes, and documents of no tokens change
            nothing, and its captured steps are faster than its eager ones: the training stages' `cuda_graphs:
            auto` then capture their steps as CUDA graphs (convert/train/graphs.py).
    """

    settings: type[MixerSettings]
    layer: type[Mixer]
    state: str
    kernels: str | None = None
    references: tuple[Callable, ...] = ()
    pictures: str | None = None
    graph_safe: bool = False

    NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")

    def __post_init__(self):
        settings, layer = self.settings, self.layer
        if not (isinstance(settings, type) and issubclass(settings, MixerSettings) and is_dataclass(settings)):
            raise TypeError(f"MixerSpec.settings = {settings!r}; expected a dataclass subclassing MixerSettings")
        if not (isinstance(layer, type) and issubclass(layer, Mixer)):
            raise TypeError(f"MixerSpec.layer = {layer!r}; expected a subclass of Mixer")
        name = settings.NAME
        if not self.NAME_PATTERN.fullmatch(name) or name in ("attention", MixerSettings.NAME):
            raise ValueError(
                f"{settings.__name__}.NAME = {name!r} cannot name a mixer; expected lowercase letters, digits and "
                "'_', starting with a letter, other than 'attention' and 'mixer'"
            )
        for field_name in ("kernels", "pictures"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"MixerSpec.{field_name} = {value!r}; expected an import path (a string) or None")

    @property
    def name(self) -> str:
        return self.settings.NAME

    @property
    def label(self) -> str:
        return self.settings.LABEL


def input_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) in x's dtype: a decode step's product of the layer's input, which a compiled step joins
    with the layer's other products of x (`Mixer.shared_input_weights`, decode_fusion.py)."""
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))


def one_kernel_step(kernels, x: torch.Tensor, cu_seqlens, float32: tuple | None, others: tuple = ()) -> bool:
    """Whether a mixer's step on x [B, T, hidden] runs as its one-kernel decode step: Triton kernels, one token, no
    packed documents, and a cached state the kernel may update where it lies (every tensor present and contiguous,
    those of `float32` in float32, and no gradients: a step that trains keeps the old state for its backward)."""
    if kernels is None or x.shape[1] != 1 or cu_seqlens is not None or float32 is None:
        return False
    tensors = (*float32, *others)
    return (
        all(t is not None and t.is_contiguous() for t in tensors)
        and all(t.dtype == torch.float32 for t in float32)
        and not torch.is_grad_enabled()
    )


def one_cache(cache, past_key_values):
    """The generation cache passed under either name: `cache` (transformers >= 5.24) or `past_key_values`."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("two different caches were passed, as `cache` and as `past_key_values`; pass one")
    return cache if cache is not None else past_key_values


def document_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `num_tokens` packed tokens (offsets cu_seqlens [S + 1]): its document [N] and its position within
    that document [N] (0 at the document's first token)."""
    bounds = cu_seqlens.to(torch.long)
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    doc = torch.searchsorted(bounds, tokens, right=True) - 1  # [N]
    return doc, tokens - bounds.gather(0, doc)  # gather: a lighter op on the host than indexing


def to_rows(x: torch.Tensor, cu_seqlens: torch.Tensor):
    """Packed documents x [B, T, ...] (offsets cu_seqlens [S + 1] into the flattened B * T tokens) as right-padded
    rows [S, L_max, ...]; also the mask of real entries [S, L_max] and where each token went (for `from_rows`)."""
    flat = x.flatten(0, 1)  # [B * T, ...]
    lengths = cu_seqlens.diff()  # [S]
    doc, offset = document_positions(cu_seqlens, flat.shape[0])  # [B * T] each
    L = int(lengths.max())
    rows = flat.new_zeros(lengths.numel(), L, *flat.shape[1:])
    rows[doc, offset] = flat
    mask = torch.zeros(lengths.numel(), L, dtype=torch.bool, device=x.device)
    mask[doc, offset] = True
    return rows, mask, (doc, offset)


def from_rows(rows: torch.Tensor, where, shape) -> torch.Tensor:
    """Inverse of `to_rows`: rows [S, L_max, ...] back to the packed [B, T, ...] layout."""
    doc, offset = where
    return rows[doc, offset].view(*shape, *rows.shape[2:])
