"""specdec next to its peers on the same GGUF, prompts, new tokens and threads.

    python -m benchmarks.bench_peers [--model smollm2-135m] [--k 4] [--new-tokens 64]
        [--prompts 6] [--threads 1] [--specdec float32:dense bfloat16:native]
        [--draft replies ngram] [--hf-dtype bfloat16 float32] [--skip-hf] [--skip-llama]

Systems, each plain and with its own prompt-lookup speculative decoding (k drafted tokens):
- HF transformers: `generate` plain and assisted (`prompt_lookup_num_tokens=k`), the model
  loaded from the same GGUF (transformers dequantizes it to `--hf-dtype`);
- llama.cpp through llama-cpp-python (optional extra `peers`): plain, and
  `LlamaPromptLookupDecoding(num_pred_tokens=k)`; skipped with a message when not installed;
- specdec: plain greedy, and greedy speculative decoding with each `--draft` drafter, per
  `--specdec` mode (dtype:cpu_linear mode; a `+compile` suffix, e.g.
  bfloat16:native+compile, runs compiled steps, every shape compiled before timing). A drafter is named by its experiment config
  (configs/draft/NAME.yaml, composed as `experiments.run draft=NAME` composes it): `replies`
  (the default experiment's: prompt lookup, the run's earlier outputs, the target's reply
  store), `ngram` (prompt lookup and earlier outputs), `datastore`, `layerskip`, ...
EOS is ignored everywhere (HF: `min_new_tokens`, llama.cpp: its token generator is read for
exactly n tokens, specdec: no stop ids), so every system generates the same number of tokens.
Prompts are the first `--prompts` of the bundled Spec-Bench-style set, chat-formatted, as
token ids (identical on every side). Systems alternate prompt by prompt. Prints tok/s
(generated tokens / generation wall time, prefill included), each system's speculative
speedup over its own plain decoding, and for specdec's speculative rows the tokens per
round (per target forward after prefill). Writes benchmarks/results/peers.json + .csv.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.harness import (
    cpu_mode_model,
    environment,
    markdown_table,
    parse_mode_spec,
    save_results,
)
from specdec import validation
from specdec.cli import ArgumentParser, user_errors
from specdec.errors import SpecDecError
from specdec.models.cpu_linear import cpu_features

LLAMA_INSTALL = (
    'pip install -e ".[peers]"  (llama-cpp-python builds llama.cpp from source: 7-45 min on '
    '2 cores; CMAKE_ARGS="-DGGML_NATIVE=ON" for this CPU. On a CPU with AMX, 0.3.36\'s AMX '
    "kernels crashed (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-02): build with "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON '
    '-DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"'
    " and pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36)"
)


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def draft_config(name: str):
    """configs/draft/NAME.yaml as `experiments.run draft=NAME` composes it (its defaults
    list included); an unknown name is a SpecDecError listing the known ones."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    known = sorted(p.stem for p in (CONFIGS / "draft").glob("*.yaml"))
    if name not in known:
        raise SpecDecError(f"--draft {name!r}: no configs/draft/{name}.yaml (known: {known})")
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose("config", overrides=[f"draft={name}"]).draft
    except MissingConfigException as e:  # pragma: no cover - a broken defaults list
        raise SpecDecError(f"--draft {name!r}: {e}") from e


def draft_label(cfg, k: int) -> str:
    """What the table calls a drafter: its config's kind, corpus and output reuse."""
    label = cfg.kind
    if cfg.get("corpus"):
        label += f"({cfg.corpus})"
    if cfg.get("reuse_outputs"):
        label += "+outputs"
    return f"{label} k={k}"


class SpecdecRun:
    """One specdec speculative system: generates n tokens for a prompt, counting rounds."""

    def __init__(self, dec, n: int):
        self.dec, self.n, self.rounds = dec, n, 0

    def __call__(self, ids: list[int]) -> list[int]:
        out = self.dec.generate([ids], self.n)
        self.rounds += out.stats["rounds"]
        return out.tokens[0]


def specdec_systems(
    path: str, spec: str, drafts: list, k: int, n: int, prompt_len: int = 0
) -> dict:
    """specdec's plain and speculative systems in one mode. A `+compile` mode compiles
    every step shape the prompts (up to `prompt_len` tokens) will meet here, before timing:
    the decode step, verifications of 1..k + 1 tokens, static caches sized for them."""
    from experiments.components import make_drafter
    from specdec.decode.generation import generate, warm_up
    from specdec.decode.schedules import make_schedule
    from specdec.decode.speculative import SpeculativeDecoder

    model, tok = cpu_mode_model(path, spec)
    systems = {(f"specdec {spec}", "plain"): lambda ids: generate(model, [ids], n).tokens[0]}
    warmed = warm_up(model, 1, prompt_len, n) if prompt_len else 0
    for cfg in drafts:
        dec = SpeculativeDecoder(
            model, make_drafter(cfg, model, tok), "greedy", schedule=make_schedule("constant", k)
        )
        warmed += dec.warm_up(1, prompt_len, n) if prompt_len else 0
        systems[f"specdec {spec}", draft_label(cfg, k)] = SpecdecRun(dec, n)
    if warmed:
        print(f"specdec {spec}: compiled {warmed} step shapes before timing", flush=True)
    return systems


def hf_systems(path, dtype: str, k: int, n: int) -> dict:
    from benchmarks.models import hf_gguf_model

    model = hf_gguf_model(path, dtype)
    common = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def run(ids, **kw):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), **common, **kw)
        return out[0, len(ids) :].tolist()

    return {
        (f"HF {dtype}", "plain"): run,
        (f"HF {dtype}", f"prompt lookup k={k}"): lambda ids: run(ids, prompt_lookup_num_tokens=k),
    }


def llama_systems(path, threads: int, k: int, n: int) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def make(draft):
        return Llama(
            model_path=str(path),
            n_threads=threads,
            n_ctx=2048,
            verbose=False,
            draft_model=draft,
        )

    plain, spec = make(None), make(LlamaPromptLookupDecoding(num_pred_tokens=k))

    def run(llm, ids):
        llm.reset()
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out

    return {
        ("llama.cpp", "plain"): lambda ids: run(plain, ids),
        ("llama.cpp", f"prompt lookup k={k}"): lambda ids: run(spec, ids),
    }


@user_errors
def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="benchmarks.bench_peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--specdec", nargs="+", default=["float32:dense", "bfloat16:native"])
    ap.add_argument(
        "--draft",
        nargs="+",
        default=["replies", "ngram"],
        help="specdec drafters by experiment config name (configs/draft/NAME.yaml)",
    )
    ap.add_argument("--hf-dtype", nargs="+", default=["bfloat16"], help="one HF model per dtype")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for flag in ("k", "new_tokens", "prompts", "threads"):
        validation.integer(getattr(args, flag), "--" + flag.replace("_", "-"), minimum=1)
    drafts = [draft_config(name) for name in args.draft]  # bad names fail before loading
    for spec in args.specdec:
        parse_mode_spec(spec)
    from experiments.datasets import load_dataset
    from specdec.models.load import load_weights
    from specdec.models.registry import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    _, tok, _ = load_weights(str(path))
    prompts = load_dataset("specbench_mini", limit=args.prompts).encode(tok)
    n, k = args.new_tokens, args.k
    systems: dict = {}
    for spec in args.specdec:
        longest = max(len(p) for p in prompts)
        systems.update(specdec_systems(str(path), spec, drafts, k, n, longest))
    if not args.skip_hf:
        for dt in args.hf_dtype:
            systems.update(hf_systems(path, dt, k, n))
    if not args.skip_llama:
        try:
            systems.update(llama_systems(path, args.threads, k, n))
        except ImportError:
            print(f"skipped llama.cpp: llama-cpp-python is not installed; {LLAMA_INSTALL}")
    for fn in systems.values():  # warm-up: allocations, lazy init
        fn(prompts[0][:16])
        if isinstance(fn, SpecdecRun):
            fn.rounds = 0
    elapsed = {key: 0.0 for key in systems}
    tokens = {key: 0 for key in systems}
    outputs: dict = {key: [] for key in systems}
    for ids in prompts:
        for key, fn in systems.items():
            t0 = time.perf_counter()
            out = fn(ids)
            elapsed[key] += time.perf_counter() - t0
            tokens[key] += len(out)
            outputs[key].append(out)
    records = []
    for (system, method), t in elapsed.items():
        plain = (system, "plain")
        tps = tokens[system, method] / t
        same = outputs[system, method] == outputs[plain]
        records.append(
            {
                "system": system,
                "method": method,
                "tokens": tokens[system, method],
                "tok_s": tps,
                "speedup_own": tps / (tokens[plain] / elapsed[plain]),
                "identical_to_own_plain": same,
                "tokens_per_round": (
                    tokens[system, method] / fn.rounds
                    if isinstance(fn := systems[system, method], SpecdecRun) and fn.rounds
                    else None
                ),
            }
        )
    ref = next(
        (r for r in records if r["system"].startswith("HF") and r["method"] == "plain"), None
    )
    for r in records:
        r["vs_HF_plain"] = r["tok_s"] / ref["tok_s"] if ref else None
    print(
        f"{args.model} | {len(prompts)} prompts x {n} new tokens (EOS ignored) | "
        f"{args.threads} thread(s) | k={k}"
    )
    print(
        markdown_table(
            records,
            [
                ("system", "system", ""),
                ("method", "method", ""),
                ("tok_s", "tok/s", ".1f"),
                ("speedup_own", "speedup over own plain", ".2f"),
                ("vs_HF_plain", "vs HF plain", ".2f"),
                ("tokens_per_round", "tokens/round", ".2f"),
                ("identical_to_own_plain", "same tokens as own plain", ""),
            ],
        )
    )
    path_out = save_results(
        "peers",
        records,
        out=args.out,
        env=environment("cpu", cpu_features=cpu_features(), threads=args.threads),
    )
    print(f"results: {path_out}")


if __name__ == "__main__":
    main()
