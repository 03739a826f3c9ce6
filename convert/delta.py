"""A trained hybrid as a small file (what it changed of its teacher), and the hybrid rebuilt from teacher and file.

    python -m raven_convert.delta save RUN/extend/model TEACHER sila.delta.safetensors --bf16
    python -m raven_convert.delta apply sila.delta.safetensors TEACHER OUT_DIR             # the model directory again

Converting and training change few of the teacher's tensors: the mixers are new, LoRA merged into the kept
attention changes its matrices by a low-rank update (at most the sum of the stages' ranks), and the rest stays
bit-equal. `save_delta` keeps the new tensors whole, each changed matrix whose difference from the teacher is of rank
at most `max_rank` as two factors (an SVD, exact up to a few units of rounding), other changed tensors whole, and the
hybrid's config; nothing of the teacher. `apply_delta` loads the teacher, adds the file back and saves a complete
model directory (code, config, tokenizer, card) as export does. A run on a machine whose outputs must stay small
(the device's 64 MiB) brings back its trained hybrids this way for later evaluation. SmolLM2 with SILA on 15
layers and two merged rank-16 LoRAs on the rest (simulated on CPU): 641 MB of weights, a delta of 89 MB, 54 MB
with --bf16 (the mixers' own projections, trained whole, are most of it; their LoRA-merged neighbours are 105
pairs of rank-32 factors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from raven_convert.files import atomic_file
from raven_convert.sources import Source, model_fingerprint

FORMAT = "raven-delta/1"
FACTORS = (".delta_a", ".delta_b")  # name + suffix: [m, r] and [r, n], the difference is a @ b
SVD_THREADS = 4


def _factors(new: torch.Tensor, old: torch.Tensor, max_rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a [m, r], b [r, n]) with old + a @ b equal to `new` [m, n] up to a few units of its dtype's rounding, when
    some r <= max_rank does it with fewer numbers than the matrix; else None. A merged LoRA update is exactly low
    rank, but `new` holds it rounded: singular values under that rounding's (noise) do not count."""
    m, n = new.shape
    difference = new.double() - old.double()
    u, s, vh = torch.linalg.svd(difference, full_matrices=False)
    unit = torch.finfo(new.dtype).eps * new.abs().max().double()  # the rounding of the largest entry
    r = max(int((s > 8 * unit * max(m, n) ** 0.5).sum()), 1)  # a noise matrix's singular values: ~ entry x sqrt(m)
    if r > max_rank or r * (m + n) >= m * n:
        return None
    a, b = u[:, :r] * s[:r], vh[:r]
    if (a @ b - difference).abs().max() > 8 * unit:
        return None
    return a.float(), b.float()


def save_delta(model_dir: str | Path, teacher: str, out: str | Path, max_rank: int = 64, whole_dtype=None) -> dict:
    """Write the hybrid in `model_dir` as its difference from `teacher` (a model directory, Hub id or .gguf, as
    `convert --src` takes it) to the safetensors file `out`, atomically. `whole_dtype` (e.g. torch.bfloat16, half
    the size; evaluation runs in bf16 anyway) stores the whole tensors in that dtype. Returns {"tensors",
    "factored", "bytes", "model_bytes"}: how many tensors it holds whole, how many as factors, its size and the
    dense weights' size."""
    # the SVDs are of small matrices: a few threads do them, where all the cores of a busy host spin on each other
    # (docs/lab/2026-11-27-ablations-06-graphed-align.md)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, SVD_THREADS))
    try:
        return _save_delta(model_dir, teacher, out, max_rank, whole_dtype)
    finally:
        torch.set_num_threads(threads)


def _save_delta(model_dir, teacher, out, max_rank: int, whole_dtype) -> dict:
    from safetensors.torch import save

    from raven_convert.train.models import load_hybrid

    hybrid = load_hybrid(Path(model_dir), "cpu")
    dtype = next(hybrid.parameters()).dtype
    base = Source.resolve(str(teacher)).load_model(str(dtype).removeprefix("torch."))
    before = base.state_dict()
    tensors, factored, dense = {}, 0, 0
    for name, value in hybrid.state_dict().items():
        dense += value.numel() * value.element_size()
        old = before.get(name)
        if old is not None and old.shape == value.shape and torch.equal(old.to(value.dtype), value):
            continue  # the teacher's, unchanged
        pair = None
        if old is not None and old.shape == value.shape and value.dim() == 2:
            pair = _factors(value, old.to(value.dtype), max_rank)
        if pair is None:
            tensors[name] = value.to(whole_dtype or value.dtype, copy=True)  # a copy: tied tensors share memory
        else:
            tensors[name + FACTORS[0]], tensors[name + FACTORS[1]] = (t.contiguous() for t in pair)
            factored += 1
    metadata = {
        "format": FORMAT,
        "config": hybrid.config.to_json_string(use_diff=False),
        "teacher": str(teacher),
        "teacher_fingerprint": model_fingerprint(base),
    }
    data = save(tensors, metadata=metadata)
    with atomic_file(out, "wb") as f:
        f.write(data)
    return {"tensors": len(tensors) - 2 * factored, "factored": factored, "bytes": len(data), "model_bytes": dense}


def apply_delta(delta: str | Path, teacher: str, out: str | Path) -> Path:
    """The hybrid `save_delta` wrote to `delta`, rebuilt on `teacher` (the same weights it was saved against, else
    ValueError naming both) and saved as a complete model directory at `out`."""
    from safetensors import safe_open

    from raven_convert.export import save_hybrid
    from raven_convert.train.models import hybrid_from_state
    from raven_layers import HybridConfig, HybridForCausalLM

    with safe_open(str(delta), "pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{delta} is not a hybrid delta ({FORMAT}); its metadata says {metadata.get('format')!r}")
        stored = {name: f.get_tensor(name) for name in f.keys()}
    config = HybridConfig.from_dict(json.loads(metadata["config"]))
    dtype = config.torch_dtype if isinstance(config.torch_dtype, torch.dtype) else getattr(torch, config.torch_dtype)
    source = Source.resolve(str(teacher))
    base = source.load_model(str(dtype).removeprefix("torch."))
    if model_fingerprint(base) != metadata["teacher_fingerprint"]:
        raise ValueError(
            f"{delta} was saved against the teacher {metadata['teacher']!r}; {teacher!r} has other weights or config"
        )
    with torch.device("meta"):
        names = HybridForCausalLM(config).state_dict()
    teacher_state = base.state_dict()  # a mixer's layer drops what its attention had (Qwen2's q/k/v biases)
    state = {k: teacher_state[k].to(dtype) for k in names if k in teacher_state}
    for name, value in stored.items():
        if name.endswith(FACTORS[0]):
            target = name.removesuffix(FACTORS[0])
            b = stored[target + FACTORS[1]]
            state[target] = (state[target].float() + value @ b).to(dtype)
        elif not name.endswith(FACTORS[1]):
            state[name] = value.to(dtype)
    hybrid = hybrid_from_state(config, state, base)
    return save_hybrid(hybrid, source.load_tokenizer(), out, base_model=metadata["teacher"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    save_cmd = commands.add_parser("save", help="a trained hybrid's difference from its teacher, as one file")
    save_cmd.add_argument("model_dir")
    save_cmd.add_argument("teacher")
    save_cmd.add_argument("out")
    save_cmd.add_argument("--max-rank", type=int, default=64, help="the largest rank stored as factors")
    save_cmd.add_argument("--bf16", action="store_true", help="whole tensors in bfloat16 (half the size)")
    apply_cmd = commands.add_parser("apply", help="the hybrid again, from its teacher and its delta file")
    apply_cmd.add_argument("delta")
    apply_cmd.add_argument("teacher")
    apply_cmd.add_argument("out")
    args = parser.parse_args(argv)
    bf16 = torch.bfloat16
    if args.command == "save":
        if args.max_rank < 1:
            parser.error(f"--max-rank {args.max_rank} is not allowed; expected an integer >= 1")
        if not (Path(args.model_dir) / "config.json").is_file():
            parser.error(f"{args.model_dir} is not a model directory (no config.json)")
        summary = save_delta(
            args.model_dir, args.teacher, args.out, args.max_rank, whole_dtype=bf16 if args.bf16 else None
        )
        print(
            f"[delta] {args.out}: {summary['tensors']} tensors whole, {summary['factored']} as low-rank factors, "
            f"{summary['bytes'] / 2**20:,.1f} MiB (the model's weights: {summary['model_bytes'] / 2**20:,.1f} MiB)"
        )
    else:
        if not Path(args.delta).is_file():
            parser.error(f"{args.delta} does not exist")
        print(f"[delta] {apply_delta(args.delta, args.teacher, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
