"""Fusion autotuning, above fusion and diagnose (docs/fusion.md):

- `factory.py`: which autotuner an optimizer runs (`autotune=` / DEAR_AUTOTUNE);
- `online.py`: `FusionTuner` (Bayesian optimization over the layout) and `OnlineAutotuner`,
  which times real iterations;
- `offline.py`: `OfflineAutotuner`, which ranks layouts by dear.diagnose's replay of a traced
  window, then confirms the best few on real iterations.
"""
