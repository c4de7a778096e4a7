"""``medley demo``'s Hugging Face part: a model directory made here, fine-tuned, exported, loaded
back by transformers.

medley writes a tiny LLaMA directory (``model.safetensors``, ``config.json`` and a BPE
``tokenizer.json`` trained on the shipped corpus) of the demo run's model shape, trains it from
those weights (``init_from``, the shipped text tokenized with that tokenizer) on the plan the
emulated run used, exports the last step as a Hugging Face directory (what ``train --export-hf``
does) and, when transformers is installed, loads the export with
``AutoModelForCausalLM.from_pretrained`` and greedily continues a prompt. transformers is optional:
without it that last part is skipped in one line.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from medley.fileio import remove_path
from medley.plan.plan import Plan
from medley.spec.model import ModelSpec

HF_VOCAB = 384
PROMPT = "The river"
NEW_TOKENS = 12


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """A greedy continuation by transformers.

    Attributes:
        prompt_ids: the prompt's token ids.
        ids: prompt and generated token ids.
        text: ``ids`` decoded with the model directory's tokenizer.
    """

    prompt_ids: list[int]
    ids: list[int]
    text: str


def write_model_dir(directory: Path, spec: ModelSpec, *, seed: int) -> Path:
    """A Hugging Face LLaMA directory of medley's seeded model ``spec``: model.safetensors,
    config.json (EOS = the tokenizer's id 0) and tokenizer.json (BPE of ``spec.vocab_size``)."""
    from safetensors.torch import save_file

    from medley.data.bpe import train_bpe
    from medley.hf.names import hf_name
    from medley.hf.read import SINGLE_FILE
    from medley.runtime.transformer import Decoder
    from medley.spec.hf_config import hf_dict_from_spec

    directory.mkdir(parents=True)
    train_bpe(directory / "tokenizer.json", spec.vocab_size)
    model = Decoder(spec, seed=seed)
    tensors = {hf_name(name): t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, directory / SINGLE_FILE, metadata={"format": "pt"})
    config = {**hf_dict_from_spec(spec), "eos_token_id": 0, "pad_token_id": 0}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def generate(directory: Path, prompt: str, *, new_tokens: int) -> Generation | None:
    """transformers' greedy continuation of ``prompt`` by the model in ``directory``; None when
    transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.disable_progress_bar()
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt_ids = tokenizer.encode(prompt).ids
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = out[0].tolist()
    return Generation(prompt_ids=prompt_ids, ids=ids, text=tokenizer.decode(ids))


def hf_finetune(*, out_dir: Path, plan: Plan, steps: int, emulate: bool, console: Console) -> dict:
    """Make, fine-tune (``steps`` on ``plan``'s layout with the made model), export and generate
    from a tiny Hugging Face model; the figures."""
    from medley.cli.hf_cmd import check_init_from, export_after_training, export_checkpoints
    from medley.launch.spawn import train_local
    from medley.runtime.train import TrainConfig
    from medley.spec.model_arg import get_model

    shape = replace(plan.shared.model, vocab_size=HF_VOCAB, tied_embeddings=False)
    shapes = " + ".join(f"pp={g.pp} x dp={g.dp}" for g in plan.groups)
    console.rule(f"Hugging Face: make, fine-tune on {shapes}, export, load")
    export = out_dir / "demo-hf-finetuned"
    for earlier in (out_dir / "demo-hf-base", export):  # an earlier demo's, in the demo's own --out
        remove_path(earlier)
    base = write_model_dir(out_dir / "demo-hf-base", shape, seed=1)
    model = get_model(str(base))
    check_init_from(model, base)
    config = TrainConfig.of(steps=steps, emulate=emulate, init_from=base, hf_dir=base, warmup_steps=2,
                         lr=1e-2, checkpoint_dir=export_checkpoints(export))
    records = train_local(Plan(groups=[replace(g, model=model) for g in plan.groups], cluster=plan.cluster),
                          config)
    with warnings.catch_warnings():  # DCP notes that it reads without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        export_after_training(config.checkpoint.dir, export, temporary=True)
    console.print(f"wrote {base} (LLaMA, {HF_VOCAB}-token BPE of the shipped corpus); fine-tuned it with "
                  f"init_from: loss {records[0].loss:.3f} -> {records[-1].loss:.3f} over {steps} steps; "
                  f"exported {export}")
    figures = {"loss_first": records[0].loss, "loss_last": records[-1].loss, "export": str(export)}
    generation = generate(export, PROMPT, new_tokens=NEW_TOKENS)
    if generation is None:
        console.print("transformers is not installed (pip install 'medley[hf]'): skipping loading the export",
                      markup=False)
        return figures
    console.print(f"transformers.AutoModelForCausalLM.from_pretrained({export.name}), greedy: "
                  f"{generation.text!r}", markup=False)
    return {**figures, "generated": generation.text, "generated_ids": generation.ids}
