"""The target's own replies, generated in this process for ``draftsmith generate`` (generate.py): the target and its
tokenizer loaded with errors naming the folder, prompts left-padded into batches, every assistant turn of a chunk of
conversations replaced in order (or plain-text prompts continued), sampling seeded per chunk."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trainer.data.generate_io import Chunk, check_messages, check_prompt
from trainer.data.tokenizer import load_tokenizer
from trainer.interface.errors import DataError, PathError, TokenizerError
from trainer.models.target import check_model_path, resolve_dtype


def seed_of(seed: int, chunk_start: int) -> int:
    digest = hashlib.sha256(f"{seed}:generate:{chunk_start}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, P] and attention mask [B, P], right-aligned (P = the longest prompt)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention[b, width - len(p) :] = 1
    return ids, attention


class Regenerator:
    """Batched replies of a causal LM to chat prompts, rendered with its tokenizer's chat template."""

    def __init__(self, model, tokenizer, config: GenerationConfig, batch_size: int) -> None:
        self.model, self.tokenizer, self.config, self.batch_size = model, tokenizer, config, batch_size
        self.device = next(model.parameters()).device

    def replies(self, conversations: list[list[dict[str, str]]]) -> list[tuple[str, bool, int]]:
        """(reply text, cut at max_new_tokens, tokens generated) for each conversation (each ends before the
        reply)."""
        return self.continue_tokens(
            [
                list(
                    self.tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)[
                        "input_ids"
                    ]
                )
                for c in conversations
            ]
        )

    def completions(self, prompts: list[str]) -> list[tuple[str, bool, int]]:
        """(continuation text, cut at max_new_tokens, tokens generated) for each plain-text prompt."""
        return self.continue_tokens([list(self.tokenizer(p)["input_ids"]) for p in prompts])

    def continue_tokens(self, token_lists: list[list[int]]) -> list[tuple[str, bool, int]]:
        """(generated text, cut at max_new_tokens, tokens generated with the EOS) for each prompt given as token
        ids."""
        out: list[tuple[str, bool, int]] = []
        eos = self.config.eos_token_id
        for start in range(0, len(token_lists), self.batch_size):
            prompts = token_lists[start : start + self.batch_size]
            if any(not p for p in prompts):
                raise DataError("generate: a prompt tokenizes to no tokens")
            ids, attention = left_padded(prompts, self.config.pad_token_id)  # [B, P] each
            with torch.no_grad():
                seqs = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    generation_config=self.config,
                )  # [B, P + N]
            for row in seqs[:, ids.shape[1] :].tolist():
                cut = row.index(eos) if eos in row else len(row)
                text = self.tokenizer.decode(row[:cut], skip_special_tokens=True)
                out.append((text, cut == len(row), min(cut + 1, len(row))))
        return out


def regenerate_records(
    records: list[dict[str, Any]], regenerator: Regenerator, messages_field: str, source: str, first: int = 0
) -> Chunk:
    """The records (input indices from ``first``) with every assistant turn replaced in order."""
    convs = [list(check_messages(r, messages_field, f"{source} record")) for r in records]
    turns = truncated = tokens = 0
    empty: set[int] = set()
    depth = 0
    while True:
        # conversations that have an assistant turn after `depth` earlier ones: regenerate that turn in one batch
        todo = []
        for i, messages in enumerate(convs):
            positions = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            if len(positions) > depth:
                todo.append((i, positions[depth]))
        if not todo:
            break
        replies = regenerator.replies([convs[i][:j] for i, j in todo])
        for (i, j), (text, cut, n) in zip(todo, replies, strict=True):
            convs[i][j] = {**convs[i][j], "content": text}
            truncated, tokens = truncated + int(cut), tokens + n
            if not text.strip():
                empty.add(first + i)
        turns += len(todo)
        depth += 1
    new = [{**r, messages_field: c} for r, c in zip(records, convs, strict=True)]
    return Chunk(new, turns, truncated, tokens, sorted(empty))


def complete_records(
    records: list[dict[str, Any]], regenerator: Regenerator, prompt_field: str, source: str, first: int = 0
) -> Chunk:
    """The records (input indices from ``first``) with ``text`` = prompt + the target's continuation."""
    prompts = [check_prompt(r, prompt_field, f"{source} record") for r in records]
    done = regenerator.completions(prompts)
    out = [{**r, "text": p + text} for r, p, (text, _, _) in zip(records, prompts, done, strict=True)]
    empty = [first + i for i, (text, _, _) in enumerate(done) if not text.strip()]
    return Chunk(out, len(done), sum(int(cut) for _, cut, _ in done), sum(n for _, _, n in done), empty)


def load_target(target: str, dtype: str, trust_remote_code: bool, needs_chat_template: bool) -> tuple[Any, Any]:
    """The target's tokenizer and model (on CPU, in eval mode), with errors naming ``target``.

    Args:
        target: a local model folder (config.json, weights and tokenizer) or a hub id.
        dtype: the weights dtype (float32, bfloat16, float16).
        trust_remote_code: allow custom modelling code in the target folder.
        needs_chat_template: refuse a tokenizer without a chat template (chat mode renders prompts with it).

    Raises:
        FileNotFoundError: ``target`` is neither a local model folder nor a hub id that loads (a misspelled path),
            or is a folder without config.json.
        ValueError: its tokenizer has no EOS token, or no chat template when one is needed.
    """
    path = check_model_path(target, "target")  # a folder without config.json, or a missing path that looks local
    try:
        tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if path.exists() else target, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        if path.exists():
            raise
        raise PathError(
            f"target {target!r} is not a local model folder or hub id (no such folder, and loading it from the hub "
            f"failed: {err}); check the path, or train or download the target first"
        ) from err
    if needs_chat_template and not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(f"the tokenizer of {target} has no chat template: generate needs one to render prompts")
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"the tokenizer of {target} has no EOS token: replies could not end")
    return tokenizer, model.eval()
