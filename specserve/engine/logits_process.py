"""Logits processing: the edits a sampling or verify row takes before its distribution is formed.

A row predicts output token number t of its request. Its history is the request's prompt, its
committed output and, in a verify, the draft prefix on the path to the row (tentative: the verify
may reject it):

    plain step                 1 row     drafts [[]]
    chain of k drafts          k + 1     [[], [d1], [d1, d2], ..., [d1 .. dk]]
    tree                       n + 1     each node's path below the root, [] for the root

so row i predicts output index len(output) + len(drafts[i]). Plain and verify steps call ``process``
with the same histories, so greedy and seeded outputs do not depend on speculation.

Edits, in order: penalties over the history (repetition_penalty, HF: a seen token's logit divided by
it where positive, multiplied where not, prompt and output; frequency_penalty and presence_penalty,
OpenAI: minus f x count and p x [count > 0] over the output), logit_bias (added), EOS and
stop_token_ids to -inf while t < min_tokens, then the request's own processors.

A processor plugs in per request, appended to ``Request.logits_processors`` when the request is made,
as any object with

    apply(logits: torch.Tensor, rows: RequestRows) -> None

which edits ``logits`` [n, V] float32 (the request's n rows, a view: edit in place, e.g. set masked
tokens to -inf; xgrammar's apply_token_bitmask_inplace fits). It is called once per step that samples
or verifies the request, before any distribution is taken from these rows. What it keeps between calls
must stay a function of the committed output: state advanced over ``rows.drafts`` (e.g. a grammar
matcher's accept_token) is rolled back before ``apply`` returns, as drafts are only tentative. The
committed output only grows from one call to the next (a matcher advances over ``rows.output`` past
what it has seen). A request with a processor gives up the steps that would not know its history on
the host (overlap scheduling's launch-ahead, the drafter's fused launches); the others are unaffected,
and a batch without one runs no code here (``Request.processes_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.engine.host_copy import host_to_device

if TYPE_CHECKING:
    from specserve.engine.request import Request


@dataclass
class RequestRows:
    """One request's rows in a step: row i's history is prompt + output + drafts[i]."""

    prompt: list[int]
    output: list[int]  # committed output tokens
    drafts: list[list[int]]  # per row, the tentative draft prefix before it

    def out_index(self, i: int) -> int:
        """The output index of the token row i predicts."""
        return len(self.output) + len(self.drafts[i])


class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, rows: RequestRows) -> None: ...


Span = tuple["Request", int, list[list[int]]]  # (request, its first row, its rows' draft prefixes)


def chain_prefixes(drafts: list[int]) -> list[list[int]]:
    """[d1, d2] -> [[], [d1], [d1, d2]]: the rows of a chain's verify."""
    return [drafts[:j] for j in range(len(drafts) + 1)]


def tree_prefixes(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's path below the root (node 0); parents come before children."""
    out: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + [tokens[i]])
    return out


def process(logits: torch.Tensor, spans: list[Span], eos_token_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """Every edit for the rows of ``spans`` (the requests with ``processes_logits``) of a step's logits
    [N, V]; other rows are left as they are. Returns new float32 logits (``logits`` is not changed:
    log-probabilities are the model's)."""
    x = logits.float().clone()
    for r, _, _ in spans:
        if r.num_pending_tokens:
            raise RuntimeError(f"request {r.request_id}'s history has a token still on the device")
    pen = [sp for sp in spans if sp[0].params.penalized]
    if pen:
        _penalize(x, pen)
    rows: list[int] = []
    toks: list[int] = []
    bias: list[float] = []
    masked_rows: list[int] = []
    masked_toks: list[int] = []
    for r, a, drafts in spans:
        p = r.params
        if p.logit_bias:
            ids, vals = list(p.logit_bias), list(p.logit_bias.values())
            for i in range(len(drafts)):
                rows.extend([a + i] * len(ids))
                toks.extend(ids)
                bias.extend(vals)
        if p.min_tokens:
            stops = sorted(set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids)))
            n_out = r.num_output_tokens
            for i, d in enumerate(drafts):
                if n_out + len(d) < p.min_tokens:
                    masked_rows.extend([a + i] * len(stops))
                    masked_toks.extend(stops)
    if rows:
        idx = host_to_device(rows + toks, x.device)
        x.index_put_((idx[: len(rows)], idx[len(rows) :]), host_to_device(bias, x.device, torch.float32),
                     accumulate=True)
    if masked_rows:
        idx = host_to_device(masked_rows + masked_toks, x.device)
        x.index_put_((idx[: len(masked_rows)], idx[len(masked_rows) :]), torch.tensor(float("-inf"), device=x.device))
    for r, a, drafts in spans:
        if r.logits_processors:
            view = RequestRows(r.prompt_token_ids, r.output_token_ids, drafts)
            for proc in r.logits_processors:
                proc.apply(x[a : a + len(drafts)], view)
    return x


def _penalize(x: torch.Tensor, spans: list[Span]) -> None:
    """Repetition, frequency and presence penalties on the rows of ``spans``, in place."""
    V = x.shape[1]
    rows: list[int] = []  # the rows edited
    row_req: list[int] = []  # ... and their request (index in spans)
    out_req: list[int] = []  # (request, token) per committed output token
    out_tok: list[int] = []
    draft_row: list[int] = []  # (edited row, token) per draft token in its prefix
    draft_tok: list[int] = []
    prompt_req: list[int] = []  # (request, token) per prompt token (repetition penalty only)
    prompt_tok: list[int] = []
    params: list[float] = []
    for j, (r, a, drafts) in enumerate(spans):
        p = r.params
        out_req.extend([j] * r.num_output_tokens)
        out_tok.extend(r.output_token_ids)
        if p.repetition_penalty != 1:
            prompt_req.extend([j] * r.num_prompt_tokens)
            prompt_tok.extend(r.prompt_token_ids)
        for i, d in enumerate(drafts):
            draft_row.extend([len(rows)] * len(d))
            draft_tok.extend(d)
            rows.append(a + i)
            row_req.append(j)
            params += [p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
    lens = [len(rows), len(row_req), len(out_req), len(out_tok), len(draft_row), len(draft_tok), len(prompt_req)]
    cuts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    t = host_to_device(rows + row_req + out_req + out_tok + draft_row + draft_tok + prompt_req + prompt_tok, x.device)
    rows_d, row_req_d, out_req_d, out_tok_d, draft_row_d, draft_tok_d, prompt_req_d = (
        t[cuts[i] : cuts[i + 1]] for i in range(len(lens)))
    prompt_tok_d = t[cuts[-1] :]
    rep, freq, pres = host_to_device(params, x.device, torch.float32).view(-1, 3).unbind(1)
    counts = torch.zeros(len(spans), V, device=x.device)
    counts.index_put_((out_req_d, out_tok_d), torch.ones(1, device=x.device), accumulate=True)
    counts = counts.index_select(0, row_req_d)  # [R, V] output counts, then each row's drafts
    counts.index_put_((draft_row_d, draft_tok_d), torch.ones(1, device=x.device), accumulate=True)
    sub = x.index_select(0, rows_d)
    if prompt_tok:
        in_prompt = torch.zeros(len(spans), V, dtype=torch.bool, device=x.device)
        in_prompt[prompt_req_d, prompt_tok_d] = True
        seen = (counts > 0) | in_prompt.index_select(0, row_req_d)
        sub = torch.where(seen & (rep[:, None] != 1), torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None]), sub)
    sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    x.index_copy_(0, rows_d, sub)
