"""Defaults and the runtime switches read from an environment mapping (only the app and the CLI pass os.environ)."""

from specdemo.config import DEFAULT_DRAFTER, PRESETS, Runtime, runtime_from_env
from specdemo.drafters.registry import names


def test_runtime_from_an_empty_environment_is_the_default():
    assert runtime_from_env({}) == Runtime()


def test_runtime_reads_each_variable():
    env = {"SPECDEMO_CACHE": "/c", "SPECDEMO_FAST_LINEAR": "0", "SPECDEMO_NATIVE_LINEAR": "0", "SPECDEMO_MERGE": "0",
           "SPECDEMO_CUDNN_SDPA": "1", "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://mirror:8080"}
    assert runtime_from_env(env) == Runtime(cache_dir="/c", fast_linear=False, native_linear=False,
                                            merge_projections="off", cudnn_sdpa=True, hub_offline=True,
                                            hub_endpoint="http://mirror:8080")
    assert runtime_from_env({"XDG_CACHE_HOME": "/x"}).cache_dir == "/x/specdemo"
    assert runtime_from_env({"HF_HUB_OFFLINE": "0"}).hub_offline is False
    assert runtime_from_env({"SPECDEMO_FAST_LINEAR": "1"}).fast_linear is True
    assert [runtime_from_env({"SPECDEMO_MERGE": v}).merge_projections for v in ("1", "on", "", "auto", "x")] == [
        "on", "on", "auto", "auto", "auto"]


def test_presets_name_known_drafters():
    for p in PRESETS:
        assert p.drafter in ("",) + names()
    assert DEFAULT_DRAFTER in names()
