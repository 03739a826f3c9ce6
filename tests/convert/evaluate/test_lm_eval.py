"""Exported hybrids run under lm-evaluation-harness (offline, through its Python API, on small local tasks).

The same models run from the command line; for RULER, for example:
    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True \
        --tasks ruler --metadata '{"max_seq_lengths":[4096]}'
"""

import json
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raven_convert.cli import main

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is part of the [test] extra")

ROWS = [
    {"question": f"{a} plus {b} is", "choices": [f"{a + b}", f"{a + b + 1}"], "label": 0, "answer": f"{a + b}"}
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3)]
]


def write_tasks(task_dir):
    data = task_dir / "sums.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{question}}}}"
    """
    (task_dir / "sums_choice.yaml").write_text(
        textwrap.dedent(
            common
            + """
        task: sums_choice
        output_type: multiple_choice
        doc_to_choice: "{{choices}}"
        doc_to_target: label
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """
        )
    )
    (task_dir / "sums_generate.yaml").write_text(
        textwrap.dedent(
            common
            + """
        task: sums_generate
        output_type: generate_until
        doc_to_target: answer
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 4
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """
        )
    )


def test_harness_scores_an_exported_hybrid(tiny_sources, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["qwen3"]), "--mixer", "raven", "--layers", "0-23:5", "--out", str(out)]
    assert main([*args, "--mixer", "sila", "--layers", "1-23:5", "--raven-num-slots", "16", "--raven-top-k", "4"]) == 0
    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks")

    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        tasks=["sums_choice", "sums_generate"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        device="cpu",
        batch_size=2,
        log_samples=True,
    )
    assert results["results"]["sums_generate"]["exact_match,none"] in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

    # The harness's log-likelihoods are the model's own: recompute them directly.
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    correct = []
    for sample in sorted(results["samples"]["sums_choice"], key=lambda s: s["doc_id"]):
        row = ROWS[sample["doc_id"]]
        scores = []
        for choice in row["choices"]:
            context = tokenizer(row["question"]).input_ids
            full = tokenizer(row["question"] + " " + choice).input_ids  # the harness's target delimiter
            with torch.no_grad():
                logp = model(torch.tensor([full])).logits[0, :-1].log_softmax(-1)
            cont = torch.tensor(full[len(context) :])
            scores.append(logp[len(context) - 1 :].gather(-1, cont[:, None]).sum().item())
        harness = [resp[0][0] for resp in sample["resps"]]
        assert harness == pytest.approx(scores, abs=1e-3)
        correct.append(float(max(range(2), key=scores.__getitem__) == row["label"]))
    assert results["results"]["sums_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
