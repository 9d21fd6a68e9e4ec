"""bench.py: the standard workload, and a CPU smoke run against Hugging Face; and a smoke run of
scripts/bench_server_faults.py (its faults' own tests are in test_server_faults.py)."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from nanovllm import LLM  # noqa: E402


def test_default_workload_draws_133966_output_tokens():
    prompts, max_tokens = bench.make_workload()
    assert len(prompts) == 256 and sum(max_tokens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(0 <= t <= 10_000 for p in prompts for t in p)


def test_small_vocab_keeps_the_stream():
    prompts, max_tokens = bench.make_workload(num_seqs=8, vocab_size=1000)
    full, full_max = bench.make_workload(num_seqs=8)
    assert max_tokens == full_max and prompts == [[t % 1000 for t in p] for p in full]


def preset_config(preset: str):
    """The Hugging Face config bench.py writes for a --dummy preset."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(bench.write_dummy_config(preset))


def assert_short_cpu_run(preset: str):
    """A short CPU run of the preset (4 sequences, prompts of 80-120 tokens) gives every token asked for."""
    result = bench.main(["--dummy", preset, "--num-seqs", "4", "--min-input-len", "80", "--max-input-len", "120",
                         "--min-output-len", "4", "--max-output-len", "8", "--device", "cpu", "--max-model-len", "256"])
    _, max_tokens = bench.make_workload(4, 80, 120, 4, 8, 0, 16384)
    assert result["output_tokens"] == sum(max_tokens)


@pytest.mark.parametrize("preset", ["gemma3-tiny", "gemma-3-1b"])
def test_gemma3_presets(preset):
    """gemma-3-1b is Gemma 3 1B's shape (26 layers, every sixth global, window 512); gemma3-tiny runs
    on CPU, with prompts longer than its window of 64."""
    config = preset_config(preset)
    assert type(config).__name__ == "Gemma3TextConfig" and config.architectures == ["Gemma3ForCausalLM"]
    if preset == "gemma-3-1b":
        assert config.layer_types.count("full_attention") == 4 and config.layer_types[5] == "full_attention"
        assert (config.sliding_window, config.hidden_size, config.vocab_size) == (512, 1152, 262144)
        return
    assert_short_cpu_run(preset)


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-0.8b"])
def test_qwen3_5_presets(preset):
    """qwen3.5-0.8b is Qwen3.5 0.8B's text shape (24 layers, every fourth full attention); qwen3.5-tiny
    runs on CPU through the state cache."""
    config = preset_config(preset)
    assert type(config).__name__ == "Qwen3_5TextConfig" and config.architectures == ["Qwen3_5ForCausalLM"]
    if preset == "qwen3.5-0.8b":
        assert config.layer_types.count("full_attention") == 6 and config.layer_types[3] == "full_attention"
        assert (config.hidden_size, config.linear_num_value_heads, config.vocab_size) == (1024, 16, 248320)
        return
    assert_short_cpu_run(preset)


@pytest.mark.parametrize("preset", ["gpt-oss-tiny", "gpt-oss-20b"])
def test_gpt_oss_presets(preset):
    """gpt-oss-20b is its shape (24 layers alternating window 128 and full, 32 experts, YaRN);
    gpt-oss-tiny runs on CPU, with prompts longer than its window of 64."""
    config = preset_config(preset)
    assert type(config).__name__ == "GptOssConfig" and config.architectures == ["GptOssForCausalLM"]
    if preset == "gpt-oss-20b":
        assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.num_local_experts == 32
        assert (config.sliding_window, config.hidden_size, config.vocab_size) == (128, 2880, 201088)
        assert config.rope_parameters["rope_type"] == "yarn"
        return
    assert_short_cpu_run(preset)


def test_qwen2_5_vl_presets_and_images_with_the_hf_baseline(capsys):
    """qwen2.5-vl-3b is Qwen2.5-VL 3B's shape (36 text layers, a 32-block tower); qwen2.5-vl-tiny runs
    on CPU with --images: 4 of 6 requests carry a 112 x 112 image (64 tokens each, 14-pixel patches
    merged 2 x 2), HF's generate beside it, every requested token produced by both."""
    config = preset_config("qwen2.5-vl-3b")
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert (config.text_config.num_hidden_layers, config.vision_config.depth, config.vision_config.patch_size) == (
        36, 32, 14)
    result = bench.main(["--dummy", "qwen2.5-vl-tiny", "--num-seqs", "6", "--images", "4", "--image-size", "112",
                         "--min-input-len", "20", "--max-input-len", "40", "--min-output-len", "4",
                         "--max-output-len", "8", "--device", "cpu", "--compare", "hf"])
    _, max_tokens = bench.make_workload(6, 20, 40, 4, 8, 0, 16384)
    assert result["images"] == 4 and result["output_tokens"] == result["baseline"]["output_tokens"] == sum(max_tokens)
    assert "one request at a time (images)" in capsys.readouterr().out


def test_cpu_smoke_run_with_hf_baseline(capsys):
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "16", "--min-input-len", "16", "--max-input-len", "64",
                         "--min-output-len", "8", "--max-output-len", "32", "--device", "cpu", "--max-model-len", "256",
                         "--compare", "hf", "--json"])
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    _, max_tokens = bench.make_workload(16, 16, 64, 8, 32, 0, 16384)
    assert last["output_tokens"] == result["output_tokens"] == sum(max_tokens)
    for key in ("ttft_s", "tpot_s"):
        assert set(last[key]) == {"p50", "p90", "p99"} and last[key]["p50"] > 0
    assert last["baseline"]["output_tokens"] == sum(max_tokens) and not last["baseline"]["capped"]
    assert last["ratio"] == last["output_tok_per_s"] / last["baseline"]["output_tok_per_s"]
    assert "nanovllm" in out and "HF transformers" in out and "ratio nanovllm / HF" in out
    assert last["gpu_idle_between_decode_steps"] is None  # timed with CUDA events: only on a GPU


def test_batch_invariant_option_reaches_the_engine_and_the_record(capsys):
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "4", "--min-input-len", "8", "--max-input-len", "24",
                         "--min-output-len", "4", "--max-output-len", "8", "--device", "cpu", "--max-model-len", "64",
                         "--batch-invariant", "--json"])
    out = capsys.readouterr().out
    assert result["batch_invariant"] is json.loads(out.strip().splitlines()[-1])["batch_invariant"] is True
    assert "batch-invariant]" in out and not result["failed_checks"]
    assert bench.parse_args(["--dummy", "qwen3-tiny"]).batch_invariant is False


def test_capped_baseline_reports_what_it_finished(capsys):
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "8", "--min-input-len", "8", "--max-input-len", "16",
                         "--min-output-len", "4", "--max-output-len", "8", "--device", "cpu", "--max-model-len", "64",
                         "--compare", "hf", "--hf-batch-size", "2", "--hf-time-limit", "0"])
    assert result["baseline"]["capped"] and result["baseline"]["output_tokens"] < result["output_tokens"]
    assert "capped" in capsys.readouterr().out


def test_timeline_draws_every_step(tmp_path):
    """--timeline records every timed step (with preemptions under a small KV cache) and draws them."""
    pytest.importorskip("matplotlib", reason="--timeline needs matplotlib (the 'plot' extra)")
    png = tmp_path / "timeline.png"
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "16", "--min-input-len", "16", "--max-input-len", "64",
                         "--min-output-len", "8", "--max-output-len", "48", "--device", "cpu", "--max-model-len", "128",
                         "--num-kvcache-blocks", "24", "--timeline", str(png)])
    assert result["timeline"] == str(png) and result["num_preemptions"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_pipeline_run_prints_each_stages_busy_share_and_draws_it_per_step(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="--timeline needs matplotlib (the 'plot' extra)")
    drawn = []
    draw = bench.draw_timeline
    monkeypatch.setattr(bench, "draw_timeline", lambda records, *args: drawn.append(records) or draw(records, *args))
    png = tmp_path / "timeline.png"
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "8", "--min-input-len", "16", "--max-input-len", "32",
                         "--min-output-len", "8", "--max-output-len", "8", "--device", "cpu", "--max-model-len", "64",
                         "--pipeline-parallel-size", "2", "--timeline", str(png)])
    busy = result["pipeline_stage_busy"]
    assert len(busy) == 2 and all(0 < b <= 1 for b in busy)
    assert "pipeline stages busy in decode steps: stage 0" in capsys.readouterr().out
    (records,) = drawn
    assert records and all(len(r["stage_busy"]) == 2 for r in records) and png.stat().st_size > 10_000


def test_moe_presets():
    """--dummy qwen3-30b-a3b is Qwen3-30B-A3B's shape (30.5B parameters, built here on the meta
    device), and its toy twin runs on CPU."""
    from transformers import AutoConfig

    from nanovllm.models import resolve_model_class
    config = AutoConfig.from_pretrained(bench.write_dummy_config("qwen3-30b-a3b"))
    model_class = resolve_model_class(config, 4096)
    assert model_class.__name__ == "Qwen3MoeForCausalLM"
    with torch.device("meta"):
        model = model_class(config, 4096)
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    result = bench.main(["--dummy", "qwen3-moe-tiny", "--num-seqs", "8", "--min-input-len", "8", "--max-input-len", "32",
                         "--min-output-len", "4", "--max-output-len", "16", "--device", "cpu", "--max-model-len", "64"])
    _, max_tokens = bench.make_workload(8, 8, 32, 4, 16, 0, 16384)
    assert result["output_tokens"] == sum(max_tokens)


def test_speculative_run_with_a_dummy_draft_and_its_timeline(tmp_path, monkeypatch):
    """--speculative-config with the target's own preset as the draft ("dummy:qwen3-tiny": the
    same random weights): every draft is accepted, about 1 / (k + 1) target forwards per output
    token, and the timeline records each step's drafts and tokens out."""
    pytest.importorskip("matplotlib", reason="--timeline needs matplotlib (the 'plot' extra)")
    records = []
    monkeypatch.setattr(bench, "draw_timeline", lambda steps, num_blocks, path: records.extend(steps))
    config = {"method": "draft_model", "model": "dummy:qwen3-tiny", "num_speculative_tokens": 4}
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "4", "--min-input-len", "16", "--max-input-len", "32",
                         "--min-output-len", "64", "--max-output-len", "64", "--device", "cpu",
                         "--max-model-len", "128",
                         "--temperature", "0", "--speculative-config", json.dumps(config),
                         "--timeline", str(tmp_path / "t.png"), "--min-acceptance-rate", "1.0"])
    assert result["failed_checks"] == []
    # (k = 4: a mean acceptance length of 5, less where the last drafts stop short of max_tokens)
    assert result["spec_acceptance_rate"] == 1.0 and result["spec_mean_acceptance_length"] > 4.5
    assert result["target_forwards_per_output_token"] < 0.25
    speculative = [r for r in records if r["draft_tokens"]]
    assert speculative and all(r["emitted_tokens"] == r["draft_tokens"] + r["num_seqs"] for r in speculative)
    assert sum(r["emitted_tokens"] for r in records) == result["output_tokens"]


def test_bench_server_faults_runs_and_reports_its_figures(capsys):
    """One repeat of each fault (a 0.5 MiB prompt: still refused, sooner): every client is answered
    and both figures are printed. The SIGTERM target is off; a stream-gap target of 0 s is over
    whatever the machine (exit status 1)."""
    import pytest
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_server_faults
    result = bench_server_faults.main(["--repeats", "1", "--prompt-mib", "0.5", "--sigterm-exit-target", "inf",
                                       "--stream-gap-target", "0"])
    out = capsys.readouterr().out
    assert result["wrong"] == [] and result["over_target"] == ["stream_gap_s"]
    for name in ("sigterm_exit_s", "stream_gap_s", "refusal_s"):
        assert 0 < result[name]["min"] <= result[name]["median"] <= result[name]["max"] < float("inf")
    for words in ("SIGTERM under load to exit", "longest stream gap during a 0.5 MiB prompt",
                  "over target: stream_gap_s"):
        assert words in out


def _bench_host():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_host
    return bench_host


HOST_SMOKE = ["--num-seqs", "8", "--steps", "6", "--prompt-lens", "20", "40", "--equal-prompt-len", "16",
              "--block-sizes", "16"]


def test_bench_host_runs_both_modes(capsys):
    """scripts/bench_host.py's default run (no upstream checkout): a figure per mode and workload."""
    results = _bench_host().main(HOST_SMOKE)
    assert set(results) == {"ours"} and len(results["ours"]) == 4
    assert {k[0] for k in results["ours"]} == {"stub", "real"} and all(v[0] > 0 for v in results["ours"].values())
    assert "ours/upstream" not in capsys.readouterr().out


def test_bench_host_compares_with_upstream(capsys):
    """--upstream: both sides, each in its own interpreter (set NANOVLLM_UPSTREAM to a checkout of
    github.com/GeeeekExplorer/nano-vllm to run it)."""
    import pytest
    upstream = os.environ.get("NANOVLLM_UPSTREAM")
    if not upstream:
        pytest.skip("no upstream nano-vllm checkout (NANOVLLM_UPSTREAM)")
    results = _bench_host().main(HOST_SMOKE + ["--modes", "stub", "--threads", "1", "--upstream", upstream])
    assert set(results) == {"ours", "upstream"} and results["ours"].keys() == results["upstream"].keys()
    assert all(v[0] > 0 for side in results.values() for v in side.values())
    assert "ours/upstream" in capsys.readouterr().out


# ---- the probe: quantized output against the unquantized model's --------------------------------
PROBE_RUN = ["--num-seqs", "2", "--min-input-len", "8", "--max-input-len", "8", "--min-output-len", "1",
             "--max-output-len", "1", "--device", "cpu", "--max-model-len", "256"]


def probe_run(tmp_path, *extra, build=None, monkeypatch=None):
    """bench.main on qwen3-tiny with --probe-check against its unquantized probe (saved once);
    build: wraps the LLM the run builds (to break one of its layers)."""
    reference = tmp_path / "reference.json"
    if not reference.exists():
        bench.main(["--dummy", "qwen3-tiny", *PROBE_RUN, "--probe-save", str(reference)])
    if build is not None:
        monkeypatch.setattr(bench, "LLM", build)
    return bench.main(["--dummy", "qwen3-tiny", *PROBE_RUN, *extra, "--probe-check", str(reference)])


def test_probe_of_each_quantized_dummy_model_is_near_the_unquantized_one(tmp_path):
    """A dummy FP8 block or AWQ checkpoint is the unquantized random model quantized (the same draws),
    so its probe lies within the quantization's error of the unquantized probe: on qwen3-tiny
    about 0.10 (fp8), 0.27 (int4), 0.06 (fp8 KV cache), against sqrt(2) for unrelated weights."""
    bounds = {("--quantization", "fp8"): 0.15, ("--dummy", "qwen3-tiny-fp8"): 0.15,
              ("--dummy", "qwen3-tiny-awq"): 0.4, ("--kv-cache-dtype", "fp8"): 0.1}
    for extra, bound in bounds.items():
        result = probe_run(tmp_path, *extra, "--probe-max-error", str(bound))
        assert result["probe_ok"] and set(result["probe_error"]) == set(bench.PROBE_STEPS), (extra, result)
        assert 0.005 < max(result["probe_error"].values()) <= bound, (extra, result["probe_error"])
    assert probe_run(tmp_path)["probe_error"] == dict.fromkeys(bench.PROBE_STEPS, 0.0)


def off_by(part: str, factor: float):
    """An LLM factory whose layers named *part have their output scaled by factor."""
    def build(*args, **kwargs):
        llm = LLM(*args, **kwargs)
        for name, module in llm.model_runner.model.named_modules():
            if name.endswith(part):
                module.register_forward_hook(lambda mod, inputs, out: out * factor)
        return llm
    return build


@pytest.mark.parametrize("part", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
def test_probe_sees_every_layer(tmp_path, monkeypatch, part):
    """Every layer has its share in the dummy model's output (weights of variance 1 / fan_in; the
    earlier +-1e-3 weights hid the MLP: 1e-4 for its output 10% off): one kind of layer 10% off
    moves the probe by 3% or more at every step, and a sign error fails it at any bound used."""
    errors = probe_run(tmp_path, build=off_by(part, 1.1), monkeypatch=monkeypatch)["probe_error"]
    assert min(errors.values()) > 0.03, errors
    result = probe_run(tmp_path, "--probe-max-error", "0.4", build=off_by(part, -1.0), monkeypatch=monkeypatch)
    assert not result["probe_ok"] and min(result["probe_error"].values()) > 0.5, result["probe_error"]


def test_probe_check_exits_1_past_its_bound(tmp_path):
    import subprocess
    reference = tmp_path / "reference.json"
    bench.main(["--dummy", "qwen3-tiny", *PROBE_RUN, "--probe-save", str(reference)])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "bench.py", "--dummy", "qwen3-tiny-awq", *PROBE_RUN, "--probe-check",
                          str(reference), "--probe-max-error", "0.01"], cwd=root, capture_output=True, text=True)
    assert run.returncode == 1 and "bound 0.01: FAIL" in run.stdout, run.stdout + run.stderr


def test_failed_checks_name_what_the_output_contradicts():
    args = bench.parse_args(["--dummy", "qwen3-tiny", "--min-acceptance-rate", "0.9", "--probe-max-error", "0.2"])
    good = {"output_tokens": 100, "requested_output_tokens": 100, "spec_acceptance_rate": 0.95, "probe_ok": True}
    assert bench.failed_checks(args, good) == []
    assert bench.failed_checks(args, {**good, "output_tokens": 99}) == ["99 output tokens, 100 asked for"]
    assert bench.failed_checks(args, {**good, "spec_acceptance_rate": 0.5}) == ["acceptance rate 0.5 below 0.9"]
    assert bench.failed_checks(args, {**good, "probe_ok": False, "probe_error": {"16 rows": 0.3}}) == [
        "probe error {'16 rows': 0.3} past 0.2"]
