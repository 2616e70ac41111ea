"""Overlapped, bucketed gradient all-reduce for data parallelism, without a wrapper module.

`GradSync` hooks a model in place and averages its gradients over ranks while backward runs;
`plan_buckets` is the bucket planner it uses (pure, usable on its own to inspect a plan).
"""

from .buckets import Bucket, format_plan, plan_buckets
from .sync import GradSync, SyncStats

__all__ = ["Bucket", "GradSync", "SyncStats", "format_plan", "plan_buckets"]
