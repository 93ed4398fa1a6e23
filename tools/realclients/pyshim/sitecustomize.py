# Workaround (harness only, not part of either training script): torchvision 0.28.0 from PyPI is a
# CUDA build; with the CPU torch 2.13 its C++ ops (torchvision::nms, ::qnms, ...) fail to load, and
# `import torchvision` then dies in torchvision/_meta_registrations.py, whose two
# `@torch.library.register_fake("torchvision::nms"/"::qnms")` decorators are not guarded by
# `torchvision.extension._has_ops()` like the rest of that file. Here register_fake for a
# torchvision:: operator that does not exist becomes a no-op decorator. Models, datasets and
# transforms do not need those ops.
import torch.library as _tl

_orig_register_fake = _tl.register_fake


def _register_fake(op, *args, **kwargs):
    if isinstance(op, str) and op.startswith("torchvision::"):
        import torch
        ns, name = op.split("::", 1)
        try:
            getattr(getattr(torch.ops, ns), name.split(".")[0])
        except (AttributeError, RuntimeError):
            fn = args[0] if args and callable(args[0]) else kwargs.get("func")
            return fn if fn is not None else (lambda f: f)
    return _orig_register_fake(op, *args, **kwargs)


_tl.register_fake = _register_fake
