"""One Prefect test harness (temporary API server and database) for every flow test of the session.

The harness starts a real Prefect server subprocess on 127.0.0.1 (about a minute on the loaded CI
machine), so flow tests are few; task logic is tested through `task.fn` in tests/tasks/.
"""

import dataclasses
import os
import tempfile

import pytest

# before prefect is imported: a private PREFECT_HOME, no telemetry
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="slime-test-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


class InjectedFailure(RuntimeError):
    """The failure a test injects into a stage (a real exception through Prefect's real states)."""


@dataclasses.dataclass
class Injection:
    """A failure injected into one callable: it fails while `armed`; `calls` counts every call."""

    name: str
    armed: bool = True
    calls: int = 0
    failures: int = 0


@pytest.fixture
def inject_failure(monkeypatch):
    """`inject_failure(owner, name, when=None) -> Injection`: `owner.name(...)` raises `InjectedFailure`
    ("injected failure in <name>") while the injection is armed and `when(...)` (same arguments) is true,
    every call when `when` is None; otherwise the real callable runs. `.armed = False` lets a re-run through."""

    def inject(owner, name: str, when=None) -> Injection:
        real = getattr(owner, name)
        injection = Injection(name)

        def failing(*args, **kwargs):
            injection.calls += 1
            if injection.armed and (when is None or when(*args, **kwargs)):
                injection.failures += 1
                raise InjectedFailure(f"injected failure in {name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, failing)
        return injection

    return inject


@pytest.fixture
def failing_train(inject_failure) -> Injection:
    """`RLLoop.train` fails at rollout 1, so with save_interval 1 iteration 0 is checkpointed first."""
    from slime.rl import RLLoop

    return inject_failure(RLLoop, "train", when=lambda loop, rollout_id, uri: rollout_id == 1)
