"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

One call handles every sampling row of a step. Random rows draw with the exponential-race
trick (argmax of p / E, E ~ Exp(1)). Unseeded rows share the engine's generator. A seeded row's
E is a hash of (seed, output index, token id) computed on the device (``seeded_exponential``), so
the token a seeded request draws at output index t depends on nothing else: not the batch, not
whether speculation verified it. Nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.host_copy import host_to_device
from specserve.sampling_params import SamplingParams

M32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float; 0 means greedy
    top_k: torch.Tensor  # [N] long; 0 means off
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    out_index: torch.Tensor  # [N] long: the output index of the token each row draws
    seeds: torch.Tensor  # [N, 2] long: the seed's low and high 32 bits (seeded rows)
    seeded: list[int]  # rows drawn from their seed (random rows of seeded requests)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], out_index: list[int] | torch.Tensor,
              device: torch.device) -> "SamplingBatch":
        """Row i samples with ``params[i]`` the output token number ``out_index[i]`` (0: the first)."""
        temps = [0.0 if p.greedy else float(p.temperature) for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        seeded = [i for i, p in enumerate(params) if p.seeded]
        seeds = [0] * (2 * len(params))
        for i in seeded:
            s = params[i].seed & (2**64 - 1)  # (an OpenAI seed may be negative)
            seeds[2 * i], seeds[2 * i + 1] = s & M32, s >> 32
        n = len(params)
        ints = top_k + seeds + (out_index if isinstance(out_index, list) else [])
        floats = temps + [float(p.top_p) for p in params] + [float(p.min_p) for p in params]
        # (copies without a host sync: the device may still run the forward they follow)
        i_d, f_d = host_to_device(ints, device, torch.long), host_to_device(floats, device, torch.float32)
        out_d = i_d[3 * n :] if isinstance(out_index, list) else out_index
        return cls(
            temperature=f_d[:n], top_k=i_d[:n], top_p=f_d[n : 2 * n], min_p=f_d[2 * n :],
            out_index=out_d, seeds=i_d[n : 3 * n].view(n, 2), seeded=seeded,
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )

    def select(self, rows: list[int]) -> "SamplingBatch":
        idx = host_to_device(rows, self.temperature.device)
        was = set(self.seeded)
        seeded = [i for i, r in enumerate(rows) if r in was]
        return SamplingBatch(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                             self.out_index[idx], self.seeds[idx], seeded, self.all_greedy, self.any_top_k,
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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply rounds) of int64 tensors holding 32-bit values:
    multipliers below 2**31 keep each product below 2**63, so int64 arithmetic never overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x21F0AAAD) & M32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, out_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [S, vocab], entry (i, v) a function of (seeds[i], out_index[i], v) alone: a
    counter-based hash, 24 bits of uniform per entry (u = (h + 0.5) / 2**24, E = -log u)."""
    k1 = _mix32(seeds[:, 0] ^ _mix32(out_index & M32))
    k2 = _mix32(seeds[:, 1] ^ _mix32(k1 ^ 0x9E3779B9))
    v = torch.arange(vocab, device=seeds.device)
    h = _mix32(_mix32(k1[:, None] ^ v[None, :]) ^ k2[:, None])
    return -torch.log(((h >> 8).float() + 0.5) * 2.0**-24)


def exponential_noise(shape: tuple[int, int], sb: SamplingBatch, shared: torch.Generator | None,
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise per row: seeded rows' from their seed and output index, the others' from ``shared``."""
    if len(sb.seeded) == shape[0]:
        return seeded_exponential(sb.seeds, sb.out_index, shape[1])
    q = torch.empty(shape, device=device).exponential_(generator=shared)
    if sb.seeded:
        idx = host_to_device(sb.seeded, device)
        q.index_copy_(0, idx, seeded_exponential(sb.seeds[idx], sb.out_index[idx], shape[1]))
    return q


def draw(probs: torch.Tensor, sb: SamplingBatch, shared: torch.Generator | None) -> torch.Tensor:
    q = exponential_noise(tuple(probs.shape), sb, shared, probs.device)
    return (probs / q).argmax(dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch, shared: torch.Generator | None = None) -> torch.Tensor:
    """[N, V] logits -> [N] token ids."""
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    return draw(processed_probs(logits, sb), sb, shared)


def picks(logits: torch.Tensor, sb: SamplingBatch | None, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """The token plain sampling takes at each row where it is not left to chance: the argmax (greedy
    rows; ``argmax`` if computed already), a seeded row's draw. Other rows: their argmax (unused)."""
    out = logits.argmax(dim=-1) if argmax is None else argmax
    if sb is None or not sb.seeded:
        return out
    idx = host_to_device(sb.seeded, logits.device)
    sub = sb.select(sb.seeded)
    return out.index_copy(0, idx, draw(processed_probs(logits.index_select(0, idx), sub), sub, None))


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
