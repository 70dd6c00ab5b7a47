from dflash_torch import DFlashEngine


def test_engine_generates_same_as_target_only(tiny_pair):
    target, drafter = tiny_pair
    spec = DFlashEngine.from_pretrained(target, drafter)
    base = DFlashEngine.from_pretrained(target, no_draft=True)
    a = spec.generate("def f(x):", max_new_tokens=40, ignore_eos=True)
    b = base.generate("def f(x):", max_new_tokens=40, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    assert a.finish_reason == "length"
    assert a.text == spec.decode(a.token_ids)
