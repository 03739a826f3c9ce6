"""The training parts layer choice borrows (layer_choice.TrainingParts), built here so that layer_choice imports
nothing of the training package, which imports it."""

from __future__ import annotations

from raven_convert.layer_choice import TrainingParts
from raven_convert.train.align import align
from raven_convert.train.data import check_data_source, load_documents
from raven_convert.train.retrieval_data import POOL_SIZE, VALUE_KINDS, WORD, build_sample


def training_parts() -> TrainingParts:
    """The corpus reader and its check, the retrieval-sample generator and the aligner, as layer choice takes them."""
    return TrainingParts(
        load_documents=load_documents,
        check_data_source=check_data_source,
        build_sample=build_sample,
        word=WORD,
        pool_size=POOL_SIZE,
        value_kinds=VALUE_KINDS,
        align=align,
    )
