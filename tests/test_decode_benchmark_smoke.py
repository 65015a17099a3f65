"""`benchmarks/decode.py` runs end to end at tiny shapes in a few seconds and writes its JSON and Markdown."""

import json

from conftest import load_benchmark


def test_decode_benchmark_smoke(tmp_path, capsys):
    benchmark = load_benchmark("decode")
    report = benchmark.main([
        "--target", "tiny-qwen3", "--num-prompts", "2", "--prompt-length", "6", "--max-new-tokens", "10",
        "--block-size", "4", "--warmup", "0", "--output-dir", str(tmp_path), "--output-name", "smoke",
    ])
    methods = [row["method"] for row in report["results"]]
    assert methods == ["plain", "hf-plain", "hf-domino", "native-domino"]
    for row in report["results"]:
        assert row["new_tokens"] == 20 and row["tokens_per_second"] > 0 and row["mean_acceptance_length"] >= 1.0
        assert row["matches_plain"] in (None, True), row  # greedy decoding is lossless on every path
    assert report["environment"]["torch"] and report["environment"]["transformers"]
    assert report["environment"]["draft_layers"] == 1 and report["settings"]["prompt_length"] == 6
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["results"] == report["results"]
    assert "| native-domino |" in (tmp_path / "smoke.md").read_text()
    assert "| hf-domino |" in capsys.readouterr().out


def test_plain_is_the_baseline_wherever_it_is_listed(tmp_path):
    report = load_benchmark("decode").main([
        "--target", "tiny-qwen3", "--num-prompts", "1", "--prompt-length", "4", "--max-new-tokens", "4",
        "--block-size", "4", "--warmup", "0", "--methods", "native-domino,plain", "--output-dir", str(tmp_path),
    ])
    rows = {row["method"]: row for row in report["results"]}
    assert [row["method"] for row in report["results"]] == ["plain", "native-domino"]
    assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["matches_plain"] is None
    assert rows["native-domino"]["matches_plain"] is True
