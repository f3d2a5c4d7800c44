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
    load_model_facts,
    load_profile,
    model_layers,
)
from disagg_mesh.server.common.types import ModelFacts


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


def test_a_prompts_time_counts_its_passes_size_and_the_prompts_beside_it() -> None:
    """Prompt time by new tokens, cached prefix and batch: llama-batched-bench's S_PP on the
    DGX Spark (gpt-oss-120b, ubatch 2048): 846 tok/s for one 512-token prompt, 1,750 for two,
    1,995 for four in one pass."""
    oss = load_profile("dgx-spark").model("gpt-oss:120b")
    depth0 = oss.prefill_rate(0)  # pp2048's rate at depth 0 (its pass factor is 1)
    assert oss.pass_factor(2048) == 1 and oss.pass_factor(512) == pytest.approx(846 / 1995)
    assert oss.pass_factor(256) == oss.pass_factor(512)  # no gain assumed below the table
    assert oss.pass_factor(8192) == pytest.approx(1997 / 1995)  # nor beyond it
    # One 512-token prompt alone, and four of them in one pass: the same pass time about.
    alone = oss.prefill_seconds(512)
    assert alone == pytest.approx(512 / (oss.prefill_rate(256) * 846 / 1995))
    four = oss.prompts_seconds([(512, 0)] * 4)
    assert four == [pytest.approx(four[0])] * 4
    assert four[0] == pytest.approx(2048 / (oss.prefill_rate(256) * 1995 / 1995))
    assert 4 * 512 / four[0] > 2 * 512 / alone  # together: over twice the tokens a second
    # A long prompt in passes of the node's n_ubatch: each pass's depth and size.
    passes = oss.prefill_seconds(1536, cached_tokens=512, ubatch=512)
    expected = sum(512 / (oss.prefill_rate(d) * oss.pass_factor(512)) for d in (768, 1280, 1792))
    assert passes == pytest.approx(expected)
    assert oss.prefill_seconds(1536, 512) < passes  # one pass of 1,536: fuller, faster
    assert depth0 > 0 and oss.prefill_seconds(0, 100, ubatch=512) == 0
    # Prompts of different lengths share each pass evenly: the shorter one finishes first,
    # the longer one at the time the two take together.
    short, long = oss.prompts_seconds([(100, 0), (900, 0)], ubatch=512)
    assert short < long
    together = oss.prompts_seconds([(1000, 0)], ubatch=512)[0]
    assert long == pytest.approx(together, rel=0.05)
    # ... at the end of the first pass (its 100 tokens and 412 of the other's).
    mid = (100 * 50 + 412 * 206) / 512
    assert short == pytest.approx(512 / (oss.prefill_rate(mid) * oss.pass_factor(512)))
    # Without a pass table (the M3 Ultra's: no published figures), the size does not count.
    mac = load_profile("m3-ultra").model("qwen3-coder:30b")
    assert mac.pass_rate is None and mac.pass_factor(64) == 1
    assert mac.prefill_seconds(64) == pytest.approx(64 / mac.prefill_rate(32))


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
    # The M4 Max (the user's second Mac Studio): every figure an estimate, from the M3
    # Ultra's by Apple's specifications: 546 against 819 GB/s, 40 against 80 GPU cores.
    m4 = load_profile("m4-max")
    for model in ("gpt-oss:120b", "qwen3-coder:30b"):
        speed, ultra = m4.model(model), mac.model(model)
        assert speed.estimate and m4.gpu
        for streams, depth in ((1, 0), (8, 2000), (32, 8192)):
            ratio = speed.decode_step_seconds(streams, depth) / ultra.decode_step_seconds(
                streams, depth
            )
            assert ratio == pytest.approx(819 / 546, rel=0.02)
        ratio = speed.prefill_seconds(2048) / ultra.prefill_seconds(2048)
        assert ratio == pytest.approx(2, rel=0.02)
        assert speed.kv_bytes(1000) == ultra.kv_bytes(1000)
    baseline = load_baseline()
    assert (
        baseline.parallel_for("gpt-oss:120b") == 1 and baseline.parallel_for("qwen3-coder:30b") == 1
    )  # OLLAMA_NUM_PARALLEL's default since Ollama 0.9.7
    assert baseline.with_num_parallel(4).parallel_for("qwen3-coder:30b") == 4
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
    message = broken(
        '[models."m"]\nkv_bytes_per_token = 10\n[models."m".prefill]\n'
        "depth_tokens = [0]\ntokens_per_second = [1]\npass_tokens = [512]\n"
        "pass_tokens_per_second = [800]\n" + good_decode
    )
    assert "prefill.measured_prompt_tokens" in message and "pass_tokens" in message
    message = broken(
        '[models."m"]\nkv_bytes_per_token = 10\n[models."m".prefill]\n'
        "depth_tokens = [0]\ntokens_per_second = [1]\npass_tokens = [512, 256]\n"
        "pass_tokens_per_second = [800, 900]\nmeasured_prompt_tokens = 512\n" + good_decode
    )
    assert "pass_tokens" in message and "must rise" in message
    assert "profile.gpu" in broken('[profile]\ngpu = "yes"\n')
    message = broken("[link]\nbandwidth_bytes_per_second = 0\n")
    assert "link.bandwidth_bytes_per_second" in message
    assert "mine.toml" in broken("[link\n")
    with pytest.raises(ProfileError, match=r"no such file, and no shipped one .*dgx-spark"):
        load_profile("dgx-sparkle")
    with pytest.raises(ProfileError, match=r"no \[models.'llama'\]"):
        load_profile("dgx-spark").model("llama")


def test_a_sim_node_says_what_its_model_is_from_the_shipped_facts(tmp_path: Path) -> None:
    """models.toml: each model the shipped profiles time, its sizes and abilities as an
    embedded node reads them from the model's file; any other model says nothing."""
    oss, coder = load_model_facts("gpt-oss:120b"), load_model_facts("qwen3-coder:30b")
    assert (oss.architecture, oss.parameter_size, oss.quantization) == ("gptoss", "116.8B", "MXFP4")
    assert (oss.trained_context_tokens, oss.embedding_length) == (131_072, 2_880)
    assert oss.reasons and oss.takes_tools and oss.inserts is False
    assert (coder.architecture, coder.parameter_size) == ("qwen3moe", "30.5B")
    assert coder.trained_context_tokens == 262_144 and coder.embedding_length == 2_048
    assert coder.inserts and coder.takes_tools and coder.reasons is False
    for profile in PROFILES.glob("*.toml"):
        if profile.stem != "ollama":
            assert all(load_model_facts(m).architecture for m in load_profile(profile.stem).models)
    assert load_model_facts("smollm2") == ModelFacts() and model_layers("smollm2") == 0
    # Layers as llama.cpp counts them (the blocks and the output layer), on both machines'
    # GPUs.
    assert (model_layers("gpt-oss:120b"), model_layers("qwen3-coder:30b")) == (37, 49)
    assert load_profile("dgx-spark").gpu and load_profile("m3-ultra").gpu
    path = tmp_path / "models.toml"
    path.write_text('[models."m"]\ncapabilities = ["completion", "vision"]\n')
    with pytest.raises(ProfileError, match=r"models.toml: models.'m'.capabilities: .*vision"):
        load_model_facts("m", path)
