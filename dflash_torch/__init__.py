"""dflash-torch: DFlash speculative decoding in PyTorch with KV injection.

A block-diffusion drafter proposes a block of tokens in one forward pass,
conditioned on the target's hidden features; the target verifies the block in one
pass. The output is exactly the target's own.
"""

from .engine import DFlashEngine, GenerationResult, GenerationStats, StreamChunk
from .errors import DFlashError
from .sampling import SamplingParams, TokenLogprob
from .structured import StructuredOutput

__all__ = ["DFlashEngine", "DFlashError", "GenerationResult", "GenerationStats", "SamplingParams", "StreamChunk",
           "StructuredOutput", "TokenLogprob"]
__version__ = "0.1.0"
