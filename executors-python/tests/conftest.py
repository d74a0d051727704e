"""Fixtures shared by the SDK's tests."""

import pytest
from _harness import PipeSession

from durable_executor import Executor


@pytest.fixture
def session_factory():
    """Makes PipeSessions (an executor served over pipes) and closes them after the test."""
    sessions = []

    def make(executor: Executor) -> PipeSession:
        s = PipeSession(executor)
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        s.close()
