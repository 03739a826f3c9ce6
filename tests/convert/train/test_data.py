"""Training data: local files of each format read as documents, packed rows that keep every token in order with
correct document and position ids, a tokenise-once cache, disjoint splits, and a resumable batch order."""

import gzip
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raven_convert.train import data
from raven_convert.train.data import (
    PackedDataset,
    batch_iterator,
    batch_rows,
    build_dataset,
    load_documents,
    pack_documents,
    rows_visited,
    tokenize,
)
from tests.conftest import tiny_tokenizer

CORPUS = Path("/work/shared/data/corpus")
DOCS = [
    "Hello world.",
    "A second, longer document: with punctuation; and digits 0123456789.",
    "x",
    "",  # empty: skipped by load_documents
    "def f(x):\n    return x * 2\n",
    "The </s> inside a text is not an end of document.",
    "Short one.",
    "Final document, long enough to spill over a row boundary or two.",
]
TEXTS = [d for d in DOCS if d]


def write_jsonl_gz(path: Path, texts, field="text") -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"source": f"doc{i}.html", field: text}) + "\n")
    return path


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """datasets leaves lock files (and, without streaming, Arrow copies) in its cache: keep them out of ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture
def jsonl(tmp_path) -> Path:
    return write_jsonl_gz(tmp_path / "docs.jsonl.gz", DOCS)


def stream(tokenizer, texts) -> list[int]:
    """The reference token stream: each text's tokens then EOS."""
    return [t for ids in tokenize(tokenizer, list(texts)) for t in [*ids, tokenizer.eos_token_id]]


def test_reads_jsonl_gz(jsonl):
    assert list(load_documents(jsonl)) == TEXTS
    assert list(load_documents(str(jsonl), max_documents=2)) == TEXTS[:2]


def test_reads_txt_one_document_per_line(tmp_path):
    lines = [t for t in TEXTS if "\n" not in t]
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n")
    assert list(load_documents(tmp_path / "docs.txt")) == lines


def test_reads_parquet_with_another_field(tmp_path):
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "body": TEXTS}), tmp_path / "docs.parquet")
    assert list(load_documents(tmp_path / "docs.parquet", text_field="body")) == TEXTS


def test_reads_directory_glob_and_list_in_sorted_order(tmp_path):
    write_jsonl_gz(tmp_path / "b.jsonl.gz", TEXTS[3:])
    write_jsonl_gz(tmp_path / "a.jsonl.gz", TEXTS[:3])
    (tmp_path / "notes.md").write_text("ignored in a directory")
    assert list(load_documents(tmp_path)) == TEXTS
    assert list(load_documents(f"{tmp_path}/*.jsonl.gz")) == TEXTS
    assert list(load_documents([tmp_path / "b.jsonl.gz", tmp_path / "a.jsonl.gz"])) == TEXTS[3:] + TEXTS[:3]


def test_not_streaming_reads_the_same(jsonl):
    assert list(load_documents(jsonl, streaming=False)) == TEXTS


def test_missing_field_names_the_columns(jsonl):
    with pytest.raises(ValueError, match=r"'body'.*\['source', 'text'\]"):
        load_documents(jsonl, text_field="body")


def test_unknown_extension_and_missing_paths(tmp_path):
    (tmp_path / "docs.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unknown file extension"):
        load_documents(tmp_path / "docs.csv")
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "absent.jsonl")
    with pytest.raises(FileNotFoundError, match="no files match"):
        load_documents(f"{tmp_path}/*.parquet")
    assert data.local_files("HuggingFaceFW/fineweb-edu") is None  # a Hub name: left to datasets


@pytest.mark.parametrize("seq_len", [1, 7, 16])
def test_pack_keeps_every_token_in_order(seq_len):
    tok = tiny_tokenizer()
    packed = pack_documents(tok, TEXTS, seq_len)
    reference = stream(tok, TEXTS)
    rows = len(reference) // seq_len
    assert set(packed) == {"input_ids", "document_ids", "position_ids", "answers"}
    for value in packed.values():
        assert value.shape == (rows, seq_len) and not value.is_floating_point()
    assert packed["input_ids"].flatten().tolist() == reference[: rows * seq_len]
    assert not packed["answers"].any()  # plain documents have no answers


def test_pack_document_and_position_ids_follow_eos():
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    packed = pack_documents(tok, TEXTS, seq_len=16)
    ids, docs, pos = (packed[k].tolist() for k in ("input_ids", "document_ids", "position_ids"))
    assert sum(t == eos for t in stream(tok, TEXTS)) == len(TEXTS)  # the literal "</s>" is not an EOS
    for row_ids, row_docs, row_pos in zip(ids, docs, pos):
        assert row_docs[0] == 0 and row_pos[0] == 0
        for t in range(1, len(row_ids)):
            new_document = row_ids[t - 1] == eos
            assert row_docs[t] == row_docs[t - 1] + new_document
            assert row_pos[t] == (0 if new_document else row_pos[t - 1] + 1)


def test_pack_drops_the_tail_and_explicit_eos():
    tok = tiny_tokenizer()
    packed = pack_documents(tok, ["abc"], seq_len=3, eos_token_id=1)
    assert packed["input_ids"].tolist() == [tokenize(tok, ["abc"])[0]]  # "abc" + EOS = 4 tokens: one row
    assert pack_documents(tok, ["ab"], seq_len=8)["input_ids"].shape == (0, 8)


def test_build_dataset_caches_and_splits_disjointly(jsonl, tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    calls = []
    real_pack = data.pack_documents
    monkeypatch.setattr(data, "pack_documents", lambda *a, **k: calls.append(1) or real_pack(*a, **k))
    cache = tmp_path / "cache"

    train, val = build_dataset(jsonl, tok, seq_len=4, cache_dir=cache, validation_fraction=0.2, seed=1)
    assert len(calls) == 1 and [p.suffix for p in cache.iterdir()] == [".pt"]  # no temporary file left behind
    train2, val2 = build_dataset(jsonl, tok, seq_len=4, cache_dir=cache, validation_fraction=0.2, seed=1)
    assert len(calls) == 1  # loaded, not tokenised again
    for a, b in ((train, train2), (val, val2)):
        assert torch.equal(a.rows, b.rows)
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)

    total = train.tensors["input_ids"].shape[0]
    assert total == len(stream(tok, TEXTS)) // 4
    assert len(val) == round(0.2 * total) >= 1
    assert set(train.rows.tolist()).isdisjoint(val.rows.tolist())
    assert sorted(train.rows.tolist() + val.rows.tolist()) == list(range(total))
    item = val[0]
    assert torch.equal(item["input_ids"], val.tensors["input_ids"][val.rows[0]].long())
    assert item["attention_mask"].tolist() == [1] * 4 and item["input_ids"].dtype == torch.int64

    _, tiny_val = build_dataset(jsonl, tok, seq_len=4, cache_dir=cache, validation_fraction=1e-6)
    assert len(tiny_val) == 1 and len(calls) == 1  # at least one validation row; the split needs no re-tokenising
    build_dataset(jsonl, tok, seq_len=5, cache_dir=cache)
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2  # another seq_len: another cache entry


def test_build_dataset_refuses_too_little_data(tmp_path):
    source = write_jsonl_gz(tmp_path / "one.jsonl.gz", ["ab"])
    with pytest.raises(ValueError, match="too few"):
        build_dataset(source, tiny_tokenizer(), seq_len=3, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def numbered_dataset(rows: int = 11, seq_len: int = 3) -> PackedDataset:
    ids = torch.arange(rows * seq_len, dtype=torch.int32).view(rows, seq_len)
    return PackedDataset({"input_ids": ids, "document_ids": ids * 0, "position_ids": ids * 0})


def row_ids(batch) -> list[int]:
    return (batch["input_ids"][:, 0] // 3).tolist()


def test_batches_are_deterministic_shuffled_epochs():
    ds = numbered_dataset()
    run = [row_ids(b) for b in batch_iterator(ds, batch_size=3, seed=5, epochs=4)]
    assert run == [row_ids(b) for b in batch_iterator(ds, batch_size=3, seed=5, epochs=4)]
    assert run != [row_ids(b) for b in batch_iterator(ds, batch_size=3, seed=6, epochs=4)]
    assert len(run) == 4 * 3  # 11 rows, batches of 3: the incomplete batch of each epoch is dropped
    for epoch in range(4):
        seen = sum(run[3 * epoch : 3 * epoch + 3], [])
        assert len(set(seen)) == 9 and set(seen) <= set(range(11))
    assert run[:3] != run[3:6]  # each epoch has its own order
    batch = next(batch_iterator(ds, batch_size=3, seed=5))
    assert set(batch) == {"input_ids", "document_ids", "position_ids", "attention_mask"}
    assert all(v.dtype == torch.int64 and v.shape == (3, 3) for v in batch.values())
    assert batch["attention_mask"].eq(1).all()


@pytest.mark.parametrize("start_step", [0, 1, 3, 5, 11])
def test_resuming_matches_an_uninterrupted_run(start_step):
    ds = numbered_dataset()
    full = [row_ids(b) for b in batch_iterator(ds, batch_size=3, seed=7, epochs=4)]
    resumed = [row_ids(b) for b in batch_iterator(ds, batch_size=3, seed=7, epochs=4, start_step=start_step)]
    assert resumed == full[start_step:]
    endless = batch_iterator(ds, batch_size=3, seed=7, start_step=start_step)
    assert [row_ids(b) for b in itertools.islice(endless, len(full) - start_step)] == full[start_step:]


@pytest.mark.parametrize("batches", [1, 3, 4, 7, 40])  # within the first epoch, across epochs, every row
def test_rows_visited_are_the_rows_the_batches_take(batches):
    ds = numbered_dataset()
    taken = {r for b in itertools.islice(batch_iterator(ds, batch_size=3, seed=7), batches) for r in row_ids(b)}
    assert rows_visited(len(ds), 3, 7, batches).tolist() == sorted(taken)
    assert rows_visited(len(ds), 3, 8, batches).tolist() != sorted(taken) or len(taken) == len(ds)
    expected = [row_ids(b) for b in itertools.islice(batch_iterator(ds, batch_size=3, seed=7), batches)]
    assert batch_rows(len(ds), 3, 7, batches).tolist() == expected  # each batch's rows, in order


def test_batch_iterator_accepts_any_dataset_of_dicts():
    ds = numbered_dataset()
    plain = [{"input_ids": ds[i]["input_ids"]} for i in range(len(ds))]
    expected = [b["input_ids"] for b in batch_iterator(ds, batch_size=2, seed=0, epochs=1)]
    got = list(batch_iterator(plain, batch_size=2, seed=0, epochs=1))
    assert all(torch.equal(b["input_ids"], e) and b["attention_mask"].eq(1).all() for b, e in zip(got, expected))
    with pytest.raises(ValueError, match="does not fit"):
        next(batch_iterator(ds, batch_size=12, seed=0))


@pytest.mark.skipif(not (CORPUS / "python-3.11-docs.jsonl.gz").is_file(), reason=f"no corpus at {CORPUS}")
def test_packs_the_python_docs():
    tok = tiny_tokenizer()
    texts = list(load_documents(CORPUS / "python-3.11-docs.jsonl.gz", max_documents=20))
    assert len(texts) == 20 and all(isinstance(t, str) and t for t in texts)
    packed = pack_documents(tok, texts, seq_len=256)
    reference = stream(tok, texts)
    rows = len(reference) // 256
    assert rows > 20 and packed["input_ids"].shape == (rows, 256)
    assert packed["input_ids"].flatten().tolist() == reference[: rows * 256]
    assert packed["document_ids"].max() >= 1  # some row holds more than one document
