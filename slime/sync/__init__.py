"""Weight sync from the trainer to the rollout engines: disk, tensor (colocated), distributed."""

from slime.sync.common import SyncResult, WeightSyncError
from slime.sync.syncer import WeightSyncer, resolve_mode

__all__ = ["SyncResult", "WeightSyncError", "WeightSyncer", "resolve_mode"]
