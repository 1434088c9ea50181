"""A process of its own for the app's timed work. The compute steps (the race, the k sweep, the batch sweep) run there
and send their items back through a pipe, so the server's threads, which encode frames and serve the page, never
hold the interpreter lock while a decoder is timed. Knows nothing of models, decoders or gradio.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The compute process ended in the middle of a step (killed for memory, say); the next step starts a new one."""


class Worker:
    """One compute process, started on first use (or by `start`), that runs one step at a time.

    `wrap(fn)` turns a generator function into one that runs in the process: its items, its exception or its end come
    back as they happen, and closing the returned generator stops the step in the process at its next item. `fn`, its
    arguments and its items must pickle (they do for the handlers' compute steps, which ZeroGPU pickles too).
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads  # torch threads in the process; None: torch's default
        self._lock = threading.Lock()  # one step at a time
        self._proc = None
        self._conn = None

    def start(self) -> None:
        """Start the process now (it imports torch and this package: seconds) rather than at the first step."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied locks, CUDA-safe
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, self.threads), daemon=True, name="specdemo-compute")
        self._proc.start()
        child.close()

    def close(self) -> None:
        """End the process."""
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)
            self._proc = None

    def wrap(self, fn: Callable[..., Iterator]) -> Callable[..., Iterator]:
        """`fn` as a generator function that runs in the compute process."""

        @functools.wraps(fn)
        def run(*args, **kwargs) -> Iterator:
            with self._lock:
                self._ensure()
                self._conn.send(("run", fn, args, kwargs))
                ended = False
                try:
                    while True:
                        kind, value = self._receive()
                        if kind == "items":
                            yield from value
                            continue
                        ended = True
                        if kind == "error":
                            raise value
                        return
                finally:
                    if not ended and self._proc is not None:  # closed early: stop the step, drop what it still sent
                        self._conn.send(("stop",))
                        while self._receive()[0] == "items":
                            pass

        return run

    def _receive(self) -> tuple[str, object]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc = None
            raise WorkerError("the compute process ended unexpectedly (out of memory?); the next run starts a new "
                              "one") from None


SEND_EVERY = 0.2  # seconds: items are sent in batches, so the server wakes a few times a second rather than at every
# decoder step (each wake-up takes a core from the timed work for a moment, and on a small machine that moment stalls
# every thread of the decoder's next operation)


def serve(conn, threads: int | None, every: float = SEND_EVERY) -> None:
    """The compute process: run each ("run", fn, args, kwargs) it is sent, sending ("items", [x, ...]) batches of its
    items (at most `every` seconds apart while it yields), then ("end", None) or ("error", exception); a ("stop",)
    between items closes the step. An item that follows a quiet spell of `every` goes at once (the first token)."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (compute): %(message)s")
    if threads:
        torch.set_num_threads(threads)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "run":  # a stop that came after its step ended
            continue
        _, fn, args, kwargs = message
        batch, sent = [], float("-inf")
        try:
            steps = fn(*args, **kwargs)
            for item in steps:
                batch.append(item)
                if time.monotonic() - sent >= every:
                    conn.send(("items", batch))
                    batch, sent = [], time.monotonic()
                if conn.poll() and conn.recv()[0] == "stop":
                    steps.close()
                    batch = []
                    break
            if batch:
                conn.send(("items", batch))
            conn.send(("end", None))
        except Exception as exc:  # the server says what went wrong; this process keeps serving
            if "out of memory" in str(exc).lower() and torch.cuda.is_available():
                with contextlib.suppress(RuntimeError):  # refused while a failed capture's pool stays open
                    torch.cuda.empty_cache()  # this process holds the memory: back for the next request
            if batch:
                conn.send(("items", batch))
            try:
                conn.send(("error", exc))
            except Exception:  # an exception that does not pickle: its words
                conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
