"""The data path of dear.DistributedOptimizer (docs/ARCHITECTURE.md):

- `engine.py`: `Engine`, everything one optimizer's data path holds, and the phases of an
  iteration as methods (post_backward, launch, reduce, gather, pre_forward, apply);
- `state.py`: `Phase`, `Iteration` (what one iteration accumulates) and `Pending` (what step()
  leaves for the next forward);
- `steps.py`: step() and synchronize(): which path an iteration's end takes;
- `checks.py`: the `.grad` and parameter write checks, and when contents are compared;
- `layout.py`: the buckets built from the forward order, re-built when the parameters change;
- `updates.py`: where a bucket's update runs (the wrapped optimizer in the next forward, or
  with shard_optimizer_state this rank's shards in step());
- `wrapper.py`: the class mixed into the user's optimizer (torch's and Horovod's API), and
  `attach`, which builds the engine.
"""
