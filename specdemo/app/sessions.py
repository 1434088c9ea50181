"""Each browser session's drafter state: what drafters keep across requests (suffix decoding's earlier answers)
belongs to one visitor.

A draft from an earlier answer shows that answer (the inspector shows rejected drafts; acceptance timing leaks them
too), so the app keeps one drafters.base.SharedState per gradio session, in the process where the drafters run (the
compute worker, or the server's own), and never lets two sessions share one. The server only marks sessions to
forget (Clear suffix cache, a closed tab); each compute step carries the marks over and applies them before it
builds a drafter, so a Clear never waits for another visitor's run to end. No gradio, no models.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..drafters.base import SharedState

MAX_SESSIONS = 64  # sessions whose states a process keeps; the least recently used goes first beyond this


class SessionStates:
    """session id -> SharedState, at most `cap` of them (least recently used evicted). Thread-safe."""

    def __init__(self, cap: int = MAX_SESSIONS):
        self.cap = cap
        self._states: OrderedDict[str, SharedState] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: str | None) -> SharedState:
        """The session's state (a new one at its first run). No session id (a caller gradio could not name): a new
        state that nobody keeps, so such runs draft from no earlier answer and leave none behind."""
        if session is None:
            return SharedState()
        with self._lock:
            state = self._states.pop(session, None)  # (an empty state is falsy: compare with None)
            self._states[session] = state = SharedState() if state is None else state  # most recently used last
            while len(self._states) > self.cap:
                self._states.popitem(last=False)
            return state

    def forget(self, sessions) -> None:
        """Drop these sessions' states (their earlier answers are gone; a later run starts a new one)."""
        with self._lock:
            for session in sessions:
                self._states.pop(session, None)

    def held(self, session: str) -> int:
        """How much the session's state holds (earlier answers; 0 when it has none)."""
        with self._lock:
            state = self._states.get(session)
        return len(state) if state is not None else 0

    def __contains__(self, session: str) -> bool:
        return session in self._states

    def __len__(self) -> int:
        return len(self._states)


STATES = SessionStates()  # this process's: filled where the compute steps run


@dataclass(frozen=True)
class Session:
    """Whose run a compute step serves (picklable: it crosses to the worker): the gradio session id, and the sessions
    the server marked to forget since the last step."""

    key: str | None = None
    forget: tuple[str, ...] = ()

    def state(self, states: SessionStates | None = None) -> SharedState:
        """Forget the marked sessions, then this session's state (in `states`, default: this process's STATES)."""
        states = STATES if states is None else states
        states.forget(self.forget)
        return states.get(self.key)


class Forgetting:
    """The server's marks: sessions whose states the next compute step drops (Clear suffix cache, a closed tab)."""

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
