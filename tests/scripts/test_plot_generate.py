"""plot_generate.py draws bench_generate.py's JSON and refuses files that are not one."""

import json

import pytest

from scripts.bench.plot_generate import main


def test_plot_writes_a_png_and_skips_out_of_memory_rows(tmp_path):
    rows = [
        {"model": m, "batch": b, "context": c, "tokens_per_s": b * (3 if m == "raven" else 1) * 100.0}
        for m in ("teacher", "raven")
        for b in (1, 8, 32)
        for c in (4096, 16384)
    ] + [{"model": "teacher", "batch": 128, "context": 16384, "oom": True}]
    source = tmp_path / "bench_generate.json"
    source.write_text(json.dumps({"gpu": "test", "results": rows}))
    out = tmp_path / "plot.png"
    main([str(source), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("text, message", [("{", "cannot read"), ('{"rows": []}', "no 'results' list")])
def test_plot_refuses_what_is_not_a_bench_json(tmp_path, text, message):
    source = tmp_path / "bad.json"
    source.write_text(text)
    with pytest.raises(SystemExit, match=message):
        main([str(source), "--out", str(tmp_path / "plot.png")])
