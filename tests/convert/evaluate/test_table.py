"""`raven-eval table` (raven_convert.evaluate.table): a task on a named haystack (TASK@NAME) gets its columns
beside TASK's; the other flags count cells against a reference, a second seed, a window."""

import gzip
import json

import pytest

from raven_convert.evaluate.table import main


def test_a_task_on_a_named_haystack_sits_beside_the_task(tmp_path, capsys):
    def summary(accuracy):
        return {"by_length": {"1024": accuracy}}

    retrieval = {
        "niah_single_2/standard": summary(1.0),
        "passkey/standard": summary(0.9),
        "niah_single_2@papers/standard": summary(0.5),
        "niah_single_2/no_inst": summary(0.1),
    }
    (tmp_path / "report.json").write_text(json.dumps({"retrieval": retrieval}))
    assert main([f"teacher={tmp_path}"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    columns = [c.strip() for c in header.split("|")[3:6]]
    assert columns == ["niah_single_2 1K", "niah_single_2@papers 1K", "passkey 1K"]
    assert [c.strip() for c in row.split("|")[3:6]] == ["100%", "50%", "90%"]


def test_within_and_agree_count_the_cells_a_target_reads(tmp_path, capsys):
    def report(name, passkey, essay):
        (tmp_path / name).mkdir()
        retrieval = {
            "passkey/standard": {"by_length": {"1024": passkey[0], "8192": passkey[1], "16384": 0.0}},
            "niah_single_2/standard": {"by_length": {"1024": essay[0], "8192": essay[1], "16384": 0.0}},
        }
        (tmp_path / name / "report.json").write_text(json.dumps({"retrieval": retrieval}))
        return f"{name}={tmp_path / name}"

    args = [report("teacher", (1.0, 0.4), (1.0, 0.68)), report("a", (1.0, 0.85), (0.9, 0.45))]
    args += [report("b", (0.95, 0.7), (1.0, 0.7)), "--reference", "teacher", "--within", "10"]
    assert main([*args, "--lengths", "1024", "8192", "--agree", "a:b"]) == 0
    out = capsys.readouterr().out
    assert "| a | 3 of 4 | niah_single_2 8K 45 vs 68 |" in out  # 90 vs 100 is within 10; above the teacher counts
    assert "| b | 4 of 4 | none |" in out
    # a vs b: |100-95| 5, |85-70| 15, |90-100| 10, |45-70| 25 -> 2 of 4 within 10, mean 13.75
    assert "| a vs b | 2 of 4 | 13.8 | passkey 8K 85 vs 70, niah_single_2 8K 45 vs 70 |" in out


def test_within_needs_a_reference():
    with pytest.raises(SystemExit):
        main(["a=x", "--within", "10"])


def test_agree_marks_the_cells_that_differ_beyond_chance(tmp_path, capsys):
    """With each prompt's score beside the reports, a cell further apart is starred when the two models' right and
    wrong answers on the same prompts differ beyond chance (exact McNemar, p < 0.05)."""

    def run(name, passkey, needle):  # right (1) or wrong (0) per prompt, 20 prompts per cell at 1K
        folder = tmp_path / name
        folder.mkdir()
        retrieval = {}
        for task, right in (("passkey", passkey), ("niah_single_2", needle)):
            results = [{"id": f"{task}/standard/1024/0/{i}", "score": float(r)} for i, r in enumerate(right)]
            (folder / f"retrieval_{task}_standard.json").write_text(json.dumps({"results": results}))
            retrieval[f"{task}/standard"] = {"by_length": {"1024": sum(right) / len(right)}}
        (folder / "report.json").write_text(json.dumps({"retrieval": retrieval}))
        return f"{name}={folder}"

    # passkey: 10 prompts a gets right and b wrong, none the other way (p = 0.002); needle: 15 points apart, but
    # from 5 prompts against 2 (p = 0.45)
    a = run("a", [1] * 20, [1] * 12 + [0] * 8)
    b = run("b", [1] * 10 + [0] * 10, [1] * 7 + [0] * 5 + [1] * 2 + [0] * 6)
    assert main([a, b, "--agree", "a:b"]) == 0
    out = capsys.readouterr().out
    assert "passkey 1K 100 vs 50*" in out
    assert "niah_single_2 1K 60 vs 45" in out and "niah_single_2 1K 60 vs 45*" not in out


def test_beyond_counts_the_answers_past_a_window(tmp_path, capsys):
    """--beyond W: per task, the prompts answered among those whose answers all lie over W tokens back and the rest,
    from the per-prompt scores (here one gzipped, as archive_run.py keeps them); lengths filter as for --within."""
    folder = tmp_path / "windows"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"retrieval": {}}))

    def row(task, length, distance, score):
        return dict(id=f"{task}/standard/{length}/0/{distance}", task=task, length=length, score=score,
                    needle_distance=distance)  # fmt: skip

    passkey = [row("passkey", 8192, 8000, 0.0), row("passkey", 8192, 30, 1.0), row("passkey", 16384, 5000, 1.0)]
    passkey += [row("passkey", 1024, 900, 1.0)]  # a length left out below
    words = [row("niah_word", 8192, 4100, 0.5), row("niah_word", 8192, 4096, 1.0), row("niah_word", 8192, 9, 0.0)]
    (folder / "retrieval_passkey_standard.json").write_text(json.dumps({"results": passkey}))
    zipped = folder / "retrieval_niah_word_standard.json.gz"
    zipped.write_bytes(gzip.compress(json.dumps({"results": words}).encode()))
    assert main([f"w={folder}", "--beyond", "4096", "--lengths", "8192", "16384"]) == 0
    out = capsys.readouterr().out
    assert "| model | passkey past / inside | niah_word past / inside | all past / inside |" in out
    # a score of 0.5 counts as right, as --agree's; a distance of exactly W is inside the window
    assert "| w | 1 of 2 / 1 of 1 | 1 of 1 / 1 of 2 | 2 of 3 / 2 of 3 |" in out

    for r in words:
        del r["needle_distance"]
    zipped.write_bytes(gzip.compress(json.dumps({"results": words}).encode()))
    with pytest.raises(SystemExit, match="w: 3 results have no needle_distance .*scripts/lab/needle_distances.py"):
        main([f"w={folder}", "--beyond", "4096"])
    with pytest.raises(SystemExit):
        main([f"w={folder}", "--beyond", "0"])


def test_raven_eval_table_is_the_table(tmp_path, capsys):
    from raven_convert.evaluate.__main__ import main as raven_eval

    (tmp_path / "report.json").write_text(json.dumps({"retrieval": {"passkey/standard": {"by_length": {"1024": 1.0}}}}))
    assert raven_eval(["table", f"teacher={tmp_path}"]) == 0
    assert "passkey 1K" in capsys.readouterr().out.splitlines()[0]
    with pytest.raises(SystemExit):
        raven_eval(["table", "--help"])
    assert capsys.readouterr().out.startswith("usage: raven-eval table")


def test_the_speed_columns_read_the_batch_1_row(tmp_path, capsys):
    cache = {"attention": 3 * 2**20, "mixer": 2**19, "total": 3.5 * 2**20}
    row = {"context_length": 16384, "skipped": False, "cache_bytes_per_sequence": cache}
    rows = [row | {"batch_size": b, "decode_tokens_per_second": 100.0 * b} for b in (8, 1)]
    (tmp_path / "report.json").write_text(json.dumps({"retrieval": {}, "speed": rows}))
    assert main([f"sila={tmp_path}"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in header.split("|")[3:5]] == [
        "decode tok/s @16K, batch 1",
        "cache/state per sequence @16K",
    ]
    assert [c.strip() for c in row.split("|")[3:5]] == ["100", "attention 3.0 MiB, mixer 512 KiB, total 3.5 MiB"]


def test_tasks_keep_the_cells_a_target_names_and_a_typo_is_named(tmp_path, capsys):
    """--tasks counts the core cells only (passkey, the essay needle, NIAH-Word), and a task no report has is
    refused with the tasks found."""

    def report(name, word):
        (tmp_path / name).mkdir()
        retrieval = {
            "passkey/standard": {"by_length": {"4096": 1.0}},
            "niah_word/standard": {"by_length": {"4096": word}},
            "niah_multivalue/standard": {"by_length": {"4096": 0.0 if name == "raven" else 0.6}},
        }
        (tmp_path / name / "report.json").write_text(json.dumps({"retrieval": retrieval}))
        return f"{name}={tmp_path / name}"

    args = [report("teacher", 0.55), report("raven", 0.3), "--reference", "teacher", "--within", "10"]
    assert main(args) == 0
    assert "| raven | 1 of 3 | niah_word 4K 30 vs 55, niah_multivalue 4K 0 vs 60 |" in capsys.readouterr().out
    assert main([*args, "--tasks", "passkey", "niah_word"]) == 0
    assert "| raven | 1 of 2 | niah_word 4K 30 vs 55 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--tasks", "niah_wrod"])
    err = capsys.readouterr().err
    assert "--tasks 'niah_wrod' is in none of the reports; did you mean 'niah_word'?" in err
    with pytest.raises(SystemExit):
        main([args[0], "--tasks", "passkey"])
    assert "--tasks applies to --within, --agree and --beyond only" in capsys.readouterr().err


def test_positions_give_each_models_loss_over_the_reference_by_span(tmp_path, capsys):
    """--positions averages each model's loss minus the reference's over spans of positions of the perplexity
    windows (--positions-plot draws it); a model without the curve gets dashes, bad edges and a missing reference
    are named."""

    def report(name, losses):
        (tmp_path / name).mkdir()
        curve = {"bucketed": False, "positions": [1, 2, 3, 4, 5, 6, 7], "loss": losses}
        entry = {"context_length": 8, "skipped": False, "perplexity": 10.0, "curve": curve}
        (tmp_path / name / "report.json").write_text(json.dumps({"perplexity": {"results": [entry]}}))
        return f"{name}={tmp_path / name}"

    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "report.json").write_text(json.dumps({}))
    args = [report("teacher", [3.0] * 7), report("far", [3.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5]), f"none={tmp_path}/none"]
    assert main([*args, "--reference", "teacher", "--ppl-length", "8", "--positions", "1,3,8"]) == 0
    out = capsys.readouterr().out
    assert "| model | ppl @8 | positions 1-2 | positions 3-7 |" in out
    assert "| far | 10.00 | +0.000 | +0.300 |" in out and "| none | - | - | - |" in out
    picture = tmp_path / "positions.png"
    assert main([*args, "--reference", "teacher", "--ppl-length", "8", "--positions", "1,3,8", "--positions-plot",
                 str(picture)]) == 0  # fmt: skip
    assert picture.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        main([*args, "--reference", "teacher", "--positions-plot", str(picture)])
    assert "--positions-plot draws --positions" in capsys.readouterr().err
    for bad in ("8,3", "1", "0,4", "a,b"):
        with pytest.raises(SystemExit):
            main([*args, "--reference", "teacher", "--positions", bad])
        assert "at least two increasing positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args[:2] + ["--positions", "1,4"])
    assert "--positions needs --reference" in capsys.readouterr().err


def test_by_depth_gives_a_tasks_accuracy_by_the_needles_depth(tmp_path, capsys):
    """--by-depth TASK: a row per model and length (--lengths keeps some), a column per depth any report has; a
    model without the task is left out, and a task no report has is refused with the ones found."""

    def report(name, retrieval):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"retrieval": retrieval}))
        return f"{name}={tmp_path / name}"

    teacher = {
        "passkey/standard": {
            "by_length": {"4096": 0.8, "8192": 0.4},
            "by_length_depth": {"4096": {"0": 1.0, "1": 0.6}, "8192": {"0": 0.0, "1": 0.8}},
        }
    }
    hybrid = {"passkey/standard": {"by_length": {"8192": 0.5}, "by_length_depth": {"8192": {"0.5": 0.5}}}}
    other = {"niah_word/standard": {"by_length": {"8192": 0.3}}}
    args = [report("teacher", teacher), report("hybrid", hybrid), report("other", other)]
    assert main([*args, "--by-depth", "passkey", "--lengths", "8192"]) == 0
    out = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert out == [
        "| model | length | depth 0 | depth 0.5 | depth 1 |",
        "| --- | --- | --- | --- | --- |",
        "| teacher | 8K | 0% | - | 80% |",
        "| hybrid | 8K | - | 50% | - |",
    ]
    assert main([*args, "--by-depth", "passkey"]) == 0
    assert "| teacher | 4K | 100% | - | 60% |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--by-depth", "passkeys"])
    assert "did you mean 'passkey'" in capsys.readouterr().err
