"""Benchmarks of dear against DDP, FSDP2 and Horovod (run as `python -m benchmarks.<name>`)."""
