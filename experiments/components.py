"""What the experiment runner builds from configs/: models (loaded once per process),
drafters and acceptance rules (from their registries: a config's `_target_` names the
registered class, its other keys are the constructor's arguments), and `instantiate`
that surfaces the library's user errors as they are."""

from __future__ import annotations

import logging

from hydra.errors import InstantiationException
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from specdec.decode.acceptance import AcceptanceRule, make_rule
from specdec.decode.drafters import Drafter, build_drafter, drafter_class
from specdec.errors import SpecDecError

log = logging.getLogger(__name__)

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
    from specdec.models import batch_invariant, cpu_compile, cpu_linear
    from specdec.models.load import load_model as load

    if not isinstance(resident_layers, int):
        resident_layers = tuple(int(i) for i in resident_layers)
    key = (
        str(model),
        str(dtype),
        # process-wide modes the runner sets per point: a sweep over them loads a model each
        cpu_linear.resolve_mode(),
        batch_invariant.resolve_setting(),
        cpu_compile.resolve_setting(),
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


def _split(cfg: DictConfig, name_key: str, group: str) -> tuple[str, str | None, dict]:
    """A drafter / rule config -> (registered name, _target_, constructor options)."""
    try:
        options = OmegaConf.to_container(cfg, resolve=True)
    except MissingMandatoryValue as e:
        raise SpecDecError(f"missing value: set {group}.{e.key}=... on the command line") from e
    return options.pop(name_key), options.pop("_target_", None), options


def _check_target(group: str, name: str, target: str | None, cls: type) -> None:
    """The config's `_target_` must be the class registered under its name."""
    try:
        named = get_class(target) if target is not None else None
    except (ImportError, ValueError) as e:
        raise SpecDecError(f"{group} config {name!r}: cannot import _target_ {target}") from e
    if named is not cls:
        raise SpecDecError(
            f"{group} config {name!r}: _target_ is {target}, but {name!r} is registered as "
            f"{cls.__module__}.{cls.__qualname__}"
        )


def make_drafter(cfg: DictConfig, target, tokenizer=None) -> Drafter:
    """draft config -> the drafter for `target` (`tokenizer`: the target's, for a draft
    model of another vocabulary). `kind` is the registered name, `_target_` the class
    registered under it, the other keys its options."""
    kind, target_name, options = _split(cfg, "kind", "draft")
    cls = drafter_class(kind)
    _check_target("draft", kind, target_name, cls)
    return build_drafter(cls, target, tokenizer, **options)


def make_acceptance(cfg: DictConfig) -> AcceptanceRule:
    """accept config -> the rule. `rule` is the registered name, `_target_` the class
    registered under it, the other keys its parameters (validated here)."""
    rule, target_name, params = _split(cfg, "rule", "accept")
    try:
        built = make_rule(rule, **params)
    except SpecDecError as e:
        raise SpecDecError(f"accept: {e}") from e
    _check_target("accept", rule, target_name, type(built))
    return built


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
