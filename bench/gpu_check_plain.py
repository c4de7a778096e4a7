"""The GPU check's plain PyTorch loop (bench/gpu_check.py runs it as a fresh interpreter).

The same arithmetic as a medley plan on one device, written the way torchtitan writes it and
nothing of medley's runtime: a LLaMA decoder (RMSNorm, rotary embeddings, grouped-query attention
through ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU), fp32 master weights, the
forward under ``torch.autocast`` in bf16, the loss in fp32, gradients accumulated over the plan's
micro-batches, the global-norm clip at 1.0 and torch's fused AdamW. Blocks are checkpointed when
the plan recomputes them. Timed eager, then with every block compiled (``nn.Module.compile``,
``fullgraph=True``: torchtitan's per-block compile) in the same process, on the same weights.

    python bench/gpu_check_plain.py --probe OUT.json      # torch, CUDA, NCCL and the GPUs
    python bench/gpu_check_plain.py SPEC.json OUT.json    # the loop (SPEC: bench/gpu_check.py)

OUT is rewritten after each phase, so a run stopped at its deadline keeps what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def probe() -> dict:
    """What a medley run would find here: versions and GPUs (names as the catalog matches them)."""
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - recorded
            out["nccl"] = f"unknown ({type(err).__name__}: {err})"
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            out["gpus"].append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                }
            )
    return out


class Block(nn.Module):
    def __init__(self, m: dict) -> None:
        super().__init__()
        h, heads, kv, hd = m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
        self.heads, self.kv, self.hd = heads, kv, hd
        self.attn_norm = nn.RMSNorm(h, eps=m["norm_eps"])
        self.wq = nn.Linear(h, heads * hd, bias=False)
        self.wk = nn.Linear(h, kv * hd, bias=False)
        self.wv = nn.Linear(h, kv * hd, bias=False)
        self.wo = nn.Linear(heads * hd, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=m["norm_eps"])
        self.gate = nn.Linear(h, m["ffn_hidden_size"], bias=False)
        self.up = nn.Linear(h, m["ffn_hidden_size"], bias=False)
        self.down = nn.Linear(m["ffn_hidden_size"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = self.wq(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.kv != self.heads:  # torchtitan's repeat_kv
            rep = self.heads // self.kv
            k = k[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
            v = v[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Llama(nn.Module):
    def __init__(self, m: dict, *, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.tok = nn.Embedding(m["vocab_size"], m["hidden_size"])
        self.blocks = nn.ModuleList(Block(m) for _ in range(m["num_blocks"]))
        self.norm = nn.RMSNorm(m["hidden_size"], eps=m["norm_eps"])
        self.out = nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
        if m["tied_embeddings"]:
            self.out.weight = self.tok.weight
        inv = 1.0 / m["rope_theta"] ** (
            torch.arange(0, m["head_dim"], 2, dtype=torch.float64) / m["head_dim"]
        )
        angles = torch.outer(torch.arange(m["seq_len"], dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if self.recompute else block(x, cos, sin)
        return self.out(self.norm(x))


def init_weights(model: nn.Module, blocks: int) -> None:
    """N(0, 0.02), residual outputs scaled by depth, unit norms (medley's rule, drawn on the device)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                std = 0.02 / (2 * blocks) ** 0.5 if name.endswith(("wo.weight", "down.weight")) else 0.02
                param.normal_(0.0, std)


class Loop:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        cuda = spec["device"] == "cuda"
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if not cuda:
            torch.set_num_threads(spec.get("threads", 1))
        torch.manual_seed(0)
        m = {**spec["model"], "seq_len": spec["seq_len"]}
        with torch.device(self.device):
            self.model = Llama(m, recompute=spec["recompute"])
        init_weights(self.model, m["num_blocks"])
        self.params = [p for p in self.model.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )
        self.vocab = m["vocab_size"]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    def step(self) -> tuple[float, torch.Tensor]:
        spec = self.spec
        self.sync()
        started = time.perf_counter()
        total = torch.zeros((), device=self.device)
        for _ in range(spec["micro_batches"]):
            tokens = torch.randint(
                0, self.vocab, (spec["micro_batch_size"], spec["seq_len"] + 1), device=self.device
            )
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(tokens[:, :-1])
            loss = (
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / spec["micro_batches"]
            )
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - started, total

    def phase(self, name: str, steps: int, warmup: int) -> dict:
        self.reset_peak()
        times, losses = [], []
        for _ in range(warmup + steps):
            seconds, loss = self.step()
            times.append(seconds)
            losses.append(loss)
        timed = times[warmup:]
        step_s = sum(timed) / len(timed)
        return {
            "phase": name,
            "steps": len(times),
            "timed_steps": len(timed),
            "step_time_s": step_s,
            "first_step_s": times[0],
            "tokens_per_s": self.spec["tokens_per_step"] / step_s,
            "mfu": self.spec["flops_per_step"] / self.spec["peak_flops"] / step_s,
            "peak_memory_bytes": self.peak(),
            "losses": [float(x) for x in losses],
        }


def run(spec: dict, out: Path) -> None:
    result: dict[str, Any] = {"spec": spec, "phases": {}, "skipped": {}}
    started = time.monotonic()
    loop = Loop(spec)
    result["setup_s"] = time.monotonic() - started
    out.write_text(json.dumps(result))
    eager = loop.phase("eager", spec["steps"], spec["warmup"])
    result["phases"]["eager"] = eager
    out.write_text(json.dumps(result))
    # compiling: the first step compiles; about a minute for a LLaMA block on a GPU host
    need = spec.get("compile_estimate_s", 60.0) + eager["step_time_s"] * (spec["steps"] + spec["warmup"])
    left = spec["deadline"] - time.time()
    if not spec.get("compile", True):
        result["skipped"]["compiled"] = "not asked for"
    elif left < need:
        result["skipped"]["compiled"] = f"{left:.0f} s left before the deadline, about {need:.0f} s needed"
    else:
        for block in loop.model.blocks:
            block.compile(fullgraph=True, backend=spec.get("compile_backend", "inductor"))
        result["phases"]["compiled"] = loop.phase("compiled", spec["steps"], spec["warmup"])
        result["phases"]["compiled"]["backend"] = spec.get("compile_backend", "inductor")
    out.write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--probe":
        Path(argv[1]).write_text(json.dumps(probe()))
        return 0
    if len(argv) != 2:
        print("usage: gpu_check_plain.py --probe OUT.json | SPEC.json OUT.json", file=sys.stderr)
        return 2
    run(json.loads(Path(argv[0]).read_text()), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
