"""python -m specdec.generate --model smollm2-135m --prompt "..." [options]

Plain or speculative generation from the command line. Without --json the text streams
to stdout followed by a one-line summary on stderr; with --json the last stdout line is
one JSON object (prompt_ids, tokens, text, tokens_per_second, stats, ...).
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec import validation
from specdec.cli import ArgumentParser, setup_logging, user_errors
from specdec.cli.speculative_options import cuda_graphs_option
from specdec.errors import SpecDecError


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m specdec.generate", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m", help="registered name, .gguf path or HF directory"
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text; repeat for a batch of prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32 (the reference: HF parity) | bfloat16 | float16 | auto (bfloat16 on CPUs "
        "with bf16 dot-product instructions, else float32)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument(
        "--backend",
        default=None,
        choices=["auto", "torch", "triton"],
        help="kernel backend (default: $SPECDEC_BACKEND or auto)",
    )
    p.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4"],
        help="quantize a safetensors model's linear layers at load",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="replay decode / verification / drafter steps from CUDA graphs "
        "(auto: on for --device cuda)",
    )
    p.add_argument(
        "--cpu-linear",
        default=None,
        help="CPU linear mode: dense (default) | native (bf16, torch's int4/int8 kernels) | "
        "ort (fp32, ONNX Runtime int8-activation kernels) | mkl | onednn | int4pack | int8pack",
    )
    p.add_argument(
        "--batch-invariant",
        default=None,
        choices=["auto", "on", "off"],
        help="CPU torch backend and Triton kernels: compute every verification row exactly "
        "as a decode step (bit for bit) so greedy speculative output equals plain greedy in "
        "bf16 too (auto: on unless float32)",
    )
    p.add_argument(
        "--cpu-compile",
        default=None,
        choices=["off", "on"],
        help="CPU: run the decode and verification steps through torch.compile (inductor "
        "fuses the work around the linears; minutes of compilation on a cold cache)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens always")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("-v", "--verbose", action="store_true")
    from specdec.cli.speculative_options import add_speculative_args

    add_speculative_args(p)
    g = p.add_argument_group("layer streaming (a target that does not fit on the device)")
    g.add_argument(
        "--stream-target",
        action="store_true",
        help="keep the target's layers off the device; copy each in just before it runs",
    )
    g.add_argument(
        "--stream-source",
        default="auto",
        choices=["auto", "host", "mmap"],
        help="where streamed layers live: host memory (pinned on CUDA) or the memory-mapped "
        ".gguf (auto: mmap for a .gguf on CPU, else host)",
    )
    g.add_argument(
        "--resident-layers",
        type=int,
        default=None,
        help="keep the first N layers on the device (default: the early-exit draft's layers "
        "with --draft early-exit, else 0)",
    )
    g.add_argument("--stream-head", action="store_true", help="stream the LM head too")
    g.add_argument(
        "--embed-on-host", action="store_true", help="keep the embedding table in host memory"
    )
    return p


def load_streamed_target(args):
    """--stream-target: the target with its layers streamed -> (Transformer, Tokenizer)."""
    from specdec.models.load import load_weights
    from specdec.models.streaming import resolve_source, stream_model

    model, tok, path = load_weights(args.model, quantize=args.quantize)
    n = model.config.n_layers
    resident = args.resident_layers
    if resident is None:
        resident = 0
        if args.draft.replace("-", "_") == "early_exit":
            if args.exit_layer is None:  # make_drafter's default, fixed here so both agree
                args.exit_layer = max(1, n // 4)
            resident = min(max(args.exit_layer, 0), n)  # a bad exit layer: the drafter says why
    stream_model(
        model,
        args.device,
        dtype=args.dtype,
        source=resolve_source(args.stream_source, path, args.device),
        resident_layers=resident,
        embed_on_device=not args.embed_on_host,
        head_on_device=not args.stream_head,
    )
    return model, tok


@user_errors
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    import torch

    from specdec.cli.speculative_options import build_speculative
    from specdec.decode.generation import generate
    from specdec.kernels.utils import set_backend
    from specdec.models import batch_invariant, cpu_compile
    from specdec.models.cpu_linear import set_mode
    from specdec.models.load import load_model

    params = validation.sampling(args.temperature, args.top_k, args.top_p)
    validation.seed(args.seed)
    validation.device(args.device)
    for text in args.prompt:
        validation.text(text, "--prompt")
    if args.backend:
        set_backend(args.backend)
    set_mode(args.cpu_linear)
    batch_invariant.set_setting(args.batch_invariant)
    cpu_compile.set_setting(args.cpu_compile)
    stream_opts = (args.stream_source != "auto", args.resident_layers is not None)
    if not args.stream_target and (any(stream_opts) or args.stream_head or args.embed_on_host):
        raise SpecDecError(
            "--stream-source, --resident-layers, --stream-head and --embed-on-host "
            "need --stream-target"
        )
    if args.stream_target:
        model, tok = load_streamed_target(args)
    else:
        model, tok = load_model(
            args.model, dtype=args.dtype, device=args.device, backend=None, quantize=args.quantize
        )
    prompts = []
    for text in args.prompt:
        if not text:
            raise SpecDecError("empty prompt: give some text with --prompt")
        prompts.append(tok.encode_chat(text) if args.chat else tok.encode(text))
    spec = build_speculative(args, model, tok)

    streaming = not args.json and len(prompts) == 1
    emitted: list[int] = []
    printed = ""

    def on_tokens(new: list[list[int]]) -> None:
        nonlocal printed
        emitted.extend(new[0])
        text = tok.decode(emitted)
        if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for more bytes
            return
        sys.stdout.write(text[len(printed) :])
        sys.stdout.flush()
        printed = text

    cb = on_tokens if streaming else None
    if spec is None:
        res = generate(
            model,
            prompts,
            args.max_new_tokens,
            params,
            frozenset() if args.ignore_eos else tok.stop_ids,
            args.seed,
            cb,
            cuda_graphs=cuda_graphs_option(args),
        )
    else:
        res = spec.generate(
            prompts,
            args.max_new_tokens,
            params,
            frozenset() if args.ignore_eos else tok.stop_ids,
            args.seed,
            cb,
        )
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
    if args.json:
        obj = {
            "model": args.model,
            "prompt_ids": res.prompt_ids[0] if len(prompts) == 1 else res.prompt_ids,
            "tokens": res.tokens[0] if len(prompts) == 1 else res.tokens,
            "text": texts[0] if len(prompts) == 1 else texts,
            "finish_reason": res.finish_reasons[0] if len(prompts) == 1 else res.finish_reasons,
            "num_generated": res.num_generated,
            "elapsed_s": res.elapsed_s,
            "prefill_s": res.prefill_s,
            "tokens_per_second": res.tokens_per_second,
            "dtype": str(model.dtype).removeprefix("torch."),
            "batch_invariant": model.batch_invariant,
            "cpu_compile": model.cpu_compile,
            "device": args.device,
            "torch": torch.__version__,
            "stats": res.stats,
        }
        print(json.dumps(obj))
        return
    if not streaming:
        for i, t in enumerate(texts):
            print(f"--- [{i}]\n{t}")
    else:
        print()
    summary = (
        f"[{res.num_generated} tokens in {res.elapsed_s:.2f}s: "
        f"{res.tokens_per_second:.1f} tok/s, prefill {res.prefill_s * 1e3:.0f} ms"
    )
    st = res.stats
    if "acceptance_rate" in st:
        summary += (
            f", acceptance {st['acceptance_rate']:.2f}, "
            f"{st['mean_accepted_tokens']:.2f} tokens/round"
        )
    if "bytes_streamed_per_token" in st:
        summary += f", {st['bytes_streamed_per_token'] / 2**20:.1f} MiB streamed/token"
    print(summary + "]", file=sys.stderr)


if __name__ == "__main__":
    main()
