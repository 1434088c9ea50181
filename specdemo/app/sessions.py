"""Each browser session's suffix cache: the earlier answers suffix decoding drafts from belong to one visitor.

A draft from an earlier answer shows that answer (the inspector shows rejected drafts; acceptance timing leaks them
too), so the app keeps one drafters.suffix.SuffixCache per gradio session, in the process where the drafters run (the
compute worker, or the server's own), and never lets two sessions share one. The server only marks sessions to
forget (Clear suffix cache, a closed tab); each compute step carries the marks over and applies them before it
builds a drafter, so a Clear never waits for another visitor's run to end. No gradio, no models.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..drafters.suffix import SuffixCache

MAX_SESSIONS = 64  # sessions whose caches a process keeps; the least recently used goes first beyond this


class SessionCaches:
    """session id -> SuffixCache, at most `cap` of them (least recently used evicted). Thread-safe."""

    def __init__(self, cap: int = MAX_SESSIONS):
        self.cap = cap
        self._caches: OrderedDict[str, SuffixCache] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: str | None) -> SuffixCache:
        """The session's cache (a new one at its first run). No session id (a caller gradio could not name): a new
        cache that nobody keeps, so such runs draft from no earlier answer and leave none behind."""
        if session is None:
            return SuffixCache()
        with self._lock:
            cache = self._caches.pop(session, None)  # (an empty cache is falsy: compare with None)
            self._caches[session] = cache = SuffixCache() if cache is None else cache  # most recently used last
            while len(self._caches) > self.cap:
                self._caches.popitem(last=False)
            return cache

    def forget(self, sessions) -> None:
        """Drop these sessions' caches (their earlier answers are gone; a later run starts a new one)."""
        with self._lock:
            for session in sessions:
                self._caches.pop(session, None)

    def held(self, session: str) -> int:
        """How many earlier answers the session's cache holds (0 when it has none)."""
        with self._lock:
            cache = self._caches.get(session)
        return len(cache) if cache is not None else 0

    def __contains__(self, session: str) -> bool:
        return session in self._caches

    def __len__(self) -> int:
        return len(self._caches)


CACHES = SessionCaches()  # this process's: filled where the compute steps run


@dataclass(frozen=True)
class Session:
    """Whose run a compute step serves (picklable: it crosses to the worker): the gradio session id, and the sessions
    the server marked to forget since the last step."""

    key: str | None = None
    forget: tuple[str, ...] = ()

    def cache(self, caches: SessionCaches | None = None) -> SuffixCache:
        """Forget the marked sessions, then this session's cache (in `caches`, default: this process's CACHES)."""
        caches = CACHES if caches is None else caches
        caches.forget(self.forget)
        return caches.get(self.key)


class Forgetting:
    """The server's marks: sessions whose caches the next compute step drops (Clear suffix cache, a closed tab)."""

    def __init__(self):
        self._marked: set[str] = set()
        self._lock = threading.Lock()

    def mark(self, session: str | None) -> None:
        if session is not None:
            with self._lock:
                self._marked.add(session)

    def session(self, key: str | None) -> Session:
        """A compute step's Session: this visitor's key, and every mark so far (taken: the step applies them)."""
        with self._lock:
            marked, self._marked = tuple(sorted(self._marked)), set()
        return Session(key, marked)

    def __contains__(self, session: str) -> bool:
        return session in self._marked
