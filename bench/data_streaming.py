"""Resident memory of training on a large data set: the data is mapped, never held whole.

    .venv/bin/python bench/data_streaming.py [--size-mb 512] [--text-mb 64] [--chat-mb 16] [--steps 4]

1. A ``.bin`` token file of ``--size-mb`` MB (uint16, written in pieces through a numpy memmap)
   and a 1 MB one; ``medley train --local-ranks 2`` (pp 2) for ``--steps`` steps on each. Every
   0.1 s the launcher and each rank's /proc status is read: peak resident set (VmHWM) and its
   anonymous part (RssAnon; mapped file pages are RssFile and the kernel may drop them).
2. A ``.jsonl`` of ``--text-mb`` MB tokenized into the token cache (a BPE tokenizer trained on the
   shipped corpus): the launcher's peak while it streams the documents, and the time it takes.
3. A ``.jsonl`` of ``--chat-mb`` MB of conversations (``messages``, a ChatML template in the
   tokenizer's directory) rendered, tokenized and masked into the example cache, then one step
   at sequence length 128 (the tiny model's longest): the same figures, and the conversations per second.

Writes bench/results/data_streaming.json and bench/results/data_streaming.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np
from provenance import provenance

from medley.data.bpe import chatml_tokenizer, train_bpe

OUT = Path(__file__).parent / "results"
MEDLEY = str(Path(sys.executable).with_name("medley"))
KEYS = ("VmHWM", "RssAnon", "RssFile")


def descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += parents.get(out[-1], [])
    return out


def status_kib(pid: int) -> dict[str, int]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) for line in lines if line.split(":")[0] in KEYS}


def watch(args: list[str]) -> dict:
    """Run ``medley`` with ``args``; the peak of each process it started, in MiB."""
    started = time.perf_counter()
    proc = subprocess.Popen([MEDLEY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, dict[str, int]] = {}
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            for key, value in status_kib(pid).items():
                peak = peaks.setdefault(pid, {})
                peak[key] = max(peak.get(key, 0), value)
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"medley {' '.join(args)} failed: {err.strip()}")
    big = sorted(peaks.items(), key=lambda kv: -kv[1].get("VmHWM", 0))
    return {"seconds": round(time.perf_counter() - started, 1), "stdout": out,
            "launcher": {k: round(v / 1024, 1) for k, v in peaks.get(proc.pid, {}).items()},
            "largest": [{k: round(v / 1024, 1) for k, v in p.items()} for _, p in big[:3]]}


def token_file(path: Path, megabytes: int) -> Path:
    tokens = megabytes * 2**20 // 2
    mapped = np.memmap(path, dtype=np.uint16, mode="w+", shape=(tokens,))
    rng, piece = np.random.default_rng(0), 1 << 24
    for start in range(0, tokens, piece):
        mapped[start:start + piece] = rng.integers(0, 256, min(piece, tokens - start), dtype=np.uint16)
    mapped.flush()
    del mapped
    return path


def text_file(path: Path, megabytes: int) -> Path:
    lines = resources.files("medley.data").joinpath("corpus.txt").read_text(encoding="utf-8").splitlines()
    lines = [line for line in lines if line.strip()]
    with open(path, "w") as handle:
        index = 0
        while handle.tell() < megabytes * 2**20:
            handle.write(json.dumps({"text": " ".join(lines[index % len(lines):][:8])}) + "\n")
            index += 8
    return path


def chat_file(path: Path, megabytes: int) -> tuple[Path, int]:
    """Conversations of corpus lines: a question, an answer, a follow-up and its answer."""
    lines = resources.files("medley.data").joinpath("corpus.txt").read_text(encoding="utf-8").splitlines()
    lines = [line for line in lines if line.strip()]
    count = 0
    with open(path, "w") as handle:
        while handle.tell() < megabytes * 2**20:
            turns = [lines[(count * 4 + k) % len(lines)][:100] for k in range(4)]
            messages = [{"role": role, "content": text} for role, text in
                        zip(("user", "assistant", "user", "assistant"), turns, strict=True)]
            handle.write(json.dumps({"messages": messages}) + "\n")
            count += 1
    return path, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--text-mb", type=int, default=64)
    parser.add_argument("--chat-mb", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    train = ["train", "--local-ranks", "2", "--pp", "2", "--split", "2,2", "--seq-len", "64",
             "--steps", str(args.steps), "--json"]
    results: dict = {**provenance(), "size_mb": args.size_mb, "text_mb": args.text_mb,
                     "chat_mb": args.chat_mb, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        big, small = token_file(root / "big.bin", args.size_mb), token_file(root / "small.bin", 1)
        results["bin_large"] = watch([*train, "--data", str(big)])
        results["bin_1mb"] = watch([*train, "--data", str(small)])
        tokenizer = train_bpe(root / "tokenizer.json", 256)
        text = text_file(root / "docs.jsonl", args.text_mb)
        results["jsonl_tokenize"] = watch([*train, "--steps", "1", "--data", str(text), "--tokenizer",
                                           str(tokenizer), "--data-cache", str(root / "cache")])
        meta = next((root / "cache").glob("*.json"))
        results["jsonl_tokens"] = json.loads(meta.read_text())["tokens"]
        chats, count = chat_file(root / "chats.jsonl", args.chat_mb)
        chatml = chatml_tokenizer(root / "chatml")
        results["chat_tokenize"] = watch([*train, "--steps", "1", "--seq-len", "128", "--data", str(chats),
                                          "--tokenizer", str(chatml),
                                          "--data-cache", str(root / "chat-cache")])
        meta = json.loads(next((root / "chat-cache").glob("*.examples.json")).read_text())
        results["chat_conversations"], results["chat_tokens"] = count, meta["tokens"]
    for run in ("bin_large", "bin_1mb", "jsonl_tokenize", "chat_tokenize"):
        results[run].pop("stdout")
    OUT.mkdir(exist_ok=True)
    (OUT / "data_streaming.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "data_streaming.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    rows = ["| run | seconds | launcher VmHWM MiB | largest process VmHWM / RssAnon / RssFile MiB |",
            "|---|---|---|---|"]
    names = {"bin_large": f".bin {results['size_mb']} MB, {results['steps']} steps",
             "bin_1mb": f".bin 1 MB, {results['steps']} steps",
             "jsonl_tokenize": f".jsonl {results['text_mb']} MB tokenized "
                               f"({results['jsonl_tokens']:,} tokens), 1 step",
             "chat_tokenize": f"chat .jsonl {results['chat_mb']} MB rendered, tokenized and masked "
                              f"({results['chat_conversations']:,} conversations, {results['chat_tokens']:,} "
                              "tokens), 1 step"}
    for key, name in names.items():
        run, top = results[key], results[key]["largest"][0]
        rows.append(f"| {name} | {run['seconds']} | {run['launcher'].get('VmHWM')} | {top.get('VmHWM')} / "
                    f"{top.get('RssAnon')} / {top.get('RssFile')} |")
    large, small = results["bin_large"]["largest"][0], results["bin_1mb"]["largest"][0]
    growth = large["VmHWM"] - small["VmHWM"]
    prose = (f"From the 1 MB to the {results['size_mb']} MB token file the largest process's peak resident "
             f"memory grew by {growth:.1f} MiB, and its file-backed pages by "
             f"{large['RssFile'] - small['RssFile']:.1f} MiB.")
    chat = results["chat_tokenize"]
    rate = results["chat_conversations"] / chat["seconds"]
    prose += (f" Conversations go into the example cache at {rate:,.0f} per second, the whole command "
              "included (chat template, tokenizer, one training step).")
    head = f"Commit `{results.get('commit', '?')}`, command `{results.get('command', '?')}`.\n\n"
    return "# Data streaming: resident memory\n\n" + head + "\n".join(rows) + "\n\n" + prose + "\n"


if __name__ == "__main__":
    os.environ.setdefault("MEDLEY_DEBUG", "0")
    main()
