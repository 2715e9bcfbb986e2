"""Drafter and acceptance-rule registries: a drafter and a lossy rule defined here (one
class each, nothing else edited) run through the engine, the CLI options and the config
builders; parameters are validated when rules and drafters are built."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from experiments.components import make_acceptance, make_drafter
from specdec.cli.speculative_options import build_speculative
from specdec.decode.acceptance import RULES, PrefixAcceptance, make_rule, register_rule
from specdec.decode.drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftRequest,
    LayerSkipDrafter,
    register_drafter,
)
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.generate import build_parser
from specdec.models.load import load_model


@register_drafter("test_repeat")
class RepeatDrafter(Drafter):
    """Proposes the pending token `copies` times (then padding); counts its own accepted
    drafts from the engine's feedback."""

    def __init__(self, copies: int = 2):
        if copies < 1:
            raise SpecDecError(f"copies must be >= 1, got {copies}")
        self.copies = copies
        self.accepted = 0

    def propose(self, request: DraftRequest) -> Draft:
        B, dev = len(request.history), request.k.device
        n = torch.clamp(request.k, max=self.copies)  # [B]
        width = max(1, int(request.k.max()))
        last = torch.tensor([h[-1] for h in request.history], device=dev)
        tokens = last[:, None].expand(B, width).clone()  # [B, width]
        return Draft(tokens, None, n)

    def commit(self, n_accepted: torch.Tensor) -> None:
        self.accepted += int(n_accepted.sum())


@register_rule("test_top_n")
class TopNAcceptance(PrefixAcceptance):
    """Lossy: accept a draft if it is among the target's n most likely tokens."""

    def __init__(self, n: int = 2):
        if not isinstance(n, int) or n < 1:
            raise SpecDecError(f"top-n acceptance needs an integer n >= 1, got {n!r}")
        self.n = n

    def accepts(self, draft_p, p):
        nth = p.topk(min(self.n, p.shape[-1]), dim=-1).values[..., -1]  # [B, k]
        return draft_p >= nth


TEXTS = ("the the the the", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 =")


@pytest.fixture(scope="module")
def target(tiny_dir):
    """A 2-layer random Llama and its tokenizer."""
    return load_model(str(tiny_dir("llama", False, layers=2)))


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_registered_drafter_is_lossless_under_greedy_acceptance(target):
    model, tok = target
    prompts = _prompts(tok)
    ref = generate(model, prompts, 20).tokens
    assert DRAFTERS["test_repeat"] is RepeatDrafter and RepeatDrafter.name == "test_repeat"
    for k in (1, 3):
        drafter = RepeatDrafter(copies=2)
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
        res = dec.generate(prompts, 20)
        assert res.tokens == ref
        st = res.stats
        assert st["drafter"] == "test_repeat"
        assert 0 < st["drafted"] <= st["rounds"] * min(k, 2)
        assert drafter.accepted == st["accepted"]  # the feedback the drafter owns


def test_registered_drafter_and_rule_from_cli_options_and_configs(target):
    model, tok = target
    argv = ["--prompt", "x", "--draft", "test_repeat", "--draft-opt", "copies=3"]
    argv += ["--accept", "test_top_n", "--accept-opt", "n=1"]
    dec = build_speculative(build_parser().parse_args(argv), model)
    assert isinstance(dec.drafter, RepeatDrafter) and dec.drafter.copies == 3
    assert isinstance(dec.rule, TopNAcceptance) and dec.rule.n == 1
    # top-1 acceptance under greedy decoding keeps exactly the greedy output
    prompts = _prompts(tok)
    assert dec.generate(prompts, 16).tokens == generate(model, prompts, 16).tokens

    dcfg = OmegaConf.create({"_target_": _qualname(RepeatDrafter), "kind": "test_repeat"})
    assert make_drafter(dcfg, model).copies == 2
    acfg = OmegaConf.create({"_target_": _qualname(TopNAcceptance), "rule": "test_top_n", "n": 4})
    assert make_acceptance(acfg).n == 4
    wrong = OmegaConf.create({"_target_": _qualname(TopNAcceptance), "rule": "threshold"})
    with pytest.raises(SpecDecError, match="registered as"):
        make_acceptance(wrong)
    with pytest.raises(SpecDecError, match="cannot import _target_ nope.Nope"):
        make_drafter(OmegaConf.create({"_target_": "nope.Nope", "kind": "ngram"}), model)
    with pytest.raises(SpecDecError, match="no parameter"):
        make_drafter(OmegaConf.create({**dcfg, "n_max": 2}), model)


def test_registered_lossy_rule_runs_lossy_in_the_engine(target):
    """Every token is in the top-V: all drafts accepted, whatever they are; the engine treats
    the rule as lossy (tested on p at temperature 1, replacement token greedy)."""
    model, tok = target
    V = model.config.vocab_size
    assert RULES["test_top_n"].lossy and not RULES["test_top_n"].uses_draft_probs
    dec = SpeculativeDecoder(
        model, RepeatDrafter(copies=4), "test_top_n", {"n": V}, make_schedule("constant", 4)
    )
    res = dec.generate(_prompts(tok), 17)
    assert res.stats["acceptance_rate"] == 1.0 and res.stats["accept"] == "test_top_n"
    for out, p in zip(res.tokens, _prompts(tok)):
        # independent replay: each round accepts its min(4, budget) copies of the pending
        # token, then the target's greedy token after them (budget: 17 tokens in all)
        want = generate(model, [p], 1).tokens[0]
        while len(want) < 17:
            want += [want[-1]] * min(4, 17 - len(want) - 1)
            want += generate(model, [p + want], 1).tokens[0]
        assert out == want


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("threshold", {"tau": math.nan}, r"tau in \(0, 1\], got nan"),
        ("threshold", {"tau": 0.0}, r"tau in \(0, 1\]"),
        ("threshold", {"tau": 1.5}, r"tau in \(0, 1\]"),
        ("threshold", {"tau": -0.1}, r"tau in \(0, 1\]"),
        ("typical", {"epsilon": -0.1}, r"epsilon in \(0, 1\]"),
        ("typical", {"epsilon": math.nan}, r"epsilon in \(0, 1\], got nan"),
        ("typical", {"epsilon": 0.1, "delta": math.nan}, "delta > 0"),
        ("typical", {"epsilon": 0.1, "delta": 0.0}, "delta > 0"),
        ("nope", {}, "unknown acceptance rule"),
        ("greedy", {"tau": 0.5}, "no parameter"),
    ],
)
def test_rule_parameters_are_validated_when_built(name, params, message):
    with pytest.raises(SpecDecError, match=message):
        make_rule(name, **params)


def test_rule_properties_and_defaults():
    assert RULES["greedy"].greedy_only and not RULES["greedy"].lossy
    assert RULES["speculative"].uses_draft_probs and not RULES["speculative"].lossy
    assert RULES["threshold"].lossy and RULES["typical"].lossy
    typical = make_rule("typical", epsilon=0.16)
    assert typical.delta == pytest.approx(0.4)  # delta defaults to sqrt(epsilon)
    assert make_rule("typical").params() == {"epsilon": 0.09, "delta": pytest.approx(0.3)}


@pytest.mark.parametrize("skip", ["", " ", [], ","])
def test_empty_layer_skip_set_is_an_error(target, skip):
    model, _ = target
    with pytest.raises(SpecDecError, match="skips no layer"):
        LayerSkipDrafter(model, skip=skip)


def test_cli_builds_drafters_from_names_and_paths(target, tiny_dir):
    model, _ = target

    def build(*argv):
        return build_speculative(build_parser().parse_args(["--prompt", "x", *argv]), model)

    with pytest.raises(SpecDecError, match="skips no layer"):
        build("--draft", "layerskip", "--skip", "")
    assert build("--draft", "early-exit", "--exit-layer", "1").drafter.layers == [0]
    path = str(tiny_dir("llama", False, layers=1, seed=3))
    dec = build("--draft", path, "--accept", "typical", "--typical-epsilon", "0.25")
    assert type(dec.drafter).__name__ == "ModelDrafter" and dec.drafter.model is not model
    assert dec.rule.params() == {"epsilon": 0.25, "delta": 0.3}  # the CLI's delta default
    with pytest.raises(SpecDecError, match="threshold acceptance needs tau"):
        build("--draft", "ngram", "--accept", "threshold", "--threshold", "nan")
