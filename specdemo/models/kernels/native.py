"""The few-row float32 CPU product compiled for the machine it runs on (fewrow.cpp), loaded through ctypes.

Why (measured in docs/notes/kernels.md): oneDNN's packed product, the best of torch's kernels at 3-9 rows, costs
1.2-1.5x a 1-row product at 5-9 rows on 2 cores, and that width cost is what keeps draft trees from paying on a CPU.
This kernel streams each weight once and meets every row with it while it is in registers, so 9 rows cost about what
1 row does; 1-2 rows are faster than `W @ x.T` as well. It needs a C++ compiler with OpenMP (g++ or clang), finds it on
PATH, and builds once per CPU (about a second) into a cache folder the caller names; without one, or where the build
fails, `build` says why once and returns None, and the caller keeps torch's kernels. A weight whose every value is a
float16 (the EAGLE-3 head's, from its float16 checkpoint) is packed as float16 and widened in registers: the same
products bit for bit from half the bytes (a cold head pass at 1-5 rows in 0.46-0.55x the time, docs/notes/kernels.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fewrow.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

log = logging.getLogger(__name__)


class Native:
    """The compiled kernel: `pack` a weight once into its layout, then `linear` any number of rows against it."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.vector_width = int(lib.specdemo_vector_width())
        self.max_rows = int(lib.specdemo_max_rows())
        self._run = {torch.float32: lib.specdemo_fewrow}
        if hasattr(lib, "specdemo_fewrow_h"):  # built where the CPU widens float16 in one instruction (F16C)
            self._run[torch.float16] = lib.specdemo_fewrow_h
        for run in self._run.values():
            run.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            run.restype = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight (N, K) as [N / VW][K][VW], in float16 where that holds every value exactly, or None where N is
        not a multiple of the vector width or the weight is not a float32 CPU matrix."""
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not n or n % self.vector_width:
            return None
        with torch.no_grad():
            w = weight.detach()
            if torch.float16 in self._run and torch.equal((half := w.half()).float(), w):  # exact: w's products
                w = half
            return w.reshape(n // self.vector_width, self.vector_width, k).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias) for float32 CPU rows of any count, W packed by `pack`."""
        blocks, k, width = packed.shape
        flat = x.reshape(-1, k).contiguous()
        y = torch.empty(flat.shape[0], blocks * width, dtype=flat.dtype)
        if flat.shape[0]:
            self._run[packed.dtype](flat.data_ptr(), packed.data_ptr(), y.data_ptr(), flat.shape[0], k,
                                    blocks * width, torch.get_num_threads())
        if bias is not None:
            y.add_(bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _cpu_id() -> str:
    """What a -march=native build depends on: the CPU's model and flags (Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def build(cache_dir: Path, flags: tuple[str, ...] = FLAGS) -> Native | None:
    """The kernel built for this CPU under cache_dir (made once; later processes load it), or None, said once, where
    there is no compiler or it fails. The file's name covers the source, the flags and the CPU, so a cache shared
    between machines never loads another CPU's build."""
    cxx = compiler()
    if cxx is None:
        log.info("native few-row products not used: no C++ compiler on PATH (torch's kernels serve instead)")
        return None
    try:
        key = hashlib.sha1("\0".join([SOURCE.read_text(), " ".join(flags), _cpu_id(), cxx]).encode()).hexdigest()
        path = Path(cache_dir) / f"fewrow-{key[:16]}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                out = Path(tmp) / path.name
                subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], check=True, capture_output=True,
                               text=True, timeout=300)
                os.replace(out, path)  # atomic: a process building beside this one finds a whole file or none
        native = Native(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("native few-row products not used: building %s failed (%s)", SOURCE.name, str(detail)[-500:])
        return None
    if not _agrees(native):
        log.warning("native few-row products not used: %s disagrees with torch on a probe", path)
        return None
    return native


def _agrees(native: Native) -> bool:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * native.vector_width, 40, generator=g)
    x = torch.randn(native.max_rows + 3, 40, generator=g)
    h = w.half().float()  # packed as float16 where the build can
    return (torch.allclose(native.linear(x, native.pack(w)), x @ w.T, rtol=1e-4, atol=1e-4)
            and torch.equal(native.linear(x, native.pack(h)), native.linear(x, native.pack(w).half().float())))
