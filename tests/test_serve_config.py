"""serve-config, the way out to vLLM and SGLang: the speculative configuration of each method (our lookup window, an
EAGLE-3 folder, suffix decoding's options under vLLM's names), block verification, the command lines (the JSON
survives shell quoting, SGLang counts the root token) and the k from a bench.json."""

import json
import shlex

import pytest

from specdemo.__main__ import main as cli_main
from specdemo.drafters import HybridDrafter, NgramDrafter
from specdemo.serve.serve_config import Lookup, sglang_flags, vllm_serve_command, vllm_speculative_config


def test_speculative_config_maps_our_lookup_window_and_k():
    d = NgramDrafter()
    assert vllm_speculative_config("ngram", 4) == {"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_max": d.max_ngram, "prompt_lookup_min": d.min_ngram}
    hybrid = HybridDrafter(NgramDrafter(), min_match=3)  # its lookup part: matches of 3 or more
    assert Lookup.of(hybrid) == Lookup(3, 8)
    assert vllm_speculative_config("ngram", 2, lookup=Lookup.of(hybrid))["prompt_lookup_min"] == 3
    assert vllm_speculative_config("eagle3", 5, "/heads/e3") == {"method": "eagle3", "model": "/heads/e3",
                                                                 "num_speculative_tokens": 5}
    with pytest.raises(ValueError, match="export"):
        vllm_speculative_config("eagle3", 5)
    with pytest.raises(ValueError):
        vllm_speculative_config("ngram", 0)
    with pytest.raises(ValueError, match="unknown"):
        vllm_speculative_config("medusa", 2)


def test_block_verification_reaches_vllms_rejection_sample_method(capsys):
    """serve-config --verification block adds vLLM's rejection_sample_method 'block' and says where vLLM runs it;
    token-wise leaves vLLM's default ('standard') alone."""
    assert vllm_speculative_config("ngram", 4, verification="block")["rejection_sample_method"] == "block"
    assert "rejection_sample_method" not in vllm_speculative_config("ngram", 4)
    with pytest.raises(ValueError, match="token, block"):
        vllm_speculative_config("ngram", 4, verification="tree")
    assert cli_main(["serve-config", "--drafter", "ngram", "--k", "3", "--verification", "block", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(shlex.split(out["vllm"])[4])["rejection_sample_method"] == "block"
    assert any("Model Runner V2" in n for n in out["notes"])


def test_serve_command_quotes_the_json_so_a_shell_gives_it_back():
    spec = vllm_speculative_config("eagle3", 3, "/my heads/e3")
    argv = shlex.split(vllm_serve_command("/models/my target", spec, ["--tensor-parallel-size", "2"]))
    assert argv[:3] == ["vllm", "serve", "/models/my target"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == spec and argv[5:] == ["--tensor-parallel-size", "2"]
    assert shlex.split(vllm_serve_command("t", None)) == ["vllm", "serve", "t"]


def test_sglang_flags_count_the_root_token():
    ngram = shlex.split(sglang_flags("ngram", 4, lookup=Lookup(2, 5)))
    assert ngram[ngram.index("--speculative-algorithm") + 1] == "NGRAM"
    assert ngram[ngram.index("--speculative-num-draft-tokens") + 1] == "5"
    assert ngram[ngram.index("--speculative-ngram-max-match-window-size") + 1] == "5"
    eagle = shlex.split(sglang_flags("eagle3", 4, "/e3"))
    assert eagle[eagle.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert [eagle[eagle.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                "--speculative-num-draft-tokens")] == ["4", "1", "5"]


def test_serve_config_prints_vllm_and_sglang_for_the_tuned_k(capsys, tmp_path):
    """k from --k, else the measured best k of a bench.json; an exported EAGLE-3 folder maps to eagle3; a folder that
    is neither an EAGLE-3 head nor a causal LM is refused, the shipped EAGLE-3 head is served as it is; tensor and
    pipeline parallel flags reach the command."""
    assert cli_main(["serve-config", "--drafter", "ngram", "--k", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative_config"] == vllm_speculative_config("ngram", 6) and out["k_source"] == "--k"
    assert json.loads(shlex.split(out["vllm"])[4]) == out["speculative_config"]
    assert "--speculative-algorithm NGRAM" in out["sglang"]

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"theory": {"best_measured_k": 3, "best_k": 5}}))
    head = tmp_path / "e3"
    head.mkdir()
    (head / "speculative_config.json").write_text(json.dumps({"method": "eagle3", "num_speculative_tokens": 2}))
    assert cli_main(["serve-config", "--draft", str(head), "--sweep", str(bench), "--tensor-parallel-size", "4",
                     "--pipeline-parallel-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "eagle3" and out["k"] == 3 and "best_measured_k" in out["k_source"]
    assert out["speculative_config"] == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    argv = shlex.split(out["vllm"])
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"

    # the shipped draft is an EAGLE-3 head in vLLM's format: served from its folder as it is
    assert cli_main(["serve-config", "--drafter", "model", "--draft", "smollm2-135m-draft", "--k", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "eagle3" and out["speculative_config"]["model"].endswith("specdemo/data/smollm2-135m-draft")
    other = tmp_path / "no-config"  # a folder with no config.json: neither an EAGLE-3 head nor a causal LM
    other.mkdir()
    (other / "weights.safetensors").write_bytes(b"")
    assert cli_main(["serve-config", "--drafter", "model", "--draft", str(other)]) == 2
    assert f"got '{other}': a folder with no config.json." in capsys.readouterr().err
    assert cli_main(["serve-config", "--drafter", "ngram", "--k", "0"]) == 2


def test_suffix_maps_to_vllms_suffix_method_with_its_option_names(capsys):
    """serve-config prints vLLM's suffix --speculative-config with the suffix_decoding_* options given as flags, and
    says that our cost-aware cut has no vLLM option."""
    assert cli_main(["serve-config", "--drafter", "suffix", "--k", "16", "--suffix-min-token-prob", "0.2",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "suffix" and out["speculative_config"] == {
        "method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.2}
    assert json.loads(shlex.split(out["vllm"])[4]) == out["speculative_config"]
    assert "--speculative-algorithm SUFFIX --speculative-num-draft-tokens 17" in out["sglang"]
    assert cli_main(["serve-config", "--drafter", "suffix", "--suffix-max-spec-factor", "-1"]) == 2
    assert "suffix_decoding_max_spec_factor=-1.0 must be >= 0" in capsys.readouterr().err
    # our cost-aware cut (on by default) has no vLLM option: the config is the same either way, and a note says so
    assert any("no cost-aware cut" in note for note in out["notes"]), out
    assert cli_main(["serve-config", "--drafter", "suffix", "--k", "16", "--suffix-min-token-prob", "0.2",
                     "--no-suffix-cost-aware", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["speculative_config"] == out["speculative_config"]
    assert not any("no cost-aware cut" in note for note in plain["notes"]), plain
