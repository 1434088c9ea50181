"""The compiled few-row product (specdemo.models.kernels.native, fewrow.cpp): F.linear's result up to rounding at
every row count, each row's result independent of how many rows share the call, both vector widths, float16-valued
weights streamed as float16 with the same products, and torch's kernels wherever it cannot serve."""

import copy
import importlib
import logging

import pytest
import torch
from torch import nn

from specdemo.models import kernels

native_module = importlib.import_module("specdemo.models.kernels.native")
needs_compiler = pytest.mark.skipif(native_module.compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def nat(tmp_path_factory):
    built = kernels.native_kernel(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "a C++ compiler is on PATH, so the kernel must build"
    return built


def _avx2() -> bool:
    try:
        return " avx2 " in open("/proc/cpuinfo").read().replace("\n", " ")
    except OSError:
        return False


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 14, 15, 17, 29, 140])
@pytest.mark.parametrize("n,k", [(16, 5), (48, 37), (1536, 576)])
def test_matches_f_linear(nat, rows, n, k):
    torch.manual_seed(rows * 7 + n)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(1, rows, k)
    got = nat.linear(x, nat.pack(w), b)
    assert got.shape == (1, rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_compiler
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(nat):
    """What makes a 9-token verify pass compute each token's products bit for bit as a 1-token pass would."""
    torch.manual_seed(0)
    w = nat.pack(torch.randn(1536, 576))
    x = torch.randn(40, 576)
    alone = nat.linear(x[:1], w)
    for rows in (2, 3, 9, 14, 15, 17, 40):
        assert torch.equal(nat.linear(x[:rows], w)[:1], alone), rows


@needs_compiler
@pytest.mark.skipif(not _avx2(), reason="the AVX2 build needs an AVX2 CPU to run")
def test_the_avx2_build(tmp_path):
    """The 8-wide variant that AVX2-only machines build, compiled here for Haswell."""
    flags = tuple("-march=haswell" if f == "-march=native" else f for f in native_module.FLAGS)
    built = native_module.build(tmp_path, flags)
    assert built is not None and built.vector_width == 8
    torch.manual_seed(1)
    w, x = torch.randn(40, 24), torch.randn(30, 24)
    assert torch.equal(built.linear(x[:1], built.pack(w)), built.linear(x, built.pack(w))[:1])
    torch.testing.assert_close(built.linear(x, built.pack(w)), x @ w.T, rtol=1e-5, atol=1e-5)
    h = w.half().float()
    assert built.pack(h).dtype == torch.float16
    assert torch.equal(built.linear(x, built.pack(h)), built.linear(x, _plain_layout(h, 8)))


def _plain_layout(w: torch.Tensor, width: int) -> torch.Tensor:
    """w packed as the kernel packs float32 weights, whatever values it holds."""
    n, k = w.shape
    return w.reshape(n // width, width, k).transpose(1, 2).contiguous()


@needs_compiler
@pytest.mark.parametrize("n,k", [(48, 37), (1536, 576)])
def test_float16_valued_weights_pack_as_float16_with_the_same_products(nat, n, k):
    """An EAGLE-3 head's weights come from a float16 checkpoint: they stream at half the bytes, and since widening a
    float16 is exact, every product is bit for bit what the float32 copy gives, at every row count."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).half().float()
    packed = nat.pack(w)
    assert packed.dtype == torch.float16
    x = torch.randn(40, k)
    for rows in (1, 2, 3, 9, 14, 15, 17, 40):
        assert torch.equal(nat.linear(x[:rows], packed), nat.linear(x[:rows], _plain_layout(w, nat.vector_width)))
    w[3, 5] += 1e-4  # one value a float16 cannot hold: the whole weight stays float32
    assert nat.pack(w).dtype == torch.float32


@needs_compiler
@pytest.mark.skipif(native_module.platform.machine() != "x86_64", reason="builds for plain x86-64")
def test_a_build_without_f16c_keeps_float16_valued_weights_as_float32(tmp_path):
    """Where the CPU cannot widen float16 in one instruction (built here for plain x86-64, as a CPU without F16C
    would be; other architectures likewise), the kernel has no float16 entry and packs every weight as float32."""
    flags = tuple("-march=x86-64" if f == "-march=native" else f for f in native_module.FLAGS)
    built = native_module.build(tmp_path, flags)
    assert built is not None and torch.float16 not in built._run
    torch.manual_seed(4)
    h, x = torch.randn(24, 16).half().float(), torch.randn(5, 16)
    assert built.pack(h).dtype == torch.float32
    torch.testing.assert_close(built.linear(x, built.pack(h)), x @ h.T, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_built_once_per_folder(nat, tmp_path):
    assert kernels.native_kernel(nat.path.parent) is nat
    again = native_module.build.__wrapped__(nat.path.parent)  # another process: finds the file, compiles nothing
    assert again.path == nat.path


def test_no_compiler_or_a_failed_build_leaves_torch_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native_module, "compiler", lambda: None)
    assert native_module.build.__wrapped__(tmp_path) is None
    if native_module.shutil.which("c++") or native_module.shutil.which("g++"):
        monkeypatch.undo()
        with caplog.at_level(logging.WARNING):
            assert native_module.build.__wrapped__(tmp_path, ("-fno-such-flag-here",)) is None
        assert "building fewrow.cpp failed" in caplog.text
        monkeypatch.setattr(native_module, "SOURCE", tmp_path / "fewrow.cpp")  # an install that left it out
        assert native_module.build.__wrapped__(tmp_path) is None


@needs_compiler
def test_patched_layers_use_it_and_fall_back_where_the_shape_does_not_fit(nat):
    torch.manual_seed(2)
    fits, odd = nn.Linear(32, 3 * nat.vector_width), nn.Linear(32, 3 * nat.vector_width + 1)
    for layer in (fits, odd):
        kernels.patch_linears(layer, native=nat)
    assert fits._specdemo_packed.is_native and not odd._specdemo_packed.is_native
    x = torch.randn(4, 32)
    with torch.inference_mode():
        for layer in (fits, odd):
            torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5,
                                       atol=1e-5)
    assert nat.pack(torch.randn(16, 8, dtype=torch.bfloat16)) is None


@needs_compiler
def test_packed_copy_follows_weight_changes_and_deepcopy(nat):
    torch.manual_seed(3)
    layer = nn.Linear(8, nat.vector_width)
    kernels.patch_linears(layer, native=nat)
    twin = copy.deepcopy(layer)
    assert twin._specdemo_packed.native is nat
    layer.load_state_dict({"weight": torch.zeros(nat.vector_width, 8), "bias": torch.ones(nat.vector_width)})
    with torch.no_grad():
        twin.weight.add_(1.0)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.ones(3, nat.vector_width))
        torch.testing.assert_close(twin(x), nn.functional.linear(x, twin.weight, twin.bias), rtol=1e-5, atol=1e-5)
