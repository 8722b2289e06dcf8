"""benchmarks/sample.py --small, in this process: the benchmark of `jaxkit sample`'s cache
against recomputing the prefix runs by hand (minutes); this keeps it from rotting between
those runs, at shrunk shapes."""

import json

from script_module import load


def _benchmark():
    return load("benchmarks/sample.py")


def test_the_sampling_benchmark_runs_both_paths_to_the_same_tokens_and_sizes_the_cache(tmp_path):
    out = tmp_path / "sample.json"
    # One point of the three --small has (each compiles two programs, 4 CPU-s): llama_tiny's,
    # whose recomputed path the target is set against, with grouped-query heads.
    argv = ["--small", "--configs", "llama_tiny", "--new-tokens", "24", "--out", str(out)]
    results = _benchmark().main(argv)
    assert json.loads(out.read_text()) == results
    points = {(p["config"], p["new_tokens"]): p for p in results["points"]}
    assert list(points) == [("llama_tiny", 24)]
    for p in points.values():
        # The same keys drawing from the same logits (the cache's equal a full forward pass
        # to ~1e-6, tests/test_sampling.py): a path that skipped or misplaced a token, or
        # timed less than the whole generation, would not draw the recomputed path's tokens.
        assert p["tokens_agree"] == p["new_tokens"]
        assert p["cache"]["prompt_bucket"] == 16 and p["cache_slots"] == 16 + p["new_tokens"]
        for path in ("cache", "recompute"):
            timed = p[path]
            assert timed["compile_s"] > 0 and timed["generate_s"] > 0
            assert timed["tokens_per_s"] == p["rows"] * p["new_tokens"] / timed["generate_s"]
    # Keys and values (2) x 2 layers x 40 slots x 2 key/value heads (4 query heads share
    # them) x head width 8 (d_model 32 / 4 heads) x 4 bytes (float32).
    assert points["llama_tiny", 24]["cache_bytes_per_sequence"] == 2 * 2 * 40 * 2 * 8 * 4
    # No point at 1,024 new tokens: the target is not claimed either way.
    assert results["target"]["ratio"] is None and results["target"]["holds"] is None
