"""archive_run.py keeps a run's results as docs/results holds them, the per-prompt scores gzipped, and
`raven-eval table` reads the archive as it reads the run."""

import gzip
import json

from raven_convert.evaluate.table import prompt_scores
from scripts.lab.archive_run import main


def fake_run(root):
    """A finished recipe run as runs.tar.gz unpacks it: stage summaries, the evaluation, the extra checks."""
    run = root / "raven-x"
    for stage in ("convert", "align", "train", "extend", "evaluate"):
        (run / stage).mkdir(parents=True)
        (run / stage / "DONE").write_text(json.dumps({"stage": stage}))
    results = [{"id": f"passkey/standard/1024/0/{i}", "score": float(i % 2)} for i in range(6)]
    (run / "evaluate" / "retrieval_passkey_standard.json").write_text(json.dumps({"results": results}))
    (run / "evaluate" / "report.json").write_text(json.dumps({"retrieval": {}}))
    (run / "evaluate" / "niah_passkey_standard.png").write_bytes(b"\x89PNG")
    (run / "memory-reach").mkdir()
    (run / "memory-reach" / "memory_reach.json").write_text("{}")
    (run / "load_check.json").write_text("{}")
    return run


def test_a_run_is_archived_with_its_scores_gzipped_and_read_back_alike(tmp_path, capsys):
    run, out = fake_run(tmp_path), tmp_path / "docs" / "raven-x"
    assert main([str(run), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "load_check.json", "memory_reach.json", "niah_passkey_standard.png", "report.json",
        "retrieval_passkey_standard.json.gz", "stages.json",
    ]  # fmt: skip
    assert json.loads((out / "stages.json").read_text())["extend"] == {"stage": "extend"}
    scores = prompt_scores(str(out), "standard")
    assert scores == prompt_scores(str(run / "evaluate"), "standard") and len(scores) == 6
    packed = (out / "retrieval_passkey_standard.json.gz").read_bytes()
    assert gzip.decompress(packed) == (run / "evaluate" / "retrieval_passkey_standard.json").read_bytes()
    assert main([str(run), str(tmp_path / "again")]) == 0  # the same scores, the same bytes
    assert (tmp_path / "again" / "retrieval_passkey_standard.json.gz").read_bytes() == packed


def test_a_run_without_an_evaluation_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "half" / "train").mkdir(parents=True)
    assert main([str(tmp_path / "half"), str(tmp_path / "out")]) == 2
    assert "half has no evaluate/report.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
