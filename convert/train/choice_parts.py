"""The training parts layer choice borrows (layer_choice.TrainingParts), built here so that layer_choice imports
nothing of the training package, which imports it."""

from __future__ import annotations

from raven_convert.layer_choice import TrainingParts
from raven_convert.train.align import align
from raven_convert.train.data import check_data_source, load_documents
from raven_convert.train.distributed import Parallel
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
        align=align_alone,
    )


def align_alone(teacher, hybrid, *args, **kwargs):
    """train.align.align on this process alone, on the teacher's device: layer choice fits its mixers inside convert,
    which the main process of a launch runs while the others wait for its DONE, so no step may hold a collective."""
    parallel = Parallel.alone(next(teacher.parameters()).device)
    return align(teacher, hybrid, *args, parallel=parallel, **kwargs)
