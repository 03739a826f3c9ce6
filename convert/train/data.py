"""Training data: documents from local files or the Hub, packed into fixed-length rows, cached once, and served in
a seeded, resumable shuffled order.

    train, val = build_dataset("/data/corpus/*.jsonl.gz", tokenizer, seq_len=2048, cache_dir="cache/data")
    batches = batch_iterator(train, batch_size=8, seed=0, start_step=resume_step)
    align(teacher, hybrid, batches, steps=200)

Packing: every document is tokenised without special tokens, an EOS is appended, all documents are concatenated,
and the stream is cut into rows of `seq_len` tokens (the incomplete tail is dropped). Documents cross row
boundaries; each row carries `document_ids` (0, 1, 2, ... within the row) and `position_ids` (restarting at 0 at
every document start and at the row start), so a model can reset its state or attention at document boundaries.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from raven_convert.files import atomic_file
from raven_convert.train.retrieval_data import RetrievalMix, WholeDocument, mix_retrieval

# File extension -> datasets builder. Compressed variants (.gz, .bz2, .xz, .zst) are read transparently.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
FIELDS = ("input_ids", "document_ids", "position_ids")
OPTIONAL_FIELDS = ("answers",)  # rows packed by pack_documents have them; rows built otherwise may not
CACHE_FORMAT = 2  # bump when the cached layout or the packing rule changes
MAX_SKIPPED = 0.05  # the share of records without the text field a run may skip (data.max_skipped); more stops it
SAMPLED_FILES = 16  # check_data_source reads a sample of this many files (every file is checked for readability)
# Tokenised into the cache key, so that a different tokenizer saved under the same name gets its own cache.
PROBES = (
    "Hello, world! The year 2024; pi = 3.14159.",
    "  def f(x):\n\treturn x ** 2  # über ünïcödé 漢字 🙂",
    "</s><s><|endoftext|> special-looking text",
)


def builder_for(path: str | Path) -> str:
    """The datasets builder ("json", "text" or "parquet") for a file, by its extension."""
    name = Path(path).name.lower()
    for compression in COMPRESSIONS:
        if name.endswith(compression):
            name = name[: -len(compression)]
            break
    suffix = Path(name).suffix
    if suffix not in BUILDERS:
        known = ", ".join(BUILDERS)
        raise ValueError(f"unknown file extension for {path}: expected one of {known} (optionally compressed)")
    return BUILDERS[suffix]


def _known(path: Path) -> bool:
    try:
        builder_for(path)
        return True
    except ValueError:
        return False


def local_files(source) -> list[Path] | None:
    """The local files `source` names (a file, a directory, a glob, or a list of these), sorted; None when `source`
    is a Hub dataset name. A directory contributes its files with known extensions (recursively, hidden ones
    skipped); a path that looks local but matches nothing raises FileNotFoundError."""
    if isinstance(source, (list, tuple)):
        files = []
        for item in source:
            found = local_files(item)
            if found is None:
                raise FileNotFoundError(f"no such file or directory: {item}")
            files.extend(found)
        return files
    text = os.path.expanduser(str(source))
    path = Path(text)
    if path.is_dir():
        hidden = lambda f: any(part.startswith(".") for part in f.relative_to(path).parts)  # noqa: E731
        files = sorted(f for f in path.rglob("*") if f.is_file() and _known(f) and not hidden(f))
        if not files:
            raise ValueError(f"directory {path} holds no files with a known extension ({', '.join(BUILDERS)})")
        return files
    if path.is_file():
        return [path]
    if glob.has_magic(text):
        files = sorted(Path(f) for f in glob.glob(text, recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"no files match {text}")
        return files
    if isinstance(source, Path) or text.startswith(("/", "./", "../")) or _known(path):
        raise FileNotFoundError(f"no such file or directory: {text}")
    return None


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or unreadable data file raises: gzip/IO errors, truncation, bad bytes, bad JSON or
    parquet (pyarrow), and datasets' wrapper of those."""
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowException

    return OSError, EOFError, UnicodeDecodeError, ArrowException, DatasetGenerationError


def _damaged(source, err: BaseException) -> ValueError:
    return ValueError(
        f"data.source {source}: cannot read it, the file is damaged, truncated or not in the format its extension "
        f"says ({type(err).__name__}: {str(err).strip() or 'no records'})"
    )


def _records(source, split: str, streaming: bool, text_sample_by: str) -> Iterator[dict]:
    """Every record of `source` (see load_documents), read with the datasets builders; a damaged file raises
    ValueError naming it instead of the reader's own exception."""
    from datasets import load_dataset

    files = local_files(source)
    errors = _read_errors() if files is not None else ()  # a Hub dataset's own errors say more than "damaged"
    try:
        if files is None:
            name, _, config = str(source).partition(":")
            dataset = load_dataset(name, config or None, split=split, streaming=streaming)
        else:
            builders = {builder_for(f) for f in files}
            if len(builders) > 1:
                raise ValueError(f"{source} mixes file formats ({', '.join(sorted(builders))}); use one format")
            (builder,) = builders
            options = {"sample_by": text_sample_by} if builder == "text" else {}
            data_files = {split: [str(f) for f in files]}
            dataset = load_dataset(builder, data_files=data_files, split=split, streaming=streaming, **options)
        yield from dataset
    except StopIteration:  # the json builder's schema probe of a file without records
        raise ValueError(f"data.source {source}: holds no records") from None
    except errors as err:
        raise _damaged(source, err) from None


def check_skipped(
    where, text_field: str, missing: int, seen: int, sample: bool = False, max_skipped: float = MAX_SKIPPED
) -> None:
    """Report records without `text_field` on stderr; more than `max_skipped` of them raises ValueError."""
    if not missing:
        return
    share = missing / max(seen, 1)
    counted = f"{missing:,} of {seen:,} {'sampled ' if sample else ''}records ({share:.0%}) of {where}"
    if share > max_skipped:
        raise ValueError(
            f"data.text_field {text_field!r}: {counted} have no such field, and data.max_skipped allows "
            f"{max_skipped:.0%}. Set data.text_field to the field that holds the text, or data.max_skipped to the "
            f"share you accept to lose (e.g. --set data.max_skipped={min(1.0, round(share + 0.005, 2))})"
        )
    print(f"[data] skipping {counted}: no field {text_field!r}", file=sys.stderr)


def load_documents(
    source,
    text_field: str = "text",
    split: str = "train",
    streaming: bool | None = None,
    max_documents: int | None = None,
    text_sample_by: str = "line",
    max_skipped: float = MAX_SKIPPED,
) -> Iterable[str]:
    """Yield the `text_field` of every record of `source`, in order, skipping empty and missing texts.

    `source` is a local file, directory or glob (.jsonl/.json, .txt, .parquet, optionally .gz; read with the
    datasets json/text/parquet builders), a list of those, or a Hub dataset name, optionally with a config after a
    colon ("HuggingFaceFW/fineweb-edu:sample-10BT"). `streaming=None` streams (reads lazily, copying nothing into
    the datasets cache). For .txt files, `text_sample_by` is the text builder's unit: "line" (one document per
    line), "paragraph" or "document" (one per file). The first record is read at once, so that a missing field
    raises ValueError here, naming the field and the columns found. Records without the field are counted: once
    read, their share is reported, and more than `max_skipped` of them raises ValueError (see check_skipped).
    """
    records = _records(source, split, True if streaming is None else streaming, text_sample_by)
    first = next(records, None)
    if first is None:
        return iter(())
    if text_field not in first:
        raise ValueError(f"{source}: no text field {text_field!r}; columns found: {sorted(first)}")

    def texts() -> Iterator[str]:
        seen = missing = kept = 0
        for record in itertools.chain([first], records):
            seen += 1
            text = record.get(text_field)
            missing += text is None
            if text:
                yield text
                kept += 1
                if kept == max_documents:
                    break
        check_skipped(source, text_field, missing, seen, max_skipped=max_skipped)

    return texts()


def check_data_source(
    source,
    text_field: str = "text",
    text_sample_by: str = "line",
    sample: int = 256,
    hint: str = "",
    max_skipped: float = MAX_SKIPPED,
) -> int:
    """Validate a local data source before any model is loaded; returns the number of files (0 for a Hub name,
    which is not checked). Every file must be readable and non-empty; the first `sample` records of each of the
    first SAMPLED_FILES files are read, so that damaged files and a missing or mostly missing text field raise
    ValueError here, naming the file and the field. `hint` ends the message of a source that does not exist."""
    try:
        files = local_files(source)
    except FileNotFoundError as err:
        raise ValueError(f"data.source: {err}{hint}") from None
    if files is None:
        return 0
    for f in files:
        try:
            with open(f, "rb") as handle:
                empty = not handle.read(1)
        except OSError as err:
            raise ValueError(f"data.source {f}: cannot read it ({err.strerror or err})") from None
        if empty:
            raise ValueError(f"data.source {f}: the file is empty; expected records with a {text_field!r} field")
    for f in files[:SAMPLED_FILES]:
        seen = missing = 0
        columns: set[str] = set()
        for record in itertools.islice(_records(f, "train", True, text_sample_by), sample):
            seen += 1
            columns |= set(record)
            missing += record.get(text_field) is None
        if not seen:
            raise ValueError(f"data.source {f}: holds no records")
        if missing == seen:
            raise ValueError(
                f"data.text_field {text_field!r}: no record of {f} has this field; fields found: {sorted(columns)}"
            )
        check_skipped(f, text_field, missing, seen, sample=True, max_skipped=max_skipped)
    return len(files)


class Progress:
    """Documents and tokens per second on stderr, at most every `every` seconds and once at the end."""

    def __init__(self, label: str, every: float = 5.0):
        self.label, self.every = label, every
        self.documents = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if time.perf_counter() - self.last >= self.every:
            self.report()

    def report(self, final: bool = False) -> None:
        self.last = time.perf_counter()
        rate = self.tokens / max(self.last - self.start, 1e-9)
        print(
            f"[{self.label}] {self.documents:,} documents | {self.tokens:,} tokens | {rate:,.0f} tok/s"
            + (f" | done in {self.last - self.start:.1f}s" if final else ""),
            file=sys.stderr,
        )


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text: no BOS/EOS added, and special-token strings inside the text ("</s>") split into
    ordinary tokens, so that only the EOS that packing appends marks a document's end."""
    encoded = tokenizer(
        texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False, verbose=False
    )
    return encoded["input_ids"]


def pack_documents(
    tokenizer, documents: Iterable[str], seq_len: int, eos_token_id: int | None = None, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Tokenise `documents`, append EOS to each, concatenate, and cut into rows of `seq_len` (tail dropped).

    Returns {"input_ids", "document_ids", "position_ids"}, each [N, seq_len] int32: `document_ids` numbers the
    segment each token belongs to within its row from 0 (it steps up at each document start), and `position_ids`
    counts from 0 at every segment start and at every row start; and "answers" [N, seq_len] bool, True at the
    answer tokens of synthetic retrieval samples. Documents are tokenised `batch_size` at a time.

    A `WholeDocument` (synthetic retrieval samples) is kept inside one row: when it does not fit in what is left of
    the current row it waits, the next document fills the row up, and it goes at the start of the next row, the
    rest of that document after it as a new segment. One longer than seq_len is dropped, and counted. Its answer
    tokens are those its text has beyond its text without the answer (`answer_chars`), tokenised alone.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} is not allowed; expected an integer >= 1")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id")
    chunks, starts, answers, progress = [], [], [], Progress("pack")
    pending: deque[tuple[list[int], int]] = deque()  # whole documents waiting for a row start, their answer tokens
    flat: list[int] = []  # this batch's tokens
    pos = dropped = 0

    def put(ids: list[int], answer: int = 0) -> None:  # one segment at the end of the stream
        nonlocal pos
        starts.append(pos)
        if answer:
            answers.append((pos + len(ids) - 1 - answer, answer))  # the last tokens before the EOS
        flat.extend(ids)
        pos += len(ids)

    documents = iter(documents)
    while batch := list(itertools.islice(documents, batch_size)):
        encoded = tokenize(tokenizer, batch)
        for text, ids, answer in zip(batch, encoded, _answer_tokens(tokenizer, batch, encoded)):
            doc = [*ids, eos]
            if isinstance(text, WholeDocument):
                whole = (doc, answer)
                if len(doc) > seq_len:
                    dropped += 1
                elif len(doc) <= seq_len - pos % seq_len:
                    put(*whole)
                else:
                    pending.append(whole)
                continue
            while pending and len(doc) > (room := seq_len - pos % seq_len):
                put(doc[:room])  # the row ends inside this document: the waiting ones start the next row
                doc = doc[room:]
                while pending and len(pending[0][0]) <= seq_len - pos % seq_len:
                    put(*pending.popleft())
            put(doc)
        chunks.append(torch.tensor(flat, dtype=torch.int32))
        progress.update(len(batch), len(flat))
        flat.clear()
    progress.report(final=True)
    if dropped:
        print(f"[data] dropped {dropped} retrieval sample(s) longer than seq_len = {seq_len} tokens", file=sys.stderr)

    stream = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int32)  # [L]
    rows = stream.numel() // seq_len
    segment_starts = torch.zeros(stream.numel(), dtype=torch.bool)  # [L]: True at each segment's first token
    segment_starts[torch.tensor(starts, dtype=torch.long)] = True
    input_ids = stream[: rows * seq_len].view(rows, seq_len)  # [N, T]
    boundary = segment_starts[: rows * seq_len].view(rows, seq_len).clone()  # [N, T]: a segment starts here
    boundary[:, 0] = True
    document_ids = boundary.int().cumsum(1) - 1  # [N, T], 0 at each row start
    index = torch.arange(seq_len).expand(rows, seq_len)  # [N, T]
    segment_start = torch.where(boundary, index, 0).cummax(1).values  # [N, T]
    position_ids = index - segment_start  # [N, T]
    answer = torch.zeros(stream.numel(), dtype=torch.bool)  # [L]
    for start, count in answers:
        answer[start : start + count] = True
    return {
        "input_ids": input_ids.contiguous(),
        "document_ids": document_ids.to(torch.int32),
        "position_ids": position_ids.to(torch.int32),
        "answers": answer[: rows * seq_len].view(rows, seq_len).clone(),
    }


def _answer_tokens(tokenizer, texts: list[str], encoded: list[list[int]]) -> list[int]:
    """How many of each text's tokens (`encoded`) are its answer: for a WholeDocument with one, its tokens less
    those of its text without the answer (answers start at a space, where tokens part); 0 for the others."""
    answered = [i for i, t in enumerate(texts) if isinstance(t, WholeDocument) and t.answer_chars]
    counts = [0] * len(texts)
    if answered:
        prompts = tokenize(tokenizer, [texts[i][: len(texts[i]) - texts[i].answer_chars] for i in answered])
        for i, prompt in zip(answered, prompts):
            counts[i] = max(len(encoded[i]) - len(prompt), 0)
    return counts


class PackedDataset(Dataset):
    """Rows of packed tensors ({"input_ids", "document_ids", "position_ids"} and "answers" where given, each
    [N, T]), optionally a subset `rows` of them (shared storage, no copy). Items and batches are int64 with an
    all-ones "attention_mask"."""

    def __init__(self, tensors: dict[str, torch.Tensor], rows: torch.Tensor | None = None):
        self.tensors = {k: tensors[k] for k in FIELDS} | {k: tensors[k] for k in OPTIONAL_FIELDS if k in tensors}
        total = self.tensors["input_ids"].shape[0]
        self.rows = torch.arange(total) if rows is None else torch.as_tensor(rows, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return self.tensors["input_ids"].shape[1]

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Items `indices` (positions in this dataset) stacked: each field [B, T] int64."""
        rows = self.rows[torch.as_tensor(indices, dtype=torch.long)]
        out = {k: v[rows].long() for k, v in self.tensors.items()}
        return out | {"attention_mask": torch.ones_like(out["input_ids"])}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.batch(torch.tensor([i])).items()}  # each [T]


def cache_key(
    source,
    tokenizer,
    seq_len: int,
    max_documents: int | None,
    text_field="text",
    split="train",
    retrieval: RetrievalMix | None = None,
) -> str:
    """sha256 (hex) of everything that decides the packed rows: the source (a Hub name, or each local file's
    resolved path, size and modification time), text field and split, the tokenizer (name_or_path, vocabulary
    size, EOS id, and a hash of its tokenisation of PROBES), seq_len, max_documents, the retrieval mix (when one is
    set) and CACHE_FORMAT."""
    files = local_files(source)
    if files is None:
        spec = {"hub": str(source)}
    else:
        spec = {"files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    probe = hashlib.sha256(json.dumps(tokenize(tokenizer, list(PROBES))).encode()).hexdigest()
    payload = {
        "format": CACHE_FORMAT,
        "source": spec,
        "text_field": text_field,
        "split": split,
        "tokenizer": {
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "probe": probe,
        },
        "seq_len": seq_len,
        "max_documents": max_documents,
    }
    if retrieval is not None and retrieval.ratio > 0:  # without one, the key of earlier caches
        payload["retrieval"] = retrieval.cache_fields()
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary sibling, then rename: readers never see a half-written file."""
    with atomic_file(path, "wb") as f:
        torch.save(obj, f)


def split_rows(
    tensors: dict[str, torch.Tensor], validation_fraction: float, seed: int
) -> tuple[PackedDataset, PackedDataset]:
    """A seeded random `validation_fraction` of the rows (at least one when the fraction is > 0) for validation,
    the rest for training; both keep the rows' original order."""
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction = {validation_fraction} is not allowed; expected 0 <= f < 1")
    total = tensors["input_ids"].shape[0]
    held = max(1, round(validation_fraction * total)) if validation_fraction > 0 else 0
    if total - held < 1:
        raise ValueError(f"only {total} packed row(s): too few for {held} validation row(s) and any training row")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    return PackedDataset(tensors, order[held:].sort().values), PackedDataset(tensors, order[:held].sort().values)


def build_dataset(
    source,
    tokenizer,
    seq_len: int,
    cache_dir: str | Path,
    validation_fraction: float = 0.01,
    max_documents: int | None = None,
    seed: int = 0,
    text_field: str = "text",
    split: str = "train",
    retrieval: RetrievalMix | None = None,
    max_skipped: float = MAX_SKIPPED,
) -> tuple[PackedDataset, PackedDataset]:
    """(train, validation) PackedDatasets of `source` packed into rows of `seq_len`, with synthetic retrieval
    samples mixed in by `retrieval` (retrieval_data.py).

    Tokenises once: the packed rows are cached as `cache_dir/<cache_key>.pt` (written atomically) and later calls
    with the same source, tokenizer, seq_len and max_documents load them instead. The validation split (a seeded
    random fraction of rows, see split_rows) is drawn after loading, so it may change without re-tokenising.
    """
    key = cache_key(source, tokenizer, seq_len, max_documents, text_field, split, retrieval)
    path = Path(cache_dir) / f"{key}.pt"
    tensors = None
    if path.is_file():
        try:
            tensors = torch.load(path, weights_only=True)
            print(f"[data] loaded {tensors['input_ids'].shape[0]:,} rows of {seq_len} from {path}", file=sys.stderr)
        except Exception as err:  # a truncated or damaged cache is rebuilt, not mistaken for a model checkpoint
            print(f"[data] the data cache {path} is damaged ({type(err).__name__}); rebuilding it", file=sys.stderr)
            tensors = None
    if tensors is None:
        documents = load_documents(
            source, text_field=text_field, split=split, max_documents=max_documents, max_skipped=max_skipped
        )
        if retrieval is not None and retrieval.ratio > 0:
            added = retrieval.ratio / (1 - retrieval.ratio)  # the mix adds synthetic text to the whole corpus
            share = f"{retrieval.ratio:.0%} of the text ({added:.2g}x the corpus)"
            print(f"[data] retrieval samples: {share}", file=sys.stderr)
            documents = mix_retrieval(documents, retrieval, seq_len, lambda text: len(tokenize(tokenizer, [text])[0]))
        tensors = pack_documents(tokenizer, documents, seq_len)
        split_rows(tensors, validation_fraction, seed)  # refuse to cache too little data
        save_atomic(tensors, path)
        print(f"[data] cached {tensors['input_ids'].shape[0]:,} rows of {seq_len} to {path}", file=sys.stderr)
    return split_rows(tensors, validation_fraction, seed)


def epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order [size] of epoch `epoch`: a function of (seed, epoch) alone."""
    mixed = int.from_bytes(hashlib.sha256(f"{seed}/{epoch}".encode()).digest()[:8], "little") >> 1
    return torch.randperm(size, generator=torch.Generator().manual_seed(mixed))


def batches_per_epoch(size: int, batch_size: int) -> int:
    """Whole batches of `batch_size` rows in an epoch of `size` rows (the incomplete last one dropped); ValueError
    when not even one fits."""
    per_epoch = size // batch_size if batch_size >= 1 else 0
    if per_epoch < 1:
        raise ValueError(f"batch_size = {batch_size} does not fit a dataset of {size} rows")
    return per_epoch


def epoch_batches(size: int, batch_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The rows (positions) of each batch of epoch `epoch` [size // batch_size, batch_size], in the order
    `batch_iterator` yields them: the epoch's shuffled order cut into batches, the incomplete last one dropped."""
    per_epoch = batches_per_epoch(size, batch_size)
    return epoch_order(size, seed, epoch)[: per_epoch * batch_size].view(per_epoch, batch_size)


def batch_rows(size: int, batch_size: int, seed: int, batches: int) -> torch.Tensor:
    """The rows (positions) of each of the first `batches` batches of `batch_iterator` [batches, batch_size]: what
    a run will read, known before it starts."""
    epochs = -(-batches // batches_per_epoch(size, batch_size))
    return torch.cat([epoch_batches(size, batch_size, seed, e) for e in range(max(epochs, 1))])[:batches]


def rows_visited(size: int, batch_size: int, seed: int, batches: int) -> torch.Tensor:
    """The rows (positions, sorted) [K] that the first `batches` batches of `batch_iterator` take from a dataset of
    `size` rows with this batch_size and seed: all of them once a run passes an epoch, but what each epoch drops."""
    seen = torch.zeros(size, dtype=torch.bool)
    epoch, left = 0, batches
    while left > 0 and not seen.all():
        taken = epoch_batches(size, batch_size, seed, epoch)[:left]  # [<= per_epoch, batch_size]
        seen[taken.flatten()] = True
        epoch, left = epoch + 1, left - len(taken)
    return seen.nonzero().squeeze(1)


def batch_iterator(
    dataset: Dataset, batch_size: int, seed: int, epochs: int | None = None, start_step: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of `batch_size` rows ({"input_ids", "document_ids", "position_ids", "attention_mask"}, each [B, T]
    int64) in a shuffled order fixed by (seed, epoch); the last incomplete batch of each epoch is dropped.

    Step s is batch s % steps_per_epoch of epoch s // steps_per_epoch, so starting at `start_step` yields exactly
    what an uninterrupted run yields from that step on. `epochs=None` runs forever; otherwise the run ends after
    `epochs` epochs counted from step 0.
    """
    size = len(dataset)
    per_epoch = batches_per_epoch(size, batch_size)
    end = None if epochs is None else epochs * per_epoch
    step = start_step
    while end is None or step < end:
        epoch, first = divmod(step, per_epoch)
        for indices in epoch_batches(size, batch_size, seed, epoch)[first:]:  # [B] each
            if isinstance(dataset, PackedDataset):
                yield dataset.batch(indices)
            else:
                items = [dataset[int(i)] for i in indices]
                batch = {k: torch.stack([torch.as_tensor(item[k]) for item in items]).long() for k in items[0]}
                batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
                yield batch
            step += 1
