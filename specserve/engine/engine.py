"""LLMEngine: request -> schedule -> (draft) -> forward/verify -> commit -> outputs.

Not thread-safe: one thread drives ``step()`` (the server's engine thread, or LLM.generate).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.config import EngineConfig
from specserve.distributed.parallel import check_tp_shapes
from specserve.engine import gc_pauses
from specserve.engine.kv_cache import BlockManager, WindowBlocks
from specserve.engine.request import Request, Status
from specserve.engine.runner import LaunchedStep, ModelRunner, kv_layout, num_kv_blocks_for
from specserve.engine.scheduler import CommitResult, Scheduler, StepPlan
from specserve.engine.stop import streamable_text_end
from specserve.loader.tokenizer import IncrementalDetokenizer
from specserve.models.cpu_packing import pack_for_cpu
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from specserve.distributed.driver import TPDriver
    from specserve.distributed.parallel import TPGroup
    from specserve.loader import ModelSource

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting_requests; retry later."""


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    spec_steps: int = 0  # steps in which at least one request verified drafts
    spec_verify_steps: int = 0  # per-request verifies
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_drafted_per_position: list[int] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)  # k chosen per request-step

    @property
    def avg_accept_length(self) -> float | None:
        if not self.spec_verify_steps:
            return None
        return (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps


def served_model_name(path: str | None) -> str:
    """Name clients use for the model: the file or folder name, without a .gguf suffix."""
    if path is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(path))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on a CPU with bf16 units, else float32 (docs/decisions.md)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()) else torch.float32
    return getattr(torch, name)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX), not by converting to fp32."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def load_target(src: "ModelSource", config: EngineConfig, device: torch.device, dtype: torch.dtype,
                tp: "TPGroup | None" = None) -> tuple[torch.nn.Module, int]:
    """The target model with its weights (``tp``: this rank's shard, read as such), its linear layers
    packed on the CPU; and how many were packed."""
    from specserve.loader import dummy_weights
    from specserve.models.registry import build_model

    model = build_model(src.config, device, dtype, tp)
    if config.load_format == "dummy":
        model.load_weights(dummy_weights(src.config, device))
    else:
        model.load_weights(src.weights(sliced=tp is not None))
    model.eval()
    return model, pack_for_cpu(model, config.cpu_weight_packing, device, dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from specserve.loader import load_model_source

        t0 = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        src = load_model_source(config.model, tokenizer_path=config.tokenizer,
                                require_weights=config.load_format != "dummy")
        self.model_config = src.config
        log.info("loading the %s of %s (%s) on %s/%s...", "dummy weights" if config.load_format == "dummy" else "weights",
                 os.path.basename(src.path), src.format, self.device, str(self.dtype).replace("torch.", ""))
        self.tokenizer = src.tokenizer
        self.model_name = served_model_name(config.model)
        # rank 0 of a tensor-parallel group: the other ranks run each target call on their shards
        self.tp: TPDriver | None = None
        runner_mc, runner_config = src.config, config
        if config.tensor_parallel_size > 1:
            from specserve.distributed.driver import start_tensor_parallel

            check_tp_shapes(src.config, config.tensor_parallel_size)
            self.tp = start_tensor_parallel(config, self.device)
            self.device = self.tp.tp.device
            runner_mc = self.tp.tp.local_config(src.config)  # this rank's heads
            runner_config = dataclasses.replace(config, enforce_eager=True)  # (no CUDA graphs across ranks yet)
        if config.speculative is not None:  # its depth by whether steps replay CUDA graphs
            spec = config.speculative.resolved(self.device.type == "cuda" and not runner_config.enforce_eager)
            self.config = config = dataclasses.replace(config, speculative=spec)
            runner_config = dataclasses.replace(runner_config, speculative=spec)
        model, self.packed_linears = load_target(src, config, self.device, self.dtype, self.tp and self.tp.tp)
        ctx = src.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > ctx:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {ctx}")
        # the budget per layer type: sliding-window layers keep only their window's blocks (a pool of their own)
        layout = kv_layout(config, runner_mc, num_kv_blocks_for(config, runner_mc, self.dtype, self.device),
                           self.dtype, config.max_model_len or ctx)
        if self.tp is not None:
            self.tp.init_workers(layout)
        self.runner = ModelRunner(model, runner_mc, runner_config, layout, self.device, self.dtype,
                                  eos_token_ids=frozenset(self.tokenizer.eos_token_ids), driver=self.tp)
        self.blocks = BlockManager(layout.num_blocks, config.block_size, config.enable_prefix_caching)
        window = None if layout.window is None else WindowBlocks(layout.num_window_blocks, config.block_size,
                                                                 layout.window, config.enable_prefix_caching)
        if window is not None:
            log.info("KV cache: %d blocks of the full-attention layers, %d of the sliding-window (%d) layers",
                     layout.num_blocks, layout.num_window_blocks, layout.window)
        self.max_model_len = min(config.max_model_len or ctx, layout.num_blocks * config.block_size)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len, set(self.tokenizer.eos_token_ids), window)
        self.requests: dict[str, Request] = {}
        self._grammars = None  # structured.grammar.GrammarCompiler, built by the first constrained request
        gc_pauses.install()
        self.step_started = 0.0  # gc_pauses.clock() at the start of the current step()
        self.step_ended = 0.0  # ... and at the end of the last step() that served requests
        self.stats = EngineStats()
        self.overlap = config.overlap_schedule == "on" or (config.overlap_schedule == "auto" and self.device.type == "cuda")
        # overlap scheduling: the plain step launched ahead, its plan advanced (Scheduler.advance) at commit
        self._ahead: tuple[StepPlan, LaunchedStep] | None = None
        self.drafter = None
        if config.speculative is not None:
            from specserve.speculative.drafter import EagleSpeculator

            self.drafter = EagleSpeculator(self)
        self.runner.capture_graphs()  # after the drafter: it sets the target's aux outputs
        if self.drafter is not None:
            self.drafter.after_capture()  # its cost profile measures the graphs
        self.load_time_s = time.perf_counter() - t0
        log.info("engine ready in %.2fs: %s on %s/%s, %d KV blocks x %d (%s), max_model_len %d%s%s",
                 self.load_time_s, self.model_name, self.device, self.dtype, self.blocks.num_blocks, config.block_size,
                 str(self.runner.kv_dtype).replace("torch.", ""), self.max_model_len,
                 ", overlap scheduling" if self.overlap else "",
                 f", tensor parallel over {config.tensor_parallel_size} ranks" if self.tp else "")

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        if isinstance(prompt, str):
            # with the tokenizer's post-processor: a BOS where the model's tokenizer adds one (Gemma)
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        params.validate()
        vocab = self.model_config.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got "
                             f"{sorted(t for t in params.logit_bias if t >= vocab)[:5]}")
        max_new = params.max_tokens if params.max_tokens is not None else 1
        if len(ids) + max_new > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request has "
                f"{len(ids)} prompt tokens and asks for {max_new} more ({len(ids) + max_new} in all)"
            )
        req = Request(request_id, text, ids, params, arrival_time=arrival_time or time.time())
        req.detok = IncrementalDetokenizer(self.tokenizer, ids)
        if params.structured_outputs is not None:  # its grammar: state and mask (structured/matcher.py)
            req.grammar = self._grammar_state(request_id, params)
            req.logits_processors.append(req.grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(ids)

    def _grammar_state(self, request_id: str, params: SamplingParams):
        from specserve.structured.grammar import GrammarCompiler
        from specserve.structured.matcher import GrammarState

        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return GrammarState(self._grammars.submit(params.structured_outputs), self.model_config.vocab_size, request_id)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return
        self.scheduler.finish(req, "abort")
        if self.drafter is not None:
            self.drafter.release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.tp is not None:
            self.tp.shutdown()

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_started = gc_pauses.clock()
        d = self.drafter
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0].all_finished:
            ahead = None  # every request in it ended: nothing to read
        plan = ahead[0] if ahead is not None else self.scheduler.schedule()  # who runs, how many tokens each
        if d is not None:
            for req in plan.preempted:
                d.release(req)
        if not plan.scheduled:
            return []
        if d is not None and plan.num_drafts:
            result = d.verify_step(plan)  # forward over drafts + acceptance
        else:
            result = self._plain_step(plan, None if ahead is None else ahead[1])
        touched = self.scheduler.commit(plan, result, self._detokenize)  # append tokens, stops, free
        if d is not None:
            d.draft_step(plan, result)  # decide k, draft for the next step
        self._account(plan)
        outputs = [out for r in touched if (out := self._output(r)) is not None]
        self.step_ended = gc_pauses.clock()
        return outputs

    def _plain_step(self, plan: StepPlan, launched: LaunchedStep | None) -> CommitResult:
        """Forward + sampling (``launched``: queued by the last step already). With overlap scheduling, the
        next step is scheduled over this one's pending tokens and launched before they are read back,
        where it is known to be plain too (the drafter's policy may say so before the sync)."""
        d = self.drafter
        own_time = launched is None  # (a step launched ahead, or that launches the next, is not timed alone)
        if d is not None:
            launched = d.plain_step(plan, launched)
        elif launched is None:
            launched = self.runner.launch(plan)
        went_ahead = False
        # (a request whose logits are processed needs its history on the host: no step goes ahead of it)
        if self.overlap and not any(s.req.processes_logits for s in plan.scheduled) and (d is None or d.plain_next(plan)):
            self.scheduler.advance(plan)
            nxt = self.scheduler.schedule()
            if nxt.scheduled:
                self._ahead = (nxt, d.launch_ahead(nxt, launched) if d is not None else self.runner.launch(nxt, launched))
                went_ahead = True
        result = launched.result()  # the step's host sync: the next step is queued behind it
        if d is not None:
            d.observe_plain(plan, result, own_time and not went_ahead)
        return result

    # -- helpers -----------------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        """Of the KV pool closest to full (with sliding-window layers: theirs or the full-attention layers')."""
        window = self.scheduler.window
        return max(self.blocks.usage, window.pool.usage) if window is not None else self.blocks.usage

    def _detokenize(self, req: Request) -> None:
        req.text += req.detok.append(req.output_token_ids[-1])

    def _account(self, plan) -> None:
        s = self.stats
        s.steps += 1
        s.generation_tokens = self.scheduler.num_generated_tokens
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_usage = self.kv_usage
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.blocks.stats.prefix_queries
        s.prefix_cache_hits = self.blocks.stats.prefix_hits

    def _output(self, req: Request) -> RequestOutput | None:
        """The request's output after this step, as its params' output_kind asks (None: none now)."""
        finished = req.status == Status.FINISHED
        kind = req.params.output_kind
        if finished:
            self.requests.pop(req.request_id, None)
            if self.drafter is not None:
                self.drafter.release(req)
        elif kind is RequestOutputKind.FINAL_ONLY:
            return None
        first_new = req.num_emitted_tokens
        new_ids = req.output_token_ids[first_new:]
        text_end = max(req.num_emitted_chars, streamable_text_end(req.text, req.params, finished))
        new_text = req.text[req.num_emitted_chars : text_end]
        req.num_emitted_tokens = req.num_output_tokens
        req.num_emitted_chars = text_end
        lps = req.logprobs
        if kind is RequestOutputKind.DELTA:
            comp = CompletionOutput(0, new_text, new_ids, req.finish_reason, req.stop_reason,
                                    lps[first_new:] if lps is not None else None)
        else:
            comp = CompletionOutput(0, req.text[:text_end], list(req.output_token_ids), req.finish_reason,
                                    req.stop_reason, list(lps) if lps is not None else None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], finished, req.metrics,
                             new_token_ids=new_ids, new_text=new_text)

    def get_stats(self) -> EngineStats:
        """A snapshot (safe to keep while the engine runs on)."""
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_usage = self.kv_usage
        if self.drafter is not None:  # the controller's counts (quick plain decisions do not copy them per step)
            self.stats.k_histogram = dict(self.drafter.controller.k_histogram)
        return dataclasses.replace(self.stats, k_histogram=dict(self.stats.k_histogram),
                                   spec_accepted_per_position=list(self.stats.spec_accepted_per_position),
                                   spec_drafted_per_position=list(self.stats.spec_drafted_per_position))
