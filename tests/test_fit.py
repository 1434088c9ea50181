"""The memory estimate before loading (specdemo.models.fit, race.check_fit), the app's device-map settings and presets,
and the app refusing a pair that cannot fit, then serving the next request (issue 31). Tiny real models in folders."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_folder
from test_handlers import OUTPUTS

from app import limits_from_env
from specdemo.app.handlers import Handlers
from specdemo.app.race import (
    AppLimits,
    UserError,
    check_fit,
    make_request,
    placement_for,
)
from specdemo.config import PRESETS, Placement, placement_from
from specdemo.models.fit import GIB, estimate_fit, folder_params, size_bytes
from specdemo.models.loading import cache_root

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fit")
    model = save_tiny_folder(path, layers=2)
    return str(path), sum(p.numel() for p in model.parameters())


def test_parameters_are_counted_from_the_safetensors_headers(folder):
    path, count = folder
    assert folder_params(path) == count


def test_the_bundled_models_converted_folder_is_counted():
    path = cache_root() / "smollm2-135m"
    if not (path / "model.safetensors").exists():
        pytest.skip("the bundled model is not converted on this machine")
    assert 134_000_000 < folder_params(path) < 136_000_000  # SmolLM2-135M, tied embeddings counted once


def test_sizes_parse_like_accelerates():
    assert size_bytes("20GiB") == 20 * GIB and size_bytes("500MB") == 500 * 10**6 and size_bytes("1024") == 1024


def test_the_fit_compares_need_with_the_limits_and_says_so():
    """32.8 B + 0.5 B parameters in bf16 need about 68 GiB (weights and 10% more): refused under 0=20GiB,cpu=40GiB,
    allowed with an offload folder (the rest on disk, said to be slow) and under larger limits."""
    params = [32_800_000_000, 494_000_000]
    tight = placement_from("auto", "0=20GiB,cpu=40GiB")
    fit = estimate_fit(params, 2, tight, CPU)
    assert not fit.fits and fit.need > 60 * GIB and fit.allowed == 60 * GIB
    text = fit.message("Qwen/Qwen2.5-32B-Instruct + Qwen/Qwen2.5-0.5B-Instruct")
    assert "need about 68.2 GiB" in text and "allows 60.0 GiB" in text and "SPECDEMO_MAX_MEMORY" in text
    disk = estimate_fit(params, 2, placement_from("auto", "0=20GiB,cpu=40GiB", "/tmp/off"), CPU)
    assert disk.fits and "offload folder on disk" in disk.message("pair")
    roomy = estimate_fit(params, 2, placement_from("auto", "0=80GiB,cpu=40GiB"), CPU)
    assert roomy.fits and "allows 120.0 GiB" in roomy.message("pair")


def request_for(target: str, limits: AppLimits, drafter: str = "ngram"):
    return make_request("w3 w5 w7", target, drafter, "", 2, False, 0.0, 1.0, 8, limits)


def test_check_fit_refuses_a_folder_model_over_the_limits(folder):
    """The app's check: a model over the device map's memory and no offload folder is a UserError naming both sizes;
    with an offload folder it fits (on disk)."""
    path, _ = folder
    tight = AppLimits(allow_local_paths=True, placement=placement_from("auto", "cpu=10KB"))
    with pytest.raises(UserError, match="does not fit here.*need about"):
        check_fit(request_for(path, tight), tight, tight_runtime(), tight.placement)
    disk = AppLimits(allow_local_paths=True, placement=placement_from("auto", "cpu=10KB", "/tmp/off"))
    assert "disk" in check_fit(request_for(path, disk), disk, tight_runtime(), disk.placement)


def tight_runtime():
    from specdemo.config import Runtime

    return Runtime(fast_linear=False, hub_offline=True)


def test_presets_that_need_a_device_map_get_one_with_the_servers_limits():
    big = next(p for p in PRESETS if p.device_map)
    limits = AppLimits(placement=Placement(None, (("cpu", "60GiB"),), "/tmp/off"))
    assert placement_for(big.target, limits) == Placement("auto", (("cpu", "60GiB"),), "/tmp/off")
    assert placement_for("smollm2-135m", limits) == Placement()
    everywhere = AppLimits(placement=placement_from("balanced", "0=10GiB"))
    assert placement_for("smollm2-135m", everywhere) == everywhere.placement


def test_app_reads_the_device_map_settings_from_the_environment():
    env = {"SPECDEMO_DEVICE_MAP": "auto", "SPECDEMO_MAX_MEMORY": "0=20GiB,cpu=60GiB",
           "SPECDEMO_OFFLOAD_FOLDER": "/tmp/off", "SPECDEMO_DRAFT_DEVICE": "cpu"}
    limits = limits_from_env(env)
    assert limits.placement == Placement("auto", ((0, "20GiB"), ("cpu", "60GiB")), "/tmp/off")
    assert limits.draft_device == "cpu"
    only_limits = limits_from_env({"SPECDEMO_MAX_MEMORY": "cpu=60GiB"})  # for the presets that need a map
    assert not only_limits.placement.active and only_limits.placement.max_memory == (("cpu", "60GiB"),)
    with pytest.raises(SystemExit, match="SPECDEMO_MAX_MEMORY"):
        limits_from_env({"SPECDEMO_MAX_MEMORY": "cpu=plenty"})


def test_the_app_refuses_a_pair_that_cannot_fit_and_keeps_serving(folder):
    """A run over the limits ends with the fit message and releases the hardware; the next run on the same tiny
    model under limits it fits in (here: the whole of it on the CPU, through accelerate) completes."""
    path, _ = folder
    tight = AppLimits(allow_local_paths=True, placement=placement_from("auto", "cpu=10KB"))
    h = Handlers(OUTPUTS, tight, tight_runtime())
    with pytest.warns(UserWarning, match="does not fit"):
        outs = list(h.run_compare("w3 w5 w7 w3 w5", path, "ngram", "", 2, False, 0.0, 1.0, 8, False, False))
    assert "does not fit" in outs[-1]["status"] and not h.hardware.locked()
    roomy = AppLimits(allow_local_paths=True, placement=placement_from("auto", "cpu=1GiB"))
    h = Handlers(OUTPUTS, roomy, tight_runtime())
    outs = list(h.run_compare("w3 w5 w7 w3 w5", path, "ngram", "", 2, False, 0.0, 1.0, 8, False, False))
    assert outs[-1]["status"].startswith("Done") and outs[-1]["result_json"]["identical"]
    assert outs[-1]["result_json"]["placement"]["target"]["device_map"] == "auto"
    assert "placement: target on cpu" in outs[-1]["stats"]
