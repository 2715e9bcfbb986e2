"""Every config under configs/ composes with Hydra's compose API and every `_target_`
instantiates (on tiny models); launcher configs compose without their plugins."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
from pathlib import Path

import pytest
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from experiments.components import make_acceptance, make_drafter
from experiments.datasets import Dataset
from experiments.results import point_dirname
from specdec.decode.acceptance import RULES, AcceptanceRule
from specdec.decode.drafters import DRAFTERS, Drafter
from specdec.decode.schedules import Schedule
from tests.experiments.conftest import drafter_overrides

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ["target", "draft", "accept", "schedule", "dataset", "experiment"]
OFFLINE_DRAFTERS = ("ngram", "layerskip", "early_exit")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_groups_have_the_documented_options():
    assert {"none", "ngram", "layerskip", "early_exit", "model", "smollm2_135m"} <= set(
        options("draft")
    )
    assert set(options("accept")) == {"greedy", "speculative", "threshold", "typical"}
    assert {"sweep_threshold", "sweep_typical"} <= set(options("experiment"))
    assert set(options("schedule")) == {"constant", "heuristic", "confidence"}
    assert {"specbench_mini", "file"} <= set(options("dataset"))
    assert {"sweep_k", "sweep_threshold", "pairings"} <= set(options("experiment"))
    assert {"parallel", "slurm", "slurm_local"} <= set(options("hydra/launcher"))


def test_default_config_has_the_documented_keys(compose_cfg):
    cfg = compose_cfg()
    for key in (
        "gen.max_new_tokens",
        "gen.temperature",
        "spec.k",
        "dataset.limit",
        "device",
        "dtype",
        "seed",
    ):
        assert OmegaConf.select(cfg, key, throw_on_missing=False) is not None, key
    assert cfg.draft.kind == "datastore" and cfg.draft.corpus == "replies"
    assert cfg.target.model == "smollm2-135m"
    assert cfg.schedule.k == cfg.spec.k


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS if g != "experiment" for o in options(g)]
)
def test_every_option_composes(compose_cfg, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if "_target_" in cfg[group]:
        assert importlib.util.find_spec(cfg[group]._target_.rsplit(".", 1)[0]) is not None


@pytest.mark.parametrize("name", options("experiment"))
def test_experiments_are_global_sweeps_over_existing_options(compose_cfg, name):
    text = (CONFIGS / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert "python -m experiments.run -m experiment=" in text  # the command, in the header
    cfg = compose_cfg([f"experiment={name}"], hydra=True)
    assert cfg.name == name
    params = cfg.hydra.sweeper.params
    assert params
    for key, values in params.items():
        if key in GROUPS:  # a group sweep names options that exist
            for v in str(values).split(","):
                assert v in options(key), (key, v)
    # every point composes: each group choice with each value of the other keys
    groups = {k: str(v).split(",") for k, v in params.items() if k in GROUPS}
    others = {k: str(v).split(",") for k, v in params.items() if k not in GROUPS}
    for choice in itertools.product(*groups.values()):
        over = [f"experiment={name}", *(f"{k}={v}" for k, v in zip(groups, choice))]
        over += [f"{k}={v[0]}" for k, v in others.items()]
        point = compose_cfg(over)
        for k in others:
            assert OmegaConf.select(point, k) is not None, (choice, k)
        OmegaConf.to_container(point, resolve=True)


def test_experiment_grids(compose_cfg):
    sweep_k = compose_cfg(["experiment=sweep_k"], hydra=True).hydra.sweeper.params
    assert [int(k) for k in sweep_k["spec.k"].split(",")] == [1, 2, 3, 4, 6, 8]
    assert set(sweep_k.draft.split(",")) == set(OFFLINE_DRAFTERS)
    lossy = {}  # threshold's tau and typical's epsilon over the same grid, greedy decoding
    for name, key in (("sweep_threshold", "accept.tau"), ("sweep_typical", "accept.epsilon")):
        thr = compose_cfg([f"experiment={name}"], hydra=True)
        lossy[thr.hydra.sweeper.params.accept] = thr.hydra.sweeper.params[key]
        assert len(thr.hydra.sweeper.params[key].split(",")) >= 4
        assert thr.gen.temperature == 0.0
    assert set(lossy) == {"threshold", "typical"}
    assert lossy["threshold"] == lossy["typical"]
    pairs = compose_cfg(["experiment=pairings"], hydra=True).hydra.sweeper.params
    drafts = {
        compose_cfg(["experiment=pairings", f"pairing={p}"]).draft.kind
        for p in pairs.pairing.split(",")
    }
    assert set(OFFLINE_DRAFTERS) <= drafts


def test_output_folders(compose_cfg):
    cfg = compose_cfg(["experiment=sweep_k"], hydra=True)
    assert cfg.hydra.sweep.dir == "outputs/multirun/sweep_k"  # stable: a rerun resumes
    assert (
        OmegaConf.to_container(cfg.hydra.sweep)["subdir"]
        == "${point_dirname:${hydra.overrides.task}}"
    )
    assert (
        point_dirname(["spec.k=2", "draft=ngram", "experiment=sweep_k"]) == "draft=ngram,spec.k=2"
    )
    assert point_dirname(["target.model=/models/SmolLM2-360M/", "+x=1"]) == (
        "+x=1,target.model=SmolLM2-360M"
    )
    assert point_dirname([]) == ""
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher")
    assert cfg.hydra.job.chdir is False


# -- every _target_ instantiates ------------------------------------------------------------
def test_targets_instantiate(compose_cfg, tiny_models, prompt_file, tmp_path):
    target_dir, draft_dir = tiny_models
    base = [f"target.model={target_dir}", "target=local"]
    cfg = compose_cfg([*base, "dataset=file", f"dataset.path={prompt_file}"])
    model, tok = instantiate(cfg.target)
    assert model.config.n_layers == 2 and tok.vocab_size == model.config.vocab_size
    ds = instantiate(cfg.dataset)
    assert isinstance(ds, Dataset) and len(ds) == 4
    assert (
        len(instantiate(compose_cfg(["dataset=specbench_mini", "dataset.limit=0"]).dataset)) == 48
    )

    for name in options("schedule"):
        sched = instantiate(compose_cfg([f"schedule={name}", "spec.k=3"]).schedule)
        assert isinstance(sched, Schedule) and sched.k == 3 and sched.name == name

    for name in options("draft"):
        over = [*base, f"draft={name}"]
        over += drafter_overrides(name, model, tok, draft_dir, tmp_path / name)
        dcfg = compose_cfg(over).draft
        if name == "none":
            assert "_target_" not in dcfg
            continue
        drafter = make_drafter(dcfg, model, tok)
        assert isinstance(drafter, get_object(dcfg._target_))
        assert drafter.name == dcfg.kind and DRAFTERS[dcfg.kind] is type(drafter)

    for name in options("accept"):
        acfg = compose_cfg([f"accept={name}"]).accept
        rule = make_acceptance(acfg)
        assert type(rule) is get_object(acfg._target_) is RULES[acfg.rule]
        assert rule.name == acfg.rule == name

    cb = compose_cfg(hydra=True).hydra.callbacks.sweep_table
    assert instantiate(cb).on_multirun_end is not None


def _targets(text: str) -> list[str]:
    return [
        line.split(":", 1)[1].split("#")[0].strip()
        for line in text.splitlines()
        if line.strip().startswith("_target_:")
    ]


def test_every_target_is_a_real_object(compose_cfg):
    """Every `_target_` under configs/ (launcher plugins aside: tested below) imports; those
    of drafters and rules are registered classes; each instantiates (test above), and every
    group option with one is instantiated there."""
    found = {}
    for path in sorted(CONFIGS.rglob("*.yaml")):
        if "launcher" in path.parts:
            continue
        for t in _targets(path.read_text()):
            found[str(path.relative_to(CONFIGS))] = get_object(t)
    assert len(found) >= 16
    for rel, obj in found.items():
        group = rel.split("/")[0]
        if group == "draft":
            assert isinstance(obj, type) and issubclass(obj, Drafter), rel
            assert obj in DRAFTERS.values(), rel
        elif group == "accept":
            assert isinstance(obj, type) and issubclass(obj, AcceptanceRule), rel
            assert obj in RULES.values(), rel
        elif group == "schedule":
            assert isinstance(obj, type) and issubclass(obj, Schedule), rel
        else:
            assert callable(obj), rel
    # the embedded target inherits every key from target/local and sets the model
    local = compose_cfg(["target=local"]).target
    embedded = compose_cfg().target
    assert OmegaConf.is_missing(local, "model") and embedded.model == "smollm2-135m"
    assert set(local) == set(embedded) and local._target_ == embedded._target_
    text = (CONFIGS / "target" / "smollm2_135m.yaml").read_text()
    assert "- local" in text and "_target_" not in text


# -- launchers -------------------------------------------------------------------------------
LAUNCHERS = {
    "parallel": ("hydra_plugins.hydra_joblib_launcher", "config", "JobLibLauncherConf"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "config", "SlurmQueueConf"),
    "slurm_local": ("hydra_plugins.hydra_submitit_launcher", "config", "LocalQueueConf"),
}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_configs_compose_without_plugins(compose_cfg, name):
    cfg = compose_cfg([f"hydra/launcher={name}"], hydra=True)
    assert cfg.hydra.launcher._target_.startswith("hydra_plugins.")


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_configs_match_the_plugins(compose_cfg, name):
    """Where the plugin is installed: same fields as its own config, and it instantiates."""
    package, module, conf = LAUNCHERS[name]
    pytest.importorskip(package)
    plugin_conf = getattr(importlib.import_module(f"{package}.{module}"), conf)
    fields = {f.name for f in dataclasses.fields(plugin_conf)}
    cfg = compose_cfg([f"hydra/launcher={name}"], hydra=True)
    assert set(cfg.hydra.launcher) == fields
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ in cfg.hydra.launcher._target_


def test_plugin_launcher_names_compose_where_installed(compose_cfg):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    for name in ("submitit_slurm", "submitit_local", "joblib"):
        cfg = compose_cfg([f"hydra/launcher={name}"], hydra=True)
        assert cfg.hydra.launcher._target_.startswith("hydra_plugins.")
