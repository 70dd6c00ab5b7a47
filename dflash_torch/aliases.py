"""Names other libraries and tools give this project's options (transformers, OpenAI,
vLLM, SGLang, TGI, llama.cpp), by the option that does their work here: the hints of the
Python API's unknown keyword arguments (``max_length``: did you mean ``max_new_tokens``?)
and of the CLI's unknown flags (``--draft-model``: did you mean ``--draft``?) come from
this one table, so that both name the same option."""

from __future__ import annotations

# Arguments of other libraries' generate / LLM calls (transformers, OpenAI, vLLM, TGI) that users bring, by the name
# of this API's argument that does their work (the first of those names that the method takes: ``draft`` of
# from_pretrained, ``drafter`` of the constructor; a request given one of from_pretrained's is told to load with it)
# and a note that says how it differs; no name: a note alone, of what a request (generate, stream, generate_batch)
# does instead. Looked up before the closest spelling (:func:`dflash_torch.engine._hint`; the CLI's flags:
# :func:`flag_hint`), which took ``stop_strings`` for ``stop_token_ids`` and ``draft_model`` for ``draft_mode``. A name that does not do the same work here (vLLM's
# allowed_token_ids, transformers' length_penalty) is left out: it gets no hint rather than a wrong one.
_SAMPLES = "for n samples of a prompt, pass it n times: generate_batch([prompt] * n, temperature=...) with temperature > 0, " \
           "and seed a list of n seeds to make them reproducible"
_UNPADDED = "not needed: each prompt is decoded as it is, without padding"
_IDS = "token ids are a prompt as they are: a list of ints, or a 1-D tensor (a tokenizer's input_ids[0])"
_GENERATED = "it counts the generated tokens only, not the prompt's"
_BLOCK = "tokens per block: each round drafts block_size - 1 tokens"
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    **dict.fromkeys(("stop_strings", "stop_sequences"), (("stop",), "")),
    "eos_token_id": (("stop_token_ids",), "its ids stop generation beside the model's EOS ids"),
    "generator": (("seed",), "it takes an int, not a torch.Generator"),
    "random_seed": (("seed",), ""),
    "max_length": (("max_new_tokens",), _GENERATED),
    **dict.fromkeys(("max_tokens", "max_completion_tokens"), (("max_new_tokens",), "")),
    "min_length": (("min_tokens",), _GENERATED),
    "min_new_tokens": (("min_tokens",), ""),
    "do_sample": (("temperature",), "temperature > 0 samples; the default, 0, is greedy"),
    **dict.fromkeys(("n", "num_return_sequences"), ((), _SAMPLES)),
    **dict.fromkeys(("pad_token_id", "attention_mask"), ((), _UNPADDED)),
    "streamer": ((), "generate's on_chunk takes a function, called with each StreamChunk; stream yields them"),
    **dict.fromkeys(("input_ids", "inputs", "prompt_token_ids"), (("prompt", "prompts"), _IDS)),
    "messages": (("prompt", "prompts"), "a conversation, a list of message dicts, is a prompt as it is"),
    "top_logprobs": (("logprobs",), ""),
    "top_n_tokens": (("logprobs",), "it takes the number of most likely tokens reported at each position"),
    "response_format": (("structured_output",), "as {'json': response_format['json_schema']['schema']}, or "
                                                "{'json_object': True} for type json_object"),
    "guided_json": (("structured_output",), "as {'json': schema}"),
    "guided_regex": (("structured_output",), "as {'regex': pattern}"),
    "guided_choice": (("structured_output",), "as {'choice': [...]}"),
    "guided_grammar": (("structured_output",), "as {'grammar': lark_grammar}"),
    **dict.fromkeys(("draft", "draft_model", "draft_dir", "draft_path", "drafter", "drafter_dir", "drafter_path",
                     "draft_model_path", "speculative_model", "assistant_model"), (("draft", "drafter"), "")),
    **dict.fromkeys(("target_only", "no_drafter"), (("no_draft",), "")),
    **dict.fromkeys(("model", "model_name", "model_path", "model_dir", "model_name_or_path",
                     "pretrained_model_name_or_path", "target_model", "target_dir"), (("target",), "")),
    **dict.fromkeys(("num_speculative_tokens", "num_assistant_tokens", "gamma"), (("block_size",), _BLOCK)),
    "torch_dtype": (("dtype",), ""),
    "device_map": (("device",), "one device: 'cpu', 'cuda' or 'cuda:N'"),
    **dict.fromkeys(("max_model_len", "max_seq_len"), (("max_context",), "")),
    "max_num_seqs": (("max_batch_size",), ""),
    **dict.fromkeys(("enable_prefix_caching", "prefix_caching"), (("reuse_prefix",), "")),
    # (the servers' and llama.cpp's flags, as keywords: n_predict is llama.cpp's --n-predict)
    "n_predict": (("max_new_tokens",), ""),
    **dict.fromkeys(("ctx_size", "context_length", "max_total_tokens"), (("max_context",), "")),
    **dict.fromkeys(("model_draft", "speculative_draft_model_path"), (("draft", "drafter"), "")),
    **dict.fromkeys(("draft_max", "speculative_num_draft_tokens"), (("block_size",), _BLOCK)),
    "max_running_requests": (("max_batch_size",), ""),
    "served_model_name": (("model_name",), ""),
    # (names whose work nothing here does the same way: no hint, rather than the closest spelling's, which named
    # max_new_tokens for TGI's max_input_tokens and vLLM's max_num_batched_tokens: trial-299)
    **dict.fromkeys(("max_input_tokens", "max_input_length", "max_num_batched_tokens", "max_batch_prefill_tokens",
                     "max_batch_total_tokens", "ubatch_size", "draft_min", "draft_p_min", "lora_modules", "max_time",
                     "top_a", "num_train_epochs"), ((), "")),
}


# The CLI's own: flags where the API's option is an argument of another shape (structured_output), and notes
# that read as a flag's (the API's speak of Python: generate_batch, torch.Generator).
FLAGS: dict[str, tuple[str, ...]] = {
    "guided_json": ("--json-schema",), "guided_regex": ("--regex",), "guided_choice": ("--choice",),
    "guided_grammar": ("--grammar",), "response_format": ("--json-schema", "--json-object"),
    # (a trainer's batch; llama.cpp's --batch-size is tokens per step, not serve's sequences: trial-303)
    "batch_size": ("--batch",),
    # (token ids: no flag takes them, --prompt takes text: trial-303)
    **dict.fromkeys(("input_ids", "inputs", "prompt_token_ids"), ()), "dataset": ("--data",), "train_data": ("--data",),
    "learning_rate": ("--lr",), "output_dir": ("--out",), "save_steps": ("--ckpt-every",),
    "max_steps": ("--steps",), "eval_steps": ("--eval-every",),
    # (trainers' names for the training sequence length; for inference, the context's)
    **dict.fromkeys(("max_seq_len", "max_seq_length"), ("--max-context", "--seq-len")),
    "max_grad_norm": ("--grad-clip",), **dict.fromkeys(("per_device_train_batch_size", "train_batch_size"), ("--batch",)),
}
# Notes for names no flag here takes (a revision goes with the model's id): shown by any command that has the
# flags they name.
FLAG_ADVICE: dict[str, tuple[str, str]] = {
    "revision": ("--target", "a revision is given with the model's Hugging Face id: --target ORG/NAME@REVISION "
                             "(--draft too)"),
    "chat_template": ("--chat-template-kwargs", "the model's own chat template is used (its tokenizer's); "
                                                "--chat-template-kwargs sets its variables"),
    "speculative_config": ("--draft", "the drafter is --draft, its block size --block-size"),
}
FLAG_NOTES = {
    **dict.fromkeys(("max_length", "min_length"), _GENERATED),
    "do_sample": "a --temperature above 0 samples; the default, 0, is greedy",
    "device_map": "one device: cpu, cuda or cuda:N",
    **dict.fromkeys(("num_speculative_tokens", "num_assistant_tokens", "gamma", "draft_max",
                     "speculative_num_draft_tokens"), "tokens per block: each round drafts the block size - 1 tokens"),
}


def flag_hint(unknown: str, flags) -> str | None:
    """The hint for the CLI's ``unknown`` flag (``--name`` or ``--name=value``, any case,
    hyphens or underscores) that another tool names so: ``"did you mean --max-new-tokens? (it
    counts the generated tokens only, not the prompt's)"``, with those of its flags that are
    among the command's ``flags`` (strings such as ``"--draft"``) and its note; for prefix
    caching asked of a command with ``--no-prefix-reuse``, that it is on by default (and
    :data:`FLAG_ADVICE`'s note where the command has the flag it names); ``""``
    for another tool's name whose work the command does not do (``--n``: no hint, rather
    than the flags it begins, ``--no-draft``); ``None`` for a name no table holds (a typo,
    perhaps: the caller looks for close spellings)."""
    name = unknown.split("=", 1)[0].removeprefix("--").lower().replace("-", "_")
    if name in ("enable_prefix_caching", "prefix_caching") and "--no-prefix-reuse" in flags:
        return "prefix reuse is on by default (--no-prefix-reuse turns it off)"
    if name in FLAG_ADVICE:
        return FLAG_ADVICE[name][1] if FLAG_ADVICE[name][0] in flags else ""
    names = FLAGS[name] if name in FLAGS else ["--" + n.replace("_", "-") for n in ALIASES.get(name, ((), ""))[0]]
    found = [f for f in names if f in flags]
    if not found:
        return "" if name in ALIASES or name in FLAGS else None
    note = FLAG_NOTES.get(name)
    return "did you mean " + " or ".join(found) + (f"? ({note})" if note else "?")
