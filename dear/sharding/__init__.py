"""shard_optimizer_state=True (docs/sharding.md): each rank keeps and updates the optimizer state
of its 1/N shard of each bucket (`state.py`: `ShardedState`); `checkpoint.py` saves and loads
that state as ShardedTensors (torch.distributed.checkpoint), across world sizes.
"""
