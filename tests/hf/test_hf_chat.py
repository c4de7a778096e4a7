"""Fine-tuning a Hugging Face model on conversations (gloo, CPU, pp 2 x dp 2 ZeRO 3,1): the
directory's own chat template renders the data (the ids are transformers' apply_chat_template),
the first loss is transformers' loss on the same batch with the prompt's labels at -100, and
every loss is the single-process reference's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import SEQ_LEN, hf_plan

from medley.data.examples import IGNORE
from medley.launch.spawn import train_local
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainConfig, load_data

TOL = 1e-5
SEED = 3
# Short turns in words of the suite's tokenizer: most conversations fit SEQ_LEN + 1 tokens.
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}")
ANSWERS = ["Bake it hot.", "Knead it.", "Let it cool.", "Flour and water."]


def _chat_model(source: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _conversations(path: Path, count: int) -> Path:
    rows = [{"messages": [{"role": "user", "content": "Bread?"},
                          {"role": "assistant", "content": ANSWERS[i % 4] + " Bake it." * (i % 3)}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(300)
def test_pp2_dp2_chat_fine_tuning_matches_transformers_masked_loss(hf_models, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    directory = _chat_model(hf_models["qwen2"], tmp_path)
    data = _conversations(tmp_path / "chat.jsonl", 16)
    plan = hf_plan(directory, pp=2, dp=2, split="1,1", zero="3,1", micro_batches="2,2")
    config = TrainConfig.of(steps=3, seed=SEED, warmup_steps=1, lr=1e-2, min_lr=1e-3, clip_norm=1.0,
                         progress=False, measure_memory=False, init_from=directory, hf_dir=directory,
                         data=str(data), data_cache=tmp_path / "cache")
    records = train_local(plan, config)
    want = reference_losses(plan.layout, config)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL

    source = load_data(config, seq_len=SEQ_LEN, vocab_size=plan.layout.model.vocab_size)
    rows = source.global_rows(step=0, seed=SEED, sequences=8, seq_len=SEQ_LEN)
    labels = torch.cat([torch.full((8, 1), IGNORE), rows.targets], dim=1)  # transformers shifts them
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(input_ids=rows.tokens, labels=labels).loss.item()
    assert abs(records[0].loss - theirs) <= TOL

    # The generic class reads tokenizer.json as it is, as medley does (AutoTokenizer would build
    # a Qwen2Tokenizer's own byte-level pipeline around the suite's Metaspace vocabulary).
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    first = json.loads(data.read_text().splitlines()[int(source.examples.order[0])])["messages"]
    ids = hf_tokenizer.apply_chat_template(first, tokenize=True)["input_ids"]
    assert source.examples.rows([0])[0][0, :min(len(ids), SEQ_LEN + 1)].tolist() == ids[:SEQ_LEN + 1]
