"""`python -m raven_convert.train` as the distributed tests launch it (torchrun, 2 gloo processes), except that with
STOP_AFTER_STEP=k every process exits (status 3) right after the train stage's step-k checkpoint: a launch killed
midway, whose sharded checkpoint a later run resumes on another number of processes."""

import os
import sys

import raven_convert.train.stage2 as stage2
from raven_convert.train.__main__ import main

STOP = int(os.environ.get("STOP_AFTER_STEP", "0"))

if STOP:
    save = stage2._save

    def save_then_stop(parallel, model, optimizer, out_dir, step, *rest):
        save(parallel, model, optimizer, out_dir, step, *rest)
        if step == STOP:
            sys.exit(3)

    stage2._save = save_then_stop

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
