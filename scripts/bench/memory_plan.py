"""Per-GPU memory and speed of each stage of an 8B conversion: a Qwen3-8B-shaped teacher with random weights (the
real shapes), every stage run through the recipe pipeline (the same code path as a real run) for a few steps under
`accelerate launch`, torch.cuda.max_memory_allocated and the process's peak host memory recorded per process and
stage, and align's and train's tokens/s read from their DONE summaries. Host memory is the peak resident set
(VmHWM) and, sampled every 20 ms, the peaks of its anonymous part (RssAnon): what the process itself holds, and of
what it maps from files (RssFile: safetensors read in place, which the kernel can drop and read again), with the
files mapped most at that peak and the code running while it grew (each process's record in the report).

    python scripts/bench/memory_plan.py --processes 1,2 --strategy ddp,fsdp --out runs/memory-plan   # on 2 GPUs
    python scripts/bench/memory_plan.py --model tiny --processes 2 --strategy fsdp --out /tmp/plan   # a CPU smoke test
    python scripts/bench/memory_plan.py --model small --processes 2 --strategy fsdp --out /tmp/plan  # host memory, CPU

Every pair of --processes and --strategy is one run (a single process is run once: both strategies are the same
there). The teacher is made once and converted once; each run starts from that conversion. Prints one Markdown
table last (the largest value over a run's processes) and writes OUT/memory_plan.json after every run, so a job cut
short keeps the runs it finished: run again with the same --out, --steps and --model, it measures only the runs the
report lacks (or that failed) and keeps the others, named or not (delete the report to measure everything again).
Each process trains on one row of 2,048 tokens per step (the global batch grows with N). `--model tiny` and
`--model small` run on the CPU (torchrun, gloo; rows of 64 tokens, float32): tiny checks the script, small (190M
parameters, 0.7 GiB) is large enough for each process's host memory to show what the 8B plan's would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import subprocess
import sys
import threading
from pathlib import Path

from common import QWEN3_8B  # scripts/bench/: the model shapes the benchmarks share

from raven_convert.evaluate.speed import status_kib
from raven_convert.files import atomic_file, mappings

TINY = QWEN3_8B | {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY |= {"head_dim": 16, "intermediate_size": 128, "vocab_size": 256}
SMALL = QWEN3_8B | {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
SMALL |= {"intermediate_size": 4096, "vocab_size": 32000}
SHAPES = {"8b": QWEN3_8B, "small": SMALL, "tiny": TINY}  # --model
ON_CPU = {"small", "tiny"}  # run under torchrun and gloo, float32 rows of 64 tokens; 8b on the GPUs
HOST_KEYS = ("gpu", "host", "host_anon", "host_file")  # a stage's numbers: the largest over a run's processes
STAGES = ["convert", "align", "weights", "train", "extend", "evaluate", "export"]  # extend and evaluate: off (skipped)


def recipe(teacher: Path, data: Path, model: str, strategy: str, steps: int = 3) -> dict:
    """The plan's recipe: every other layer of the `model` (SHAPES) to Raven, `steps` steps of one row a stage."""
    cpu = model in ON_CPU
    seq = 64 if cpu else 2048
    precision = "no" if cpu else "bf16"
    stage = {"steps": steps, "batch_size": 1, "save_every": steps, "log_every": 1, "mixed_precision": precision}
    return {
        "source": str(teacher),
        "layers": [{"mixer": "raven", "layers": f"0-{SHAPES[model]['num_hidden_layers'] - 1}:2"}],
        "mixer_settings": {"raven": {"num_slots": 64, "top_k": 8}},
        "dtype": "float32" if cpu else "bfloat16",
        "data": {"source": str(data), "seq_len": seq, "validation_fraction": 0.1},
        "align": stage,
        "token_weights": {"enabled": True, "batch_size": 1},
        "train": stage | {"trainable": "mixers+lora", "gradient_checkpointing": not cpu},
        "export": {},
        "distributed": {"strategy": strategy},
    }


def make_inputs(out: Path, model: str) -> tuple[Path, Path]:
    """A random teacher of the `model`'s shapes (SHAPES; bfloat16, float32 on the CPU) with a character tokenizer,
    and a corpus."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    cpu = model in ON_CPU
    teacher, data = out / f"teacher-{model}", out / "corpus"
    if not (teacher / "config.json").is_file():
        config = Qwen3Config(**SHAPES[model])
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 8B: minutes on a CPU
            made = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if cpu else torch.bfloat16)
        made.save_pretrained(teacher)
        del made
        torch.cuda.empty_cache()  # this process stays alive beside the launched ones: it keeps no GPU memory
        vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>", "<unk>", *sorted(set(string.printable))])}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        backend.decoder = decoders.Fuse()
        tokens = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
        PreTrainedTokenizerFast(tokenizer_object=backend, **tokens).save_pretrained(teacher)
    if not data.is_dir():
        data.mkdir(parents=True)
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly big mice".split()
        count = 64 if cpu else 12  # about 100 rows of 2,048 tokens: the weights stage reads them all with 8B
        docs = [" ".join(words[i % 16 :] + words[: i % 16]) * 200 for i in range(count)]
        (data / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return teacher, data


def status_gib(field: str) -> float:
    """A memory field of /proc/self/status (VmHWM, RssAnon, ...) in GiB."""
    return status_kib(field) / 2**20


def host_peak_gib(reset: bool = False) -> float:
    """This process's peak resident memory (VmHWM) in GiB since the last reset; reset=True starts a new peak."""
    peak = status_gib("VmHWM")
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    return peak


def mapped_files_gib() -> dict[str, float]:
    """Every regular file (shared libraries aside) with at least 1 MiB of this process's resident memory mapped from
    it (files.mappings), as {path: GiB}, the most first."""
    resident = {}
    for m in mappings():
        if m["path"].startswith("/") and not (m["path"].endswith(".so") or ".so." in m["path"]):
            resident[m["path"]] = resident.get(m["path"], 0) + m.get("Rss", 0)
    largest = sorted(((name, kib) for name, kib in resident.items() if kib >= 1024), key=lambda kv: -kv[1])
    return {name: kib / 2**20 for name, kib in largest}


PACKAGES = {"convert", "kernels", "raven_convert", "raven_kernels", "raven_layers"}  # in a checkout or installed


def main_thread_at() -> str:
    """Where the main thread is in this project's code (its innermost frame in one of PACKAGES), as
    'folder/file.py:line function'; '-' outside it."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        code, path = frame.f_code, Path(frame.f_code.co_filename)
        if PACKAGES.intersection(path.parts[:-1]):
            return f"{path.parent.name}/{path.name}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return "-"


class HostPeak:
    """The peaks of this process's anonymous resident memory (RssAnon, GiB: what it holds itself) and of what it maps
    from files (RssFile) while the block runs, sampled by a thread every `interval` seconds (the kernel keeps no peak
    of either); each rise of either peak counted to where the main thread was when it was seen (`grew_anon`, `grew`:
    a rise inside a call that holds the GIL counts where the thread is next seen), and the `top` files mapped most,
    listed as the peak grew (`files`: the listing that found the most mapped): a process that holds or maps more
    than its share shows which code did it, and which file."""

    def __init__(self, interval: float = 0.02, top: int = 3):
        self.interval, self.top = interval, top
        self.anon = self.file = 0.0
        self.files: dict[str, float] = {}
        self.grew: dict[str, float] = {}
        self.grew_anon: dict[str, float] = {}

    def _sample(self) -> None:
        listed = seen = 0.0
        while not self._stop.wait(self.interval):
            anon, file = status_gib("RssAnon"), status_gib("RssFile")
            where = main_thread_at() if anon > self.anon or file > self.file else "-"
            if anon > self.anon:
                self.grew_anon[where] = self.grew_anon.get(where, 0.0) + anon - self.anon
                self.anon = anon
            if file > self.file:
                self.grew[where] = self.grew.get(where, 0.0) + file - self.file
                self.file = file
                if file > 1.02 * listed:  # smaps is slow to read: again only once the peak grew 2%
                    listed, found = file, mapped_files_gib()
                    # read after the peak's sample, smaps may come after a mapping is gone: the fullest listing stays
                    if (total := sum(found.values())) >= seen:
                        seen, self.files = total, dict(list(found.items())[: self.top])

    def __enter__(self) -> HostPeak:
        self.anon, self.file, self._stop = status_gib("RssAnon"), status_gib("RssFile"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.anon = max(self.anon, status_gib("RssAnon"))

    def record(self) -> dict:
        """This block's numbers for a stage's record: host_anon, host_file, files, and where each peak grew (grew_anon,
        grew: the 3 largest rises)."""
        grew, grew_anon = (dict(sorted(g.items(), key=lambda kv: -kv[1])[:3]) for g in (self.grew, self.grew_anon))
        return {
            "host_anon": self.anon,
            "host_file": self.file,
            "files": self.files,
            "grew": grew,
            "grew_anon": grew_anon,
        }


def worker(args) -> None:
    """One process of the launch: each stage after convert through run_recipe, its peak memory recorded."""
    import torch

    from raven_convert.train.recipe import parse_recipe
    from raven_convert.train.stages import run_recipe

    plan = parse_recipe(json.loads(Path(args.recipe).read_text()))
    peaks = {}
    for stage in STAGES[1:]:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        host_peak_gib(reset=True)
        with HostPeak() as host:
            run_recipe(plan, args.run_dir, stages=[stage])
        gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        peaks[stage] = {"gpu": gpu, "host": host_peak_gib()} | host.record()
    rank = int(os.environ.get("RANK", "0"))
    Path(args.report).with_suffix(f".rank{rank}.json").write_text(json.dumps(peaks))


def launch(args, processes: int, recipe_path: Path, run_dir: Path, report: Path) -> None:
    """The worker on `processes` processes: accelerate launch on GPUs, torchrun on the CPU (--model tiny, small)."""
    env = dict(os.environ)
    if args.model in ON_CPU:  # accelerate launch --cpu starts one process (several are its MPI path): torchrun, gloo
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        env["CUDA_VISIBLE_DEVICES"] = ""  # on a GPU host too: several processes would share its first GPU
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
        command += ["--multi_gpu"] if processes > 1 else []
    command += [__file__, "--worker", "--recipe", str(recipe_path), "--run-dir", str(run_dir), "--report", str(report)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def convert_once(args, out: Path, teacher: Path, data: Path) -> dict:
    """The convert stage, run once on one process into OUT/converted (every run starts from a hard-linked copy of
    it): its peak memory (convert runs on the main process alone under any launch)."""
    import torch

    from raven_convert.train.recipe import parse_recipe
    from raven_convert.train.stages import run_recipe

    converted = out / "converted"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    host_peak_gib(reset=True)
    with HostPeak() as host:
        run_recipe(parse_recipe(recipe(teacher, data, args.model, "ddp")), converted, stages=["convert"])
    gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    torch.cuda.empty_cache()
    return {"gpu": gpu, "host": host_peak_gib()} | host.record()


def rate(run_dir: Path, stage: str) -> float | None:
    done = run_dir / stage / "DONE"
    return json.loads(done.read_text()).get("tokens_per_second") if done.is_file() else None


def earlier_runs(report: Path, meta: dict) -> list[dict]:
    """The runs an earlier invocation measured into `report` with the same model and steps: [] when there is none (or
    it measured something else)."""
    if not report.is_file():
        return []
    earlier = json.loads(report.read_text())
    if {k: earlier.get(k) for k in meta} != meta:
        print(f"{report} measured another model or step count: measuring every run again", flush=True)
        return []
    return earlier["runs"]


def with_earlier(done: dict, runs: list[dict]) -> list[dict]:
    """`runs` (the conversion's row first) with the runs measured before that this invocation did not name, in order
    of process count."""
    named = {(r["strategy"], r["processes"]) for r in runs}
    rest = runs[1:] + [r for key, r in done.items() if key not in named]
    return runs[:1] + sorted(rest, key=lambda r: (r["processes"], r["strategy"]))


def save(report: Path, meta: dict, runs: list[dict]) -> None:
    with atomic_file(report) as f:
        f.write(json.dumps(meta | {"runs": runs}, indent=1))


def parse_list(text: str, kind, allowed=None) -> list:
    values = [kind(v) for v in text.split(",")]
    bad = [v for v in values if (allowed is not None and v not in allowed) or (kind is int and v < 1)]
    if bad:
        raise SystemExit(f"{bad[0]!r} is not allowed here: " + (", ".join(allowed) if allowed else "integers >= 1"))
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1", help="comma-separated process counts, e.g. 1,2,4,8")
    parser.add_argument("--strategy", default="fsdp", help="comma-separated: ddp, fsdp")
    parser.add_argument("--steps", type=int, default=None, help="align and train steps (default 6; 3 on the CPU)")
    parser.add_argument("--out", default="runs/memory-plan")
    shapes = "the teacher's shapes: 8b on GPUs; small and tiny on the CPU"
    parser.add_argument("--model", default="8b", choices=list(SHAPES), help=shapes)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    counts = parse_list(args.processes, int)
    strategies = parse_list(args.strategy, str, ("ddp", "fsdp"))
    args.steps = args.steps or (3 if args.model in ON_CPU else 6)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "steps": args.steps, "shape": SHAPES[args.model]}
    report_path = out / "memory_plan.json"
    done = {(r["strategy"], r["processes"]): r for r in earlier_runs(report_path, meta) if "failed" not in r}
    teacher, data = make_inputs(out, args.model)
    convert = done.get(("-", 1)) if (out / "converted" / "convert" / "DONE").is_file() else None
    runs = [convert or {"strategy": "-", "processes": 1, "stages": {"convert": convert_once(args, out, teacher, data)}}]
    configs = [(n, s) for n in counts for s in (strategies if n > 1 else strategies[:1])]
    for processes, strategy in configs:
        name = f"{strategy}-{processes}"
        row = {"strategy": strategy if processes > 1 else "one process", "processes": processes}
        if (row["strategy"], processes) in done:
            print(f"{name}: measured before ({report_path}), kept", flush=True)
            runs.append(done[row["strategy"], processes])
            continue
        path = out / f"recipe-{name}.json"
        path.write_text(json.dumps(recipe(teacher, data, args.model, strategy, args.steps)))
        run_dir, report = out / f"run-{name}", out / f"memory-{name}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(["cp", "-al", str(out / "converted"), str(run_dir)], check=True)
        try:
            launch(args, processes, path, run_dir, report)
        except subprocess.CalledProcessError as error:
            runs.append(row | {"failed": str(error)})
        else:
            ranks = [json.loads(report.with_suffix(f".rank{r}.json").read_text()) for r in range(processes)]
            stages = {s: {k: max(r[s].get(k) or 0 for r in ranks) for k in HOST_KEYS} for s in STAGES[1:]}
            rates = {s: rate(run_dir, s) for s in ("align", "train")}
            runs.append(row | {"stages": stages, "ranks": ranks, "tokens_per_second": rates})
        shutil.rmtree(run_dir)  # an 8B run leaves tens of GB of model files; its numbers are in the report
        save(report_path, meta, with_earlier(done, runs))
    runs = with_earlier(done, runs)
    save(report_path, meta, runs)
    print_table(runs, args.model in ON_CPU, weights_gib(teacher))
    return 0


def weights_gib(model_dir: Path) -> float:
    """The size of a model directory's safetensors files in GiB: the model's size in its dtype."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**30


def print_table(runs: list[dict], cpu: bool, model_gib: float) -> None:
    """One row per stage, one column per run: peak GPU memory (GiB, largest process) / peak host memory (GiB), its
    anonymous part in parentheses (runs measured before it was recorded have none); then each run's largest host
    peak and anonymous peak over its stages as multiples of the model's size (`model_gib`, issue 53's measure)."""
    shown = [STAGES[0]] + [s for s in STAGES[1:] if s not in ("extend", "evaluate")]
    heads = [f"{r['processes']} x {r['strategy']}" if r["processes"] > 1 else r["strategy"] for r in runs[1:]]
    unit = "peak host GiB per process (CPU run)" if cpu else "GiB per GPU (max allocated) / host GiB per process"
    unit += ", (anonymous: what the process itself holds, not files mapped from disk)"
    print(f"\n{unit}\n")
    print("| stage | " + " | ".join(heads) + " |")
    print("| --- " * (len(heads) + 1) + "|")
    for stage in shown:
        cells = []
        for r in runs[1:]:
            got = runs[0]["stages"]["convert"] if stage == "convert" else r.get("stages", {}).get(stage)
            if got is None:
                cells.append("failed")
            else:
                anon = f" ({got['host_anon']:.{2 if cpu else 1}f})" if got.get("host_anon") is not None else ""
                cells.append(f"{got['host']:.2f}{anon}" if cpu else f"{got['gpu']:.1f} / {got['host']:.1f}{anon}")
        print(f"| {stage} | " + " | ".join(cells) + " |")
    for key, label in (("host", "host peak"), ("host_anon", "anonymous peak")):
        cells = []
        for r in runs[1:]:
            peaks = [runs[0]["stages"]["convert"]] + [v for v in r.get("stages", {}).values() if v]
            found = [v[key] for v in peaks if v.get(key) is not None]
            cells.append(f"{max(found) / model_gib:.2f}x" if found and model_gib else "-")
        print(f"| {label}, x the model ({model_gib:.2f} GiB) | " + " | ".join(cells) + " |")
    for stage in ("align", "train"):
        cells = [
            f"{r['tokens_per_second'][stage]:,.0f}" if r.get("tokens_per_second", {}).get(stage) else "-"
            for r in runs[1:]
        ]
        print(f"| {stage} tokens/s | " + " | ".join(cells) + " |")
    for part, grew, title in (
        ("host_anon", "grew_anon", "The most held (RssAnon GiB), the code it grew in"),
        (
            "host_file",
            "grew",
            "The most mapped from files (RssFile GiB, shared libraries included), the files, the code it grew in",
        ),
    ):
        lines = []
        for r, head in zip(runs[1:], heads):
            traced = [
                (got[part], rank, stage, got)
                for rank, stages in enumerate(r.get("ranks", []))
                for stage, got in stages.items()
                if got.get(grew) is not None
            ]
            if traced:
                gib, rank, stage, got = max(traced, key=lambda t: t[0])
                files = ", ".join(f"{Path(name).name} {g:.2f}" for name, g in got["files"].items()) or "no data file"
                where = ", ".join(f"{g:.2f} at {at}" for at, g in got[grew].items()) or "nothing"
                top = f" ({files})" if part == "host_file" else ""
                lines.append(f"- {head}: {gib:.2f} GiB, process {rank} in {stage}{top}; it grew {where}")
        if lines:  # runs measured before the trace have none
            print(f"\n{title}:\n" + "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
