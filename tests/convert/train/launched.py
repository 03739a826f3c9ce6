"""`python -m raven_convert.train` as the distributed tests launch it (torchrun, 2 gloo processes), except that with
STOP_AFTER_STEP=k every process exits (status 3) right after the train stage's step-k checkpoint: a launch killed
midway, whose sharded checkpoint a later run resumes on another number of processes. With LOG_LOADS=FILE every
process appends a line to FILE as it starts and ends reading a model from its source (the teacher), and after each
stage the number of models still alive (not yet collected). With GRAPH_LAYOUT=1 an eager train stage runs on the
layout its CUDA graphs would replay (documents padded to the run's slots over every process's share, in-chunk forms
chosen on the device); NUDGE=x scales the model's starting weights by 1 + x: a run that differs in rounding alone.
With STEP_AS_GRAPHS=1 the train stage takes its graphed path, each step run eagerly instead of captured (the CPU
has no CUDA graphs)."""

import gc
import os
import sys
import time

import torch

import raven_convert.train.stage2 as stage2
import raven_convert.train.stages as stages
from raven_convert.sources import Source
from raven_convert.train.__main__ import main
from raven_convert.train.graphs import host_documents, run_document_slots
from raven_kernels import chunked

STOP = int(os.environ.get("STOP_AFTER_STEP", "0"))
LOG_LOADS = os.environ.get("LOG_LOADS")
GRAPH_LAYOUT = os.environ.get("GRAPH_LAYOUT") == "1"
NUDGE = float(os.environ.get("NUDGE", "0"))
STEP_AS_GRAPHS = os.environ.get("STEP_AS_GRAPHS") == "1"

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

if GRAPH_LAYOUT or NUDGE:
    setup = stage2.Stage2Trainer.setup

    def setup_as_asked(self):
        if NUDGE:
            with torch.no_grad():
                for p in self.student.parameters():
                    p.mul_(1 + NUDGE)
        setup(self)
        if GRAPH_LAYOUT and not self.graphs:
            config, processes = self.config, self.accelerator.num_processes
            steps = config.steps * config.grad_accum
            slots = run_document_slots(self.dataset, config.batch_size, config.seed, steps, processes)
            chunked.FORCE_DEVICE_CHOICE = True
            stage2.device_documents = lambda batch, device: tuple(
                t.to(device) for t in host_documents(batch, slots=slots)
            )
            self.note(f"eager steps on the graphs' layout: documents padded to {slots} per step")

    stage2.Stage2Trainer.setup = setup_as_asked

if STEP_AS_GRAPHS:

    class EagerCapturedStep:
        """CapturedStep's calls, each run eagerly (no CUDA graph on the CPU)."""

        warmup = 1

        def __init__(self, step):
            self.step, self.graphs = step, {}

        def __call__(self, inputs):
            return self.step(inputs)

    stage2.step_graphs = lambda *args, **kwargs: True
    stage2.CapturedStep = EagerCapturedStep

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
