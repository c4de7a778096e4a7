"""Learned tokens per second with and without ``--pack`` on a chat set with a realistic length spread.

    .venv/bin/python bench/packing.py [--conversations 600] [--steps 12] [--seq-len 128]

A chat set of ``--conversations`` conversations (a question of 2-5 words, an answer) whose
answer lengths are log-normal (median 5 words, sigma 1.0: the long right tail of instruction
sets such as ShareGPT or Alpaca, scaled to the tiny model's 128-token context), tokenized with
the suite's ChatML BPE. ``medley train --local-ranks 2`` (pp 2, 4 micro-batches of 2) runs
``--steps`` steps on it unpacked and packed (CPU, gloo, fp32); from the ``--json`` records, the
median over the steps after the first of tokens/s and learned tokens/s (the assistant's tokens
the loss counts), and the data lines (padding share, packing efficiency). The example lengths
reported are the tokenized ones.

Writes bench/results/packing.json and bench/results/packing.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
from provenance import provenance

from medley.data.bpe import chatml_tokenizer
from medley.data.cache import load_tokenizer
from medley.data.chat import encode_conversation, load_chat_template

OUT = Path(__file__).parent / "results"
MEDIAN_WORDS, SIGMA = 5, 1.0  # the answers' log-normal length in words
MEDLEY = str(Path(sys.executable).with_name("medley"))


def write_chats(path: Path, count: int, seed: int = 0) -> None:
    words = resources.files("medley.data").joinpath("corpus.txt").read_text().split()
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for _ in range(count):
            question = " ".join(words[i] for i in rng.integers(0, len(words), int(rng.integers(2, 6))))
            length = max(1, int(round(rng.lognormal(np.log(MEDIAN_WORDS), SIGMA))))
            start = int(rng.integers(0, len(words) - length))
            messages = [{"role": "user", "content": question},
                        {"role": "assistant", "content": " ".join(words[start:start + length])}]
            handle.write(json.dumps({"messages": messages}) + "\n")


def lengths(path: Path, tokenizer_dir: Path) -> list[int]:
    tokenizer = load_tokenizer(tokenizer_dir)
    template = load_chat_template(tokenizer_dir, None)
    out = []
    for number, line in enumerate(path.read_text().splitlines()):
        ids, _ = encode_conversation(json.loads(line)["messages"], template=template,
                                     tokenizer=tokenizer.tokenizer, where=f"{path}:{number + 1}")
        out.append(len(ids))
    return out


def run(data: Path, tokenizer_dir: Path, cache: Path, *, steps: int, seq_len: int, pack: bool) -> dict:
    args = [MEDLEY, "train", "--local-ranks", "2", "--pp", "2", "--split", "3,3", "--micro-batches", "4",
            "--micro-batch-size", "2", "--seq-len", str(seq_len), "--steps", str(steps), "--data", str(data),
            "--tokenizer", str(tokenizer_dir), "--data-cache", str(cache), "--json",
            *(["--pack"] if pack else [])]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {done.stderr.strip()}")
    records = json.loads(done.stdout)["records"][1:]
    notes = [line for line in done.stderr.splitlines() if line.startswith(("--data", "--pack"))]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "learned_tokens_per_s": statistics.median(r["learned_tokens_per_s"] for r in records),
            "step_time_s": statistics.median(r["step_time_s"] for r in records),
            "final_loss": records[-1]["loss"], "notes": notes}


def markdown(results: dict) -> str:
    spread = results["lengths"]
    plain, packed = results["unpacked"], results["packed"]
    gain = packed["learned_tokens_per_s"] / plain["learned_tokens_per_s"]
    lines = [
        "# Packing: learned tokens per second, packed vs one example per sequence", "",
        f"Commit `{results['commit']}`, `{results['command']}`. CPU, gloo, tiny model, pp 2, "
        f"{results['conversations']} conversations, seq_len {results['seq_len']}, {results['steps']} steps "
        "(medians over the steps after the first).", "",
        f"Tokenized lengths: p10 {spread['p10']}, median {spread['p50']}, p90 {spread['p90']}, max "
        f"{spread['max']} tokens ({spread['over_seq']} longer than a sequence, cut).", "",
        "| | tokens/s | learned tokens/s | step time | final loss |", "|---|---:|---:|---:|---:|"]
    for name, row in (("one per sequence", plain), ("--pack", packed)):
        lines.append(f"| {name} | {row['tokens_per_s']:,.0f} | {row['learned_tokens_per_s']:,.0f} | "
                     f"{row['step_time_s'] * 1e3:.0f} ms | {row['final_loss']:.3f} |")
    lines += ["", f"Packed, the run learns {gain:.2f}x the tokens per second. The data lines:", ""]
    lines += [f"- {note}" for note in (*plain["notes"], *packed["notes"])]
    lines += ["", "The losses differ because the runs see different data per step (a packed step holds more "
              "examples), not because packing changes an example's loss (tests/runtime/test_packing.py)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    results: dict = {**provenance(), "conversations": args.conversations, "steps": args.steps,
                     "seq_len": args.seq_len}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer_dir = chatml_tokenizer(root / "chatml")
        data = root / "chat.jsonl"
        write_chats(data, args.conversations)
        found = np.asarray(lengths(data, tokenizer_dir))
        results["lengths"] = {f"p{q}": int(np.percentile(found, q)) for q in (10, 50, 90)}
        results["lengths"] |= {"max": int(found.max()), "over_seq": int((found > args.seq_len + 1).sum())}
        for name, pack in (("unpacked", False), ("packed", True)):
            results[name] = run(data, tokenizer_dir, root / "cache", steps=args.steps, seq_len=args.seq_len,
                                 pack=pack)
    OUT.mkdir(exist_ok=True)
    (OUT / "packing.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "packing.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
