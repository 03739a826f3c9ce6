"""What the settings models of the recipe's sections share (recipe_schema.py builds the recipe from them).

class RetrievalMix(BaseModel):
    restated: float = 0.0
    _dump = omit_at_default("restated")   # model_dump() leaves restated out while it is 0.0
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_serializer

from raven_convert.train.compiling import CompileSetting

# a stage's `compile` setting (align's and stage 2's)
CompileParts = Annotated[
    CompileSetting,
    Field(description="torch.compile the mixers' glue and the layers' norms and MLPs (compiling.py); auto: on CUDA"),
]


def omit_at_default(*names: str):
    """A pydantic serializer for a model's body that leaves the fields `names` out of its dumps while they hold their
    defaults: a field added later keeps the stage fingerprints and data caches made before it valid."""

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict:
        data = handler(self)
        for name in names:
            if getattr(self, name) == type(self).model_fields[name].default:
                data.pop(name, None)
        return data

    return _dump
