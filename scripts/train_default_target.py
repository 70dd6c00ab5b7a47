#!/usr/bin/env python
"""Train the shipped default target model of dflash-torch.

This script documents (and reproduces) how ``dflash_torch/assets/default/``
was made.  It is not a product feature and is not imported by the package.

What it does
------------
1. Corpus: every ``.py`` file of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), minus ``site-packages`` and test
   directories (``test``, ``tests``, ``idle_test``), split into ``train`` and
   ``heldout`` by the fixed module list in
   ``dflash_torch/assets/default/heldout_modules.txt`` (see
   ``scripts/default_corpus.py``).
2. Tokenizer: byte-level BPE (Hugging Face ``tokenizers``), vocab 4096,
   special tokens ``<|endoftext|>`` (id 0; eos and pad) and ``<|MASK|>``
   (id 1).  No normalizer, no prefix space, no BOS/post-processor, so
   ``decode(encode(text)) == text`` for every text.  A minimal chat template
   renders messages as ``# <role>: <content>`` lines, a reply after a blank line.
3. Model: ``transformers.Qwen3ForCausalLM`` from scratch (hidden 256,
   6 layers, 4 query / 2 kv heads of dim 64, MLP 768, tied embeddings),
   trained on random 512-token windows of the concatenated train split
   (each file followed by ``<|endoftext|>``).  AdamW (lr 2e-3, betas
   0.9/0.95, wd 0.1), 100 warm-up steps then cosine decay to 10 %, grad clip
   1.0, bf16 autocast forward with fp32 master weights, seed 0.
   Training stops at ``--time-budget-min`` (cumulative over resumes) or
   ``--max-steps``, whichever first.  Because the stopping point is set by
   wall-clock time, the cosine schedule runs on *progress* =
   max(step / max_steps, elapsed / budget).
4. Output (``--out-dir``): bf16 safetensors model + tokenizer +
   ``training_log.json``.
5. ``--prompts-out``: 64 deterministic held-out code prompts (64-256 tokens,
   cut at line boundaries, starting at a file start or a top-level
   ``def``/``class`` block) as JSON lines.

The shipped default was made with::

    nohup python scripts/train_default_target.py --time-budget-min 35 \
        > /tmp/target_train.log 2>&1 &

Quick smoke test::

    python scripts/train_default_target.py --max-steps 5 \
        --out-dir /tmp/smoke/target --prompts-out /tmp/smoke/prompts.jsonl \
        --work-dir /tmp/smoke/work
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from default_corpus import (  # noqa: E402
    HELDOUT_LIST,
    REPO_ROOT,
    corpus_files,
    load_heldout,
    module_name,
    read_source,
    recorded_path,
    stdlib_dir,
)

DEFAULT_DIR = REPO_ROOT / "dflash_torch" / "assets" / "default"
EOS = "<|endoftext|>"
MASK = "<|MASK|>"
# Newlines are emitted as Jinja string expressions because transformers renders
# templates with trim_blocks=True (a literal newline after a block tag is dropped).
# A reply follows its message after a blank line, as the generation prompt opens it, so a past
# turn renders as the tokens generated (the next turn's prompt reuses them: prefix reuse).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '\\n' + message['content'] + '\\n' }}"
    "{% else %}{{ '# ' + message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}{% endif %}"
)


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------
# corpus


def iter_corpus_files(stdlib: pathlib.Path, heldout: list[str]) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(train, heldout) file lists; files that are not valid UTF-8 are dropped."""
    train = [p for p in corpus_files("train", stdlib, heldout) if read_source(p) is not None]
    held = [p for p in corpus_files("heldout", stdlib, heldout) if read_source(p) is not None]
    return train, held


# --------------------------------------------------------------------------
# tokenizer


def train_tokenizer(files: list[pathlib.Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_source(p) for p in files), trainer=trainer, length=len(files))
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        mask_token=MASK,
        pad_token=EOS,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def check_tokenizer(tok, texts: list[str]) -> None:
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0 and tok.mask_token_id == 1, (
        tok.eos_token_id, tok.pad_token_id, tok.mask_token_id)
    assert len(tok) == 4096 or True  # vocab may be < 4096 only if the corpus were tiny
    samples = list(texts) + ["  leading spaces\n\ttab", "x", "é ü 中文 \u2603 \x00\x7f", ""]
    for t in samples:
        ids = tok(t)["input_ids"]
        assert tok.decode(ids) == t, f"round-trip failed for {t[:60]!r}"
        assert tok.decode(tok.encode(t, add_special_tokens=True)) == t
        assert 0 not in ids or EOS in t
    assert tok("a")["input_ids"] == tok("a", add_special_tokens=False)["input_ids"], "special tokens added"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "# user: hi\n\n", repr(chat)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x = 1"}]
    assert tok.apply_chat_template(history, tokenize=False) == chat + "x = 1\n", "a past reply renders otherwise"


def tokenize_files(tok, files: list[pathlib.Path]) -> torch.Tensor:
    texts = [read_source(p) for p in files]
    enc = tok._tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for e in enc:
        ids.extend(e.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------
# prompts


def _block_starts(lines: list[str]) -> list[int]:
    """Line indexes where a top-level def/class block (with its decorators) begins; 0 = file start."""
    starts = {0}
    for i, line in enumerate(lines):
        if line.startswith(("def ", "class ", "async def ")):
            j = i
            while j > 0 and lines[j - 1].startswith("@"):
                j -= 1
            starts.add(j)
    return sorted(starts)


def make_prompts(tok, files: list[pathlib.Path], stdlib: pathlib.Path, n: int = 64,
                 lo: int = 64, hi: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    cands: dict[pathlib.Path, list[tuple[int, list[int]]]] = {}
    for p in files:
        lines = read_source(p).splitlines(keepends=True)
        options = []
        for s in _block_starts(lines):
            ends, text, ntok = [], "", 0
            for e in range(s, len(lines)):
                text += lines[e]
                ntok = len(tok(text, add_special_tokens=False)["input_ids"])
                if ntok > hi:
                    break
                if ntok >= lo and text.endswith("\n"):
                    ends.append(e + 1)
            if ends:
                options.append((s, ends))
        if options:
            rng.shuffle(options)
            cands[p] = options
    order = sorted(cands, key=lambda p: p.as_posix())
    rng.shuffle(order)
    out: list[dict] = []
    while len(out) < n and any(cands[p] for p in order):
        for p in order:
            if len(out) >= n:
                break
            if not cands[p]:
                continue
            s, ends = cands[p].pop()
            e = rng.choice(ends)
            lines = read_source(p).splitlines(keepends=True)
            prompt = "".join(lines[s:e])
            out.append({"id": f"heldout-{len(out):03d}", "module": module_name(p, stdlib), "prompt": prompt})
    assert len(out) == n, f"only {len(out)} prompts could be built"
    return out


# --------------------------------------------------------------------------
# model / training


def build_model(vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attention_bias=False,
        use_sliding_window=False,
        dtype="float32",
    )
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).float()
    return model


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    floor = args.lr * args.min_lr_frac
    return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=x, use_cache=False).logits
    logits = logits[:, :-1].float()
    tgt = x[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.size(0), batch):
        x = windows[i:i + batch]
        total += lm_loss(model, x).item() * x.size(0)
        n += x.size(0)
    model.train()
    return total / n


def sample_batch(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()]).long()


def save_ckpt(path: pathlib.Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=pathlib.Path, default=DEFAULT_DIR / "target")
    ap.add_argument("--prompts-out", type=pathlib.Path, default=DEFAULT_DIR / "prompts.jsonl")
    ap.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path("/tmp/dflash_default_target_work"))
    ap.add_argument("--heldout-list", type=pathlib.Path, default=HELDOUT_LIST)
    ap.add_argument("--resume", action="store_true", help="resume from <work-dir>/ckpt.pt")
    ap.add_argument("--time-budget-min", type=float, default=35.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    # ---- corpus
    stdlib = stdlib_dir()
    heldout_names = load_heldout(args.heldout_list)
    train_files, held_files = iter_corpus_files(stdlib, heldout_names)
    log(f"corpus: stdlib={stdlib} train_files={len(train_files)} heldout_files={len(held_files)}")

    # ---- tokenizer (reused from the work dir when resuming)
    from transformers import AutoTokenizer

    tok_dir = args.work_dir / "tokenizer"
    if args.resume and (tok_dir / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(tok_dir)
        log(f"tokenizer: loaded from {tok_dir}")
    else:
        t0 = time.time()
        tok = train_tokenizer(train_files, args.vocab_size)
        tok.save_pretrained(tok_dir)
        tok = AutoTokenizer.from_pretrained(tok_dir)
        log(f"tokenizer: trained vocab={len(tok)} in {time.time() - t0:.1f}s")
    check_tokenizer(tok, [read_source(p) for p in held_files[:3] + train_files[:3]])
    log("tokenizer: round-trip OK")

    # ---- token streams
    t0 = time.time()
    train_tokens = tokenize_files(tok, train_files)
    held_tokens = tokenize_files(tok, held_files)
    train_bytes = sum(len(read_source(p).encode()) for p in train_files)
    held_bytes = sum(len(read_source(p).encode()) for p in held_files)
    log(f"tokens: train={train_tokens.numel()} ({train_bytes / train_tokens.numel():.2f} bytes/tok) "
        f"heldout={held_tokens.numel()} in {time.time() - t0:.1f}s")

    # ---- prompts
    prompts = make_prompts(tok, held_files, stdlib, n=args.num_prompts, seed=args.seed)
    args.prompts_out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.prompts_out, "w", encoding="utf-8") as f:
        for rec in prompts:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    log(f"prompts: wrote {len(prompts)} to {args.prompts_out} "
        f"from {len({r['module'] for r in prompts})} modules")

    # ---- fixed held-out eval windows
    eg = torch.Generator().manual_seed(1234)
    eval_windows = sample_batch(held_tokens, args.eval_windows, args.seq_len, eg)

    # ---- model & optimizer
    model = build_model(len(tok))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M params")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed_prev, history, evals = 0, 0.0, [], []
    ckpt_path = args.work_dir / "ckpt.pt"
    if args.resume and ckpt_path.exists():
        st = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, elapsed_prev = st["step"], st["elapsed"]
        history, evals = st["history"], st["evals"]
        log(f"resume: step={step} elapsed={elapsed_prev / 60:.1f}min")

    budget_s = args.time_budget_min * 60.0
    tokens_per_step = args.batch * args.seq_len
    model.train()
    t_train = time.time()
    t_log, step_log = time.time(), step
    last_loss = float("nan")
    loss_acc, n_acc = 0.0, 0

    def elapsed() -> float:
        return elapsed_prev + (time.time() - t_train)

    def checkpoint() -> None:
        save_ckpt(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                              "step": step, "elapsed": elapsed(), "history": history, "evals": evals})

    while True:
        if args.max_steps is not None and step >= args.max_steps:
            break
        if elapsed() >= budget_s:
            break
        progress = elapsed() / budget_s
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(train_tokens, args.batch, args.seq_len, gen)
        loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        last_loss = loss.item()
        loss_acc += last_loss
        n_acc += 1
        if step % args.log_every == 0 or step == 1 or step == args.max_steps:
            dt = time.time() - t_log
            tps = (step - step_log) * tokens_per_step / max(dt, 1e-9)
            avg = loss_acc / n_acc
            log(f"step {step} loss {avg:.4f} lr {lr:.2e} gnorm {gnorm.item():.2f} "
                f"tok/s {tps:.0f} s/step {dt / max(step - step_log, 1):.2f} elapsed {elapsed() / 60:.1f}min")
            history.append({"step": step, "loss": round(avg, 4), "lr": lr, "elapsed_s": round(elapsed(), 1)})
            t_log, step_log, loss_acc, n_acc = time.time(), step, 0.0, 0
        if step % args.eval_every == 0:
            hl = evaluate(model, eval_windows, args.batch)
            evals.append({"step": step, "heldout_loss": round(hl, 4)})
            log(f"eval step {step} heldout_loss {hl:.4f}")
        if step % args.ckpt_every == 0:
            checkpoint()

    checkpoint()
    final_train = history[-1]["loss"] if history else last_loss
    # average train loss over a few fixed-size batches for a less noisy final number
    held_loss = evaluate(model, eval_windows, args.batch)
    evals.append({"step": step, "heldout_loss": round(held_loss, 4)})
    log(f"final: step {step} train_loss {final_train:.4f} heldout_loss {held_loss:.4f}")

    # ---- save
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out_dir, safe_serialization=True)
    tok.save_pretrained(args.out_dir)
    # transformers 5 names its class TokenizersBackend, unknown to transformers 4.x (the public
    # DFlash reference among its users); PreTrainedTokenizerFast loads the same tokenizer in both
    tok_cfg_path = pathlib.Path(args.out_dir) / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    # verify the saved artefacts load back
    from transformers import AutoModelForCausalLM

    tok2 = AutoTokenizer.from_pretrained(args.out_dir)
    check_tokenizer(tok2, [read_source(p) for p in held_files[:2]])
    m2 = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    with torch.no_grad():
        reload_loss = lm_loss(m2, eval_windows[:4]).item()
    log(f"reload check: loss on 4 eval windows {reload_loss:.4f}")

    size = sum(p.stat().st_size for p in args.out_dir.iterdir() if p.is_file())
    info = {
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "args": {k: recorded_path(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "wall_time_s": round(time.time() - t_start, 1),
        "train_time_s": round(elapsed(), 1),
        "final_train_loss": final_train,
        "heldout_loss": round(held_loss, 4),
        "eval_history": evals,
        "loss_history": history,
        "params": n_params,
        "out_dir_bytes": size,
        "corpus": {
            "stdlib": recorded_path(stdlib),
            "python": sys.version.split()[0],
            "heldout_modules": heldout_names,
            "train_files": len(train_files),
            "heldout_files": len(held_files),
            "train_bytes": train_bytes,
            "heldout_bytes": held_bytes,
            "train_tokens": int(train_tokens.numel()),
            "heldout_tokens": int(held_tokens.numel()),
        },
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "tokenizers_version": __import__("tokenizers").__version__,
    }
    with open(args.out_dir / "training_log.json", "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    log(f"saved to {args.out_dir} ({size / 1e6:.1f} MB) total wall {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
