"""Fusion buckets: which parameters are communicated together, and each bucket's life."""

from .bucket import Bucket, Stage
from .planner import BucketSpec, plan_buckets

__all__ = ["Bucket", "BucketSpec", "Stage", "plan_buckets"]
