"""The simulated engine's hardware profiles (#41): interpolation, the shipped files against
the published figures they cite, and errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_mesh.server.common.engines.sim.profile import (
    PROFILES,
    ProfileError,
    Table,
    load_baseline,
    load_profile,
)


def test_a_table_interpolates_between_points_and_extrapolates_with_care() -> None:
    rate = Table((0.0, 10.0, 20.0), (100.0, 80.0, 70.0))
    assert rate(0) == 100 and rate(10) == 80 and rate(20) == 70
    assert rate(5) == pytest.approx(90) and rate(15) == pytest.approx(75)
    assert rate(-5) == 100  # before the first point: its value
    assert rate(30) == pytest.approx(60)  # beyond: the last segment's slope
    assert rate(1000) == pytest.approx(7)  # ... floored at a tenth of the last value
    flat = Table((1.0, 4.0), (10.0, 25.0), flat_beyond=True)
    assert flat(2) == pytest.approx(15) and flat(64) == 25  # no gain assumed beyond
    assert Table((0.0,), (5.0,))(123) == 5


def test_the_dgx_spark_profile_gives_back_the_published_figures() -> None:
    spark = load_profile("dgx-spark")
    oss = spark.model("gpt-oss:120b")
    # llama.cpp's pp2048 at depth 0 and 8192: 1,938 and 1,581 tokens/s.
    assert oss.prefill_seconds(2048) == pytest.approx(2048 / 1938)
    assert oss.prefill_seconds(2048, cached_tokens=8192) == pytest.approx(2048 / 1581)
    # Deeper prompts are slower; a cached prefix costs nothing but depth.
    assert oss.prefill_seconds(2048, 4096) > oss.prefill_seconds(2048, 0)
    assert oss.prefill_seconds(0, 4096) == 0
    # Batched generation: 57 tok/s alone, 313 at 32 streams (a step of 32 tokens).
    assert oss.decode_step_seconds(1, 0) == pytest.approx(1 / 57)
    assert oss.decode_step_seconds(32, 0) == pytest.approx(32 / 313)
    assert oss.decode_step_seconds(64, 0) == pytest.approx(64 / 313)  # no gain beyond 32
    # One stream at depth 8192: the published 59 -> 51.9 tok/s fall.
    assert oss.decode_step_seconds(1, 8192) == pytest.approx(1 / (57 * 51.9 / 59))
    # KV: every position of the full layers, the 128-token window of the others.
    assert oss.kv_bytes(1000) == 1000 * 36864 + 128 * 36864
    qwen = spark.model("qwen3-coder:30b")
    assert qwen.kv_bytes(1000) == 1000 * 98304
    assert qwen.prefill_seconds(2048) == pytest.approx(2048 / 3176)
    assert spark.link.seconds(1_150_000_000) == pytest.approx(1.0002)
    assert not oss.estimate and not qwen.estimate


def test_every_shipped_profile_loads_and_marks_its_estimates() -> None:
    for path in PROFILES.glob("*.toml"):
        if path.stem == "ollama":
            continue
        profile = load_profile(path.stem)
        assert set(profile.models) == {"gpt-oss:120b", "qwen3-coder:30b"}, path
        for speed in profile.models.values():
            assert speed.prefill_seconds(1000, 1000) > 0 and speed.decode_step_seconds(4, 500) > 0
    mac = load_profile("m3-ultra")
    assert mac.model("gpt-oss:120b").estimate and mac.model("qwen3-coder:30b").estimate
    # The Mac generates faster than the Spark, and evaluates prompts slower (the published
    # figures' shape: 819 against 273 GB/s, 26 against ~100 TFLOPS).
    spark = load_profile("dgx-spark")
    for model in ("gpt-oss:120b", "qwen3-coder:30b"):
        assert mac.model(model).decode_step_seconds(1, 0) < spark.model(model).decode_step_seconds(
            1, 0
        )
        assert mac.model(model).prefill_seconds(2048) > spark.model(model).prefill_seconds(2048)
    baseline = load_baseline()
    assert (
        baseline.parallel_for("gpt-oss:120b") == 1 and baseline.parallel_for("qwen3-coder:30b") == 4
    )
    assert baseline.prompt_evaluated_on_decode_host and not baseline.kv_handoff


def test_a_bad_profile_names_its_file_and_key(tmp_path: Path) -> None:
    def broken(text: str) -> str:
        path = tmp_path / "mine.toml"
        path.write_text(text)
        with pytest.raises(ProfileError) as caught:
            load_profile(str(path))
        return str(caught.value)

    good_decode = (
        '[models."m".decode]\ndepth_tokens = [0]\ntokens_per_second = [10]\n'
        "batch = [1]\nbatch_tokens_per_second = [10]\n"
    )
    message = broken(
        '[models."m"]\nkv_bytes_per_token = 10\n[models."m".prefill]\n'
        "depth_tokens = [0, 100, 50]\ntokens_per_second = [1, 2, 3]\n" + good_decode
    )
    assert "mine.toml" in message and "depth_tokens" in message and "must rise" in message
    message = broken('[models."m"]\nkv_bytes_per_token = 10\n' + good_decode)
    assert "[prefill]" in message
    message = broken("[link]\nbandwidth_bytes_per_second = 0\n")
    assert "link.bandwidth_bytes_per_second" in message
    assert "mine.toml" in broken("[link\n")
    with pytest.raises(ProfileError, match=r"no such file, and no shipped one .*dgx-spark"):
        load_profile("dgx-sparkle")
    with pytest.raises(ProfileError, match=r"no \[models.'llama'\]"):
        load_profile("dgx-spark").model("llama")
