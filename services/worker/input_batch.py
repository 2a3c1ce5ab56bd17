"""The worker's persistent batch: per-request state kept across steps, updated by diffs.

Rows are dense: request i of the batch lives in row i of every array; removing a request moves
the last row into its hole, so the arrays never need rebuilding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData
from services.worker.sampling_metadata import RequestSamplingTensors


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    sampling_tensors: RequestSamplingTensors  # built once, when the request joins the batch


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int64)  # [rows, len]
        self.token_ids_np = self.token_ids.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = torch.zeros((max_num_reqs, max_blocks), dtype=torch.int32)  # [rows, blocks]
        self.block_table_np = self.block_table.numpy()
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # each row's LoRA adapter id; 0: the base model
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.states: list[CachedRequestState] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, new: NewRequestData, sampling_tensors: RequestSamplingTensors) -> None:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the worker's batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"the worker's batch is full ({self.max_num_reqs} requests)")
        tokens = new.prompt_token_ids + new.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {len(tokens)} tokens; the limit is {self.max_model_len}")
        row = self.num_reqs
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        self.states.append(CachedRequestState(
            new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
            new.stop_token_ids, sampling_tensors,
        ))
        self.token_ids_np[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.lora_ids[row] = 0 if new.lora_request is None else new.lora_request.lora_int_id
        self.append_blocks(row, new.block_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table_np[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return  # finished before the worker ever saw it, or already removed
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.states[row] = self.states[last]
            self.row_of[moved] = row
            n = self.num_tokens[last]
            self.token_ids_np[row, :n] = self.token_ids_np[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            nb = self.num_blocks[last]
            self.block_table_np[row, :nb] = self.block_table_np[last, :nb]
            self.num_blocks[row] = nb
            self.lora_ids[row] = self.lora_ids[last]
        self.req_ids.pop()
        self.states.pop()

    def write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Speculative decoding: each request's drafted tokens after its known ones, as this step's
        inputs. num_tokens stays: the drafts become tokens only if append_tokens takes them."""
        for req_id, tokens in drafts.items():
            row = self.row_of[req_id]
            start = self.num_tokens[row]
            self.token_ids_np[row, start : start + len(tokens)] = tokens

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray, counts: np.ndarray) -> list[list[int]]:
        """Append counts[i] tokens to rows[i], taken in order from `token_ids` [counts.sum()].
        Returns each row's new tokens."""
        if not len(rows):
            return []
        self.token_ids_np[np.repeat(rows, counts), flat_ranges(self.num_tokens[rows], counts)] = token_ids
        self.num_tokens[rows] += counts
        new_tokens = np.split(token_ids, np.cumsum(counts)[:-1])
        per_row = [tokens.tolist() for tokens in new_tokens]
        for row, tokens in zip(rows.tolist(), per_row):
            self.states[row].output_token_ids.extend(tokens)
        return per_row


def flat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[counts.sum()] int64: starts[0] .. starts[0] + counts[0] - 1, then the same for row 1, ..."""
    total = int(counts.sum())
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(total)
