"""`python -m raven_convert.train` as the distributed tests launch it (torchrun, 2 gloo processes), except that with
STOP_AFTER_STEP=k every process exits (status 3) right after the train stage's step-k checkpoint: a launch killed
midway, whose sharded checkpoint a later run resumes on another number of processes. With LOG_LOADS=FILE every
process appends a line to FILE as it starts and ends reading a model from its source (the teacher), and after each
stage the number of models still alive (not yet collected)."""

import gc
import os
import sys
import time

import raven_convert.train.stage2 as stage2
import raven_convert.train.stages as stages
from raven_convert.sources import Source
from raven_convert.train.__main__ import main

STOP = int(os.environ.get("STOP_AFTER_STEP", "0"))
LOG_LOADS = os.environ.get("LOG_LOADS")

if STOP:
    save = stage2._save

    def save_then_stop(parallel, model, optimizer, out_dir, step, *rest):
        save(parallel, model, optimizer, out_dir, step, *rest)
        if step == STOP:
            sys.exit(3)

    stage2._save = save_then_stop

if LOG_LOADS:
    load_model = Source.load_model

    def logged_load_model(self, *args, **kwargs):
        rank = os.environ["RANK"]
        with open(LOG_LOADS, "a") as log:
            log.write(f"start {rank} {time.time()}\n")
        model = load_model(self, *args, **kwargs)
        time.sleep(0.2)  # a slow read: another process reading at the same time would start inside this one
        with open(LOG_LOADS, "a") as log:
            log.write(f"end {rank} {time.time()}\n")
        return model

    Source.load_model = logged_load_model
    log = stages.log

    def log_models_alive(message: str) -> None:
        log(message)
        if "] done in" in message:  # a stage has finished: what it loaded should be gone
            from transformers import PreTrainedModel

            alive = sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())
            with open(LOG_LOADS, "a") as out:
                out.write(f"alive {alive} {message.split(']')[0][1:]}\n")

    stages.log = log_models_alive

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
