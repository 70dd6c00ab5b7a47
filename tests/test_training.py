"""Drafter training: the block mask, the batched training forward against the
inference path, loss going down, export -> loader -> engine, deterministic resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.drafter import DFlashDrafter, InjectedContext
from dflash_torch.models.target import TargetModel
from dflash_torch.training.data import collate, read_corpus, tokenize_conversation
from dflash_torch.training.objective import (
    batch_loss, block_attention_mask, block_inputs, copy_target_layers, drafter_blocks_forward, greedy_walk, sample_anchors,
    target_features,
)
from dflash_torch.training.trainer import TrainConfig, Trainer

from conftest import corpus_texts, drafter_config, save_drafter


def dense_reference_mask(anchors: list[int], T: int, B: int) -> torch.Tensor:
    """The block attention mask built key by key."""
    n = len(anchors)
    m = torch.zeros(n * B, T + n * B, dtype=torch.bool)
    for i, a in enumerate(anchors):
        for k in range(B):
            row = i * B + k
            for p in range(T):
                m[row, p] = p < a
            for j in range(n):
                for kk in range(B):
                    m[row, T + j * B + kk] = j == i
    return m


def test_block_mask_matches_dense_reference():
    T, B = 23, 4
    anchors = torch.tensor([[1, 5, 6, 20], [3, 3, 9, 12]])
    got = block_attention_mask(anchors, T, B)
    for s in range(anchors.shape[0]):
        assert torch.equal(got[s], dense_reference_mask(anchors[s].tolist(), T, B))


def test_sample_anchors_respects_lengths_and_loss_mask():
    lengths = torch.tensor([10, 4])
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 6:10] = True
    mask[1, :4] = True
    anchors, valid = sample_anchors(lengths, mask, 8, torch.Generator().manual_seed(0))
    assert sorted(anchors[0][valid[0]].tolist()) == [5, 6, 7, 8]
    assert sorted(anchors[1][valid[1]].tolist()) == [1, 2]


@pytest.mark.parametrize("B", [16, 5])
def test_training_forward_equals_inference_path(tiny_pair, B):
    target_dir, _ = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    cfg = drafter_config(target_dir, num_layers=2, block_size=B)
    drafter = DFlashDrafter.from_pretrained(save_drafter(target_dir.parent / f"eq-drafter-{B}", cfg, seed=3), torch.float32)
    g = torch.Generator().manual_seed(1)
    T = 40
    ids = torch.randint(2, 320, (2, T), generator=g)
    lengths = torch.tensor([T, 31])
    loss_mask = torch.arange(T)[None, :] < lengths[:, None]
    anchors, valid = sample_anchors(lengths, loss_mask, 6, g)
    assert valid.all()
    with torch.no_grad():
        feats = target_features(target, ids, lengths, cfg.target_layer_ids)
        tokens, positions = block_inputs(ids, anchors, B, cfg.mask_token_id)
        dense = target.logits(drafter_blocks_forward(drafter, target, feats, tokens, positions, block_attention_mask(anchors, T, B)))
        train_logits = target.logits(drafter_blocks_forward(drafter, target, feats, tokens, positions))
        for s in range(2):
            for i, a in enumerate(anchors[s].tolist()):
                ctx = InjectedContext(drafter)
                ctx.reset(a + B)
                ctx.inject(drafter, feats[s, :a], torch.arange(a))
                h = drafter(target.embed(tokens[s, i]), torch.arange(a, a + B), ctx, a + B)
                ref = target.logits(h)
                torch.testing.assert_close(train_logits[s, i], ref, atol=1e-5, rtol=0)
                torch.testing.assert_close(dense[s, i], ref, atol=1e-5, rtol=0)


def _jsonl(path: Path) -> Path:
    texts = corpus_texts(60_000)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "sort a list"},
                                         {"role": "assistant", "content": "def f(x):\n    return sorted(x)\n"}]}) + "\n")
    return path


def _cfg(tmp: Path, target: Path, data: Path, **kw) -> TrainConfig:
    base = dict(target=str(target), data=[str(data)], out=str(tmp / "out"), work_dir=str(tmp / "work"), num_layers=1,
                block_size=8, steps=6, batch=2, seq_len=64, anchors_per_seq=8, lr=3e-3, warmup_steps=2,
                eval_every=1000, ckpt_every=1000, log_every=1, val_seqs=2, progress=False, seed=7)
    base.update(kw)
    return TrainConfig(**base)


def test_read_corpus_and_chat_loss_mask(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    corpus = read_corpus([_jsonl(tmp_path / "d.jsonl")])
    assert len(corpus.documents) >= 1 and len(corpus.conversations) == 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    ex = tokenize_conversation(tok, corpus.conversations[0])
    answer = tok.decode(ex.ids[ex.loss_mask].tolist())
    assert "sorted(x)" in answer and "sort a list" not in answer
    # a directory reads its .jsonl files as records too (and refuses malformed ones)
    (tmp_path / "dir").mkdir()
    _jsonl(tmp_path / "dir" / "d.jsonl")
    (tmp_path / "dir" / "notes.txt").write_text("plain text")
    in_dir = read_corpus([tmp_path / "dir"])
    assert len(in_dir.conversations) == 1 and "plain text" in in_dir.documents
    (tmp_path / "dir" / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DFlashError):
        read_corpus([tmp_path / "dir"])


def test_training_reduces_loss_and_exports_loadable_drafter(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    cfg = _cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=100, self_distill=6, self_distill_batch=4,
               prefix_min=8, prefix_max=24, warmup_steps=3, lr=3e-3, raw_fraction=0.0)
    info = Trainer(cfg, log=lambda m: None).run()
    losses = [h["loss"] for h in info["loss_history"]]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:3]) / 3, losses
    assert info["data"]["distilled_sequences"] == 6
    out = Path(cfg.out)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["block_size"] == 8
    assert conf["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [2]}
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(out / "model.safetensors")).values())
    spec = DFlashEngine.from_pretrained(target_dir, out)
    base = DFlashEngine.from_pretrained(target_dir, no_draft=True)
    blob = torch.load(next(Path(cfg.work_dir).glob("data-*.pt")), weights_only=False)
    accepted_any = False
    for ids, mask in blob["distilled"][:3]:  # prompts the drafter was trained on: it accepts drafts there
        prompt = ids[:int(mask.float().argmax())].tolist()
        a = spec.generate(prompt, max_new_tokens=40, ignore_eos=True)
        b = base.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert a.token_ids == b.token_ids
        # replaying the rounds on the known greedy sequence gives the engine's own taus
        taus = greedy_walk(spec.drafter, spec.target, torch.tensor(prompt + b.token_ids), len(prompt))
        assert taus and taus == a.stats.acceptance_lengths[:len(taus)], (taus, a.stats.acceptance_lengths)
        accepted_any |= max(taus) > 1
    assert accepted_any


def test_resume_continues_identically(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    full = _cfg(tmp_path / "a", target_dir, data, steps=4)
    Trainer(full, log=lambda m: None).run()
    half = _cfg(tmp_path / "b", target_dir, data, steps=4)
    half.steps = 2
    Trainer(half, log=lambda m: None).run()
    half.steps, half.resume = 4, True
    info = Trainer(half, log=lambda m: None).run()
    assert info["steps"] == 4
    a = torch.load(Path(full.work_dir) / "checkpoint.pt", weights_only=False)
    b = torch.load(Path(half.work_dir) / "checkpoint.pt", weights_only=False)
    for k in a["drafter"]:
        assert torch.equal(a["drafter"][k], b["drafter"][k]), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


def test_init_from_target_reproduces_target_layer_context_kv(tiny_pair):
    target_dir, _ = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    cfg = drafter_config(target_dir, num_layers=2)  # L = 4: ids [1, 1], copies layers 2 and 3
    drafter = DFlashDrafter(cfg)
    copy_target_layers(drafter, target)
    ids = torch.randint(2, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids, torch.tensor([12]), cfg.target_layer_ids)[0]
    # the input of target layer 2 is the output of layer 1
    h1 = target_features(target, ids, torch.tensor([12]), [1])[0]
    layer = target.model.layers[2]
    pos = torch.arange(12)
    cos, sin = target.rotary.cos_sin(pos, torch.float32)
    k_ref, v_ref = layer.self_attn.key_value(layer.input_layernorm(h1), cos, sin)
    k, v = drafter.context_kv(feats, pos)[0]
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)


@pytest.mark.parametrize("case", ["out-is-target", "out-holds-drafter", "work-holds-checkpoint", "short-seq", "save-float16"])
def test_train_refuses_unsafe_or_useless_options_before_training(tiny_pair, tmp_path, capsys, case):
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--steps", "1", "--no-progress"]
    words = {"out-is-target": "target's directory", "out-holds-drafter": "--overwrite",
             "work-holds-checkpoint": "--resume", "short-seq": "--seq-len", "save-float16": "float16"}[case]
    if case == "out-is-target":
        args[args.index("--out") + 1] = str(target)
    elif case == "out-holds-drafter":
        shutil.copytree(drafter, out)
    elif case == "work-holds-checkpoint":
        (out / "train_work").mkdir(parents=True)
        (out / "train_work" / "checkpoint.pt").write_bytes(b"x")
    elif case == "short-seq":
        args += ["--seq-len", "16", "--block-size", "16"]
    else:
        args += ["--save-dtype", "float16"]
    target_files = {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()}
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()} == target_files
    if case == "out-holds-drafter":  # and --overwrite is the way through
        assert cli_main(args + ["--overwrite", "--batch", "2", "--seq-len", "64", "--val-seqs", "0"]) == 0
        assert (out / "model.safetensors").stat().st_mode & 0o644 == 0o644
