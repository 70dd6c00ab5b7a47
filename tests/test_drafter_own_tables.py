"""DFlash-format drafters that ship their own embedding table and LM head
(``embed_tokens.weight`` / ``lm_head.weight``, config.json ``has_embed_tokens`` /
``has_lm_head``; e.g. NVIDIA's self-contained DFlash drafters): the drafter embeds its block
with its own table and scores its drafts with its own head, as vLLM's DFlash drafters do;
copies equal to the target's are dropped at load; the output stays the target's own.

Oracles: the tables themselves (the drafter's block rows are the table's rows, its draft
logits the head's product) and target-only decoding (speculative output)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import VOCAB, edited_checkpoint
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.drafter_config import DrafterConfig
from dflash_torch.models.drafter import DFlashDrafter

PROMPT = [5, 17, 99, 3, 42, 7]


def _target_tables(target_dir):
    w = load_file(str(target_dir / "model.safetensors"))
    table = w["model.embed_tokens.weight"]
    return table, w.get("lm_head.weight", table)


def _with_tables(drafter_dir, out, *, embed=None, head=None, config=None):
    def add(w):
        if embed is not None:
            w["embed_tokens.weight"] = embed.to(w["fc.weight"].dtype).contiguous()
        if head is not None:
            w["lm_head.weight"] = head.to(w["fc.weight"].dtype).contiguous()
    return edited_checkpoint(drafter_dir, out, state=add, config=config)


@pytest.fixture(scope="module")
def plain(agree_pair):
    target, drafter = agree_pair
    return DFlashEngine.from_pretrained(target, drafter)


def _run(engine, n=40):
    return engine.generate(PROMPT, max_new_tokens=n, ignore_eos=True)


def test_copies_of_the_target_s_tables_are_dropped_and_change_nothing(agree_pair, plain, tmp_path):
    target, drafter = agree_pair
    table, head = _target_tables(target)
    copies = DFlashEngine.from_pretrained(target, _with_tables(drafter, tmp_path / "copies", embed=table, head=head))
    assert copies.drafter.embed_tokens is None and copies.drafter.lm_head is None  # (shared with the target)
    assert copies.drafter.config.own_embedding and copies.drafter.config.own_lm_head
    a, b = _run(plain), _run(copies)
    assert a.token_ids == b.token_ids and a.stats.acceptance_lengths == b.stats.acceptance_lengths


def test_a_table_and_head_of_its_own_are_used_and_the_output_stays_the_target_s(agree_pair, plain, tmp_path):
    """Other tables than the target's: the block rows are the drafter's table's rows, the draft
    logits its head's, the drafts (and so the acceptance) change, the tokens do not."""
    target, drafter = agree_pair
    hidden = plain.target.config.hidden_size
    g = torch.Generator().manual_seed(3)
    own_embed, own_head = torch.randn(VOCAB, hidden, generator=g), torch.randn(VOCAB, hidden, generator=g) * 0.05
    engine = DFlashEngine.from_pretrained(target, _with_tables(drafter, tmp_path / "own", embed=own_embed, head=own_head))
    d = engine.drafter
    assert d.embed_tokens is not None and d.lm_head is not None
    ids = torch.tensor([3, 4, 250])
    torch.testing.assert_close(d.embed(engine.target, ids), own_embed[ids].to(d.embed_tokens.weight.dtype),
                               rtol=0, atol=0)
    rows = torch.randn(2, hidden, generator=g).to(d.lm_head.weight.dtype)
    torch.testing.assert_close(d.draft_logits(engine.target, rows), rows @ d.lm_head.weight.T)
    assert not torch.allclose(d.draft_logits(engine.target, rows), plain.drafter.draft_logits(plain.target, rows))
    a, b = _run(plain), _run(engine)
    assert b.token_ids == a.token_ids  # (lossless whatever it drafts)
    assert b.stats.acceptance_lengths != a.stats.acceptance_lengths  # (its own tables do draft otherwise)
    alone = DFlashEngine.from_pretrained(target, no_draft=True).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert b.token_ids == alone.token_ids


def test_has_embed_tokens_and_has_lm_head_are_checked_against_the_checkpoint(agree_pair, tmp_path):
    target, drafter = agree_pair
    table, _ = _target_tables(target)
    said = _with_tables(drafter, tmp_path / "said", config=lambda c: c.update(has_embed_tokens=True))
    with pytest.raises(DFlashError, match=r"drafter checkpoint .* lacks weights: embed_tokens\.weight$"):
        DFlashDrafter.from_pretrained(said, torch.float32)
    denied = _with_tables(drafter, tmp_path / "denied", embed=table, config=lambda c: c.update(has_embed_tokens=False))
    with pytest.raises(DFlashError, match=r"ships embed_tokens\.weight but its config\.json says has_embed_tokens: "
                                          r"false \(set it true .*\)$"):
        DFlashDrafter.from_pretrained(denied, torch.float32)
    no_vocab = _with_tables(drafter, tmp_path / "no-vocab", embed=table, config=lambda c: c.pop("vocab_size"))
    with pytest.raises(DFlashError, match=r"ships its own embed_tokens / lm_head, but its config\.json has no "
                                          r"vocab_size"):
        DFlashDrafter.from_pretrained(no_vocab, torch.float32)
    wrong = _with_tables(drafter, tmp_path / "wrong", head=table[:, :8])
    with pytest.raises(DFlashError, match=r"drafter weight lm_head\.weight has shape \(\d+, 8\), config implies"):
        DFlashDrafter.from_pretrained(wrong, torch.float32)


@pytest.mark.parametrize("extra,message", [
    ({"has_embed_tokens": "yes"}, r"^drafter config.json has_embed_tokens must be true or false, got 'yes'$"),
    ({"has_lm_head": True, "vocab_size": None}, r"^drafter config.json has_embed_tokens / has_lm_head true needs "
                                                r"vocab_size"),
])
def test_bad_own_table_keys_are_refused_in_one_line(agree_pair, extra, message):
    _, drafter = agree_pair
    cfg = {**json.loads((drafter / "config.json").read_text()), **extra}
    with pytest.raises(DFlashError, match=message):
        DrafterConfig.from_dict(cfg)


def test_a_dflash2_drafter_s_own_tables_copies_dropped_others_used(agree_dflash2_pair, tmp_path):
    """DFlash 2: copies of the target's tables (config.json silent) are dropped and change
    nothing; other tables are used (its head's logits feed the selector's unary scores) and
    the output stays the target's own."""
    target, drafter = agree_dflash2_pair
    plain = DFlashEngine.from_pretrained(target, drafter)
    table, head = _target_tables(target)
    copies = DFlashEngine.from_pretrained(target, _with_tables(drafter, tmp_path / "copies", embed=table, head=head))
    assert copies.drafter.embed_tokens is None and copies.drafter.lm_head is None
    assert copies.drafter.config.own_embedding and copies.drafter.config.own_lm_head
    a, b = _run(plain), _run(copies)
    assert a.token_ids == b.token_ids and a.stats.acceptance_lengths == b.stats.acceptance_lengths
    hidden = plain.target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    own_embed, own_head = torch.randn(VOCAB, hidden, generator=g), torch.randn(VOCAB, hidden, generator=g) * 0.05
    engine = DFlashEngine.from_pretrained(target, _with_tables(drafter, tmp_path / "own", embed=own_embed, head=own_head,
                                                               config=lambda c: c.update(has_embed_tokens=True,
                                                                                         has_lm_head=True)))
    d = engine.drafter
    rows = torch.randn(2, hidden, generator=g).to(d.lm_head.weight.dtype)
    torch.testing.assert_close(d.draft_logits(engine.target, rows), d.unary_scores(rows @ d.lm_head.weight.T))
    ids = torch.tensor([3, 4, 250])
    torch.testing.assert_close(d.embed(engine.target, ids), own_embed[ids].to(d.embed_tokens.weight.dtype),
                               rtol=0, atol=0)
    c = _run(engine)
    assert c.token_ids == a.token_ids  # (lossless whatever it drafts)
    assert c.stats.acceptance_lengths != a.stats.acceptance_lengths  # (its own tables do draft otherwise)


def test_the_config_written_says_what_it_has():
    base = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, attention_bias=False,
                block_size=8, mask_token_id=3, target_layer_ids=[1], num_target_layers=4, vocab_size=VOCAB,
                sliding_windows=[None])
    written = DrafterConfig(**base, own_embedding=True).to_dict()
    assert written["has_embed_tokens"] is True and "has_lm_head" not in written
    assert DrafterConfig.from_dict(written).own_embedding is True
    assert "has_embed_tokens" not in DrafterConfig(**base).to_dict()


def test_training_from_a_drafter_with_tables_of_its_own_is_refused_in_one_line(agree_pair, tmp_path):
    from dflash_torch.models.target import TargetModel
    from dflash_torch.training.trainer import TrainConfig, load_init_drafter

    target, drafter = agree_pair
    table, _ = _target_tables(target)
    source = _with_tables(drafter, tmp_path / "own", embed=table)
    cfg = TrainConfig(target=str(target), data=[], out=str(tmp_path / "out"), init_from=str(source))
    with pytest.raises(DFlashError, match=r"^init_from .* ships its own embedding table / LM head; dflash-torch "
                                          r"trains drafters that read the target's"):
        load_init_drafter(cfg, TargetModel.from_pretrained(target, torch.float32).config)


def test_a_learned_mask_embedding_file_is_refused_not_ignored(agree_dflash2_pair, tmp_path):
    """A drafter shipping mask_embedding.pt (a community DFlash 2 drafter's learned mask
    embedding, a pickle beside its safetensors) is refused in one line, not run without it."""
    _, drafter = agree_dflash2_pair
    d = edited_checkpoint(drafter, tmp_path / "mask")
    torch.save(torch.zeros(8), d / "mask_embedding.pt")
    with pytest.raises(DFlashError, match=r"^drafter .* ships mask_embedding\.pt \(a learned mask-token embedding "
                                          r"outside its safetensors\); .* does not read that file$"):
        DFlashDrafter.from_pretrained(d, torch.float32)
