"""One Prefect test harness (temporary API server and database) for every flow test of the session.

The harness starts a real Prefect server subprocess on 127.0.0.1 (about a minute on the loaded CI
machine), so flow tests are few; task logic is tested through `task.fn` in tests/tasks/.
"""

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
