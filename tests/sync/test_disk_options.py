"""Disk sync's slime options against two built-in engines: --update-weight-disk-keep-files keeps every
version's directory, and --custom-update-weight-post-write-path (a hook written to slime's signature) runs
after the files are written and before any engine reads them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

from slime.config import SyncConfig, load_config
from slime.errors import ConfigError
from slime.sync import WeightSyncer
from slime.sync.disk import post_write_hook

CALLS: list[dict] = []


def publish(args, version_dir, rollout_engines):
    """slime's post-write hook signature; records what the engines serve while it runs."""
    with httpx.Client(timeout=30, trust_env=False) as http:
        served = [http.get(f"{url}/get_weight_version").json() for url in rollout_engines]
    CALLS.append({"dir": version_dir, "files": sorted(p.name for p in Path(version_dir).iterdir()),
                  "engines": list(rollout_engines), "served": served, "tag": args.my_tag})


@pytest.mark.slow  # two engines start: ~35 s
def test_keep_files_and_post_write_hook(cluster, tiny_kit, tmp_path):
    _, urls = cluster
    (tmp_path / "custom.yaml").write_text("my_tag: published\n")
    args = load_config(None, ["--custom-update-weight-post-write-path", f"{__name__}.publish", "--weight-sync-mode",
                              "disk", "--custom-config-path", str(tmp_path / "custom.yaml")]).as_namespace()
    weights = load_file(str(Path(tiny_kit.model_dir) / "model.safetensors"))
    syncer = WeightSyncer(SyncConfig(weight_sync_mode="disk", update_weight_disk_dir=str(tmp_path / "w"),
                                     update_weight_disk_keep_files=True),
                          hf_config=AutoConfig.from_pretrained(tiny_kit.model_dir), post_write=post_write_hook(args))
    CALLS.clear()
    for version in ("v1", "v2"):
        result = asyncio.run(syncer.sync(urls, lambda: iter(weights.items()), version))
        assert "post_write" in result.seconds
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["weight_version_v1", "weight_version_v2"]
    assert [Path(c["dir"]).name for c in CALLS] == ["weight_version_v1", "weight_version_v2"]
    assert all("config.json" in c["files"] and c["engines"] == urls and c["tag"] == "published" for c in CALLS)
    # before the engines read the files: they still serve the previous version
    assert "v1" not in str(CALLS[0]["served"]) and "v2" not in str(CALLS[1]["served"])
    assert "v1" in str(CALLS[1]["served"])


def test_disk_only_options_need_disk_mode():
    with pytest.raises(ConfigError, match="update_weight_disk_keep_files: applies to disk weight sync"):
        load_config(None, ["--update-weight-disk-keep-files"])
    config = load_config(None, ["--update-weight-disk-keep-files", "--update-weight-transport", "disk"])
    assert config.sync.update_weight_disk_keep_files and config.sync.weight_sync_mode == "disk"
