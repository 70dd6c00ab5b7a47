"""dflash-torch: DFlash speculative decoding in PyTorch with KV injection.

A block-diffusion drafter proposes a block of tokens in one forward pass,
conditioned on the target's hidden features; the target verifies the block in one
pass. The output is exactly the target's own.

The names below are imported on first use (PEP 562), so that ``import dflash_torch`` (and
``dflash_torch.errors``) does not wait for torch; the command line imports it while it
builds its parser (see :func:`dflash_torch.cli.main`).
"""

from __future__ import annotations

import importlib

from .errors import CompileError, ContextLengthError, ContextOptionError, DFlashError, OptionError

# public name -> the module that defines it
_LAZY = {"DFlashEngine": ".engine", "GenerationResult": ".engine", "GenerationStats": ".engine",
         "StreamChunk": ".engine", "SamplingParams": ".sampling", "TokenLogprob": ".sampling",
         "StructuredOutput": ".structured"}

__all__ = ["CompileError", "ContextLengthError", "ContextOptionError", "DFlashEngine", "DFlashError", "GenerationResult",
           "GenerationStats", "OptionError", "SamplingParams", "StreamChunk", "StructuredOutput", "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # (found directly from now on)
    return value


def __dir__() -> list[str]:
    """The public names (and the module's dunders), not the helpers this file imports."""
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__))
