"""The contract's guards (docs/contract.md): what a script may not do behind dear's back, and
what must match across ranks.

- `written.py`: fingerprints of tensors' contents (writes through `.data` that leave autograd's
  version counter alone) and the parameters written between step() and their update;
- `stream.py`: the tiny per-iteration all-gather that checks every rank's collectives pair up;
- `validation.py`: checks at wrap time (names, devices, the same model and settings on every
  rank, wrapping twice, a DDP model, Horovod's process sets);
- `model_guard.py`: reads of parameters whose update is still pending.
"""
