"""results_table.py: a task on a named haystack (TASK@NAME) gets its columns beside TASK's."""

import json

from scripts.results_table import main


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
