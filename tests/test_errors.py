"""Every bad input gives a clear, one-line DFlashError from the Python API, and the
command line prints that one line (no traceback) and exits non-zero. The CLI runs
in-process here (``dflash_torch.cli.main``); tests/test_cli.py runs a few of the same
errors as real subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REFUSING_TEMPLATE, copy_tokenizer, dflash2_config, drafter_config, make_target, save_drafter
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.errors import OptionError
from dflash_torch.cli import main as cli_main


@pytest.fixture(scope="module")
def bad(tiny_pair, tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Broken or mismatched checkpoints next to the good tiny pair."""
    from safetensors.torch import load_file, save_file

    target, drafter = tiny_pair
    root = tmp_path_factory.mktemp("bad")
    paths = {"target": target, "drafter": drafter, "missing": root / "does-not-exist", "empty": ""}

    def drafter_with(name, **changes):
        cfg = drafter_config(target, block_size=16)
        for k, v in changes.items():
            setattr(cfg, k, v)
        paths[name] = save_drafter(root / name, cfg)

    drafter_with("hidden", hidden_size=32, num_attention_heads=2, num_key_value_heads=2)
    drafter_with("num_layers", num_target_layers=6)
    drafter_with("layer_ids", target_layer_ids=[1, 4])
    drafter_with("mask_id", mask_token_id=320)

    (root / "no-config").mkdir()
    (root / "no-config" / "model.safetensors").write_bytes(b"")
    paths["no_config"] = root / "no-config"
    (root / "config-dir" / "config.json").mkdir(parents=True)
    paths["config_dir"] = root / "config-dir"

    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(target / "config.json", no_weights / "config.json")
    copy_tokenizer(tokenizer_dir, no_weights)
    paths["no_weights"] = no_weights
    bin_only = shutil.copytree(no_weights, root / "bin-only")  # (transformers' older format, a pickle)
    torch.save(load_file(str(target / "model.safetensors")), bin_only / "pytorch_model.bin")
    paths["bin_only"] = bin_only

    for name in ("dangling_link", "weights_dir"):  # an interrupted download's link to a missing blob; a directory
        broken = root / name
        broken.mkdir()
        shutil.copy(target / "config.json", broken / "config.json")
        copy_tokenizer(tokenizer_dir, broken)
        if name == "dangling_link":
            (broken / "model.safetensors").symlink_to(root / "blobs" / "never-downloaded")
        else:
            (broken / "model.safetensors").mkdir()
        paths[name] = broken

    sharded = make_target(root / "sharded", "qwen3", tokenizer=False, max_shard_size="150KB")
    copy_tokenizer(tokenizer_dir, sharded)
    shards = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    wrong_index = shutil.copytree(sharded, root / "wrong-index")  # (its index maps the embedding to a shard without it)
    shard = json.loads((wrong_index / "model.safetensors.index.json").read_text())["weight_map"]["model.embed_tokens.weight"]
    held = load_file(str(wrong_index / shard))
    del held["model.embed_tokens.weight"]
    save_file(held, str(wrong_index / shard), metadata={"format": "pt"})
    paths["wrong_index"], paths["wrong_index_shard"] = wrong_index, shard
    (sharded / shards[-1]).unlink()
    paths["missing_shard"] = sharded
    dangling_shard = root / "dangling-shard"  # (a sharded snapshot whose last blob never came)
    shutil.copytree(sharded, dangling_shard)
    (dangling_shard / shards[-1]).symlink_to(root / "blobs" / "never-downloaded-shard")
    paths["dangling_shard"] = dangling_shard
    dangling_tokenizer = root / "dangling-tokenizer"  # (transformers blamed a missing sentencepiece / tiktoken)
    shutil.copytree(target, dangling_tokenizer)
    (dangling_tokenizer / "tokenizer.json").unlink()
    (dangling_tokenizer / "tokenizer.json").symlink_to(root / "blobs" / "never-downloaded-tokenizer")
    paths["dangling_tokenizer"] = dangling_tokenizer

    lacking = root / "lacking-tensor"
    shutil.copytree(target, lacking)
    state = load_file(str(lacking / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(lacking / "model.safetensors"))
    paths["lacking_tensor"] = lacking

    prefixed = shutil.copytree(drafter, root / "drafter-prefixed")  # (every weight under "model.")
    save_file({f"model.{k}": v for k, v in load_file(str(drafter / "model.safetensors")).items()},
              str(prefixed / "model.safetensors"))
    paths["drafter_prefixed"] = prefixed
    extra = root / "drafter-extra-weights"  # e.g. a DFlash 2 drafter's convolution weights
    shutil.copytree(drafter, extra)
    dstate = load_file(str(extra / "model.safetensors"))
    dstate["layers.0.attention_conv.base_kernel"] = dstate["norm.weight"][:4].clone()
    save_file(dstate, str(extra / "model.safetensors"))
    paths["drafter_extra"] = extra
    paths["dflash2"] = save_drafter(root / "dflash2", dflash2_config(target, block_size=16))  # a valid DFlash 2 drafter
    v2_lacking = root / "dflash2-lacking"  # a DFlash 2 config over DFlash (v1) weights: its modules are missing
    shutil.copytree(drafter, v2_lacking)
    (v2_lacking / "config.json").write_text(json.dumps(dflash2_config(target, block_size=16).to_dict()))
    paths["dflash2_lacking"] = v2_lacking
    v2_bare = root / "dflash2-bare"  # architectures DFlash2DraftModel without the DFlash 2 settings
    shutil.copytree(drafter, v2_bare)
    cfg = json.loads((v2_bare / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    (v2_bare / "config.json").write_text(json.dumps(cfg))
    paths["dflash2_bare"] = v2_bare

    corrupt = root / "corrupt"
    shutil.copytree(target, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    paths["corrupt"] = corrupt
    garbage = root / "garbage"
    shutil.copytree(target, garbage)
    (garbage / "model.safetensors").write_bytes(b"garbage\n")
    paths["garbage"] = garbage
    return paths


# (name, from_pretrained keyword arguments or None, generate kwargs or None, words the message must contain)
LOAD_CASES = [
    ("hidden-size", dict(draft="hidden"), "hidden_size"),
    ("num-target-layers", dict(draft="num_layers"), "num_target_layers"),
    ("layer-ids-out-of-range", dict(draft="layer_ids"), "target_layer_ids"),
    ("mask-id-outside-vocab", dict(draft="mask_id"), "mask_token_id"),
    ("missing-target-dir", dict(target="missing"), "does not exist"),
    ("missing-drafter-dir", dict(draft="missing"), "does not exist"),
    ("missing-config", dict(target="no_config"), "config.json"),
    ("config-is-a-directory", dict(target="config_dir"), "config-dir/config.json is not a file (a directory)"),  # ("has no config.json")
    ("empty-path", dict(target="empty"), "the checkpoint path is empty"),  # ("" was ".": "'.' has no config.json")
    ("missing-weights", dict(target="no_weights"), "safetensors"),
    # (no word that the pickle beside it is not read)
    ("pickle-weights-only", dict(target="bin_only"), "has no safetensors weights (model.safetensors or "
     "model.safetensors.index.json); it holds pytorch_model.bin (PyTorch pickle weights), which dflash-torch does not "
     "read: convert them to safetensors, e.g. load the model with transformers and save_pretrained(DIR, "
     "safe_serialization=True)"),
    ("missing-shard", dict(target="missing_shard"), "missing"),
    # (a FileNotFoundError / OSError traceback)
    ("dangling-weights-link", dict(target="dangling_link"), "model.safetensors is a broken link (an interrupted download"),
    ("dangling-shard-link", dict(target="dangling_shard"), ".safetensors is a broken link (an interrupted download"),
    ("dangling-tokenizer-link", dict(target="dangling_tokenizer"), "tokenizer.json is a broken link (an interrupted down"),
    ("weights-path-is-a-directory", dict(target="weights_dir"), "model.safetensors is not a readable file"),
    ("missing-tensor", dict(target="lacking_tensor"), "up_proj"),
    # (the index entry was not named: "lacks weights: model.embed_tokens.weight")
    ("index-maps-to-the-wrong-shard", dict(target="wrong_index"), "lacks weights: model.embed_tokens.weight "
     "(model.safetensors.index.json maps model.embed_tokens.weight to model-0000"),
    # (all named as missing: "lacks weights: fc.weight, hidden_norm.weight, ...")
    ("drafter-weights-under-a-prefix", dict(draft="drafter_prefixed"), "lacks weights: fc.weight, hidden_norm.weight, "
     "layers.0.input_layernorm.weight, layers.0.mlp.down_proj.weight, layers.0.mlp.gate_proj.weight ... (it holds them "
     "under the prefix 'model.': model.fc.weight, ...; rename them without it)"),
    ("drafter-unknown-weights", dict(draft="drafter_extra"), "attention_conv"),
    ("dflash2-without-its-weights", dict(draft="dflash2_lacking"), "lacks weights: candidate_selector.hidden_projection.weight"),
    ("dflash2-without-its-settings", dict(draft="dflash2_bare"), "lacks dflash_config.conv_kernel_size"),
    ("truncated-weights", dict(target="corrupt"), "not a valid safetensors"),
    ("garbage-weights", dict(target="garbage"), "not a valid safetensors"),
    ("float16", dict(dtype="float16"), "float16"),
    ("unknown-dtype", dict(dtype="int8"), "dtype"),
    ("block-size-too-large", dict(block_size=32), "block size"),
    ("block-size-zero", dict(block_size=0), "block size"),
    ("unknown-draft-mode", dict(draft_mode="magic"), "draft mode"),
    ("no-drafter-given", dict(draft=None), "this target needs draft, its DFlash drafter checkpoint (or no_draft for"),
    # (the drafter was silently ignored; the command line refuses --draft with --no-draft too)
    ("no-draft-with-a-drafter", dict(no_draft=True), "no_draft decodes with the target alone; drop draft (or no_draft)"),
    # (accepted silently before, while a block size or draft_max_batch_size without a drafter was refused)
    ("recompute-without-drafter", dict(draft=None, no_draft=True, draft_mode="recompute"),
     "draft_mode 'recompute' needs a drafter (target-only decoding drafts nothing); drop draft_mode (or no_draft)"),
]


def _load_kwargs(bad, spec):
    kw = dict(spec)
    target = bad[kw.pop("target", "target")]
    draft = kw.pop("draft", "drafter")
    return target, (bad[draft] if draft else None), kw


@pytest.mark.parametrize("name,spec,words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_bad_checkpoints_and_options_raise_one_line_errors(bad, name, spec, words):
    target, draft, kw = _load_kwargs(bad, spec)
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(target, draft, **kw)
    msg = str(err.value)
    assert "\n" not in msg and words in msg, msg


@pytest.mark.parametrize("name,value", [("no_draft", "false"), ("compile", "no"), ("pack", 0), ("static", "yes"),
                                        ("fuse", "no")])
def test_yes_no_load_options_must_be_bools(bad, name, value):
    """A string is not a yes/no option: no_draft="false" decoded with the target alone,
    fuse="no" joined the projections (every truthy value read as True)."""
    with pytest.raises(DFlashError, match=f"^{name} must be True or False, got {value!r}$"):
        DFlashEngine.from_pretrained(bad["target"], None if name == "no_draft" else bad["drafter"], **{name: value})


@pytest.mark.parametrize("name", ["target", "draft"])
def test_a_checkpoint_that_is_not_a_path_names_the_argument(bad, name):
    """from_pretrained(5) raised a TypeError from pathlib."""
    kw = dict(target=bad["target"], draft=bad["drafter"])
    kw[name] = 5
    with pytest.raises(DFlashError, match=f"^{name} must be a checkpoint directory or a Hugging Face id "
                                          "\\(a str or a path\\), got 5$"):
        DFlashEngine.from_pretrained(**kw)


def test_recompute_with_static_names_static(bad):
    """The refusal named compile, which the caller had not passed."""
    with pytest.raises(DFlashError, match="^draft_mode 'recompute' grows its shapes every round; it cannot run "
                                          "with static \\(fixed shapes\\)$"):
        DFlashEngine.from_pretrained(bad["target"], bad["drafter"], draft_mode="recompute", static=True)


GENERATE_CASES = [
    ("context-overflow", dict(max_new_tokens=2000), "exceeds the context"),
    ("negative-temperature", dict(temperature=-0.5), "temperature"),
    ("top-p-zero", dict(top_p=0.0), "top_p"),
    ("top-p-above-one", dict(top_p=1.5), "top_p"),
    ("negative-top-k", dict(top_k=-2), "top_k"),
    ("zero-max-new-tokens", dict(max_new_tokens=0), "max_new_tokens"),
    ("empty-prompt", dict(prompt=""), "empty"),
    ("empty-stop-string", dict(stop=[""]), "stop"),
]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return DFlashEngine.from_pretrained(*tiny_pair)


@pytest.mark.parametrize("name,kw,words", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_bad_requests_raise_one_line_errors(engine, name, kw, words):
    kw = dict(kw)
    prompt = kw.pop("prompt", "def f(x):")
    with pytest.raises(DFlashError) as err:
        engine.generate(prompt, **kw)
    msg = str(err.value)
    assert "\n" not in msg and words in msg, msg
    # the engine is still usable after a rejected request
    assert len(engine.generate("def f(x):", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_context_limit_is_exact(engine, tiny_pair):
    prompt = engine.encode_prompt("def f(x):")
    assert engine.max_context == 1024  # the target's max_position_embeddings
    small = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=len(prompt) + 8)
    assert len(small.generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids) == 8
    with pytest.raises(DFlashError, match="exceeds the context"):
        small.generate(prompt, max_new_tokens=9, ignore_eos=True)


def test_a_default_max_new_tokens_is_cut_to_the_context_a_given_one_is_refused(engine, tiny_pair, capsys):
    """A request that gives no max_new_tokens gets 256 cut to the context its prompt leaves
    (as the server cuts its default; it was refused: "prompt (30 tokens) + max_new_tokens
    (256) exceeds the context of 40 tokens"): generate, stream, generate_batch and the
    command line. A given value that does not fit stays refused; a min_tokens above the
    tokens left is named as such; 256 stands where it fits."""
    from dflash_torch.errors import OptionError

    small = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=40)
    ids = list(range(5, 35))  # 30 tokens: 10 left
    ref = small.generate(ids, max_new_tokens=10, ignore_eos=True)
    out = small.generate(ids, ignore_eos=True)
    assert (out.token_ids, out.finish_reason) == (ref.token_ids, "length") and len(ref.token_ids) == 10
    assert [t for c in small.stream(ids, ignore_eos=True) for t in c.token_ids] == ref.token_ids
    assert [r.token_ids for r in small.generate_batch([ids, ids[:25]], ignore_eos=True)] == [
        ref.token_ids, small.generate(ids[:25], max_new_tokens=15, ignore_eos=True).token_ids]
    assert [len(r.token_ids) for r in small.generate_batch([ids, ids[:25]], max_new_tokens=[None, 3],
                                                            ignore_eos=True)] == [10, 3]
    with pytest.raises(OptionError, match=r"^prompt \(30 tokens\) \+ max_new_tokens \(11\) exceeds the context of 40 "
                                          r"tokens; ask for at most 10 new tokens, or raise max_context \(up to 1024\)$"):
        small.generate(ids, max_new_tokens=11)  # (trial-209: how to make it fit was not said)
    with pytest.raises(OptionError, match=r"exceeds the context of 1024 tokens; ask for at most 1014 new tokens$"):
        engine.generate(ids[:10], max_new_tokens=1015)  # (the target's whole context: nothing to raise)
    with pytest.raises(OptionError, match=r"^prompt \(1 token\) \+ max_new_tokens \(40\) exceeds"):  # (trial-141)
        small.generate(ids[:1], max_new_tokens=40)
    with pytest.raises(OptionError, match=r"context of 40 tokens; ask for at most 1 new token, or raise"):  # (trial-255)
        small.generate((ids + ids)[:39], max_new_tokens=2)
    with pytest.raises(OptionError, match=r"^min_tokens \(11\) exceeds the 10 tokens left in the context of 40 tokens "
                                          r"after the prompt \(30 tokens\)$"):
        small.generate(ids, min_tokens=11)
    with pytest.raises(DFlashError, match=r"^prompt 1: min_tokens \(11\) exceeds the 10 tokens left"):
        small.generate_batch([ids[:20], ids], min_tokens=11)
    assert len(small.generate(ids, min_tokens=10).token_ids) == 10
    wide = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=300)
    assert len(wide.generate(ids, ignore_eos=True).token_ids) == 256  # (the default, where it fits)
    # the command line: no --max-new-tokens is the default, cut; a given one is refused
    target, drafter = tiny_pair
    text = "def f(x):\n    return x + 1\n" * 3
    n = len(engine.encode_prompt(text))
    argv = ["generate", text, "--target", str(target), "--draft", str(drafter), "--max-context", str(n + 5),
            "--ignore-eos", "--json"]
    assert cli_main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    assert cli_main(argv + ["--max-new-tokens", "6"]) == 2
    assert capsys.readouterr().err == (f"dflash-torch: error: prompt ({n} tokens) + --max-new-tokens (6) exceeds the "
                                       f"context of {n + 5} tokens; ask for at most 5 new tokens, or raise --max-context "
                                       "(up to 1024)\n")


def test_min_tokens_with_stop_token_ids_covering_the_vocabulary_is_refused_up_front(engine):
    """min_tokens holds back every stop token id until then: with stop_token_ids (and EOS)
    covering the whole vocabulary, no token is left. It was refused up front in none of
    generate, stream, generate_batch: greedy decoding gave EOS as the first token despite
    min_tokens, sampling raised torch's "probability tensor contains either inf, nan"."""
    every = list(range(engine.target.config.vocab_size))
    line = (r"^min_tokens \(2\) holds back every stop token id until then, and the stop token ids \(stop_token_ids "
            r"and EOS\) cover the whole vocabulary \(320 ids\): no token is left to generate; drop min_tokens or some "
            r"stop_token_ids$")
    for kw in (dict(), dict(temperature=1.0, seed=0), dict(ignore_eos=True)):
        with pytest.raises(OptionError, match=line):
            engine.generate("def f(x):", max_new_tokens=4, min_tokens=2, stop_token_ids=every, **kw)
        with pytest.raises(OptionError, match=line):
            next(engine.stream("def f(x):", max_new_tokens=4, min_tokens=2, stop_token_ids=every, **kw))
    with pytest.raises(DFlashError, match=line[1:]):
        engine.generate_batch(["def f(x):", "a"], max_new_tokens=4, min_tokens=2, stop_token_ids=every)
    left = every[:100] + every[101:]  # (one token left: min_tokens gives it)
    out = engine.generate("def f(x):", max_new_tokens=4, min_tokens=2, stop_token_ids=left)
    assert out.token_ids[:2] == [100, 100] and out.finish_reason == "stop", out
    assert engine.generate("def f(x):", max_new_tokens=4, stop_token_ids=every).token_ids  # (no min_tokens: a stop)


def test_a_min_tokens_above_the_default_names_what_applies(engine, tiny_pair, capsys):
    """A min_tokens above what applies with no max_new_tokens given names it: the default
    (known before the prompt: a generate_batch's shared min_tokens is no prompt's fault),
    else the tokens the prompt leaves in the context (it said "min_tokens (300) must be at
    most max_new_tokens (256)", a value the caller never gave): generate, stream,
    generate_batch and the command line. A given max_new_tokens keeps its message."""
    from dflash_torch.errors import OptionError

    ids = list(range(5, 35))  # 30 tokens
    left = r"^min_tokens \(20\) exceeds the 10 tokens left in the context of 40 tokens after the prompt \(30 tokens\)$"
    default = r"^min_tokens \(300\) exceeds the default max_new_tokens \(256\), which applies where none is given$"
    for context, least, words in ((40, 20, left), (40, 300, default), (400, 300, default)):
        e = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=context)
        for call in (lambda: e.generate(ids, min_tokens=least), lambda: list(e.stream(ids, min_tokens=least)),
                     lambda: e.generate_batch([ids], min_tokens=least),
                     lambda: e.generate_batch([ids, ids[:5]], min_tokens=least) if least > 256 else e.generate(
                         ids, min_tokens=least)):
            with pytest.raises(OptionError, match=words):
                call()
        with pytest.raises(OptionError, match=r"^min_tokens \(300\) must be at most max_new_tokens \(9\)$"):
            e.generate(ids, min_tokens=300, max_new_tokens=9)
    target, drafter = tiny_pair
    text = "def f(x):\n    return x + 1\n" * 3
    n = len(engine.encode_prompt(text))
    argv = ["generate", text, "--target", str(target), "--draft", str(drafter), "--min-tokens", "300"]
    assert cli_main(argv[:-1] + ["20", "--max-context", str(n + 5)]) == 2
    assert capsys.readouterr().err == (f"dflash-torch: error: --min-tokens (20) exceeds the 5 tokens left in the "
                                       f"context of {n + 5} tokens after the prompt ({n} tokens)\n")
    assert cli_main(argv + ["--max-context", "400"]) == 2
    assert capsys.readouterr().err == ("dflash-torch: error: --min-tokens (300) exceeds the default --max-new-tokens "
                                       "(256), which applies where none is given\n")


def test_default_max_new_tokens_is_checked_when_set_and_a_raw_tokenizer_is_refused(engine):
    """``engine.default_max_new_tokens`` may be set, to an integer >= 1 only (None or "64" was
    a TypeError at the next request, -3 a message about a max_new_tokens never given); a
    ``tokenizers.Tokenizer`` (tokenizer.json read by the tokenizers library, not transformers)
    is refused when the engine is built (it was an AttributeError at the first request). An integral
    float is refused as max_new_tokens refuses it (one rule: 3.0 was taken here, refused there;
    trial-310)."""
    e = DFlashEngine(engine.target, engine.tokenizer, engine.drafter)
    for bad in (None, "64", -3, 0, 2.5, True, 3.0, np.float64(3.0)):
        with pytest.raises(DFlashError, match=r"^default_max_new_tokens must be an integer >= 1, got "):
            e.default_max_new_tokens = bad
        if bad is not None:
            with pytest.raises(DFlashError, match=r"^max_new_tokens must be an integer >= 1, got "):
                e.generate([5, 6, 7], max_new_tokens=bad)
    e.default_max_new_tokens = np.int64(3)
    assert e.default_max_new_tokens == 3 and len(e.generate([5, 6, 7], ignore_eos=True).token_ids) == 3
    raw = engine.tokenizer.backend_tokenizer
    with pytest.raises(DFlashError, match=r"^tokenizer must be a transformers tokenizer .*got Tokenizer"):
        DFlashEngine(engine.target, raw, engine.drafter)


def test_the_constructor_refuses_a_mismatched_drafter_or_tokenizer_as_from_pretrained_does(
        engine, sentencepiece_pair, tmp_path):
    """``DFlashEngine(target, tokenizer, drafter)`` checks the pair as :meth:`from_pretrained`
    does (a drafter made for another target was accepted, and generate raised torch's
    "mat1 and mat2 shapes cannot be multiplied" deep in a round), and the tokenizer's size
    against the target's vocab_size (a tokenizer of another model decoded garbage). A
    target's vocab_size padded above the tokenizer's size, as real checkpoints pad it, is
    accepted."""
    other = DFlashEngine.from_pretrained(*sentencepiece_pair)  # (Llama, 700 tokens, hidden 64)
    with pytest.raises(DFlashError, match=r"^incompatible pair: drafter vocab_size 700 != target vocab_size 320$"):
        DFlashEngine(engine.target, engine.tokenizer, other.drafter)
    with pytest.raises(DFlashError, match=r"^the tokenizer has 700 tokens but the target's vocab_size is 320: its "
                                          r"tokens 320\.\.699 \('.*', '.*', '.*', \.\.\.\) have no row in the "
                                          r"target's embedding$"):
        DFlashEngine(engine.target, other.tokenizer)
    with pytest.raises(DFlashError, match=rf"^the tokenizer has {len(engine.tokenizer)} tokens, far fewer than the "
                                          r"target's vocab_size \(700\): not the target's tokenizer\?$"):
        DFlashEngine(other.target, engine.tokenizer)
    padded = make_target(tmp_path / "padded", vocab_size=len(engine.tokenizer) + 64)  # (as Qwen's 151936 > 151669)
    target = DFlashEngine.from_pretrained(padded, no_draft=True).target
    assert DFlashEngine(target, engine.tokenizer).generate([5, 6, 7], max_new_tokens=2, ignore_eos=True).token_ids


def test_a_tokenizer_with_an_added_pad_token_or_forwarding_len_is_refused_in_one_line(engine, tiny_pair, tmp_path):
    """A tokenizer of one token more than the target's vocab_size, a ``[PAD]`` added as
    Llama-2's and Mistral's recipes add one, is refused naming that token (the message gave the
    two sizes alone: nothing said the extra token was an added one), by the constructor and
    from a checkpoint directory; a wrapper that forwards attributes through ``__getattr__``
    (``len()`` does not: it was a TypeError traceback from len()) is refused as not a
    tokenizer."""
    from transformers import AutoTokenizer

    from dflash_torch.tokenizer import load_tokenizer

    target, _ = tiny_pair
    tok = AutoTokenizer.from_pretrained(target)
    assert len(tok) == engine.target.config.vocab_size == 320
    tok.add_special_tokens({"pad_token": "[PAD]"})
    words = ("^the tokenizer has 321 tokens but the target's vocab_size is 320: its added token 320 \\('\\[PAD\\]'\\) "
             "has no row in the target's embedding$")
    with pytest.raises(DFlashError, match=words):
        DFlashEngine(engine.target, tok)
    tok.save_pretrained(tmp_path)
    with pytest.raises(DFlashError, match=words):
        load_tokenizer(tmp_path, 320)

    class Forwarding:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

    with pytest.raises(DFlashError, match=r"^tokenizer must be a transformers tokenizer .*got Forwarding \(its class "
                                          r"has no __len__"):
        DFlashEngine(engine.target, Forwarding(engine.tokenizer))


def test_a_prompt_that_fills_the_context_is_named_not_max_new_tokens(engine, tiny_pair, capsys):
    """A prompt of max_context tokens or more leaves no room for a token, whatever
    max_new_tokens: the error names the prompt (it named max_new_tokens, which lowering
    cannot help): generate, generate_batch, the decoders and the command line."""
    from dflash_torch.errors import OptionError
    from dflash_torch.sampling import SamplingParams

    small = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=40)
    for ids in (list(range(5, 45)), list(range(5, 50))):
        line = (f"the prompt ({len(ids)} tokens) leaves no room for a new token in the context of 40 tokens; "
                "shorten it or raise max_context (up to 1024)")
        for call in (lambda: small.generate(ids, max_new_tokens=1), lambda: small.generate(ids),
                     lambda: small.generate_batch([ids], max_new_tokens=1),
                     lambda: list(small.decoder.rounds(ids, SamplingParams(), 1))):
            with pytest.raises(OptionError) as err:
                call()
            assert str(err.value) == line and err.value.name == "prompt", str(err.value)
    with pytest.raises(OptionError, match=r"^prompt 1: the prompt \(40 tokens\) leaves no room") as err:
        small.generate_batch([list(range(5, 15)), list(range(5, 45))])
    assert err.value.names == ("prompt", "max_context", "max_new_tokens")  # (a plain DFlashError lost them)
    target, drafter = tiny_pair
    text = "def f(x):\n    return x + 1\n" * 3
    n = len(engine.encode_prompt(text))
    for extra in ([], ["--max-new-tokens", "1"]):
        assert cli_main(["generate", text, "--target", str(target), "--draft", str(drafter), "--max-context", str(n),
                         *extra]) == 2
        assert capsys.readouterr().err == (f"dflash-torch: error: the prompt ({n} tokens) leaves no room for a new "
                                           f"token in the context of {n} tokens; shorten it or raise --max-context "
                                           "(up to 1024)\n")
    # at the target's own context (1024 tokens) raising max_context is no advice: it cannot go higher
    ids = [5 + i % 300 for i in range(1024)]
    for call in (lambda: engine.generate(ids, max_new_tokens=1), lambda: engine.generate_batch([ids])):
        with pytest.raises(OptionError) as err:
            call()
        assert str(err.value).endswith("the prompt (1024 tokens) leaves no room for a new token in the target's "
                                       "context of 1024 tokens; shorten it") and err.value.names == ("prompt",), err.value
    # below it, where max_new_tokens would not fit the target's context either, raising max_context needs fewer
    with pytest.raises(OptionError) as err:
        small.generate(list(range(5, 45)), max_new_tokens=990)
    assert str(err.value) == ("the prompt (40 tokens) leaves no room for a new token in the context of 40 tokens; "
                              "shorten it or raise max_context (up to 1024) with fewer max_new_tokens"), err.value
    # nor below it, for a prompt longer than the target's context
    with pytest.raises(OptionError) as err:
        small.generate(ids, max_new_tokens=1)
    assert str(err.value) == ("the prompt (1024 tokens) leaves no room for a new token in the context of 40 tokens; "
                              "shorten it (the target's context is 1024 tokens)") and err.value.names == ("prompt",)
    long = "x = 1; " * 400
    assert len(engine.encode_prompt(long)) >= 1024
    assert cli_main(["generate", long, "--target", str(target), "--draft", str(drafter)]) == 2
    assert re.fullmatch(r"dflash-torch: error: the prompt \(\d+ tokens\) leaves no room for a new token in the "
                        r"target's context of 1024 tokens; shorten it\n", capsys.readouterr().err)


def test_dflash2_drafter_loads_and_decodes(bad, capsys):
    """A DFlash 2 drafter (architectures DFlash2DraftModel) is loaded in full, not refused:
    through the API and the command line."""
    from dflash_torch.models.dflash2 import DFlash2Drafter

    engine = DFlashEngine.from_pretrained(bad["target"], bad["dflash2"])
    assert isinstance(engine.drafter, DFlash2Drafter)
    assert len(engine.generate("def f(x):", max_new_tokens=4).token_ids) >= 1
    rc = cli_main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--ignore-eos", "--target", str(bad["target"]),
                   "--draft", str(bad["dflash2"]), "--json"])
    out = capsys.readouterr()
    assert rc in (0, None) and "error" not in out.err
    assert len(json.loads(out.out)["token_ids"]) == 4


# --- the same errors through the command line ----------------------------------------------

def _cli_args(bad, spec):
    target, draft, kw = _load_kwargs(bad, spec)
    args = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--target", str(target)]
    args += ["--draft", str(draft)] if draft else []
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([str(v)] if v != "" else [])  # "" = a flag
    return args


# the command line names the flags the user typed (--block-size), Python the arguments (block size)
CLI_WORDS = {"block size": "--block-size must be an integer in [1, 16]",
             "this target needs draft, its DFlash drafter checkpoint (or no_draft for":
                 "this target needs --draft, its DFlash drafter checkpoint (or --no-draft for"}
CLI_CASES = [(n, _spec, CLI_WORDS.get(w, w)) for n, _spec, w in LOAD_CASES
             if n not in ("unknown-draft-mode", "unknown-dtype", "no-draft-with-a-drafter", "recompute-without-drafter")] + [
    ("context-overflow", dict(max_new_tokens=2000), "+ --max-new-tokens (2000) exceeds the context of 1024 tokens"),
    ("negative-temperature", dict(temperature=-0.5), "error: --temperature must be a finite number >= 0, got -0.5"),
    ("top-p-zero", dict(top_p=0.0), "error: --top-p must be in (0, 1], got 0.0"),
    ("top-p-above-one", dict(top_p=1.5), "error: --top-p must be in (0, 1], got 1.5"),
    ("negative-top-k", dict(top_k=-2), "error: --top-k must be an integer >= -1 (0 or -1 = off), got -2"),
    ("zero-max-new-tokens", dict(max_new_tokens=0), "error: --max-new-tokens must be an integer >= 1, got 0"),
    ("negative-max-new-tokens", dict(max_new_tokens=-3), "error: --max-new-tokens must be an integer >= 1, got -3"),
    ("seed-too-large", dict(seed=2**64, temperature=1.0), "error: --seed must be an integer in [-2**63, 2**64)"),
    ("block-size-without-drafter", dict(draft=None, no_draft="", block_size=4), "error: --block-size 4 needs a drafter"),
    ("recompute-without-drafter", dict(draft=None, no_draft="", draft_mode="recompute"),
     "error: --draft-mode 'recompute' needs a drafter (target-only decoding drafts nothing); drop --draft-mode (or --no-draft)"),
    ("empty-prompt", dict(prompt=""), "empty"),
    ("unknown-draft-mode", dict(draft_mode="magic"), "draft-mode"),
    ("not-a-number", dict(temperature="hot"), "temperature"),
    ("draft-and-no-draft", dict(no_draft=""), "--no-draft"),
]


@pytest.mark.parametrize("name,spec,words", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_prints_one_line_and_exits_nonzero(bad, capsys, name, spec, words):
    spec = dict(spec)
    prompt = spec.pop("prompt", None)
    args = _cli_args(bad, spec)
    if prompt is not None:
        args[args.index("--prompt") + 1] = prompt
    if "max_new_tokens" in spec:  # the later option wins in argparse
        args.remove("4")
        args.remove("--max-new-tokens")
    try:
        rc = cli_main(args)
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    captured = capsys.readouterr()
    assert rc not in (0, None)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-torch: error:"), captured.err
    assert words in lines[0] and "Traceback" not in captured.err
    assert captured.out == ""


def test_target_with_unused_or_misshaped_weights_is_refused(tmp_path):
    """Tensors the model would silently ignore (e.g. biases the config does not announce)
    or of the wrong shape are a clear error, never silently wrong logits."""
    import pytest
    import torch
    from safetensors.torch import load_file, save_file

    from conftest import make_target
    from dflash_torch.errors import DFlashError
    from dflash_torch.models.target import TargetModel

    target = make_target(tmp_path / "t", "qwen3", tokenizer=False)
    state = load_file(str(target / "model.safetensors"))
    extra = dict(state)
    extra["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(state["model.layers.0.self_attn.q_proj.weight"].shape[0])
    save_file(extra, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashError, match="does not use"):
        TargetModel.from_pretrained(target, torch.float32)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashError, match="shape"):
        TargetModel.from_pretrained(target, torch.float32)
    quantized = dict(state)  # integer weights without a quantization_config: a RuntimeError traceback
    quantized["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].to(torch.int8)
    save_file(quantized, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashError, match="q_proj.weight has dtype int8"):
        TargetModel.from_pretrained(target, torch.float32)
    # a corrupt checkpoint: logits of NaN, tokens of nothing; a float64 1e300 is finite as stored, but
    # overflows the float32 it runs in (it was "holds NaN or infinite values (a corrupt checkpoint)")
    for value, words in ((float("nan"), "target weight {} holds NaN or infinite"), (float("inf"), "target weight {} "
                         "holds NaN or infinite"), (1e300, "weight {} holds float64 values beyond the range of float32")):
        corrupt = dict(state)
        corrupt["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"].to(
            torch.float64 if value == 1e300 else torch.float32)
        corrupt["model.layers.1.mlp.down_proj.weight"][5, 7] = value
        save_file(corrupt, str(target / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(DFlashError, match=words.format("model.layers.1.mlp.down_proj.weight")):
            TargetModel.from_pretrained(target, torch.float32)


@pytest.mark.parametrize("prompt", ["12", [1.7, 2], [True, 3], ["5"]], ids=["str", "float", "bool", "str-id"])
def test_step_level_apis_refuse_prompt_ids_that_are_not_integers(engine, prompt):
    """BatchDecoder.add and SpeculativeDecoder.rounds took "12" as the ids 1 and 2 and 1.7
    as 1 (int() of each), or failed with a ValueError."""
    from dflash_torch.sampling import SamplingParams

    batch = engine.batch_decoder()
    with pytest.raises(DFlashError, match="^prompt token ids must be (a list of )?integers, got "):
        batch.add("s", prompt, SamplingParams(), 2)
    assert "s" not in batch and batch.free_slots == engine.max_batch_size
    with pytest.raises(DFlashError, match="^prompt token ids must be (a list of )?integers, got "):
        next(engine.decoder.rounds(prompt, SamplingParams(), 2))


def test_a_weight_in_two_files_is_refused(tiny_pair, tmp_path, capsys):
    """Two safetensors files holding the same weight (a second copy left beside the
    first, or two shards of an index): the file read last silently won."""
    target, drafter = tiny_pair
    copy = shutil.copytree(drafter, tmp_path / "drafter")
    (copy / "model.safetensors").rename(copy / "a.safetensors")
    shutil.copy(copy / "a.safetensors", copy / "b.safetensors")
    with pytest.raises(DFlashError, match=r"weight \S+ is in both a\.safetensors and b\.safetensors"):
        DFlashEngine.from_pretrained(target, copy)
    assert cli_main(["generate", "hi", "--target", str(target), "--draft", str(copy), "--max-new-tokens", "2"]) == 2
    assert "is in both a.safetensors and b.safetensors" in capsys.readouterr().err


def test_a_target_given_as_the_drafter_names_every_drafter_format(tiny_pair):
    """A target checkpoint given as the drafter: one line naming the drafter formats read,
    the Speculators format among them (it was left out of the list)."""
    with pytest.raises(DFlashError, match=r"^draft: \S+: the drafter checkpoint is not a DFlash drafter \(architectures="
                                          r".*, or a Speculators-format config \(speculators_model_type \"dflash\"\)$"):
        DFlashEngine.from_pretrained(tiny_pair[0], tiny_pair[0])


@pytest.mark.parametrize("archs", [["DFlash3DraftModel"], ["Qwen3DFlashDraftModel", "Qwen3ForCausalLM"],
                                   ["DFlash2DraftModel", "DFlash3DraftModel"]])
def test_a_dflash_architecture_not_known_is_refused(tiny_pair, tmp_path, archs):
    """A drafter whose architectures name a DFlash class dflash-torch does not read (a later
    format, another project's variant) was run as DFlash v1 because it has a dflash_config, or
    as the known class it is listed beside."""
    drafter = shutil.copytree(tiny_pair[1], tmp_path / "d")
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["dflash_config"]  # (what made it read as DFlash v1)
    cfg["architectures"] = archs
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"^the drafter checkpoint is a DFlash model dflash-torch does not know "
                                          + re.escape(f"(architectures={archs}); it reads ['DFlashDraftModel', ")):
        DFlashEngine.from_pretrained(tiny_pair[0], drafter)


def test_drafter_with_integer_weights_is_refused(tiny_pair, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_torch.models.drafter import DFlashDrafter

    drafter = tmp_path / "d"
    shutil.copytree(tiny_pair[1], drafter)
    state = load_file(str(drafter / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"].to(torch.int8)
    save_file(state, str(drafter / "model.safetensors"))
    with pytest.raises(DFlashError, match=r"drafter weight fc.weight has dtype int8; dflash-torch reads floating-point weights only \(float32 / bfloat16 / float16 / float64;") as err:
        DFlashDrafter.from_pretrained(drafter, torch.float32)
    assert "\n" not in str(err.value)


# --- options several commands share: one validation, the same refusal everywhere -----------

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # (this process may use)
ALL_COMMANDS = ("generate", "serve", "bench", "train")
MODEL_COMMANDS = ("generate", "serve", "bench")  # the ones that take the model options
BAD_OPTIONS = [
    # (option, value, commands that take it, pattern the one line must contain)
    ("--threads", "-1", ALL_COMMANDS, "--threads must be"),
    ("--threads", "0", ALL_COMMANDS, "--threads must be"),
    # (more threads than CPUs only contend for them)
    ("--threads", str(CPUS + 1), ALL_COMMANDS,
     rf"--threads must be an integer from 1 to the CPUs this process may use \({CPUS}\), got {CPUS + 1}$"),
    ("--block-size", "0", ALL_COMMANDS, "--block-size"),
    ("--block-size", "-2", ALL_COMMANDS, "--block-size"),
    ("--block-size", "99", MODEL_COMMANDS, "--block-size must be"),  # above the drafter's 16 (train: a new drafter's B)
    ("--max-context", "0", MODEL_COMMANDS, "--max-context"),
    ("--max-context", "1", MODEL_COMMANDS, "--max-context"),  # no room for a prompt token and a generated one
    ("--max-context", "100000", MODEL_COMMANDS, "--max-context"),
    ("--prefill-chunk", "0", ("generate", "serve"), "--prefill-chunk must be an integer >= 1, got 0$"),
    ("--prefill-chunk", "8", ("bench",), "bench times every mode at the default prefill chunk \\(256\\); drop --prefill-chunk$"),
    ("--dtype", "int8", MODEL_COMMANDS, "unsupported --dtype .int8."),
    ("--dtype", "float16", MODEL_COMMANDS, "--dtype float16 is not supported"),
    ("--device", "tpu", MODEL_COMMANDS, "--device .tpu."),
    ("--device", "cuda:99", MODEL_COMMANDS, "--device .cuda:99."),
    # (torch ignored a CPU index: cpu:99 ran; trial-319 c)
    ("--device", "cpu:1", MODEL_COMMANDS, "--device .cpu:1.: torch runs all the CPUs as one device; use cpu"),
    ("--api-key", " ", ("serve",), "api-key"),
    ("--api-key", "sk with spaces", ("serve",), "api-key"),
    ("--draft-max-batch-size", "0", ("serve", "bench"), "--draft-max-batch-size must be an integer >= 1 or 'auto'"),
    ("--prefix-slots", "-1", ("serve",), "--prefix-slots must be an integer >= 0, got -1$"),
    ("--drain-timeout", "-1", ("serve",), r"--drain-timeout must be a number of seconds >= 0 \(0: no drain\), got -1$"),
    ("--drain-timeout", "nan", ("serve",), "--drain-timeout must be a number of seconds >= 0 .*, got nan$"),
    ("--drain-timeout", "inf", ("serve",), "--drain-timeout must be a number of seconds >= 0 .*, got inf$"),
    ("--body-timeout", "-1", ("serve",), r"--body-timeout must be a number of seconds >= 0 \(0: no limit\), got -1$"),
    ("--body-timeout", "nan", ("serve",), "--body-timeout must be a number of seconds >= 0 .*, got nan$"),
    # (an empty name served the directory's name, a blank one served "  ")
    ("--model-name", "", ("serve",), "--model-name must not be empty"),
    ("--model-name", "  ", ("serve",), "--model-name must not be empty"),
]
OPTION_CASES = [(cmd, opt, value, words) for opt, value, cmds, words in BAD_OPTIONS for cmd in cmds]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command_line(command: str, tiny_pair, tmp_path: Path) -> list[str]:
    """A command line of ``command`` that would run (and finish quickly) on the tiny pair."""
    target, drafter = tiny_pair
    pair = ["--target", str(target), "--draft", str(drafter)]
    if command == "generate":
        return ["generate", "--prompt", "def f(x):", "--max-new-tokens", "2", *pair]
    if command == "serve":
        return ["serve", "--port", str(_free_port()), *pair]
    if command == "bench":
        return ["bench", *pair, "--num-prompts", "1", "--max-new-tokens", "2", "--modes", "target-only", "--sweep", "",
                "--out", str(tmp_path / "bench"), "--no-progress"]
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 50)
    return ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "drafter"), "--steps", "1",
            "--no-progress"]


@pytest.mark.parametrize("command,option,value,words", OPTION_CASES,
                         ids=[f"{c}{o}={v.strip() or 'blank'}" for c, o, v, _ in OPTION_CASES])
def test_shared_options_are_refused_alike_by_every_command(tiny_pair, tmp_path, capsys, command, option, value, words):
    import re

    args = _command_line(command, tiny_pair, tmp_path) + [option, value]
    rc = cli_main(args)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("dflash-torch: error:"), captured.err
    assert re.search(words, lines[0]) and "Traceback" not in captured.err, lines[0]
    target, drafter = (str(p) for p in tiny_pair)  # (serve says what it loads before the pair checks its options)
    loading = f"dflash-torch: loading {target!r} + drafter {drafter!r} ...\n"
    # (those that need no model, before it: it said it loaded for a --device it then refused; trial-319 e)
    before = option in ("--threads", "--dtype", "--device")
    assert captured.out in (("", loading) if command == "serve" and not before else ("",)), captured.out


@pytest.mark.parametrize("kw,words", [
    (dict(dtype=None), "dtype"), (dict(dtype=5), "dtype"), (dict(device=None), "device"), (dict(device="tpu"), "device"),
    (dict(max_context=1), "max_context"), (dict(max_context=2.5), "max_context"), (dict(block_size=True), "block size"),
    (dict(block_size="4"), "block size"),
], ids=lambda x: str(x))
def test_python_api_refuses_the_same_values(tiny_pair, kw, words):
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(*tiny_pair, **kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_numpy_integers_are_taken_by_every_integer_option(tiny_pair):
    """NumPy integers are the same numbers (as README says, wherever numbers are taken): every
    integer option of from_pretrained takes them (block size, context, batch sizes were
    refused: "must be an integer ..., got np.int64(4)") and holds them as Python ints."""
    import numpy as np

    engine = DFlashEngine.from_pretrained(*tiny_pair, block_size=np.int64(4), max_context=np.int32(128),
                                          max_batch_size=np.int64(2), draft_max_batch_size=np.int64(1),
                                          prefix_slots=np.int64(1), prefill_chunk=np.int16(8), shared_starts=np.int64(3))
    batch = engine.batch_decoder()
    values = (engine.block_size, engine.max_context, engine.max_batch_size, engine.draft_max_batch_size,
              batch.block_size, batch.max_context, batch.max_batch_size, batch.draft_max_batch_size, batch.prefix_slots,
              batch.prefill_chunk, engine.shared_starts)
    assert values == (4, 128, 2, 1, 4, 128, 2, 1, 1, 8, 3) and {type(v) for v in values} == {int}


def test_decode_takes_token_ids_only(tiny_pair):
    """engine.decode (README's logprobs example uses it) refuses what is not a sequence of
    integer ids in one line (it raised bare TypeErrors, and decoded True as id 1), and takes
    NumPy arrays and torch tensors of ids as their lists."""
    import numpy as np

    engine = DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)
    for bad in ("abc", 5, [1.5], [None], [True], None):
        with pytest.raises(DFlashError, match="^token_ids must be a list of integer token ids, got "):
            engine.decode(bad)
    text = engine.decode([5, 6, 7])
    assert text and engine.decode(np.array([5, 6, 7])) == engine.decode(torch.tensor([5, 6, 7])) == \
        engine.decode((np.int64(5), 6, 7)) == text


@pytest.mark.parametrize("layer_types, layers, words", [
    (["full_attention"] * 4, 3, r"^target: transformers refuses .*config\.json \(AutoTokenizer reads it to load the "
                                r"tokenizer\): .*num_hidden_layers.* must be equal to the number of .*layer_types"),
    # (a value transformers' class cannot iterate: "cannot load the tokenizer ...: 'int' object is not iterable")
    (0, 4, r"^target config\.json layer_types must be a list of layer type names, got 0$"),
], ids=["too-many", "not-a-list"])
def test_a_config_transformers_refuses_as_a_whole_is_named_not_the_tokenizer(tmp_path, layer_types, layers, words):
    """A config.json whose fields transformers' config class refuses together (more
    layer_types than num_hidden_layers) fails where AutoTokenizer reads it: one line naming
    config.json and transformers' reason (it blamed the tokenizer: "cannot load the tokenizer").
    (A Llama target: dflash-torch's parser reads no layer_types of it; a Qwen3 one's it refuses itself.)"""
    from conftest import make_target

    target = make_target(tmp_path / "t", "llama")
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(layer_types=layer_types, num_hidden_layers=layers)
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=words) as err:
        DFlashEngine.from_pretrained(target, no_draft=True)
    assert "\n" not in str(err.value)


def test_threads_are_validated_in_python_too():
    from dflash_torch import compute

    for bad in (0, -1, 1.5, True, "2", os.cpu_count() + 1):
        with pytest.raises(DFlashError, match="^threads must be"):
            compute.set_num_threads(bad)


@pytest.fixture(scope="module")
def threads_past_the_affinity(tmp_path_factory) -> dict:
    """``generate x --threads 2`` and ``train ... --threads 2`` in turn in one real process
    that may use one CPU (its affinity, set before it starts: torch reads it when imported;
    one start, ~4 s CPU, for both): ``{"threads": torch's default thread count there, command:
    (status, stderr)}``."""
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("threads")
    cpu = min(os.sched_getaffinity(0))
    argvs = {"generate": ["generate", "x"],
             "train": ["train", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d"), "--out",
                       str(tmp_path / "o")]}
    code = ("import json, sys, torch\n"
            "from dflash_torch.cli import main\n"
            "print(torch.get_num_threads(), flush=True)\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    print('--', file=sys.stderr, flush=True)\n"
            "    print(main(args + ['--threads', '2']), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(argvs.values()))], capture_output=True,
                          text=True, timeout=240, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    threads, *statuses = proc.stdout.split()
    errs = proc.stderr.split("--\n")[1:]
    assert len(statuses) == len(errs) == len(argvs), (proc.stdout, proc.stderr)
    return {"threads": int(threads), **{command: (int(status), err)
                                        for command, status, err in zip(argvs, statuses, errs)}}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or CPUS < 2, reason="needs CPU affinity (Linux) and 2 CPUs")
@pytest.mark.parametrize("command", ["generate", "train"])
def test_threads_are_at_most_the_cpus_this_process_may_use(threads_past_the_affinity, command):
    """``taskset -c N dflash-torch generate x --threads 2``: more threads than the CPUs the
    process may use (its affinity: taskset, a container's cpuset) is refused in one line
    naming that count (it was taken: the check counted the machine's CPUs, os.cpu_count()),
    before anything loads. torch's own default thread count is the affinity's (1 here).
    (A real process, shared by both commands: :func:`threads_past_the_affinity`.)"""
    status, stderr = threads_past_the_affinity[command]
    assert status == 2 and threads_past_the_affinity["threads"] == 1, stderr
    assert stderr == "dflash-torch: error: --threads must be an integer from 1 to the CPUs this process may use " \
                     "(1), got 2\n", stderr


def test_stop_token_ids_take_one_id_or_a_list(engine):
    ref = engine.generate("def f(x):", max_new_tokens=12, ignore_eos=True)
    stop = ref.token_ids[5]
    first = ref.token_ids.index(stop)
    # (a range, a 1-D array or tensor: as a prompt's ids; trial-208 refused a range, a tuple was taken)
    for value in (stop, [stop], (stop,), range(stop, stop + 1), np.array([stop]), torch.tensor([stop])):
        out = engine.generate("def f(x):", max_new_tokens=12, ignore_eos=True, stop_token_ids=value)
        assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop"
    vocab = engine.target.config.vocab_size
    out = engine.generate("def f(x):", max_new_tokens=3, stop_token_ids=range(vocab))
    assert out.token_ids == ref.token_ids[:1] and out.finish_reason == "stop"
    outs = engine.generate_batch(["def f(x):", "a"], max_new_tokens=3, stop_token_ids=range(vocab))
    assert [len(o.token_ids) for o in outs] == [1, 1]
    stopper = engine.new_stopper(3, stop_token_ids=np.arange(vocab))  # (unconverted by generate's own plain())
    assert stopper.stop_ids == set(range(vocab))
    with pytest.raises(OptionError, match=r"^min_tokens \(2\) holds back every stop token id"):
        engine.generate("def f(x):", max_new_tokens=4, min_tokens=2, stop_token_ids=range(vocab))
    for bad in ("5", [1.5], [True], [-1], [vocab], {"a": 1}):
        with pytest.raises(DFlashError, match="stop token ids") as err:
            engine.generate("def f(x):", max_new_tokens=3, stop_token_ids=bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_warmup_fits_any_context_the_user_chose(engine, static):
    for max_context in (2, 5, 8, 9, 40):
        small = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=max_context, static=static)
        assert small.warmup() > 0
    with pytest.raises(DFlashError, match="max_context"):
        DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_context=1)


def test_api_key_is_validated_and_stripped(engine):
    from dflash_torch.serving import create_app

    for bad in ("", "  \n", "sk with space", "sk-\u00e9t\u00e9", 42):
        with pytest.raises(DFlashError, match="api_key"):
            create_app(engine, api_key=bad)


@pytest.mark.parametrize("bad", ["", " ", 5])
def test_model_name_must_be_a_non_blank_string(engine, bad):
    from dflash_torch.serving import create_app

    with pytest.raises(DFlashError, match="^model_name must (not be empty|be a string, got int)$"):
        create_app(engine, model_name=bad)


def test_quantized_drafter_is_refused_like_a_quantized_target(tiny_pair, tmp_path):
    """A drafter whose config.json has a quantization_config is refused in one line (it
    loaded its weights as if they were unquantized)."""
    drafter = tmp_path / "d"
    shutil.copytree(tiny_pair[1], drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="the drafter checkpoint is quantized \\(quant_method 'awq'\\)") as err:
        DFlashEngine.from_pretrained(tiny_pair[0], drafter)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("what", ["target", "drafter"])
@pytest.mark.parametrize("quant,message", [
    ({"bits": 4, "group_size": 128}, "config.json quantization_config has no quant_method (which names how the weights "
                                     "are quantized, e.g. 'fp8'); dflash-torch reads unquantized"),
    ("fp8", "config.json quantization_config must be an object naming its quant_method, got a string 'fp8'; "
            "dflash-torch reads unquantized"),
])
def test_a_quantization_config_without_a_quant_method_is_refused_as_such(tiny_pair, tmp_path, what, quant, message):
    """A quantization_config with no quant_method, or one that is not an object, is refused
    saying so (it read "quantized (quant_method 'unknown')", a method no config names)."""
    from conftest import edited_checkpoint

    pair = list(tiny_pair)
    i = 0 if what == "target" else 1
    pair[i] = edited_checkpoint(pair[i], tmp_path / what, config=lambda cfg: cfg.update(quantization_config=quant))
    with pytest.raises(DFlashError, match=f"^{what} {re.escape(message)}") as err:
        DFlashEngine.from_pretrained(*pair)
    assert "\n" not in str(err.value) and "unknown" not in str(err.value)


def test_a_drafter_with_fp8_weights_is_told_drafters_are_read_unquantized(tiny_pair, tmp_path):
    """A drafter's float8 weights without a quantization_config: the message said the config
    lacked an FP8 quantization_config, and adding one got it refused as quantized; drafters
    are read unquantized only, which it now says."""
    from conftest import edited_checkpoint

    drafter = edited_checkpoint(tiny_pair[1], tmp_path / "d", state=lambda w: w.update(
        {k: v.to(torch.float8_e4m3fn) for k, v in w.items() if k.endswith("_proj.weight")}))
    with pytest.raises(DFlashError, match=r"^\S+: weight \S+_proj\.weight is float8_e4m3fn; dflash-torch reads drafters "
                                          r"unquantized only \(float32/bfloat16/float16 weights\): a drafter must be "
                                          r"trained or exported unquantized") as err:
        DFlashEngine.from_pretrained(tiny_pair[0], drafter)
    assert "\n" not in str(err.value) and "quant_method 'fp8'" not in str(err.value)


@pytest.mark.parametrize("what", ["target", "drafter"])
def test_a_gptq_style_checkpoint_is_named_as_one(tiny_pair, tmp_path, what):
    """AutoGPTQ's layout (X.qweight / X.scales / X.qzeros, a quantize_config.json, no
    quantization_config in config.json) was refused as lacking X.weight, with no hint."""
    from conftest import edited_checkpoint

    def gptq(w):
        for key in [k for k in w if k.endswith("_proj.weight")]:
            out, cols = w.pop(key).shape
            base = key.removesuffix("weight")
            w.update({base + "qweight": torch.zeros(cols // 8, out, dtype=torch.int32),
                      base + "scales": torch.ones(1, out, dtype=torch.float16),
                      base + "qzeros": torch.zeros(1, out // 8, dtype=torch.int32)})

    pair = list(tiny_pair)
    i = 0 if what == "target" else 1
    pair[i] = edited_checkpoint(pair[i], tmp_path / what, state=gptq)
    (pair[i] / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": -1, "sym": True}))
    with pytest.raises(DFlashError, match=rf"^\S+: \S+_proj\.qweight is a GPTQ-style packed weight \(qweight / scales / "
                                          rf"qzeros, with a quantize_config\.json\), a format dflash-torch does not "
                                          rf"read: use an unquantized {what} checkpoint") as err:
        DFlashEngine.from_pretrained(*pair)
    assert "\n" not in str(err.value) and "lacks weights" not in str(err.value)


def test_a_bad_prompt_of_a_batch_is_named_and_nothing_is_decoded(engine):
    """generate_batch checks every prompt before decoding any: a bad one, even past the
    slots (index 8 of 9, 8 slots), is refused in a message that starts with its index,
    and the target ran no forward for the others. One prompt alone: no index."""
    assert engine.max_batch_size == 8
    good = engine.encode_prompt("def f(x):")
    vocab = engine.target.config.vocab_size
    forwards = []
    hook = engine.target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for bad, kw, message in [
            ("", {}, "prompt 8: the prompt is empty (0 tokens)"),
            ([5, vocab], {}, f"prompt 8: prompt token ids must be in [0, {vocab})"),
            ([5] * 1000, dict(max_new_tokens=30),
             "prompt 8 (1000 tokens) + max_new_tokens (30) exceeds the context of 1024 tokens"),
            (good, dict(temperature=[0.0] * 8 + [-1.0]), "prompt 8: temperature must be"),
        ]:
            with pytest.raises(DFlashError) as err:
                engine.generate_batch([good] * 8 + [bad], **{"max_new_tokens": 4, **kw})
            assert str(err.value).startswith(message), str(err.value)
            with pytest.raises(DFlashError) as err:
                engine.generate_batch([bad], **{"max_new_tokens": 4, **{k: v[-1:] if isinstance(v, list) else v
                                                                         for k, v in kw.items()}})
            assert str(err.value).startswith(message.replace("prompt 8: ", "").replace("prompt 8 (", "prompt (")), \
                str(err.value)
        assert forwards == []  # nothing was decoded for the good prompts
    finally:
        hook.remove()
    assert [r.token_ids for r in engine.generate_batch([good, good], max_new_tokens=3, ignore_eos=True)] == \
        [engine.generate(good, max_new_tokens=3, ignore_eos=True).token_ids] * 2


CLI_FLAG_CASES = [
    (["--max-new-tokens", "-3"], dict(max_new_tokens=-3), "--max-new-tokens must be an integer >= 1, got -3"),
    (["--temperature", "-1"], dict(temperature=-1.0), "--temperature must be a finite number >= 0, got -1.0"),
    # (argparse took -1e-3 for a flag: "argument --temperature: expected one argument", trial-293 f)
    (["--temperature", "-1e-3"], dict(temperature=-1e-3), "--temperature must be a finite number >= 0, got -0.001"),
    (["--top-p", "2"], dict(top_p=2.0), "--top-p must be in (0, 1], got 2.0"),
    (["--top-k", "-2"], dict(top_k=-2), "--top-k must be an integer >= -1 (0 or -1 = off), got -2"),
    (["--stop="], dict(stop=[""]), "--stop strings must not be empty"),
    (["--presence-penalty", "3"], dict(presence_penalty=3.0), "--presence-penalty must be a number in [-2, 2], got 3.0"),
    (["--frequency-penalty", "-2.5"], dict(frequency_penalty=-2.5),
     "--frequency-penalty must be a number in [-2, 2], got -2.5"),
    (["--repetition-penalty", "0"], dict(repetition_penalty=0.0),
     "--repetition-penalty must be a finite number > 0 (1 = off), got 0.0"),
    (["--logprobs", "21", "--json"], dict(logprobs=21), "--logprobs must be an integer in [0, 20], got 21"),
    (["--max-new-tokens", "1100"], dict(max_new_tokens=1100),
     "prompt (7 tokens) + --max-new-tokens (1100) exceeds the context of 1024 tokens; ask for at most 1017 new tokens"),
]


@pytest.mark.parametrize("argv,kwargs,line", CLI_FLAG_CASES, ids=[" ".join(c[0]) for c in CLI_FLAG_CASES])
def test_cli_errors_name_the_flag_the_python_api_its_argument(tiny_pair, engine, capsys, argv, kwargs, line):
    """The command line says --max-new-tokens where the Python API says max_new_tokens."""
    target, drafter = tiny_pair
    rc = cli_main(["generate", "def f(x):", "--target", str(target), "--draft", str(drafter), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"dflash-torch: error: {line}\n", err
    flag = argv[0].split("=")[0]
    with pytest.raises(DFlashError) as exc:
        engine.generate("def f(x):", **kwargs)
    assert str(exc.value) == line.replace(flag, flag.removeprefix("--").replace("-", "_")), str(exc.value)


def _set(path: str, value):
    """An edit of a config dict: ``path`` ``"a.b"`` sets ``cfg["a"]["b"] = value``."""
    def edit(cfg):
        *parents, key = path.split(".")
        for p in parents:
            cfg = cfg[p]
        cfg[key] = value
    return edit


# (which checkpoint, its config.json edit or raw bytes, words of the one-line error)
def _map_embedding(shard):
    """An edit of a shard index: the embedding's entry mapped to ``shard``."""
    return lambda index: index["weight_map"].__setitem__("model.embed_tokens.weight", shard)


MALFORMED_CONFIGS = [
    ("target", _set("model_type", ["qwen3"]), "unsupported target model_type ['qwen3']"),
    ("target", _set("vocab_size", "320"), "target config.json vocab_size must be an integer >= 1, got '320'"),
    ("target", _set("num_attention_heads", 0), "num_attention_heads must be an integer >= 1, got 0"),
    ("target", _set("head_dim", 2.5), "head_dim must be an integer >= 1, got 2.5"),
    # a required field that is null was taken as present (a TypeError traceback in the model's build)
    ("target", _set("num_attention_heads", None), "target config.json lacks num_attention_heads"),
    ("drafter", _set("intermediate_size", None), "drafter config.json lacks intermediate_size"),
    # qwen2 / qwen3 / qwen3_moe read num_hidden_layers before checking it (KeyError / TypeError tracebacks)
    ("target", lambda c: c.pop("num_hidden_layers"), "target config.json lacks num_hidden_layers"),
    ("target", _set("num_hidden_layers", "4"), "target config.json num_hidden_layers must be an integer >= 1, got '4'"),
    # per-layer tables of 10**12 entries were built before the weights were looked at (MemoryError, or killed)
    *[(which, lambda c: (c.pop("layer_types", None), c.update(num_hidden_layers=10**12)),
       "config.json num_hidden_layers 1000000000000 is more than the checkpoint's ") for which in ("target", "drafter")],
    ("target", _set("rms_norm_eps", "1e-6"), "rms_norm_eps must be a number > 0, got '1e-6'"),
    ("target", _set("rope_parameters", [10000]), "rope_parameters must be an object, got [10000]"),
    ("target", b'{"model_type": "qwen3\xff"}', "config.json is not valid JSON"),
    ("target", b"[1, 2]", "config.json must hold a JSON object, not a list"),
    ("drafter", _set("dflash_config.target_layer_ids", ["a", 2]), "target_layer_ids must be a non-empty list of integers"),
    ("drafter", _set("dflash_config.target_layer_ids", []), "target_layer_ids must be a non-empty list of integers"),
    # no target_layer_ids over a target of under 4 layers: the reference rule gave negative ids (helper-1)
    ("drafter", lambda c: (c["dflash_config"].pop("target_layer_ids"), c.update(num_target_layers=2)),
     "drafter config.json has no dflash_config.target_layer_ids, and the reference rule gives [1, -1] for 2 drafter "
     "layers over a target of 2 layers; set dflash_config.target_layer_ids"),
    ("drafter", _set("block_size", "sixteen"), "drafter config.json block_size must be an integer >= 2, got 'sixteen'"),
    # (buffers of 10**12 rows: "RuntimeError: ... you tried to allocate 8000000000000 bytes")
    ("drafter", _set("block_size", 10**12), "the drafter's trained block size, its config.json block_size "
     "1000000000000, is longer than the target's context of 1024 tokens"),
    # no mask_token_id: its mask token is looked up in the target's tokenizer, as SGLang does (test_greedy)
    ("drafter", lambda c: c["dflash_config"].update(mask_token_id=None, mask_token="<|NOPE|>"),
     "drafter config.json has no dflash_config.mask_token_id, and its mask token '<|NOPE|>' would be id 320 (the id "
     "it gets added after the tokenizer's 320 tokens, as SGLang adds it), outside the target's 320 embedding rows"),
    ("drafter", _set("architectures", 5), "drafter config.json architectures must be a list of class names, got 5"),
    ("target", _set("architectures", [5]), "target config.json architectures must be a list of class names, got [5]"),
    ("drafter", lambda c: c["dflash_config"].update(mask_token_id=None, mask_token=7),
     "drafter config.json dflash_config.mask_token must be a non-empty string, got 7"),
    ("drafter", _set("dflash_config.mask_token_id", 1.5), "mask_token_id must be an integer >= 0, got 1.5"),
    ("drafter", _set("dflash_config", [1]), "dflash_config must be an object, got [1]"),
    # drafter variants that change its computation: refused by their key, not run wrongly
    ("drafter", _set("dflash_config.sample_from_anchor", True), "drafter config.json has sample_from_anchor true (the "
     "anchor slot predicts too, a DSpark-style block); dflash-torch runs DFlash blocks whose anchor is the last committed token"),
    ("drafter", _set("sample_from_anchor", True), "drafter config.json has sample_from_anchor true"),
    ("drafter", _set("dflash_config.shift_label", True), "DFlash drafter config sets shift_label=True; only "
     "shift_label=False is supported"),
    ("drafter", _set("projector_type", "domino"), "DFlash drafter config sets projector_type='domino'; only "
     "projector_type='dflash' (or unset) is supported"),
    ("drafter", _set("dflash_config.attention_sink_bias", True), "drafter config.json sets "
     "dflash_config.attention_sink_bias true (a learned attention-sink logit per head, MiMo-style); dflash-torch's "
     "DFlash drafter has no attention sinks"),
    ("drafter", _set("add_swa_attention_sink_bias", True), "drafter config.json sets add_swa_attention_sink_bias true"),
    ("drafter", _set("dflash_config.use_swa", "yes"), "drafter config.json dflash_config.use_swa must be true or false, "
     "got 'yes'"),
    ("drafter", _set("dflash_config.use_swa", True), "drafter dflash_config.use_swa is true but neither "
     "dflash_config.swa_window_size nor sliding_window is set"),
    ("drafter", _set("dflash_config.swa_window_size", 0), "drafter config.json dflash_config.swa_window_size must be "
     "an integer >= 1, got 0"),
    ("drafter", lambda c: (c.update(sliding_window=8), c["dflash_config"].update(use_swa=True, swa_window_size=4)),
     "drafter config.json has two sliding windows: sliding_window 8 and dflash_config.swa_window_size 4; make them equal"),
    ("drafter", _set("dflash_config.use_qk_norm", "no"), "drafter config.json dflash_config.use_qk_norm must be true "
     "or false, got 'no'"),
    ("drafter", _set("rms_norm_eps", "x"), "drafter config.json rms_norm_eps must be a number > 0"),
    ("drafter", _set("sliding_window", "x"), "drafter config.json sliding_window must be an integer >= 1, got 'x'"),
    # ("incompatible pair: drafter vocab_size 320 != target vocab_size 320")
    ("drafter", _set("vocab_size", "320"), "drafter config.json vocab_size must be an integer >= 1, got '320'"),
    ("target", _set("eos_token_id", ["0"]), "target config.json eos_token_id must be a token id or a list of them"),
    # (a corrupt field: where transformers' tokenizer loader reads config.json it failed as "cannot load the
    # tokenizer ... module 'torch' has no attribute 'bogus'", elsewhere it passed unnoticed)
    ("target", _set("torch_dtype", "bogus"), "target config.json torch_dtype 'bogus' is not a torch dtype"),
    # an MLP activation other than SiLU decoded silently as SiLU (unlike transformers)
    ("target", _set("hidden_act", "gelu"), "target config.json hidden_act 'gelu' is not supported"),
    ("drafter", _set("hidden_act", "gelu"), "drafter config.json hidden_act 'gelu' is not supported"),
    # a yes/no field as a string: "false" was taken as true (tie_word_embeddings then failed as a
    # tokenizer error, attention_bias as missing bias weights)
    ("target", _set("tie_word_embeddings", "false"), "target config.json tie_word_embeddings must be true or false, got 'false'"),
    ("target", _set("attention_bias", "false"), "target config.json attention_bias must be true or false, got 'false'"),
    ("drafter", _set("attention_bias", "no"), "drafter config.json attention_bias must be true or false, got 'no'"),
    # a stop id that can never be generated
    ("target", _set("eos_token_id", [0, 5000]), "target config.json eos_token_id 5000 is outside the vocabulary of 320 tokens"),
    ("generation", _set("eos_token_id", 9999), "generation_config.json eos_token_id 9999 is outside the vocabulary of 320 tokens"),
    # a drafter layer kind that is not attention was run as full attention
    ("drafter", _set("layer_types", ["linear_attention", "full_attention"]),
     "drafter layer_types must be full_attention or sliding_attention, got 'linear_attention'"),
    # rope parameters of the wrong type (TypeError tracebacks, or a string factor that ran)
    ("target", _set("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": None, "high_freq_factor": 4.0}),
     "rope scaling type 'llama3' lacks low_freq_factor"),
    ("target", _set("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}),
     "target config.json rope_scaling.beta_fast must be a number > 0, got '32'"),
    ("target", _set("rope_scaling", {"rope_type": "linear", "factor": "8"}),
     "target config.json rope_scaling.factor must be a number > 0, got '8'"),
    ("target", _set("rope_scaling", {"rope_type": "linear", "factor": -4.0}),
     "target config.json rope_scaling.factor must be a number > 0, got -4.0"),
    # a drafter's unsupported or incomplete rule: the message did not say whose config it was
    ("drafter", _set("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
     "drafter config.json rope_scaling: unsupported rope scaling type 'dynamic'; supported: linear, llama3, yarn"),
    ("drafter", _set("rope_scaling", {"rope_type": "linear"}),
     "drafter config.json rope_scaling: rope scaling type 'linear' lacks factor"),
    ("generation", b"{", "generation_config.json is not valid JSON"),
    # (the message did not name the file: "cannot load the tokenizer of ...: Expecting property name ...")
    ("tokenizer_config.json", b"{oops", "tokenizer_config.json is not valid JSON"),
    ("special_tokens_map.json", b"{oops", "special_tokens_map.json is not valid JSON"),
    ("generation", _set("eos_token_id", "0"), "generation_config.json eos_token_id must be a token id or a list of them, got '0'"),
    ("index", b"{oops", "model.safetensors.index.json is not valid JSON"),
    ("index", b'{"metadata": {}}', "has no weight_map"),
    # (an entry that is not a name was "has no weight_map"; a path out of the checkpoint was opened)
    ("index", _map_embedding(5), "weight_map maps model.embed_tokens.weight to 5, not a shard file name"),
    ("index", _map_embedding(None), "weight_map maps model.embed_tokens.weight to null, not a shard file name"),
    ("index", _map_embedding("/etc/passwd"), "weight_map maps model.embed_tokens.weight to '/etc/passwd', which is not a "
                                             "file of the checkpoint (a file name in "),
    ("index", _map_embedding("../sharded/model-00001-of-00002.safetensors"),
     "weight_map maps model.embed_tokens.weight to '../sharded/model-00001-of-00002.safetensors', which is not a file"),
    ("index", _map_embedding(""), "weight_map maps model.embed_tokens.weight to '', which is not a file of the checkpoint"),
]


@pytest.mark.parametrize("which,edit,words", MALFORMED_CONFIGS,
                         ids=[f"{c[0]}-{c[2][:40]}" for c in MALFORMED_CONFIGS])
def test_malformed_config_values_are_one_line_errors(tiny_pair, tokenizer_dir, tmp_path, capsys, which, edit, words):
    """A config.json (or generation_config.json, or shard index) value of the wrong type is
    refused with one line naming it, in Python and on the command line, never a TypeError /
    KeyError traceback or a stop id that never matches (a string)."""
    target, drafter = tiny_pair
    if which == "index":
        target = make_target(tmp_path / "sharded", "qwen3", tokenizer=False, max_shard_size="150KB")
        copy_tokenizer(tokenizer_dir, target)
        file = target / "model.safetensors.index.json"
    else:
        src = drafter if which == "drafter" else target
        copy = shutil.copytree(src, tmp_path / which)
        target, drafter = (target, copy) if which == "drafter" else (copy, drafter)
        file = copy / {"generation": "generation_config.json", "target": "config.json", "drafter": "config.json"}.get(
            which, which)
    if isinstance(edit, bytes):
        file.write_bytes(edit)
    else:
        cfg = json.loads(file.read_text())
        edit(cfg)
        file.write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(target, drafter)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)
    capsys.readouterr()  # (the fixture's progress bars)
    rc = cli_main(["generate", "hi", "--target", str(target), "--draft", str(drafter), "--max-new-tokens", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and words in lines[0], lines


def test_chat_without_a_chat_template_names_the_argument_or_the_flag(tiny_pair, tmp_path, capsys):
    """A tokenizer without a chat template: Python (and the server, which passes the message
    on) names the argument ``chat``, the command line the flag ``--chat``; neither tells a
    Python or HTTP user to drop a command-line flag."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "no-template")
    (target / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    engine = DFlashEngine.from_pretrained(target, no_draft=True)
    for prompt, chat in (("hi", True), ([{"role": "user", "content": "hi"}], False)):
        with pytest.raises(DFlashError, match=r"^chat cannot be used: this model's tokenizer has no chat template"):
            engine.generate(prompt, chat=chat, max_new_tokens=2)
    assert cli_main(["generate", "hi", "--chat", "--target", str(target), "--no-draft", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("dflash-torch: error: --chat cannot be used: this model's tokenizer "
                                               "has no chat template (send a text prompt)")
    # bench: a {"messages"} line of the prompt file is named, not --chat, which was not given (trial-268)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x = 1"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert cli_main(["bench", "--target", str(target), "--modes", "target-only", "--prompts", str(prompts),
                     "--max-new-tokens", "2", "--sweep", "", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (f"dflash-torch: error: prompt 2 of {prompts} is a {{\"messages\": [...]}} "
                                               "line, which needs a chat template, and this model's tokenizer has "
                                               "none: give it as a {\"prompt\": text} line")


@pytest.mark.parametrize("template, words", [
    (REFUSING_TEMPLATE, "the chat template refuses these messages: System role not supported"),
    ("{{ messages | bogusfilter }}", "the model's chat template cannot be rendered: No filter named 'bogusfilter'."),
], ids=["raise_exception", "broken"])
def test_a_chat_template_error_is_a_one_line_error(tiny_pair, tmp_path, capsys, template, words):
    """Templates raise on messages they refuse (roles out of order, a system role, ...):
    that was a jinja2 TemplateError traceback on the command line (a 500 in the server)."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "template")
    (target / "chat_template.jinja").write_text(template)
    engine = DFlashEngine.from_pretrained(target, no_draft=True)
    with pytest.raises(DFlashError) as err:
        engine.generate([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_new_tokens=2)
    assert str(err.value) == words
    assert cli_main(["generate", "hi", "--chat", "--target", str(target), "--no-draft", "--max-new-tokens", "2"]) == (
        2 if template != REFUSING_TEMPLATE else 0)  # (a user message alone is fine by the refusing template)
    err_lines = capsys.readouterr().err.strip().splitlines()
    if template != REFUSING_TEMPLATE:
        assert err_lines == [f"dflash-torch: error: {words}"]


@pytest.mark.parametrize("case", ["drafter-as-target", "recompute-compiled"])
def test_load_errors_name_the_argument_in_python_and_the_flag_on_the_command_line(tiny_pair, capsys, case):
    target, drafter = tiny_pair
    if case == "drafter-as-target":
        kw, flags = dict(target=drafter, draft=drafter), []
        python = "target must be the target LLM's checkpoint, not a DFlash drafter's"
        cli = "--target must be the target LLM's checkpoint, not a DFlash drafter's"
    else:
        kw, flags = dict(target=target, draft=drafter, draft_mode="recompute", compile=True), ["--draft-mode", "recompute", "--compile"]
        python = "draft_mode 'recompute' grows its shapes every round; it cannot run with compile (fixed shapes)"
        cli = "--draft-mode 'recompute' grows its shapes every round; it cannot run with --compile (fixed shapes)"
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(**kw)
    assert str(err.value) == python
    assert cli_main(["generate", "hi", "--target", str(kw["target"]), "--draft", str(kw["draft"]), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"dflash-torch: error: {cli}"


@pytest.mark.parametrize("what", ["target", "drafter"])
def test_weights_that_do_not_fit_in_free_memory_are_refused_before_loading(tiny_pair, monkeypatch, what):
    """A model larger than the device's free memory gets one line naming both sizes, before a
    byte of its weights is read (not an out-of-memory error halfway, or a silent kill)."""
    import torch

    import dflash_torch.checkpoint as checkpoint
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.models.target import TargetModel

    model_dir = tiny_pair[0] if what == "target" else tiny_pair[1]
    load = (TargetModel if what == "target" else DFlashDrafter).from_pretrained
    assert checkpoint.available_memory("cpu") > 0
    need = sum(p.numel() for p in load(model_dir, torch.float32).parameters()) * 4
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need - 1)
    reads = []
    real_safe_open = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: reads.append(a) or real_safe_open(*a, **k))
    # (a small model's sizes below a GB in MB or kB: "needs 0.0 GB ...; cpu has 0.0 GB free" said nothing)
    with pytest.raises(DFlashError, match=rf"^the {what} needs [0-9.]+ [kM]B for its weights in float32; cpu has "
                                          r"[0-9.]+ [kM]B free$") as err:
        load(model_dir, torch.float32)
    assert " 0.0 " not in str(err.value)
    assert reads == []
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need)  # exactly enough: it loads
    assert load(model_dir, torch.float32) is not None and reads


def test_memory_sizes_in_messages_take_the_unit_they_reach():
    """The memory checks' sizes: one decimal in the largest unit reached (decimal for the
    weights, binary for the caches), so that a small size does not read 0.0 GB."""
    from dflash_torch.checkpoint import memory_text

    assert [memory_text(n) for n in (3.072e12, 42.3e9, 1e9, 999_960_000, 310_400_000, 1_536, 999, 0)] == [
        "3.1 TB", "42.3 GB", "1.0 GB", "1.0 GB", "310.4 MB", "1.5 kB", "999 bytes", "0 bytes"]
    assert [memory_text(n, binary=True) for n in (3 * 2**40, 2**31, 1.6 * 2**30, 512 * 2**20, 2**10, 1000)] == [
        "3.0 TiB", "2.0 GiB", "1.6 GiB", "512.0 MiB", "1.0 KiB", "1000 bytes"]


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere(tiny_pair):
    """The default dtype: the checkpoints' bfloat16 on a GPU, float32 (exact, and the fast
    one on CPUs without bfloat16 units) on the CPU; the engine loads in it."""
    import torch

    from dflash_torch.options import resolve_dtype

    assert resolve_dtype("auto", device="cuda:1") == resolve_dtype("AUTO", device=torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", device="cpu") == resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bf16", device="cpu") == torch.bfloat16 and resolve_dtype("float32", device="cuda") == torch.float32
    assert resolve_dtype(str(torch.bfloat16)) == resolve_dtype("torch.bfloat16") == torch.bfloat16  # (was refused)
    engine = DFlashEngine.from_pretrained(*tiny_pair)
    assert {p.dtype for p in engine.decoder.target.parameters()} == {torch.float32}
    with pytest.raises(DFlashError, match=r"^unsupported dtype 'int8'; choose one of auto, float32, bfloat16$"):
        resolve_dtype("int8")


def test_device_names_take_any_case_as_dtype_names_do_and_a_cpu_index_other_than_0_is_refused(tiny_pair):
    """trial-319 (c): --device CPU was refused while --dtype BF16 was taken; and cpu:1 (or
    cpu:99) ran, torch ignoring the index. Now a device name is read in any case, and a CPU
    index other than 0 is refused in one line (the engine loads on CPU for CPU / cpu:0)."""
    import torch

    from dflash_torch.options import resolve_device

    assert resolve_device("CPU") == resolve_device(" Cpu ") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu:0") == resolve_device(torch.device("cpu", 0)) == torch.device("cpu:0")
    for value in ("cpu:1", "CPU:99", torch.device("cpu", 3)):
        with pytest.raises(OptionError, match=r"^device .*: torch runs all the CPUs as one device; use cpu \(or cpu:0\)$"):
            resolve_device(value)
    with pytest.raises(OptionError, match=r"^unsupported device 'MPS'; use cpu or cuda$"):
        resolve_device("MPS")
    engine = DFlashEngine.from_pretrained(*tiny_pair, device="CPU")
    assert {p.device.type for p in engine.decoder.target.parameters()} == {"cpu"}


def test_the_public_errors_are_exported():
    """The errors the public docstrings name ("Raises: OptionError") are dflash_torch's names, in
    its __all__ (dflash_torch.OptionError was an AttributeError; trial-310): every DFlashError of
    dflash_torch.errors."""
    import inspect

    import dflash_torch
    from dflash_torch import errors

    public = {name for name, value in vars(errors).items() if inspect.isclass(value) and issubclass(value, DFlashError)}
    assert {"DFlashError", "OptionError", "ContextLengthError", "ContextOptionError", "CompileError"} <= public
    for name in public:
        assert getattr(dflash_torch, name) is getattr(errors, name) and name in dflash_torch.__all__, name


def test_a_request_that_does_not_fit_the_context_is_a_context_length_error(engine):
    """A prompt that fills the context, a prompt with max_new_tokens or min_tokens past it, or
    one too long in characters raise dflash_torch.ContextLengthError (a DFlashError; its
    OptionErrors still name their options), which a caller can tell from other bad requests."""
    from dflash_torch import ContextLengthError

    n = engine.max_context
    cases = [(dict(prompt=[5] * n), "prompt"), (dict(prompt=[5] * 10, max_new_tokens=n), "max_new_tokens"),
             (dict(prompt=[5] * (n - 4), min_tokens=10), "min_tokens"), (dict(prompt="x" * 10**6), None)]
    for kwargs, name in cases:
        with pytest.raises(ContextLengthError) as err:
            engine.generate(**kwargs)
        assert isinstance(err.value, DFlashError) and err.value.code == "context_length_exceeded"
        assert getattr(err.value, "name", None) == name, (kwargs.keys(), err.value)
        prompt = kwargs.pop("prompt")  # (trial-209: a batch's prompt 1 was a plain OptionError / DFlashError)
        with pytest.raises(ContextLengthError) as err:
            engine.generate_batch([[5] * 4, prompt], **{k: [1, v] for k, v in kwargs.items()})
        assert str(err.value).startswith(("prompt 1: ", "prompt 1 (")) and getattr(err.value, "name", None) == name, \
            err.value
    with pytest.raises(DFlashError) as err:
        engine.generate([5], max_new_tokens=0)
    assert not isinstance(err.value, ContextLengthError)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_new_tokens": 10**5000}, "max_new_tokens"), ({"temperature": -10**5000}, "temperature"),
    ({"seed": 10**5000}, "seed"), ({"stop_token_ids": [10**5000]}, "stop_token_ids"),
    ({"logit_bias": {5: 10**5000}}, "logit_bias"), ({"min_tokens": 10**5000}, "min_tokens"),
    ({"prompt_logprobs": 10**5000}, "prompt_logprobs"), ({"repetition_penalty": 10**5000}, "repetition_penalty"),
])
def test_an_integer_too_long_to_print_is_an_option_error_naming_it(engine, tiny_pair, kwargs, name):
    """An argument that is or holds an integer of thousands of digits (which Python refuses to
    print) is an OptionError naming it, from generate, stream and generate_batch; the check's own
    message, which printed the value, was a bare ValueError (trial-168); from_pretrained's too."""
    want = f"{name} is or holds an integer of over 4,000 digits: far out of its range"
    for call in (engine.generate, lambda p, **k: list(engine.stream(p, **k)), lambda p, **k: engine.generate_batch([p], **k)):
        with pytest.raises(OptionError) as err:
            call("def f(x):", **kwargs)
        assert str(err.value) == want and err.value.name == name
    if name == "max_new_tokens":
        with pytest.raises(OptionError, match="^prompt is or holds an integer of over 4,000 digits"):
            engine.generate([5, 10**5000])
        with pytest.raises(DFlashError, match=r"^token id \(an integer of about 5001 digits\) is outside the vocabulary"):
            engine.decode([10**5000])
        with pytest.raises(OptionError, match="^max_context is or holds an integer of over 4,000 digits"):
            DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True, max_context=10**5000)
        # (built directly, and token_text: a ValueError, and the tokenizer's OverflowError, trial-173)
        from dflash_torch.sampling import SamplingParams

        with pytest.raises(OptionError, match="^temperature must be a finite number >= 0, got an integer of about 5001 "):
            SamplingParams(temperature=10**5000)
        for bad in (-10**5000, 10**30, 10**6, -1, "5", True):
            with pytest.raises(DFlashError, match=r"^token_id must be a token id, an integer in \[0, \d+\), got "):
                engine.token_text(bad)


@pytest.fixture(scope="module")
def next_config(tmp_path_factory) -> dict:
    from conftest import make_hybrid_target

    path = make_hybrid_target(tmp_path_factory.mktemp("next-config"), "qwen3_next", tokenizer=False)
    return json.loads((path / "config.json").read_text())


# (edit of a Qwen3-Next config.json, words of the error); each was a TypeError / ValueError /
# ZeroDivisionError traceback, or (mlp_only_layers "1") read as a set of characters
HYBRID_MALFORMED = [
    (_set("rope_parameters.partial_rotary_factor", "quarter"), "target partial_rotary_factor must be a number in (0, 1], got 'quarter'"),
    (_set("rope_parameters.partial_rotary_factor", 1.5), "target partial_rotary_factor must be a number in (0, 1], got 1.5"),
    (_set("full_attention_interval", 0), "target config.json full_attention_interval must be an integer >= 1, got 0"),
    (_set("full_attention_interval", "4"), "target config.json full_attention_interval must be an integer >= 1, got '4'"),
    (_set("linear_conv_kernel_dim", 2.5), "target config.json linear_conv_kernel_dim must be an integer >= 1, got 2.5"),
    (_set("linear_key_head_dim", "16"), "target config.json linear_key_head_dim must be an integer >= 1, got '16'"),
    (_set("decoder_sparse_step", "2"), "target config.json decoder_sparse_step must be an integer >= 1, got '2'"),
    (_set("mlp_only_layers", "1"), "target config.json mlp_only_layers must be a list of layer indices, got '1'"),
    (_set("shared_expert_intermediate_size", "48"),
     "target config.json shared_expert_intermediate_size must be an integer >= 1, got '48'"),
    (_set("shared_expert_intermediate_size", 0),
     "target config.json shared_expert_intermediate_size must be an integer >= 1, got 0"),  # (was "lacks" it)
    (_set("num_experts_per_tok", 1.0), "target config.json num_experts_per_tok must be an integer >= 1, got 1.0"),
]


@pytest.mark.parametrize("edit,words", HYBRID_MALFORMED, ids=[w.split(" must")[0].split()[-1] + "-" + w.rsplit(" ", 1)[-1]
                                                             for _, w in HYBRID_MALFORMED])
def test_malformed_hybrid_and_moe_config_values_are_one_line_errors(next_config, edit, words):
    from dflash_torch.models.config import TargetConfig

    TargetConfig.from_dict(json.loads(json.dumps(next_config)))  # (the config as saved parses)
    cfg = json.loads(json.dumps(next_config))
    cfg.pop("layer_types", None)  # (full_attention_interval is read where layer_types is absent)
    edit(cfg)
    with pytest.raises(DFlashError) as err:
        TargetConfig.from_dict(cfg)
    assert str(err.value) == words


def test_null_partial_rotary_factor_and_interval_take_the_defaults(next_config):
    from dflash_torch.models.config import TargetConfig

    cfg = json.loads(json.dumps(next_config))
    cfg.pop("layer_types", None)
    cfg.update(partial_rotary_factor=None, full_attention_interval=None, linear_conv_kernel_dim=None)
    cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    parsed = TargetConfig.from_dict(cfg)
    assert parsed.partial_rotary_factor == 0.25 and parsed.linear_attention.conv_kernel == 4
    assert [t == "full_attention" for t in parsed.layer_types] == [(i + 1) % 4 == 0 for i in range(6)]


def _config_only(target: Path, tmp_path: Path) -> Path:
    """A directory holding ``target``'s config.json alone (tests add the files they need)."""
    copy = tmp_path / "target"
    copy.mkdir()
    shutil.copy(target / "config.json", copy / "config.json")
    return copy


@pytest.mark.parametrize("case", ["no-tokenizer", "tokenizer-larger-than-vocab"])
def test_tokenizer_errors_come_before_any_weight_is_read(tiny_pair, tokenizer_dir, tmp_path, monkeypatch, case):
    """A tokenizer problem is found before the weights load (minutes for a real model), not after."""
    from dflash_torch import engine as engine_module

    target, drafter = tiny_pair
    copy = _config_only(target, tmp_path)
    os.symlink(target / "model.safetensors", copy / "model.safetensors")
    if case == "tokenizer-larger-than-vocab":
        copy_tokenizer(tokenizer_dir, copy)
        cfg = json.loads((copy / "config.json").read_text())
        cfg["vocab_size"] = 100  # (the tokenizer has 320)
        (copy / "config.json").write_text(json.dumps(cfg))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the tokenizer was checked")

    monkeypatch.setattr(engine_module.TargetModel, "from_pretrained", no_weights)
    monkeypatch.setattr(engine_module.DFlashDrafter, "from_pretrained", no_weights)
    words = "has no tokenizer files" if case == "no-tokenizer" else "the tokenizer has 320 tokens but the target's vocab_size is 100"
    with pytest.raises(DFlashError, match=words):
        DFlashEngine.from_pretrained(copy, None if case != "no-tokenizer" else drafter,
                                     no_draft=case != "no-tokenizer")


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="sentencepiece is installed")
@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_a_sentencepiece_tokenizer_without_the_package_names_it(tiny_pair, tmp_path, kind):
    """A tokenizer only a SentencePiece tokenizer.model holds, without the sentencepiece package:
    one line naming the package (transformers logged five lines, fell back to tiktoken and said to
    install tiktoken). A tiktoken tokenizer.model (text lines) is left to transformers."""
    target, _ = tiny_pair
    copy = _config_only(target, tmp_path)
    (copy / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (copy / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02" if kind == "sentencepiece"
                                           else b"IQ== 0\nIg== 1\n")
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(copy, None, no_draft=True)
    assert ("needs the sentencepiece package: pip install sentencepiece" in str(err.value)) == (kind == "sentencepiece")


@pytest.mark.parametrize("case", ["absent", "directory"])
def test_a_tokenizer_config_without_a_vocabulary_says_so(tiny_pair, tokenizer_dir, tmp_path, case):
    """tokenizer_config.json without tokenizer.json (an interrupted download), or with a
    directory of that name: transformers' reason advised installing sentencepiece or tiktoken;
    the message says first which files are missing, or which is a directory."""
    target, _ = tiny_pair
    copy = _config_only(target, tmp_path)
    shutil.copy(tokenizer_dir / "tokenizer_config.json", copy / "tokenizer_config.json")
    if case == "directory":
        (copy / "tokenizer.json").mkdir()
    words = (r"which has no tokenizer.json, tokenizer.model or vocab.json \(an incomplete download\?\)$" if case == "absent"
             else r": its tokenizer.json is a directory, not a file$")
    with pytest.raises(DFlashError, match=words):
        DFlashEngine.from_pretrained(copy, None, no_draft=True)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"])
def test_a_tokenizer_file_that_is_a_directory_is_refused(tiny_pair, tokenizer_dir, tmp_path, name):
    """Beside a good tokenizer.json, a directory named as another tokenizer file: transformers
    loaded the tokenizer without that file (its special tokens and chat template) and said
    nothing."""
    target, _ = tiny_pair
    copy = _config_only(target, tmp_path)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, copy / f.name)
    if (copy / name).exists():
        (copy / name).unlink()
    (copy / name).mkdir()
    with pytest.raises(DFlashError, match=rf": its {re.escape(name)} is a directory, not a file$"):
        DFlashEngine.from_pretrained(copy, None, no_draft=True)


def test_an_engine_from_a_hugging_face_id_is_named_by_it(tiny_pair, tmp_path, monkeypatch):
    """(The name ``serve`` gives the model by default: a cached id kept only its last part,
    "tiny", and clients asking for "acme/tiny", as vLLM names it, got a 404.) The path of its
    snapshot in the cache is named by the id too (trial-284 (d): it was named by the commit
    hash, the snapshot directory's name)."""
    from huggingface_hub import constants

    target, _ = tiny_pair
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(target, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert DFlashEngine.from_pretrained("acme/tiny", no_draft=True).name == "acme/tiny"
    assert DFlashEngine.from_pretrained(str(snapshot) + "/", no_draft=True).name == "acme/tiny"
    monkeypatch.chdir(snapshot)
    assert DFlashEngine.from_pretrained(".", no_draft=True).name == "acme/tiny"
    other = shutil.copytree(target, tmp_path / "snapshots" / ("1" * 40))  # (not in a models--ORG--NAME folder)
    assert DFlashEngine.from_pretrained(other, no_draft=True).name == other.name  # (a directory: its name)


def test_an_engine_from_a_relative_or_home_path_is_named_by_its_directory(tiny_pair, tmp_path, monkeypatch):
    """The name ``serve`` gives the model by default is the target directory's own: ``--target .``
    served the model id "" (the name of Path(".")), ``..`` the id "..", and ``~/x/target`` the id
    "~/x/target" (the ~ was not expanded to see that it is a directory)."""
    target, _ = tiny_pair
    home = tmp_path / "home"
    copy = shutil.copytree(target, home / "models" / "tiny-target")
    (copy / "sub").mkdir()
    monkeypatch.setenv("HOME", str(home))
    for cwd, given in ((copy, "."), (copy, "./"), (copy / "sub", ".."), (copy / "sub", "../"), (home, "models/tiny-target/"),
                       (tmp_path, "~/models/tiny-target"), (copy / "sub", "../../tiny-target")):
        monkeypatch.chdir(cwd)
        assert DFlashEngine.from_pretrained(given, no_draft=True).name == "tiny-target", given
    (tmp_path / "link").symlink_to(copy)  # (a link: the name it is given by)
    assert DFlashEngine.from_pretrained(tmp_path / "link", no_draft=True).name == "link"


def test_a_path_of_an_unknown_users_home_is_a_path_not_found(tiny_pair, tmp_path, cli):
    """``~nosuchuser/x`` (a user this system does not have) is left as it is, as a shell leaves
    it, and is then a path that does not exist: Path.expanduser() raised "RuntimeError: Could
    not determine home directory." with a traceback (generate, train's --target and --data,
    from_pretrained)."""
    from dflash_torch.training.data import corpus_files

    target, _ = tiny_pair
    with pytest.raises(DFlashError, match="'~nosuchuser/target' is not a local directory"):
        DFlashEngine.from_pretrained("~nosuchuser/target", no_draft=True)
    with pytest.raises(DFlashError, match="~nosuchuser/data"):
        corpus_files(["~nosuchuser/data"])
    r = cli("generate", "--target=~nosuchuser/target", "x")
    assert r.returncode == 2 and r.stderr.startswith("dflash-torch: error: --target: model '~nosuchuser/target' "), r.stderr
    for args in (["--target=~nosuchuser/target", "--data", str(tmp_path)], ["--target", str(target), "--data=~nosuchuser/d"]):
        r = cli("train", *args, "--out", str(tmp_path / "out"), "--steps", "1")
        assert r.returncode == 2 and "~nosuchuser/" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("lacks", [None, "config", "shard", "link", "bin"])
def test_hugging_face_ids_resolve_from_the_local_cache(tiny_pair, tmp_path, monkeypatch, lacks):
    """A cached repo id resolves to its snapshot; one cached without its config.json is
    called that (it was "not in the Hugging Face cache"). Offline, a snapshot that lacks a
    shard, whose weights are a broken link or only ``.bin`` ones is named with that reason, as a
    directory is (it was "no config.json or safetensors weights" for each)."""
    from huggingface_hub import constants
    from safetensors.torch import load_file, save_file

    from dflash_torch.checkpoint import resolve_model_dir

    target, _ = tiny_pair
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    shutil.copy(target / "config.json", snapshot / "config.json")
    shutil.copy(target / "model.safetensors", snapshot / "model.safetensors")
    if lacks == "config":
        (snapshot / "config.json").unlink()
    elif lacks == "shard":  # (its index names two shards; the second is not there)
        weights = load_file(snapshot / "model.safetensors")
        (snapshot / "model.safetensors").unlink()
        save_file(weights, snapshot / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(weights)}}))
    elif lacks == "link":  # (a link to a blob that is gone, as a download cut short leaves it)
        (snapshot / "model.safetensors").unlink()
        (snapshot / "model.safetensors").symlink_to("../../blobs/0123")
    elif lacks == "bin":
        (snapshot / "model.safetensors").rename(snapshot / "pytorch_model.bin")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # (read when huggingface_hub is imported)
    reasons = {"config": f"{snapshot} has no config.json",
               "shard": f"{snapshot}: shard(s) listed in model.safetensors.index.json are missing: "
                        "model-00002-of-00002.safetensors",
               "link": f"{snapshot}: model.safetensors is a broken link (an interrupted download? download the "
                       "checkpoint again)",
               "bin": f"{snapshot} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
                      "it holds pytorch_model.bin (PyTorch pickle weights), which dflash-torch does not read"}
    if lacks is None:
        assert resolve_model_dir("acme/tiny") == snapshot
    else:
        with pytest.raises(DFlashError) as err:
            resolve_model_dir("acme/tiny")
        assert str(err.value).startswith(f"model 'acme/tiny' is in the Hugging Face cache incomplete ({reasons[lacks]}")
        assert str(err.value).endswith("); HF_HUB_OFFLINE is set, so it is not downloaded")
    with pytest.raises(DFlashError, match=re.escape(f"'acme/other' is not a local directory ({Path('acme/other').absolute()}) "
                                                    "and is not in the Hugging Face cache; HF_HUB_OFFLINE is set, so it "
                                                    "is not downloaded")):
        resolve_model_dir("acme/other")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_missing_checkpoint_names_its_argument_and_flag(tiny_pair, tmp_path, capsys, which):
    """("model directory ... does not exist" named neither --target nor --draft.)"""
    target, drafter = tiny_pair
    paths = {"target": str(target), "draft": str(drafter), which: str(tmp_path / "nowhere")}
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(paths["target"], paths["draft"])
    assert str(err.value) == f"{which}: model directory {paths[which]!r} does not exist"
    rc = cli_main(["generate", "hi", "--target", paths["target"], "--draft", paths["draft"], "--max-new-tokens", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines == [f"dflash-torch: error: --{which}: model directory {paths[which]!r} does not exist"]


def test_prompt_ids_may_be_numpy_integers_or_0_dim_tensors(engine):
    """(As check_prompt_ids documents; encode_prompt refused them as "not chat messages".)"""
    import numpy as np
    import torch

    want = engine.generate([5, 7, 3], max_new_tokens=4).token_ids
    assert engine.generate([np.int64(5), np.int32(7), torch.tensor(3)], max_new_tokens=4).token_ids == want
    for prompt, got in (([torch.tensor(3.0)], "tensor(3.)"),
                        # (a tensor of several ids among ids: it said only "must be integers", of integers)
                        ([5, torch.tensor([7, 3])], "a tensor of shape (2,)"), ([5, np.array([7, 3])], "an array of shape (2,)")):
        with pytest.raises(DFlashError, match=re.escape(f"prompt token ids must be integers, one id each, got {got}") + "$"):
            engine.generate(prompt, max_new_tokens=2)


def test_prompts_as_tuples_ranges_and_1_d_tensors_or_arrays(engine):
    """Token ids as a tuple, a range, a 1-D tensor or NumPy array are the same prompt as the
    list; a 2-D one (a tokenizer's [1, N] input_ids) or one of floats is a one-line error."""
    import numpy as np
    import torch

    want = engine.generate([5, 7, 3], max_new_tokens=4).token_ids
    for prompt in ((5, 7, 3), torch.tensor([5, 7, 3]), np.array([5, 7, 3]),
                   torch.tensor([5, 7, 3], dtype=torch.int32)):
        assert engine.generate(prompt, max_new_tokens=4).token_ids == want, prompt
    assert engine.generate(range(5, 8), max_new_tokens=4).token_ids == engine.generate([5, 6, 7], max_new_tokens=4).token_ids
    rows = "generate_batch(list(ids)) takes its rows as prompts, each without its padding)"
    for prompt, words in ((torch.tensor([[5, 7, 3]]), "must be 1-D, got shape (1, 3) (a batch of one, e.g. a "
                                                      "tokenizer's input_ids: pass its row, ids[0])"),
                          # more than one row: not ids[0], which would drop the other prompts
                          (np.zeros((2, 2), dtype=np.int64), f"must be 1-D, got shape (2, 2) (2 prompts: {rows}"),
                          (torch.tensor([[5, 6], [7, 8], [9, 10]]), f"must be 1-D, got shape (3, 2) (3 prompts: {rows}"),
                          (torch.tensor([5.0, 7.0]), "must be integers, got a tensor of torch.float32"),
                          # (a tokenizer's batch as lists: said as for a tensor)
                          ([[5, 7, 3]], "got a list of one list (a batch of one): pass its row, ids[0]"),
                          ([[5, 7], [3]], "got a list of 2 lists (2 prompts: generate_batch takes them)"),
                          (np.array([0.5]), "must be integers, got an array of float64")):
        with pytest.raises(DFlashError, match=re.escape(words)):
            engine.generate(prompt, max_new_tokens=2)


def test_numpy_scalars_are_the_numbers_they_hold(engine):
    """(They were refused with messages such as "max_new_tokens must be an integer >= 1, got np.int64(4)".)"""
    import numpy as np

    kw = dict(max_new_tokens=6, temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True,
              logit_bias={5: -100.0}, stop_token_ids=[3], min_tokens=2, logprobs=1)
    as_numpy = dict(max_new_tokens=np.int64(6), temperature=np.float32(0.7), top_k=np.int32(3), top_p=np.float64(0.9),
                    min_p=np.float32(0.05), seed=np.uint16(3), ignore_eos=np.True_, logit_bias={np.int64(5): np.float32(-100)},
                    stop_token_ids=[np.int64(3)], min_tokens=np.int8(2), logprobs=np.int64(1))
    assert engine.generate("def f(x):", **as_numpy).token_ids == engine.generate("def f(x):", **kw).token_ids
    batch = engine.generate_batch(["a", "b"], max_new_tokens=np.array([3, 4]), ignore_eos=True)
    assert [len(r.token_ids) for r in batch] == [3, 4]
    # torch's too (trial-139: "temperature must be a finite number >= 0, got tensor(0.7000)", a number that is)
    as_torch = {k: {torch.tensor(5): torch.tensor(-100.0)} if k == "logit_bias" else
                [torch.tensor(3)] if k == "stop_token_ids" else torch.tensor(v) for k, v in kw.items()}
    assert engine.generate("def f(x):", **as_torch).token_ids == engine.generate("def f(x):", **kw).token_ids
    batch = engine.generate_batch(["a", "b"], max_new_tokens=torch.tensor([3, 4]), ignore_eos=True)
    assert [len(r.token_ids) for r in batch] == [3, 4]
    with pytest.raises(DFlashError, match=r"^temperature must be a finite number >= 0, got \[0\.5, 1\.0\]$"):
        engine.generate("x", temperature=torch.tensor([0.5, 1.0]))
    # a meta or sparse tensor has no values to read: named, not torch's "Cannot copy out of meta tensor; no data!",
    # "Tensor.item() cannot be called on meta tensors" or "Cannot access data pointer of Tensor ..." (trial-279)
    meta = "a meta tensor (a shape and a dtype, no values): make it on a real device (cpu, cuda)"
    with warnings.catch_warnings():  # (torch's "Sparse CSR tensor support is in beta state")
        warnings.simplefilter("ignore")
        csr = torch.tensor([[5, 7]]).to_sparse_csr()
    prompt_cases = ((torch.tensor([5, 7], device="meta"), f"the prompt is {meta}"),
                    (torch.tensor([[5, 7]], device="meta"), f"the prompt is {meta}"),
                    ([torch.tensor(5), torch.tensor(7, device="meta")], f"the prompt holds {meta}"),
                    (torch.tensor([5, 7]).to_sparse(), "the prompt is a sparse tensor (torch.sparse_coo): pass its .to_dense()"),
                    (csr, "the prompt is a sparse tensor (torch.sparse_csr): pass its .to_dense()"))
    for prompt, message in prompt_cases:
        for call in (lambda: engine.generate(prompt, max_new_tokens=2), lambda: engine.generate_batch([prompt], max_new_tokens=2)):
            with pytest.raises(OptionError, match=f"^{re.escape(message)}$"):
                call()
        with pytest.raises(OptionError, match=f"^prompt 1: {re.escape(message)}$"):
            engine.generate_batch([[5, 7], prompt], max_new_tokens=2)
    sparse = "a sparse tensor (torch.sparse_coo): pass its .to_dense()"
    option_cases = (("stop_token_ids", torch.tensor([5], device="meta"), f"is {meta}"),
                    ("max_new_tokens", torch.tensor(3, device="meta"), f"is {meta}"),
                    ("temperature", torch.tensor(0.5, device="meta"), f"is {meta}"),
                    ("stop_token_ids", [torch.tensor(5, device="meta")], f"holds {meta}"),
                    ("logit_bias", {torch.tensor(5, device="meta"): 1.0}, f"holds {meta}"),
                    ("stop_token_ids", torch.tensor([5]).to_sparse(), f"is {sparse}"))
    for name, value, said in option_cases:
        for call in (engine.generate, engine.stream, lambda p, **kw: engine.generate_batch([p, p], **kw)):
            with pytest.raises(OptionError, match=f"^{re.escape(name + ' ' + said)}$") as err:
                list(call("x", **{name: value}))
            assert err.value.name == name
    with pytest.raises(OptionError, match=f"^max_new_tokens is {re.escape(meta)}$"):
        engine.generate_batch(["a", "b"], max_new_tokens=torch.tensor([3, 4], device="meta"))
    with pytest.raises(OptionError, match=f"^token_ids is {re.escape(meta)}$"):
        engine.decode(torch.tensor([5, 7], device="meta"))


def test_a_misspelt_argument_or_a_callback_that_is_not_one_is_named(engine):
    """generate, stream and generate_batch name the closest argument (stream and generate_batch
    gave Python's TypeError without it); the constructor names DFlashEngine (it named
    SpeculativeDecoder, which the user did not call), as Python names a method."""
    for method, call in (("generate", lambda **kw: engine.generate("x", **kw)),
                         ("stream", lambda **kw: engine.stream("x", **kw)),
                         ("generate_batch", lambda **kw: engine.generate_batch(["x", "y"], **kw))):
        with pytest.raises(TypeError, match=rf"^DFlashEngine\.{method}\(\) got an unexpected keyword argument "
                                            r"'max_tokens' \(did you mean 'max_new_tokens'\?\)$"):
            call(max_tokens=5)
        with pytest.raises(TypeError, match=rf"^DFlashEngine\.{method}\(\) got an unexpected keyword argument 'bogus'$"):
            call(bogus=1)
    parts = engine.target, engine.tokenizer, engine.drafter
    with pytest.raises(TypeError, match=r"^DFlashEngine\.__init__\(\) got an unexpected keyword argument 'bogus'$"):
        DFlashEngine(*parts, bogus=1)
    for wrong, right in (("prefil_chunk", "prefill_chunk"), ("max_batchsize", "max_batch_size")):
        with pytest.raises(TypeError, match=rf"^DFlashEngine\.__init__\(\) got an unexpected keyword argument "
                                            rf"'{wrong}' \(did you mean '{right}'\?\)$"):
            DFlashEngine(*parts, **{wrong: 1})
    assert DFlashEngine(*parts, prefill_chunk=64).decoder.prefill_chunk == 64
    with pytest.raises(DFlashError, match=r"^on_chunk must be a function of a StreamChunk \(or None\), got int$"):
        engine.generate("x", max_new_tokens=2, on_chunk=5)
    # (trial-310: help(DFlashEngine.generate) showed (self, prompt, *, on_chunk=None, **kwargs)): it shows stream's
    # arguments and on_chunk, as help() renders them
    import inspect
    import pydoc

    shown, streams = inspect.signature(engine.generate), inspect.signature(engine.stream)
    assert list(shown.parameters) == [*streams.parameters, "on_chunk"] and shown.return_annotation == "GenerationResult"
    assert all(shown.parameters[n] == p for n, p in streams.parameters.items())
    assert "max_new_tokens: 'int | None' = None" in pydoc.render_doc(DFlashEngine.generate, renderer=pydoc.plaintext)


def test_an_argument_of_another_librarys_generate_is_named_by_ours(engine):
    """A name that transformers' generate, OpenAI or vLLM give an argument is hinted at by the
    argument that does its work here, not by its closest spelling (trial-279: stop_strings
    got 'stop_token_ids', generator 'temperature', pad_token_id 'stop_token_ids', draft_model
    and draft_dir 'draft_mode'; max_length, do_sample, n got nothing. trial-283: drafter_dir
    got 'draft_mode', target_only 'target', prefix_caching 'prefill_chunk', prompt_token_ids
    and allowed_token_ids (the opposite of a stop) 'stop_token_ids', length_penalty
    'presence_penalty'; input_ids, messages, assistant_model, gamma got nothing); a typo
    still gets the closest spelling, a name merely alike (a ratio under 0.8) none; an argument
    of loading given to a request names from_pretrained's. Every hint names an argument the
    method takes, or from_pretrained's where it says so."""
    import inspect

    ids = "token ids are a prompt as they are: a list of ints, or a 1-D tensor (a tokenizer's input_ids[0])"
    request = {"stop_strings": " (did you mean 'stop'?)",
               "generator": " (did you mean 'seed'? it takes an int, not a torch.Generator)",
               "max_length": " (did you mean 'max_new_tokens'? it counts the generated tokens only, not the prompt's)",
               "do_sample": " (did you mean 'temperature'? temperature > 0 samples; the default, 0, is greedy)",
               "pad_token_id": " (not needed: each prompt is decoded as it is, without padding)",
               "n": " (for n samples of a prompt, pass it n times: generate_batch([prompt] * n, temperature=...) with "
                    "temperature > 0, and seed a list of n seeds to make them reproducible)",
               "prompt_token_ids": f" (did you mean {{prompt!r}}? {ids})", "input_ids": f" (did you mean {{prompt!r}}? {ids})",
               "inputs": f" (did you mean {{prompt!r}}? {ids})",
               "messages": " (did you mean {prompt!r}? a conversation, a list of message dicts, is a prompt as it is)",
               "top_n_tokens": " (did you mean 'logprobs'? it takes the number of most likely tokens reported at each "
                               "position)",
               "response_format": " (did you mean 'structured_output'? as {{'json': response_format['json_schema']"
                                  "['schema']}}, or {{'json_object': True}} for type json_object)",
               "assistant_model": " (it is set when loading: DFlashEngine.from_pretrained(draft=...))",
               "num_speculative_tokens": " (it is set when loading: DFlashEngine.from_pretrained(block_size=...))",
               "max_seq_len": " (it is set when loading: DFlashEngine.from_pretrained(max_context=...))",
               # (no hint rather than a wrong one: none here does their work)
               "allowed_token_ids": "", "length_penalty": "", "prompt_lookup_num_tokens": "",
               "spaces_between_special_tokens": "",
               "tempreature": " (did you mean 'temperature'?)", "max_new_token": " (did you mean 'max_new_tokens'?)",
               "bogus": ""}
    for method, call in (("generate", lambda **kw: engine.generate("x", **kw)),
                         ("stream", lambda **kw: engine.stream("x", **kw)),
                         ("generate_batch", lambda **kw: engine.generate_batch(["x", "y"], **kw))):
        for name, hint in request.items():
            with pytest.raises(TypeError) as err:
                call(**{name: 1})
            hint = hint.format(prompt="prompts" if method == "generate_batch" else "prompt")
            assert str(err.value) == f"DFlashEngine.{method}() got an unexpected keyword argument {name!r}{hint}"
    block = " (did you mean 'block_size'? tokens per block: each round drafts block_size - 1 tokens)"
    loading = {"draft_model": " (did you mean 'draft'?)", "draft_dir": " (did you mean 'draft'?)",
               "drafter_dir": " (did you mean 'draft'?)", "target_only": " (did you mean 'no_draft'?)",
               "prefix_caching": " (did you mean 'reuse_prefix'?)", "num_speculative_tokens": block,
               "gamma": block, "num_assistant_tokens": block, "max_seq_len": " (did you mean 'max_context'?)",
               "model_name_or_path": " (did you mean 'target'?)", "max_model_len": " (did you mean 'max_context'?)",
               "blocksize": " (did you mean 'block_size'?)", "prefix_cache": "",
               "do_sample": "", "n": "", "messages": ""}  # (a request's arguments: not hinted at by a loading one)
    for name, hint in loading.items():  # (refused before anything is loaded)
        with pytest.raises(TypeError) as err:
            DFlashEngine.from_pretrained(**{name: "d"})
        assert str(err.value) == f"DFlashEngine.from_pretrained() got an unexpected keyword argument {name!r}{hint}"
    with pytest.raises(TypeError, match=r"^DFlashEngine\.__init__\(\) got an unexpected keyword argument 'draft_model' "
                                        r"\(did you mean 'drafter'\?\)$"):
        DFlashEngine(engine.target, engine.tokenizer, draft_model=engine.drafter)
    for name, right in (("prefix_caching", "reuse_prefix"), ("max_seq_len", "max_context")):  # (not prefill_chunk)
        with pytest.raises(TypeError, match=rf"^DFlashEngine\.__init__\(\) got an unexpected keyword argument "
                                            rf"'{name}' \(did you mean '{right}'\?\)$"):
            DFlashEngine(engine.target, engine.tokenizer, **{name: 1})
    # OpenAI's forms of their values: response_format's dict as structured_output, logprobs=True (it said only
    # "has unknown keys json_schema, type" and "must be an integer in [0, 20], got True")
    with pytest.raises(OptionError, match=re.escape(
            "structured_output has unknown keys json_schema, type (known: json, json_object, regex, choice, grammar); "
            "for OpenAI's response_format pass {'json': response_format['json_schema']['schema']}, or {'json_object': "
            "True} for type json_object") + "$"):
        engine.generate("x", max_new_tokens=2, structured_output={"type": "json_schema",
                                                                  "json_schema": {"name": "a", "schema": {}}})
    with pytest.raises(OptionError, match=re.escape("structured_output has unknown keys bogus (known: json, json_object, "
                                                    "regex, choice, grammar)") + "$"):
        engine.generate("x", max_new_tokens=2, structured_output={"bogus": 1})
    with pytest.raises(OptionError, match=re.escape(
            "logprobs must be an integer in [0, 20], got True (the number of most likely tokens reported beside each "
            "token, as OpenAI's top_logprobs; 0: the chosen token's log-probability alone, as OpenAI's logprobs=True "
            "without top_logprobs)") + "$"):
        engine.generate("x", max_new_tokens=2, logprobs=True)
    with pytest.raises(OptionError, match=re.escape(
            "prompt_logprobs must be an integer in [0, 20], got True (the number of most likely tokens reported at each "
            "prompt position; 0: the prompt token's log-probability alone)") + "$"):
        engine.generate("x", max_new_tokens=2, prompt_logprobs=True)
    assert engine.generate("x", max_new_tokens=2, logprobs=0).logprobs[0].top == []  # (as the hint says)
    from dflash_torch.decoding import SpeculativeDecoder
    from dflash_torch.aliases import ALIASES as _ALIASES

    takes = {"generate": (DFlashEngine.stream, DFlashEngine.generate), "stream": (DFlashEngine.stream,),
             "generate_batch": (DFlashEngine.generate_batch,), "from_pretrained": (DFlashEngine.from_pretrained,),
             "__init__": (DFlashEngine.__init__, SpeculativeDecoder)}
    calls = {"generate": lambda **kw: engine.generate("x", **kw), "stream": lambda **kw: engine.stream("x", **kw),
             "generate_batch": lambda **kw: engine.generate_batch(["x", "y"], **kw),
             "from_pretrained": DFlashEngine.from_pretrained,
             "__init__": lambda **kw: DFlashEngine(engine.target, engine.tokenizer, **kw)}
    loading = set(inspect.signature(inspect.unwrap(DFlashEngine.from_pretrained)).parameters)
    for method, functions in takes.items():
        known = {n for f in functions for n in inspect.signature(inspect.unwrap(f)).parameters}
        for name in set(_ALIASES) - known:
            with pytest.raises(TypeError) as err:
                calls[method](**{name: 1})
            text = str(err.value)
            assert not text.endswith("()"), text  # (a name with no note: no hint, not an empty one)
            said = re.findall(r"did you mean '(\w+)'", text) + re.findall(r"(\w+)\((?!\w+=)", text)[1:]
            assert set(said) <= known | {"generate_batch"}, (method, name, text)
            for called, keyword in re.findall(r"(\w+)\((\w+)=\.\.\.\)", text):  # (from_pretrained(draft=...))
                assert called == "from_pretrained" and keyword in loading and method != "from_pretrained", text


def test_a_tokenizers_output_or_a_list_of_texts_as_the_prompt_gets_a_hint(engine):
    """A tokenizer's output (``tokenizer(text)``, a BatchEncoding) as the prompt names it and
    says to pass its ``["input_ids"]`` (its row, of ``return_tensors="pt"``); a list of
    strings says generate_batch takes several texts. Both got only "the prompt must be a
    string, a list of token ids, or a list of chat messages" / "a prompt list must hold
    token ids (ints) or chat messages"."""
    tok = engine.tokenizer
    start = r"^the prompt must be a string, a list of token ids, or a list of chat messages, got a tokenizer's output \(BatchEncoding\): "
    cases = [(tok("def f(x):"), r'pass its \["input_ids"\]$'),
             (tok("def f(x):", return_tensors="pt"), r'pass its \["input_ids"\]\[0\] \(a batch of one\)$'),
             (tok(["a", "bb"], return_tensors="pt", padding=True),
              r'its \["input_ids"\] holds 2 prompts: pass its rows to generate_batch as a list, each without its padding$')]
    for prompt, how in cases:
        with pytest.raises(DFlashError, match=start + how):
            engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^prompts must be a non-empty list of prompts, got a tokenizer's output "
                                          r'\(BatchEncoding\): pass the rows of its \["input_ids"\] as a list, each '
                                          r"without its padding$"):
        engine.generate_batch(tok(["a", "bb"]), max_new_tokens=2)
    direct = engine.generate("def f(x):", max_new_tokens=2, ignore_eos=True).token_ids
    for ids in (tok("def f(x):")["input_ids"], tok("def f(x):", return_tensors="pt")["input_ids"][0]):
        assert engine.generate(ids, max_new_tokens=2, ignore_eos=True).token_ids == direct
    with pytest.raises(DFlashError, match=r"^the prompt must be a string, a list of token ids, or a list of chat "
                                          r"messages, got GenerationResult$"):
        engine.generate(engine.generate("a", max_new_tokens=2), max_new_tokens=2)
    texts = r"^a prompt list must hold token ids \(ints\) or chat messages \(\{'role': str, 'content': str\}\); got "
    with pytest.raises(DFlashError, match=texts + r"a list of 2 strings \(2 text prompts: generate_batch takes them\)$"):
        engine.generate(["a", "b"], max_new_tokens=2)
    with pytest.raises(DFlashError, match=texts + r"a list of 1 string \(one text prompt: pass the string itself\)$"):
        engine.generate(["a"], max_new_tokens=2)
    with pytest.raises(DFlashError, match=texts + r"a tuple of 2 strings \(2 text prompts: generate_batch takes them\)$"):
        engine.generate(("a", "b"), max_new_tokens=2)  # (it said "a list" of a tuple)
    # chat messages as (role, content) pairs, or a list of conversations, are not a tokenizer's batch (trial-279: "got a
    # list of one list (a batch of one): pass its row, ids[0]"; "a tuple of 2 strings (2 text prompts: generate_batch
    # takes them)", which then ran "user" and "hi" as two prompts)
    pairs = "each chat message is a dict, [{'role': role, 'content': content} for role, content in pairs]"
    one = "a chat message is a dict, not a (role, content) pair; pass [{'role': 'user', 'content': text}]"
    conversations = "generate takes one conversation (a list of message dicts), generate_batch a list of them"
    message = {"role": "user", "content": "x"}
    for prompt, hint in (([("user", "hi")], f"a (role, content) pair: {pairs}"),
                         ([["a", "b"]], f"a (role, content) pair: {pairs}"),
                         ([("system", "s"), message, ("user", "hi")], f"2 (role, content) pairs: {pairs}"),
                         (("user", "hi"), f"a tuple of 2 strings, 'user' and a text: {one}"),
                         (["user", "hi"], f"a list of 2 strings, 'user' and a text: {one}"),
                         ([["a", "b", "c"]], "a list of lists of strings: each chat message is a dict {'role': str, "
                                             "'content': str}"),
                         ([[message]], f"a list of 1 list of chat messages: {conversations}"),
                         ([[message], [message]], f"a list of 2 lists of chat messages: {conversations}")):
        with pytest.raises(DFlashError, match=texts + re.escape(hint) + "$"):
            engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(DFlashError, match=texts + re.escape(f"a tuple of 2 strings, 'user' and a text: {one}") + "$"):
        engine.generate_batch([("user", "hi")], max_new_tokens=2)
    with pytest.raises(DFlashError, match=texts + re.escape(f"a (role, content) pair: {pairs}") + "$"):
        engine.generate_batch([[("user", "hi")]], max_new_tokens=2)
    assert len(engine.generate_batch([[message], [message]], max_new_tokens=2)) == 2  # (as generate_batch takes them)
    # one conversation of pairs as generate_batch's prompts (trial-283: prompt 0's hint, "pass [{'role': 'system',
    # 'content': text}]", split it into one prompt a message)
    for prompts in ([("system", "be brief"), ("user", "hi")], [["system", "be brief"], ["user", "hi"], ["assistant", "a"]]):
        with pytest.raises(DFlashError, match=re.escape(
                f"prompts is a list of prompts, and this looks like one conversation of {len(prompts)} (role, content) "
                "pairs: a chat message is a dict, and generate_batch takes a list of conversations, each a list of "
                "message dicts: pass [[{'role': role, 'content': content} for role, content in pairs]]") + "$"):
            engine.generate_batch(prompts, max_new_tokens=2)
    # the rows of a tokenizer's tensor or array as a list, list(input_ids), as one prompt: said as for lists of ids
    # (trial-283: "prompt token ids must be integers", of integers)
    rows = tok(["a", "bb"], return_tensors="np", padding=True)["input_ids"]
    for prompt, hint in ((list(torch.tensor([[5, 6], [7, 8]])), "a list of 2 1-D tensors (2 prompts: generate_batch takes them)"),
                         ([torch.tensor([5, 6, 7])], "a list of one 1-D tensor (a batch of one): pass its row, ids[0]"),
                         (list(rows), "a list of 2 1-D arrays (2 prompts: generate_batch takes them)"),
                         ((np.array([5, 6]),), "a tuple of one 1-D array (a batch of one): pass its row, ids[0]")):
        with pytest.raises(DFlashError, match=texts + re.escape(hint) + "$"):
            engine.generate(prompt, max_new_tokens=2)
        with pytest.raises(DFlashError, match="^prompt 1: " + texts[1:] + re.escape(hint) + "$"):
            engine.generate_batch(["x", prompt], max_new_tokens=2)
    assert [r.token_ids for r in engine.generate_batch(list(torch.tensor([[5, 6], [7, 8]])), max_new_tokens=2,
                                                       ignore_eos=True)] == \
        [engine.generate(ids, max_new_tokens=2, ignore_eos=True).token_ids for ids in ([5, 6], [7, 8])]  # (as the hint says)


def test_api_misuse_found_by_a_trial_gets_a_clear_error(engine):
    """One prompt passed to generate_batch (it said "prompt 0: the prompt must be a string, a
    list of token ids, ..."); chat=True on token ids (silently ignored); decoding an id outside
    the vocabulary (an OverflowError, or '' silently)."""
    for prompt in ([5, 6, 7], [{"role": "user", "content": "hi"}]):
        with pytest.raises(DFlashError, match=r"^prompts is a list of prompts, .*: pass \[prompt\]$"):
            engine.generate_batch(prompt, max_new_tokens=2)
    assert len(engine.generate_batch([[5, 6, 7]], max_new_tokens=2)) == 1
    # a tensor or array of several prompts (it said "prompts must be a non-empty list")
    ids = [[5, 6], [7, 8]]
    for kind, name in ((torch.tensor, "Tensor"), (np.array, "ndarray")):
        with pytest.raises(DFlashError, match=re.escape(f"prompts must be a non-empty list of prompts, got a 2-D {name} of "
                                                        "shape (2, 2): generate_batch(list(ids)) takes its rows as "
                                                        "prompts, each without its padding")):
            engine.generate_batch(kind(ids), max_new_tokens=2)
        assert [r.token_ids for r in engine.generate_batch(list(kind(ids)), max_new_tokens=2)] == \
            [r.token_ids for r in engine.generate_batch(ids, max_new_tokens=2)]
    for prompts, given in (([], "an empty one"), ("hi", "str")):
        with pytest.raises(DFlashError, match=f"^prompts must be a non-empty list of prompts, got {given}$"):
            engine.generate_batch(prompts, max_new_tokens=2)
    with pytest.raises(DFlashError, match="^chat applies to a text prompt"):
        engine.encode_prompt([5, 6, 7], chat=True)
    vocab = engine.target.config.vocab_size
    for bad in (-1, vocab):
        with pytest.raises(DFlashError, match=rf"^token id {bad} is outside the vocabulary \[0, {vocab}\)$"):
            engine.decode([3, bad])


def test_a_bad_option_of_all_prompts_names_no_prompt(engine):
    """chat_template_kwargs and tools are one value for all the prompts of generate_batch: an
    error about that value names no prompt (it said "prompt 0: ..."); one about a prompt with
    it still names the prompt."""
    messages = [{"role": "user", "content": "a"}]
    for kw, words in ((dict(chat_template_kwargs=[{"a": 1}, {"a": 2}]),
                       "chat_template_kwargs must be an object (a dict) with string keys, got [{'a': 1}, {'a': 2}]"),
                      (dict(tools={"type": "function"}), "tools must be a list of objects (dicts), got {'type': 'function'}")):
        with pytest.raises(DFlashError, match="^" + re.escape(words) + "$"):
            engine.generate_batch([messages, messages], max_new_tokens=2, **kw)
    with pytest.raises(DFlashError, match=r"^prompt 1: chat_template_kwargs apply to chat prompts only"):
        engine.generate_batch([messages, [5, 6]], chat_template_kwargs={"a": 1}, max_new_tokens=2)


def test_weights_that_cannot_be_mapped_or_allocated_are_one_line_errors(tiny_pair, monkeypatch, capsys):
    """A process that may not map or allocate the weights (``ulimit -v``, a device out of
    memory: torch raises RuntimeError, injected here into safetensors' open) gets one line
    naming the file; another RuntimeError is not taken for one."""
    import dflash_torch.checkpoint as checkpoint

    real = checkpoint.safe_open

    def failing(message):
        def open_(*args, **kwargs):
            raise RuntimeError(message)
        return open_

    target = str(tiny_pair[0])
    monkeypatch.setattr(checkpoint, "safe_open", failing(f"unable to mmap 1064 bytes from file <{target}/model.safetensors>:"
                                                         " Cannot allocate memory (12)"))
    assert cli_main(["generate", "x", "--target", target, "--no-draft", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dflash-torch: error: out of memory reading the weights in {target}/model.safetensors: unable to "
                   f"mmap 1064 bytes from file <{target}/model.safetensors>: Cannot allocate memory (12)\n")
    monkeypatch.setattr(checkpoint, "safe_open", failing("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                                         "can't allocate memory: you tried to allocate 10 bytes"))
    with pytest.raises(DFlashError, match=r"^out of memory reading the weights in .*: \[enforce fail .*can't allocate"):
        DFlashEngine.from_pretrained(target, no_draft=True)
    monkeypatch.setattr(checkpoint, "safe_open", failing("a bug"))
    with pytest.raises(RuntimeError, match="^a bug$"):
        DFlashEngine.from_pretrained(target, no_draft=True)
    monkeypatch.setattr(checkpoint, "safe_open", real)
    assert DFlashEngine.from_pretrained(target, no_draft=True).generate("x", max_new_tokens=2).token_ids


def test_a_drafter_without_its_target_says_the_default_target_was_used(tiny_pair, capsys):
    """``--draft`` alone pairs the drafter with the shipped target: when they do not fit, the
    error says that no target was given (not only the mismatch); with the target it is the
    mismatch alone."""
    drafter = str(tiny_pair[1])
    assert cli_main(["generate", "x", "--draft", drafter]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-torch: error: incompatible pair: ") and err.endswith(
        " (no target was given, so the shipped default target was used: give the drafter's target)\n"), err
    from dflash_torch.engine import DEFAULT_TARGET

    with pytest.raises(DFlashError, match=r"^incompatible pair: [^(]*$"):
        DFlashEngine.from_pretrained(DEFAULT_TARGET, drafter)


def _refused_in_a_worker(kwargs: dict):
    """A worker's job: a request with a bad option (run in another process)."""
    from dflash_torch.sampling import SamplingParams

    SamplingParams(**kwargs)


def test_errors_pickle_whole_so_a_process_pool_hands_them_back(engine):
    """An OptionError (most user mistakes) or a server ParamError survives pickling with its
    names: raised in a ProcessPoolExecutor worker it comes back as itself (it broke the pool,
    BrokenProcessPool for every later job, and hung multiprocessing.Pool: __init__ needs the
    option's name, which the default pickling dropped)."""
    import concurrent.futures
    import multiprocessing
    import pickle

    from dflash_torch.errors import OptionError
    from dflash_torch.serving.scheduler import ParamError

    with pytest.raises(OptionError) as err:
        engine.generate("x", max_new_tokens=0)
    errors = [err.value, OptionError("top_p must be in (0, 1]", "top_p", "temperature"), ParamError("bad n", "n"),
              ParamError("bad", None)]
    errors[1].extra = 3  # (attributes set after raising come back too)
    for e in errors:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.__dict__ == e.__dict__, (e, back)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        with pytest.raises(OptionError, match="temperature") as err:
            pool.submit(_refused_in_a_worker, {"temperature": -1}).result(timeout=120)
        assert err.value.name == "temperature"
        assert pool.submit(_refused_in_a_worker, {}).result(timeout=120) is None  # (the pool still works)


_NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]  # (root as an ordinary user: modes apply)

def _as_an_ordinary_user(tmp_path) -> list[str]:
    """The command prefix under which file modes apply to this process's children (root reads
    whatever the modes say: setpriv drops the capabilities that let it); skips the test where
    there is none."""
    import subprocess

    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes do not apply")
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    if subprocess.run([*_NO_DAC, "cat", str(probe)], capture_output=True).returncode == 0:
        pytest.skip("setpriv does not drop root's file access here")
    return _NO_DAC


_UNREADABLE_SCRIPT = r'''
import contextlib, io, json, sys
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException as exc:
            rc = repr(exc)
    out.append([rc, err.getvalue()])
for target, draft in json.loads(sys.argv[2]):
    try:
        DFlashEngine.from_pretrained(target, draft)
        out.append("loaded")
    except DFlashError as exc:
        out.append(str(exc))
    except BaseException as exc:
        out.append(repr(exc))
print(json.dumps(out))
'''


def _unreadable_run(prefix: list[str], argvs: list[list[str]], pairs: list[list[str]], **env: str) -> list:
    """Run :data:`_UNREADABLE_SCRIPT` under ``prefix`` (:func:`_as_an_ordinary_user`): each
    command line of ``argvs``, then ``from_pretrained`` of each (target, drafter) of ``pairs``
    -> its JSON output (``[rc, stderr]`` per command, ``"loaded"`` or the error per pair)."""
    import subprocess
    import sys

    proc = subprocess.run([*prefix, sys.executable, "-c", _UNREADABLE_SCRIPT, json.dumps(argvs), json.dumps(pairs)],
                          capture_output=True, text=True, timeout=600, input="",
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _weights_and_directories(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The checkpoints of :func:`test_unreadable_weights_and_checkpoint_directories_are_one_line_errors`
    (see :func:`unreadable`)."""
    target, drafter = tiny_pair
    sharded = make_target(root / "sharded", "qwen3", tokenizer=False, max_shard_size="150KB")
    copy_tokenizer(tokenizer_dir, sharded)
    shard = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    denied = "Permission denied"
    cases = []  # (target, drafter, path made unreadable, its mode, the message)
    for name, which, rel, mode in (("weights", "target", "model.safetensors", 0),
                                   ("drafter-weights", "drafter", "model.safetensors", 0),
                                   ("tokenizer", "target", "tokenizer.json", 0),
                                   ("dir-000", "target", "", 0), ("dir-444", "target", "", 0o444),
                                   ("dir-111", "target", "", 0o111), ("drafter-dir", "drafter", "", 0)):
        t, d = shutil.copytree(target, root / name / "t"), shutil.copytree(drafter, root / name / "d")
        path = (t if which == "target" else d) / rel if rel else (t if which == "target" else d)
        # (a tokenizer's error is led by target: as the target's other errors are, trial-325)
        flag = "" if rel and rel != "tokenizer.json" else f"{which.replace('drafter', 'draft')}: "
        cases.append((t, d, path, mode, f"{flag}cannot read {path}: {denied}"))
    cases.append((sharded, drafter, sharded / shard, 0, f"cannot read {sharded / shard}: {denied}"))
    argvs = [["generate", "x", "--target", str(t), "--draft", str(d)] for t, d, *_ in cases]
    for t, d, _, _, _ in (cases[0], cases[3]):
        pair = ["--target", str(t), "--draft", str(d)]
        argvs += [["chat", *pair], ["serve", *pair], ["bench", *pair, "--out", str(root / f"bench-{len(argvs)}")]]
    return {"argvs": argvs, "pairs": [[str(t), str(d)] for t, d, *_ in cases],
            "modes": [(path, mode) for _, _, path, mode, _ in cases], "cases": cases}


def _shard_in_a_subdirectory(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The checkpoint of :func:`test_a_shard_in_an_index_subdirectory_that_may_not_be_entered_is_named`."""
    _, drafter = tiny_pair
    sharded = make_target(root / "sharded", "qwen3", tokenizer=False, max_shard_size="150KB")
    copy_tokenizer(tokenizer_dir, sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (sharded / "w").mkdir()
    (sharded / shard).rename(sharded / "w" / shard)
    index["weight_map"] = {k: "w/" + v if v == shard else v for k, v in index["weight_map"].items()}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"argvs": [["generate", "x", "--target", str(sharded), "--draft", str(drafter)]],
            "pairs": [[str(sharded), str(drafter)]], "modes": [(sharded / "w", 0)], "sharded": sharded, "shard": shard}


def _linked_into_a_store(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The checkpoints of :func:`test_files_linked_into_an_unreadable_directory_are_named`."""
    target, drafter = tiny_pair
    cases = []  # (the checkpoint, the store made unreadable, the file named)
    for name, linked in (("weights", ["model.safetensors"]), ("config", None), ("tokenizer", ["tokenizer.json"])):
        store, checkpoint = root / name / "store", root / name / "linked"
        shutil.copytree(target, store)
        checkpoint.mkdir()
        for file in sorted(store.iterdir()):
            if linked is None or file.name in linked:
                (checkpoint / file.name).symlink_to(os.path.join("..", "store", file.name))
            else:
                shutil.copy(file, checkpoint / file.name)
        cases.append((checkpoint, store, checkpoint / (linked[0] if linked else "config.json")))
    return {"argvs": [["generate", "x", "--target", str(c), "--draft", str(drafter)] for c, _, _ in cases],
            "pairs": [[str(c), str(drafter)] for c, _, _ in cases], "modes": [(store, 0) for _, store, _ in cases],
            "cases": cases}


def _slow_tokenizer_files(checkpoint: Path) -> Path:
    """``checkpoint``'s tokenizer.json as the vocab.json and merges.txt of a byte-level BPE
    tokenizer (GPT2Tokenizer), without the tokenizer.json."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    (checkpoint / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (checkpoint / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    (checkpoint / "tokenizer.json").unlink()
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return checkpoint


def _vocab_or_merges(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The checkpoints of :func:`test_an_unreadable_vocab_or_merges_file_is_named`."""
    target, drafter = tiny_pair
    readable = _slow_tokenizer_files(shutil.copytree(target, root / "readable"))
    files = [shutil.copytree(readable, root / f"no-{name}") / name for name in ("vocab.json", "merges.txt")]
    return {"argvs": [["generate", "x", "--target", str(f.parent), "--draft", str(drafter)] for f in files],
            "pairs": [[str(f.parent), str(drafter)] for f in files], "modes": [(f, 0) for f in files],
            "readable": readable, "files": files}


def _files_it_does_not_need(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The checkpoints of :func:`test_an_unreadable_tokenizer_file_it_does_not_need_is_no_error`."""
    target, drafter = tiny_pair
    slow = _slow_tokenizer_files(shutil.copytree(target, root / "slow"))
    both = shutil.copytree(target, root / "both")
    files = [Path(shutil.copy(slow / name, both / name)) for name in ("vocab.json", "merges.txt")]
    model = shutil.copytree(target, root / "model")
    (model / "tokenizer.model").write_bytes(b"\0" * 64)
    files.append(model / "tokenizer.model")
    return {"argvs": [], "pairs": [[str(d), str(drafter)] for d in (both, model)], "modes": [(f, 0) for f in files]}


def _cache_repo(hub: Path, repo_id: str, source: Path, listed: tuple[str, ...] = ()) -> Path:
    """``source``'s files in the Hugging Face cache ``hub`` as huggingface_hub keeps them: blobs
    named by their hash, a snapshot of links to them, refs/main naming the snapshot; with
    ``listed``, the repo's file list as huggingface_hub 2 keeps it (``trees/COMMIT.json``): its
    files and ``listed``, files of the repo the snapshot lacks."""
    import hashlib

    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    if listed:
        files = {f.name: {"size": f.stat().st_size, "blob_id": "0" * 40} for f in source.iterdir()}
        files.update({name: {"size": 1, "blob_id": "0" * 40} for name in listed})
        (repo / "trees").mkdir()
        (repo / "trees" / f"{snapshot.name}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    return repo


def _hugging_face_cache(root: Path, tiny_pair, tokenizer_dir) -> dict:
    """The cached repos of :func:`test_unreadable_hugging_face_cache_entries_are_one_line_errors`
    (in ``root/hub``, the run's HF_HUB_CACHE: see :func:`unreadable`)."""
    target, drafter = tiny_pair
    hub = root / "hub"
    repos = {name: _cache_repo(hub, f"acme/{name}", drafter if name.startswith("d") else target,
                               ("README.md",) if name == "t-listed" else ())
             for name in ("t", "t-blobs", "t-snapshot", "t-listed", "t-ref", "t-repo", "d", "d-blobs")}
    snapshot = "snapshots/" + "a" * 40
    cases = [("t-blobs", "d", repos["t-blobs"] / "blobs", repos["t-blobs"] / snapshot / "config.json"),
             ("t-snapshot", "d", repos["t-snapshot"] / snapshot, repos["t-snapshot"] / snapshot),
             ("t-listed", "d", repos["t-listed"] / snapshot, repos["t-listed"] / snapshot),
             ("t-ref", "d", repos["t-ref"] / "refs" / "main", repos["t-ref"] / "refs" / "main"),
             ("t-repo", "d", repos["t-repo"], repos["t-repo"]),
             ("t", "d-blobs", repos["d-blobs"] / "blobs", repos["d-blobs"] / snapshot / "config.json")]
    return {"argvs": [["generate", "x", "--target", f"acme/{t}", "--draft", f"acme/{d}"] for t, d, _, _ in cases],
            "pairs": [[f"acme/{t}", f"acme/{d}"] for t, d, _, _ in cases], "modes": [(p, 0) for _, _, p, _ in cases],
            "cases": cases, "hub": hub}


_UNREADABLE_CASES = {"weights-and-directories": _weights_and_directories, "shard-in-a-subdirectory": _shard_in_a_subdirectory,
                     "linked-into-a-store": _linked_into_a_store, "vocab-or-merges": _vocab_or_merges,
                     "files-it-does-not-need": _files_it_does_not_need, "hugging-face-cache": _hugging_face_cache}


@pytest.fixture(scope="module")
def unreadable(tiny_pair, tokenizer_dir, tmp_path_factory) -> dict[str, dict]:
    """The checkpoints of each of :data:`_UNREADABLE_CASES` (by name: what its builder returned),
    with the paths of its ``modes`` made unreadable, run in one process as an ordinary user
    (:func:`_unreadable_run`; starting one costs ~4 s CPU: the tests below share it): each case's
    ``out`` is its part of the output (``[rc, stderr]`` per command line of its ``argvs``, then
    ``"loaded"`` or the error per pair of its ``pairs``). The process runs with HF_HUB_OFFLINE and
    HF_HUB_CACHE at the Hugging Face cache case's (read by huggingface_hub when imported; the
    other cases name local directories)."""
    prefix = _as_an_ordinary_user(tmp_path_factory.mktemp("probe"))
    built = {name: build(tmp_path_factory.mktemp(name), tiny_pair, tokenizer_dir)
             for name, build in _UNREADABLE_CASES.items()}
    modes = [pm for case in built.values() for pm in case["modes"]]
    restore = [(path, 0o755 if path.is_dir() else 0o644) for path, _ in modes]
    for path, mode in modes:
        path.chmod(mode)
    try:
        out = _unreadable_run(prefix, [a for case in built.values() for a in case["argvs"]],
                              [p for case in built.values() for p in case["pairs"]],
                              HF_HUB_CACHE=str(built["hugging-face-cache"]["hub"]), HF_HUB_OFFLINE="1")
    finally:
        for path, mode in restore:
            path.chmod(mode)
    commands = out[:sum(len(case["argvs"]) for case in built.values())]
    loads = out[len(commands):]
    for case in built.values():
        case["out"] = commands[:len(case["argvs"])] + loads[:len(case["pairs"])]
        commands, loads = commands[len(case["argvs"]):], loads[len(case["pairs"]):]
    assert commands == loads == []
    return built


def test_unreadable_weights_and_checkpoint_directories_are_one_line_errors(unreadable):
    """A weight file this process may not read (the target's, the drafter's, a shard of an
    index) was a traceback, ``FileNotFoundError: No such file or directory`` (safe_open's word
    for every failure to open); a checkpoint directory it may not list or enter a
    PermissionError from pathlib; from_pretrained raised them bare (and an unreadable tokenizer.json
    was "cannot load the tokenizer of DIR: [Errno 13] ..."). Each is one line naming the
    file or directory, exit 2, from generate, chat, serve and bench. Root reads whatever the
    modes say, so as root the commands run without the capabilities that let it (setpriv).
    (The process is the one :func:`unreadable` runs for every such test.)"""
    case = unreadable["weights-and-directories"]
    argvs, cases, out = case["argvs"], case["cases"], case["out"]
    cli, api = out[:len(argvs)], out[len(argvs):]
    words = [c[4] for c in cases] + [cases[i][4] for i in (0, 3) for _ in range(3)]
    for argv, (rc, err), msg in zip(argvs, cli, words, strict=True):
        msg = msg.replace("target: ", "--target: ").replace("draft: ", "--draft: ")
        assert (rc, err) == (2, f"dflash-torch: error: {msg}\n"), argv
    assert api == [c[4] for c in cases]


def test_a_shard_in_an_index_subdirectory_that_may_not_be_entered_is_named(unreadable, tiny_pair):
    """An index whose shard lies in a subdirectory (``w/SHARD``, which loads) this process may
    not enter was "cannot read DIR: Permission denied", naming the readable checkpoint
    directory; it names the path that failed."""
    case = unreadable["shard-in-a-subdirectory"]
    sharded, shard = case["sharded"], case["shard"]
    words = f"cannot read {sharded / 'w' / shard}: Permission denied"
    assert case["out"] == [[2, f"dflash-torch: error: {words}\n"], words]
    assert DFlashEngine.from_pretrained(sharded, tiny_pair[1]).drafter is not None  # (entered: it loads)


def test_files_linked_into_an_unreadable_directory_are_named(unreadable):
    """A checkpoint directory whose files are links into a directory this process may not
    enter (a store of blobs) said ``cannot read DIR`` of the readable checkpoint directory;
    the file is named (its weights, its config.json, its tokenizer.json)."""
    case = unreadable["linked-into-a-store"]
    cases, out = case["cases"], case["out"]
    words = [f"target: cannot read {file}: Permission denied" for _, _, file in cases]  # (the tokenizer's load checks
    # the links of the checkpoint's files, the weights' too: led by target: as its errors are, trial-325)
    assert out[:len(cases)] == [[2, f"dflash-torch: error: {w.replace('target: ', '--target: ')}\n"] for w in words]
    assert out[len(cases):] == words


def test_an_unreadable_vocab_or_merges_file_is_named(unreadable):
    """A tokenizer of vocab.json and merges.txt (no tokenizer.json) one of which this process
    may not read was "cannot load the tokenizer of DIR: Error while initializing BPE:
    Permission denied (os error 13)", naming neither; it is ``cannot read FILE``."""
    case = unreadable["vocab-or-merges"]
    assert DFlashEngine.from_pretrained(case["readable"], no_draft=True).tokenizer.vocab_size > 100  # (it loads)
    words = [f"target: cannot read {file}: Permission denied" for file in case["files"]]
    assert case["out"] == [[2, f"dflash-torch: error: --{w}\n"] for w in words] + words


def test_an_unreadable_tokenizer_file_it_does_not_need_is_no_error(unreadable):
    """Beside a tokenizer.json, a vocab.json and merges.txt (or a tokenizer.model) this process
    may not read are files AutoTokenizer does not open: the target loads, as transformers loads
    it (they were refused, "cannot read DIR/vocab.json", opened before loading)."""
    assert unreadable["files-it-does-not-need"]["out"] == ["loaded", "loaded"]


def test_unreadable_hugging_face_cache_entries_are_one_line_errors(unreadable):
    """A cached repo whose blobs or snapshot this process may not read (a shared HF_HOME) was a
    PermissionError traceback from pathlib, from the command line and from_pretrained; one whose
    folder or refs/main it may not read was "not in the Hugging Face cache", and so was one whose
    snapshot it may not read where huggingface_hub keeps the repo's file list. Each is
    ``cannot read PATH: Permission denied``, exit 2."""
    case = unreadable["hugging-face-cache"]
    cases, out = case["cases"], case["out"]
    words = [f"{'draft' if d.endswith('blobs') else 'target'}: cannot read {named}: Permission denied"
             for _, d, _, named in cases]
    assert out[:len(cases)] == [[2, f"dflash-torch: error: --{w}\n"] for w in words]
    assert out[len(cases):] == words


def test_a_tokenizer_without_its_vocabulary_files_is_refused(tiny_pair, tmp_path, capsys):
    """A target whose tokenizer_config.json is there but not its vocabulary (no tokenizer.json,
    vocab.json, merges.txt: a partial download) loaded transformers' tokenizer of its special
    tokens alone, one token: generate said "the prompt is empty (0 tokens)", serve answered
    token-id prompts with "". It is refused when loading (generate, the Python API, train),
    naming the files it lacks; a tokenizer a few tokens short of vocab_size still loads."""
    from dflash_torch.tokenizer import load_tokenizer

    target, drafter = tiny_pair
    bare = shutil.copytree(target, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    words = (f"target: the tokenizer of {bare} has 1 token, far fewer than the target's vocab_size (320): its vocabulary "
             "files are missing or incomplete (no tokenizer.json, tokenizer.model, vocab.json or merges.txt; an "
             "interrupted download?)")
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(bare, no_draft=True)
    assert str(err.value) == words
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(bare, drafter)
    assert str(err.value) == words
    assert cli_main(["generate", "def f(x):", "--target", str(bare), "--no-draft"]) == 2
    assert capsys.readouterr().err == f"dflash-torch: error: --{words}\n"
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    assert cli_main(["train", "--target", str(bare), "--data", str(text), "--out", str(tmp_path / "out"), "--steps", "1",
                     "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith(f"dflash-torch: error: --{words}\n")
    # a real tokenizer is often a little smaller than vocab_size (padded): down to half of it loads
    assert len(load_tokenizer(target, 320)) == len(load_tokenizer(target, 640)) == 320
    # (a whole vocabulary of too few tokens, a wrong one: the other files are not listed as missing)
    slow = _slow_tokenizer_files(shutil.copytree(target, tmp_path / "slow"))
    for checkpoint, name in ((target, "tokenizer.json"), (slow, "vocab.json and merges.txt")):
        with pytest.raises(DFlashError) as err:
            load_tokenizer(checkpoint, 641)
        assert str(err.value) == (f"the tokenizer of {checkpoint} has 320 tokens, far fewer than the target's vocab_size "
                                  f"(641): too few for this target (a wrong or incomplete {name}?)")
    with pytest.raises(DFlashError, match=r"^the tokenizer has 320 tokens but the target's vocab_size is 300: its "
                                          r"tokens 300\.\.319 \(.*\) have no row in the target's embedding$"):
        load_tokenizer(target, 300)
