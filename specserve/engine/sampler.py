"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

One call handles every sampling row of a step. Random rows draw with the exponential-race
trick (argmax of p / E, E ~ Exp(1)), which lets a seeded request use its own generator while
the others share one draw; nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.host_copy import host_to_device
from specserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float; 0 means greedy
    top_k: torch.Tensor  # [N] long; 0 means off
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    generators: list[torch.Generator | None]  # per row; None: the engine's shared generator
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              device: torch.device) -> "SamplingBatch":
        temps = [0.0 if p.greedy else float(p.temperature) for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        top_p = [float(p.top_p) for p in params]
        min_p = [float(p.min_p) for p in params]
        return cls(  # (copies without a host sync: the device may still run the forward they follow)
            temperature=host_to_device(temps, device, torch.float32),
            top_k=host_to_device(top_k, device, torch.long),
            top_p=host_to_device(top_p, device, torch.float32),
            min_p=host_to_device(min_p, device, torch.float32),
            generators=generators,
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
        )

    def select(self, rows: torch.Tensor | list[int]) -> "SamplingBatch":
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.temperature.device)
        rows_l = idx.tolist()
        return SamplingBatch(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                             [self.generators[r] for r in rows_l], self.all_greedy, self.any_top_k,
                             self.any_top_p, self.any_min_p)


def processed_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution a random row samples from: temperature, then top-k, top-p, min-p.

    Greedy rows (temperature 0) get a one-hot at the argmax, so verification treats them alike.
    """
    greedy = sb.temperature == 0
    temp = torch.where(greedy, torch.ones_like(sb.temperature), sb.temperature)
    x = logits.float() / temp[:, None]
    if sb.any_top_k or sb.any_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        v = x.shape[-1]
        ranks = torch.arange(v, device=x.device)[None, :]
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if sb.any_top_k:
            k = torch.where(sb.top_k > 0, sb.top_k, torch.full_like(sb.top_k, v))
            drop |= ranks >= k[:, None]
        if sb.any_top_p:
            p_sorted = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
            before = p_sorted.cumsum(-1) - p_sorted  # mass strictly above this token
            drop |= before > sb.top_p[:, None]
        drop[:, 0] = False
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    if sb.any_min_p:
        thresh = probs.max(dim=-1, keepdim=True).values * sb.min_p[:, None]
        probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    q = torch.empty(shape, device=device)
    if not any(g is not None for g in generators):
        return q.exponential_(generator=shared)
    q.exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q


def draw(probs: torch.Tensor, sb: SamplingBatch, shared: torch.Generator | None) -> torch.Tensor:
    q = exponential_noise(tuple(probs.shape), sb.generators, shared, probs.device)
    return (probs / q).argmax(dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch, shared: torch.Generator | None = None) -> torch.Tensor:
    """[N, V] logits -> [N] token ids."""
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    return draw(processed_probs(logits, sb), sb, shared)


@dataclass
class TopLogprobs:
    """``top_logprobs_on_device``'s tensors, read back by ``dicts``."""

    chosen: torch.Tensor  # [N] the chosen tokens' log-probabilities
    vals: torch.Tensor | None  # [N, n] the top n, or None for n = 0
    ids: torch.Tensor | None

    def map(self, fn) -> "TopLogprobs":
        return TopLogprobs(fn(self.chosen), None if self.vals is None else fn(self.vals),
                           None if self.ids is None else fn(self.ids))

    def dicts(self, tokens: list[int], wanted: list[int | None] | None = None) -> list[dict[int, float]]:
        """Per row: the chosen token, then row r's top ``wanted[r]`` (default: all n computed)."""
        chosen = self.chosen.tolist()
        vals_l = self.vals.tolist() if self.vals is not None else None
        ids_l = self.ids.tolist() if self.ids is not None else None
        out: list[dict[int, float]] = []
        for r, tok in enumerate(tokens):
            d = {tok: chosen[r]}
            if vals_l is not None and ids_l is not None:
                n = len(ids_l[r]) if wanted is None else wanted[r] or 0
                for i, v in zip(ids_l[r][:n], vals_l[r][:n]):
                    d.setdefault(i, v)
            out.append(d)
        return out


def top_logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> TopLogprobs:
    """Log-probabilities of the model's raw distribution, the chosen token's and the top ``n``, left on
    the device (no host sync)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0]
    if n > 0:
        vals, ids = lp.topk(n, dim=-1)
        return TopLogprobs(chosen, vals, ids)
    return TopLogprobs(chosen, None, None)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[dict[int, float]]:
    """Log-probabilities of the model's raw distribution: the chosen token plus the top ``n``."""
    return top_logprobs_on_device(logits, tokens, n).dicts(tokens.tolist())
