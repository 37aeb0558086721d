"""GSM8K and scoring data: reading and checking JSONL, Tekken tokenisation, packed batches.

Everything here runs before the first model call and raises ``ValueError`` naming the file, the
line and the field for bad input, so that a run stops before any output is written.

Token layout of one example (the same in every mode)::

    prompt   = [BOS] + tekken("Question: {question}\\nAnswer: ")      # no loss
    response = tekken("{answer}") + [EOS]                               # loss on these tokens

A batch is one packed row of ``seq_length`` tokens (:func:`megatron_vocabstats.packing.
pack_sequences`): several examples back to back, each padded to the parallel layout's alignment.
Labels are shifted inside each example; ``loss_mask`` is 1 exactly where the label is a response
token.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_vocabstats.packing import PackedBatch, pack_sequences

PROMPT_TEMPLATE = "Question: {question}\nAnswer: "
FINAL_ANSWER = re.compile(r"####\s*(\S+)\s*$")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(HERE), "data", "gsm8k")


def default_tokenizer_path() -> str:
    """Path of the Tekken tokenizer file shipped in the ``mistral-common`` wheel (offline)."""
    import mistral_common

    return os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")


def load_tokenizer(path: str | None = None):
    """Mistral's Tekken tokenizer (131,072 tokens) from ``path`` (default: the wheel's file).

    Returns a ``mistral_common.tokens.tokenizers.tekken.Tekkenizer``; ``.n_words`` is the
    vocabulary size, ``.encode(text, bos=, eos=)`` the token ids (list of int).

    Raises:
        ValueError: ``path`` missing or not a Tekken file.
    """
    import logging

    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    logging.getLogger("mistral_common").setLevel(logging.WARNING)
    path = path or default_tokenizer_path()
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer: {path} not found")
    try:
        return Tekkenizer.from_file(path)
    except Exception as exc:  # mistral-common raises several types (BLE: re-raised)
        raise ValueError(f"--tokenizer: {path} is not a Tekken tokenizer file ({exc})") from exc


def read_jsonl(path: str, fields: Sequence[str], *, what: str) -> list[dict[str, str]]:
    """Rows of a JSONL file, each a JSON object with string values for ``fields``.

    Blank lines are skipped. ``what`` names the command-line option in messages.

    Raises:
        ValueError: the file is missing or unreadable, has no rows, a line that is not JSON or
            not an object, or a row without one of ``fields`` as a string (path:line named).
    """
    if not os.path.isfile(path):
        kind = "is a directory, not a JSONL file" if os.path.isdir(path) else "not found"
        raise ValueError(f"{what}: {path} {kind}")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{what}: {path}:{number} is not valid JSON ({exc.msg})") \
                        from None
                if not isinstance(row, dict):
                    raise ValueError(f"{what}: {path}:{number} must be a JSON object, got "
                                     f"{type(row).__name__}")
                for field in fields:
                    if not isinstance(row.get(field), str):
                        raise ValueError(f"{what}: {path}:{number} needs a string field "
                                         f"{field!r} (fields: {list(fields)})")
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: {path} is not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{what}: {path} cannot be read ({exc.strerror or exc})") from None
    if not rows:
        raise ValueError(f"{what}: {path} holds no rows")
    return rows


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` of a GSM8K answer, normalised (no ``,`` or ``$``).

    ``"... #### 1,080"`` -> ``"1080"``; ``"4.50"`` -> ``"4.5"``; None when there is no ``####``
    or what follows is not a finite number.
    """
    match = FINAL_ANSWER.search(text)
    if match is None:
        return None
    raw = match.group(1).replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value):  # "nan", "inf", "1e400": not an answer
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def load_gsm8k(path: str, *, what: str, limit: int | None = None) -> list[dict[str, str]]:
    """GSM8K rows ``{"question", "answer"}`` whose answer ends in ``#### <number>``.

    Raises:
        ValueError: as :func:`read_jsonl`, and an answer without a final ``#### <number>``.
    """
    rows = read_jsonl(path, ("question", "answer"), what=what)
    for number, row in enumerate(rows, start=1):
        if final_answer(row["answer"]) is None:
            raise ValueError(f"{what}: {path} row {number}: the answer must end in "
                             "'#### <number>' (GSM8K format)")
    return rows[:limit] if limit else rows


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenised example: ``prompt`` (no loss) and ``response`` (scored) token ids."""

    prompt: list[int]
    response: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.response)


def encode_gsm8k(tokenizer, question: str, answer: str) -> Example:
    """``Example`` of one GSM8K pair in the module's layout (BOS + template, answer + EOS)."""
    return Example(tokenizer.encode(PROMPT_TEMPLATE.format(question=question), bos=True,
                                    eos=False),
                   tokenizer.encode(answer, bos=False, eos=True))


def encode_scoring_rows(tokenizer, rows: Sequence[dict[str, str]], *, what: str) -> list[Example]:
    """``Example(BOS + prompt, response)`` per scoring row; the response gets no EOS.

    Raises:
        ValueError: a response that tokenises to zero tokens (row named).
    """
    examples = []
    for number, row in enumerate(rows, start=1):
        response = tokenizer.encode(row["response"], bos=False, eos=False)
        if not response:
            raise ValueError(f"{what}: row {number}: the response {row['response']!r} tokenises "
                             "to zero tokens; there is nothing to score")
        examples.append(Example(tokenizer.encode(row["prompt"], bos=True, eos=False), response))
    return examples


# --------------------------------------------------------------------------- GRPO stand-in rollouts


def corrupted_answers(answer: str, group_size: int, rng: random.Random) -> list[str]:
    """``group_size`` stand-in rollouts for one question: the reference and variants of it.

    Variant k (cycling): 0 the reference (correct); 1 the final number changed (wrong); 2 the
    reasoning lines in another order with the right final number (correct); 3 cut before the
    final ``####`` (no answer: wrong). So every group holds both rewards when ``group_size >= 2``.
    """
    lines = answer.split("\n")
    body, last = lines[:-1], lines[-1]
    final = final_answer(answer)
    variants = []
    for k in range(group_size):
        kind = k % 4
        if kind == 0:
            variants.append(answer)
        elif kind == 1:
            wrong = int(float(final)) + rng.randint(1, 9)
            variants.append("\n".join(body + [f"#### {wrong}"]))
        elif kind == 2:
            shuffled = body[:]
            rng.shuffle(shuffled)
            variants.append("\n".join(shuffled + [last]))
        else:
            variants.append("\n".join(body) if body else "I do not know.")
    return variants


def reward(response: str, reference: str) -> float:
    """1.0 when the final ``####`` numbers of ``response`` and ``reference`` match, else 0.0."""
    got = final_answer(response)
    return float(got is not None and got == final_answer(reference))


# --------------------------------------------------------------------------- packing


def pack_rows(lengths: Sequence[int], seq_length: int, alignment: int) -> list[list[int]]:
    """Greedy in-order packing: indices of the examples of each row of ``seq_length`` tokens.

    Example i takes ``ceil(lengths[i] / alignment) * alignment`` tokens; a row is closed when the
    next example does not fit. Examples longer than ``seq_length`` must be removed first.
    """
    rows, current, used = [], [], 0
    for i, n in enumerate(lengths):
        size = -(-n // alignment) * alignment
        if current and used + size > seq_length:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        rows.append(current)
    return rows


def sequence_ids(cu_seqlens_padded: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: index of the packed sequence each position belongs to."""
    positions = torch.arange(total, device=cu_seqlens_padded.device)
    return torch.searchsorted(cu_seqlens_padded[1:].to(torch.int64), positions, right=True)


def block_causal_mask(cu_seqlens_padded: torch.Tensor, total: int) -> torch.Tensor:
    """Megatron attention mask ``[1, 1, T, T]`` bool (True = masked) of a packed row.

    Position i attends to j iff both lie in the same padded sequence and j <= i: the
    block-diagonal causal mask equivalent to THD attention with these ``cu_seqlens``.
    """
    seq = sequence_ids(cu_seqlens_padded, total)
    positions = torch.arange(total, device=seq.device)
    masked = (seq[:, None] != seq[None, :]) | (positions[None, :] > positions[:, None])
    return masked[None, None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """One packed row ready for ``GPTModel``.

    ``model_inputs``: keyword arguments of the model call (``input_ids`` / ``position_ids``
    ``[1, T]`` int64, and either ``attention_mask`` ``[1, 1, T, T]`` bool or
    ``packed_seq_params``). ``labels``: int64 ``[1, T]`` (ignored positions hold 0, a valid id,
    so that Megatron's own loss accepts them; ``loss_mask`` removes them). ``loss_mask``: float32
    ``[1, T]``, 1.0 where the label is a response token. ``packed``: the
    :class:`~megatron_vocabstats.packing.PackedBatch` (cu_seqlens for unpacking).
    ``num_sequences``: examples in the row; ``real_tokens``: their tokens (no padding).
    """

    model_inputs: dict[str, Any]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    packed: PackedBatch
    num_sequences: int
    real_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.labels.shape[-1]


def make_batch(examples: Sequence[Example], *, seq_length: int, alignment: int,
               device: torch.device, thd: bool, pad_token_id: int = 0) -> Batch:
    """Pack ``examples`` into one row of ``seq_length`` tokens (see :class:`Batch`).

    ``thd=True`` passes Megatron ``packed_seq_params`` (transformer-engine attention on CUDA);
    otherwise a block-diagonal causal ``attention_mask`` (Megatron's local attention rejects
    ``packed_seq_params``). The response mask comes from packing 0/1 flags the same way: the flag
    "label" of a position is the flag of its next token.

    Raises:
        ValueError: the examples do not fit ``seq_length`` (from ``pack_sequences``).
    """
    sequences = [torch.tensor(ex.prompt + ex.response, dtype=torch.int64, device=device)
                 for ex in examples]
    flags = [torch.tensor([0] * len(ex.prompt) + [1] * len(ex.response), dtype=torch.int64,
                          device=device) for ex in examples]
    packed = pack_sequences(sequences, alignment=alignment, total_length=seq_length,
                            pad_token_id=pad_token_id, seq_params=thd)
    response = pack_sequences(flags, alignment=alignment, total_length=seq_length,
                              seq_params=False).labels == 1
    inputs = {"input_ids": packed.tokens, "position_ids": packed.position_ids}
    if thd:
        inputs["attention_mask"] = None
        inputs["packed_seq_params"] = packed.packed_seq_params
    else:
        inputs["attention_mask"] = block_causal_mask(packed.cu_seqlens_padded, seq_length)
    return Batch(model_inputs=inputs, labels=packed.labels.clamp(min=0),
                 loss_mask=response.to(torch.float32), packed=packed,
                 num_sequences=len(examples),
                 real_tokens=sum(ex.num_tokens for ex in examples))


class PackedRows:
    """``examples`` packed in order into rows of ``seq_length`` tokens, built on demand.

    ``groups[i]`` lists the indices of the examples of row i (:func:`pack_rows`); ``rows[i]`` is
    its :class:`Batch` (:func:`make_batch`), built when asked for so that a large dataset never
    holds every row (and its ``[T, T]`` mask) at once.
    """

    def __init__(self, examples: Sequence[Example], *, seq_length: int, alignment: int,
                 device: torch.device, thd: bool):
        self.examples = list(examples)
        self.groups = pack_rows([e.num_tokens for e in self.examples], seq_length, alignment)
        self._layout = dict(seq_length=seq_length, alignment=alignment, device=device, thd=thd)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> Batch:
        return make_batch([self.examples[k] for k in self.groups[i]], **self._layout)

