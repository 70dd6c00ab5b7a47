"""Shared fixtures: tiny real checkpoints (safetensors + config.json) and a real
byte-level BPE tokenizer, built inside the tests with transformers' own model classes."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sysconfig
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_torch.models.drafter_config import DFlash2Settings, DrafterConfig, default_target_layer_ids

# A shell that runs a job in the background without job control (``cmd &`` in a script)
# starts it with SIGINT ignored, and every child inherits that: the Ctrl-C tests'
# subprocesses would never get a KeyboardInterrupt. Python's own handler here makes the
# children start with the default disposition (a handler does not survive exec; "ignore" does).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One intra-op thread: the test models are tiny, and on a shared, loaded machine two
# spinning OpenMP threads per process slow every forward pass down by orders of magnitude.
# Subprocesses (CLI tests) inherit OMP_NUM_THREADS.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB = 320
MASK_ID = 1
EOS_ID = 0


def corpus_texts(limit_chars: int = 200_000) -> list[str]:
    """Real text for the test tokenizer: a few standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for name in ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py"]:
        t = (stdlib / name).read_text(encoding="utf-8")
        texts.append(t)
        total += len(t)
        if total > limit_chars:
            break
    return texts


def make_tokenizer(out_dir: Path, vocab_size: int = VOCAB) -> None:
    """Train and save a byte-level BPE tokenizer (``<|endoftext|>`` = 0, ``<|MASK|>`` = 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|MASK|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|MASK|>", pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
    fast.save_pretrained(str(out_dir))


def make_sentencepiece_tokenizer(vocab_size: int = 700):
    """A Llama-2-style tokenizer (a ``PreTrainedTokenizerFast``): SentencePiece BPE with the
    word-start marker ``▁`` (a space, dropped at the start of a decode), byte fallback (the
    256 byte tokens ``<0x00>`` .. ``<0xFF>``: a run of them decodes as UTF-8 if valid, else
    one U+FFFD per byte), ``<unk>`` = 0, ``<s>`` = 1 (put before each prompt), ``</s>`` = 2."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False, max_token_length=8)
    tok.train_from_iterator([line for t in corpus_texts(60_000) for line in t.splitlines() if line.strip()], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    spec = json.loads(tok.to_str())
    # (the byte tokens are ordinary tokens of the model's vocabulary, not added ones, as in Llama 2's: llguidance
    # reads an added token's text literally, "<0xE9>", and a model token's as its byte)
    spec["added_tokens"] = [added for added in spec["added_tokens"] if added["content"] in specials]
    for added in spec["added_tokens"]:
        added["special"] = True
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    return fast


# a chat template that refuses a system message, as real templates refuse roles out of order
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                     "supported') }}{% endif %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}# assistant:\n")


def make_target(out_dir: Path, family: str = "qwen3", *, seed: int = 0, tokenizer: bool = True,
                max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random target of ``family`` (qwen3, llama, qwen2) with transformers' class
    (sharded safetensors when ``max_shard_size`` is given, e.g. ``"100KB"``)."""
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=1024, tie_word_embeddings=True,
                eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID)
    if family == "qwen3":
        base["head_dim"] = 16
    base.update(overrides)
    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    model = model_cls(cfg_cls(**base)).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(str(out_dir), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


HYBRID_FAMILIES = ("qwen3_moe", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")


def make_hybrid_target(out_dir: Path, model_type: str, *, seed: int = 0, tokenizer: bool = True,
                       max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random target of a hybrid / mixture-of-experts ``model_type`` (one of
    :data:`HYBRID_FAMILIES`) with transformers' own class: 6 layers (hybrids: linear
    attention except layer 3), 4 experts with top-2 routing where the family has experts,
    and for the multimodal wrappers ``qwen3_5`` / ``qwen3_5_moe`` a small vision tower
    (sharded safetensors when ``max_shard_size`` is given)."""
    import transformers

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=1024, tie_word_embeddings=False,
                eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID)
    if model_type != "qwen3_moe":
        text.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4)
    if "moe" in model_type or model_type == "qwen3_next":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        if model_type != "qwen3_moe":
            text["shared_expert_intermediate_size"] = 48
        if model_type != "qwen3_5_moe_text" and model_type != "qwen3_5_moe":
            text["norm_topk_prob"] = True
    text.update(overrides)
    classes = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        moe = model_type == "qwen3_5_moe"
        config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
            text_config=text, tie_word_embeddings=text["tie_word_embeddings"],
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=4, num_position_embeddings=16))
        model = (transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration)(config)
    else:
        cfg_cls, model_cls = classes[model_type]
        model = model_cls(cfg_cls(**text))
    model.eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if p.dim() == 2 or (p.dim() == 3 and "experts" in name):
                p.normal_(0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight", "model.norm.weight")) and model_type != "qwen3_moe":
                p.normal_(0, 0.1)  # (1 + weight) norms: exercise the offset
    model.save_pretrained(str(out_dir), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


def make_muse_glimmer_target(out_dir: Path, *, seed: int = 0, tokenizer: bool = True, vision: bool = True,
                             **overrides) -> Path:
    """Save a tiny random Muse Glimmer target with transformers' own
    ``MuseGlimmerForConditionalGeneration`` (the multimodal wrapper, as published; a vision
    tower of one layer unless ``vision`` is False, then a ``muse_glimmer_text`` config over
    the same decoder weights): 6 layers (full attention without RoPE on layers 1 and 5,
    transformers' default pattern; the others a window of 8), every norm weight random,
    ``output_multiplier`` 0.5 and a soft cap of 5 (so that the cap bends the logits).
    ``overrides``: text config fields."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, output_multiplier=0.5,
                final_logit_softcapping=5.0, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID)
    text.update(overrides)
    config = transformers.MuseGlimmerConfig(
        text_config=text, vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2), out_hidden_size=128, projector_hidden_size=64)
    model = transformers.MuseGlimmerForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if name == "model.language_model.norm.weight":  # (a plain scale; the layers' norms scale by 1 + weight)
                p.normal_(1, 0.3)
            elif "norm" in name:
                p.normal_(0, 0.3)
            elif name == "lm_head.weight":
                p.normal_(0, 0.8)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(out_dir))
    if not vision:
        out_dir = Path(out_dir)
        state = load_file(str(out_dir / "model.safetensors"))
        keep = {k: v for k, v in state.items() if k == "lm_head.weight" or k.startswith("model.language_model.")}
        save_file(keep, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps(dict(cfg["text_config"], architectures=["MuseGlimmerTextModel"]),
                                                        indent=2))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


# the rope of the published gpt-oss checkpoints (YaRN, not truncated)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def make_gpt_oss_target(out_dir: Path, *, seed: int = 0, tokenizer: bool = True, mxfp4: bool = False,
                        **overrides) -> Path:
    """Save a tiny random gpt-oss target with transformers' ``GptOssForCausalLM``: 4 layers
    (sliding window 8 on layers 0 and 2), 4 experts with top-2 routing, learned sinks, the
    published rope. ``mxfp4``: the expert matrices are replaced by random MXFP4 blocks and
    scales and the config says ``quant_method: mxfp4``, as in the published checkpoints
    (hidden and intermediate sizes are then multiples of 32)."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32 if mxfp4 else 24, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=8, max_position_embeddings=131072, rope_parameters=dict(GPT_OSS_ROPE),
               eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID, experts_implementation="eager")
    cfg.update(overrides)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(str(out_dir))
    if mxfp4:
        state = load_file(str(Path(out_dir) / "model.safetensors"))
        e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        g = torch.Generator().manual_seed(seed)
        for layer in range(cfg["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts."
            for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                del state[prefix + name]
                state[prefix + name + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g,
                                                                 dtype=torch.uint8)
                # scales 2**-6 .. 2**-4: elements up to 6 / 16
                state[prefix + name + "_scales"] = torch.randint(121, 124, (e, rows, cols // 32), generator=g,
                                                                 dtype=torch.uint8)
        save_file(state, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((Path(out_dir) / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


def drafter_config(target_dir: Path, *, num_layers: int = 2, block_size: int = 16, mask_token_id: int = MASK_ID,
                   target_layer_ids: list[int] | None = None) -> DrafterConfig:
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)  # multimodal wrappers
    L = tcfg["num_hidden_layers"]
    heads = tcfg["num_attention_heads"]
    return DrafterConfig(
        hidden_size=tcfg["hidden_size"], num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=tcfg.get("num_key_value_heads", heads), head_dim=tcfg.get("head_dim") or tcfg["hidden_size"] // heads,
        intermediate_size=tcfg.get("intermediate_size") or 2 * tcfg["hidden_size"], rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        attention_bias=False, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids or default_target_layer_ids(L, num_layers), num_target_layers=L,
        vocab_size=tcfg["vocab_size"], sliding_windows=[None] * num_layers,
    )


def dflash2_config(target_dir: Path, *, taps: int = 2, group_size: int = 16, rank: int = 16, top_k: int = 8,
                   **kw) -> DrafterConfig:
    """:func:`drafter_config` of a DFlash 2 drafter (small selector: rank 16, top-8)."""
    cfg = drafter_config(target_dir, **kw)
    cfg.dflash2 = DFlash2Settings(conv_kernel_size=taps, conv_group_size=group_size, selector_rank=rank, selector_top_k=top_k)
    return cfg


def randomize_dflash2_modules(model, *, conv_std: float = 0.3, selector_std: float = 0.5) -> None:
    """Non-trivial DFlash 2 modules: base kernels = identity + Normal(0, conv_std), kernel
    projections Normal(0, conv_std / 4), codebooks and hidden projection Normal(0, selector_std)
    (the pairwise term then changes the walk's choices)."""
    from dflash_torch.models.dflash2 import GroupedDynamicConv

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GroupedDynamicConv):
                m.reset_to_identity()
                m.base_kernel.add_(torch.randn_like(m.base_kernel) * conv_std)
                m.kernel_projection.weight.normal_(0, conv_std / 4)
        sel = model.candidate_selector
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.normal_(0, selector_std)


def save_drafter(out_dir: Path, cfg: DrafterConfig, state: dict[str, torch.Tensor] | None = None, *, seed: int = 0) -> Path:
    """Save a drafter in the published DFlash (or, for a config with ``dflash2``, DFlash 2)
    format (random weights unless ``state``: see :func:`randomize_dflash2_modules`)."""
    from dflash_torch.models.drafter import drafter_class

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if state is None:
        torch.manual_seed(seed)
        model = drafter_class(cfg)(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and not name.startswith("candidate_selector."):
                    p.normal_(0, 0.08)
        if cfg.dflash2 is not None:
            randomize_dflash2_modules(model)
        state = model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return out_dir


def make_dflash2_from(drafter_dir: Path, out_dir: Path, *, conv_std: float = 0.0, selector_std: float = 0.0,
                      seed: int = 0, **settings) -> Path:
    """A DFlash 2 drafter on the backbone of the DFlash drafter in ``drafter_dir``: the same
    backbone weights, convolutions = identity (+ Normal noise, :func:`randomize_dflash2_modules`,
    when ``conv_std`` > 0) and codebooks / hidden projection Normal(0, ``selector_std``)
    (all zero when 0). ``settings``: ``taps``, ``group_size``, ``rank``, ``top_k`` (default 2, 16, 16, 8)."""
    from safetensors.torch import load_file

    from dflash_torch.models.dflash2 import DFlash2Drafter

    cfg = DrafterConfig.from_dict(json.loads((Path(drafter_dir) / "config.json").read_text()))
    opts = dict(taps=2, group_size=16, rank=16, top_k=8)
    opts.update(settings)
    cfg.dflash2 = DFlash2Settings(conv_kernel_size=opts["taps"], conv_group_size=opts["group_size"],
                                  selector_rank=opts["rank"], selector_top_k=opts["top_k"])
    torch.manual_seed(seed)
    model = DFlash2Drafter(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(Path(drafter_dir) / "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith("candidate_selector.") or "_conv." in k for k in missing)
    randomize_dflash2_modules(model, conv_std=conv_std, selector_std=selector_std)
    return save_drafter(out_dir, cfg, model.state_dict())


@contextmanager
def stderr_that_cannot_take(kind: str, tmp_path):
    """``subprocess`` keyword arguments giving a command a stderr that cannot take what is written:
    ``full`` (``2>/dev/full``), ``read-only`` (a descriptor open for reading, as ``2>&-`` through
    pyenv's shell-script shim leaves it) or ``closed`` (``2>&-``)."""
    import subprocess

    if kind == "closed":
        yield {"stderr": subprocess.DEVNULL, "preexec_fn": lambda: os.close(2)}
        return
    if kind == "read-only":
        (tmp_path / "stderr").write_text("")
    with open("/dev/full" if kind == "full" else tmp_path / "stderr", "w" if kind == "full" else "r") as stderr:
        yield {"stderr": stderr}


class EndlessInput(io.RawIOBase):
    """An endless stdin (``yes |``, ``< /dev/zero``): ``unit`` repeated without end; ``taken``
    counts the bytes handed out, and a read past ``most`` of them fails (AssertionError), so
    that a reader that reads it to its end fails rather than filling the memory. Wrap it as
    ``io.TextIOWrapper(io.BufferedReader(EndlessInput(...)))`` for a ``sys.stdin``."""

    def __init__(self, unit: bytes = b"y\n", most: int = 1 << 24):
        self.unit, self.most, self.taken = unit, most, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        assert self.taken < self.most, f"stdin read past {self.most} bytes: read as if to its end"
        n = len(buffer)
        buffer[:n] = (self.unit * (n // len(self.unit) + 2))[self.taken % len(self.unit):][:n]
        self.taken += n
        return n


@pytest.fixture
def cli(capsys, monkeypatch):
    """``dflash-torch ARGS`` run in this process (``cli("generate", ..., stdin="text")``; a process
    spends ~4 s CPU starting the interpreter and torch): its status, stdout and stderr as a
    ``subprocess.CompletedProcess`` has them. ``stdin``: its text, or a text stream to be
    ``sys.stdin`` (e.g. over an :class:`EndlessInput`)."""
    import io
    import sys
    from types import SimpleNamespace

    from dflash_torch.cli import main as cli_main

    def run(*args: str, stdin: str | io.TextIOBase = "") -> SimpleNamespace:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())) if isinstance(stdin, str)
                            else stdin)
        capsys.readouterr()
        try:
            code = cli_main(list(args))
        except SystemExit as exc:  # (argparse's: --help, a bad flag)
            code = exc.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): a tiny Qwen3 target with tokenizer and a random B=16 drafter."""
    root = tmp_path_factory.mktemp("pair")
    target = make_target(root / "target")
    drafter = save_drafter(root / "drafter", drafter_config(target))
    return target, drafter


@pytest.fixture(scope="session")
def sentencepiece_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): a tiny Llama target with :func:`make_sentencepiece_tokenizer`'s
    tokenizer and a random B=8 drafter."""
    root = tmp_path_factory.mktemp("sentencepiece")
    tok = make_sentencepiece_tokenizer()
    target = make_target(root / "target", "llama", tokenizer=False, vocab_size=len(tok), eos_token_id=2,
                         bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    tok.save_pretrained(str(target))
    drafter = save_drafter(root / "drafter", drafter_config(target, mask_token_id=0, block_size=8))
    return target, drafter


# --- helpers added for the core-engine suite -------------------------------------------


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files of ``src_dir`` (saved by :func:`make_tokenizer`) into ``dst_dir``."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(src_dir) / name).is_file():
            shutil.copy(Path(src_dir) / name, Path(dst_dir) / name)


def load_hf(target_dir: Path):
    """The target checkpoint loaded by transformers itself (float32, eval), with the class
    its config names (e.g. the multimodal wrapper of Qwen3.5): the oracle."""
    import transformers

    arch = json.loads((Path(target_dir) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(target_dir), dtype=torch.float32).eval()


AGREE_TOKEN = 42  # the token c that the agreeable target predicts often
MUSE_AGREE_POST_NORM = -0.7  # the post-sublayer norm weights of an agreeable Muse Glimmer target


def make_agreeable_pair(root: Path, tokenizer_dir: Path, *, block_size: int = 16, alpha: float = 0.5,
                        beta: float = 2.5, model_type: str = "qwen3", self_scale: float = -1.0,
                        agree_token: int = AGREE_TOKEN) -> tuple[Path, Path]:
    """A (target, drafter) pair whose random drafter agrees with the target often.

    Every token embedding of an untied Qwen3 target gets a shared direction ``u``
    (a random multiple in [0, 2 * alpha) of it), except token c = ``AGREE_TOKEN`` whose
    embedding carries ``self_scale * alpha * u`` (negative: runs of c end); the lm_head row of c is
    ``beta * u``. The target then predicts c often but not always. The drafter has small
    random weights, so its output stays close to the (u-heavy) mask embedding and it
    proposes c nearly everywhere: it is accepted whenever the target predicts c.
    ``model_type``: ``qwen3``, ``gpt_oss``, ``muse_glimmer``, ``gemma4``, ``gemma4_moe``, ``minimax_m2`` or a text family of
    :data:`HYBRID_FAMILIES`; ``self_scale``:
    c's own multiple of ``u`` (higher: longer runs of c); ``agree_token``: c.
    """
    root = Path(root)
    if model_type == "qwen3":
        target = make_target(root / "target", "qwen3", seed=1, tokenizer=False, tie_word_embeddings=False)
    elif model_type == "gpt_oss":
        target = make_gpt_oss_target(root / "target", seed=1, tokenizer=False)
    elif model_type == "muse_glimmer":
        target = make_muse_glimmer_target(root / "target", seed=1, tokenizer=False)
    elif model_type == "minimax_m2":
        target = make_minimax_m2_target(root / "target", seed=1, tokenizer=False)
    elif model_type in ("gemma4", "gemma4_moe"):  # (untied, so that c's head row is its own)
        target = make_gemma4_target(root / "target", seed=1, tokenizer=False, multimodal=False,
                                    moe=model_type == "gemma4_moe", tie_word_embeddings=False)
    else:
        target = make_hybrid_target(root / "target", model_type, seed=1, tokenizer=False)
    return make_agreeable(target, tokenizer_dir, root, model_type, block_size=block_size, alpha=alpha, beta=beta,
                          self_scale=self_scale, agree_token=agree_token)


def make_agreeable(target: Path, tokenizer_dir: Path, root: Path, model_type: str, *, block_size: int = 16,
                   alpha: float = 0.5, beta: float = 2.5, self_scale: float = -1.0,
                   agree_token: int = AGREE_TOKEN) -> tuple[Path, Path]:
    """:func:`make_agreeable_pair`'s recipe applied to an untied target saved at ``target``
    (one safetensors file, rewritten; of ``model_type``), and its drafter saved under
    ``root / "drafter"``: (target, drafter)."""
    from safetensors.torch import load_file

    from dflash_torch.models.drafter import DFlashDrafter

    state = load_file(str(target / "model.safetensors"))
    head = "head.weight" if "head.weight" in state else "lm_head.weight"  # (DeepSeek-V4 saves DeepSeek's name)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(state[head].shape[1], generator=g)
    u /= u.norm()
    scale = torch.rand(state[head].shape[0], 1, generator=g) * 2
    scale[agree_token] = self_scale
    embed = "model.language_model.embed_tokens.weight" if model_type == "muse_glimmer" else "model.embed_tokens.weight"
    state[embed] += alpha * scale * u
    if model_type == "muse_glimmer":  # sublayer outputs at 0.3 of their norm (which scales by 1 + w): u survives
        for key in [k for k in state if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))]:
            state[key] = torch.full_like(state[key], MUSE_AGREE_POST_NORM)
    if model_type.startswith("gemma4"):  # sublayer outputs at 0.3 of their norm (which scales by w): u survives
        for key in [k for k in state if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))]:
            state[key] = torch.full_like(state[key], 1 + MUSE_AGREE_POST_NORM)
    state[head][agree_token] = beta * u
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(tokenizer_dir, target)
    cfg = drafter_config(target, block_size=block_size)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    drafter = save_drafter(root / "drafter", cfg, model.state_dict())
    return target, drafter


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """One trained test tokenizer, to copy into targets saved without one."""
    out = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def agree_pair(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) from :func:`make_agreeable_pair` (B = 16)."""
    return make_agreeable_pair(tmp_path_factory.mktemp("agree"), tokenizer_dir)


@pytest.fixture(scope="session")
def agree_hybrid_pair(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): an agreeable pair (:func:`make_agreeable_pair`) whose target
    is a hybrid mixture-of-experts Qwen3-Next (Gated DeltaNet + attention, experts), B = 16."""
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-hybrid"), tokenizer_dir, model_type="qwen3_next",
                               alpha=1.0, self_scale=0.0)


@pytest.fixture(scope="session")
def agree_gpt_oss_pair(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): an agreeable pair (:func:`make_agreeable_pair`) whose target
    is a gpt-oss (sink attention, sliding window 8, experts), B = 16."""
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-gpt_oss"), tokenizer_dir, model_type="gpt_oss",
                               alpha=0.5, beta=5.0, self_scale=0.0)


@pytest.fixture(scope="session")
def mxfp4_gpt_oss_pair(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """(target_dir, random drafter_dir, B = 8) of a tiny gpt-oss target whose experts are MXFP4."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    target = make_gpt_oss_target(root / "target", seed=6, tokenizer=False, mxfp4=True)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=6)


def varied_prompts(target_model, n: int, *, seed: int = 0, length: int = 5) -> list[list[int]]:
    """Token-id prompts for the agreeable target whose greedy continuations are varied:
    made of the 40 tokens whose embeddings point least along the lm_head row of c, so the
    target does not start with c and switches between c and other tokens later."""
    with torch.no_grad():
        u = target_model.lm_head.weight[AGREE_TOKEN]
        low = (target_model.model.embed_tokens.weight @ u).argsort()[:40].tolist()
    g = torch.Generator().manual_seed(seed)
    return [[low[i] for i in torch.randint(0, 40, (length,), generator=g).tolist()] for _ in range(n)]


@pytest.fixture(scope="session")
def agree_dflash2_pair(agree_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): the agreeable target and a DFlash 2 drafter on the agreeable
    drafter's backbone with random convolutions and codebooks (:func:`make_dflash2_from`,
    conv_std 0.2, selector_std 0.6): its walk departs from the backbone's argmax often, and
    is still accepted over multi-token paths (greedy mean tau about 1.9 at B = 16)."""
    target, drafter = agree_pair
    return target, make_dflash2_from(drafter, tmp_path_factory.mktemp("agree-dflash2"), conv_std=0.2, selector_std=0.6, seed=3)


def to_speculators(drafter_dir: Path, target_dir: Path, out_dir: Path, *, draft_tokens: list[int] | None = None,
                   sliding_window: int | None = None, non_causal: bool = False, ship_embedding: bool = False,
                   ship_lm_head: bool | None = None, embed_tokens: torch.Tensor | None = None,
                   aux_ids: list[int] | None = None) -> Path:
    """The DFlash drafter of ``drafter_dir`` written in the Speculators format (the layout of
    vLLM's speculators library, as tests/data/speculators holds it; the same weights, its
    target layer ids l as aux ids l + 1).

    Args:
        draft_tokens: a draft vocabulary (sorted target ids): ``lm_head`` is those rows of the
            target's LM head, with ``d2t`` / ``t2d``; None: the target's vocabulary.
        sliding_window: make the first layer a sliding-window one of that size.
        non_causal: ``sliding_window_non_causal``.
        ship_embedding / ship_lm_head: write copies of the target's embedding table / LM head
            (``ship_lm_head`` defaults to having a draft vocabulary, as speculators >= 0.9 saves).
        embed_tokens: write this embedding table instead (``[vocab, hidden]``).
        aux_ids: write these ``aux_hidden_state_layer_ids`` instead (another drafter then).
    """
    drafter_dir, target_dir, out_dir = Path(drafter_dir), Path(target_dir), Path(out_dir)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    weights = load_file(str(drafter_dir / "model.safetensors"))
    target = load_file(str(target_dir / "model.safetensors"))
    table = target.get("model.embed_tokens.weight", target.get("embed.weight"))  # (DeepSeek-V4 as published: embed.)
    head = target.get("lm_head.weight", target.get("head.weight", table))
    n = cfg["num_hidden_layers"]
    layer_types = ["full_attention"] * n
    if sliding_window is not None:
        layer_types[0] = "sliding_attention"
    layer_cfg = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "intermediate_size", "rms_norm_eps", "attention_bias", "hidden_act",
                                      "vocab_size") if k in cfg}
    layer_cfg.update(model_type="qwen3", rope_parameters={"rope_theta": cfg.get("rope_theta", 10000.0), "rope_type": "default"},
                     layer_types=layer_types, sliding_window=sliding_window, use_sliding_window=sliding_window is not None,
                     max_position_embeddings=cfg.get("max_position_embeddings") or 1024, tie_word_embeddings=False)
    vocab = cfg["vocab_size"]
    draft_vocab = vocab if draft_tokens is None else len(draft_tokens)
    if draft_tokens is not None:
        tokens = torch.tensor(sorted(draft_tokens))
        weights["lm_head.weight"] = head[tokens].clone()
        weights["d2t"] = tokens - torch.arange(len(tokens))
        weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, tokens, True)
    elif ship_lm_head:
        weights["lm_head.weight"] = head.clone()
    if ship_embedding or embed_tokens is not None:
        weights["embed_tokens.weight"] = (table if embed_tokens is None else embed_tokens).clone()
    dflash = cfg["dflash_config"]
    spec = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"": "config.DFlashSpeculatorConfig"},
        "aux_hidden_state_layer_ids": aux_ids or [i + 1 for i in dflash["target_layer_ids"]],
        "block_size": cfg.get("block_size") or dflash.get("block_size"), "draft_vocab_size": draft_vocab, "dtype": "float32",
        "mask_token_id": dflash["mask_token_id"], "sample_from_anchor": False, "sliding_window_non_causal": non_causal,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy", "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 15, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": str(target_dir)}},
        "speculators_model_type": "dflash", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False, "transformer_layer_config": layer_cfg,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(spec, indent=2))
    return out_dir


SPEC_DRAFT_TOKENS = [t for t in range(VOCAB) if t % 3 != 1]  # a draft vocabulary of two thirds (AGREE_TOKEN in it)


@pytest.fixture(scope="session")
def agree_speculators_pair(agree_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): the agreeable target and its drafter in the Speculators format
    (:func:`to_speculators`) with a draft vocabulary of :data:`SPEC_DRAFT_TOKENS` and a causal
    sliding window of 8 on its first layer."""
    target, drafter = agree_pair
    return target, to_speculators(drafter, target, tmp_path_factory.mktemp("agree-speculators"),
                                  draft_tokens=SPEC_DRAFT_TOKENS, sliding_window=8)


def incremental_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits ``[60, V]`` of ``ids[:60]`` read as decoding reads them: a prefill chunk of
    40 tokens, a deferred verify block of 16 committed in part (7 rows), then single tokens
    (a hybrid target's deferred commit path)."""
    with torch.no_grad():
        cache = model.new_cache()
        cache.reset(128)
        steps = [model(ids[:40], torch.arange(40), cache, 40)[0]]
        block, _ = model(ids[40:56], torch.arange(40, 56), cache, 56, defer_commit=True)
        steps.append(block[:7])
        model.commit(cache, torch.tensor(7))
        for p in range(47, 60):
            steps.append(model(ids[p:p + 1], torch.tensor([p]), cache, p + 1)[0])
    return torch.cat(steps)


def check_rollback(model, ids: torch.Tensor, counts, block: int = 16) -> None:
    """A hybrid target's rollback: for each accepted count n of ``counts``, after a 20-token
    prefix, a verify block of ``block`` tokens deferred and then committed n rows leaves the
    recurrent state (convolution and recurrent) that feeding only those n tokens leaves (up
    to float32 rounding of batched against shorter inputs), the next 4 tokens' logits agree,
    and a deferred block leaves the state as it was. ``ids``: at least ``24 + 2 * block``."""
    with torch.no_grad():
        for n in counts:
            verified, fed = model.new_cache(), model.new_cache()
            for cache in (verified, fed):
                cache.reset(64)
                model(ids[:20], torch.arange(20), cache, 20)
            model(ids[20:20 + block], torch.arange(20, 20 + block), verified, 20 + block, defer_commit=True)
            model.commit(verified, torch.tensor(n))
            model(ids[20:20 + n], torch.arange(20, 20 + n), fed, 20 + n)
            for a, b in zip(verified.recurrent.conv + verified.recurrent.ssm, fed.recurrent.conv + fed.recurrent.ssm):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            la = model(ids[20 + n:24 + n], torch.arange(20 + n, 24 + n), verified, 24 + n)[0]
            lb = model(ids[20 + n:24 + n], torch.arange(20 + n, 24 + n), fed, 24 + n)[0]
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
            before = [t.clone() for t in fed.recurrent.ssm + fed.recurrent.conv]
            model(ids[24 + n:24 + n + block], torch.arange(24 + n, 24 + n + block), fed, 24 + n + block,
                  defer_commit=True)
            assert all(torch.equal(x, y) for x, y in zip(before, fed.recurrent.ssm + fed.recurrent.conv)), n


def forward_in_pieces(model, ids: torch.Tensor, pieces: list[int], static: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's logits and all layers' outputs of ``ids`` fed in consecutive pieces of the
    given lengths (``static``: attending over the whole preallocated cache, as fixed shapes do)."""
    cache = model.new_cache()
    cache.reset(64)
    logits, feats, start = [], [], 0
    layers = list(range(model.config.num_hidden_layers))
    with torch.no_grad():
        for n in pieces:
            end = start + n
            lg, f = model(ids[start:end], torch.arange(start, end), cache, kv_len=None if static else end,
                          feature_layers=layers)
            logits.append(lg)
            feats.append(f)
            start = end
    return torch.cat(logits), torch.cat(feats)


def check_forward_matches_transformers(model, hf, ids: torch.Tensor, pieces: list[int], static: bool):
    """Our target's logits and every layer's output for ``ids`` fed in ``pieces``
    (:func:`forward_in_pieces`) equal transformers' (``hf``) within 1e-4; returns its output."""
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    logits, feats = forward_in_pieces(model, ids, pieces, static)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    h = model.config.hidden_size
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(feats[:, layer * h:(layer + 1) * h], ref.hidden_states[layer + 1][0], rtol=1e-4, atol=1e-4)
    return ref


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers' own greedy ``generate`` gives after ``ids`` (EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def check_greedy_equals_transformers(target_dir: Path, drafter_dir: Path, block_sizes=(2, 8, 16), new_tokens: int = 24):
    """Greedy speculative decoding == transformers' greedy ``generate``, token for token: the
    target alone, each of ``block_sizes``, recompute, fixed shapes and a batch of two."""
    from dflash_torch import DFlashEngine

    hf = load_hf(target_dir)
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir)
    engines = [DFlashEngine(spec.target, spec.tokenizer)]
    engines += [DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=b) for b in block_sizes]
    engines += [DFlashEngine(spec.target, spec.tokenizer, spec.drafter, draft_mode="recompute", block_size=5),
                DFlashEngine(spec.target, spec.tokenizer, spec.drafter, static=True, max_context=300)]
    prompts = ["def f(x):", "import os\nimport sys\n"]
    refs = [hf_greedy(hf, spec.encode_prompt(p), new_tokens) for p in prompts]
    for prompt, ref in zip(prompts, refs):
        for engine in engines:
            out = engine.generate(spec.encode_prompt(prompt), max_new_tokens=new_tokens, ignore_eos=True)
            assert out.token_ids == ref, (engine.block_size, engine.decoder.draft_mode, engine.decoder.static)
    batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, max_batch_size=2, max_context=128)
    outs = batch.generate_batch(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs


def check_many_accepted_tokens_are_lossless(target_dir: Path, drafter_dir: Path) -> None:
    """An agreeable pair's rounds that accept several tokens, over 80 tokens (ten windows of a
    sliding window of 8): eager (prefill chunks of 256 and of 8), fixed shapes and batched
    decoding (chunks of 8) all give transformers' greedy tokens, and the acceptance lengths
    vary (mean > 1.5, four values or more). With chunks of 8 or 32 a target's sliding-window
    layers keep rings shorter than the sequence (``window + max(B, chunk) - 1`` rows), so
    positions wrap around them many times."""
    from dflash_torch import DFlashEngine

    hf = load_hf(target_dir)
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir)
    chunked = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, prefill_chunk=8)
    static = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, static=True, max_context=256, prefill_chunk=32)
    batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, max_batch_size=2, max_context=256, prefill_chunk=8)
    prompts = [[5, 17, 99, 3], list(range(2, 45))]
    refs = [hf_greedy(hf, p, 80) for p in prompts]
    taus = []
    for prompt, ref in zip(prompts, refs):
        for engine in (spec, chunked, static):
            out = engine.generate(prompt, max_new_tokens=80, ignore_eos=True)
            assert out.token_ids == ref
            taus += out.stats.acceptance_lengths
    assert [o.token_ids for o in batch.generate_batch(prompts, max_new_tokens=80, ignore_eos=True)] == refs
    assert sum(taus) / len(taus) > 1.5 and len(set(taus)) >= 4, sorted(set(taus))
    windows = spec.target.kv_windows()
    if any(windows):  # (the rings were shorter than the sequences: positions wrapped)
        B = spec.block_size
        for kv, rows in ((chunked.decoder.target_cache.kv, 8), (static.decoder.target_cache.kv, 32),
                         (batch.batch_decoder().target_kv, 8)):
            assert [t.shape[-2] for t, w in zip(kv.k, windows) if w] == [w + max(B, rows) - 1 for w in windows if w]
            assert all(w + max(B, rows) - 1 < 84 for w in windows if w)


def check_compiled_rounds_are_lossless(target_dir: Path, drafter_dir: Path) -> None:
    """Compiled rounds (torch.compile, eager backend) commit the eager decoder's tokens, and
    after warm-up no graph is recompiled, no frame re-traced and no graph ever broken."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    from dflash_torch.decoding import SpeculativeDecoder
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.models.target import TargetModel

    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=256, prefill_chunk=32)
    eager = SpeculativeDecoder(target, drafter)
    run_rounds(compiled, [5, 17, 99, 3], 40)
    graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
    for prompt in ([11, 12, 13], list(range(2, 60))):
        assert run_rounds(compiled, prompt, 60)[0] == run_rounds(eager, prompt, 60)[0]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])


def run_rounds(decoder, prompt, n, params=None):
    """The first ``n`` tokens a :class:`SpeculativeDecoder` commits for ``prompt`` (greedy
    unless ``params``), and the acceptance length of each drafted round."""
    from dflash_torch.sampling import SamplingParams

    tokens, taus = [], []
    for rnd in decoder.rounds(prompt, params or SamplingParams(), n):
        tokens.extend(rnd.tokens)
        if rnd.acceptance_length is not None:
            taus.append(rnd.acceptance_length)
    return tokens[:n], taus


def read_completion_stream(stream, leave_after: int | None = None) -> tuple[str, object, int]:
    """Read an ``openai`` completions stream: (text, usage, text events). With
    ``leave_after``, drop the connection after that many text events (a client leaving)."""
    text, usage, events = [], None, 0
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
            continue
        text.append(ev.choices[0].text)
        events += 1
        if leave_after is not None and events >= leave_after:
            stream.close()  # drop the connection mid-stream
            break
    return "".join(text), usage, events


@pytest.fixture(scope="module")
def local_engine(tiny_pair):
    """The tiny pair's target in-process, for token counting only (encode_prompt / decode)."""
    from dflash_torch import DFlashEngine

    return DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """A tiny random Qwen3-MoE target (attention, experts) and a random drafter (B = 8), loaded."""
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.models.target import TargetModel

    root = tmp_path_factory.mktemp("moe-models")
    target_dir = make_hybrid_target(root / "target", "qwen3_moe", seed=3, tokenizer=False)
    drafter_dir = save_drafter(root / "drafter", drafter_config(target_dir, block_size=8))
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


@pytest.fixture(scope="session")
def dflash2_models(agree_dflash2_pair):
    """The agreeable DFlash 2 pair, loaded."""
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.models.target import TargetModel

    target_dir, drafter_dir = agree_dflash2_pair
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


def added_tensor(key: str, shape=(4,)):
    """A ``state`` edit of :func:`edited_checkpoint`: a zero tensor ``key`` of ``shape`` added."""
    def edit(state):
        state[key] = torch.zeros(shape)
    return edit


def check_gathered_dispatch(model, tokens: int) -> None:
    """The expert dispatch CUDA graphs capture (every pair gathers its expert) equals the
    sparse one, on layer 1's mixture of experts of ``model`` (width 64) for ``tokens`` tokens."""
    from dflash_torch.models.moe import dispatch_experts, gathered_experts

    moe = model.model.layers[1].mlp
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    weights, ids = moe.route(x)
    e = moe.experts
    sparse = dispatch_experts(x, ids, weights, e.gate_up_proj, e.down_proj, **e.quantization())
    gathered = gathered_experts(x, ids, weights, e.gate_up_proj, e.down_proj, **e.quantization())
    torch.testing.assert_close(gathered, sparse, rtol=1e-5, atol=1e-6)


def edited_checkpoint(src: Path, dst: Path, *, config=None, state=None) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst``, with ``config(cfg)`` applied to
    its config.json dict and ``state(weights)`` to its tensors (both edit in place)."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if state:
        weights = load_file(str(dst / "model.safetensors"))
        state(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def randomize_moe_weights(model, prefix: str = "", *, correction_std: float = 0.3) -> None:
    """Larger-than-default weights for a tiny MoE target built with transformers' class (peaked,
    less tie-prone logits): matrices N(0, 0.08), norm weights N(1, 0.2), LayerNorm biases
    N(0, 0.2), score correction biases N(0, ``correction_std``) (so that they change which
    experts are chosen); only parameters whose names start with ``prefix``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(prefix):
                continue
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
            elif name.endswith("norm.bias"):
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, correction_std)


def make_minimax_m2_target(out_dir: Path, *, seed: int = 0, tokenizer: bool = True, published_config: bool = False,
                           **overrides) -> Path:
    """Save a tiny random MiniMax-M2 target with transformers' ``MiniMaxM2ForCausalLM``: 4
    layers, 6 experts with top-2 routing, heads of 16 rotating their first 8 channels, random
    norm weights and routing biases (``e_score_correction_bias``, large enough to change the
    choice of experts). ``published_config``: the config.json rewritten the way the published
    checkpoints write theirs (top-level ``rope_theta`` and ``rotary_dim`` without a
    ``partial_rotary_factor``, and their remote-code fields)."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, rotary_dim=8,
               max_position_embeddings=1024, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
               experts_implementation="eager")
    cfg.update(overrides)
    model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**cfg)).eval()
    randomize_moe_weights(model, correction_std=0.1)
    model.save_pretrained(str(out_dir))
    if published_config:
        config = json.loads((Path(out_dir) / "config.json").read_text())
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        n = config["num_hidden_layers"]
        config.update(attn_type_list=[1] * n, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
                      use_routing_bias=True, shared_intermediate_size=0, use_mtp=True, num_mtp_modules=3,
                      mtp_transformer_layers=1, layernorm_full_attention_beta=1.0, layernorm_mlp_beta=1.0,
                      sliding_window=None, swa_rope_theta=-1.0)
        (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


def make_gemma4_target(out_dir: Path, *, seed: int = 0, tokenizer: bool = True, multimodal: bool = True,
                       moe: bool = False, unified: bool = False, **overrides) -> Path:
    """Save a tiny random Gemma 4 target with transformers' own classes:
    ``Gemma4ForConditionalGeneration`` (the published multimodal layout, a one-layer vision
    tower) unless ``multimodal`` is False (``Gemma4ForCausalLM``). 6 layers, the last one
    full attention (heads of 32, one key/value head, values from ``k_proj``: the 31B's
    ``attention_k_eq_v``, proportional RoPE), the others a window of 8 (heads of 16, two
    key/value heads); a soft cap of 10; ``moe``: a mixture of 4 experts (top 2) beside
    every MLP, as in the 26B-A4B; ``unified``: the encoder-free gemma-4-12B's classes
    (``Gemma4Unified*``: no mixture of experts; its multimodal wrapper a small vision
    embedder). Every norm weight and layer scalar random. ``overrides``: text config fields."""
    import transformers

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=8, max_position_embeddings=1024, hidden_size_per_layer_input=0,
                final_logit_softcapping=10.0, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID)
    if moe:
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    if unified:
        del text["hidden_size_per_layer_input"]
    text.update(overrides)
    if unified and multimodal:
        config = transformers.Gemma4UnifiedConfig(text_config=text, audio_config=None, vision_config=dict(
            mm_embed_dim=32, output_proj_dims=32, mm_posemb_size=16, patch_size=4))
        model = transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    elif unified:
        model = transformers.Gemma4UnifiedForCausalLM(transformers.Gemma4UnifiedTextConfig(**text)).eval()
    elif multimodal:
        config = transformers.Gemma4Config(text_config=text, audio_config=None, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16))
        model = transformers.Gemma4ForConditionalGeneration(config).eval()
    else:
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text)).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if "language_model" not in name and multimodal:
                continue
            if name.endswith("norm.weight") or name.endswith(("router.scale", "per_expert_scale")):
                p.normal_(1, 0.3)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(str(out_dir))
    if tokenizer:
        make_tokenizer(out_dir)
    return Path(out_dir)


def v4_drafter(target: Path, out_dir: Path, *, std: float = 0.08, seed: int = 0, layer_ids=None) -> Path:
    """A random Speculators-format DFlash drafter (B = 8, two layers, weights N(0, std)) reading
    the multi-stream features of the V4 target at ``target`` (``target_hidden_size`` =
    ``hc_mult * hidden_size``, as RedHatAI/DeepSeek-V4-Flash-speculator.dflash), of target
    layers ``layer_ids`` (aux ids + 1; default: the DFlash reference's spread)."""
    import json

    from dflash_torch.models.drafter import DFlashDrafter

    tcfg = json.loads((target / "config.json").read_text())
    cfg = drafter_config(target, block_size=8, target_layer_ids=layer_ids)
    cfg.target_hidden_size = tcfg["hc_mult"] * tcfg["hidden_size"]
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    plain = save_drafter(Path(str(out_dir) + "-dflash"), cfg, model.state_dict())
    out = to_speculators(plain, target, out_dir)
    spec = json.loads((out / "config.json").read_text())
    spec["target_hidden_size"] = cfg.target_hidden_size
    spec["speculators_config"]["verifier"]["architectures"] = ["DeepseekV4ForCausalLM"]
    (out / "config.json").write_text(json.dumps(spec, indent=2))
    return out


def assert_same_weights(mine: dict, theirs: dict, *context) -> None:
    """Two state dicts hold the same names, and under each the same dtype and values, bit for
    bit (``context``: what an assertion message names besides the tensor's name)."""
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), (*context, k)


# two tools of a chat request (the tool-call parser and forced-call tests)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "ratio": {"type": ["number", "null"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


@contextmanager
def serve_in_thread(app):
    """``app`` (:func:`dflash_torch.serving.app.create_app`'s) served by a real uvicorn HTTP
    server on a free local port, in a thread of this process (a ``dflash-torch serve`` process
    spends ~4 s CPU starting) -> its base URL (``http://127.0.0.1:PORT``); on leaving, the server
    stops and the app's scheduler closes."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert thread.is_alive() and time.time() < deadline, "the server did not come up"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        app.state.scheduler.close()


def run_forked(code: str, argv: list[str] = (), timeout: float = 120):
    """The script ``code`` run as ``python -c CODE ARGV...`` runs it, in a fork of this process
    (a real process, for signals, exit statuses and limits set in it, without the ~4 s CPU a new
    interpreter spends importing torch and transformers): its ``returncode`` (1 with the
    traceback on stderr where it raises, a KeyboardInterrupt too), ``stdout`` and ``stderr``
    (pipes, not files, which a limit on the size of files the script sets would cut), as a
    ``subprocess.CompletedProcess`` has them. Its SIGINT handler is a new interpreter's
    (KeyboardInterrupt), whatever this process's is; it leaves with ``os._exit``, not through
    the interpreter's exit (tests of that run a new interpreter).

    Raises:
        AssertionError: it ran past ``timeout`` seconds (it is killed).
    """
    import sys
    import threading
    import time
    import traceback
    import warnings
    from types import SimpleNamespace

    pipes = [os.pipe(), os.pipe()]  # (stdout, stderr)
    with warnings.catch_warnings():  # (Python >= 3.12 warns on a fork in a process with threads)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # (the child: it never returns into pytest)
        status = 1
        try:
            for fd, (_, write) in zip((1, 2), pipes):
                os.dup2(write, fd)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.argv = ["-c", *argv]
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(status)
    said = [b"", b""]

    def read(i: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            said[i] = pipe.read()

    readers = []
    for i, (read_end, write_end) in enumerate(pipes):
        os.close(write_end)
        readers.append(threading.Thread(target=read, args=(i, read_end), daemon=True))
        readers[-1].start()
    deadline = time.monotonic() + timeout
    while not (waited := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked script ran past {timeout} s")
        time.sleep(0.02)
    for reader in readers:
        reader.join(60)
    return SimpleNamespace(returncode=os.waitstatus_to_exitcode(waited[1]), stdout=said[0].decode(errors="replace"),
                           stderr=said[1].decode(errors="replace"))
