"""An RL iteration holds one slot of the `slime-gpu` tag limit when that limit exists, and asks nothing of the
API when it does not (tasks/rl.py, gpu_slot)."""

import contextlib

from prefect import flow
from prefect.client.orchestration import get_client

from tasks.evaluate import GPU_TAG
from tasks.rl import GPU_LIMIT, gpu_slot


@flow
def slots_seen() -> list:
    """Active slots of the limit inside and after one iteration's slot (None: no limit, nothing held)."""
    slot = gpu_slot()
    if slot is contextlib.nullcontext:
        return [None]
    with get_client(sync_client=True) as client:
        with slot():
            inside = client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots
        after = client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots
    return [inside, after]


def test_an_iteration_holds_the_gpu_slot_only_where_the_limit_exists(prefect_api):
    with get_client(sync_client=True) as client:
        with contextlib.suppress(Exception):
            client.delete_concurrency_limit_by_tag(GPU_TAG)
        assert slots_seen() == [None]
        client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=1)  # what make serve creates
        try:
            assert slots_seen() == [1, 0]
        finally:
            client.delete_concurrency_limit_by_tag(GPU_TAG)
