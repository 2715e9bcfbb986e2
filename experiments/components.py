"""The `_target_`s of configs/: models (loaded once per process), drafters, acceptance
parameters, and `instantiate` that surfaces the library's user errors as they are."""

from __future__ import annotations

import logging
import math

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from specdec.decode import cli_options
from specdec.errors import SpecDecError

log = logging.getLogger(__name__)

OFFLINE_DRAFTERS = ("ngram", "layerskip", "early_exit")
_MODELS: dict[tuple, tuple] = {}


def load_model(
    model: str,
    dtype: str = "float32",
    device: str = "cpu",
    backend: str | None = None,
    quantize: str | None = None,
    stream: bool = False,
    stream_source: str = "auto",
    resident_layers=0,
):
    """-> (Transformer, Tokenizer); a sweep's points in one process share the loaded model.
    stream=True keeps the layers off the device and copies each in right before it runs
    (specdec.models.streaming); `resident_layers` (a count or indices) stay on the device."""
    from specdec.models.load import load_model as load

    if not isinstance(resident_layers, int):
        resident_layers = tuple(int(i) for i in resident_layers)
    key = (
        str(model),
        str(dtype),
        str(device),
        backend,
        quantize,
        bool(stream),
        stream_source,
        resident_layers,
    )
    if key not in _MODELS:
        log.info("loading %s (%s, %s%s)", model, dtype, device, ", streamed" if stream else "")
        if stream:
            from specdec.models.streaming import load_streamed

            _MODELS[key] = load_streamed(
                str(model),
                dtype=dtype,
                device=device,
                backend=backend,
                quantize=quantize,
                source=stream_source,
                resident_layers=resident_layers,
            )
        else:
            _MODELS[key] = load(
                str(model), dtype=dtype, device=device, backend=backend, quantize=quantize
            )
    return _MODELS[key]


def make_drafter(
    target,
    kind: str,
    model: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    backend: str | None = None,
    quantize: str | None = None,
    **options,
):
    """A drafter for `target`: one of OFFLINE_DRAFTERS with its options, or kind=model with
    `model` a registered name, .gguf or HF directory sharing the target's tokenizer."""
    draft_model = None
    if kind == "model":
        if not model:
            raise SpecDecError("draft=model needs draft.model=<registered name, .gguf or HF dir>")
        draft_model, draft_tok = load_model(model, dtype, device, backend, quantize)
        if draft_model.config.vocab_size != target.config.vocab_size:
            raise SpecDecError(
                f"vocabulary mismatch: draft {model!r} has {draft_model.config.vocab_size} "
                f"tokens, the target {target.config.vocab_size}; pair models sharing a tokenizer"
            )
    elif kind not in OFFLINE_DRAFTERS:
        raise SpecDecError(f"unknown drafter {kind!r} (none, model, {', '.join(OFFLINE_DRAFTERS)})")
    return cli_options.make_drafter(kind, target, draft_model=draft_model, **options)


def acceptance(cfg: DictConfig) -> tuple[str, dict]:
    """accept config -> (rule, rule parameters). Typical acceptance: tau is Medusa's epsilon
    and delta defaults to sqrt(tau)."""
    rule = cfg.rule
    if rule == "threshold":
        try:
            return rule, cli_options.accept_params(rule, float(cfg.tau))
        except SpecDecError as e:
            raise SpecDecError(f"accept.tau: {e}") from e
    if rule == "typical":
        tau, delta = float(cfg.tau), cfg.get("delta")
        if delta is None:
            delta = math.sqrt(tau) if tau > 0 else 0.0  # invalid tau: the rule says why
        return rule, {"epsilon": tau, "delta": float(delta)}
    return rule, {}


def instantiate(cfg: DictConfig, **kwargs):
    """hydra.utils.instantiate, re-raising the SpecDecError it wraps and turning a missing
    mandatory value (`???`) into a user error naming the key to set."""
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(cfg, **kwargs)
    except MissingMandatoryValue as e:
        raise SpecDecError(f"missing value: set {e.full_key}=... on the command line") from e
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, SpecDecError | MissingMandatoryValue):
            cause = cause.__cause__
        if isinstance(cause, MissingMandatoryValue):
            raise SpecDecError(
                f"missing value: set {cause.full_key}=... on the command line"
            ) from e
        if cause is not None:
            raise cause from None
        raise


def missing_keys(cfg: DictConfig) -> list[str]:
    """Full keys of mandatory values (`???`) left unset in `cfg`."""
    return sorted(OmegaConf.missing_keys(cfg))
