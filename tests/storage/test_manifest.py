"""reusable_manifest: a stage's committed output is reused only when it was made with the same key."""

import re

import pytest

from slime.errors import ConfigError
from slime.storage import commit_directory, read_manifest, reusable_manifest

CONFLICT = "{uri} was made with key {found}; pick another output name"


def test_reusable_manifest_returns_a_same_key_commit_and_refuses_another_key(tmp_path):
    out = tmp_path / "out"
    assert reusable_manifest(str(out), "k1", CONFLICT) is None  # nothing there: compute it
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert reusable_manifest(str(out), "k1", CONFLICT) is None  # files without a manifest are not an output
    commit_directory(str(out), "eval_result", config_hash="k1", metadata={"accepted": 3})
    reused = reusable_manifest(str(out), "k1", CONFLICT)
    assert reused == read_manifest(str(out)) and reused.metadata == {"accepted": 3}
    with pytest.raises(ConfigError, match=f"^{re.escape(str(out))} was made with key k1; pick another output name$"):
        reusable_manifest(str(out), "k2", CONFLICT)
    assert read_manifest(str(out)).config_hash == "k1"  # the committed output is left as it was
