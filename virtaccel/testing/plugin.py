"""The pytest plugin (registered as `virtaccel` through the pytest11 entry point).

Why: a failing randomized run is only useful if it can be replayed, and the seed is
what replays it. Every Session a test builds (directly, through a test bed, an image
run or run_model) is recorded; when the test fails, its report gets a "virtaccel
sessions" section naming each session's attachment, VMs and seed.

Fixtures:
    make_session(**kwargs) -> a launched Session, closed when the test ends.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, Iterator

import pytest

from ..session import Session

_SESSIONS = pytest.StashKey[list[Session]]()


def describe(session: Session) -> str:
    """One line that replays `session`: its attachment, VMs and seed."""
    names = ", ".join(s.name for s in session.specs)
    origin = f" from image {session.image.path}" if session.image is not None else ""
    return f"{session.attach} session{origin}, VMs {names}: seed {session.seed}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    seen: list[Session] = []
    item.stash[_SESSIONS] = seen
    Session.observers.append(seen.append)
    try:
        yield
    finally:
        Session.observers.remove(seen.append)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    sessions = item.stash.get(_SESSIONS, [])
    if report.when == "call" and report.failed and sessions:
        report.sections.append(("virtaccel sessions (replay with these seeds)",
                                "\n".join(describe(s) for s in sessions)))


@pytest.fixture
def make_session() -> Iterator[Callable[..., Session]]:
    """make_session(**Session kwargs): a launched Session, closed at the end of the test."""
    made: list[Session] = []

    def make(**kwargs: Any) -> Session:
        session = Session(**kwargs)
        made.append(session)
        return session.launch()

    yield make
    for session in made:
        session.close()
