"""Write the Speculators-format oracle fixtures of tests/test_speculators.py.

Needs vLLM's ``speculators`` library (``pip install speculators``; it pins its own
transformers and torch, so use a separate environment: ``python -m venv --system-site-packages
ENV && ENV/bin/pip install --no-deps speculators`` plus what it imports). It is not a
dependency of dflash-torch: the fixtures it writes are committed.

For each case it builds a tiny DFlash drafter with the library's own ``DFlashDraftModel``
(random weights: a sliding-window layer then a full one; Qwen3, or Llama with GELU-tanh MLPs
and biases), saves it with the
library's ``save_pretrained`` (its config.json and safetensors, as published Speculators
checkpoints are written), adds ``embed_tokens.weight`` (and a full-vocabulary
``lm_head.weight``), which speculators >= 0.9 leaves out because it takes the target's, and
records the library's draft logits (``_backbone_forward`` with one anchor at a time, eager
attention under its training mask) for random context features and tokens:
``reference.safetensors`` holds ``features [T, k * hidden]``, ``input_ids [T]``,
``anchors [n]`` and ``logits_<a> [block_size, draft_vocab_size]``.

    ENV/bin/python scripts/speculators_reference.py tests/data/speculators
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CASES = {  # name: (draft vocabulary size, sliding_window_non_causal, layer config class, its extra settings)
    "draft-vocab-causal": (40, False, "qwen3", {}),
    "full-vocab-non-causal": (96, True, "qwen3", {}),
    # speculators' --draft-arch llama, with GELU-tanh MLPs (what it copies from a Gemma verifier) and biases
    "llama-gelu-bias": (64, False, "llama", {"hidden_act": "gelu_pytorch_tanh", "attention_bias": True}),
}
VOCAB, HIDDEN, BLOCK, WINDOW, CONTEXT, ANCHORS = 96, 32, 4, 6, 20, (3, 9, 15)


def build(out: Path, draft_vocab: int, non_causal: bool, arch: str, extra: dict) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    torch.manual_seed(0)
    config_class = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    layers = config_class(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                          use_sliding_window=True, **extra)
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=layers, draft_vocab_size=draft_vocab, block_size=BLOCK,
        aux_hidden_state_layer_ids=[1, 3], mask_token_id=VOCAB - 1, sliding_window_non_causal=non_causal,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    model = DFlashDraftModel(cfg)
    if draft_vocab != VOCAB:
        kept = torch.sort(torch.randperm(VOCAB)[:draft_vocab]).values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + 1.0 if p.ndim == 1 else torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out))
    (out / "config.py").unlink(missing_ok=True)  # (the library's code, copied for trust_remote_code: not ours to ship)
    weights = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    weights["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    weights.setdefault("lm_head.weight", torch.randn(draft_vocab, HIDDEN, generator=g) * 0.3)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def reference(out: Path) -> None:
    import speculators.models.dflash.core as core
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(out)).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    torch.manual_seed(1)
    k = len(model.config.aux_hidden_state_layer_ids)
    features = torch.randn(1, CONTEXT, k * HIDDEN)
    ids = torch.randint(0, VOCAB - 1, (1, CONTEXT))
    result = {"features": features[0], "input_ids": ids[0], "anchors": torch.tensor(ANCHORS)}
    for a in ANCHORS:
        core.select_anchors = lambda mask, n, block, a=a: (torch.tensor([a]), torch.tensor([True]))
        with torch.no_grad():
            _, logits, *_ = model._backbone_forward(features, ids, torch.ones(1, CONTEXT), torch.zeros(1, CONTEXT, HIDDEN),
                                                    torch.zeros(1, CONTEXT, dtype=torch.long), max_anchors=1)
        result[f"logits_{a}"] = logits[0].contiguous()
    save_file(result, str(out / "reference.safetensors"))


def main(root: Path) -> None:
    for name, (draft_vocab, non_causal, arch, extra) in CASES.items():
        out = root / name
        build(out, draft_vocab, non_causal, arch, extra)
        reference(out)
        print(out, json.loads((out / "config.json").read_text())["speculators_version"])


def cli(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``): ``OUT_DIR``. A missing ``OUT_DIR``, or
    an environment without the speculators library, is argparse's error (exit status 2).
    (Plain argparse: the environment it runs in need not import dflash_torch.)"""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write the fixtures in (tests/data/speculators)")
    args = ap.parse_args(argv)
    try:
        import speculators  # noqa: F401
    except ImportError as exc:
        ap.error(f"needs vLLM's speculators library ({exc}); see this script's docstring for its environment")
    main(args.out)


if __name__ == "__main__":
    cli()
