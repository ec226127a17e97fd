"""A "bring your own model" fixture built offline: a small Qwen2 (or any architecture of :data:`ARCHITECTURES`, the
ones TRL's own GRPOTrainer suite trains) with a byte-level BPE tokenizer trained here by ``tokenizers``, a ChatML chat
template and no pad token, saved with ``save_pretrained`` to a folder, as a user's Hugging Face model folder would be
(nothing is downloaded). Also local dataset files for it: TRL's standard format (text prompts) and a GSM8K-style file
in TRL's conversational format (message-list prompts, ``#### 42`` answers).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def addition_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct word problems "What is a plus b?" with their sums, in TRL's standard format."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(40) for b in range(40)], n)
    return [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a, b in pairs]


def write_dataset(path: Path, n: int = 160) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_rows(n)))
    return path


# Templated multi-step word problems: (question, worked answer ending in GSM8K's "#### <number>", steps).
_PEOPLE = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay"]
_THINGS = ["apples", "stamps", "marbles", "books", "shells"]


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct two- and three-step problems in GSM8K's shape, as TRL conversational rows: ``prompt`` a list of
    system + user messages, ``answer`` the worked solution ending in ``#### <number>``, and an extra ``steps`` column
    (TRL passes extra columns to reward functions)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        who, what = rng.choice(_PEOPLE), rng.choice(_THINGS)
        a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(1, 9)
        if rng.random() < 0.5:
            question = f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have now?"
            worked, result, steps = f"{who} has {a} + {b} = {a + b} {what}.", a + b, 2
        else:
            question = (f"{who} has {a} {what}, buys {b} more and gives away {c}. How many {what} does {who} "
                        "have left?")
            worked = f"After buying, {a} + {b} = {a + b}. After giving away, {a + b} - {c} = {a + b - c}."
            result, steps = a + b - c, 3
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [{"role": "system", "content": "Solve it; end with the number."},
                                {"role": "user", "content": question}],
                     "answer": f"{worked}\n#### {result}", "steps": steps})
    return rows


def write_gsm8k_conversational(path: Path, n: int = 120, bad: bool = True) -> Path:
    """The conversational GSM8K-style file; with ``bad``, one row whose messages are not a conversation (an unknown
    role) and one repeating an earlier conversation, for the quarantine."""
    rows = gsm8k_rows(n)
    if bad:
        rows.append({"prompt": [{"role": "narrator", "content": "Once upon a time"}], "answer": "#### 1", "steps": 1})
        rows.append(dict(rows[0]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Tiny configs (2 layers, hidden size 64) of the architectures TRL's own GRPOTrainer suite trains, by model type. Each
# keeps the architecture's distinguishing parts, small: MoE routers and experts, sliding-window layers with a window
# shorter than a prompt, and for the hybrids one layer of each kind (Mamba / linear attention + attention).
_ATTENTION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
ARCHITECTURES: dict[str, dict] = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "llama": {},
    "mistral": {"sliding_window": 6},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"sliding_window": 6},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "glm4_moe": {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"],
                "max_position_embeddings": 131072},  # YaRN's 32 x 4096, as its rope parameters say (no table is made)
    "nemotron_h": {"head_dim": 16, "layers_block_type": ["mamba", "attention"], "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16},
    "falcon_h1": {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_chunk_size": 16},
    "qwen3_next": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
}


def bpe_tokenizer(corpus: list[str], vocab_size: int, chat_template: str):
    """A byte-level BPE tokenizer trained on ``corpus``, with ChatML's special tokens (``<|im_end|>`` its end of
    sequence) and ``chat_template``, and no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", bos_token=None,
                                        unk_token=None, additional_special_tokens=SPECIAL[:2])
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tokenizer():
    """A byte-level BPE tokenizer trained here on the tasks' text, with ChatML's special tokens and chat template and
    no pad token."""
    corpus = [f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}<|im_end|>"
              for r in addition_rows(1600, seed=1)]
    corpus += [f"{r['prompt'][0]['content']} {r['prompt'][1]['content']} {r['answer']}"
               for r in gsm8k_rows(400, seed=1)]
    tokenizer = bpe_tokenizer(corpus, 400, CHAT_TEMPLATE)
    assert tokenizer.pad_token is None  # the loader's pad-token fallback is what the tests exercise
    return tokenizer


def tiny_config(architecture: str, vocab_size: int, eos_token_id: int | None = None):
    """The transformers config of ``architecture`` (a key of :data:`ARCHITECTURES`) at the tiny sizes."""
    from transformers import AutoConfig

    return AutoConfig.for_model(architecture, **{**_ATTENTION, **ARCHITECTURES[architecture]}, vocab_size=vocab_size,
                                tie_word_embeddings=True, eos_token_id=eos_token_id, bos_token_id=None,
                                pad_token_id=None)


def build_own_model(folder: Path, seed: int = 0, architecture: str = "qwen2") -> Path:
    """Build the tokenizer (:func:`build_tokenizer`) and a randomly initialised tiny model of ``architecture`` (a
    key of :data:`ARCHITECTURES`, a transformers model type) and save both to ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config(architecture, len(tokenizer), tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # Some tokenizer classes default to a pad token unless the folder says there is none (as Llama-style folders do).
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "pad_token": None}, indent=2))
    return folder


# ---------------------------------------------------------------- a tool-calling chat model (protocol chat)


def _tool_conversation(row: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """(prompt messages, the demonstrated turns) of an addition row: a calculator call, its answer, the sum."""
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" plus ")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
    prompt = [{"role": "user", "content": row["prompt"]}]
    return prompt, [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "calculator", "content": row["answer"]},
                    {"role": "assistant", "content": row["answer"]}]


def build_tool_calling_model(folder: Path, steps: int = 100, seed: int = 0) -> Path:
    """A user's tool-calling chat model, built offline: a tiny Qwen2 with TRL's Qwen2.5 chat template (one TRL's tool
    loop recognises), a byte-level BPE tokenizer trained on tool conversations, and ``steps`` of supervised
    fine-tuning on demonstrations that call the registered ``calculator`` tool with the sum's expression, read its
    answer and repeat it (rendered with the tool's schema, as TRL renders prompts). Saved to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo.environments import get_tool
    from grpo.training.warm_start import supervised_warm_start

    tools = [get_tool("calculator")]
    render = bpe_tokenizer(["x"], 600, qwen2_5_chat_template)  # the template renders text without a trained vocabulary
    pairs = []
    for row in addition_rows(800, seed=seed + 1):
        prompt, turns = _tool_conversation(row)
        head = render.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
        whole = render.apply_chat_template(prompt + turns, tools=tools, tokenize=False)
        pairs.append((head, whole[len(head):].removesuffix("\n").removesuffix("<|im_end|>")))
    folder.mkdir(parents=True, exist_ok=True)
    trained = bpe_tokenizer([head + demo for head, demo in pairs[:300]], 600, qwen2_5_chat_template)
    trained.save_pretrained(folder)
    config = AutoConfig.for_model(  # the prompt carries the tool's schema (~230 tokens)
        "qwen2", **{**_ATTENTION, "max_position_embeddings": 1024}, vocab_size=len(trained),
        tie_word_embeddings=True, eos_token_id=trained.eos_token_id, bos_token_id=None, pad_token_id=None)
    config.save_pretrained(folder)
    # Fine-tuned with the tokenizer as loaded from the folder: with the model's config beside it, transformers picks
    # the model type's tokenizer class (Qwen2Tokenizer), whose pre-tokenizer splits text differently from the one
    # trained above (233 tokens instead of 227 for a prompt); a model fine-tuned on the other split never called.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer.pad_token = tokenizer.eos_token  # batches of demonstrations; the folder keeps no pad token
        supervised_warm_start(model, tokenizer, [h for h, _ in pairs], [d for _, d in pairs], steps, 32, 3e-3, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    return folder


def write_tool_dataset(path: Path, n: int = 120) -> Path:
    """Addition problems, as TRL conversational rows (the prompts the tool-calling model is fine-tuned on are another
    sample of the same task)."""
    rows = addition_rows(n, seed=7)
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]})
                            + "\n" for r in rows))
    return path
