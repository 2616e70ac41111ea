"""Overlapped, bucketed gradient all-reduce for data parallelism, without a wrapper module.

`GradSync` hooks a model in place and averages its gradients over ranks while backward runs;
`plan_buckets` is the bucket planner it uses (pure, usable on its own to inspect a plan);
`BucketTuner` chooses the bucket cap online under ``bucket_mb="auto"``. ``mode="sharded"``
reduce-scatters instead and steps each rank's slice with ``GradSync.shard_optimizer``
(the `sharded` sub-package; docs/design.md section 7).
"""

from .buckets import DDP_BUCKET_MB, Bucket, format_plan, plan_buckets
from .stats import SyncStats, union_length
from .sync import GradSync
from .tune import BucketTuner, TuningResult

__all__ = ["DDP_BUCKET_MB", "Bucket", "BucketTuner", "GradSync", "SyncStats", "TuningResult", "format_plan", "plan_buckets",
           "union_length"]
