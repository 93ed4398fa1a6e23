"""Work on the reduced shards between the reduce-scatters and the all-gathers, where each rank
holds 1/N of the averaged gradient:

- `shards.py`: this rank's gradient slice of each bucket's shard (no flags, no padding);
- `amp.py`: GradScaler's contract (unscale and inf-check on the shards, agreed by every rank);
- `clip.py`: the global norm from per-rank partial norms, torch's clip coefficient applied.
"""
