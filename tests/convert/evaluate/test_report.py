"""`raven-eval`: one command writes report.json and the pictures, for a teacher and for a hybrid."""

import json
import re

import pytest

from raven_convert.cli import main as convert_main
from raven_convert.evaluate.__main__ import main as eval_main

PARAGRAPHS = [
    "Startups grow fast when founders talk to users. Most ideas look bad at first.",
    "Writing helps thinking. A sentence that is hard to write usually hides a vague idea.",
    "Cities attract ambitious people. Each city sends a message about what matters there.",
    "Good taste can be learned. It comes from looking closely at the best work in a field.",
]
PAPER = "Theorem 1. The state $S_t$ of size 64 x 128 stays bounded by 2.5 for all t. Table 3 lists 41.2 and 38.9."


@pytest.fixture
def haystack(tmp_path):
    folder = tmp_path / "essays"
    folder.mkdir()
    for i in range(3):
        (folder / f"essay{i}.txt").write_text("\n\n".join(PARAGRAPHS[i:] + PARAGRAPHS[:i]) * 4)
    return folder


def run_eval(model_dir, out, haystack, *extra):
    args = [str(model_dir), "--out", str(out), "--lengths", "700", "--depths", "0,0.5", "--samples", "1"]
    args += ["--haystack-dir", str(haystack), "--picture-length", "700", "--batch-size", "2", *extra]
    assert eval_main(args) == 0
    return json.loads((out / "report.json").read_text())


def test_hybrid_report_has_every_part_and_picture(tiny_sources, tmp_path, haystack):
    model_dir = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--out", str(model_dir), "--raven-num-slots", "16"]
    args += ["--raven-top-k", "4", "--sse-lora-rank", "8"]
    args += ["--mixer", "raven", "--layers", "0", "--mixer", "sse", "--layers", "1", "--mixer", "sila", "--layers", "2"]
    assert convert_main(args) == 0
    (tmp_path / "text.txt").write_text(" ".join(PARAGRAPHS) * 20)
    out = tmp_path / "eval"
    extra = ["--ppl-data", str(tmp_path / "text.txt"), "--ppl-lengths", "64", "--attention-window", "400"]
    report = run_eval(model_dir, out, haystack, *extra)
    assert report["request"]["lengths"] == [700] and report["request"]["attention_window"] == 400
    assert set(report["retrieval"]) == {"passkey/standard", "niah_single_2/standard"}
    assert all(0 <= t["accuracy"] <= 1 and t["n"] == 2 for t in report["retrieval"].values())
    for label, summary in report["retrieval"].items():  # depth 0 lies past the window, depth 0.5 inside it
        split = summary["past_window"]
        assert split["window"] == 400 and split["past"]["n"] == split["inside"]["n"] == 1, label
        scores = json.loads((out / f"retrieval_{label.replace('/', '_')}.json").read_text())["results"]
        assert sorted(r["needle_distance"] > 400 for r in scores) == [False, True], label
    assert report["perplexity"]["results"][0]["context_length"] == 64
    pictures = report["pictures"]
    assert set(pictures) == {
        "raven_esl",
        "raven_slot_allocation",
        "sila_input_gate",
        "sse_partition_usage",
        "sse_state_entropy",
    }
    for name in [*pictures.values(), "niah_passkey_standard.png", "niah_niah_single_2_standard.png", "loss_curve.png"]:
        assert (out / name).stat().st_size > 1000, name


def test_teacher_report_with_speed(tiny_sources, tmp_path, haystack):
    out = tmp_path / "eval"
    speed = ["--speed-lengths", "16", "--speed-batches", "1,2"]
    report = run_eval(tiny_sources["llama"], out, haystack, "--tasks", "passkey", *speed)
    rows = [(e["context_length"], e["batch_size"], e["path"]) for e in report["speed"]]
    path = "generate, dynamic cache (eager)"
    assert "pictures" not in report and rows == [(16, 1, path), (16, 2, path)]
    assert "past_window" not in report["retrieval"]["passkey/standard"]  # full attention: no window to be past
    assert (out / "speed.png").stat().st_size > 1000


@pytest.fixture
def papers(tmp_path):
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "paper.txt").write_text("\n\n".join([PAPER] * 12))
    return folder


def test_bad_task_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["model", "--out", str(tmp_path), "--tasks", "passkey,needle"])
    assert exit_info.value.code == 2
    assert "argument --tasks: unknown task 'needle'; allowed: passkey, niah_single_1," in capsys.readouterr().err


def test_a_task_on_a_named_haystack_is_reported_beside_the_task_and_resumed_apart(
    tiny_sources, tmp_path, haystack, papers, monkeypatch, capsys
):
    import raven_convert.evaluate.report as report_module

    run_retrieval, asked = report_module.run_retrieval, []

    def answer_until(stop):  # run_retrieval that records the tasks asked, interrupted at task `stop`
        def run(model, tokenizer, samples, **kwargs):
            asked.append(samples[0].task)
            if samples[0].task == stop:
                raise KeyboardInterrupt
            text, on_papers = " ".join(s.prompt for s in samples), "@" in samples[0].task
            assert (PAPER[:40] in text) == on_papers and any(p[:40] in text for p in PARAGRAPHS) != on_papers
            return run_retrieval(model, tokenizer, samples, **kwargs)

        return run

    out = tmp_path / "eval"
    args = [str(tiny_sources["llama"]), "--out", str(out), "--lengths", "700", "--depths", "0,1", "--samples", "1"]
    args += ["--haystack-dir", str(haystack), "--haystacks", f"papers={papers}", "--no-pictures"]
    args += ["--tasks", "niah_single_2,niah_single_2@papers"]
    monkeypatch.setattr(report_module, "run_retrieval", answer_until("niah_single_2@papers"))
    assert eval_main(args) == 130
    assert json.loads((out / "report.json").read_text())["finished"] == ["retrieval niah_single_2 (standard)"]
    assert "To resume:" in capsys.readouterr().err

    monkeypatch.setattr(report_module, "run_retrieval", answer_until("niah_single_2"))  # finished: not asked again
    assert eval_main([*args, "--resume"]) == 0
    assert asked == ["niah_single_2", "niah_single_2@papers", "niah_single_2@papers"]
    report = json.loads((out / "report.json").read_text())
    assert report["request"]["haystacks"] == {"papers": str(papers)}
    assert report["finished"] == ["retrieval niah_single_2 (standard)", "retrieval niah_single_2@papers (standard)"]
    assert list(report["retrieval"]) == ["niah_single_2/standard", "niah_single_2@papers/standard"]
    assert all(t["n"] == 2 for t in report["retrieval"].values())
    assert "niah_single_2@papers/standard: " in capsys.readouterr().out  # the printed table
    for name in ("niah_niah_single_2_standard.png", "niah_niah_single_2@papers_standard.png"):
        assert (out / name).stat().st_size > 1000, name
    results = json.loads((out / "retrieval_niah_single_2@papers_standard.json").read_text())["results"]
    assert [r["id"] for r in results] == [
        "niah_single_2@papers/standard/700/0/0",
        "niah_single_2@papers/standard/700/1/0",
    ]


def test_task_lengths_run_each_task_at_its_own_lengths(tiny_sources, tmp_path, haystack):
    flags = ["--tasks", "passkey,niah_word", "--lengths", "450,700", "--task-lengths", "niah_word=450", "--depths", "0"]
    report = run_eval(tiny_sources["llama"], tmp_path / "eval", haystack, *flags, "--no-pictures")
    assert report["request"]["task_lengths"] == {"niah_word": [450]}
    lengths = {task: sorted(map(int, r["by_length"])) for task, r in report["retrieval"].items()}
    assert lengths == {"passkey/standard": [450, 700], "niah_word/standard": [450]}


def test_named_haystacks_are_checked_before_loading(tmp_path, capsys, papers):
    (tmp_path / "empty").mkdir()
    for flags, message in [
        (["--haystacks", f"papers={tmp_path / 'empty'}"], f"haystack 'papers' {tmp_path / 'empty'}: no *.txt files"),
        (["--haystacks", "papers=no/such/papers"], "argument --haystacks: haystack 'papers' no/such/papers: no such"),
        (["--haystacks", str(papers)], f"argument --haystacks: '{papers}' is not NAME=DIR"),
        (["--haystacks", f"Papers={papers}"], "argument --haystacks: haystack name 'Papers' is not a short identifier"),
        (["--tasks", "niah_word@papers"], "argument --tasks: task 'niah_word@papers': no haystack named 'papers'; "),
        (
            ["--tasks", "niah_word@paper", "--haystacks", f"papers={papers}"],
            "no haystack named 'paper'; did you mean 'papers'? defined: papers",
        ),
        (["--tasks", "passkey@papers"], "argument --tasks: task 'passkey@papers': passkey hides its needles in"),
    ]:
        with pytest.raises(SystemExit) as exit_info:  # "model" does not exist: a refusal that loads nothing
            eval_main(["model", "--out", str(tmp_path / "eval"), *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags
        assert not (tmp_path / "eval").exists()


def test_attention_window_needs_a_hybrid(tiny_sources, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_main(
            [str(tiny_sources["llama"]), "--out", str(tmp_path), "--tasks", "passkey", "--attention-window", "64"]
        )
    assert exit_info.value.code == 2
    assert "--attention-window=64 applies to converted hybrids only" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--batch-size", "0", "argument --batch-size: expected an integer >= 1, got '0'"),
        ("--samples", "0", "argument --samples: expected an integer >= 1, got '0'"),
        ("--speed-lengths", "0", "argument --speed-lengths: '0' is not a length"),
        (
            "--speed-batches",
            "1,0",
            "argument --speed-batches: '1,0' is not a list of batch sizes; expected integers >=",
        ),
        ("--speed-batches", "8x", "argument --speed-batches: '8x' is not a list of batch sizes"),
        ("--lengths", ",", "argument --lengths: ',' names no length"),
        ("--tasks", ",", "argument --tasks: ',' names none"),
        ("--variants", "loud", "argument --variants: ['loud'] not allowed; choose from ['no_inst', 'standard',"),
        ("--depths", "0,half", "argument --depths: '0,half' is not a list of numbers"),
        ("--ppl-data", "no/such/texts", "argument --ppl-data: 'no/such/texts' does not exist"),
        ("--haystack-dir", "no/such/essays", "argument --haystack-dir: 'no/such/essays' does not exist"),
    ],
)
def test_bad_flags_are_refused_before_loading(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:  # "model" does not exist: a refusal that loads nothing
        eval_main(["model", "--out", str(tmp_path / "eval"), flag, value])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_a_failing_part_keeps_the_report_of_the_others(tiny_sources, tmp_path, haystack, monkeypatch, capsys):
    import raven_convert.evaluate.report as report_module

    def broken(*args, **kwargs):
        raise RuntimeError("speed broke")

    monkeypatch.setattr(report_module, "measure_speed", broken)
    out = tmp_path / "eval"
    args = [str(tiny_sources["llama"]), "--out", str(out), "--lengths", "700", "--depths", "0", "--samples", "1"]
    args += ["--haystack-dir", str(haystack), "--tasks", "passkey", "--speed-lengths", "16"]
    assert eval_main(args) == 1
    report = json.loads((out / "report.json").read_text())
    assert set(report["retrieval"]) == {"passkey/standard"} and "speed" not in report
    assert report["failed"] == {"speed": "RuntimeError: speed broke"}
    assert "speed (RuntimeError: speed broke) failed; the other parts are in" in capsys.readouterr().out


def test_ctrl_c_says_what_finished_and_the_rerun_resumes(tiny_sources, tmp_path, haystack, monkeypatch, capsys):
    import shlex

    import raven_convert.evaluate.report as report_module

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_module, "measure_speed", interrupt)
    out = tmp_path / "eval"
    args = [str(tiny_sources["llama"]), "--out", str(out), "--lengths", "700", "--depths", "0", "--samples", "1"]
    args += ["--haystack-dir", str(haystack), "--tasks", "passkey", "--speed-lengths", "16", "--speed-batches", "1"]
    assert eval_main(args) == 130
    line = capsys.readouterr().err.splitlines()[-1]
    resume = shlex.join(["raven-eval", *args, "--resume"])
    saved = f"finished parts are in {out / 'report.json'}: retrieval passkey (standard)"
    assert line == f"interrupted: {saved}. To resume: {resume}"
    assert json.loads((out / "report.json").read_text())["retrieval"]["passkey/standard"]["n"] == 1

    monkeypatch.undo()
    monkeypatch.setattr(report_module, "run_retrieval", interrupt)  # the finished part is not run again
    assert eval_main(shlex.split(resume)[1:]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (
        report["finished"] == ["retrieval passkey (standard)", "speed"] and report["speed"][0]["context_length"] == 16
    )
    assert report["seconds"].keys() == set(report["finished"])  # each part's time, the resumed one's kept


def test_raven_eval_help_gives_each_flag_its_default(capsys):
    with pytest.raises(SystemExit):
        eval_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [
        ("--lengths", "1024,2048,4096"),
        ("--samples", "4"),
        ("--depths", "0,0.25,0.5,0.75,1"),
        ("--ppl-lengths", "512,2048"),
        ("--ppl-windows", "8"),
        ("--picture-length", "1024"),
        ("--speed-batches", "1,8"),
    ]:
        assert re.search(rf"{flag} \S+ [^-]*\(default: {re.escape(default)}\)", text), flag
