"""omit_at_default: a field added to a settings model later leaves the dumps (fingerprints, cache keys) made before
it as they were, until it is set to something else."""

from pydantic import BaseModel

from raven_convert.train.schema import omit_at_default


class Settings(BaseModel):
    steps: int = 1
    weight: float = 1.0
    _dump = omit_at_default("weight")


class Extended(Settings):
    seq_len: int = 8


def test_a_field_at_its_default_is_left_out_of_the_dumps_of_the_model_and_its_subclasses():
    assert Settings().model_dump() == Settings(weight=1).model_dump() == {"steps": 1}
    assert Settings(weight=2).model_dump(mode="json") == {"steps": 1, "weight": 2.0}
    assert Extended().model_dump() == {"steps": 1, "seq_len": 8}
    assert Extended(weight=0.5).model_dump() == {"steps": 1, "weight": 0.5, "seq_len": 8}
