"""``dflash-torch train``: train a DFlash drafter for a target model."""

from __future__ import annotations

import argparse

from ..cli import add_chat_template_kwargs_arg, path_arg
from .trainer import ARCHS, DFLASH2_FIELDS, TrainConfig, Trainer, check_config


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(sub) -> None:
    """Add the ``train`` subcommand to the ``dflash-torch`` parser."""
    p = sub.add_parser(
        "train", help="train a DFlash drafter for a target model",
        description="Train a DFlash drafter (random anchors, block attention mask, decay-weighted loss; "
                    "DFlash paper sec. 4.2), or with --arch dflash2 a DFlash 2 drafter (grouped dynamic convolutions "
                    "and a candidate selector, plus the selector loss), and save it in the published checkpoint format. "
                    "Training runs on the CPU: the target is loaded in float32 (about 4 bytes a parameter of RAM, "
                    "e.g. 32 GB for an 8B target; a target whose float32 weights exceed the available memory is "
                    "refused before it loads); the drafter trains there too.",
    )
    d = TrainConfig.__dataclass_fields__
    p.add_argument("--target", type=path_arg, required=True, help="target checkpoint dir or HF id (ORG/NAME[@REVISION]: a branch, tag or commit), downloaded unless cached")
    p.add_argument("--data", type=path_arg, required=True, nargs="+", help="text files (a document each), JSONL or .json files of {'text'} / {'messages'} "
                        "records (a .json: an array of them, one, or JSON Lines), or directories (every non-hidden file "
                        "below them as above; there, a .json file that is not records, e.g. a package.json, is a text document, "
                        "a file that is not UTF-8 text is skipped, but a .jsonl file, or a .json file of records, "
                        "is data and is refused where it is not valid, and this run's --out and --work-dir are left out)")
    p.add_argument("--out", type=path_arg, required=True, help="output drafter directory (config.json + model.safetensors)")
    p.add_argument("--work-dir", type=path_arg, default=None, help="data cache and resumable checkpoint (default: OUT/train_work)")
    p.add_argument("--arch", choices=ARCHS, default=d["arch"].default,
                   help="dflash (DFlashDraftModel, default) or dflash2 (DFlash2DraftModel)")
    p.add_argument("--num-layers", type=int, default=None, help="drafter layers (default 2)")
    p.add_argument("--block-size", type=int, default=None, help="block size B (default 16)")
    p.add_argument("--init-from-target", action="store_true", help="start the drafter layers from the target's last layers")
    p.add_argument("--init-from", type=path_arg, default=None, metavar="DRAFTER",
                   help="start from this DFlash drafter, a dir or HF id, ORG/NAME[@REVISION] (its shape and weights; with --arch dflash2 a DFlash (v1) drafter's "
                        "backbone, with identity convolutions and small random codebooks)")
    p.add_argument("--selector-loss-weight", type=float, default=None,
                   help="dflash2: weight of the selector loss (default 1)")
    p.add_argument("--conv-kernel-size", type=int, default=None, help="dflash2: convolution taps (default 2)")
    p.add_argument("--conv-group-size", type=int, default=None,
                   help="dflash2: channels per dynamic-tap group (default 16)")
    p.add_argument("--selector-rank", type=int, default=None, help="dflash2: codebook rank (default 256)")
    p.add_argument("--selector-top-k", type=int, default=None,
                   help="dflash2: candidates per draft slot (default 16)")
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="target layers to read, e.g. 1,3 (default: the DFlash rule)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="drafter MLP width (default: the target's dense MLP width; for a target whose every MLP is a "
                        "mixture of experts, the width a token passes through: top-k x the expert width, e.g. "
                        "num_experts_per_tok x moe_intermediate_size, plus the shared expert's)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id (default: the tokenizer's mask token or <|MASK|>, else the first embedding row "
                        "that is no token id of the tokenizer)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (and/or --time-budget-min)")
    p.add_argument("--time-budget-min", type=float, default=None, help="stop after this many minutes of training, its evaluations included "
                   "(cumulative over resumes; the data preparation is not counted)")
    p.add_argument("--batch", type=int, default=d["batch"].default, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=d["seq_len"].default, help="tokens per sequence (default 512)")
    p.add_argument("--anchors-per-seq", type=int, default=d["anchors_per_seq"].default, help="blocks per sequence (default 64)")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"].default,
                   help=f"linear learning-rate warm-up steps (default {d['warmup_steps'].default})")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"].default,
                   help=f"AdamW weight decay (default {d['weight_decay'].default})")
    p.add_argument("--grad-clip", type=float, default=d["grad_clip"].default,
                   help=f"gradient norm clip (default {d['grad_clip'].default})")
    p.add_argument("--gamma", type=float, default=None, help="loss decay of slot k: exp(-(k-1)/gamma) (default 7 * B / 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, data order and anchors (default 0)")
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true", help="replace a drafter already in --out / a checkpoint in the work dir")
    p.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="add N sequences continued greedily by the target itself from prompts of the data")
    p.add_argument("--self-distill-batch", type=int, default=d["self_distill_batch"].default,
                   help=f"prompts the target continues at once (default {d['self_distill_batch'].default})")
    p.add_argument("--prefix-min", type=int, default=None,
                   help=f"shortest length drawn for a self-distill text prompt (tokens, default {d['prefix_min'].default}; "
                        "at most --seq-len - 16): each is drawn from --prefix-min to --prefix-max tokens from a line "
                        "start, then cut back to its last line end, and kept where at least half --prefix-min tokens "
                        "remain, so a prompt may be as short as --prefix-min / 2 (a chat prompt is its conversation "
                        "up to the last reply, whatever these)")
    p.add_argument("--prefix-max", type=int, default=None,
                   help=f"longest length drawn for a self-distill text prompt (tokens, default {d['prefix_max'].default}, "
                        "or --seq-len - 16 where that is less)")
    add_chat_template_kwargs_arg(p, "for rendering the chat data and the self-distill prompts taken from it")
    p.add_argument("--raw-fraction", type=float, default=d["raw_fraction"].default,
                   help="share of batch rows from the raw corpus when examples exist (default 0.25)")
    p.add_argument("--val-seqs", type=int, default=d["val_seqs"].default, help=f"sequences set apart for validation: val_loss and val_tau, the acceptance length of greedy decoding replayed along them (exact on --self-distill rows; on other text a lower bound, drafts counted where the text holds the target's greedy choice) (0: none; default {d['val_seqs'].default})")
    p.add_argument("--eval-every", type=int, default=d["eval_every"].default,
                   help=f"steps between validations (default {d['eval_every'].default})")
    p.add_argument("--ckpt-every", type=int, default=d["ckpt_every"].default,
                   help=f"steps between resumable checkpoints (default {d['ckpt_every'].default})")
    p.add_argument("--threads", "--num-threads", dest="num_threads", type=int, default=None, help="torch CPU threads, at most the CPUs this process may use (default: torch's choice)")
    p.add_argument("--no-autocast", action="store_true", help="train in float32 instead of bf16 autocast")
    p.add_argument("--save-dtype", default="bfloat16", help="dtype of the saved weights: bfloat16 (default), float32 or float16 (auto: float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_train)


# the options whose flags default to None, "not given" (a TrainConfig holds their defaults): check_config refuses some
# where given (a DFlash 2 option without --arch dflash2, --num-layers with --init-from, a long --prefix-max)
GIVEN_OPTIONS = ("num_layers", "block_size", "prefix_min", "prefix_max", *DFLASH2_FIELDS)


def _train(args: argparse.Namespace) -> int:
    d = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(
        target=args.target, data=args.data, out=args.out, work_dir=args.work_dir, arch=args.arch,
        init_from_target=args.init_from_target, init_from=args.init_from,
        target_layer_ids=args.target_layer_ids, intermediate_size=args.intermediate_size,
        mask_token_id=args.mask_token_id, steps=args.steps, time_budget_min=args.time_budget_min, batch=args.batch,
        seq_len=args.seq_len, anchors_per_seq=args.anchors_per_seq, lr=args.lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma, seed=args.seed, resume=args.resume,
        overwrite=args.overwrite, self_distill=args.self_distill, self_distill_batch=args.self_distill_batch,
        raw_fraction=args.raw_fraction, val_seqs=args.val_seqs, eval_every=args.eval_every,
        ckpt_every=args.ckpt_every, num_threads=args.num_threads, autocast=not args.no_autocast,
        save_dtype=args.save_dtype, progress=not args.no_progress, chat_template_kwargs=args.chat_template_kwargs,
        **{k: d[k].default if getattr(args, k) is None else getattr(args, k) for k in GIVEN_OPTIONS},
    )
    from ..cli import terminate_as_interrupt

    # (the refusals only the command line can tell: of the flags given, where a TrainConfig holds their defaults;
    # Trainer.run checks the rest, and the directories, for the Python API too)
    check_config(cfg, {k for k in GIVEN_OPTIONS if getattr(args, k) is not None})
    # (SIGTERM, what timeout, docker stop, systemd and Slurm send, saves a checkpoint as a Ctrl-C does, then exits 143:
    # it killed the run with nothing saved)
    with terminate_as_interrupt():
        Trainer(cfg, flags=args.option_flags).run()
    return 0
