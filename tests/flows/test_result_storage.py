"""Result storage of a remote store root: a RemoteFileSystem block saved through the Prefect API."""

import fsspec
from prefect.blocks.core import Block
from prefect.filesystems import RemoteFileSystem

from tasks._cache import RESULTS_DIR, result_storage


def test_remote_store_results_go_to_a_saved_block_under_the_store(prefect_api):
    slug = result_storage("memory://slime-results-test/runs", {"skip_instance_cache": True})
    block = Block.load(slug)
    assert isinstance(block, RemoteFileSystem)
    assert block.basepath == f"memory://slime-results-test/runs/{RESULTS_DIR}"
    assert block.settings == {"skip_instance_cache": True}
    assert result_storage("memory://slime-results-test/runs/", {"skip_instance_cache": True}) == slug  # one per root
    assert result_storage("memory://other-root") != slug
    block.write_path("key", b"{}")
    assert fsspec.filesystem("memory").cat_file(f"/slime-results-test/runs/{RESULTS_DIR}/key") == b"{}"
