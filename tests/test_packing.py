"""Prepacked bfloat16 linears (CPU, oneDNN): same numbers as ``F.linear``, same weights
and state dict, same greedy output, and a compiled decoder still traces them."""

import pytest
import torch
import torch.nn.functional as F

from dflash_torch import DFlashEngine
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.packing import PackedLinear, pack_linears, packing_supported
from dflash_torch.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        ref = F.linear(x, lin.weight, lin.bias)
        out = PackedLinear(lin)(x)
        out3 = PackedLinear(lin)(x.view(1, rows, 96))
    assert out.shape == ref.shape and out3.shape == (1, rows, 160)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(out3[0], out)


def test_pack_linears_keeps_weights_ties_and_greedy_output(tiny_pair):
    target_dir, drafter_dir = tiny_pair
    plain = DFlashEngine.from_pretrained(target_dir, drafter_dir, dtype="bfloat16", pack=False)
    packed = DFlashEngine.from_pretrained(target_dir, drafter_dir, dtype="bfloat16")
    assert isinstance(packed.target.model.layers[0].mlp.up_proj, PackedLinear)
    assert isinstance(packed.drafter.fc, PackedLinear)
    assert packed.target.state_dict().keys() == plain.target.state_dict().keys()
    if packed.target.config.tie_word_embeddings:
        assert packed.target.lm_head.weight is packed.target.model.embed_tokens.weight
    for prompt in ([5, 17, 99, 3], list(range(2, 40))):
        a = packed.generate(prompt, max_new_tokens=40, ignore_eos=True)
        b = plain.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert a.token_ids == b.token_ids


def test_compiled_decoder_traces_packed_models(tiny_pair):
    target_dir, drafter_dir = tiny_pair
    engine = DFlashEngine.from_pretrained(target_dir, drafter_dir, dtype="bfloat16")
    assert pack_linears(engine.target) == 0  # already packed: nothing left to replace
    torch._dynamo.reset()
    compiled = SpeculativeDecoder(engine.target, engine.drafter, compile=True, compile_backend="eager", max_context=128)
    tokens = []
    for rnd in compiled.rounds([5, 17, 99, 3], SamplingParams(), 30):
        tokens += rnd.tokens
    assert len(tokens) >= 30
