"""The rows a stage 2 run reads, and how each micro-batch of them leaves the host: the checks of what the rows must
carry (answers for answer_weight, weights for every row read in a token-weight table), each process's slice of every
global micro-batch, and the documents packed in a batch found on the host.

    read = rows_read(config, len(rows), processes)         # [K] the rows a run will read (token_weights.weight_table)
    for batch in micro_batches(with_index(rows), config, accelerator, start_step): ...
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from raven_convert.train.data import PackedDataset, batch_iterator, rows_visited
from raven_convert.train.graphs import host_documents
from raven_convert.train.stage2_config import TrainConfig


def answer_summary(dataset) -> str:
    """How many of `dataset`'s tokens are answers (rows' "answers"); ValueError naming the setting where its rows
    have none."""
    if "answers" not in dataset[0]:
        raise ValueError(
            "answer_weight != 1 needs rows that mark answers: rows packed with synthetic retrieval samples "
            "(data.retrieval, data.pack_documents); these rows have no 'answers'"
        )
    if not isinstance(dataset, PackedDataset):
        return "the rows mark them"
    answers = dataset.tensors["answers"][dataset.rows]  # [N, T]
    if not answers.any():
        raise ValueError(
            f"answer_weight != 1, and none of the rows' {answers.numel():,} tokens is an answer: the data holds no "
            "synthetic retrieval sample (data.retrieval's ratio; a corpus gives samples once it has shown 32 words)"
        )
    return f"{int(answers.sum()):,} of the rows' {answers.numel():,} tokens ({answers.float().mean().item():.3%})"


class _Indexed(Dataset):
    """`dataset` whose items and batches also carry "index", their position in it (for a token-weight table)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return dict(self.dataset[i]) | {"index": torch.tensor(i)}


class _IndexedPacked(PackedDataset):
    def __init__(self, dataset: PackedDataset):  # shares the storage
        self.tensors, self.rows = dataset.tensors, dataset.rows

    def batch(self, indices):
        return super().batch(indices) | {"index": torch.as_tensor(indices, dtype=torch.long)}


def with_index(dataset):
    """`dataset` whose items and batches also carry "index", their position in it, to look a token-weight table's
    rows up by."""
    return _IndexedPacked(dataset) if isinstance(dataset, PackedDataset) else _Indexed(dataset)


def rows_read(config: TrainConfig, size: int, processes: int) -> torch.Tensor:
    """The rows [K] (positions, sorted) of a dataset of `size` rows that `train` with `config` on `processes`
    processes reads: its micro-batches are batch_iterator's batches of the global batch (see micro_batches)."""
    return rows_visited(size, config.batch_size * processes, config.seed, config.steps * config.grad_accum)


def check_weight_table(table: torch.Tensor, dataset, config: TrainConfig, processes: int) -> None:
    """Refuse a token-weight table with no weights (NaN, see token_weights.weight_table's `only`) for a row this run
    reads: it was computed for another run's steps, global batch or seed."""
    read = rows_read(config, len(dataset), processes)
    missing = read[table[read].isnan().any(dim=1)]
    if len(missing):
        raise ValueError(
            f"the token-weight table has no weights for {len(missing):,} of the {len(read):,} rows this run reads "
            f"(rows {missing[:5].tolist()}...): it was computed for another train.steps, batch size, number of "
            "processes or seed; compute it again (--redo weights)"
        )


def device_documents(batch: dict, device):
    """The documents packed in a host batch's rows as the hybrid's forward takes them (`packed_documents`), on
    `device`: found on the host, so that the forward does not read the position ids back; None without them."""
    if "position_ids" not in batch:
        return None
    found = host_documents(batch)
    return False if found is None else tuple(t.to(device, non_blocking=True) for t in found)


def micro_batches(dataset, config: TrainConfig, accelerator, start_step: int):
    """This process's slice of every global micro-batch, from optimizer step `start_step` on (forever); the rows'
    "answers" only where answer_weight reads them (nothing copied to the device for nothing)."""
    n, rank, b = accelerator.num_processes, accelerator.process_index, config.batch_size
    start = start_step * config.grad_accum
    unread = () if config.answer_weight != 1 else ("answers",)
    for batch in batch_iterator(dataset, b * n, config.seed, start_step=start):
        yield {k: v[rank * b : (rank + 1) * b] for k, v in batch.items() if k not in unread}
