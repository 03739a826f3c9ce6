"""needle_distances.py: scores from before the evaluation recorded each prompt's needle_distance get it from the
prompts rebuilt out of the report's request, and a score whose prompt is not the rebuilt one is refused."""

import gzip
import json

import pytest

from raven_convert.evaluate.settings import EvalRequest
from raven_convert.evaluate.table import prompt_results
from scripts.lab.needle_distances import main
from tests.conftest import tiny_tokenizer

ESSAY = "Rivers bend twice before the town. Boats wait at the mill. Nobody hurries here in spring."


@pytest.fixture
def old_report(tmp_path):
    """A report directory as an evaluation on another machine left it, before needle_distance: its request names
    that machine's haystack, and its scores (one file gzipped, as archive_run.py keeps them) lack the field."""
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "essay.txt").write_text("\n\n".join([ESSAY] * 40))
    request = EvalRequest(
        model="/root/runs/x/model", out="/root/runs/x/evaluate", tasks=["passkey", "niah_single_2"], lengths=[700],
        depths=[0.0, 0.5], samples=2, haystack_dir="/root/cache/essays",
    )  # fmt: skip
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text(json.dumps({"request": request.model_dump(mode="json")}))
    expected = {}
    for task, gz in (("passkey", False), ("niah_single_2", True)):
        samples = request.model_copy(update={"haystack_dir": str(essays)}).prompts(task, "standard", tiny_tokenizer())
        rows = [dict(id=s.meta["id"], n_tokens=s.meta["n_tokens"], task=task, variant="standard", score=1.0)
                for s in samples]  # fmt: skip
        expected |= {s.meta["id"]: s.meta["needle_distance"] for s in samples}
        text = json.dumps({"summary": {}, "results": rows}).encode()
        name = f"retrieval_{task}_standard.json" + (".gz" if gz else "")
        (report / name).write_bytes(gzip.compress(text) if gz else text)
    tokenizer = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer)
    return report, essays, tokenizer, expected


def test_distances_are_added_from_the_rebuilt_prompts(old_report, capsys):
    report, essays, tokenizer, expected = old_report
    assert main([str(report), "--tokenizer", str(tokenizer), "--haystack", str(essays)]) == 0
    rows = prompt_results(str(report), "standard")
    assert {r["id"]: r["needle_distance"] for r in rows} == expected and len(rows) == 8
    assert len(set(expected.values())) > 2  # depths 0 and 0.5, two tasks: distances that tell prompts apart
    assert (report / "retrieval_niah_single_2_standard.json.gz").read_bytes()[:2] == b"\x1f\x8b"  # still gzipped
    out = capsys.readouterr().out
    assert "retrieval_niah_single_2_standard.json.gz 4 prompts, retrieval_passkey_standard.json 4 prompts" in out
    assert not list(report.glob(".*"))  # no temporary file left behind


def test_a_prompt_that_is_not_the_rebuilt_one_is_refused(old_report):
    report, essays, tokenizer, _ = old_report
    scores = report / "retrieval_passkey_standard.json"
    payload = json.loads(scores.read_text())
    payload["results"][1]["n_tokens"] += 5  # as another tokenizer would have made it
    scores.write_text(json.dumps(payload))
    before = scores.read_bytes()
    with pytest.raises(ValueError, match=r"prompt 'passkey/standard/700/0/1' \(\d+ tokens\) is not among the rebuilt"):
        main([str(report), "--tokenizer", str(tokenizer), "--haystack", str(essays)])
    assert scores.read_bytes() == before  # nothing written: every file is checked first
    assert (
        "needle_distance"
        not in gzip.decompress((report / "retrieval_niah_single_2_standard.json.gz").read_bytes()).decode()
    )


def test_a_folder_without_a_report_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--tokenizer", str(tmp_path)])
    assert "has no report.json" in capsys.readouterr().err
