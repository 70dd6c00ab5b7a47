"""Drafter training: the block mask, the batched training forward against the
inference path, loss going down, export -> loader -> engine, deterministic resume."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.errors import shown
from dflash_torch.models.drafter import DFlashDrafter, InjectedContext
from dflash_torch.models.target import TargetModel
from dflash_torch.training.data import read_corpus, tokenize_conversation
from dflash_torch.training.objective import (
    block_attention_mask, block_inputs, copy_target_layers, drafter_blocks_forward, greedy_walk, sample_anchors,
    target_features,
)
from dflash_torch.training.runlock import LOCK_NAME
from dflash_torch.training.trainer import TrainConfig, Trainer, init_from_target_note

from conftest import copy_tokenizer, corpus_texts, dflash2_config, drafter_config, make_hybrid_target, save_drafter, run_forked


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


@pytest.mark.parametrize("arch", ["dflash", "dflash2", "sliding", "sliding-noncausal"])
@pytest.mark.parametrize("B", [16, 5])
def test_training_forward_equals_inference_path(tiny_pair, B, arch):
    """All blocks of a batch in one forward (block mask; DFlash 2: convolutions within each
    block, the embedding scale; sliding: layers with sliding windows of 6 and 3 beside a
    full one, as drafters for Gemma 4 / gpt-oss have, their blocks causal (the format's
    default rule) or not) give the logits of the inference path, block by block."""
    target_dir, _ = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    if arch == "dflash":
        cfg = drafter_config(target_dir, num_layers=2, block_size=B)
    elif arch.startswith("sliding"):
        cfg = drafter_config(target_dir, num_layers=3, block_size=B)
        cfg.sliding_windows = [6, 3, None]
        cfg.causal_layers = [False] * 3 if arch == "sliding-noncausal" else [True, True, False]
    else:
        cfg = dflash2_config(target_dir, num_layers=2, block_size=B, taps=3)
        cfg.dflash2.input_embedding_scale = 1.25
    path = save_drafter(target_dir.parent / f"eq-drafter-{arch}-{B}", cfg, seed=3)
    drafter = DFlashDrafter.from_pretrained(path, torch.float32)
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


def test_selector_loss_matches_a_loop_reference(tiny_pair, tmp_path):
    from dflash_torch.training.objective import selector_loss, slot_weights

    target_dir, _ = tiny_pair
    drafter = DFlashDrafter.from_pretrained(save_drafter(tmp_path / "v2", dflash2_config(target_dir, top_k=5), seed=1),
                                            torch.float32)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(0)
    b, n, S = 2, 3, 4
    hidden = torch.randn(b, n, S, 64, generator=g)
    unary = torch.randn(b, n, S, 320, generator=g)
    anchors = torch.randint(0, 320, (b, n), generator=g)
    labels = torch.randint(0, 320, (b, n, S), generator=g)
    top = unary.topk(5, dim=-1).indices
    labels[..., ::2] = top[..., ::2, 2]  # every other slot's label is a candidate (rank 2)
    labels[0, 0, 1] = top[0, 0, 1, 0]
    valid = torch.rand(b, n, S, generator=g) > 0.2
    got, weight = selector_loss(drafter, hidden, unary, anchors, labels, valid, gamma=3.0)
    w = slot_weights(S, 3.0)
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            for k in range(S):
                cands = unary[i, j, k].topk(5).indices.tolist()
                if not valid[i, j, k] or int(labels[i, j, k]) not in cands:
                    continue
                pred = int(anchors[i, j]) if k == 0 else int(labels[i, j, k - 1])
                h = sel.hidden_projection.weight @ hidden[i, j, k]
                scores = torch.stack([unary[i, j, k, c] + (sel.predecessor_codebook[pred] * h * sel.successor_codebook[c]).sum()
                                      for c in cands])
                ce = -torch.log_softmax(scores, 0)[cands.index(int(labels[i, j, k]))]
                num, den = num + w[k] * ce, den + w[k]
    assert den > 0
    torch.testing.assert_close(got, num / den)
    assert weight == pytest.approx(float(den))
    got, weight = selector_loss(drafter, hidden, unary, anchors, labels, torch.zeros_like(valid), gamma=3.0)
    assert weight == 0.0 and float(got.detach()) == 0.0  # no slot counts: no measurement
    # batch_loss reports it as no value (validation's mean skips it; it read 0.0 before)
    from dflash_torch.training.objective import batch_loss, sample_anchors
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    ids = torch.randint(0, 320, (2, 24), generator=g)
    lengths, mask = torch.tensor([24, 24]), torch.ones(2, 24, dtype=torch.bool)
    anchors, ok = sample_anchors(lengths, mask, 3, g)
    assert bool(ok.any())
    out = batch_loss(drafter, target, ids, lengths, mask, anchors, ok, 3.0)
    assert out.selector_loss is not None and out.selector_weight_sum > 0
    out = batch_loss(drafter, target, ids, lengths, mask, anchors, torch.zeros_like(ok), 3.0)
    assert out.selector_loss is None and out.selector_weight_sum == 0.0


def _jsonl(path: Path) -> Path:
    texts = corpus_texts(60_000)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "sort a list"},
                                         {"role": "assistant", "content": "def f(x):\n    return sorted(x)\n"}]}) + "\n")
    return path


def _cli_flags() -> dict[str, str]:
    """``dflash-torch train``'s flag of each field (``Trainer(flags=)``, as the command line gives it)."""
    from dflash_torch.cli import build_parser

    return build_parser().parse_args(["train", "--target", "t", "--data", "d", "--out", "o"]).option_flags


def _as_cli(err: DFlashError) -> str:
    """``err``'s message as ``dflash-torch train`` says it (the fields an OptionError names, as flags)."""
    from dflash_torch.cli import error_message

    return error_message(err, _cli_flags())


def _cfg(tmp: Path, target: Path, data: Path, **kw) -> TrainConfig:
    base = dict(target=str(target), data=[str(data)], out=str(tmp / "out"), work_dir=str(tmp / "work"), num_layers=1,
                block_size=8, steps=6, batch=2, seq_len=64, anchors_per_seq=8, lr=3e-3, warmup_steps=2,
                eval_every=1000, ckpt_every=1000, log_every=1, val_seqs=2, progress=False, seed=7)
    base.update(kw)
    return TrainConfig(**base)


def test_a_conversation_that_opens_with_the_assistant_trains_and_self_distills(tiny_pair):
    """An assistant turn with no turn before it: its whole rendering carries the loss, and
    its self-distill prompt is empty (skipped); both raised transformers' "Cannot apply
    chat template to an empty conversation" ValueError traceback."""
    from transformers import AutoTokenizer

    from dflash_torch.training.data import Corpus, chat_prompt
    from dflash_torch.training.distill import distill_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    messages = [{"role": "assistant", "content": "def f(x):\n    return sorted(x)\n"}]
    ex = tokenize_conversation(tok, messages)  # (the loss on the reply, not on the turn's header: helper-30)
    assert tok.decode(ex.ids[ex.loss_mask].tolist()).strip() == "def f(x):\n    return sorted(x)"
    assert not ex.loss_mask[0] and "# assistant:" in tok.decode(ex.ids.tolist())
    assert chat_prompt(tok, messages) == []
    prompts, _ = distill_prompts(tok, Corpus(documents=[], conversations=[messages]), 2, 64)
    assert prompts == []


# Qwen3's way: an empty think block in the last assistant turn only (earlier turns render without it)
LAST_TURN_DIFFERS = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant' + '\\n' }}"
    "{% if loop.last %}{{ '<think>' + '\\n\\n' + '</think>' + '\\n\\n' }}{% endif %}"
    "{{ m.content + '<|im_end|>' + '\\n' }}{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant' + '\\n' }}{% endif %}")


# Qwen3's reasoning rule: a reply after the last user turn shows its <think> block (empty if none), earlier
# replies are rendered without their reasoning
QWEN3_REASONING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set answer = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{% set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in m.content "
    "else '' %}{{ '<|im_start|>assistant' + '\\n' }}"
    "{% if loop.index0 > ns.last %}{{ '<think>' + '\\n' + thought + '\\n' + '</think>' + '\\n\\n' }}{% endif %}"
    "{{ answer + '<|im_end|>' + '\\n' }}{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant' + '\\n' }}{% endif %}")
# Phi-3's: the end-of-text token after the last turn when no generation prompt follows
PHI3 = ("{% for m in messages %}{{ '<|' + m.role + '|>' + '\\n' + m.content + '<|end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% else %}{{ eos_token }}{% endif %}")


def _masked_spans(tok, ex) -> list[str]:
    spans, run = [], []
    for token, masked in zip(ex.ids.tolist() + [None], ex.loss_mask.tolist() + [False]):
        if masked:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans


@pytest.mark.parametrize("template", ["tests", "last-turn-differs"])
def test_chat_loss_covers_the_assistant_turns_exactly(tiny_pair, template):
    """The loss lies on each assistant turn: from where the text departs from the
    generation prompt to the turn's end, never into the next user turn. A template that
    renders the last assistant turn differently (helper-24: the mask ran 4 tokens into the
    next user turn) and one whose turn does not start with its generation prompt's text
    (the tests' "# assistant:" + line end, the mask started a token late)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    if template == "last-turn-differs":
        tok.chat_template = LAST_TURN_DIFFERS
    messages = [{"role": "user", "content": "write a function"}, {"role": "assistant", "content": "def f(x): return x"},
                {"role": "user", "content": "more please"}, {"role": "assistant", "content": "import os"}]
    spans = _masked_spans(tok, tokenize_conversation(tok, messages))
    if template == "last-turn-differs":
        assert spans == ["def f(x): return x<|im_end|>\n", "<think>\n\n</think>\n\nimport os<|im_end|>\n"]
    else:
        assert [s.strip() for s in spans] == ["def f(x): return x", "import os"]
    # cut inside the second turn: the first stays whole, the second is covered up to the cut
    full = tokenize_conversation(tok, messages)
    cut = tokenize_conversation(tok, messages, max_len=len(full.ids) - 2)
    assert torch.equal(cut.ids, full.ids[:-2]) and torch.equal(cut.loss_mask, full.loss_mask[:-2])
    # cut before the first reply: no loss at all (it was on every token: the user's text)
    early = tokenize_conversation(tok, messages, max_len=4)
    assert len(early.ids) == 4 and not early.loss_mask.any() and not early.whole


@pytest.mark.parametrize("template, messages, want", [
    # earlier replies lose their reasoning, the last shows it (helper-28: every token carried the loss)
    ("qwen3", [("user", "USR a"), ("assistant", "<think>\nR1\n</think>\n\nANS one"), ("user", "USR b"),
               ("assistant", "<think>\nR2\n</think>\n\nANS two")],
     ["ANS one<|im_end|>\n", "<think>\nR2\n</think>\n\nANS two<|im_end|>\n"]),
    ("qwen3", [("user", "USR a"), ("assistant", ""), ("user", "USR b"), ("assistant", "ANS z")],  # an empty reply
     ["<|im_end|>\n", "<think>\n\n</think>\n\nANS z<|im_end|>\n"]),
    ("qwen3", [("user", "USR a"), ("assistant", "<think>\nR\n</think>\n\nline 1\nline 2"), ("user", "USR b"),
               ("assistant", "line 1\nline 2")],  # the same answer twice
     ["line 1\nline 2<|im_end|>\n", "<think>\n\n</think>\n\nline 1\nline 2<|im_end|>\n"]),
    ("phi3", [("user", "USR a"), ("assistant", "ANS one"), ("user", "USR b"), ("assistant", "ANS two")],
     ["ANS one<|end|>\n", "ANS two<|end|>\n"]),  # (not the end-of-text after the last turn: helper-30)
    # a short next message that the reply itself contains (helper-30: every token carried the loss)
    ("qwen3", [("user", "What is 2+2?"), ("assistant", "The answer is 4."), ("user", "4"), ("assistant", "Yes, 4.")],
     ["The answer is 4.<|im_end|>\n", "<think>\n\n</think>\n\nYes, 4.<|im_end|>\n"]),
    ("phi3", [("user", "Is it ok?"), ("assistant", "It is ok."), ("user", "ok"), ("assistant", "Good.")],
     ["It is ok.<|end|>\n", "Good.<|end|>\n"]),
    # opening with the reply: not what the template writes before it
    ("qwen3", [("assistant", "Welcome, ask me."), ("user", "ok"), ("assistant", "fine")],
     ["Welcome, ask me.<|im_end|>\n", "<think>\n\n</think>\n\nfine<|im_end|>\n"]),
])
def test_chat_loss_with_templates_that_render_earlier_turns_otherwise(tiny_pair, template, messages, want):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = QWEN3_REASONING if template == "qwen3" else PHI3
    ex = tokenize_conversation(tok, [{"role": r, "content": c} for r, c in messages])
    assert not ex.whole and _masked_spans(tok, ex) == want
    # a template that does not write the replies at all: not found, so the loss covers every token (and says so)
    tok.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    ex = tokenize_conversation(tok, [{"role": r, "content": c} for r, c in messages])
    assert ex.whole and ex.loss_mask.all()


# Mistral v0.3's way: the system prompt goes into the last user turn (of a conversation that ends with one)
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
           "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}{% for m in turns %}"
           "{% if m.role == 'user' %}{% if loop.last and system is defined %}{{ '[INST] ' + system + '\\n\\n' + m.content"
           " + '[/INST]' }}{% else %}{{ '[INST] ' + m.content + '[/INST]' }}{% endif %}"
           "{% else %}{{ ' ' + m.content|trim + eos_token }}{% endif %}{% endfor %}")
# a header that counts the messages: every earlier turn's rendering alone differs from the conversation's
COUNTED = ("Conversation of {{ messages|length }} messages\n{% for m in messages %}{{ '# ' + m.role + ': ' + m.content"
           " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '# assistant: ' }}{% endif %}")


@pytest.mark.parametrize("template, system, want", [
    ("mistral", False, [" Hello!<|endoftext|>", " Sure thing.<|endoftext|>"]),
    # (found by their contents: from the reply's first character, the space the template writes before it not)
    ("mistral", True, ["Hello!<|endoftext|>", "Sure thing.<|endoftext|>"]),
    ("counted", False, ["Hello!\n", "Sure thing.\n"]), ("counted", True, ["Hello!\n", "Sure thing.\n"]),
    ("counted-upper", True, None)])
def test_chat_loss_never_lies_on_user_turns_the_template_renders_otherwise_later(tiny_pair, template, system, want):
    """A template that renders the turns before a reply otherwise once the conversation goes
    on: the generation prompt departs from the text inside a user turn, and the loss covered
    the user's text with no WARNING (trial-91). The replies are found by their contents'
    places instead; where those cannot be found either (a template that changes the text),
    the conversation trains on all its tokens (``whole``, counted in the WARNING line)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = {"mistral": MISTRAL, "counted": COUNTED,
                         "counted-upper": COUNTED.replace("m.content", "m.content|upper")}[template]
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "More please"}, {"role": "assistant", "content": "Sure thing."}]
    if system:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    ex = tokenize_conversation(tok, messages)
    if want is None:
        assert ex.whole and ex.loss_mask.all()
    else:
        assert not ex.whole and _masked_spans(tok, ex) == want


# --- the loss mask of chat data, checked against where each message's text lies -------------
# Templates in the styles of real families (written for these tests): each message's text, character by character,
# is found by rendering it with every content character replaced by one naming its message (the oracle).
STYLE_TEMPLATES = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "qwen3-reasoning": QWEN3_REASONING,
    # Qwen3.5's guard: a conversation (or a part of one) with no user turn is refused
    "user-guard": ("{% set ns = namespace(user=false) %}{% for m in messages %}{% if m.role == 'user' %}"
                   "{% set ns.user = true %}{% endif %}{% endfor %}{% if not ns.user %}"
                   "{{ raise_exception('No user turn in these messages.') }}{% endif %}" + LAST_TURN_DIFFERS),
    "phi3": PHI3,
    # Phi-3's own: roles other than system, user and assistant are not written
    "phi3-drops-tools": ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
                         "{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"),
    # gpt-oss's: the last reply closes with <|return|>, a reply a generation prompt follows with <|end|>
    "harmony": ("{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>'"
                " + m.content }}{% if loop.last and not add_generation_prompt %}{{ '<|return|>' }}{% else %}"
                "{{ '<|end|>' }}{% endif %}{% else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n'"
               " + m.content|trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "gemma": ("{% for m in messages %}{% set role = 'model' if m.role == 'assistant' else 'user' %}"
              "{{ '<start_of_turn>' + role + '\\n' + m.content|trim + '<end_of_turn>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
    # DeepSeek-R1's: the generation prompt opens the reasoning, "<think>\\n"
    "r1": ("{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}{% elif m.role == 'assistant' %}"
           "{{ '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"),
    "mistral": MISTRAL,
    "counted": COUNTED,
    # </s> after the last reply only, turns apart by a space: a closing taken up to a line end after an earlier reply
    # ran over "USER: " into the user's first word (trial-98)
    "space-apart": ("{% for m in messages %}{% if m.role == 'assistant' %}{{ 'ASSISTANT: ' + m.content }}"
                    "{% if loop.last %}{{ '</s>' }}{% else %}{{ ' ' }}{% endif %}{% else %}"
                    "{{ m.role|upper + ': ' + m.content + ' ' }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
    "no-closing-last": ("{% for m in messages %}{% if m.role == 'assistant' %}{{ 'ASSISTANT: ' + m.content }}"
                        "{% if not loop.last %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% else %}"
                        "{{ m.role|upper + ': ' + m.content + '\\n' }}{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
}


def _conversations() -> dict[str, list[dict]]:
    def u(c):
        return {"role": "user", "content": c}

    def a(c):
        return {"role": "assistant", "content": c}
    base = [u("Hi there"), a("Hello! How can I help?"), u("Tell me a joke"), a("Why did the chicken cross?")]
    return {
        "base": base, "system": [{"role": "system", "content": "You are terse."}, *base],
        "empty-user-between-same-replies": [u("Can you help me?"), a("Sure."), u(""), a("Sure."),
                                            u("Thanks! My card number is 1234."), a("Sure.")],
        "tool-between": [u("q"), a("ans"), {"role": "tool", "content": "res"}, u("secret"), a("ans")],
        "greeting-first": [{"role": "system", "content": "Be kind."}, a("Hi, how can I help?"),
                           u("What is 2+2?"), a("4")],
        "reply-starts-with-lt": [u("Write HTML"), a("<html><body>hi</body></html>")],
        "empty-reply": [u("Hi"), a(""), u("More"), a("Yes.")],
        "same-reply-thrice": [u("a"), a("ok"), u("b"), a("ok"), u("c"), a("ok")],
        "reply-holds-user-text": [u("4"), a("The answer is 4."), u("hi"), a("hi, 4 again")],
        "multiline": [u("list\nthings"), a("one\ntwo\n"), u("more"), a("\nthree\n")],
        "replies-end-in-markup": [u("code"), a("Sure:\n```\nx = 1\n```\n"), u("bold"), a("<b>bold</b>")],
    }


# the closing markers STYLE_TEMPLATES write after a reply: each one after a reply's text must carry the loss
CLOSINGS = ["<|im_end|>", "<|end|>", "<|return|>", "<|eot_id|>", "<end_of_turn>", "<｜end▁of▁sentence｜>", "</s>",
            "<|endoftext|>"]


def _owner(tok, messages: list[dict], text: str) -> list[int] | None:
    """For each character of ``text``: the index of the message whose content it is, or -1."""
    alt = [{**m, "content": "".join(c if c.isspace() else chr(0xE000 + k) for c in m["content"])}
           for k, m in enumerate(messages)]
    other = tok.apply_chat_template(alt, tokenize=False)
    if len(other) != len(text):
        return None
    owner = [ord(x) - 0xE000 if 0xE000 <= ord(x) < 0xE000 + len(messages) else -1 for x in other]
    assert all(o >= 0 or x == y for o, x, y in zip(owner, other, text))
    return owner


@pytest.mark.parametrize("template", sorted(STYLE_TEMPLATES))
def test_chat_loss_lies_on_replies_only_for_many_templates(tiny_pair, template):
    """Whatever way a reply's span is found, no character of a user's, system's or tool's
    text (or another reply's) carries the loss unless the conversation trains on all its
    tokens (``whole``, counted in the WARNING line), and each non-empty reply's text does
    (trial-94: an empty user turn between two same replies, or a tool turn Phi-3 does not
    write, put the loss on the user's text after it with no word; gpt-oss's last reply, a
    reply opening with "<" after R1's "<think>\\n", and a Qwen3.5-style guard refusing a
    partial conversation, left text of replies off the loss or refused the run). The closing
    marker written after a reply carries it too (trial-97: gpt-oss's <|return|> / <|end|> after a
    reply ending in a line end or ">" did not)."""
    from transformers import AutoTokenizer

    from dflash_torch.training.data import _token_spans

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = STYLE_TEMPLATES[template]
    if tok.bos_token is None:
        tok.bos_token = "<|endoftext|>"
    wholes = []
    for label, messages in _conversations().items():
        try:
            text = tok.apply_chat_template(messages, tokenize=False)
        except Exception:  # (a conversation the template refuses: refused as training data too)
            with pytest.raises(DFlashError):
                tokenize_conversation(tok, messages)
            continue
        ex = tokenize_conversation(tok, messages)
        owner = _owner(tok, messages, text)
        assert owner is not None, (template, label)
        if ex.whole:
            assert ex.loss_mask.all()
            wholes.append(label)
            continue
        on = [False] * len(text)
        for (s, e), m in zip(_token_spans(tok, text, None), ex.loss_mask.tolist()):
            on[s:e] = [m] * (e - s) if m else on[s:e]
        wrong = {messages[o]["role"] + str(o) for c, o in enumerate(owner) if on[c] and o >= 0
                 and messages[o]["role"] != "assistant"}
        assert not wrong, (template, label, wrong, [text[c] for c in range(len(text)) if on[c]])
        missed = [c for c, o in enumerate(owner) if o >= 0 and messages[o]["role"] == "assistant" and not on[c]
                  and not text[c].isspace()]
        assert not missed, (template, label, text[missed[0]:missed[-1] + 1])
        # the closing written after a reply's text (before the next message's) carries it: the drafter learns to stop
        for i in {o for o in owner if o >= 0 and messages[o]["role"] == "assistant"}:
            end = max(c for c, o in enumerate(owner) if o == i) + 1
            nxt = next((c for c in range(end, len(text)) if owner[c] >= 0), len(text))
            hits = [(p, mark) for mark in CLOSINGS if (p := text.find(mark, end, nxt)) >= 0]
            if hits:
                p, mark = min(hits)
                assert all(on[p:p + len(mark)]), (template, label, i, mark)
    # every conversation here has its replies found by one method or the other
    assert wholes == [], (template, wholes)


# gpt-oss's tool calls: a call's reasoning (the message's content) is written only while it is the last message
HARMONY_CALLS = STYLE_TEMPLATES["harmony"].replace(
    "{% if m.role == 'assistant' %}",
    "{% if m.tool_calls %}{% if loop.last %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.content + "
    "'<|end|>' }}{% endif %}{{ '<|start|>assistant to=functions.' + m.tool_calls[0].function.name + "
    "'<|channel|>commentary json<|message|>' + m.tool_calls[0].function.arguments|tojson + '<|call|>' }}"
    "{% elif m.role == 'assistant' %}", 1)


def test_chat_loss_on_gpt_oss_style_replies_and_calls(tiny_pair):
    """gpt-oss's style writes no line ends, closes the last reply with <|return|> and one a
    turn follows with <|end|> (trial-94: the last reply had no loss but its opening's
    "<|channel|>final<|message|>"; earlier replies' <|end|> had none), and drops a call's
    reasoning once the conversation goes on (the call's turn was not found: all tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = HARMONY_CALLS
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sure, it is sunny."}]
    ex = tokenize_conversation(tok, messages)
    assert not ex.whole and _masked_spans(tok, ex) == [
        "Hello!<|end|>", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>final<|message|>Sure, it is sunny.<|return|>"]

def test_chat_loss_of_an_opening_reply_never_lies_on_the_default_system_prompt(tiny_pair):
    """A conversation opening with a reply whose text the template's default system prompt
    also holds (Qwen2.5's "a helpful assistant"): the loss started at that earlier occurrence
    and covered the rest of the system prompt and the turn's header, with no WARNING (trial-97)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = (
        "{% if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{% endif %}" + STYLE_TEMPLATES["chatml"])
    messages = [{"role": "assistant", "content": "a helpful assistant"}, {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "welcome"}]
    ex = tokenize_conversation(tok, messages)
    assert not ex.whole and _masked_spans(tok, ex) == ["a helpful assistant<|im_end|>\n", "welcome<|im_end|>\n"]


def test_chat_loss_covers_gpt_oss_style_reasoning_of_the_last_reply(tiny_pair):
    """gpt-oss writes the last reply's reasoning (``thinking``, its analysis channel) before its
    final channel, and none in a generation prompt's turn: the model generates it, so it carries
    the loss (trial-97: only the final channel's text did)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = STYLE_TEMPLATES["harmony"].replace(
        "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content }}",
        "{% if m.thinking and loop.last and not add_generation_prompt %}"
        "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif %}"
        "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content }}", 1)
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "thinking": "Add two and two: four."}]
    ex = tokenize_conversation(tok, messages)
    assert not ex.whole and "".join(_masked_spans(tok, ex)) == (
        "<|channel|>analysis<|message|>Add two and two: four.<|end|><|start|>assistant<|channel|>final<|message|>"
        "4<|return|>")


def test_chat_loss_of_a_gpt_oss_style_call_with_an_empty_content_and_thinking(tiny_pair):
    """gpt-oss refuses a call's content given with its thinking and takes an empty one as none:
    the contents' markers put one in the empty content's place, the template refused that, and
    the conversation trained on all its tokens, the user's included (trial-97)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = HARMONY_CALLS.replace(
        "{% if m.tool_calls %}", "{% if m.tool_calls %}{% if m.content and m.thinking %}"
        "{{ raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}"
        "{% endif %}", 1)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather? My account: 12345"},
                {"role": "assistant", "content": "", "thinking": "I should call the tool.", "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    ex = tokenize_conversation(tok, messages)
    assert not ex.whole and _masked_spans(tok, ex) == [
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>final<|message|>It is sunny.<|return|>"]


def test_chat_loss_covers_the_closing_where_a_template_writes_a_content_otherwise(tiny_pair):
    """gpt-oss writes a tool's content as JSON: the contents are not all placed at once, and the
    last reply's <|return|> after a reply ending in ">" had no loss (trial-97)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    plain = "'<|start|>' + m.role + '<|message|>' + m.content + '<|end|>'"
    assert plain in HARMONY_CALLS
    tok.chat_template = HARMONY_CALLS.replace(plain, plain.replace(
        "m.content", "(m.content|tojson if m.role == 'tool' else m.content)"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
                {"role": "tool", "content": "sunny\n"}, {"role": "assistant", "content": "It is <b>sunny</b>"}]
    ex = tokenize_conversation(tok, messages)
    assert not ex.whole and _masked_spans(tok, ex)[-1] == "<|channel|>final<|message|>It is <b>sunny</b><|return|>"


def test_a_template_refusing_a_part_of_a_conversation_does_not_refuse_the_run(tiny_pair, tmp_path):
    """A Qwen3.5-style guard refuses the part before an opening greeting ([system] alone has
    no user turn); the conversation renders whole, so it trains on its replies (trial-94: the
    run was refused, saying the template refuses this conversation)."""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    tok.chat_template = STYLE_TEMPLATES["user-guard"]
    greeting = [{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": "Hi, how can I help?"},
                {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": greeting}) + "\n")
    lines = []
    data, _, _ = prepare_data(_cfg(tmp_path, target_dir, path, val_seqs=0, batch=1, seq_len=512, raw_fraction=0.0),
                              target_dir, tok, lines.append)
    assert not any("WARNING" in m for m in lines), lines
    [ex] = data.examples
    assert not ex.whole and [s.strip() for s in _masked_spans(tok, ex)] == [
        "Hi, how can I help?<|im_end|>", "<think>\n\n</think>\n\nIt is 4.<|im_end|>"]

def test_read_corpus_and_chat_loss_mask(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    corpus = read_corpus([_jsonl(tmp_path / "d.jsonl")])
    assert len(corpus.documents) >= 1 and len(corpus.conversations) == 1
    # a dataset's tool message whose id no call has is read (the engine's prompts refuse it: the ids
    # do not change the rendering, and one record should not stop a run)
    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "r"}, {"role": "assistant", "content": "ok"}]}) + "\n")
    assert [m["role"] for m in read_corpus([calls]).conversations[0]] == ["user", "assistant", "tool", "assistant"]
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


def test_conversations_without_a_reply_in_seq_len_are_left_out_and_whole_ones_warned(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    with open(data, "a") as f:  # a reply past --seq-len 64 (its loss was on the user's text)
        f.write(json.dumps({"messages": [{"role": "user", "content": "word " * 200},
                                         {"role": "assistant", "content": "ok"}]}) + "\n")
    lines = []
    Trainer(_cfg(tmp_path, target_dir, data, steps=1, warmup_steps=1), log=lines.append).run()
    assert any("1 conversation has no assistant reply within seq_len 64 tokens; left out" in m for m in lines), lines
    assert not any("WARNING" in m for m in lines), lines


def test_too_little_chat_data_whose_replies_lie_past_seq_len_says_to_raise_it_also_from_the_cache(tiny_pair, tmp_path):
    """(trial C: the error said to lower --seq-len, and a second run, from the data cache,
    did not say that conversations were left out at all; a refused run now removes the cache
    it wrote of data too small to train on, so the second run reads the data again and says
    the same)"""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "word " * 40},
                                                      {"role": "assistant", "content": "ok"}]}) + "\n" for _ in range(3)))
    cfg = _cfg(tmp_path, target_dir, data, val_seqs=0, batch=2, seq_len=16)
    for run in ("tokenized", "again"):
        lines = []
        with pytest.raises(DFlashError) as err:
            prepare_data(cfg, Path(target_dir), _tok(target_dir), lines.append)
        msg = str(err.value)  # (the fields named: trial-259; the command line names the flags)
        assert "0 chat conversations (left out: 3 with no assistant reply within seq_len 16 tokens)" in msg, (run, msg)
        assert "raise seq_len" in msg and "lower batch or seq_len" not in msg, (run, msg)
        msg = _as_cli(err.value)
        assert "0 chat conversations (left out: 3 with no assistant reply within --seq-len 16 tokens)" in msg, (run, msg)
        assert "raise --seq-len" in msg and "lower --batch or --seq-len" not in msg, (run, msg)
        assert "data: 3 conversations have no assistant reply within seq_len 16 tokens; left out" in lines, (run, lines)
        assert not lines[0].startswith("data: loaded ") and not list(cfg.work_path().glob("data-*")), (run, lines)


def test_conversations_without_an_assistant_turn_are_left_out_and_said(tiny_pair, tmp_path):
    """A conversation's loss lies on its assistant turns: one with none has no loss and is
    left out, in a line (trial C: it trained on all its tokens, the user's text, unsaid); so is
    a record whose messages list is empty, counted in the data statistics (it was dropped
    unsaid: trial-272)."""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    user_only = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about 3 things"}]
    ex = tokenize_conversation(tok, user_only)
    assert len(ex.ids) > 0 and not ex.loss_mask.any() and not ex.whole
    data = tmp_path / "chat.jsonl"
    reply = [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "sorted(x)"}]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (reply, user_only, user_only, [])))
    cfg = _cfg(tmp_path, target_dir, data, val_seqs=0, batch=1)
    for run in ("tokenized", "from the cache"):
        lines = []
        train, _, stats = prepare_data(cfg, Path(target_dir), tok, lines.append)
        assert len(train.examples) == 1 and stats["conversations_without_assistant_turn"] == 2, (run, stats)
        assert stats["conversations_empty"] == 1, (run, stats)
        assert f"data: 1 record has an empty messages list, e.g. {data}:4; left out" in lines, (run, lines)
        assert f"data: 2 conversations have no assistant turn, e.g. {data}:2; left out (a conversation's loss lies on " \
               "its assistant turns)" in lines, (run, lines)
    cfg = _cfg(tmp_path / "b", target_dir, data, val_seqs=0, batch=2)
    with pytest.raises(DFlashError, match=r"1 chat conversations \(left out: 2 with no assistant turn\) make 1 sequences"):
        prepare_data(cfg, Path(target_dir), tok, lambda m: None)


def test_a_mask_token_the_data_holds_is_warned(tiny_pair, tmp_path):
    """(helper-24: --mask-token-id 0, the EOS, was taken silently)"""
    from transformers import AutoTokenizer

    target_dir, _ = tiny_pair
    eos = AutoTokenizer.from_pretrained(str(target_dir)).eos_token_id
    lines = []
    Trainer(_cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=1, mask_token_id=eos), log=lines.append).run()
    # (the field: the command line names the flag, test_resume_names_the_drafter_settings_that_differ_before_the_data_step)
    assert any(f"WARNING: mask_token_id {eos} is the tokenizer's EOS token" in m for m in lines), lines
    # (trial-229: a plain token's id, e.g. a frequent word, was taken silently; the tokenizer's <|MASK|> is no warning)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    word = tok.encode("x", add_special_tokens=False)[0]
    for mask_id, warned in ((word, True), (tok.mask_token_id, False)):
        lines = []
        Trainer(_cfg(tmp_path / str(mask_id), target_dir, _jsonl(tmp_path / "d.jsonl"), steps=1, mask_token_id=mask_id),
                log=lines.append).run()
        said = [m for m in lines if m.startswith(f"WARNING: mask_token_id {mask_id} ")]
        assert said == ([f"WARNING: mask_token_id {word} is the tokenizer's token "
                          f"{tok.convert_ids_to_tokens(word)!r}, which text is tokenized to; "
                         "the drafter cannot tell a masked slot from it (give an id no text maps to, or leave the option "
                         "out)"] if warned else []), lines


def _without_the_mask_token(target_dir: Path, dst: Path) -> Path:
    """A copy of ``target_dir`` whose tokenizer has no mask token: ``<|MASK|>`` (id 1) dropped
    from its added tokens and its vocabulary, so id 1 is a gap and len(tokenizer) (319) is
    the id of a real token."""
    shutil.copytree(target_dir, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] != "<|MASK|>"]
    tj["model"]["vocab"].pop("<|MASK|>")
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc.pop("mask_token", None)
    tc.get("added_tokens_decoder", {}).pop("1", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    (dst / "special_tokens_map.json").unlink(missing_ok=True)
    return dst


def test_the_mask_token_of_a_tokenizer_without_one_is_an_id_no_text_maps_to(tiny_pair, tmp_path):
    """A tokenizer without a mask token or ``<|MASK|>`` whose ids have a gap: the mask id is
    the first embedding row that is no token id (the gap), not len(tokenizer), which is a
    real token's id there and was taken, said to be unused (trial-222); where the ids have
    no gap it is still len(tokenizer). The engine's mask id for a drafter config without one
    (the id adding the token gives) is that token's: a WARNING says so."""
    from transformers import AutoTokenizer

    from dflash_torch.models.drafter_config import fill_mask_token_id, token_ids, unused_token_id
    from dflash_torch.training.trainer import resolve_mask_token_id

    target_dir, drafter_dir = tiny_pair
    gapped = _without_the_mask_token(target_dir, tmp_path / "gapped")
    tok = AutoTokenizer.from_pretrained(str(gapped))
    vocab = json.loads((gapped / "config.json").read_text())["vocab_size"]
    assert tok.mask_token_id is None and len(tok) == vocab - 1 and len(tok) in token_ids(tok) and 1 not in token_ids(tok)
    assert resolve_mask_token_id(tok, vocab, None) == (1, "the first embedding row that is no token of the tokenizer")
    lines = []
    Trainer(_cfg(tmp_path, gapped, _jsonl(tmp_path / "d.jsonl"), steps=1), log=lines.append).run()
    assert any("mask_token_id=1 (the first embedding row that is no token of the tokenizer)" in m for m in lines), lines
    # no gap: the row past the vocabulary, as before (and as the engine gives a drafter config without a mask id)
    full = AutoTokenizer.from_pretrained(str(target_dir))
    assert unused_token_id(full, vocab + 4) == len(full) == vocab and unused_token_id(full, vocab) is None
    raw = json.loads((drafter_dir / "config.json").read_text())
    raw["dflash_config"].pop("mask_token_id")
    _, note = fill_mask_token_id(raw, AutoTokenizer.from_pretrained(str(gapped)), vocab)
    assert note.startswith("WARNING: the drafter's config.json has no mask_token_id: mask token '<|MASK|>' is id "
                           f"{vocab - 1} (") and f"already the tokenizer's token {tok.convert_ids_to_tokens(vocab - 1)!r}" \
        in note, note


def test_the_mask_tokens_text_in_the_data_is_tokenized_as_plain_text_and_said(tiny_pair, tmp_path):
    """The literal text ``<|MASK|>`` (the mask token, id 1, an added special token) in the
    data became the mask id and was trained on as context and as a label with no word
    (trial-222): it is tokenized as plain text (as a target writes it, merged with its
    neighbours as the text would be), in documents, conversations (the reply's loss still
    lies on it) and self-distill prompts alike, and a line says how often and where; the
    other special tokens (EOS, the template's) stay special."""
    from dflash_torch.training.data import encode_text, mask_as_text
    from dflash_torch.training.distill import text_prompts

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    plain = tok("x <|MASK|> y", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert 1 in tok("x <|MASK|> y", add_special_tokens=False)["input_ids"] and 1 not in plain
    wrapped, text = mask_as_text(tok, 1)
    assert text == "<|MASK|>" and encode_text(wrapped, "x <|MASK|> y") == plain
    assert encode_text(wrapped, "x <|MASK|> y<|endoftext|>") == plain + [0]  # (EOS read as itself)
    assert mask_as_text(tok, 0)[0] is tok and mask_as_text(tok, 200) == (tok, None)  # (EOS; a vocabulary token)
    assert all(1 not in p for p in text_prompts(wrapped, ["a <|MASK|> b\n" * 40], 3, 4, 8, __import__("random").Random(0)))
    reply = "call it as f(<|MASK|>) twice"
    ex = tokenize_conversation(wrapped, [{"role": "user", "content": "how?"}, {"role": "assistant", "content": reply}])
    assert not ex.whole and 1 not in ex.ids.tolist() and reply in tok.decode(ex.ids[ex.loss_mask].tolist())
    data = tmp_path / "d.jsonl"
    _jsonl(data)
    with open(data, "a") as f:
        f.write(json.dumps({"text": "a <|MASK|> b <|MASK|>\n" * 3}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "how?"}, {"role": "assistant", "content": reply}]}))
    lines = []
    Trainer(_cfg(tmp_path, target_dir, data, steps=1), log=lines.append).run()
    where = f"{data}:{len(corpus_texts(60_000)) + 2}"
    assert (f"data: the text '<|MASK|>', the mask token's, occurs 7 times in the data (6 in {where} and 1 more in 1 "
            "other source); it is tokenized as plain text there, not as the mask token id 1, which stands for masked "
            "slots only") in lines, lines
    blob = torch.load(next((tmp_path / "work").glob("data-*.pt")), weights_only=True)
    assert 1 not in blob["stream"].tolist() and all(1 not in ids.tolist() for ids, _ in blob["chat"])
    assert blob["stream"].tolist().count(0) == len(corpus_texts(60_000)) + 1  # (each document's EOS)
    # a tokenizer that cannot read it as text (a slow one: no offsets): a WARNING saying what it becomes
    from dflash_torch.training.trainer import mask_text_note

    assert mask_text_note(read_corpus([data]), "<|MASK|>", 1, False) == (
        f"data: WARNING: the text '<|MASK|>', the mask token's, occurs 7 times in the data (6 in {where} and 1 more in 1 "
        "other source); this tokenizer makes it the mask token id 1, so the drafter reads it as a masked slot and learns "
        "to draft that id: take it out of the data, or pass mask_token_id with an id no text maps to")


def test_json_record_files_are_read_as_records_in_any_case(tmp_path):
    """``.json`` (an array of records, one record, or JSON Lines) and ``.JSONL`` are records,
    as in .jsonl (both were read as one document of JSON text, helper-24); in a directory a
    .json file that is not records (a package.json) stays a document; given, it is refused. An array's
    records are counted from 1, as JSON Lines lines are (they were from 0: trial-175)."""
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(): pass"}]}
    records = [{"text": "alpha"}, chat, {"text": "beta"}]
    (tmp_path / "array.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "one.json").write_text(json.dumps({"text": "gamma"}, indent=2))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "upper.JSONL").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, docs in (("array.json", ["alpha", "beta"]), ("one.json", ["gamma"]), ("lines.json", ["alpha", "beta"]),
                       ("upper.JSONL", ["alpha", "beta"])):
        corpus = read_corpus([tmp_path / name])
        assert corpus.documents == docs, name
        assert corpus.conversations == ([chat["messages"]] if name != "one.json" else []), name
    (tmp_path / "bad.json").write_text('[{"text": "x"}, {"txt": 1}]')
    with pytest.raises(DFlashError, match=r"bad\.json: record 2: expected an object with a 'text' string"):
        read_corpus([tmp_path / "bad.json"])
    (tmp_path / "broken.json").write_text('[{"text": "x"},')
    with pytest.raises(DFlashError, match=r"broken\.json:1: not valid JSON"):
        read_corpus([tmp_path / "broken.json"])
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "package.json").write_text('{"name": "x", "version": "1.0"}')
    (tmp_path / "dir" / "data.json").write_text(json.dumps(records))
    corpus = read_corpus([tmp_path / "dir"])
    assert corpus.documents == ["alpha", "beta", '{"name": "x", "version": "1.0"}'] and len(corpus.conversations) == 1
    # records with a bad one, in a directory: refused as given (helper-28: trained on as JSON text)
    (tmp_path / "dir" / "more.json").write_text('[{"text": "a"}, {"txt": "b"}]')
    with pytest.raises(DFlashError, match=r"more\.json: record 2"):
        read_corpus([tmp_path / "dir"])
    # a message's reasoning_content is kept for the template (it was dropped)
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "a", "reasoning_content": "because"}]}) + "\n")
    assert read_corpus([tmp_path / "r.jsonl"]).conversations[0][1] == {"role": "assistant", "content": "a",
                                                                       "reasoning_content": "because"}
    # a null reasoning_content is an absent one, as the chat API takes it (it refused the run: trial-97)
    (tmp_path / "rn.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "a", "reasoning_content": None}]}) + "\n")
    assert read_corpus([tmp_path / "rn.jsonl"]).conversations[0][1] == {"role": "assistant", "content": "a"}
    # a null field is an absent one (datasets writes the other kind's field as null): not "holds both" (trial-94)
    (tmp_path / "nulls.jsonl").write_text(json.dumps({"text": None, **chat}) + "\n" +
                                          json.dumps({"text": "delta", "messages": None}) + "\n")
    corpus = read_corpus([tmp_path / "nulls.jsonl"])
    assert corpus.conversations == [chat["messages"]] and corpus.documents == ["delta"]


def test_chat_records_with_roles_training_does_not_take_are_refused(tmp_path):
    """ShareGPT-style roles ("human" / "gpt") trained unsaid, every "gpt" reply left out of the
    loss (only assistant turns get it: trial-275): a role outside the server's five is refused,
    naming file:line, the message's index and its role, with the role meant for ShareGPT's."""
    ok = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant")]
    ok += [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "done"}]
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": ok}) + "\n")
    assert len(read_corpus([tmp_path / "ok.jsonl"]).conversations) == 1
    sharegpt = {"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "def f(): pass"}]}
    (tmp_path / "sg.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(sharegpt) + "\n")
    with pytest.raises(DFlashError, match=r"sg\.jsonl:2: message 0 has role 'human', which training does not take: "
                                          r"roles are system, developer, user, assistant, tool .*'human' as 'user'"):
        read_corpus([tmp_path / "sg.jsonl"])
    sharegpt["messages"][0]["role"] = "user"
    (tmp_path / "sg.json").write_text(json.dumps([sharegpt]))
    with pytest.raises(DFlashError, match=r"sg\.json: record 1: message 1 has role 'gpt'.*'gpt' as 'assistant'"):
        read_corpus([tmp_path / "sg.json"])
    sharegpt["messages"][1]["role"] = "ipython"
    (tmp_path / "ip.jsonl").write_text(json.dumps(sharegpt) + "\n")
    with pytest.raises(DFlashError, match=r"ip\.jsonl:1: message 1 has role 'ipython'") as info:
        read_corpus([tmp_path / "ip.jsonl"])
    assert "ShareGPT" not in str(info.value)


def test_train_help_says_what_a_directory_makes_of_a_json_file_that_is_not_records(tmp_path, capsys):
    """A .json file that is not records is refused given itself but read as a text document
    in a --data directory (as data.py says: a directory's files are read as they come, e.g.
    a package.json of a code corpus); train --help said only "text files, directories, or
    JSONL" (trial-118)."""
    from dflash_torch.cli import main as cli_main

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "package.json").write_text('{"name": "x"}')
    assert read_corpus([tmp_path / "dir"]).documents == ['{"name": "x"}']
    with pytest.raises(DFlashError, match=r"package\.json: expected an object with a 'text' string"):
        read_corpus([tmp_path / "dir" / "package.json"])
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "a .json file that is not records, e.g. a package.json, is a text document" in help_, help_
    assert "a file that is not UTF-8 text is skipped" in help_ and ".json files of {'text'} / {'messages'}" in help_
    # (a .jsonl file that is not UTF-8 is refused there, not skipped: it is data the user meant)
    assert "but a .jsonl file, or a .json file of records, is data and is refused where it is not valid" in help_


def test_prefix_min_help_says_a_text_prompt_may_be_half_as_long(tiny_pair, capsys):
    """--prefix-min was "shortest self-distill prompt", but a text prompt is cut back to a line end
    and kept down to prefix_min // 2 tokens (trial: 22 of 64 prompts of 10-13 tokens at --prefix-min
    16): the help says what the code does."""
    import random

    from dflash_torch.cli import main as cli_main
    from dflash_torch.training.distill import text_prompts

    target, _ = tiny_pair
    lengths = [len(p) for p in text_prompts(_tok(target), corpus_texts(20_000), 64, 16, 32, random.Random(0))]
    assert len(lengths) == 64 and min(lengths) >= 8 and any(n < 16 for n in lengths), lengths
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert ("--prefix-min PREFIX_MIN shortest length drawn for a self-distill text prompt (tokens, default 32; at most "
            "--seq-len - 16): each is drawn from --prefix-min to --prefix-max tokens from a line start, then cut back "
            "to its last line end, and kept where at least half --prefix-min tokens remain, so a prompt may be as short "
            "as --prefix-min / 2") in help_, help_


def test_train_says_it_holds_the_target_in_float32_on_the_cpu_and_refuses_one_too_big(tiny_pair, tmp_path, capsys,
                                                                                         monkeypatch):
    """train loads the target in float32 on the CPU, which neither --help nor the refusal of a
    target too big for the memory said (trial-127)."""
    from dflash_torch import checkpoint
    from dflash_torch.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "Training runs on the CPU: the target is loaded in float32 (about 4 bytes a parameter of RAM" in help_, help_
    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: 1000)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(tmp_path / "out"), "--steps", "1",
            "--no-progress", "--seq-len", "64", "--batch", "2", "--val-seqs", "0"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "for its weights in float32; cpu has 1.0 kB free (train loads the target in float32 on " \
        "the CPU, about 4 bytes a parameter" in err[0], err
    assert not (tmp_path / "out").exists()


def test_train_refuses_a_drafter_whose_training_state_does_not_fit_in_one_line(tiny_pair, tmp_path, capsys):
    """A huge --intermediate-size was an allocator's 25-line traceback once the data was prepared (trial):
    the drafter's float32 weights, gradients and AdamW moments (16 bytes a parameter) are counted first."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(tmp_path / "out"), "--steps", "3",
            "--no-progress", "--seq-len", "64", "--batch", "2", "--num-layers", "1", "--intermediate-size", str(10 ** 9)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the MLP's three 64 x 10^9 weights, the attention's (4 query heads and 2 key/value heads of 16), fc and the norms
    n = 3 * 64 * 10 ** 9 + 2 * 64 * 64 + 2 * 64 * 32 + 64 * 64 + 4 * 64 + 2 * 16
    assert len(err) == 1 and err[0].startswith(f"dflash-torch: error: the drafter needs 55.1 TB to train ({n:,} parameters at 16 "
                                               "bytes each: float32 weights, gradients and AdamW's two moments; "), err
    assert ("of activations a step; 1.5 times these, as the allocator keeps freed memory; the export's copy; the run's "
            "own); cpu has ") in err[0], err
    # (the MLP's activations, 1024 block rows of 10^9 values, are most of it: the step's sizes are named too)
    assert err[0].endswith("free beside the target: give a smaller --intermediate-size (now 1000000000) or "
                           "--num-layers (now 1), or a smaller --batch (now 2), --seq-len (now 64) or --anchors-per-seq "
                           "(now 64)"), err
    assert not (tmp_path / "out").exists()
    # the Python API names the fields, as it does elsewhere (it named the flags: trial-249); the CLI the flags
    from dflash_torch.errors import OptionError

    with pytest.raises(OptionError) as raised:
        Trainer(_cfg(tmp_path, target, text, intermediate_size=10 ** 9), log=lambda m: None).run()
    assert str(raised.value).endswith("free beside the target: give a smaller intermediate_size (now 1000000000) or "
                                      "num_layers (now 1)") and "--" not in str(raised.value), raised.value
    for kw, line, flags in [
            (dict(target_layer_ids=[0, 99]), "target_layer_ids [99] outside the target's 4 layers",
             ["--target-layer-ids", "0,99"]),
            (dict(target_layer_ids=[]), "target_layer_ids needs at least one target layer id",
             ["--target-layer-ids", ""]),
            (dict(init_from_target=True, num_layers=9),
             "init_from_target copies the target's last num_layers layers: at most 4, got 9",
             ["--init-from-target", "--num-layers", "9"])]:
        with pytest.raises(OptionError) as raised:
            Trainer(_cfg(tmp_path, target, text, **kw), log=lambda m: None).run()
        assert str(raised.value) == line
        assert cli_main([*args[:-4], *flags]) == 2
        cli_line = line.replace("target_layer_ids", "--target-layer-ids").replace("init_from_target", "--init-from-target")
        assert capsys.readouterr().err.strip().splitlines() == [
            "dflash-torch: error: " + cli_line.replace("num_layers", "--num-layers")], flags
    assert not (tmp_path / "out").exists()


def test_the_memory_check_counts_the_activations_and_what_the_allocator_keeps(tiny_pair, tmp_path, capsys,
                                                                              monkeypatch):
    """--num-layers 30000 --target-layer-ids 0,1 on a tiny target passed the check (its 16 bytes a
    parameter fit in the 23 GB free), then was OOM-killed without a word (trial-293): a step's
    activations, 1.5 times the whole as the allocator keeps freed memory, and the export's copy count
    too. Nothing is built: the sizes are refused before anything is allocated."""
    from dflash_torch.cli import main as cli_main
    from dflash_torch.errors import OptionError
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.checkpoint import load_config
    import dflash_torch.training.trainer as trainer_mod

    target, _ = tiny_pair
    tcfg = TargetConfig.from_dict(load_config(target))
    cfg = _cfg(tmp_path, target, tmp_path / "c.txt", num_layers=30_000, target_layer_ids=[0, 1])
    dcfg = trainer_mod.make_drafter_config(tcfg, cfg, 5)
    need, n, act = trainer_mod.training_memory(dcfg, cfg)
    assert n == trainer_mod.drafter_parameters(dcfg) and act > 0
    assert need > 1.5 * (16 * n + act)  # (1.5 times the state and the activations, the export's copy, the run's own)
    monkeypatch.setattr(trainer_mod.checkpoint, "available_memory", lambda device: 16 * n + n)  # (the trial's 23 GB)
    with pytest.raises(OptionError) as raised:
        trainer_mod.check_drafter_fits(dcfg, cfg)
    assert "or num_layers (now 30000)" in str(raised.value) and "--" not in str(raised.value), raised.value
    monkeypatch.undo()
    # a step whose activations no machine holds (1 million sequences of 128 tokens, 32 blocks each) is refused
    # before the data is read, the step's sizes named; it said "too little training data" after preparing it
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(tmp_path / "out"), "--steps", "3",
            "--no-progress", "--seq-len", "128", "--batch", str(10 ** 6), "--num-layers", "1", "--anchors-per-seq", "32"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-torch: error: the drafter needs ") and err[0].endswith(
        "or --num-layers (now 1), or a smaller --batch (now 1000000), --seq-len (now 128) or --anchors-per-seq "
        "(now 32)"), err
    assert not (tmp_path / "out").exists()


def test_the_parameter_count_of_a_deep_drafter_is_its_layers_extrapolated(tiny_pair, tmp_path):
    """The memory check counts a drafter's parameters from builds of one and two of its layers
    (a 30000-layer meta build took long): the same count as the whole drafter's."""
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.checkpoint import load_config
    import dflash_torch.training.trainer as trainer_mod

    target, _ = tiny_pair
    tcfg = TargetConfig.from_dict(load_config(target))
    for arch, layers in (("dflash", 1), ("dflash", 2), ("dflash", 5), ("dflash2", 3)):
        cfg = _cfg(tmp_path, target, tmp_path / "c.txt", num_layers=layers, target_layer_ids=[0, 1], arch=arch)
        dcfg = trainer_mod.make_drafter_config(tcfg, cfg, 5)
        with torch.device("meta"):
            whole = trainer_mod.drafter_class(dcfg)(dcfg)
        assert trainer_mod.drafter_parameters(dcfg) == sum(p.numel() for p in whole.parameters()), (arch, layers)


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


def test_resuming_a_checkpoint_of_the_old_schedule_keeps_it(tiny_pair, tmp_path):
    """A checkpoint saved before the lr's cosine was counted from the warm-up's end (no
    lr_decay_from, no warmup_elapsed) keeps the schedule its run began with, the decay counted
    from step 0: the lr jumped back up on resume (trial-263). A new checkpoint is marked."""
    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    cfg = _cfg(tmp_path / "a", target_dir, data, steps=3)
    Trainer(cfg, log=lambda m: None).run()
    ckpt = Path(cfg.work_dir) / "checkpoint.pt"
    st = torch.load(ckpt, weights_only=True)
    marker = st.pop("lr_decay_from", None)
    del st["warmup_elapsed"]
    torch.save(st, ckpt)
    cfg.steps, cfg.resume = 6, True
    lines = []
    Trainer(cfg, log=lines.append).run()
    old = [3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(3, 6)]  # (the steps resumed)
    log = json.loads((Path(cfg.out) / "training_log.json").read_text())
    assert [h["lr"] for h in log["loss_history"]][3:] == pytest.approx(old)
    assert any("decays the learning rate from step 0" in m for m in lines), lines
    assert marker == "warmup"
    assert torch.load(ckpt, weights_only=True)["lr_decay_from"] == "start"  # (and a later resume keeps it)


def test_resume_continues_identically(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    full = _cfg(tmp_path / "a", target_dir, data, steps=4, save_dtype="float32")
    Trainer(full, log=lambda m: None).run()
    # the log's drafter_config is the exported config.json (its torch_dtype said bfloat16: trial-175)
    out = Path(full.out)
    assert json.loads((out / "training_log.json").read_text())["drafter_config"] == \
        json.loads((out / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
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
    # warm-up to lr over 2 steps, then the cosine from lr, counted from the warm-up's end (it was counted from step 0:
    # the lr jumped down from 3e-3 to 1.65e-3 as the warm-up ended, trial-259), on resume too
    lrs = [3e-3 / 2, 3e-3, 3e-3, 3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 2))]
    assert [h["lr"] for h in a["history"]] == [h["lr"] for h in b["history"]] == pytest.approx(lrs)
    lines = []  # another recipe on resume: allowed, with a warning naming what changed (it was silent)
    half.steps, half.lr, half.gamma, half.autocast = 5, 1e-3, 2.0, False
    Trainer(half, log=lines.append).run()
    warned = [m for m in lines if "WARNING" in m]
    # (a default value said so, as --gamma's was, for every option: trial-175; the fields named in Python: trial-263)
    assert len(warned) == 1 and "lr the default, 0.001 (was 0.003)" in warned[0] and "steps" not in warned[0], lines
    # defaults as values (it said "--gamma 2.0 (was None), --autocast False (was True)")
    assert "gamma 2 (was the default, 3.5), autocast False (was True)" in warned[0], warned
    half.gamma, half.autocast = None, True
    # another target of the same shape: warned too (it was silent); the same one spelt otherwise is not
    import shutil
    other = tmp_path / "other-target"
    shutil.copytree(target_dir, other)
    lines = []
    link = tmp_path / "link-to-other"  # (named as typed, not resolved, as the README says: trial-175)
    link.symlink_to(other)
    half.steps, half.target = 6, str(link)
    Trainer(half, log=lines.append).run()
    warned = [m for m in lines if "WARNING" in m]
    assert len(warned) == 1 and f"target {str(link)!r} (was {str(target_dir)!r})" in warned[0], lines
    lines = []
    half.steps, half.target = 7, str(other) + "/"
    Trainer(half, log=lines.append).run()
    assert not [m for m in lines if "WARNING" in m and "--target" in m], lines
    # a --steps already reached: said so (the checkpoint's drafter is exported as it is); another recipe is not
    # warned as one training goes on with, nor recorded (it was, in the checkpoint and the log: trial-175)
    def recorded() -> list[dict]:
        ckpt = torch.load(Path(half.work_dir) / "checkpoint.pt", weights_only=True)["train_config"]
        return [{k: c[k] for k in ("lr", "batch", "steps", "time_budget_min")}
                for c in (ckpt, json.loads((Path(half.out) / "training_log.json").read_text())["config"])]

    kept = [{"lr": 1e-3, "batch": 2, "steps": 7, "time_budget_min": None}] * 2
    assert recorded() == kept
    lines = []
    half.steps, half.lr, half.batch = 3, 2e-3, 3
    info = Trainer(half, log=lines.append).run()
    assert info["steps"] == 7 and info["config"]["lr"] == 1e-3 and recorded() == kept
    assert any("at step 7, steps 3 is reached: no training" in m for m in lines), lines
    assert not [m for m in lines if "WARNING" in m], lines
    lines = []  # (the command line names the flags: the Python API named them too, trial-263)
    Trainer(half, log=lines.append, flags=_cli_flags()).run()
    assert any(m.endswith("at step 7, --steps 3 is reached: no training; the drafter is exported as it is (give a "
                          "larger --steps to train on)") for m in lines), lines
    lines = []  # and a --time-budget-min already spent (it said nothing)
    half.steps, half.time_budget_min = None, 1e-6
    assert Trainer(half, log=lines.append).run()["steps"] == 7
    assert any("time_budget_min 1e-06 is spent: no training" in m for m in lines), lines
    assert not [m for m in lines if "WARNING" in m] and recorded() == kept, lines


def test_a_time_budget_spent_before_a_step_is_trained_is_warned(tiny_pair, tmp_path):
    """A --time-budget-min spent before step 1 (e.g. by the evaluation before training) exported an
    untrained drafter with exit 0 and no word; a resume with budget left that it spends before a step likewise."""
    target_dir, _ = tiny_pair
    cfg = _cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=None, time_budget_min=1e-9)
    lines = []
    assert Trainer(cfg, log=lines.append).run()["steps"] == 0
    assert "WARNING: time_budget_min 1e-09 was spent before a step was trained (it counts the evaluations too): " \
        "the drafter exported is untrained" in lines, lines
    assert (Path(cfg.out) / "model.safetensors").is_file()
    # (2 steps, then a resume with a sliver of budget left; over the first run's drafter, as the command line's --overwrite)
    cfg = replace(cfg, steps=2, time_budget_min=None, overwrite=True)
    Trainer(cfg, log=lambda m: None).run()
    elapsed = torch.load(Path(cfg.work_dir) / "checkpoint.pt", weights_only=True)["elapsed"]
    lines = []
    cfg = replace(cfg, resume=True, overwrite=False, steps=None, time_budget_min=(elapsed + 1e-6) / 60)
    assert Trainer(cfg, log=lines.append).run()["steps"] == 2
    assert any(m.startswith("WARNING: time_budget_min ") and m.endswith(
        "the drafter exported is the checkpoint's of step 2, as it was") for m in lines), lines
    lines = []  # (a --steps run says nothing of it)
    assert Trainer(replace(cfg, resume=False, overwrite=True, steps=1, time_budget_min=None, warmup_steps=1),
                   log=lines.append).run()["steps"] == 1
    assert not [m for m in lines if "WARNING" in m], lines


def test_a_ctrl_c_inside_the_optimizer_step_saves_a_whole_update(tiny_pair, tmp_path, monkeypatch):
    """SIGINT delivered while AdamW updates the parameters (half of them done): the update is
    finished before the interrupt is taken, so the checkpoint saved on Ctrl-C, resumed, ends
    where an uninterrupted run does (helper-24: it saved a half-applied update)."""
    import os
    import signal

    import torch.optim.adam as adam

    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    full = _cfg(tmp_path / "a", target_dir, data, steps=4)
    Trainer(full, log=lambda m: None).run()
    original, calls = adam._single_tensor_adam, []

    def interrupted_midway(params, *args, **kwargs):  # AdamW's update on CPU (per parameter group)
        calls.append(len(params))
        if len(calls) != 2:
            return original(params, *args, **kwargs)
        half = len(params) // 2
        original(params[:half], *(a[:half] if isinstance(a, list) and len(a) == len(params) else a for a in args),
                 **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return original(params[half:], *(a[half:] if isinstance(a, list) and len(a) == len(params) else a for a in args),
                        **kwargs)

    monkeypatch.setattr(adam, "_single_tensor_adam", interrupted_midway)
    cut = _cfg(tmp_path / "b", target_dir, data, steps=4)
    lines = []
    with pytest.raises(KeyboardInterrupt):  # (raised again once saved: it was SystemExit(130), trial-259)
        Trainer(cut, log=lines.append).run()
    assert len(calls) == 2 and calls[1] > 1
    assert "interrupted: checkpoint of step" in lines[-1] and lines[-1].endswith("; continue with resume=True"), lines
    monkeypatch.setattr(adam, "_single_tensor_adam", original)
    cut.resume = True
    Trainer(cut, log=lambda m: None).run()
    a = torch.load(Path(full.work_dir) / "checkpoint.pt", weights_only=False)
    b = torch.load(Path(cut.work_dir) / "checkpoint.pt", weights_only=False)
    for k in a["drafter"]:
        assert torch.equal(a["drafter"][k], b["drafter"][k]), k


def test_dflash2_logged_loss_is_the_cross_entropy_as_val_loss(tiny_pair, tmp_path):
    """A DFlash 2 run logs the cross-entropy as ``loss`` (comparable with ``val_loss``) and
    the selector loss beside it: the first step's loss, before any update, is the same
    whatever --selector-loss-weight (helper-24: it was cross-entropy + weight x selector)."""
    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    first = []
    for weight in (0.0, 1.0):
        cfg = _cfg(tmp_path / f"w{weight}", target_dir, data, steps=1, arch="dflash2", selector_rank=8,
                   selector_top_k=8, selector_loss_weight=weight)
        history = Trainer(cfg, log=lambda m: None).run()["loss_history"]
        first.append(history[0])
    assert first[0]["loss"] == first[1]["loss"] and first[1]["selector_loss"] > 0.1, first


def test_the_last_loss_history_row_has_the_keys_and_values_of_the_others(tiny_pair, tmp_path, monkeypatch):
    """The last row of loss_history, of steps between logged ones, had "train_tau": null and,
    with --arch dflash2, no selector_loss (trial-118): a --steps run logs its last step as the
    others, and a --time-budget-min stop measures the last step's train_tau on its batch."""
    from dflash_torch.training import trainer

    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    clock = [0.0]  # (the budget run: each step takes one second of a fake clock)
    monkeypatch.setattr(trainer.time, "time", lambda: clock[0])
    real_generator = trainer.step_generator

    def step_generator(seed, step):
        clock[0] += 1.0
        return real_generator(seed, step)

    monkeypatch.setattr(trainer, "step_generator", step_generator)
    for name, kw in (("steps", dict(steps=3)), ("budget", dict(steps=None, time_budget_min=2.5 / 60))):
        cfg = _cfg(tmp_path / name, target_dir, data, arch="dflash2", selector_rank=8, selector_top_k=8,
                   log_every=10, val_seqs=0, **kw)
        history = Trainer(cfg, log=lambda m: None).run()["loss_history"]
        assert [h["step"] for h in history] == [1, 3], (name, history)
        assert history[0].keys() == history[1].keys() and "selector_loss" in history[1], (name, history)
        assert all(isinstance(h["train_tau"], float) and 1.0 <= h["train_tau"] <= 8.0 for h in history), (name, history)
        assert all(isinstance(h["selector_loss"], float) for h in history), (name, history)


def test_init_from_target_reproduces_target_layer_context_kv(tiny_pair):
    target_dir, _ = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    cfg = drafter_config(target_dir, num_layers=2)  # L = 4: ids [1, 1], copies layers 2 and 3
    drafter = DFlashDrafter(cfg)
    copied = copy_target_layers(drafter, target)
    assert copied == [(0, 2, None), (1, 3, None)]
    assert init_from_target_note(copied) == "init: init_from_target: drafter layers 0, 1 start as target layers 2, 3"
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


def test_init_from_target_says_which_layers_it_copied_and_warns_where_none():
    """(trial C: on a Gemma 4, gpt-oss or Qwen3.5 target it copied no layer, unsaid)"""
    assert init_from_target_note([(0, 5, None)]) == "init: init_from_target: drafter layer 0 starts as target layer 5"
    assert init_from_target_note([(0, 4, "gated attention"), (1, 5, None)]) == \
        ("init: init_from_target: drafter layer 1 starts as target layer 5; drafter layer 0 keeps its random "
         "initialisation (target layer 4: gated attention)")
    assert init_from_target_note([(0, 2, "no q/k norms"), (1, 3, "no q/k norms")]) == \
        ("init: WARNING: init_from_target copied no layer (target layers 2, 3: no q/k norms); drafter layers 0, 1 "
         "keep their random initialisation")


def test_training_a_drafter_for_a_hybrid_moe_target(tmp_path, tokenizer_dir):
    """A Qwen3.5-MoE target (Gated DeltaNet + gated attention, (1 + w) norms, experts only):
    --init-from-target copies no layer of another kind and takes its norms as the scale they
    apply; the drafter's MLP width is the routed width; training runs and the exported
    drafter decodes losslessly."""
    text = dict(intermediate_size=None)  # every MLP is a mixture of experts
    target_dir = make_hybrid_target(tmp_path / "target", "qwen3_5_moe_text", tokenizer=False, **text)
    copy_tokenizer(tokenizer_dir, target_dir)
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter(drafter_config(target_dir, num_layers=1))
    fresh = {k: v.clone() for k, v in drafter.layers[0].state_dict().items()}
    (copied,) = copy_target_layers(drafter, target)
    assert copied[:2] == (0, 5) and "no dense MLP" in copied[2], copied
    assert all(torch.equal(v, fresh[k]) for k, v in drafter.layers[0].state_dict().items())
    torch.testing.assert_close(drafter.norm.weight, 1 + target.model.norm.weight)
    assert target.model.norm.weight.abs().max() > 0.01  # the offset is really there
    cfg = _cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), init_from_target=True)
    lines = []
    Trainer(cfg, log=lines.append).run()
    assert any(m.startswith("init: WARNING: init_from_target copied no layer (target layer 5: ") and
               m.endswith("; drafter layer 0 keeps its random initialisation") for m in lines), lines
    conf = json.loads((Path(cfg.out) / "config.json").read_text())
    assert conf["intermediate_size"] == 2 * 32 + 48  # top_k * moe_intermediate_size + shared expert
    spec = DFlashEngine.from_pretrained(target_dir, cfg.out)
    base = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ("def f(x):", "import os\n"):
        assert spec.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == \
            base.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids



def test_a_hybrid_self_distill_run_trains_the_same_drafter_with_its_data_cache_or_without(tmp_path, tokenizer_dir):
    """Self-distilling with transformers' Qwen3.5 draws from torch's global generator (its
    from_pretrained does), which the drafter's initialisation drew from next: the same run with
    the same seed trained another drafter where the data cache was already there (a re-run,
    overwrite, a run started again after a Ctrl-C before training began: trial-320 a). The
    initialisation is seeded where it begins: the drafters are the same."""
    target_dir = make_hybrid_target(tmp_path / "target", "qwen3_5_text", tokenizer=False)
    copy_tokenizer(tokenizer_dir, target_dir)
    cfg = _cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=1, self_distill=2, self_distill_batch=2,
               prefix_min=8, prefix_max=16, val_seqs=0, save_dtype="float32")
    lines = []
    Trainer(cfg, log=lines.append).run()
    assert any(m.startswith("data: self-distilled") for m in lines), lines  # (the first run distilled)
    fresh = load_file(str(Path(cfg.out) / "model.safetensors"))
    again = []
    Trainer(replace(cfg, overwrite=True), log=again.append).run()
    assert any(m.startswith("data: loaded") for m in again), again  # (the second one read the data cache)
    cached = load_file(str(Path(cfg.out) / "model.safetensors"))
    assert fresh.keys() == cached.keys()
    assert all(torch.equal(fresh[k], cached[k]) for k in fresh), \
        max(float((fresh[k] - cached[k]).abs().max()) for k in fresh)

REFUSED_TRAIN_OPTIONS = {
    "out-is-target": "target's directory", "out-holds-drafter": "--overwrite", "work-holds-checkpoint": "--resume",
    "short-seq": "--seq-len", "save-float64": "unsupported --save-dtype 'float64'; choose one of auto, float32, bfloat16, float16",
    "init-from-with-shape": "--num-layers cannot be combined with --init-from",
    "init-from-dflash2-as-dflash": "is a DFlash 2 drafter; train it with --arch dflash2",
    "conv-group-size": "--conv-group-size 24 does not divide the hidden size 64",
    "top-k-above-vocab": "--selector-top-k 400 exceeds the vocabulary of 320",
    "self-distill-batch-0": "--self-distill-batch must be >= 1, got 0",
    "negative-prefix": "--prefix-min must be >= 1, got -5",
    # (an IndexError traceback from copying target layer -5 of 4)
    "init-from-target-too-deep": "--init-from-target copies the target's last --num-layers layers: at most 4, got 9",
    "intermediate-size-0": "--intermediate-size must be >= 1, got 0",  # (0 meant the target's width)
    "prefix-min-above-max": "--prefix-min (10) must be <= --prefix-max (5)",
    "negative-weight-decay": "--weight-decay must be a finite number >= 0, got -0.1",  # (the message named five options)
    "grad-clip-0": "--grad-clip must be a finite number > 0, got 0.0",
    # (inf and NaN passed: --lr inf saved a drafter of NaN weights with exit 0)
    "lr-inf": "--lr must be a finite number > 0, got inf",
    # (argparse took -1e-3 for a flag: "argument --lr: expected one argument", trial-293 f)
    "lr-negative-exponent": "--lr must be a finite number > 0, got -0.001",
    "weight-decay-nan": "--weight-decay must be a finite number >= 0, got nan",
    # (passed, then failed as a divergence that blamed --lr)
    "selector-loss-weight-nan": "--selector-loss-weight must be a finite number >= 0, got nan",
    "selector-loss-weight-inf": "--selector-loss-weight must be a finite number >= 0, got inf",
    "raw-fraction-nan": "--raw-fraction must be in [0, 1], got nan",
    # (cut to --seq-len - 16 unsaid; the defaults are cut so where a short --seq-len leaves less room)
    "prefix-max-past-seq-len": "--prefix-max 100 is longer than a self-distill prompt may be at --seq-len 64 (48 tokens, "
                               "leaving 16 to the continuation): give at most 48, or a longer --seq-len",
    "resume-and-overwrite": "--resume continues the checkpoint in the work dir and --overwrite starts over: give one",  # (resumed)
    # (came after the "drafter: ..." line, once the target had loaded)
    "data-missing": "training data ",
    # (silently ignored when training a DFlash drafter)
    "dflash2-option-for-dflash": "--selector-rank is an option of DFlash 2 drafters (--arch dflash2); this run trains a "
                                 "dflash drafter",
    "dflash2-default-option-for-dflash": "--selector-top-k is an option of DFlash 2 drafters",  # (its default value too)
    # (a NotADirectoryError traceback once the target had loaded)
    "out-under-a-file": "cannot use --out ",
    # (an argument of the template call itself, as generate/chat/serve refuse it)
    "template-kwargs-reserved": "--chat-template-kwargs cannot set add_generation_prompt",
    # (the checks the Python API shares: their fields named as flags)
    "gamma-0": "--gamma must be a finite number > 0, got 0.0",
    "anchors-per-seq-0": "--anchors-per-seq must be >= 1, got 0",
    "threads-0": "--threads must be an integer from 1 to the CPUs this process may use",
    # (trained with the source's top-k 8, and recorded 4: trial-259)
    "init-from-dflash2-top-k": "--selector-top-k 4 cannot be combined with --init-from ",
}


def test_a_target_without_tokenizer_files_is_named_by_its_flag(tiny_pair, tmp_path, capsys):
    """``--target notok`` (a checkpoint without tokenizer files) said "notok has no tokenizer
    files (...)", the only --target error without the "--target:" its others have (trial-320);
    generate said it so too; so are its tokenizer's other errors. The Python API names the field."""
    from dflash_torch.cli import main as cli_main
    from dflash_torch.errors import OptionError
    from dflash_torch.tokenizer import TOKENIZER_FILES

    target, _ = tiny_pair
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(target) / f, notok / f)
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    said = f"--target: {notok} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
    for args in (["train", "--target", str(notok), "--data", str(text), "--out", str(tmp_path / "out"), "--steps", "1",
                  "--no-progress"], ["generate", "hi", "--target", str(notok), "--no-draft"]):
        assert cli_main(args) == 2
        assert capsys.readouterr().err == f"dflash-torch: error: {said}\n"
    with pytest.raises(OptionError) as err:
        DFlashEngine.from_pretrained(notok, no_draft=True)
    assert str(err.value) == said.replace("--target", "target") and err.value.names == ("target",)
    # its other tokenizer errors too (tokenizer_config.json alone left: trial-325)
    halftok = shutil.copytree(target, tmp_path / "halftok")
    (halftok / "tokenizer.json").unlink()
    said = (f"--target: cannot load the tokenizer of {halftok}, which has no tokenizer.json, tokenizer.model or "
            "vocab.json (an incomplete download?)")
    for args in (["train", "--target", str(halftok), "--data", str(text), "--out", str(tmp_path / "out"), "--steps",
                  "1", "--no-progress"], ["generate", "hi", "--target", str(halftok), "--no-draft"]):
        assert cli_main(args) == 2
        assert capsys.readouterr().err == f"dflash-torch: error: {said}\n"
    with pytest.raises(OptionError) as err:
        DFlashEngine.from_pretrained(halftok, no_draft=True)
    assert str(err.value) == said.replace("--target", "target") and err.value.names == ("target",)


@pytest.mark.parametrize("case", list(REFUSED_TRAIN_OPTIONS))
def test_train_refuses_unsafe_or_useless_options_before_training(tiny_pair, tmp_path, capsys, case):
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--steps", "1", "--no-progress"]
    words = REFUSED_TRAIN_OPTIONS[case]
    if case == "init-from-with-shape":
        args += ["--init-from", str(drafter), "--num-layers", "2"]
    elif case == "init-from-dflash2-as-dflash":
        args += ["--init-from", str(save_drafter(tmp_path / "v2", dflash2_config(target)))]
    elif case == "init-from-dflash2-top-k":
        args += ["--init-from", str(save_drafter(tmp_path / "v2", dflash2_config(target))), "--arch", "dflash2",
                 "--selector-top-k", "4"]
    elif case == "conv-group-size":
        args += ["--arch", "dflash2", "--conv-group-size", "24"]
    elif case == "top-k-above-vocab":
        args += ["--arch", "dflash2", "--selector-top-k", "400"]
    elif case == "out-is-target":
        args[args.index("--out") + 1] = str(target)
    elif case == "out-holds-drafter":
        shutil.copytree(drafter, out)
    elif case == "work-holds-checkpoint":
        (out / "train_work").mkdir(parents=True)
        (out / "train_work" / "checkpoint.pt").write_bytes(b"x")
    elif case == "short-seq":
        args += ["--seq-len", "16", "--block-size", "16"]
    elif case == "self-distill-batch-0":
        args += ["--self-distill", "2", "--self-distill-batch", "0", "--seq-len", "64", "--batch", "2", "--val-seqs", "0"]
    elif case == "negative-prefix":  # (sliced the prompts from the wrong end)
        args += ["--self-distill", "2", "--prefix-min", "-5", "--prefix-max", "-1", "--seq-len", "64", "--batch", "2",
                 "--val-seqs", "0"]
    elif case == "init-from-target-too-deep":
        args += ["--init-from-target", "--num-layers", "9"]
    elif case == "intermediate-size-0":
        args += ["--intermediate-size", "0"]
    elif case == "prefix-min-above-max":
        args += ["--self-distill", "2", "--prefix-min", "10", "--prefix-max", "5"]
    elif case == "negative-weight-decay":
        args += ["--weight-decay", "-0.1"]
    elif case == "grad-clip-0":
        args += ["--grad-clip", "0"]
    elif case == "data-missing":
        args[args.index("--data") + 1] = str(tmp_path / "nowhere.txt")
    elif case == "lr-inf":
        args += ["--lr", "inf"]
    elif case == "lr-negative-exponent":
        args += ["--lr", "-1e-3"]
    elif case == "weight-decay-nan":
        args += ["--weight-decay", "nan"]
    elif case.startswith("selector-loss-weight-"):
        args += ["--arch", "dflash2", "--selector-loss-weight", case.rsplit("-", 1)[1]]
    elif case == "prefix-max-past-seq-len":
        args += ["--self-distill", "2", "--prefix-max", "100", "--seq-len", "64"]
    elif case == "resume-and-overwrite":
        (out / "train_work").mkdir(parents=True)
        (out / "train_work" / "checkpoint.pt").write_bytes(b"x")
        args += ["--resume", "--overwrite"]
    elif case == "raw-fraction-nan":
        args += ["--raw-fraction", "nan"]
    elif case == "dflash2-option-for-dflash":
        args += ["--selector-rank", "16"]
    elif case == "dflash2-default-option-for-dflash":
        args += ["--selector-top-k", "16"]
    elif case == "out-under-a-file":
        (tmp_path / "afile").write_text("x")
        args[args.index("--out") + 1] = str(tmp_path / "afile" / "sub")
    elif case == "template-kwargs-reserved":
        args += ["--chat-template-kwargs", '{"add_generation_prompt": false}']
    elif case == "gamma-0":
        args += ["--gamma", "0"]
    elif case == "anchors-per-seq-0":
        args += ["--anchors-per-seq", "0"]
    elif case == "threads-0":
        args += ["--threads", "0"]
    else:
        args += ["--save-dtype", "float64"]
    target_files = {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()}
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()} == target_files
    if case == "out-holds-drafter":  # and --overwrite is the way through
        assert cli_main(args + ["--overwrite", "--batch", "2", "--seq-len", "64", "--val-seqs", "0"]) == 0
        assert (out / "model.safetensors").stat().st_mode & 0o644 == 0o644


# TrainConfig fields the Python API took unchecked (trial): what each did, and the line now
API_REFUSALS = {
    "gamma-0": ({"gamma": 0.0}, "gamma must be a finite number > 0, got 0.0"),  # (trained with gamma 7, unsaid)
    "gamma-nan": ({"gamma": float("nan")}, "gamma must be a finite number > 0, got nan"),  # ("diverged ... lower --lr")
    "steps-0": ({"steps": 0}, "steps must be >= 1, got 0"),  # (exported an untrained drafter, unsaid)
    "batch-0": ({"batch": 0}, "batch must be >= 1, got 0"),  # (an AttributeError)
    "anchors-0": ({"anchors_per_seq": 0}, "anchors_per_seq must be >= 1, got 0"),  # (a RuntimeError of reshape)
    "log-every-0": ({"log_every": 0}, "log_every must be >= 1, got 0"),  # (a ZeroDivisionError)
    "batch-float": ({"batch": 2.5}, "batch must be an integer >= 1, got 2.5"),
    "no-stop": ({"steps": None}, "give steps, time_budget_min, or both"),
    "no-data": ({"data": []}, "data must name at least one path (a text or data file, a directory)"),
    "init-from-and-shape": ({"init_from": "d", "intermediate_size": 64},
                            "intermediate_size cannot be combined with init_from (the drafter's shape and weights come "
                            "from it)"),
    "seq-len-within-block": ({"seq_len": 8}, "seq_len (8) must be longer than the block size (8)"),
    "min-lr-frac": ({"min_lr_frac": 2.0}, "min_lr_frac must be in [0, 1], got 2.0"),
    # (trial-259: 1.0 / True ids trained into a config.json the engine refuses; "1,3" was a TypeError of '<=')
    "layer-ids-float": ({"target_layer_ids": [1.0, 3.0]},
                        "target_layer_ids must be a list of integers (target layer ids), got [1.0, 3.0]"),
    "layer-ids-bool": ({"target_layer_ids": [True, 3]},
                       "target_layer_ids must be a list of integers (target layer ids), got [True, 3]"),
    "layer-ids-text": ({"target_layer_ids": "1,3"},
                       "target_layer_ids must be a list of integers (target layer ids), got '1,3'"),
    "mask-id-float": ({"mask_token_id": 1.0}, "mask_token_id must be an integer (a token id), got 1.0"),
    "mask-id-bool": ({"mask_token_id": True}, "mask_token_id must be an integer (a token id), got True"),
    "mask-id-text": ({"mask_token_id": "1"}, "mask_token_id must be an integer (a token id), got '1'"),
    # (random.seed's ValueError, a TypeError, torch's "Overflow when unpacking long long", manual_seed's RuntimeError)
    **{f"seed-{what}": ({"seed": seed}, "seed must be an integer from -2**63 to 2**64 - 1 (what torch.manual_seed "
                                        f"takes), got {shown(seed)}")
       for what, seed in (("text", "abc"), ("none", None), ("huge", 2**70), ("float", 1.5), ("bool", True))},
    # (TypeErrors of posixpath / pathlib)
    "target-none": ({"target": None},
                    "target must be a checkpoint directory or Hugging Face id (a str or os.PathLike), got None"),
    "out-none": ({"out": None}, "out must be a directory (a str or os.PathLike), got None"),
    "out-int": ({"out": 123}, "out must be a directory (a str or os.PathLike), got 123"),
    "work-dir-int": ({"work_dir": 123}, "work_dir must be a directory (a str or os.PathLike) or None, got 123"),
    "init-from-int": ({"init_from": 123}, "init_from must be a checkpoint directory or Hugging Face id (a str or "
                                          "os.PathLike) or None, got 123"),
    # ("no" was true: autocast on, copying on, a resume)
    "autocast-text": ({"autocast": "no"}, "autocast must be True or False, got 'no'"),
    "init-from-target-text": ({"init_from_target": "yes"}, "init_from_target must be True or False, got 'yes'"),
    "resume-text": ({"resume": "no"}, "resume must be True or False, got 'no'"),
    "save-dtype-int": ({"save_dtype": 5}, "save_dtype must be a dtype name ('bfloat16', 'float32') or a torch.dtype, "
                                          "got 5"),
    "resume-and-overwrite": ({"resume": True, "overwrite": True}, "resume=True continues the checkpoint in the work "
                             "dir and overwrite=True starts over: give one of them"),
    # (silently ignored under arch "dflash"; a self-distill prompt cut to seq_len - 16, unsaid)
    "dflash2-field-for-dflash": ({"selector_top_k": 0}, "selector_top_k is an option of DFlash 2 drafters (arch "
                                                        "dflash2); this run trains a dflash drafter"),
    "prefix-past-seq-len": ({"self_distill": 2, "prefix_min": 60, "prefix_max": 100},
                            "prefix_min 60 is longer than a self-distill prompt may be at seq_len 64 (48 tokens, "
                            "leaving 16 to the continuation): give at most 48, or a longer seq_len"),
}


@pytest.mark.parametrize("case", list(API_REFUSALS))
def test_the_python_api_refuses_what_the_command_line_does(tiny_pair, tmp_path, case):
    """TrainConfig + Trainer.run check the values the train command checks (shared, check_config),
    naming the field, before anything is read or written."""
    from dflash_torch.errors import OptionError

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    fields, words = API_REFUSALS[case]
    cfg = replace(_cfg(tmp_path, target, text, steps=2, val_seqs=0), **fields)
    with pytest.raises(OptionError) as err:
        Trainer(cfg, log=lambda m: None).run()
    assert str(err.value) == words and err.value.name in fields, err.value
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_every_seed_torch_takes_makes_step_generators_and_the_others_the_same():
    """A seed near torch.manual_seed's bound overflowed the step generator's seed after the target
    had loaded (trial-259); the seeds that fitted keep their generators (a resume goes on alike)."""
    from dflash_torch.training.data import step_generator
    from dflash_torch.training.trainer import SEED_RANGE

    for seed in SEED_RANGE:
        step_generator(seed, 3, 1).initial_seed()
    for seed in (0, 7, -5):
        want = torch.Generator().manual_seed((seed * 1_000_003 + 3) * 7 + 1)
        assert torch.equal(torch.rand(4, generator=step_generator(seed, 3, 1)), torch.rand(4, generator=want))


def test_the_python_api_refuses_the_directories_the_command_line_does(tiny_pair, tmp_path):
    """(trial-259) Trainer.run checks out, work_dir and data as the train command does (the
    checks are shared, check_run_dirs; its messages name the fields, the command line's the
    flags): out the target's directory replaced the target's weights; a second run replaced
    the first one's drafter and checkpoint; data naming out trained on the drafter's own files;
    an out or work_dir that is a file was a pathlib error once the target had loaded; a failed
    run left the directories it made behind."""
    from dflash_torch.errors import OptionError

    target, drafter = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    files = {p.name: p.read_bytes() for p in copy.iterdir()}

    def refused(words: str, **fields) -> OptionError:
        cfg = replace(_cfg(tmp_path, copy, text, steps=1, warmup_steps=1, val_seqs=0), **fields)
        with pytest.raises(OptionError) as err:
            Trainer(cfg, log=lambda m: None).run()
        assert str(err.value) == words, err.value
        return err.value

    err = refused(f"out '{copy}' is the target's directory; give the drafter its own directory", out=str(copy),
                  work_dir=None)
    assert _as_cli(err) == f"--out '{copy}' is the target's directory; give the drafter its own directory"
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == files
    out = tmp_path / "out"
    shutil.copytree(drafter, out)
    names = ", ".join(sorted(p.name for p in out.iterdir()))
    err = refused(f"out '{out}' already holds a drafter or other model ({names}): pass overwrite=True to replace it")
    assert _as_cli(err) == f"--out '{out}' already holds a drafter or other model ({names}): pass --overwrite to replace it"
    err = refused(f"data '{out}' is this run's out: the drafter's own files would be read as data; put the data in a "
                  "directory of its own", data=[str(out)], overwrite=True)
    assert _as_cli(err).startswith(f"--data '{out}' is this run's --out: ")
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoint.pt").write_bytes(b"x")
    err = refused(f"'{work}' holds a training checkpoint: pass resume=True to continue it or overwrite=True to start over",
                  out=str(tmp_path / "new" / "out"))
    assert _as_cli(err) == f"'{work}' holds a training checkpoint: pass --resume to continue it or --overwrite to start over"
    err = refused(f"resume=True: '{work / 'checkpoint.pt'}' is not a whole torch checkpoint file (truncated or damaged), "
                  "so it cannot be read; leave out resume=True and pass overwrite=True to start over",
                  out=str(tmp_path / "new" / "out"), resume=True)
    assert _as_cli(err) == (f"--resume: '{work / 'checkpoint.pt'}' is not a whole torch checkpoint file (truncated or "
                            "damaged), so it cannot be read; leave out --resume and pass --overwrite to start over")
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(f"out '{afile}' is a file; give a directory", out=str(afile))
    refused(f"work_dir '{afile}' is a file; give a directory", work_dir=str(afile), out=str(tmp_path / "new" / "out"))
    # refused once the target has loaded (a field named, not its flag): the directories it made are removed
    err = refused("mask_token_id 99999 is outside the target vocabulary of 320", out=str(tmp_path / "new" / "out"),
                  work_dir=str(tmp_path / "new" / "work"), mask_token_id=99999)
    assert _as_cli(err) == "--mask-token-id 99999 is outside the target vocabulary of 320"
    assert not (tmp_path / "new").exists()
    err = refused("conv_group_size 24 does not divide the hidden size 64", out=str(tmp_path / "new" / "out"),
                  work_dir=str(tmp_path / "new" / "work"), arch="dflash2", conv_group_size=24)
    assert _as_cli(err) == "--conv-group-size 24 does not divide the hidden size 64"
    assert not (tmp_path / "new").exists()


def test_the_python_api_overwrites_when_told_and_leaves_the_callers_threads(tiny_pair, tmp_path):
    """overwrite=True (--overwrite) replaces a drafter in out; save_dtype given as a torch.dtype
    is written as its name (it failed json.dumps after the whole run, training_log.json never
    written); num_threads is the run's only (the caller's count stayed 1); a warm-up longer
    than the run is warned (trial-259)."""
    target, drafter = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    shutil.copytree(drafter, tmp_path / "out")
    cfg = _cfg(tmp_path, target, text, steps=2, warmup_steps=5, val_seqs=0, num_threads=1, overwrite=True,
               save_dtype=torch.float32)
    assert cfg.save_dtype == "float32"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    lines = []
    try:
        info = Trainer(cfg, log=lines.append).run()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert info["config"]["save_dtype"] == log["config"]["save_dtype"] == "float32" and log["steps"] == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"
    said = "WARNING: warmup_steps 5 is more than steps 2: the learning rate warms up for the whole run, reaching " \
        "0.4 x lr at its last step, and never decays; give a smaller warmup_steps"
    assert said in lines, lines
    assert [h["lr"] for h in log["loss_history"]] == pytest.approx([3e-3 / 5, 2 * 3e-3 / 5])
    from dflash_torch.errors import OptionError

    ckpt = Path(cfg.work_dir) / "checkpoint.pt"
    with pytest.raises(OptionError) as err:  # (a resume's errors name the fields too: they named the flags)
        Trainer(replace(cfg, resume=True, overwrite=False, num_layers=2), log=lambda m: None).run()
    assert str(err.value) == (
        f"resume=True: '{ckpt}' was trained with another drafter configuration: num_layers 2 here, 1 in the checkpoint; "
        "target layers 1,1 here (the default of num_layers 2; target_layer_ids not given), 2 in the checkpoint (give "
        "the checkpoint's values to continue it, or leave out resume=True and pass overwrite=True to start over)")
    assert _as_cli(err.value) == (
        f"--resume: '{ckpt}' was trained with another drafter configuration: --num-layers 2 here, 1 in the checkpoint; "
        "target layers 1,1 here (the default of --num-layers 2; --target-layer-ids not given), 2 in the checkpoint "
        "(give the checkpoint's values to continue it, or leave out --resume and pass --overwrite to start over)")
    lines = []  # (the command line names the flags)
    Trainer(cfg, log=lines.append, flags={"warmup_steps": "--warmup-steps", "steps": "--steps", "lr": "--lr"}).say(
        said, "warmup_steps", "steps", "lr")
    assert lines == ["WARNING: --warmup-steps 5 is more than --steps 2: the learning rate warms up for the whole run, "
                     "reaching 0.4 x --lr at its last step, and never decays; give a smaller --warmup-steps"]


def test_init_from_refuses_sizes_other_than_its_drafters(tiny_pair, tmp_path):
    """(trial-259) With init_from, num_layers=5 or block_size=8 trained the source's 3 layers and
    B=16 unsaid, and training_log.json recorded 5 and 8 (the command line refuses those flags);
    so did a DFlash 2 source's --selector-top-k 4 on the command line too."""
    from dflash_torch.errors import OptionError

    target, drafter = tiny_pair  # (a 2-layer, B = 16 drafter)
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    for key, value, theirs in (("num_layers", 5, 2), ("block_size", 8, 16)):
        cfg = _cfg(tmp_path, target, text, steps=1, val_seqs=0, init_from=str(drafter), num_layers=2, block_size=16)
        with pytest.raises(OptionError) as err:
            Trainer(replace(cfg, **{key: value}), log=lambda m: None).run()
        assert str(err.value) == (f"{key} {value} cannot be combined with init_from '{drafter}', whose {key} is {theirs}: "
                                  f"the drafter's shape comes from it (leave {key} at its default, or give {theirs})")
        assert not (tmp_path / "out").exists()
    v2 = save_drafter(tmp_path / "v2", dflash2_config(target))  # (top-k 8)
    cfg = _cfg(tmp_path, target, text, steps=1, val_seqs=0, init_from=str(v2), num_layers=2, block_size=16,
               arch="dflash2", selector_top_k=4)
    with pytest.raises(OptionError) as err:
        Trainer(cfg, log=lambda m: None).run()
    assert _as_cli(err.value) == (f"--selector-top-k 4 cannot be combined with --init-from '{v2}', whose --selector-top-k "
                                  "is 8: the drafter's shape comes from it (leave --selector-top-k at its default, "
                                  "or give 8)")


def test_the_python_api_takes_one_data_path_as_a_list_of_it_and_paths_as_paths(tiny_pair, tmp_path):
    """data="code.txt" was read letter by letter ("training data c does not exist"); an out given
    as a Path failed the export's training_log.json after training; a gamma given is the one used."""
    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    cfg = replace(_cfg(tmp_path, target, text, steps=2, val_seqs=0, gamma=0.5), data=str(text), out=tmp_path / "out",
                  target=target)
    assert cfg.data == [str(text)] and cfg.out == str(tmp_path / "out") and cfg.target == str(target)
    info = Trainer(cfg, log=lambda m: None).run()
    assert info["gamma"] == 0.5 and info["config"]["data"] == [str(text)]
    assert json.loads((tmp_path / "out" / "training_log.json").read_text())["steps"] == 2
    assert TrainConfig(target="t", data=tmp_path / "d", out="o").data == [str(tmp_path / "d")]


# Qwen3's non-thinking mode, in short: an empty think block opens every reply and the generation prompt
NO_THINKING = ("{% set empty = '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and not enable_thinking "
               "else '' %}{% for m in messages %}# {{ m['role'] }}: {{ empty if m['role'] == 'assistant' else '' }}"
               "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}# assistant: {{ empty }}{% endif %}")


def test_train_renders_the_chat_data_with_chat_template_kwargs(tiny_pair, tmp_path, capsys):
    """--chat-template-kwargs (as generate/chat/bench/serve take it) renders the chat data
    and the self-distill prompts, e.g. Qwen3's non-thinking mode that the published
    drafters were trained on (train had no such option: trial-91); it is part of the data
    cache's key and of the recipe a --resume compares."""
    from dflash_torch.cli import main as cli_main

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "chat_template.jinja").write_text(NO_THINKING)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} about lists"},
                                                     {"role": "assistant", "content": f"answer {i}: sorted(x)"}]}) + "\n"
                            for i in range(12)))
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "1", "--batch", "2",
            "--seq-len", "128", "--val-seqs", "0", "--num-layers", "1", "--block-size", "8", "--no-progress",
            "--self-distill", "2", "--prefix-min", "4", "--chat-template-kwargs", '{"enable_thinking": false}']
    assert cli_main(args) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    (first,) = (out / "train_work").glob("data-*.pt")
    blob = torch.load(first, weights_only=False)
    for ids, mask in blob["chat"]:
        text, loss = tok.decode(ids.tolist()), tok.decode(ids[mask].tolist())
        assert text.startswith("# user: question") and "# assistant: <think>\n\n</think>\n\nanswer" in text, text
        assert loss.startswith("answer") and "question" not in loss, loss  # (the think block is the prompt's)
    assert len(blob["distilled"]) == 2
    for ids, mask in blob["distilled"]:  # (the prompts end with the non-thinking generation prompt)
        assert tok.decode(ids[~mask].tolist()).endswith("# assistant: <think>\n\n</think>\n\n")
    log = json.loads((out / "training_log.json").read_text())
    assert log["config"]["chat_template_kwargs"] == {"enable_thinking": False}
    capsys.readouterr()
    # resumed with other variables: the recipe differs, said; the data is made again (not the cache's)
    args[args.index("--steps") + 1] = "2"
    args[-1] = '{"enable_thinking": true}'
    assert cli_main(args + ["--resume"]) == 0
    said = capsys.readouterr().err
    assert """--chat-template-kwargs '{"enable_thinking": true}' (was '{"enable_thinking": false}')""" in said, said
    assert f"data: kept {first} (made from other data or settings, but it holds 2 self-distilled" in said, said
    (again,) = set((out / "train_work").glob("data-*.pt")) - {first}  # (the self-distilled one kept)
    blob = torch.load(again, weights_only=False)
    assert all("<think>" not in tok.decode(ids.tolist()) for ids, _ in blob["chat"])


class _Terminal(io.StringIO):
    """A stream that says it is a terminal: tqdm draws its bars there (on no other stderr)."""

    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_the_logged_loss(tiny_pair, tmp_path, monkeypatch):
    """The bar's loss was a moving average of its own (0.95), lagging behind the loss the log
    says on short runs (6.817 on the bar, 5.5254 in the log: trial-272): it is the last
    loss_history row's, the run's final_train_loss at its end."""
    target_dir, _ = tiny_pair
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    info = Trainer(_cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=3, val_seqs=0, progress=True),
                   log=lambda m: None).run()
    monkeypatch.undo()
    bar = [part for part in terminal.getvalue().split("\r") if part.startswith("train")][-1]
    assert f"loss={info['final_train_loss']}," in bar and "3/3" in bar, bar


def test_a_run_whose_stderr_is_no_terminal_says_its_progress_in_lines(tiny_pair, tmp_path, monkeypatch):
    """``nohup dflash-torch train ... > log``: no bar is drawn there, and between the evaluations
    the log said nothing, no train loss, rate, elapsed time or time left (trial-320). A line
    says them every PROGRESS_LINE_EVERY_S seconds (here every step), the train loss of that step;
    none where the bar is drawn."""
    import dflash_torch.training.trainer as trainer_mod
    from dflash_torch.training.trainer import format_duration, progress_line

    target_dir, _ = tiny_pair
    monkeypatch.setattr(trainer_mod, "PROGRESS_LINE_EVERY_S", 0.0)
    lines: list[str] = []
    info = Trainer(_cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=3, val_seqs=0, progress=True),
                   log=lines.append).run()
    said = [m for m in lines if m.startswith("step ")]
    assert [m.split(":")[0] for m in said] == ["step 1/3", "step 2/3", "step 3/3"], lines
    last = said[-1]
    assert f"train loss {info['final_train_loss']}, lr " in last and " tokens/s, elapsed " in last, last
    assert last.endswith(", ETA 0.0 s") and ("steps/s" in last or "s/step" in last), last
    # each line's loss is its step's, not the last logged row's, up to log_every - 1 steps old (trial-325)
    lines.clear()
    Trainer(_cfg(tmp_path / "sparse", target_dir, _jsonl(tmp_path / "d.jsonl"), steps=3, val_seqs=0, progress=True,
                 log_every=10), log=lines.append).run()
    assert [m.split(", lr ")[0] for m in lines if m.startswith("step ")] == \
        [f"step {r['step']}/3: train loss {r['loss']}" for r in info["loss_history"]], (lines, info["loss_history"])
    terminal = _Terminal()  # (the bar says it all there)
    monkeypatch.setattr(sys, "stderr", terminal)
    lines.clear()
    Trainer(_cfg(tmp_path / "tty", target_dir, _jsonl(tmp_path / "d.jsonl"), steps=2, val_seqs=0, progress=True),
            log=lines.append).run()
    assert not any(m.startswith("step ") for m in lines), lines
    # the rate of this invocation, the time left to --steps or the budget, whichever comes first
    assert progress_line(40, 300, 4.1234, 9.5e-4, 20, 10240, 40.0, 600.0, None) == \
        "step 40/300: train loss 4.1234, lr 9.50e-04, 2.0 s/step, 256 tokens/s, elapsed 10 min 00 s, ETA 8 min 40 s"
    assert progress_line(40, None, None, 1e-3, 40, 4096, 10.0, 10.0, 70.0) == \
        "step 40: train loss -, lr 1.00e-03, 4.00 steps/s, 410 tokens/s, elapsed 10.0 s, ETA 1 min 00 s"
    assert [format_duration(s) for s in (0.04, 59.94, 59.96, 125, 7380)] == \
        ["0.0 s", "59.9 s", "1 min 00 s", "2 min 05 s", "2 h 03 min"]


def test_a_run_ends_with_a_readable_summary_and_the_command_that_uses_the_drafter(tiny_pair, tmp_path):
    """The last line was ``saved drafter to ref (step 30, train loss 3.9932, eval {'step': 30,
    'val_loss': ..., 'val_slot_acc': [...], ...}, 0.0 min)``, and the data line a dict of 17
    counters (trial-320): both are plain words now, the time in seconds, with where
    training_log.json is and the command that decodes with the drafter, which runs."""
    import re
    import shlex

    from dflash_torch.cli import main as cli_main

    target_dir, _ = tiny_pair
    cfg = _cfg(tmp_path, target_dir, _jsonl(tmp_path / "d.jsonl"), steps=2, val_seqs=2)
    lines: list[str] = []
    info = Trainer(cfg, log=lines.append).run()
    out = Path(cfg.out)
    assert not any("{" in m for m in lines), lines
    data = [m for m in lines if m.startswith("data: ") and "held out" in m]
    st = info["data"]
    assert data == [f"data: {st['documents']} documents ({st['stream_tokens']:,} tokens), 1 conversation; "
                    f"{st['val_sequences']} sequences held out for evaluation"], lines
    ev = info["final_eval"]
    tau = "no val_tau" if ev["val_tau"] is None else f"val_tau {ev['val_tau']}"
    assert re.fullmatch(rf"saved drafter to {re.escape(str(out))} \(step 2, train loss {info['final_train_loss']}, "
                        rf"val_loss {ev['val_loss']}, {tau}, \d+\.\d s of training\)", lines[-3]), lines
    assert lines[-2] == f"training log: {out / 'training_log.json'}", lines
    use = f"decode with it: dflash-torch generate 'Hello' --target {target_dir} --draft {out}"
    assert lines[-1] == use, lines
    assert cli_main(shlex.split(use.removeprefix("decode with it: dflash-torch "))
                    + ["--max-new-tokens", "4", "--ignore-eos"]) == 0
    # no held-out rows, a data cache: the same lines, none the less
    lines.clear()
    info = Trainer(replace(cfg, overwrite=True, val_seqs=0, steps=1), log=lines.append).run()
    assert any(m.startswith("data: ") and m.endswith("; none held out for evaluation") for m in lines), lines
    assert re.fullmatch(rf"saved drafter to .* \(step 1, train loss {info['final_train_loss']}, \d+\.\d s of "
                        r"training\)", lines[-3]), lines


def test_the_data_line_counts_the_held_out_conversations_apart(tiny_pair, tmp_path):
    """The data line said "37 conversations (30 trained on)" where 6 of those 30 were held out
    for evaluation, 24 trained on, as training_log.json counted (trial-325): the held-out
    chat rows are subtracted; held-out rows of another kind leave the count as it is."""
    target, _ = tiny_pair
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer number {i} is here"}]} for i in range(12)]
    rows.append({"messages": [{"role": "user", "content": "no reply"}]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list[str] = []
    info = Trainer(_cfg(tmp_path, target, data, steps=1, val_seqs=2, raw_fraction=0.0), log=lines.append).run()
    st = info["data"]
    assert st["val_kind"] == "chat" and st["val_sequences"] == 2 and st["chat_and_distilled_examples"] == 10, st
    assert "data: 13 conversations (10 trained on); 2 sequences held out for evaluation" in lines, lines
    # none held out: all 12 with a reply train
    lines.clear()
    info = Trainer(_cfg(tmp_path / "nv", target, data, steps=1, val_seqs=0, raw_fraction=0.0), log=lines.append).run()
    assert info["data"]["val_kind"] is None and info["data"]["chat_and_distilled_examples"] == 12, info["data"]
    assert "data: 13 conversations (12 trained on); none held out for evaluation" in lines, lines


def test_a_val_tau_of_none_says_why(tiny_pair, tmp_path, capsys):
    """Held-out rows whose replies are shorter than a block leave nothing to replay: val_tau
    is None, and the log and the eval line now say why (trial-91: no word); draft slots
    never measured have a val_slot_acc of None."""
    target, _ = tiny_pair
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": "ok"}]}) + "\n"
                            for i in range(20)))
    lines: list[str] = []
    cfg = _cfg(tmp_path, target, data, steps=2, block_size=8, val_seqs=2, raw_fraction=0.0, eval_every=1)
    info = Trainer(cfg, log=lines.append).run()
    final = info["final_eval"]
    assert final["val_tau"] is None and "no held-out row holds a block of 8 tokens" in final["val_tau_note"], final
    evals = [m for m in lines if m.startswith("eval step")]
    assert evals[0].startswith("eval step 0: val_loss") and "val_tau None (no held-out row holds" in evals[0], lines
    # the row ends at its last token here, not at --seq-len: the note says either (it named --seq-len alone, trial-94)
    assert "before the row ends (at its last token or at seq_len 64)" in final["val_tau_note"], final
    # and what would give an estimate (it said why alone, each eval line again: trial-320)
    assert final["val_tau_note"].endswith(
        ": nothing to replay; for an estimate, give self_distill 5 or more (the held-out rows are then self-distilled "
        "sequences, a text prompt's continued to seq_len), or data whose replies run to 8 tokens or more within "
        "seq_len, or a smaller block_size"), final
    assert [m.split(" val_tau ")[1] for m in evals[1:]] == ["None (nothing to replay: see above)"] * 2, lines
    # slots no anchor of these short replies reaches are unmeasured: None, not an accuracy of 0.0 (trial-94)
    acc = final["val_slot_acc"]
    assert acc[-1] is None and all(a is None or 0.0 <= a <= 1.0 for a in acc), acc
    # the remedy said gives one; the command line names the flags
    info = Trainer(replace(cfg, out=str(tmp_path / "sd"), work_dir=str(tmp_path / "sd-work"), steps=1, self_distill=5,
                           val_seqs=1), log=lambda m: None).run()
    assert info["final_eval"]["val_tau"] is not None, info["final_eval"]
    lines.clear()
    Trainer(replace(cfg, overwrite=True, steps=1), log=lines.append, flags=_cli_flags()).run()
    assert any(m.startswith("eval step 0: ") and "give --self-distill 5 or more" in m and "a smaller --block-size" in m
               and "continued to --seq-len" in m for m in lines), lines
    # from an --init-from drafter, whose block size cannot be changed (refused), no smaller --block-size (trial-325)
    lines.clear()
    info = Trainer(replace(cfg, out=str(tmp_path / "init"), work_dir=str(tmp_path / "init-work"), steps=1,
                           init_from=cfg.out), log=lines.append,
                   flags=_cli_flags()).run()
    assert info["final_eval"]["val_tau_note"].endswith(
        "give self_distill 5 or more (the held-out rows are then self-distilled sequences, a text prompt's continued "
        "to seq_len), or data whose replies run to 8 tokens or more within seq_len"), info["final_eval"]
    assert any(m.startswith("eval step 0: ") and m.endswith("replies run to 8 tokens or more within --seq-len)")
               for m in lines), lines


def test_overwrite_removes_the_replaced_checkpoints_weight_files_only(tiny_pair, tmp_path, capsys):
    """--overwrite into a directory holding a sharded checkpoint left its shards and index
    beside the new model.safetensors (trial-91); they go now, the directory's other files
    stay. Shards alone (no config.json) are a checkpoint too: refused without --overwrite."""
    from conftest import make_target

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    out = make_target(tmp_path / "out", max_shard_size="100KB", tokenizer=False)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    (out / "config.json").unlink()
    (out / "notes.txt").write_text("mine")
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--steps", "1", "--batch", "2",
            "--seq-len", "64", "--val-seqs", "0", "--num-layers", "1", "--no-progress"]
    assert cli_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (  # (not "a checkpoint", the work dir's word: trial-175)
        f"dflash-torch: error: --out '{out}' already holds a drafter or other model (model-00001-of-{len(shards):05d}"
        f".safetensors, model-00002-of-{len(shards):05d}.safetensors, model-00003-of-{len(shards):05d}.safetensors, ...): "
        "pass --overwrite to replace it")
    assert cli_main(args + ["--overwrite"]) == 0
    assert f"removed the weight files of the checkpoint replaced in {out}: model-" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "notes.txt", "train_work", "training_log.json"]
    assert DFlashEngine.from_pretrained(target, out).drafter is not None


def test_train_refuses_an_out_that_is_a_cached_target_or_init_from(tiny_pair, tmp_path, capsys, monkeypatch):
    """``--target ORG/ID --out <its snapshot in the Hugging Face cache> --overwrite`` was accepted
    (only a --target that is a directory was compared): the drafter's config.json was written
    through the snapshot's link into the target's blob. The target's directory, found as
    loading finds it (also through a link to it), and a cached --init-from's are refused;
    the cache is unchanged. So is a --work-dir that is one of them (trial-137)."""
    from huggingface_hub import constants
    from test_errors import _cache_repo

    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    hub = tmp_path / "hub"
    snapshots = {n: _cache_repo(hub, f"acme/{n}", src) / "snapshots" / ("a" * 40) for n, src in (("t", target), ("d", drafter))}
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = {p: p.read_bytes() for p in hub.rglob("*") if p.is_file()}
    (tmp_path / "link").symlink_to(snapshots["t"])
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", "acme/t", "--data", str(text), "--steps", "1", "--batch", "2", "--seq-len", "64",
            "--val-seqs", "0", "--no-progress", "--overwrite"]
    cases = [(snapshots["t"], [], "the target's directory"), (tmp_path / "link", [], "the target's directory"),
             (snapshots["d"], ["--init-from", "acme/d"], "the directory of --init-from 'acme/d' in the Hugging Face cache")]
    for out, more, whose in cases:
        assert cli_main([*args, "--out", str(out), *more]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dflash-torch: error: --out '{out}' is {whose}; give the drafter its own directory"], err
    # a --work-dir there is refused too: its checkpoint.pt and data caches were written into the target's directory
    for work, more, whose in [*cases, (target, [], "the target's directory")]:
        args_work = [*args, "--out", str(tmp_path / "out"), "--work-dir", str(work), *more]
        if work == target:
            args_work[2] = str(target)
        assert cli_main(args_work) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dflash-torch: error: --work-dir '{work}' is {whose}; give the data cache and checkpoint a "
                       "directory of their own"], err
        assert not (tmp_path / "out").exists()
    # elsewhere in the target's cache folder (its blobs; a new directory there): deleting the model deleted the drafter
    folder = hub / "models--acme--t"
    for out in (folder / "blobs", folder / "out"):
        assert cli_main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dflash-torch: error: --out '{out}' is inside the Hugging Face cache folder of 'acme/t' "
                       f"('{folder}'); give the drafter its own directory outside it"], err
    assert not (folder / "out").exists()
    assert not any(p.name.startswith(("checkpoint", "data-")) for p in Path(target).iterdir())
    assert {p: p.read_bytes() for p in hub.rglob("*") if p.is_file()} == cached
    assert not any(p.name == "train_work" for p in hub.rglob("*"))


def test_progress_bars_are_drawn_only_on_a_terminal_and_lines_keep_their_own_lines(tiny_pair, tmp_path, capsys,
                                                                                    monkeypatch):
    """``train ... 2> log`` (stderr a file): the bar's \\r-separated redraws filled the log, and
    eval lines were glued to it (``...[00:00<?, ?step/s]eval step 0: val_loss ...``); so did the
    self-distill bar. Where stderr is not a terminal no bar is drawn; where it is, the run's
    lines are written above the bar, each on its own line (trial-284)."""
    from dflash_torch.cli import main as cli_main
    from dflash_torch.tokenizer import load_tokenizer
    from dflash_torch.training.distill import self_distill

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(60)))
    args = ["train", "--target", str(target), "--data", str(text), "--steps", "2", "--batch", "2", "--seq-len", "64",
            "--val-seqs", "2", "--eval-every", "1", "--num-layers", "1", "--block-size", "4"]
    assert cli_main([*args, "--out", str(tmp_path / "file")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "step/s" not in err, err
    assert [line for line in err.splitlines() if line.startswith("eval step")] == \
        [line for line in err.splitlines() if "eval step" in line] != [], err

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli_main([*args, "--out", str(tmp_path / "tty")]) == 0
    monkeypatch.undo()
    drawn = terminal.getvalue()
    assert "step/s" in drawn, drawn  # (the bar)
    lines = [part for line in drawn.split("\n") for part in line.split("\r")]
    evals = [line for line in lines if "eval step" in line]
    assert len(evals) == 3 and all(line.startswith("eval step") for line in evals), drawn
    capsys.readouterr()
    examples = self_distill(target, load_tokenizer(target), [[1, 2, 3]], [False], 6, progress=True)
    assert len(examples) == 1 and capsys.readouterr().err == ""  # (nor transformers' bar as it loads the weights)


def test_training_log_records_a_command_that_reruns_and_the_commit_of_a_hub_target(tiny_pair, tmp_path, capsys,
                                                                                     monkeypatch):
    """training_log.json's ``command`` was ``" ".join(argv)``: an ``--out 'tr out ü'`` was recorded
    unquoted, not a command that runs again; and a Hub id's log recorded only ``acme/t@main``, not
    the commit main named then (main moves). The command is quoted as a shell reads it, and
    ``target_revision`` is the cached snapshot's commit (null for a local directory) (trial-284)."""
    import shlex

    from huggingface_hub import constants
    from test_errors import _cache_repo

    from dflash_torch import hub
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    snapshot = _cache_repo(tmp_path / "hub", "acme/t", target) / "snapshots" / ("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "tr out ü"
    args = ["train", "--target", "acme/t@main", "--data", str(text), "--out", str(out), "--steps", "1", "--batch", "2",
            "--seq-len", "64", "--val-seqs", "0", "--num-layers", "1", "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dflash-torch", *args])
    assert cli_main(args) == 0, capsys.readouterr().err
    log = json.loads((out / "training_log.json").read_text())
    assert shlex.split(log["command"]) == ["dflash-torch", *args]
    assert log["target_revision"] == "a" * 40 and log["config"]["target"] == "acme/t@main"
    assert log["init_from_revision"] is None  # (no init_from)
    # a drafter to start from, taken by its Hub id: its commit too
    drafter = tmp_path / "d"
    drafter.mkdir()
    for file in out.iterdir():
        if file.is_file():  # (not its train_work folder)
            shutil.copy(file, drafter)
    _cache_repo(tmp_path / "hub", "acme/d", drafter)
    again = tmp_path / "again"
    args = ["train", "--target", "acme/t", "--init-from", "acme/d", "--data", str(text), "--out", str(again), "--steps",
            "1", "--batch", "2", "--seq-len", "64", "--val-seqs", "0", "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dflash-torch", *args])
    assert cli_main(args) == 0, capsys.readouterr().err
    log = json.loads((again / "training_log.json").read_text())
    assert log["target_revision"] == log["init_from_revision"] == "a" * 40
    # the snapshot's own path, or a link to it, is that commit too; a local directory of its own has none
    (tmp_path / "link").symlink_to(snapshot)
    assert [hub.revision_of(p) for p in ("acme/t", snapshot, tmp_path / "link", target, "acme/none", f"acme/x@{'b' * 40}")] \
        == ["a" * 40, "a" * 40, "a" * 40, None, None, "b" * 40]


def test_training_log_and_checkpoint_keep_each_invocation_of_a_resumed_run(tiny_pair, tmp_path, capsys, monkeypatch):
    """train text --steps 1, resume --lr 2e-3 --steps 2, resume --data chat --steps 3: the log's
    command and config showed only the last invocation (the checkpoint's train_config too), the
    recipe of the first two lost (trial-293). ``runs`` keeps each: its command, the step it
    started at, the first one's config and each resume's changed values; ``command`` and
    ``config`` are still the last invocation's."""
    import shlex

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    work, args = _one_step_run(target, tmp_path)
    chat = _add_chats(tmp_path / "chat.jsonl", 12)
    commands = [args, [*args, "--steps", "2", "--resume", "--lr", "2e-3"],
                [*args, "--steps", "3", "--resume", "--lr", "2e-3", "--data", str(chat)]]
    for argv in commands:
        monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dflash-torch", *argv])
        assert cli_main(argv) == 0, capsys.readouterr().err
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert shlex.split(log["command"]) == ["dflash-torch", *commands[-1]]  # (the last one's, as before)
    assert log["config"]["data"] == [str(chat)] and log["config"]["lr"] == 2e-3 and log["steps"] == 3
    runs = log["runs"]
    assert [shlex.split(r["command"]) for r in runs] == [["dflash-torch", *c] for c in commands]
    assert [r["start_step"] for r in runs] == [0, 1, 2]
    first = runs[0]["config"]
    assert first["data"] == [str(tmp_path / "c.txt")] and first["lr"] == 1e-3 and first["steps"] == 1
    assert first["resume"] is False and "changed" not in runs[0]
    assert runs[1]["changed"] == {"lr": 2e-3, "steps": 2, "resume": True}
    assert runs[2]["changed"] == {"data": [str(chat)], "steps": 3}
    # the checkpoint keeps them too (a later resume goes on from them)
    st = torch.load(work / "checkpoint.pt", weights_only=True)
    assert st["runs"] == runs and st["train_config"] == log["config"]
    # a checkpoint saved before runs were kept: its run starts the list, its command unknown
    del st["runs"]
    torch.save(st, work / "checkpoint.pt")
    argv = [*args, "--steps", "4", "--resume", "--lr", "2e-3", "--data", str(chat)]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dflash-torch", *argv])
    assert cli_main(argv) == 0, capsys.readouterr().err
    runs = json.loads((tmp_path / "out" / "training_log.json").read_text())["runs"]
    assert runs[0] == {"command": None, "start_step": 0, "config": log["config"]}
    assert runs[1]["start_step"] == 3 and runs[1]["changed"] == {"steps": 4}, runs


def test_train_refuses_an_out_or_work_dir_inside_the_target(tiny_pair, tmp_path, capsys):
    """``--out`` or ``--work-dir`` in a directory inside the target's (there or not yet, also
    through a link to the target or a ``..``) was accepted: the drafter's files, or the data
    caches and checkpoint.pt, were written into the target's checkpoint. Refused in one line,
    as the target's directory itself is, before anything is made in it."""
    from dflash_torch.cli import main as cli_main

    target = shutil.copytree(tiny_pair[0], tmp_path / "target")  # (a run this lets through writes into it)
    (target / "old").mkdir()
    (tmp_path / "link").symlink_to(target)
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", str(target), "--data", str(text), "--steps", "1", "--batch", "2", "--seq-len", "64",
            "--val-seqs", "0", "--no-progress"]
    own = {"--out": "the drafter its own directory",
           "--work-dir": "the data cache and checkpoint a directory of their own"}
    for inside in (target / "drafter", target / "old", target / "new" / "deeper", tmp_path / "link" / "drafter",
                   tmp_path / "elsewhere" / ".." / "target" / "x"):
        for flag, more in (("--out", []), ("--work-dir", ["--out", str(tmp_path / "out")])):
            assert cli_main([*args, *more, flag, str(inside)]) == 2, (flag, inside)
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"dflash-torch: error: {flag} '{inside}' is inside the target's directory; give {own[flag]} "
                           "outside it"], err
            assert not (tmp_path / "out").exists() and not (tmp_path / "elsewhere").exists()
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    # (a directory beside the target whose name starts with the target's is not inside it)
    assert cli_main([*args, "--out", str(tmp_path / "target-drafter"), "--work-dir", str(tmp_path / "target2")]) == 0
    assert (tmp_path / "target-drafter" / "config.json").is_file()


def test_train_never_writes_through_a_link_in_out(tiny_pair, tmp_path, capsys, monkeypatch):
    """``--out DIR --overwrite`` where DIR's config.json and weights are links (a linked layout, a
    snapshot of the Hugging Face cache given as a directory, fine-tuned in place with
    --init-from) wrote config.json through its link into the file it names (a blob no longer
    holding what its name says). The links are replaced by new files; what they named is
    unchanged."""
    from test_errors import _cache_repo

    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    source = shutil.copytree(drafter, tmp_path / "source")
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in ("config.json", "model.safetensors"):
        (linked / name).symlink_to(source / name)
    (source / "training_log.json").write_text("{}")
    (linked / "training_log.json").symlink_to(source / "training_log.json")
    snapshot = _cache_repo(tmp_path / "hub", "acme/d", drafter) / "snapshots" / ("a" * 40)
    kept = {p: p.read_bytes() for p in [*source.iterdir(), *(tmp_path / "hub").rglob("blobs/*")]}
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    args = ["train", "--target", str(target), "--data", str(text), "--steps", "1", "--batch", "2", "--seq-len", "64",
            "--val-seqs", "0", "--no-progress", "--overwrite"]
    for out, more in ((linked, ["--num-layers", "1"]), (snapshot, ["--init-from", str(snapshot)])):
        assert cli_main([*args, "--out", str(out), *more]) == 0, capsys.readouterr().err
        for name in ("config.json", "model.safetensors", "training_log.json"):
            assert (out / name).is_file() and not (out / name).is_symlink(), (out, name)
        assert DFlashEngine.from_pretrained(target, out).drafter is not None
    assert {p: p.read_bytes() for p in kept} == kept
    assert json.loads((linked / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_failed_or_interrupted_export_never_leaves_a_broken_drafter(tiny_pair, tmp_path, capsys, monkeypatch):
    """A full disk (or a Ctrl-C) while the drafter was exported left --out with a truncated
    model.safetensors beside the old config.json (with --overwrite the previous drafter was
    gone), and exited 130 unsaid (trial-137). The files are written aside and moved into
    place: a failed export says so in one line, leaves the old drafter whole, and --resume
    exports it; a Ctrl-C during the export is ignored (the export goes on, whole)."""
    import errno
    import os
    import signal

    import safetensors
    import safetensors.torch

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--steps", "1", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0",
            "--block-size", "8", "--no-progress"]
    assert cli_main([*args, "--num-layers", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    old = {f.name: f.read_bytes() for f in out.iterdir()}
    save_file = safetensors.torch.save_file

    def disk_full(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    assert cli_main([*args, "--num-layers", "2", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"dflash-torch: error: cannot export the drafter to '{out}': No space left on device; the checkpoint "
                       f"of step 1 is saved in '{work / 'checkpoint.pt'}': run again with --resume to export it"), err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == old  # (no temporary file left either)
    assert DFlashEngine.from_pretrained(target, out).drafter.config.num_hidden_layers == 1

    def disk_full_as_safetensors_says_it(state, path, metadata=None):  # (not an OSError: trial-166, a traceback)
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_as_safetensors_says_it)
    assert cli_main([*args, "--num-layers", "2", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"dflash-torch: error: cannot export the drafter to '{out}': No space left on device; the checkpoint "
                       f"of step 1 is saved in '{work / 'checkpoint.pt'}': run again with --resume to export it"), err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == old

    def interrupted(state, path, metadata=None):  # (a real SIGINT, as the terminal sends it, while it writes)
        os.kill(os.getpid(), signal.SIGINT)
        return save_file(state, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    assert cli_main([*args, "--num-layers", "2", "--resume"]) == 0
    assert f"saved drafter to {out}" in capsys.readouterr().err
    assert DFlashEngine.from_pretrained(target, out).drafter.config.num_hidden_layers == 2
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors", "training_log.json"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    # weights that cannot be moved into place (a directory there): the old config.json stays (trial-146: removed)
    config = (out / "config.json").read_bytes()
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").mkdir()
    assert cli_main([*args, "--num-layers", "2", "--overwrite"]) == 2
    assert "dflash-torch: error: cannot export the drafter to" in capsys.readouterr().err
    assert (out / "config.json").read_bytes() == config
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors", "training_log.json"]
    # a training_log.json that cannot be written: one line (trial-146: a traceback), the drafter exported
    (out / "model.safetensors").rmdir()
    (out / "training_log.json").unlink()
    (out / "training_log.json").mkdir()
    assert cli_main([*args, "--num-layers", "2", "--overwrite"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: the drafter is saved in '{out}', but its training_log.json could not be written: "
        "Is a directory")
    assert DFlashEngine.from_pretrained(target, out).drafter.config.num_hidden_layers == 2


def test_a_ctrl_c_in_the_last_evaluation_saves_a_checkpoint_that_resume_exports(tiny_pair, tmp_path, capsys,
                                                                                monkeypatch):
    """A Ctrl-C after the last step, in the final evaluation, exited 130 unsaid with the steps
    since the last checkpoint lost: it saves a checkpoint as one during training does."""
    import os
    import signal
    import time

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    out, work = tmp_path / "out", tmp_path / "work"
    evaluate, calls = Trainer.evaluate, []

    def evaluating(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # (the first is the one before training)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            raise AssertionError("no KeyboardInterrupt")
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", evaluating)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--steps", "2", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "2",
            "--block-size", "8", "--num-layers", "1", "--no-progress"]
    assert cli_main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"interrupted: checkpoint of step 2 saved to '{work / 'checkpoint.pt'}'; continue with --resume", err
    assert not out.joinpath("config.json").exists()
    assert cli_main([*args, "--resume"]) == 0
    assert "saved drafter to" in capsys.readouterr().err
    assert json.loads((out / "training_log.json").read_text())["final_eval"]["step"] == 2


@pytest.mark.parametrize("in_the_way", ["checkpoint.pt", "checkpoint.tmp"])
def test_a_final_checkpoint_that_cannot_be_saved_still_exports_the_drafter(tiny_pair, tmp_path, capsys, in_the_way):
    """The last checkpoint failing (a full --work-dir; here a directory where checkpoint.pt goes) left --out
    without the trained drafter, though it had room: the drafter is exported, then the failure said. A
    directory where its temporary file goes is named (it was "... to work/checkpoint.pt: Is a directory",
    though no checkpoint.pt was there)."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    out, work = tmp_path / "out", tmp_path / "work"
    (work / in_the_way).mkdir(parents=True)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--steps", "2", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0",
            "--block-size", "8", "--num-layers", "1", "--no-progress", "--overwrite"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dflash-torch: error: the drafter of step 2 is saved in '{out}', but --resume cannot "
                              f"continue this run: cannot save the training checkpoint of step 2 to "
                              f"'{work / 'checkpoint.pt'}': "), err
    if in_the_way == "checkpoint.tmp":
        assert err[-1].endswith(f": cannot write {work / 'checkpoint.tmp'}: Is a directory"), err
    assert json.loads((out / "training_log.json").read_text())["steps"] == 2
    DFlashEngine.from_pretrained(target, out)  # (a whole drafter)


def test_a_checkpoint_that_cannot_be_saved_mid_run_or_on_ctrl_c_still_exports_the_drafter(tiny_pair, tmp_path, capsys,
                                                                                         monkeypatch):
    """A --ckpt-every checkpoint failing stopped training with nothing exported, and so did one saved after a
    Ctrl-C (exit 2, the trained steps lost): the drafter of that step is exported to --out, then the failure
    said (a Ctrl-C's: a line, exit 130 still)."""
    import os
    import signal
    import time

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "checkpoint.tmp").mkdir(parents=True)
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--steps", "3", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "2",
            "--block-size", "8", "--num-layers", "1", "--no-progress", "--overwrite"]
    unsaved = (f"but --resume cannot continue this run: cannot save the training checkpoint of step 1 to "
               f"'{work / 'checkpoint.pt'}': cannot write {work / 'checkpoint.tmp'}: Is a directory")
    assert cli_main([*args, "--ckpt-every", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"dflash-torch: error: training stopped: the drafter of step 1 is saved in '{out}', {unsaved}", err
    assert json.loads((out / "training_log.json").read_text())["steps"] == 1
    DFlashEngine.from_pretrained(target, out)
    shutil.rmtree(out)

    evaluate, calls = Trainer.evaluate, []

    def evaluating(self, *args, **kwargs):  # (a Ctrl-C in the evaluation after step 1)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            raise AssertionError("no KeyboardInterrupt")
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", evaluating)
    assert cli_main([*args, "--eval-every", "1"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"interrupted: the drafter of step 1 is saved in '{out}', {unsaved}", err
    assert json.loads((out / "training_log.json").read_text())["steps"] == 1
    DFlashEngine.from_pretrained(target, out)


def test_out_and_work_dir_expand_a_tilde_as_the_other_paths_do(tiny_pair, tmp_path, capsys, monkeypatch):
    """--out '~/x' and --work-dir '~/x' (quoted, or after '=': the shell leaves the ~) made a directory named ~ in the
    working directory, while --data, --target and --init-from expand it."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / "c.txt").write_text("def f(x):\n    return x\n" * 50)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert cli_main(["train", "--target", str(target), "--data", "~/c.txt", "--out", "~/out", "--work-dir=~/work",
                     "--steps", "1", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0",
                     "--block-size", "8", "--num-layers", "1", "--no-progress"]) == 0
    assert f"saved drafter to {home / 'out'} " in capsys.readouterr().err
    assert (home / "out" / "config.json").is_file() and (home / "work" / "checkpoint.pt").is_file()
    assert not list(cwd.iterdir())


def test_export_moves_the_new_config_into_place_last(tiny_pair, tmp_path, monkeypatch):
    """A crash between the renames of an export leaves weights without a config.json, never
    the new weights beside the old drafter's config.json."""
    import os

    import dflash_torch.training.trainer as trainer

    target, drafter_dir = tiny_pair
    out = shutil.copytree(drafter_dir, tmp_path / "out")
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    replace = os.replace

    def crash_before_the_config(src, dst):  # (the file system's rename, failing for config.json only)
        if Path(dst).name == "config.json":
            raise OSError("crash")
        return replace(src, dst)

    monkeypatch.setattr(trainer.os, "replace", crash_before_the_config)
    with pytest.raises(OSError, match="crash"):
        trainer.export_drafter(drafter, drafter.config, out, "float32")
    assert sorted(f.name for f in out.iterdir()) == ["model.safetensors"]  # (the temporary config is gone too)
    monkeypatch.setattr(trainer.os, "replace", replace)
    trainer.export_drafter(drafter, drafter.config, out, "float32")
    assert DFlashEngine.from_pretrained(target, out).drafter is not None


def test_save_dtype_float16_saves_float16_weights_the_engine_decodes_losslessly(tiny_pair, tmp_path):
    """trial-319 (d): --save-dtype float16 was refused "activations can overflow", a reason of
    computing in float16, while save_dtype is storage only (the engine reads float16 weights
    into its own dtype). Now it saves float16 weights, which decode as the target alone does;
    a weight past float16's range is refused at the export rather than saved as inf."""
    import dflash_torch.training.trainer as trainer

    target, drafter_dir = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 50)
    cfg = _cfg(tmp_path, target, text, steps=2, val_seqs=0, save_dtype="fp16")
    Trainer(cfg, log=lambda m: None).run()
    out = Path(cfg.out)
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.float16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    spec = DFlashEngine.from_pretrained(target, out)
    base = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ("def f(x):", "import os\n"):
        assert spec.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == \
            base.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = 1e6
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    with pytest.raises(DFlashError, match=r"^the drafter weight fc.weight holds 1e\+06, past the range of save_dtype "
                                          r"float16: save it as bfloat16 or float32$"):
        trainer.export_drafter(drafter, drafter.config, out, "float16")
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    trainer.export_drafter(drafter, drafter.config, out, "bfloat16")  # (in its range)


def _recorded_moves(monkeypatch) -> list[tuple]:
    """The trainer's flushes (``_fsync``, the real one) and moves (``os.replace``, real), noted
    in order as ``("fsync", path, the file's bytes or None for a directory)`` and
    ``("replace", src, dst)``."""
    import os

    import dflash_torch.training.trainer as trainer

    events, fsync, replace = [], trainer._fsync, os.replace

    def flushed(path):
        fsync(path)
        events.append(("fsync", Path(path), None if Path(path).is_dir() else Path(path).read_bytes()))

    def moved(src, dst):
        replace(src, dst)
        events.append(("replace", Path(src), Path(dst)))

    monkeypatch.setattr(trainer, "_fsync", flushed)
    monkeypatch.setattr(trainer.os, "replace", moved)
    return events


def test_export_flushes_each_file_before_it_is_moved_and_the_directory_after(tiny_pair, tmp_path, monkeypatch):
    """The export moved its temporary files into place without flushing them: after a power
    cut, a renamed file could be empty. Each file (config.json, model.safetensors,
    training_log.json) is flushed whole through one helper before its rename, and --out after
    the renames."""

    import dflash_torch.training.trainer as trainer

    target, drafter_dir = tiny_pair
    out = tmp_path / "out"
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    events = _recorded_moves(monkeypatch)
    trainer.export_drafter(drafter, drafter.config, out, "float32")
    trainer._write_replacing(out / "training_log.json", '{"steps": 1}\n')
    for name in ("model.safetensors", "config.json", "training_log.json"):
        (i, src), = [(i, e[1]) for i, e in enumerate(events) if e[0] == "replace" and e[2] == out / name]
        assert ("fsync", src, (out / name).read_bytes()) in events[:i], (name, events)  # (flushed whole, before)
        assert ("fsync", out, None) in events[i + 1:], (name, events)  # (the rename flushed after it)
    assert DFlashEngine.from_pretrained(target, out).drafter is not None


def test_the_data_cache_and_the_checkpoint_are_flushed_before_they_are_moved(tiny_pair, tmp_path, monkeypatch):
    """The data cache and the training checkpoint (what --resume reads) were moved into place
    unflushed, as the export's files were: each is flushed whole before its rename now."""

    import dflash_torch.training.trainer as trainer

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    events = _recorded_moves(monkeypatch)
    Trainer(_cfg(tmp_path, target, text, steps=2, ckpt_every=1, val_seqs=0), log=lambda m: None).run()
    work = tmp_path / "work"
    for name in ("data-*.pt", trainer.CHECKPOINT):
        (dst,) = work.glob(name)
        i, src = [(i, e[1]) for i, e in enumerate(events) if e[0] == "replace" and e[2] == dst][-1]
        assert ("fsync", src, dst.read_bytes()) in events[:i], (name, events)  # (the last one moved: flushed whole)


def test_train_dflash2_from_a_dflash_drafter_round_trips(tiny_pair, tmp_path, capsys):
    """``train --arch dflash2 --init-from`` a DFlash drafter: the backbone starts as the
    source's (identity convolutions, small random codebooks), the selector loss falls, and
    the exported DFlash 2 drafter loads with exactly the trained weights, decodes
    losslessly, and proposes what training's acceptance replay proposes."""
    from dflash_torch.cli import main as cli_main
    from dflash_torch.models.dflash2 import DFlash2Drafter
    from dflash_torch.training.trainer import copy_drafter, load_init_drafter
    from dflash_torch.training.objective import init_drafter_weights

    target_dir, source_dir = tiny_pair  # a random B = 16, 2-layer DFlash drafter
    # the start: the source's backbone, identity convolutions, small random codebooks
    cfg = _cfg(tmp_path, target_dir, tmp_path / "unused", arch="dflash2", init_from=str(source_dir), selector_rank=8,
               num_layers=2, block_size=16)  # (the source's: others are refused, trial-259)
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    source, dcfg = load_init_drafter(cfg, target.config)
    assert dcfg.dflash2.selector_rank == 8 and dcfg.block_size == 16 and dcfg.num_hidden_layers == 2
    start = DFlash2Drafter(dcfg)
    init_drafter_weights(start)
    assert copy_drafter(start, source) == sorted(k for k in start.state_dict() if "_conv." in k or "selector" in k)
    for k, v in source.state_dict().items():
        assert torch.equal(start.state_dict()[k], v), k
    codebook = start.candidate_selector.predecessor_codebook
    assert 0 < float(codebook.detach().std()) < 0.05
    ctx = [InjectedContext(d) for d in (source, start)]
    feats, block = torch.randn(9, source.fc.in_features), torch.tensor([5] + [1] * 15)
    hidden = []
    for c, d in zip(ctx, (source, start)):
        c.reset(25)
        c.inject(d, feats, torch.arange(9))
        hidden.append(d(target.embed(block), torch.arange(9, 25), c, 25))
    assert torch.equal(hidden[0], hidden[1])  # identity convolutions: the source's forward exactly

    out = tmp_path / "out"
    args = ["train", "--target", str(target_dir), "--data", str(_jsonl(tmp_path / "d.jsonl")), "--out", str(out),
            "--arch", "dflash2", "--init-from", str(source_dir), "--selector-rank", "8", "--selector-top-k", "8",
            "--steps", "40", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "8", "--lr", "3e-3",
            "--warmup-steps", "2", "--val-seqs", "2", "--eval-every", "1000", "--save-dtype", "float32", "--no-progress"]
    assert cli_main(args) == 0
    capsys.readouterr()
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"]
    assert {k: conf["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} \
        == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 8}
    log = json.loads((out / "training_log.json").read_text())
    assert all("selector_loss" in h for h in log["loss_history"])  # (null where no slot counted)
    sel = [h["selector_loss"] for h in log["loss_history"] if h["selector_loss"] is not None]
    assert len(sel) >= 4 and sum(sel[-2:]) < sum(sel[:2]), sel
    trained = torch.load(out / "train_work" / "checkpoint.pt", weights_only=False)["drafter"]
    spec = DFlashEngine.from_pretrained(target_dir, out)
    assert isinstance(spec.drafter, DFlash2Drafter)
    loaded = spec.drafter.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    base = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ("def f(x):", "import os\n"):
        ids = spec.encode_prompt(prompt)
        a = spec.generate(ids, max_new_tokens=40, ignore_eos=True)
        b = base.generate(ids, max_new_tokens=40, ignore_eos=True)
        assert a.token_ids == b.token_ids
        taus = greedy_walk(spec.drafter, spec.target, torch.tensor(ids + b.token_ids), len(ids))
        assert taus and taus == a.stats.acceptance_lengths[:len(taus)]


# --- the training data: validation, cache, size, bounded tokenization ---------------------


def _tok(target_dir: Path):
    from dflash_torch.tokenizer import load_tokenizer

    return load_tokenizer(target_dir)


def _add_chats(path: Path, n: int) -> Path:
    """``path``, a chat JSONL file of ``n`` short conversations ("add i" -> "x + i")."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i}"},
                                                     {"role": "assistant", "content": f"x + {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def _prepare(cfg: TrainConfig, tokenizer, target_dir: Path):
    from dflash_torch.training.trainer import prepare_data

    return prepare_data(cfg, Path(target_dir), tokenizer, lambda m: None)


STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                   "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                   "# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}")


@pytest.mark.parametrize("case", ["jsonl-not-utf8", "jsonl-in-dir-not-utf8", "text-not-utf8", "text-surrogate",
                                  "chat-surrogate", "chat-template-refuses", "text-and-messages", "chat-image-part",
                                  "chat-template-type-error", "chat-kwarg-shadows-function", "json-nested-deep",
                                  "json-array-nested-deep", "message-not-an-object", "message-without-role",
                                  "message-content-a-number", "message-null-content"])
def test_bad_data_is_refused_naming_file_and_line(tiny_pair, tmp_path, case):
    """A bad record or a template that cannot render one is refused in one line naming the
    file and line (a template's TypeError, a variable shadowing ``raise_exception`` and
    JSON nested too deeply were tracebacks: trial-94; the data renders as the engine's chat
    path renders it, tool call arguments as a mapping)."""
    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    good = json.dumps({"text": "def f(x):\n    return x\n" * 40}).encode() + b"\n"
    name, line, body, words = {
        "jsonl-not-utf8": ("d.jsonl", 2, good + b'{"text": "caf\xe9"}\n', "not UTF-8"),
        "jsonl-in-dir-not-utf8": ("dir/d.jsonl", 3, good + b"\n" + b'{"text": "caf\xe9"}\n', "not UTF-8"),
        "text-not-utf8": ("t.txt", 2, b"def f(x):\n    return 'caf\xe9'\n", "not UTF-8"),
        "text-surrogate": ("d.jsonl", 2, good + b'{"text": "a \\ud800 b"}\n', "surrogate \\ud800"),
        "chat-surrogate": ("d.jsonl", 2, good + json.dumps({"messages": [{"role": "user", "content": "hi \udfff"}]}).encode()
                           + b"\n", "surrogate \\udfff"),
        "chat-template-refuses": ("d.jsonl", 2, good + json.dumps({"messages": [{"role": "system", "content": "hi"},
                                                                                 {"role": "assistant", "content": "ok"}]})
                                  .encode() + b"\n", "unknown role system"),
        "text-and-messages": ("d.jsonl", 2, good + json.dumps({"text": "a", "messages": []}).encode() + b"\n",
                              "either a 'text' string or a 'messages' list, not both"),
        "chat-image-part": ("d.jsonl", 2, good + json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode() + b"\n", "content part 0 must be"),
        "chat-template-type-error": ("d.jsonl", 2, good + json.dumps({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]}).encode() + b"\n",
            "the chat template cannot render these messages: can only concatenate str"),
        "chat-kwarg-shadows-function": ("d.jsonl", 2, good + json.dumps({"messages": [
            {"role": "system", "content": "hi"}, {"role": "assistant", "content": "ok"}]}).encode() + b"\n",
            "cannot render these messages: 'int' object is not callable"),
        "json-nested-deep": ("d.jsonl", 2, good + b'{"text": "hi", "meta": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
                             "nested too deeply"),
        "message-not-an-object": ("d.jsonl", 2, good + json.dumps({"messages": ["hello"]}).encode() + b"\n",
                                  "message 0 is not an object: each message must be {'role': str, 'content': str}"),
        "json-array-nested-deep": ("d.json", None, b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        # (each message's fault named with its index, as a content part's is: all were one line, trial-272)
        **{c: ("d.jsonl", 2, good + json.dumps({"messages": [{"role": "user", "content": "hi"}, bad]}).encode() + b"\n",
               f"chat message 1 {words}: each message is {{'role': str, 'content': str}}")
           for c, bad, words in (("message-without-role", {"content": "hi"}, "has no role"),
                                 ("message-content-a-number", {"role": "assistant", "content": 5},
                                  "has a content of type int, not a string or a list of text parts"),
                                 ("message-null-content", {"role": "assistant", "content": None}, "has a null content"))},
    }[case]
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(body)
    if case in ("chat-template-refuses", "chat-kwarg-shadows-function"):
        tok.chat_template = STRICT_TEMPLATE
    if case == "chat-template-type-error":  # (the call's arguments joined to a string, then to a number)
        tok.chat_template = ("{% for m in messages %}{{ m.role + ': ' }}{% if m.tool_calls %}"
                             "{{ 'call ' + m.tool_calls[0].function.arguments + 1 }}{% else %}{{ m.content }}{% endif %}"
                             "\n{% endfor %}")
    kwargs = {"raise_exception": 1} if case == "chat-kwarg-shadows-function" else None
    cfg = _cfg(tmp_path, target_dir, path.parent if case.startswith("jsonl-in-dir") else path, val_seqs=0, batch=1,
               chat_template_kwargs=kwargs)
    with pytest.raises(DFlashError) as err:
        _prepare(cfg, tok, target_dir)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}: " if line else f"{path}: ") and words in msg and "\n" not in msg, msg


# a template that writes tool calls (Qwen3's hermes format)
TOOLS_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% endif %}{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_data_takes_the_messages_the_engine_takes(tiny_pair, tmp_path):
    """OpenAI's content parts and assistant turns with tool calls and a null content, as the
    engine's chat path and the server take them, are training data too (the whole file was
    refused: trial-91), rendered as the engine renders them (parts joined by line ends, a
    call's JSON arguments as a mapping), the loss on the replies and calls."""
    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    tok.chat_template = TOOLS_TEMPLATE
    parts = [{"role": "user", "content": [{"type": "text", "text": "PART one"}, {"type": "text", "text": "PART two"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "REPLY text"}]}]
    tools = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "TOOL says sunny"},
             {"role": "assistant", "content": "It is sunny."}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (parts, tools)))
    data, _, _ = _prepare(_cfg(tmp_path, target_dir, path, val_seqs=0, batch=1, seq_len=256, raw_fraction=0.0), tok,
                          target_dir)
    texts = [tok.decode(ex.ids.tolist()) for ex in data.examples]
    assert "<|im_start|>user\nPART one\nPART two<|im_end|>" in texts[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in texts[1]
    losses = [_masked_spans(tok, ex) for ex in data.examples]
    assert [s.strip() for s in losses[0]] == ["REPLY text<|im_end|>"]
    assert [s.strip() for s in losses[1]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>"]
    assert not any(ex.whole for ex in data.examples)


def test_directory_skips_files_that_are_not_text(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.py").write_text("def f(x):\n    return x\n" * 40)
    (tmp_path / "dir" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    corpus = read_corpus([tmp_path / "dir"])
    assert corpus.skipped == [tmp_path / "dir" / "logo.png"] and len(corpus.documents) == 1
    (tmp_path / "dir" / "a.py").unlink()
    with pytest.raises(DFlashError, match="holds no text .1 file skipped as not UTF-8"):
        read_corpus([tmp_path / "dir"])


def test_a_data_directory_holding_out_and_the_work_dir_leaves_them_out_and_says_so(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("def f(x):\n    return x + 1\n" * 60)
    cfg = _cfg(tmp_path, target_dir, data, val_seqs=0, batch=1, seq_len=32, out=str(data / "drafter"),
               work_dir=str(data / "work"))
    (data / "drafter").mkdir()  # (as train makes them before it reads the data)
    (data / "work").mkdir()
    tok = _tok(target_dir)
    lines: list[str] = []
    from dflash_torch.training.trainer import data_key, prepare_data

    key = data_key(cfg, Path(target_dir))
    first, _, info = prepare_data(cfg, Path(target_dir), tok, lines.append)
    # the drafter's files and the run's log, as a finished run leaves them
    (data / "drafter" / "config.json").write_text(json.dumps({"model_type": "dflash"}))
    (data / "drafter" / "training_log.json").write_text(json.dumps({"history": []}))
    (data / "work" / "notes.txt").write_text("not data")
    assert data_key(cfg, Path(target_dir)) == key  # (the cache stays: no "removed ... made from other data")
    lines.clear()
    second, _, info2 = prepare_data(cfg, Path(target_dir), tok, lines.append)
    assert info2["documents"] == info["documents"] == 1 and torch.equal(second.stream, first.stream)
    assert any("loaded" in line for line in lines), lines
    said = [line for line in lines if "did not read" in line]
    assert len(said) == 2 and f"did not read '{data / 'drafter'}' (this run's out or work_dir)" in said[0], lines
    assert read_corpus([data], [data / "drafter", data / "work"]).excluded == [data / "drafter", data / "work"]
    # a data directory inside --out is read whole, and a file given itself is read wherever it lies
    assert len(read_corpus([data / "work"], [data]).documents) == 1
    assert len(read_corpus([data / "work" / "notes.txt"], [data / "work"]).documents) == 1


def test_a_data_directory_follows_links_to_directories_once_and_leaves_out_the_runs_own(tmp_path):
    """Links to directories inside a --data directory were passed over unsaid (links to files
    were read; the help says every non-hidden file below it, trial-137): they are followed,
    each directory once (a link back up the tree does not loop), and a link to this run's
    --out or work dir is left out as the directory itself is."""
    from dflash_torch.training.data import corpus_files

    data, more, out = tmp_path / "data", tmp_path / "more", tmp_path / "out"
    for d in (data, more / "sub", out):
        d.mkdir(parents=True)
    (data / "a.txt").write_text("a")
    (more / "b.txt").write_text("b")
    (more / "sub" / "c.txt").write_text("c")
    (out / "config.json").write_text("{}")
    (data / "linked").symlink_to(more)
    (data / "twice").symlink_to(more)  # (the same directory again: read once)
    (data / "loop").symlink_to(data)  # (a link back up: not read again)
    (data / "linked" / "up").symlink_to(more)  # (more/up: a loop inside the linked directory)
    (data / "drafter").symlink_to(out)
    excluded: list[Path] = []
    files = corpus_files([data], [out], excluded)
    assert files == [(data / "a.txt", False), (data / "linked" / "b.txt", False),
                     (data / "linked" / "sub" / "c.txt", False)], files
    assert excluded == [data / "drafter"]
    assert read_corpus([data], [out]).documents == ["a", "b", "c"]


def test_a_data_directory_reads_a_file_reached_through_two_links_once(tmp_path):
    """A file reached through two file links inside a --data directory (or a link and its own
    name) was read twice, its text trained on twice: each real file is read once, at its first
    path in sorted order, as each linked directory is."""
    import os

    from dflash_torch.training.data import corpus_files

    data, more = tmp_path / "data", tmp_path / "more"
    for d in (data / "sub", more):
        d.mkdir(parents=True)
    (data / "a.txt").write_text("a")
    (more / "x.txt").write_text("x")
    (data / "l1.txt").symlink_to(more / "x.txt")
    (data / "sub" / "l2.txt").symlink_to(more / "x.txt")
    (data / "z.txt").symlink_to(data / "a.txt")  # (a link to a file read under its own name)
    (data / "linked").symlink_to(more)  # (x.txt a third time, through a link to its directory)
    files = corpus_files([data])
    assert files == [(data / "a.txt", False), (data / "l1.txt", False)], files
    assert read_corpus([data]).documents == ["a", "x"]
    # (trial-156: across --data arguments too: overlapping directories, a file given twice or also found in a
    # given directory, a hard link; each was read again)
    os.link(more / "x.txt", tmp_path / "hard.txt")
    for paths in ([data, tmp_path / "data" / ".." / "data"], [data, data / "a.txt"], [data, more],
                  [data, tmp_path / "hard.txt"]):
        assert corpus_files(paths) == files, paths
    assert corpus_files([data / "a.txt", data / "a.txt", data / "z.txt"]) == [(data / "a.txt", True)]


def test_data_cache_follows_contents_not_paths_or_mtimes(tiny_pair, tmp_path):
    import os

    target_dir, _ = tiny_pair
    target = tmp_path / "target"  # a copy whose chat template can change
    target.mkdir()
    for f in Path(target_dir).iterdir():
        shutil.copy(f, target / f.name)
    data = tmp_path / "dir"
    data.mkdir()
    a = data / "a.txt"
    a.write_text("def f(x):\n    return x + 1\n" * 60)
    (data / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "add one"},
                                                               {"role": "assistant", "content": "x + 1"}]}) + "\n")
    cfg = _cfg(tmp_path, target, data, val_seqs=0, batch=1, seq_len=32)
    first, _, _ = _prepare(cfg, _tok(target), target)
    # an edit that keeps the size and the mtime
    st = a.stat()
    a.write_text("def g(y):\n    return y * 2\n" * 60)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert a.stat().st_size == st.st_size and a.stat().st_mtime_ns == st.st_mtime_ns
    tok = _tok(target)
    second, _, _ = _prepare(cfg, tok, target)
    expect = tok(a.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert second.stream.tolist() == expect and first.stream.tolist() != expect
    # the tokenizer's chat template is part of the data too
    (target / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    tok = _tok(target)
    third, _, _ = _prepare(cfg, tok, target)
    assert third.examples[0].ids.tolist() == tok.encode("<user> add one\n<assistant> x + 1\n", add_special_tokens=False)
    assert third.examples[0].ids.tolist() != second.examples[0].ids.tolist()
    assert len(list(Path(cfg.work_dir).glob("data-*"))) == 1  # the superseded caches are gone


def test_too_little_data_is_refused_with_the_counts(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    n = len(tok(text.read_text(), add_special_tokens=False)["input_ids"]) + 1  # + EOS
    windows = n // 16
    assert windows >= 3
    ok = _cfg(tmp_path, target_dir, text, seq_len=16, batch=windows - 1, val_seqs=4)
    data, val_rows, _ = _prepare(ok, tok, target_dir)
    assert len(val_rows) == 1 and data.stream.numel() // 16 == windows - 1
    with pytest.raises(DFlashError) as err:
        _prepare(_cfg(tmp_path, target_dir, text, seq_len=16, batch=windows, val_seqs=4), tok, target_dir)
    msg = str(err.value)  # (the fields named: trial-259; the command line names the flags)
    assert f"{n} tokens of text ({windows} windows of seq_len 16) make {windows} sequences" in msg, msg
    assert msg.endswith(f"batch {windows} needs {windows} and the eval split (val_seqs 4) 1 more: add data, or lower "
                        "batch or seq_len, or pass val_seqs 0"), msg
    msg = _as_cli(err.value)
    assert f"{n} tokens of text ({windows} windows of --seq-len 16) make {windows} sequences" in msg, msg
    assert msg.endswith(f"--batch {windows} needs {windows} and the eval split (--val-seqs 4) 1 more: add data, or "
                        "lower --batch or --seq-len, or pass --val-seqs 0"), msg
    _prepare(_cfg(tmp_path, target_dir, text, seq_len=16, batch=windows, val_seqs=0), tok, target_dir)  # no eval: fits
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(DFlashError, match=r"\b[23] tokens of text \(0 windows of seq_len 64\) make 0 sequences"):
        _prepare(_cfg(tmp_path, target_dir, tiny, val_seqs=0, batch=1), tok, target_dir)


def test_too_little_chat_data_and_a_capped_eval_split_say_what_helps(tiny_pair, tmp_path):
    """Chat-only data too small for --batch advised a lower --seq-len, which adds no sequence;
    a --val-seqs cut down to one said "a tenth of the text windows" while the rows came from
    the conversations only (trial-127)."""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    chat = _add_chats(tmp_path / "chat.jsonl", 6)
    with pytest.raises(DFlashError) as err:
        _prepare(_cfg(tmp_path, target_dir, chat, val_seqs=0, batch=7, seq_len=32), tok, target_dir)
    msg = str(err.value)
    assert "6 chat conversations make 6 sequences" in msg and "lower batch or seq_len" not in msg, msg
    assert msg.endswith("add data (each conversation or self-distilled sequence is one sequence, whatever seq_len; "
                        "text makes one per seq_len tokens), or lower batch"), msg
    assert _as_cli(err.value).endswith("add data (each conversation or self-distilled sequence is one sequence, "
                                       "whatever --seq-len; text makes one per --seq-len tokens), or lower --batch")
    text = tmp_path / "c.txt"  # (with text, a shorter --seq-len makes more windows)
    text.write_text("def f(x):\n    return x\n" * 20)
    with pytest.raises(DFlashError, match=r"add data, or lower batch or seq_len$"):
        _prepare(_cfg(tmp_path, target_dir, text, val_seqs=0, batch=99, seq_len=16), tok, target_dir)
    lines: list[str] = []
    cfg = _cfg(tmp_path, target_dir, chat, val_seqs=3, batch=2, seq_len=32)
    cfg.data.append(str(text))
    _, val_rows, _ = prepare_data(cfg, Path(target_dir), tok, lines.append)
    said = [line for line in lines if "holding out" in line]
    assert len(val_rows) == 1 and said == [
        "data: holding out 1 sequence for evaluation, not val_seqs 3: they are taken from one kind of data only, "
        "here the 6 chat conversations, at most a fifth of them, leaving at least batch 2 sequences to train on"], lines


def test_self_distill_that_finds_too_little_is_refused(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    cfg = _cfg(tmp_path, target_dir, tiny, val_seqs=0, batch=1, self_distill=3, prefix_min=8, prefix_max=16)
    with pytest.raises(DFlashError, match="self_distill 3 found no prompt in the data: no text passage of 4 tokens"):
        _prepare(cfg, tok, target_dir)
    # too little even if every requested sequence were made: refused before generating
    cfg = _cfg(tmp_path, target_dir, tiny, val_seqs=2, batch=4, self_distill=2, prefix_min=8, prefix_max=16)
    with pytest.raises(DFlashError, match="make 2 sequences; one step of batch 4 needs 4 and the eval split"):
        _prepare(cfg, tok, target_dir)


def test_self_distill_draws_each_chat_prompt_once_and_never_holds_out_a_copy_of_a_training_row(tiny_pair, tmp_path):
    """Chat prompts were drawn with replacement: greedy continuation repeated sequences, and the
    held-out split copied training rows (a silently wrong validation metric: trial-272). Each
    distinct prompt is drawn once (said in the data: line), and a conversation the data
    repeats is never held out."""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    convs = [{"messages": [{"role": "user", "content": f"Write a Python function that returns {i} plus x."},
                           {"role": "assistant", "content": f"def add_{i}(x):\n    return x + {i}\n"}]} for i in range(8)]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
    lines: list[str] = []
    cfg = _cfg(tmp_path, target_dir, chat, val_seqs=2, batch=2, seq_len=96, self_distill=20, self_distill_batch=20)
    data, val_rows, stats = prepare_data(cfg, Path(target_dir), tok, lines.append)
    rows = [tuple(e.ids.tolist()) for e in data.examples]
    distilled = rows[len(rows) - (stats["distilled_sequences"] - len(val_rows)):]
    assert stats["distilled_sequences"] == stats["distilled_chat_prompts_distinct"] == 8, stats
    assert len(set(distilled)) == len(distilled) and len(val_rows) == 1, (stats, len(val_rows))
    assert not {tuple(ids.tolist()) for ids, _ in val_rows} & set(rows)
    assert any(line.startswith("data: self-distill found only 8 of 20 prompts in the data (the conversations give 8 "
                               "distinct chat prompts, each drawn once") for line in lines), lines

    def split(records):  # -> the training rows' token tuples, the held-out rows, the data statistics
        chat.write_text("".join(json.dumps(c) + "\n" for c in records))
        data, val_rows, stats = prepare_data(_cfg(tmp_path, target_dir, chat, val_seqs=2, batch=2, seq_len=96),
                                             Path(target_dir), tok, lines.append)
        return [tuple(e.ids.tolist()) for e in data.examples], val_rows, stats

    # a conversation the data holds twice stays to train on (both copies)
    rows, val_rows, stats = split(convs + convs[:2])
    assert len(val_rows) == 2 and stats["val_copies_left_to_train"] == 4 and len(rows) == 8, stats
    assert not {tuple(ids.tolist()) for ids, _ in val_rows} & set(rows)
    # nor one whose tokens begin another's: a one-turn conversation that is the first turn of a
    # two-turn one the data holds (all held-out rows were such prefixes of training rows: trial-275)
    two = [{"messages": c["messages"] + [{"role": "user", "content": f"And times {i}?"},
                                         {"role": "assistant", "content": f"def mul_{i}(x):\n    return x * {i}\n"}]}
           for i, c in enumerate(convs[:6])]
    rows, val_rows, stats = split(two + convs[:6])
    assert len(val_rows) == 2 and stats["val_copies_left_to_train"] == 6 and len(rows) == 10, stats
    assert not any(r[:len(ids)] == tuple(ids.tolist()) for ids, _ in val_rows for r in rows)


def test_other_settings_keep_an_older_data_cache_of_self_distilled_data_and_remove_cheap_ones(tiny_pair, tmp_path):
    """A run with other data or settings removed the work dir's older data cache, self-distilled
    sequences too (hours of generation lost to one try of another seed: trial-272): such a cache
    is kept, in a line; one of tokenized data only is still removed."""
    from dflash_torch.training.trainer import prepare_data

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    chat = _add_chats(tmp_path / "chat.jsonl", 4)
    work = tmp_path / "work"
    _prepare(_cfg(tmp_path, target_dir, chat, val_seqs=0, batch=1, self_distill=2), tok, target_dir)
    (distilled,) = work.glob("data-*.pt")
    lines: list[str] = []
    prepare_data(_cfg(tmp_path, target_dir, chat, val_seqs=0, batch=1, seed=8), Path(target_dir), tok, lines.append)
    assert f"data: kept {distilled} (made from other data or settings, but it holds 2 self-distilled sequences, " \
        "costly to make again: a run with its data and settings loads it; delete it to free its space)" in lines, lines
    (cheap,) = set(work.glob("data-*.pt")) - {distilled}
    lines.clear()
    prepare_data(_cfg(tmp_path, target_dir, chat, val_seqs=0, batch=1, seed=9), Path(target_dir), tok, lines.append)
    assert f"data: removed {cheap} (made from other data or settings)" in lines and distilled.is_file(), lines
    assert len(list(work.glob("data-*"))) == 2


class RecordingTokenizer:
    """The real tokenizer, noting the longest text it is asked to tokenize in one go."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def _note(self, text):
        self.longest = max([self.longest, *map(len, [text] if isinstance(text, str) else text)])

    def __call__(self, text, **kw):
        self._note(text)
        return self.tok(text, **kw)

    def encode(self, text, **kw):
        self._note(text)
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_long_documents_are_tokenized_in_bounded_pieces_with_unchanged_ids(tiny_pair, tmp_path, monkeypatch):
    from dflash_torch.training import data as data_mod

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    monkeypatch.setattr(data_mod, "PIECE_CHARS", 2000, raising=False)
    monkeypatch.setattr(data_mod, "CALL_CHARS", 5000, raising=False)
    source = "".join(corpus_texts(60_000))
    assert len(source) > 20 * 2000
    docs = {"lines.txt": source, "one-line.txt": source.replace("\n", " "), "no-space.txt": "ab" * 5000}
    for name, doc in docs.items():
        (tmp_path / name).write_text(doc)
    cfg = _cfg(tmp_path, target_dir, tmp_path / "lines.txt", val_seqs=0, batch=1)
    cfg.data = [str(tmp_path / name) for name in docs]
    rec = RecordingTokenizer(tok)
    data, _, _ = _prepare(cfg, rec, target_dir)
    assert rec.longest <= 2000
    ids = data.stream.tolist()
    eos = tok.eos_token_id
    for doc in list(docs.values())[:2]:  # cut at line ends / lone spaces: the ids of one call
        plain = tok(doc, add_special_tokens=False)["input_ids"] + [eos]
        assert ids[:len(plain)] == plain
        ids = ids[len(plain):]
    assert tok.decode(ids[:-1]) == docs["no-space.txt"] and ids[-1] == eos  # hard cuts: same text back
    # a chat conversation: only the first --seq-len tokens are made, in bounded pieces
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "explain"},
                                             {"role": "assistant", "content": source}]}) + "\n")
    rec = RecordingTokenizer(tok)
    data, _, _ = _prepare(_cfg(tmp_path / "c", target_dir, chat, val_seqs=0, batch=1), rec, target_dir)
    ex = data.examples[0]
    full = tok.apply_chat_template(json.loads(chat.read_text())["messages"], tokenize=False)
    assert rec.longest <= 2000 and ex.ids.tolist() == tok(full, add_special_tokens=False)["input_ids"][:64]
    assert not ex.loss_mask[:5].any() and ex.loss_mask[-5:].all()


def test_normal_files_tokenize_as_the_tokenizer_does(tiny_pair):
    from dflash_torch.training.data import tokenize_documents

    target_dir, _ = tiny_pair
    tok = _tok(target_dir)
    docs = corpus_texts() + ["", "x", "tab\tand  spaces \n\n  trailing  \r\nend"]
    expect = []
    for doc in docs:
        expect += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tokenize_documents(tok, docs).tolist() == expect


@pytest.mark.parametrize("case", ["jsonl-not-utf8", "two-tokens", "distill-finds-nothing"])
def test_train_cli_refuses_bad_or_too_little_data_in_one_line(tiny_pair, tmp_path, capsys, case):
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    data = tmp_path / ("d.jsonl" if case == "jsonl-not-utf8" else "d.txt")
    data.write_bytes(b'{"text": "caf\xe9"}\n' if case == "jsonl-not-utf8" else b"ab")
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "2",
            "--batch", "2", "--seq-len", "64", "--no-progress"]
    if case == "distill-finds-nothing":
        args += ["--self-distill", "4"]
    words = {"jsonl-not-utf8": f"{data}:1: not UTF-8 text (byte 0xe9)",
             "two-tokens": "too little training data: 3 tokens of text", "distill-finds-nothing": "found no prompt"}[case]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("dflash-torch: error: ") and words in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_ctrl_c_while_the_data_is_prepared_is_said_and_leaves_no_empty_dirs(tiny_pair, tmp_path, capsys, monkeypatch):
    """(trial C: a Ctrl-C during --self-distill's data step exited 130 unsaid, leaving an empty
    --out and work dir; one during training says so and saves a checkpoint)"""
    import os
    import signal
    import time

    import dflash_torch.training.distill as distill
    from dflash_torch.cli import main as cli_main

    def interrupted(*args, **kwargs):  # (a real SIGINT, as the terminal sends it)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        raise AssertionError("no KeyboardInterrupt")

    monkeypatch.setattr(distill, "self_distill", interrupted)
    target, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    kept = tmp_path / "kept"  # an --out that was there before the run stays
    kept.mkdir()
    for out in (tmp_path / "new" / "out", kept):
        args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "2", "--batch", "2",
                "--seq-len", "64", "--block-size", "8", "--num-layers", "1", "--self-distill", "4", "--no-progress"]
        assert cli_main(args) == 130  # (as one during training)
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == "interrupted while preparing the data: no step was trained", err
        assert "Traceback" not in err
    assert not (tmp_path / "new").exists()  # (made for --out too: removed with it, as bench does)
    assert kept.is_dir() and not any(kept.iterdir())


def test_a_stopped_run_says_what_to_run_next_and_generate_on_its_out_says_so_too(tiny_pair, tmp_path, capsys,
                                                                                   monkeypatch):
    """A Ctrl-C before training began said "no step was trained (the prepared data is kept in
    ...)", and the natural next step, --resume, was refused (no checkpoint); ``generate --draft
    OUT`` on such a run's --out said only "no config.json" (trial-320). The line says to run the
    same command again, without --resume; generate says what exports the drafter: the command
    again, or with --resume where a checkpoint was saved."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    out = tmp_path / "out"
    work = out / "train_work"
    calls = []
    original = Trainer.evaluate

    def interrupted(self, *args, **kwargs):  # (the evaluation before training, then the one of step 1)
        calls.append(1)
        if len(calls) in (1, 3):
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", interrupted)
    args = ["train", "--target", str(target), "--data", str(_jsonl(tmp_path / "d.jsonl")), "--out", str(out),
            "--steps", "2", "--batch", "2", "--seq-len", "64", "--block-size", "8", "--num-layers", "1",
            "--eval-every", "1", "--no-progress"]
    generate = ["generate", "hi", "--target", str(target), "--draft", str(out), "--max-new-tokens", "2"]
    assert cli_main(args) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"interrupted before training began: no step was trained (the prepared data is kept in '{work}'); run the "
        "same command again to start training (without --resume: no checkpoint was saved)")
    assert cli_main(generate) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --draft: {out} has no config.json: not a Hugging Face checkpoint directory (it holds "
        f"{work}, the work dir of a dflash-torch train run stopped before training began: that train command again "
        "trains and exports the drafter)")
    assert cli_main(args) == 130  # (the same command: it trains, and is stopped in step 1's evaluation)
    assert "interrupted: checkpoint of step 1 saved to" in capsys.readouterr().err
    assert cli_main(generate) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --draft: {out} has no config.json: not a Hugging Face checkpoint directory (it holds "
        f"{work}, the checkpoint of a dflash-torch train run stopped before its drafter was exported: that train "
        "command again with --resume continues it and exports the drafter)")
    assert cli_main([*args, "--resume"]) == 0
    capsys.readouterr()
    assert cli_main(generate) == 0


def test_generate_on_the_out_of_a_run_in_progress_says_it_is_in_progress(tiny_pair, tmp_path, capsys):
    """``generate --draft OUT`` while the train run into OUT was still training said the run
    "stopped" and to continue it with --resume, which was refused as OUT is in use (trial-325):
    where a live process holds the run's lock (in OUT, or its train_work) the error names it
    as in progress; once it is gone (killed: its lock file left, held by no one), "stopped"."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    for name, held in (("a", "train_work"), ("b", "")):  # (the default work dir; another --work-dir: OUT alone)
        out = tmp_path / name
        (out / held).mkdir(parents=True, exist_ok=True)
        generate = ["generate", "hi", "--target", str(target), "--draft", str(out), "--max-new-tokens", "2"]
        holder = _hold_dir(out / held)
        try:
            capsys.readouterr()
            assert cli_main(generate) == 2
            assert capsys.readouterr().err.strip().splitlines()[-1] == (
                f"dflash-torch: error: --draft: {out} has no config.json: not a Hugging Face checkpoint directory (a "
                f"dflash-torch train run, PID {holder}, is in progress there: it exports the drafter there when it "
                "ends; wait for it to end)")
        finally:
            _kill(holder)
        assert (out / held / LOCK_NAME).is_file()
        assert cli_main(generate) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "in progress" not in last and last.endswith(
            "the work dir of a dflash-torch train run stopped before training began: that train command again trains "
            "and exports the drafter)" if held else "checkpoint directory"), last


def test_a_run_refused_before_its_data_is_prepared_removes_the_dirs_it_made_only(tiny_pair, tmp_path, capsys):
    """"too little training data" left the --out it made behind, holding train_work/data-*.pt
    (trial-118): a run refused for too little data removes the data cache it wrote, then the
    directories it made, now empty; directories that were there stay, with their files."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    data = tmp_path / "tiny.txt"
    data.write_text("ab")
    kept, work = tmp_path / "kept", tmp_path / "work"
    for d in (kept, work):
        d.mkdir()
        (d / "mine.txt").write_text("the user's")
    for out, extra in ((tmp_path / "a" / "b" / "out", []), (kept, []), (tmp_path / "c" / "out", ["--work-dir", str(work)]),
                       (tmp_path / "d" / "out", ["--work-dir", str(tmp_path / "d" / "w")])):
        args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "2", "--batch", "2",
                "--seq-len", "64", "--no-progress", *extra]
        assert cli_main(args) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("dflash-torch: error: too little training data"), err
    assert not any((tmp_path / name).exists() for name in "acd")
    assert sorted(f.name for f in kept.iterdir()) == ["mine.txt"]  # (its train_work, made by the run, is gone)
    assert sorted(f.name for f in work.iterdir()) == ["mine.txt"]  # (the user's work dir, without the run's cache)


def test_a_refused_run_removes_the_dirs_it_made_past_a_link_and_dot_dot(tiny_pair, tmp_path, capsys):
    """``--out A/link/../new/sub`` with A/link a link to a directory: the OS makes the
    directories from where the link leads (A/data/new/sub), but those recorded as made were
    A/new/sub (``..`` dropped textually), so a refused run left A/data/new/sub behind (trial-137)."""
    import os

    from dflash_torch.cli import main as cli_main, missing_dirs

    target, _ = tiny_pair
    data = tmp_path / "tiny.txt"
    data.write_text("ab")
    (tmp_path / "data" / "drafter").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data" / "drafter")
    out = tmp_path / "link" / ".." / "new" / "sub"
    real = Path(os.path.realpath(tmp_path))
    assert missing_dirs(out) == [real / "data" / "new" / "sub", real / "data" / "new"]
    assert sorted(missing_dirs(tmp_path / "x" / ".." / "y")) == [real / "x", real / "y"]  # (mkdir makes both)
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "1", "--batch", "2",
            "--seq-len", "64", "--no-progress"]
    assert cli_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("dflash-torch: error: too little training data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["drafter"]
    assert not (tmp_path / "new").exists()


def test_a_run_refused_for_too_little_data_keeps_the_work_dirs_older_data_cache(tiny_pair, tmp_path, capsys):
    """A run refused for too little data deleted the work dir's cache of other data ("made from
    other data or settings") before it was refused (trial-137): the older caches go only once
    the new data passed the size check, i.e. once the run trains on it."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    good, tiny = tmp_path / "good.txt", tmp_path / "tiny.txt"
    good.write_text("def f(x):\n    return x\n" * 50)
    tiny.write_text("ab")
    work = tmp_path / "work"
    args = ["train", "--target", str(target), "--out", str(tmp_path / "out"), "--work-dir", str(work), "--steps", "1",
            "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0", "--num-layers", "1",
            "--block-size", "8", "--no-progress", "--overwrite"]
    assert cli_main([*args, "--data", str(good)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    (cache,) = work.glob("data-*.pt")
    assert cli_main([*args, "--data", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert "too little training data" in err.strip().splitlines()[-1] and "removed" not in err, err
    assert list(work.glob("data-*")) == [cache]  # (the refused run's own cache is gone, the older one stays)
    assert cli_main([*args, "--data", str(good)]) == 0
    assert f"data: loaded {cache}" in capsys.readouterr().err
    more = tmp_path / "more.txt"  # (a run that trains on other data replaces it, and says so)
    more.write_text("def g(y):\n    return y * 2\n" * 50)
    assert cli_main([*args, "--data", str(more)]) == 0
    assert f"data: removed {cache} (made from other data or settings)" in capsys.readouterr().err
    assert len(list(work.glob("data-*"))) == 1 and not cache.exists()


def test_a_stopped_run_removes_no_file_another_run_wrote_into_a_directory_it_made(tiny_pair, tmp_path, capsys,
                                                                                  monkeypatch):
    """A run that stops removed the directories it made whole, with what another run wrote
    there meanwhile (trial-136: two runs under one new parent, the first stopped while it
    prepared its data, deleted the second's finished drafter): it removes only its own data
    cache and the directories it made that are then empty. And a --data directory that is
    this run's --out or --work-dir is refused (the drafter's own files were read as data)."""
    import dflash_torch.training.trainer as trainer
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    data = tmp_path / "tiny.txt"
    data.write_text("ab")
    other = tmp_path / "runs" / "b" / "config.json"
    check = trainer.check_data_size

    def another_run_saves_meanwhile(*args, **kwargs):
        other.parent.mkdir(parents=True)
        other.write_text("{}")  # (another run's drafter, saved while this one prepared its data)
        return check(*args, **kwargs)

    monkeypatch.setattr(trainer, "check_data_size", another_run_saves_meanwhile)
    args = ["train", "--target", str(target), "--data", str(data), "--steps", "2", "--batch", "2", "--seq-len", "64",
            "--no-progress"]
    assert cli_main([*args, "--out", str(tmp_path / "runs" / "a")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("dflash-torch: error: too little training data")
    assert other.read_text() == "{}" and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["b"]
    monkeypatch.setattr(trainer, "check_data_size", check)
    (tmp_path / "own").mkdir()
    for extra in (["--out", str(tmp_path / "own")], ["--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "own")]):
        args_own = ["train", "--target", str(target), "--data", str(tmp_path / "own"), *extra, "--steps", "1",
                    "--no-progress"]  # (without --steps or --time-budget-min: refused for that first)
        assert cli_main(args_own) == 2
        err = capsys.readouterr().err.strip().splitlines()
        name = "--out" if extra[1].endswith("own") else "--work-dir"
        assert err == [f"dflash-torch: error: --data '{tmp_path / 'own'}' is this run's {name}: the drafter's own files "
                       "would be read as data; put the data in a directory of its own"], err


def test_training_that_diverges_stops_with_one_line_and_writes_no_drafter(tiny_pair, tmp_path, capsys):
    """A learning rate that blows the weights up ends training at the first non-finite loss
    or gradient, before the update reaches the weights: exit 2 with one line, no drafter
    written (it saved a drafter of NaN weights, which decoded greedily at tau 1 and made
    sampled decoding raise a torch traceback)."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("\n".join(corpus_texts(20_000)))
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--steps", "8", "--batch", "2",
            "--seq-len", "64", "--anchors-per-seq", "4", "--val-seqs", "0", "--warmup-steps", "0", "--lr", "1e8",
            "--no-progress"]
    assert cli_main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "dflash-torch: error: training diverged at step" in errors[0] and "--lr" in errors[0], errors
    assert not (out / "model.safetensors").exists()
    assert any((out / "train_work").glob("data-*.pt"))  # (the prepared data is kept for the run with a lower --lr)


def test_self_distill_draws_no_progress_bar_when_told_not_to(tiny_pair, capsys):
    """``--no-progress``: transformers' "Loading weights" bar of the self-distill model
    stays off too (and transformers' own setting is left as it was)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dflash_torch.training.distill import self_distill

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    examples = self_distill(tiny_pair[0], tok, [[5, 6, 7]], [False], seq_len=6, progress=False)
    assert len(examples) == 1 and examples[0].ids.tolist()[:3] == [5, 6, 7] and len(examples[0].ids) == 6
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("lr,steps", [(1e38, 3), (float("inf"), 1)], ids=["optimizer-overflow", "weights-not-finite"])
def test_a_learning_rate_that_blows_the_weights_up_is_an_error_not_a_saved_drafter(tiny_pair, tmp_path, lr, steps,
                                                                                      monkeypatch):
    """--lr 1e38: Adam's update overflowed in a RuntimeError traceback; an infinite lr (the
    command line now refuses it) made the weights NaN in the last step and the drafter was
    saved (exit 0)."""
    import dflash_torch.training.trainer as trainer

    if lr == float("inf"):  # (refused by check_config now, the Python API's too: past it, the check of the weights)
        monkeypatch.setattr(trainer, "check_config", lambda cfg: None)
    target, _ = tiny_pair
    cfg = _cfg(tmp_path, target, _jsonl(tmp_path / "d.jsonl"), lr=lr, steps=steps, warmup_steps=0, val_seqs=0)
    with pytest.raises(DFlashError, match=r"training diverged (at|by) step \d") as err:
        Trainer(cfg, log=lambda m: None).run()
    assert "lower lr" in str(err.value) and "\n" not in str(err.value)  # (the field: trial-259)
    assert "lower --lr" in _as_cli(err.value)
    assert not (Path(cfg.out) / "model.safetensors").exists()


def test_default_target_layers_keep_the_reference_rule_where_it_fits():
    """The DFlash rule's ids are kept, silently, for targets deep enough (28 / 36 layers:
    [1, 25], [1, 17, 33], ...); below that they fail or repeat layers with what to pass."""
    from dflash_torch.models.drafter_config import default_target_layer_ids
    from dflash_torch.training.trainer import default_layer_ids

    for L in (6, 28, 36, 64):
        for n in range(1, 6 if L > 6 else 4):
            assert default_layer_ids(L, n) == (default_target_layer_ids(L, n), None), (L, n)
    assert default_layer_ids(28, 2)[0] == [1, 25] and default_layer_ids(36, 3)[0] == [1, 17, 33]
    assert default_layer_ids(5, 2) == ([1, 2], None) and default_layer_ids(2, 1) == ([1], None)
    # the fewer drafter layers it suggests are computed, not searched (it tried each count below num_layers, which
    # hung --num-layers 100000 for minutes, trial-293): the same as a search, with the rule called a few times
    for L in range(1, 40):
        for n in range(1, 50):
            usable = lambda ids: all(0 <= i < L for i in ids) and all(a < b for a, b in zip(ids, ids[1:]))
            if usable(default_target_layer_ids(L, n)):
                continue
            fewer = next((m for m in range(n - 1, 0, -1) if usable(default_target_layer_ids(L, m))), None)
            try:
                _, note = default_layer_ids(L, n)
            except DFlashError as exc:
                note = str(exc)
            assert (f"num_layers {fewer}" in note) if fewer else ("num_layers" not in note.split(": pass ")[-1]), (L, n)
    import dflash_torch.training.trainer as trainer_mod

    calls = []

    def counted(L, n):
        calls.append(n)
        return default_target_layer_ids(L, n)

    trainer_mod.default_target_layer_ids, rule = counted, trainer_mod.default_target_layer_ids
    try:
        ids, note = default_layer_ids(4, 3_000)
    finally:
        trainer_mod.default_target_layer_ids = rule
    assert len(calls) <= 3 and ids == [1] * 3_000, len(calls)
    # (the 3000 ids are shown shortened)
    assert note.startswith("WARNING: the default target layers of a 3000-layer drafter for this 4-layer target are "
                           "[1, 1, 1, 1, 1, 1, ... (2,988 more) ..., 1, 1, 1, 1, 1, 1] (") and len(note) < 400, note
    assert note.endswith("or pass num_layers 1"), note
    ids, note = default_layer_ids(5, 4)  # (with fewer drafter layers the rule's ids are distinct)
    # (the fields: the command line names the flags, test_default_target_layers_on_shallow_targets_say_what_to_pass)
    assert ids == [1, 1, 2, 2] and note.endswith("which repeat layers: choose 4 layers with target_layer_ids "
                                                 "(e.g. 0,1,2,4), or pass num_layers 2"), note


SHALLOW_TARGET_CASES = {  # (target layers, extra flags): the exact line (a warning: trained all the same)
    # (it said "--target-layer-ids [-1] outside the target's 2 layers", a flag the user never gave)
    "2-layer": (2, [], "dflash-torch: error: the default target layers of a 2-layer drafter are [1, -1] (the DFlash "
                       "rule spreads them from layer 1 to layer L - 3 = -1), outside the target's 2 layers: pass "
                       "--num-layers 1, or choose 2 layers with --target-layer-ids (e.g. 0,1)"),
    "1-layer": (1, [], "dflash-torch: error: the default target layers of a 2-layer drafter are [1, -2] (the DFlash "
                       "rule spreads them from layer 1 to layer L - 3 = -2), outside the target's 1 layer: pass "
                       "--num-layers 1, or choose 2 layers with --target-layer-ids"),
    # (given ids: the error names the flag, as before)
    "2-layer-given": (2, ["--target-layer-ids", "0,-1"],
                      "dflash-torch: error: --target-layer-ids [-1] outside the target's 2 layers"),
    "empty-given": (2, ["--target-layer-ids", ""],  # (it fell back to the rule unsaid)
                    "dflash-torch: error: --target-layer-ids needs at least one target layer id"),
    # (trained on [1, 0] / [1, 1, 1, 1] without a word)
    "3-layer": (3, [], "WARNING: the default target layers of a 2-layer drafter for this 3-layer target are [1, 0] "
                       "(the DFlash rule spreads them from layer 1 to layer L - 3 = 0), which are not in increasing "
                       "order: choose 2 layers with --target-layer-ids (e.g. 0,2), or pass --num-layers 1"),
    "4-layer-4-deep": (4, ["--num-layers", "4"],
                       "WARNING: the default target layers of a 4-layer drafter for this 4-layer target are "
                       "[1, 1, 1, 1] (the DFlash rule spreads them from layer 1 to layer L - 3 = 1), which repeat "
                       "layers: choose 4 layers with --target-layer-ids (e.g. 0,1,2,3), or pass --num-layers 1"),
}


@pytest.mark.parametrize("case", list(SHALLOW_TARGET_CASES))
def test_default_target_layers_on_shallow_targets_say_what_to_pass(tmp_path, tokenizer_dir, capsys, case):
    from conftest import make_target

    from dflash_torch.cli import main as cli_main

    L, flags, line = SHALLOW_TARGET_CASES[case]
    target = make_target(tmp_path / "t", num_hidden_layers=L, tokenizer=False)
    copy_tokenizer(tokenizer_dir, target)
    capsys.readouterr()  # (transformers' saving bar)
    text = tmp_path / "c.txt"
    text.write_text("\n".join(corpus_texts(8_000)))
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--steps", "1", "--batch", "2",
            "--seq-len", "32", "--block-size", "4", "--anchors-per-seq", "2", "--val-seqs", "0", "--warmup-steps", "1",
            "--no-progress", *flags]
    code = cli_main(args)
    err = capsys.readouterr().err.splitlines()
    if "error" in line:
        assert code == 2 and err == [line], err
        return
    assert code == 0 and [e for e in err if "WARNING" in e] == [line], err
    ids = json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert ids == ([1, 0] if L == 3 else [1, 1, 1, 1])


def test_resume_names_the_drafter_settings_that_differ_before_the_data_step(tiny_pair, tmp_path, capsys, monkeypatch):
    """--resume with other drafter settings than the checkpoint's: each named as a flag with
    both values (it said "a different drafter configuration"), and, as a missing checkpoint,
    said before the data is prepared (it came after)."""
    import dflash_torch.training.trainer as trainer_mod
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair  # 4 layers: the default 2-layer drafter reads [1, 1]
    text = tmp_path / "c.txt"
    text.write_text("\n".join(corpus_texts(8_000)))
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--batch", "2", "--seq-len", "32",
            "--anchors-per-seq", "2", "--val-seqs", "0", "--no-progress"]
    ckpt = out / "train_work" / "checkpoint.pt"

    def no_data(*a, **k):
        raise AssertionError("the data step ran")

    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "prepare_data", no_data)
        assert cli_main(args + ["--resume", "--steps", "2"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"dflash-torch: error: --resume: no checkpoint at '{ckpt}'"]
    assert cli_main(args + ["--steps", "1", "--num-layers", "1", "--block-size", "8"]) == 0
    capsys.readouterr()
    tail = " (give the checkpoint's values to continue it, or leave out --resume and pass --overwrite to start over)"
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "prepare_data", no_data)
        assert cli_main(args + ["--resume", "--steps", "2"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"dflash-torch: error: --resume: '{ckpt}' was trained with another drafter configuration: --num-layers 2 "
            "here, 1 in the checkpoint; --block-size 16 here, 8 in the checkpoint; target layers 1,1 here (the default "
            "of --num-layers 2; --target-layer-ids not given), 2 in the checkpoint" + tail]
        assert cli_main(args + ["--resume", "--steps", "2", "--num-layers", "1", "--block-size", "8", "--arch",
                                "dflash2", "--intermediate-size", "96"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"dflash-torch: error: --resume: '{ckpt}' was trained with another drafter configuration: --arch dflash2 "
            "here, dflash in the checkpoint; --intermediate-size 96 here, 128 in the checkpoint" + tail]
        # (trial-222: a flag not given was named as if it were: --target-layer-ids 1,1 here; --intermediate-size ...)
        assert cli_main(args + ["--resume", "--steps", "2", "--num-layers", "1", "--block-size", "8",
                                "--target-layer-ids", "1", "--intermediate-size", "96", "--mask-token-id", "2"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            "WARNING: --mask-token-id 2 is the tokenizer's token '!', which text is tokenized to; the drafter cannot tell "
            "a masked slot from it (give an id no text maps to, or leave the option out)",
            f"dflash-torch: error: --resume: '{ckpt}' was trained with another drafter configuration: --target-layer-ids 1 "
            "here, 2 in the checkpoint; --intermediate-size 96 here, 128 in the checkpoint; --mask-token-id 2 here, 1 in "
            "the checkpoint" + tail]
    # the same settings: it goes on from the checkpoint
    assert cli_main(args + ["--resume", "--steps", "2", "--num-layers", "1", "--block-size", "8"]) == 0
    assert "resume: step 1" in capsys.readouterr().err
    assert torch.load(ckpt, weights_only=False)["step"] == 2


@torch.no_grad()
def test_greedy_walk_on_text_counts_only_drafts_the_target_would_take(agree_pair):
    """On text that is not the target's own greedy continuation, a draft counts only where it
    equals the text and the target's greedy choice there (transformers' model as the oracle),
    so a round's tau never exceeds what the engine would accept after that context. (A text of
    the agreeable drafter's favourite token: it drafts the text everywhere, the target takes it
    only sometimes; val_tau counted the full block every round.)"""
    from transformers import AutoModelForCausalLM

    from conftest import AGREE_TOKEN

    target_dir, drafter_dir = agree_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    B = drafter.config.block_size
    ids = torch.tensor([5, 9, 17] + [AGREE_TOKEN] * 61)
    start = 3
    oracle = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    takes = oracle(ids[None]).logits[0, :-1].argmax(-1) == ids[1:]  # takes[p - 1]: position p is the target's choice
    taus = greedy_walk(drafter, target, ids, start)
    assert taus
    s = start
    for tau in taus:
        run = 0  # the target's choices from s + 1 on that the text holds
        while run < B - 1 and bool(takes[s + run]):
            run += 1
        assert tau - 1 <= run, (s, tau, run)
        s += tau
    assert max(taus) > 1 and min(taus) < B  # the target takes some drafts, not all


# Qwen3's way with calls: a line end before <tool_call> only after a content; earlier turns' reasoning dropped
QWEN3_CALLS = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% if loop.index0 > ns.last and m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{% endif %}{{ m.content or '' }}{% if m.tool_calls %}{% if m.content %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>' + m.tool_calls[0].function.name + '</tool_call>' }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_loss_of_a_qwen3_style_call_with_an_empty_content_and_reasoning(tiny_pair):
    """A call whose content is "" with reasoning, under a template that writes a line end
    before the call only after a content (Qwen3's): the contents are placed with the empty
    one left unmarked, so each reply has its span (it trained on all its tokens, counted:
    common agent data; trial-98)."""
    from transformers import AutoTokenizer

    from dflash_torch.chat_template import chat_messages

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = QWEN3_CALLS
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks a lot"},
                {"role": "assistant", "content": "You are welcome."}]
    ex = tokenize_conversation(tok, chat_messages(messages))
    assert not ex.whole
    spans = "".join(_masked_spans(tok, ex))
    assert "get_weather" in spans and "It is sunny." in spans and "You are welcome." in spans, spans
    assert "Paris" not in spans and "sunny<" not in spans and "Thanks" not in spans, spans


_RUN_AS_A_USER = r'''
import contextlib, io, json, sys
from dflash_torch.cli import main
for line in sys.stdin:  # (each line: a JSON list of command lines, answered in a line "RAN " + JSON)
    out = []
    for argv in json.loads(line):
        std, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(std), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except BaseException as exc:
                rc = repr(exc)
        out.append([rc, std.getvalue() + err.getvalue()])
    print("RAN " + json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def as_a_user(tmp_path_factory):
    """``run(argvs)`` -> ``[rc, stdout + stderr]`` of each command line of ``argvs``, run one after
    another by :data:`_RUN_AS_A_USER` under test_errors' ``_as_an_ordinary_user`` prefix (file
    modes apply to it; the test skips where none can be had): one process for the module's tests
    (a process spends ~4 s CPU importing torch and transformers)."""
    import subprocess

    from test_errors import _as_an_ordinary_user

    prefix = _as_an_ordinary_user(tmp_path_factory.mktemp("user-probe"))
    log = tmp_path_factory.mktemp("user-runner") / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([*prefix, sys.executable, "-c", _RUN_AS_A_USER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def run(argvs: list[list[str]]) -> list:
        proc.stdin.write(json.dumps(argvs) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:  # (past what the process printed outside sys.stdout, if anything)
            if line.startswith("RAN "):
                return json.loads(line.removeprefix("RAN "))
        raise AssertionError(f"the process running as an ordinary user ended ({proc.wait(60)}): {log.read_text()}")

    try:
        yield run
    finally:
        proc.stdin.close()
        assert proc.wait(120) == 0, log.read_text()


def test_train_refuses_unreadable_data_and_unwritable_work_dirs_in_one_line(tiny_pair, tmp_path, as_a_user):
    """As an ordinary user (root reads whatever the modes say: setpriv drops that): an
    unreadable file at the top of the target directory that loading does not need (a
    README.md) was a PermissionError traceback from hashing it for the data cache's key, and
    so was an unreadable --data file; an unreadable --data directory was "holds no text", an
    unreadable directory below it was passed over (skipped_files 0); a --work-dir this process
    may not write was a RuntimeError traceback from torch.save after the data was prepared.
    The README.md trains; the others are one line naming the path, exit 2, before the target
    loads."""

    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    (target / "README.md").write_text("# a model\n")
    text = "def f(x):\n    return x\n" * 50
    data = tmp_path / "a.txt"
    data.write_text(text)
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    for name in ("dir/a.txt", "dir/sub/b.txt", "file-dir/a.txt", "file-dir/b.txt", "closed-dir/a.txt",
                 "dir/.hidden/c.txt", "unreadable.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    modes = {target / "README.md": 0, tmp_path / "unreadable.txt": 0, tmp_path / "dir" / "sub": 0,
             tmp_path / "file-dir" / "b.txt": 0, tmp_path / "closed-dir": 0, tmp_path / "dir" / ".hidden": 0,
             work: 0o555}
    args = ["--steps", "1", "--batch", "2", "--seq-len", "64", "--val-seqs", "0", "--no-progress"]
    cases = [(data, [], None),  # (the README.md: trains)
             (tmp_path / "unreadable.txt", [], tmp_path / "unreadable.txt"),
             (tmp_path / "dir", [], tmp_path / "dir" / "sub"),  # (not its hidden .hidden, which is not read)
             (tmp_path / "file-dir", [], tmp_path / "file-dir" / "b.txt"),
             (tmp_path / "closed-dir", [], tmp_path / "closed-dir"),
             (data, ["--work-dir", str(work)], None)]
    argvs = [["train", "--target", str(target), "--data", str(d), "--out", str(tmp_path / f"out{i}"), *args, *more]
             for i, (d, more, _) in enumerate(cases)]
    for path, mode in modes.items():
        path.chmod(mode)
    try:
        out = as_a_user(argvs)
    finally:
        for path in modes:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert out[0][0] == 0, out[0]
    assert (tmp_path / "out0" / "model.safetensors").is_file()
    want = [f"dflash-torch: error: cannot read {path}: Permission denied\n" for _, _, path in cases[1:-1]]
    want.append(f"dflash-torch: error: cannot use --work-dir '{work}' as a directory: Permission denied\n")
    assert out[1:] == [[2, w] for w in want]


def test_train_refuses_an_out_or_work_dir_it_may_not_list_in_one_line(tiny_pair, tmp_path, as_a_user):
    """As an ordinary user: an existing --out this process may enter and write but not list
    (mode 311), or not enter at all (000), with or without --overwrite, and a --work-dir it may
    not enter, were PermissionError tracebacks from looking into them; each is ``cannot use
    --out DIR as a directory: Permission denied``, exit 2, and the directory is left."""

    target, _ = tiny_pair
    data = tmp_path / "a.txt"
    data.write_text("def f(x):\n    return x\n" * 50)
    args = ["--steps", "1", "--batch", "2", "--seq-len", "64", "--val-seqs", "0", "--no-progress"]
    cases = [(0o311, "--out", []), (0o311, "--out", ["--overwrite"]), (0, "--out", []), (0, "--out", ["--overwrite"]),
             (0, "--work-dir", [])]
    dirs = [tmp_path / f"d{i}" for i in range(len(cases))]
    argvs = [["train", "--target", str(target), "--data", str(data), *args, *more, "--out",
              str(d if flag == "--out" else tmp_path / f"out{i}"), *(["--work-dir", str(d)] if flag == "--work-dir" else [])]
             for i, ((_, flag, more), d) in enumerate(zip(cases, dirs))]
    for (mode, _, _), d in zip(cases, dirs):
        d.mkdir()
        d.chmod(mode)
    try:
        out = as_a_user(argvs)
    finally:
        for d in dirs:
            d.chmod(0o755)
    assert out == [[2, f"dflash-torch: error: cannot use {flag} '{d}' as a directory: Permission denied\n"]
                   for (_, flag, _), d in zip(cases, dirs)]
    assert all(d.is_dir() and not any(d.iterdir()) for d in dirs)


def test_a_data_cache_that_cannot_be_read_back_is_made_again(tiny_pair, tmp_path, capsys, as_a_user):
    """A data cache in the work dir that is truncated, empty, not such a cache, holds other
    pickled objects (nothing in it is run: it was unpickled whole), or (as an ordinary user)
    one this process may not read was a traceback from torch.load; it is made again, said in
    a WARNING line, and the run trains on the same data."""

    from dflash_torch.cli import main as cli_main
    from dflash_torch.training.trainer import prepare_data

    target, _ = tiny_pair
    data = tmp_path / "a.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 60)
    cfg = _cfg(tmp_path, target, data, val_seqs=0, batch=1, seq_len=32)
    tok = _tok(target)
    first, _, _ = _prepare(cfg, tok, target)
    [cache] = Path(cfg.work_dir).glob("data-*.pt")
    whole = cache.read_bytes()
    torch.save([1, 2], tmp_path / "list.pt")
    # (one holding other objects, whose unpickling runs code: read with weights_only, so not run, and made again)
    ran = tmp_path / "ran"
    blob = torch.load(cache, weights_only=True)
    torch.save({**blob, "notes": [_RunsCode(str(ran))]}, tmp_path / "planted.pt")
    for damaged in (whole[:100], b"", (tmp_path / "list.pt").read_bytes(), (tmp_path / "planted.pt").read_bytes()):
        cache.write_bytes(damaged)
        said = []
        again, _, _ = prepare_data(cfg, Path(target), tok, said.append)
        assert again.stream.tolist() == first.stream.tolist()
        assert [s for s in said if "WARNING" in s][0].startswith(f"data: WARNING: cannot read back {cache} ("), said
        said.clear()
        prepare_data(cfg, Path(target), tok, said.append)
        assert f"data: loaded {cache}" in said and not any("WARNING" in s for s in said), said
    assert not ran.exists()
    work = tmp_path / "work"
    argv = ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out"), "--work-dir", str(work),
            "--steps", "1", "--batch", "2", "--seq-len", "64", "--val-seqs", "0", "--no-progress", "--overwrite"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    [cache] = work.glob("data-*.pt")
    cache.chmod(0)
    try:
        out = as_a_user([argv])
    finally:
        cache.chmod(0o644)
    [[rc, text]] = out
    assert rc == 0, text
    assert f"data: WARNING: cannot read back {cache} (Permission denied); making it again\n" in text


def test_train_data_that_is_not_a_regular_file_is_said_so(tiny_pair, tmp_path, capsys):
    """--data a FIFO or /dev/null was "training data X does not exist" (it exists); it is
    "training data X is not a regular file", exit 2, before anything opens it."""
    import os

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for data in (fifo, Path("/dev/null")):
        args = ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1",
                "--no-progress"]
        assert cli_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dflash-torch: error: training data {data} is not a regular file"], err


def test_the_default_mlp_width_of_a_drafter_for_an_all_expert_target_is_what_a_token_passes_through(capsys):
    """make_drafter_config's MLP width: the target's dense width where a layer has a dense MLP
    (a Qwen3-MoE with mlp_only_layers); where every MLP is a mixture of experts, top_k x the
    expert width (+ a shared expert), not the config's intermediate_size, which is then one
    expert's (gpt-oss: it gave 24, not 2 x 24) or unused (Qwen3-MoE: it gave its 128). train
    --help says so (it said "default: the target's", trial-222), and the mask id's default too."""
    from dflash_torch.cli import main as cli_main
    from dflash_torch.models.config import TargetConfig

    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert ("drafter MLP width (default: the target's dense MLP width; for a target whose every MLP is a mixture of "
            "experts, the width a token passes through: top-k x the expert width, e.g. num_experts_per_tok x "
            "moe_intermediate_size, plus the shared expert's)") in help_, help_
    assert ("mask token id (default: the tokenizer's mask token or <|MASK|>, else the first embedding row that is no "
            "token id of the tokenizer)") in help_, help_
    from dflash_torch.training.trainer import make_drafter_config

    base = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=300, rms_norm_eps=1e-6, max_position_embeddings=512)
    gpt_oss = {"model_type": "gpt_oss", **base, "intermediate_size": 24, "num_local_experts": 4,
               "num_experts_per_tok": 2, "sliding_window": 8}
    qwen3_moe = {"model_type": "qwen3_moe", **base, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_experts": 4, "num_experts_per_tok": 2}
    cfg = TrainConfig(target="t", data=["d"], out="o", num_layers=1)
    for target, width in ((gpt_oss, 2 * 24), (qwen3_moe, 2 * 32), ({**qwen3_moe, "mlp_only_layers": [0]}, 128)):
        assert make_drafter_config(TargetConfig.from_dict(target), cfg, 1).intermediate_size == width, target


_CTRL_C_THRICE = r'''
import atexit, os, signal, sys, time
import torch
import dflash_torch.training.trainer as trainer
from dflash_torch.cli import entry

calls, loss, save = [], trainer.batch_loss, torch.save

def batch_loss(*args, **kwargs):  # Ctrl-C while training (the third step)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGINT)
    return loss(*args, **kwargs)

def saving(obj, path, *args, **kwargs):  # and again while the checkpoint is saved
    if str(path).endswith("checkpoint.tmp"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    return save(obj, path, *args, **kwargs)

def at_exit():  # and once more while the interpreter exits (run before torch's own exit callbacks)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)

trainer.batch_loss, torch.save = batch_loss, saving
atexit.register(at_exit)
sys.argv = ["dflash-torch", *sys.argv[1:]]
entry()
'''


def test_ctrl_c_again_while_train_saves_and_exits_ends_quietly(tiny_pair, tmp_path):
    """A second Ctrl-C while train saved its checkpoint on the first (or while the process
    exited) printed "Exception ignored in atexit callback ... KeyboardInterrupt" with a
    traceback (trial-127): the save goes on whole and the process ends with 130, quietly.
    It is started with SIGINT ignored, as `dflash-torch train ... &` from a script is: SIGINT
    stops it all the same (it trained on to its last step, exit 0: trial-293 d)."""
    import signal
    import os
    import subprocess
    import sys

    target, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    args = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "50", "--batch", "2",
            "--seq-len", "64", "--block-size", "8", "--num-layers", "1", "--val-seqs", "0", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _CTRL_C_THRICE, *args], capture_output=True, text=True, env=env,
                         timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    assert "interrupted: checkpoint of step 2 saved to" in run.stderr.strip().splitlines()[-1], run.stderr
    assert torch.load(out / "train_work" / "checkpoint.pt", weights_only=False)["step"] == 2


def test_sigterm_saves_a_checkpoint_as_ctrl_c_does_and_resume_goes_on(tiny_pair, tmp_path, capsys):
    """SIGTERM (timeout, docker stop, systemd, Slurm) killed train with nothing saved: it saves the
    checkpoint of the steps trained, as a Ctrl-C does, and exits 143 (128 + SIGTERM); --resume goes on."""
    import fcntl
    import os
    import pty
    import re
    import select
    import signal
    import struct
    import subprocess
    import sys
    import termios
    import time

    from dflash_torch.cli import main as cli_main

    def read(fd: int, wait: float) -> bytes:
        """What the terminal ``fd`` has within ``wait`` seconds (b"" at its end: EIO once the child has exited)."""
        if not select.select([fd], [], [], wait)[0]:
            return b""
        try:
            return os.read(fd, 1 << 16) or b""
        except OSError:
            return b""

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0", "--block-size", "8",
            "--num-layers", "1"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    terminal, stderr = pty.openpty()  # (stderr a terminal: the progress bar is drawn only there)
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # (0 columns: a bar of nothing)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", *args, "--steps", "1000000"],
                            stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    os.close(stderr)
    seen, deadline = b"", time.monotonic() + 240
    try:  # (until the progress bar shows a step trained)
        while not re.search(rb"train:[^\r\n]*\| *[1-9][0-9]*/", seen):
            assert proc.poll() is None and time.monotonic() < deadline, seen[-500:]
            seen += read(terminal, 0.2)
        capsys.readouterr()
        # (another run in its --out, or resuming it, while it trains: refused, naming it; both wrote there at once)
        for more in ([], ["--resume"]):
            assert cli_main([*args, "--steps", "1", "--no-progress", *more]) == 2
            assert capsys.readouterr().err.strip().splitlines()[-1] == (
                f"dflash-torch: error: --out '{out}' is in use by another training run (PID {proc.pid}): wait for it "
                "to end, or give another --out")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        while more := read(terminal, 1):
            seen += more
        err = seen.decode()
    finally:
        proc.kill()
        os.close(terminal)
    assert proc.returncode == 143, err
    assert not (out / LOCK_NAME).exists() and not (work / LOCK_NAME).exists()  # (released, its files removed)
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(rf"interrupted: checkpoint of step (\d+) saved to {re.escape(repr(str(work / 'checkpoint.pt')))}; "
                         "continue with --resume", last)
    assert found and "Traceback" not in err, err
    step = int(found.group(1))
    assert step >= 1 and torch.load(work / "checkpoint.pt", weights_only=True)["step"] == step
    handler = signal.getsignal(signal.SIGTERM)
    assert cli_main([*args, "--no-progress", "--resume", "--steps", str(step + 2)]) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # (the handler before the run is restored)
    assert f"resume: step {step}," in capsys.readouterr().err
    assert json.loads((out / "training_log.json").read_text())["steps"] == step + 2


def _hold_dir(path: Path) -> int:
    """Start a process that holds the run lock of the directory ``path``, as a train run there
    does, until it is killed: its PID (kill it with SIGKILL, which no handler sees, then reap it:
    ``os.waitpid``). A fork of this process, which takes the lock and sleeps: a new interpreter
    spent ~2.5 s CPU importing dflash_torch.training for it."""
    import time

    from dflash_torch.training.runlock import RunLock

    said, say = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: it never returns into pytest)
        try:
            os.close(said)
            lock = RunLock()  # (held while it is referenced)
            lock.take({"work_dir": (str(path), path)})
            os.write(say, b"held\n")
            while True:
                time.sleep(60)
        finally:
            os._exit(1)
    os.close(say)
    with os.fdopen(said) as told:
        if told.readline() != "held\n":
            os.waitpid(pid, 0)
            raise AssertionError(f"the process that was to hold {path} did not")
    return pid


def _kill(pid: int) -> None:
    """SIGKILL the process ``pid`` (one of :func:`_hold_dir`) and reap it; nothing where it is gone."""
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_a_directory_another_run_holds_is_refused_and_a_killed_runs_lock_file_blocks_nothing(tiny_pair, tmp_path,
                                                                                             capsys):
    """A run holds its --out and --work-dir locked (two runs in one --out both trained, wrote one
    checkpoint.pt, and the later export won, each saying it saved its drafter: trial-293 a): a run
    in a directory another process holds is refused, naming the directory and that process, and
    leaves nothing behind; a run killed with SIGKILL (which no handler sees) leaves its lock file,
    which blocks no later run; a run's lock files are gone once it ends."""
    from dflash_torch.cli import main as cli_main

    work, args = _one_step_run(tiny_pair[0], tmp_path)
    out = tmp_path / "out"
    holder = _hold_dir(work)
    try:
        capsys.readouterr()
        assert cli_main(args) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"dflash-torch: error: --work-dir '{work}' is in use by another training run (PID {holder}): wait for "
            "it to end, or give another --work-dir")
        assert not out.exists() and sorted(f.name for f in work.iterdir()) == [LOCK_NAME]
    finally:
        _kill(holder)
    assert (work / LOCK_NAME).is_file()  # (left by the killed process)
    assert cli_main(args) == 0
    assert not (work / LOCK_NAME).exists() and not (out / LOCK_NAME).exists()
    assert (out / "model.safetensors").is_file()


def test_a_checkpoint_that_cannot_be_saved_after_an_earlier_one_says_resume_continues_from_it(tiny_pair, tmp_path,
                                                                                              capsys, monkeypatch):
    """With --ckpt-every, a later checkpoint failing said "--resume cannot continue this run", though the
    earlier one stayed in place and --resume continued from it: the line names its step and says so; and
    so it does, the resumed run ending as the uninterrupted one."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["train", "--target", str(target), "--data", str(text), "--work-dir", str(work), "--steps", "3",
            "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "2", "--block-size", "8",
            "--num-layers", "1", "--no-progress", "--ckpt-every", "1", "--eval-every", "1"]
    assert cli_main([*args, "--out", str(tmp_path / "full"), "--work-dir", str(tmp_path / "work-full")]) == 0
    evaluate, calls = Trainer.evaluate, []

    def evaluating(self, *args, **kwargs):  # (step 2's evaluation: after step 1's checkpoint, before step 2's)
        calls.append(1)
        if len(calls) == 3:
            (work / "checkpoint.tmp").mkdir()
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", evaluating)
    capsys.readouterr()
    assert cli_main([*args, "--out", str(out)]) == 2
    ckpt = work / "checkpoint.pt"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"dflash-torch: error: training stopped: the drafter of step 2 is saved in '{out}', but cannot "
                       f"save the training checkpoint of step 2 to '{ckpt}': cannot write {work / 'checkpoint.tmp'}: "
                       f"Is a directory; the checkpoint of step 1 stays in '{ckpt}', and --resume continues from it"), err
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    (work / "checkpoint.tmp").rmdir()
    assert cli_main([*args, "--out", str(out), "--resume"]) == 0
    assert "resume: step 1," in capsys.readouterr().err
    full, resumed = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_a_save_that_fails_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(tiny_pair, tmp_path):
    """A full disk while the training checkpoint was saved was a RuntimeError traceback from
    torch.save ("unexpected pos ...") that left a partial checkpoint.tmp, and while the drafter
    was exported a SafetensorError traceback (not an OSError: uncaught) (trial-166). Writes that
    fail for real (past RLIMIT_FSIZE: EFBIG, as a full disk fails them) are one line naming the
    path and the reason, exit 2, and leave no temporary file; the checkpoint before them stays.
    So is the data cache's (trial-293 b).
    (The export's SafetensorError: test_a_failed_or_interrupted_export_never_leaves_a_broken_drafter.)"""
    import hashlib
    import re

    target, _ = tiny_pair
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["train", "--target", str(target), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0", "--block-size", "8",
            "--num-layers", "1", "--no-progress"]
    # (the three runs below, one after another in one process: _FULL_DISK, in a fork of this one)
    argvs = [(4096, [*args, "--steps", "1"]), (None, [*args, "--steps", "1"]), (4096, [*args, "--steps", "2", "--resume"])]
    ran = run_forked(_FULL_DISK, [json.dumps(argvs)], timeout=600)
    assert ran.returncode == 0, ran.stderr
    runs = [SimpleNamespace(returncode=int(code), stderr=said)
            for said, code in zip(*[iter(re.split(r"^RUN ENDED (\d+)\n", ran.stderr, flags=re.M))] * 2)]
    assert len(runs) == 3, ran.stderr

    # the data cache (a RuntimeError traceback from torch.save, "unexpected pos ...": trial-293 b); the run's
    # directories, which it made, are removed (they hold no partial file)
    proc = runs[0]
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(rf"dflash-torch: error: cannot save the prepared data to "
                        rf"'{re.escape(str(work))}/data-[0-9a-f]{{16}}\.pt': File too large",
                        proc.stderr.strip().splitlines()[-1]), proc.stderr
    assert "RUN 1 LEFT work=False out=False" in ran.stdout.splitlines(), ran.stdout  # (before run 2 made them)
    first = runs[1]
    assert first.returncode == 0, first.stderr
    ckpt = work / "checkpoint.pt"
    saved = [line for line in ran.stdout.splitlines() if line.startswith("RUN 2 CHECKPOINT ")]
    assert saved == [f"RUN 2 CHECKPOINT {hashlib.sha256(ckpt.read_bytes()).hexdigest()}"], ran.stdout  # (still it)
    # the checkpoint of a resumed run (the data cache is read, not written)
    proc = runs[2]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (  # (--out is on the same full disk: the drafter is tried first)
        f"dflash-torch: error: cannot export the drafter to '{out}': File too large; and cannot save the training "
        f"checkpoint of step 2 to '{ckpt}': File too large; the checkpoint of step 1 stays in '{ckpt}', and --resume "
        "continues from it"), proc.stderr
    assert sorted(f.name for f in work.iterdir() if "checkpoint" in f.name) == ["checkpoint.pt"]


_FULL_DISK = r'''
import hashlib, json, resource, signal, sys
from pathlib import Path
from dflash_torch.cli import main

# Runs the command lines (limit, argv) of json sys.argv[1] one after another, each with files limited to `limit`
# bytes (RLIMIT_FSIZE: EFBIG past it, as a full disk fails a write; SIGXFSZ ignored: not the signal that kills the
# process) or not (None): "RUN ENDED STATUS" on stderr after each; on stdout, whether run 1 left --work-dir and --out,
# and the sha256 of the checkpoint run 2 saved.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for i, (limit, argv) in enumerate(json.loads(sys.argv[1]), 1):
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))
    code = main(argv)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print(f"RUN ENDED {code}", file=sys.stderr, flush=True)
    out, work = (Path(argv[argv.index(flag) + 1]) for flag in ("--out", "--work-dir"))
    if i == 1:
        print(f"RUN 1 LEFT work={work.exists()} out={out.exists()}", flush=True)
    if i == 2:
        print("RUN 2 CHECKPOINT", hashlib.sha256((work / "checkpoint.pt").read_bytes()).hexdigest(), flush=True)
'''


def _one_step_run(target, tmp_path) -> tuple[Path, list[str]]:
    """(work dir, made; ``train`` arguments of a one-step run on a small text that saves there)."""
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    work = tmp_path / "work"
    work.mkdir()
    return work, ["train", "--target", str(target), "--data", str(text), "--out", str(tmp_path / "out"), "--work-dir",
                  str(work), "--steps", "1", "--batch", "2", "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs",
                  "0", "--warmup-steps", "1", "--block-size", "8", "--num-layers", "1", "--no-progress"]


class _RunsCode:
    """Unpickled, it makes the directory ``path`` (as a pickle can run any code)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_resume_does_not_unpickle_objects_a_checkpoint_does_not_hold(tiny_pair, tmp_path, capsys):
    """--resume reads checkpoint.pt with torch.load(weights_only=True): a checkpoint.pt that holds
    other Python objects (here one whose unpickling runs code) is refused in one line, its code
    not run (it was unpickled whole: the code ran)."""
    from dflash_torch.cli import main as cli_main

    work, args = _one_step_run(tiny_pair[0], tmp_path)
    ran = tmp_path / "ran"
    torch.save({"drafter": {}, "optimizer": {}, "step": 1, "elapsed": 0.0, "history": [], "evals": [],
                "drafter_config": {"hook": _RunsCode(str(ran))}}, work / "checkpoint.pt")
    assert cli_main([*args, "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --resume: '{work / 'checkpoint.pt'}' holds Python objects a dflash-torch training "
        "checkpoint does not (only tensors and plain values), so it is not read (unpickling them could run code); give "
        "the --work-dir of a dflash-torch train run, or leave out --resume and pass --overwrite to replace it")
    assert not ran.exists()


def test_a_checkpoint_pt_of_another_tool_is_not_called_a_training_checkpoint(tiny_pair, tmp_path, capsys):
    """--resume with a --work-dir holding another tool's checkpoint.pt was a KeyError
    ('drafter_config') traceback, and without --resume it was called "a training checkpoint"
    to continue with --resume (trial-166): both one line saying it is none, exit 2."""
    from dflash_torch.cli import main as cli_main

    work, args = _one_step_run(tiny_pair[0], tmp_path)
    ckpt = work / "checkpoint.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, ckpt)
    assert cli_main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dflash-torch: error: '{ckpt}' is not a dflash-torch training checkpoint: give another --work-dir, or pass "
        "--overwrite to replace it"]
    assert cli_main([*args, "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --resume: '{ckpt}' is not a dflash-torch training checkpoint (it holds no drafter, "
        "optimizer, step, elapsed, history, evals, drafter_config); give the --work-dir of a dflash-torch train run, "
        "or leave out --resume and pass --overwrite to replace it")
    assert cli_main([*args, "--overwrite"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli_main(args) == 2  # (its own checkpoint now: as it was)
    assert capsys.readouterr().err.splitlines() == [
        f"dflash-torch: error: '{work}' holds a training checkpoint: pass --resume to continue it or --overwrite to "
        "start over"]


def test_resume_with_another_target_names_the_target_not_flags_for_its_sizes(tiny_pair, sentencepiece_pair, tmp_path,
                                                                           capsys):
    """--resume with an incompatible --target listed the target's head_dim, hidden_size, ...
    "here vs in the checkpoint" as settings to give, and --target-layer-ids though it was not
    given (trial-166): it says the checkpoint was trained for another target, named, with the
    sizes that differ, and to pass that --target; flags only for what the user set. A target
    whose tokenizer names no mask token says so too (it asked for --mask-token-id first,
    which the checkpoint holds: trial-175)."""
    from dflash_torch.cli import main as cli_main

    from conftest import make_target

    target, _ = tiny_pair
    other = make_target(tmp_path / "other", hidden_size=32, head_dim=8, num_hidden_layers=6, intermediate_size=96)
    text = tmp_path / "c.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    work = tmp_path / "work"
    args = ["train", "--data", str(text), "--out", str(tmp_path / "out"), "--work-dir", str(work), "--batch", "2",
            "--seq-len", "64", "--anchors-per-seq", "2", "--val-seqs", "0", "--block-size", "8", "--no-progress"]
    assert cli_main([*args, "--target", str(target), "--steps", "1", "--num-layers", "1"]) == 0
    capsys.readouterr()
    ckpt = work / "checkpoint.pt"
    head = (f"dflash-torch: error: --resume: '{ckpt}' was trained for another model, '{target.resolve()}' (head_dim 8 "
            "here, 16 in the checkpoint; hidden_size 32 here, 64 in the checkpoint; num_target_layers 6 here, 4 in the "
            "checkpoint")
    tail = "or leave out --resume and pass --overwrite to start over"
    assert cli_main([*args, "--target", str(other), "--steps", "2", "--num-layers", "1", "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{head}): pass --target '{target.resolve()}' to continue it, {tail}")
    assert cli_main([*args, "--target", str(other), "--steps", "2", "--num-layers", "2", "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{head}; and other settings: --num-layers 2 here, 1 in the checkpoint): pass --target '{target.resolve()}' "
        f"and the values of the checkpoint to continue it, {tail}")
    sp_target, _ = sentencepiece_pair
    assert cli_main([*args, "--target", str(sp_target), "--steps", "2", "--num-layers", "1", "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --resume: '{ckpt}' was trained for another model, '{target.resolve()}' (vocab_size 700 "
        f"here, 320 in the checkpoint): pass --target '{target.resolve()}' to continue it, {tail}")


def test_a_run_interrupted_and_resumed_logs_the_losses_of_an_uninterrupted_one(tiny_pair, tmp_path, monkeypatch):
    """The running mean behind each loss_history row (the losses since the last row) was not
    in the checkpoint: after a Ctrl-C between two rows and --resume, the next row and the
    final_train_loss were the mean of the resumed steps only (trial-166), though the weights
    were those of an uninterrupted run. It is saved and restored: the logs are the same. The
    step's scheduled evaluation, not logged before the Ctrl-C, runs first on resume (it was
    lost for good: eval_history lacked it, trial-272)."""
    import os
    import signal

    import torch.optim.adam as adam

    target_dir, _ = tiny_pair
    data = _jsonl(tmp_path / "d.jsonl")
    full = _cfg(tmp_path / "a", target_dir, data, steps=4, log_every=3, eval_every=2)
    whole = Trainer(full, log=lambda m: None).run()
    original, calls = adam._single_tensor_adam, []

    def interrupted_in_step_2(params, *args, **kwargs):  # (AdamW's update on CPU, once a parameter group)
        calls.append(len(params))
        result = original(params, *args, **kwargs)
        if len(calls) == 4:  # (step 2's last group: the Ctrl-C is taken once the step is done, before step 3)
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(adam, "_single_tensor_adam", interrupted_in_step_2)
    cut = _cfg(tmp_path / "b", target_dir, data, steps=4, log_every=3, eval_every=2)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        Trainer(cut, log=lines.append).run()
    assert lines[-1].startswith("interrupted: checkpoint of step 2 saved"), lines
    monkeypatch.setattr(adam, "_single_tensor_adam", original)
    cut.resume = True
    resumed = Trainer(cut, log=lambda m: None).run()

    def rows(info):
        return [{k: r[k] for k in ("step", "loss", "train_tau", "grad_norm")} for r in info["loss_history"]]

    assert [r["step"] for r in whole["loss_history"]] == [1, 3, 4]
    assert rows(resumed) == rows(whole)
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert [e["step"] for e in whole["eval_history"]] == [0, 2, 4]
    assert resumed["eval_history"] == whole["eval_history"]


@pytest.mark.parametrize("damage", ["truncated", "text"])
def test_resume_of_a_damaged_checkpoint_says_so_in_one_whole_line(tiny_pair, tmp_path, capsys, damage):
    """A truncated checkpoint.pt, or one of text, was torch's words cut at 200 characters
    ("... there is a high likelihood that your checkpoint file is"), or its advice to
    torch.save with an mmap option (trial-175): one line saying it is damaged and what to do."""
    from dflash_torch.cli import main as cli_main

    work, args = _one_step_run(tiny_pair[0], tmp_path)
    ckpt = work / "checkpoint.pt"
    if damage == "truncated":
        torch.save({"drafter": {"w": torch.zeros(4096)}, "step": 1}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:8000])
    else:
        ckpt.write_text("not a checkpoint\n")
    assert cli_main([*args, "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-torch: error: --resume: '{ckpt}' is not a whole torch checkpoint file (truncated or damaged), so it "
        "cannot be read; leave out --resume and pass --overwrite to start over")


def test_resuming_an_init_from_run_says_neither_a_reset_nor_flags_never_given(tiny_pair, tmp_path, capsys):
    """A resumed --init-from run said "init: weights of DRAFTER" after "resume: step 1", as if
    they were reset to them; without --init-from again it named the defaults of --num-layers,
    --block-size, ... as the settings that differ, never the --init-from (trial-175). A source
    that does not fit the target, or whose weights do not fit its own config, is refused
    naming --init-from."""
    from conftest import drafter_config, save_drafter

    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    drafter = save_drafter(tmp_path / "d1", drafter_config(target, num_layers=1, block_size=8))
    work, args = _one_step_run(target, tmp_path)
    args = args[:args.index("--block-size")] + ["--init-from", str(drafter), "--no-progress"]
    # (a drafter for another hidden size: "incompatible pair: drafter hidden_size 32 != ..." named no flag)
    other = save_drafter(tmp_path / "d32", replace(drafter_config(target, num_layers=1), hidden_size=32))
    assert cli_main([*args[:-3], "--init-from", str(other), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-torch: error: --init-from '{other}' does not fit the target (incompatible pair: drafter hidden_size 32 "
        "!= target hidden_size 64)"]
    # (a target's directory, not a drafter's: "the drafter checkpoint is not a DFlash drafter" named no flag, trial-293)
    assert cli_main([*args[:-3], "--init-from", str(target), "--no-progress"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"dflash-torch: error: --init-from '{target}': the drafter checkpoint "
                                                 "is not a DFlash drafter (architectures=['Qwen3ForCausalLM'])"), said
    # (weights that do not fit the source's own config: "drafter weight ... has shape ..." named no flag, trial-249)
    edited = tmp_path / "d1024"
    shutil.copytree(drafter, edited)
    conf = json.loads((edited / "config.json").read_text())
    width, conf["intermediate_size"] = conf["intermediate_size"], 1024
    (edited / "config.json").write_text(json.dumps(conf))
    assert cli_main([*args[:-3], "--init-from", str(edited), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-torch: error: --init-from '{edited}': drafter weight layers.0.mlp.gate_proj.weight has shape "
        f"({width}, 64), config implies (1024, 64)"]
    assert cli_main(args) == 0
    assert f"init: weights of {drafter}" in capsys.readouterr().err
    # (its source has none: the export had none, where a fresh run's drafter has the target's)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 1024
    assert cli_main([*args, "--steps", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resume: step 1," in err and "init: weights" not in err, err
    plain = [a for a in args if a not in ("--init-from", str(drafter))]
    # without --init-from the drafter's shape is the checkpoint's, which the --init-from drafter set (it named the
    # defaults of --num-layers ... as differing, then said "pass --init-from D again", which led nowhere where D had
    # changed since: trial-293)
    assert cli_main([*plain, "--steps", "3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "drafter: 1 layers, B=8, target_layer_ids=[2], mask_token_id=1 (the checkpoint's, of its run's --init-from " \
        f"'{drafter}')" in err and f"--init-from left out (was '{drafter}')" in err, err
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["steps"] == 3 and log["config"]["num_layers"] == 1 and log["config"]["block_size"] == 8
    assert log["config"]["init_from"] == str(drafter)
    # a shape setting given besides, other than the checkpoint's: it is said to leave it out
    assert cli_main([*plain, "--steps", "4", "--resume", "--num-layers", "3"]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (f"dflash-torch: error: --resume: '{work / 'checkpoint.pt'}' was trained with another drafter "
                    f"configuration: --num-layers 3 here, 1 in the checkpoint: its run started with --init-from "
                    f"'{drafter}', which set the drafter's shape, and a run resumed without --init-from takes its shape "
                    "from the checkpoint: leave out --num-layers to continue it, or leave out --resume and pass --overwrite "
                    "to start over"), said
    # the --init-from drafter replaced by one of another shape since: it is said to leave out --init-from (it said
    # "give the checkpoint's values", whose flags are refused beside --init-from)
    shutil.rmtree(drafter)
    save_drafter(drafter, drafter_config(target, num_layers=2, block_size=8))
    assert cli_main([*args, "--steps", "4", "--resume"]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(f"here they are those of --init-from '{drafter}', which has changed since its run started "
                         "from it (leave out --init-from to continue it (a run resumed without it takes the drafter's shape "
                         "from the checkpoint), or leave out --resume and pass --overwrite to start over)"), said
    assert cli_main([*plain, "--steps", "4", "--resume"]) == 0  # (which it does)
    # a checkpoint of such a run saved without max_position_embeddings (before it was filled in) resumes as before
    st = torch.load(work / "checkpoint.pt", weights_only=True)
    del st["drafter_config"]["max_position_embeddings"]
    torch.save(st, work / "checkpoint.pt")
    assert cli_main([*plain, "--steps", "5", "--resume"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err


def test_init_from_target_given_or_left_out_on_resume_is_warned(tiny_pair, tmp_path, capsys):
    """--init-from-target given or dropped on --resume was ignored unsaid (a changed --lr is warned):
    it sets the weights a run starts from, which a resumed run takes from the checkpoint."""
    import dflash_torch.cli as cli

    target, _ = tiny_pair
    work, args = _one_step_run(target, tmp_path)
    assert cli.main([*args, "--init-from-target"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--steps", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert ("resume: WARNING: --init-from-target left out (was given): it sets the weights a run starts from, and a "
            "resumed run goes on from the checkpoint's; it changes nothing here") in err, err
    assert "init: --init-from-target" not in err and "recipe differs" not in err
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["steps"] == 2 and log["config"]["init_from_target"] is True  # (how the drafter started)
    assert cli.main([*args, "--steps", "3", "--resume", "--init-from-target"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    shutil.rmtree(work), shutil.rmtree(tmp_path / "out")
    work.mkdir()
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main([*args, "--steps", "2", "--resume", "--init-from-target"]) == 0
    err = capsys.readouterr().err
    assert "resume: WARNING: --init-from-target given (was not): it sets the weights a run starts from" in err, err
    assert "init: --init-from-target" not in err


def test_init_from_given_changed_or_left_out_on_resume_is_warned_and_never_recorded(tiny_pair, tmp_path, capsys):
    """--init-from given on --resume of an --init-from-target run was accepted unsaid and recorded
    as the run's start (init_from_target True and init_from both: a pair the flags refuse); a later
    resume then said "its run started with --init-from D ... pass --init-from D again" (trial-249).
    Given, changed or dropped, it is warned as --init-from-target is, and the record keeps the
    run's first value."""
    from conftest import drafter_config, save_drafter

    import dflash_torch.cli as cli

    target, _ = tiny_pair
    work, args = _one_step_run(target, tmp_path)
    assert cli.main([*args, "--init-from-target"]) == 0
    o2, o3 = tmp_path / "o2", tmp_path / "o3"
    shutil.copytree(tmp_path / "out", o2), shutil.copytree(tmp_path / "out", o3)
    capsys.readouterr()
    shape = args.index("--block-size")
    init = [*args[:shape], "--no-progress"]  # (the shape comes from the --init-from drafter)
    warning = ": it sets the weights a run starts from, and a resumed run goes on from the checkpoint's; it changes " \
        "nothing here"
    assert cli.main([*init, "--steps", "2", "--resume", "--init-from", str(o2)]) == 0
    err = capsys.readouterr().err
    assert f"resume: WARNING: --init-from '{o2}' given (was not){warning}" in err, err
    assert "init: weights" not in err
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["steps"] == 2 and log["config"]["init_from"] is None and log["config"]["init_from_target"] is True
    assert torch.load(work / "checkpoint.pt", weights_only=True)["train_config"]["init_from"] is None
    # (a later resume named the --init-from as the run's start: "pass --init-from o2 again")
    assert cli.main([*args, "--steps", "3", "--resume", "--init-from-target", "--intermediate-size", "96"]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--intermediate-size 96 here" in said and "--init-from " not in said, said
    # a drafter of another shape given on resume: its values are named as that drafter's
    other = save_drafter(tmp_path / "d2", drafter_config(target, num_layers=2, block_size=8))
    assert cli.main([*init, "--steps", "3", "--resume", "--init-from", str(other)]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(f"here they are those of --init-from '{other}', which its run did not start from (leave out "
                         "--init-from and give the checkpoint's values to continue it, or leave out --resume and pass "
                         "--overwrite to start over)"), said
    # a run that started from o2: another drafter is warned, the same one spelt otherwise is not, dropping it is
    shutil.rmtree(work), shutil.rmtree(tmp_path / "out")
    work.mkdir()
    assert cli.main([*init, "--init-from", str(o2)]) == 0
    capsys.readouterr()
    assert cli.main([*init, "--steps", "2", "--resume", "--init-from", str(o3)]) == 0
    assert f"resume: WARNING: --init-from '{o3}' (was '{o2}'){warning}" in capsys.readouterr().err
    assert cli.main([*init, "--steps", "3", "--resume", "--init-from", f"{o2}{os.sep}"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert cli.main([*args, "--steps", "4", "--resume"]) == 0
    assert f"resume: WARNING: --init-from left out (was '{o2}'){warning}" in capsys.readouterr().err
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert log["steps"] == 4 and log["config"]["init_from"] == str(o2) and log["config"]["init_from_target"] is False
    assert cli.main([*args, "--steps", "5", "--resume", "--intermediate-size", "96"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"its run started with --init-from '{o2}', which set the drafter's shape, and a run resumed without --init-from "
        "takes its shape from the checkpoint: leave out --intermediate-size to continue it, or leave out --resume and "
        "pass --overwrite to start over")


def test_the_command_line_names_no_flag_inside_a_path(tiny_pair, tmp_path, monkeypatch, capsys):
    """Paths in train's messages are quoted, and a field's name inside quotes or before a dot and a
    word (``resume.d``) is not replaced by its flag: "--data my --out is this run's out" for
    --data 'my out' --out 'my out', "x --resume holds a training checkpoint: pass resume=True"
    for --work-dir 'x resume', "saved to --resume.d/checkpoint.pt" (trial-263)."""
    from dflash_torch.cli import error_message, main as cli_main
    from dflash_torch.errors import named

    target, _ = tiny_pair
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my out").mkdir()
    (tmp_path / "c.txt").write_text("def f(x):\n    return x\n" * 50)
    base = ["train", "--target", str(target), "--steps", "2", "--no-progress"]
    tail = ": the drafter's own files would be read as data; put the data in a directory of its own"
    for path in ("my out", "out"):
        assert cli_main([*base, "--data", path, "--out", path]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"dflash-torch: error: --data '{path}' is this run's --out{tail}"]
    (tmp_path / "x resume").mkdir()
    (tmp_path / "x resume" / "checkpoint.pt").write_bytes(b"x")
    assert cli_main([*base, "--data", "c.txt", "--out", "o", "--work-dir", "x resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dflash-torch: error: 'x resume' holds a training checkpoint: pass --resume to continue it or --overwrite "
        "to start over"]
    # (the interrupt's line, said through Trainer.say as an error's message is)
    for path in ("'resume.d/checkpoint.pt'", "resume.d/checkpoint.pt"):
        line = f"interrupted: checkpoint of step 202 saved to {path}; continue with resume=True"
        assert error_message(named(line, "resume"), {"resume": "--resume"}) == \
            f"interrupted: checkpoint of step 202 saved to {path}; continue with --resume"
