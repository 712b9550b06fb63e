import pytest


@pytest.fixture
def spy(monkeypatch):
    """``spy(module, name, record) -> calls``: wraps ``module.name`` for the test so that each call
    appends ``record(args, kwargs)`` to ``calls`` (which fused op a module traced, and with what)."""

    def install(module, name, record):
        calls = []
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(record(args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
        return calls

    return install
