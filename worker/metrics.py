"""The worker's Prometheus metrics, in a registry of its own per server (no global state:
a process may build, tear down and rebuild a server).

Exported names (all prefixed `resident_`):
- `request_ttft_seconds`, `request_inter_token_latency_seconds`, `request_e2e_latency_seconds`
  (histograms), `request_success_total{finish_reason}` (stop, length, and abort: the client
  went away or the request was cancelled)
- `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_ratio` (gauges, set after
  every engine step)
- `prompt_tokens_total`, `generation_tokens_total` (counters)
- `worker_startup_phase_seconds{phase}`: import, weights, verify, tokenizer, kv_alloc,
  warmup, total (process start to ready) — the names `resident demo`/`bench restart` read.
- speculative decoding (only when the worker speculates): `worker_spec_drafts_total`
  (verification steps with draft tokens), `worker_spec_proposed_tokens_total`,
  `worker_spec_accepted_tokens_total` (counters), `worker_spec_acceptance_rate` (accepted /
  proposed) and `worker_spec_mean_accepted_length` (accepted per verification step; tokens
  per step = 1 + this) (gauges, over the worker's life).

The request-level metrics are also exposed under vLLM's names (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, each labelled `model_name`), so dashboards and autoscalers
written for vLLM read a resident worker unchanged: copies made when /metrics is rendered
(`VllmNames`), not a second set of counters to update.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STARTUP_PHASES = ("import", "cuda_context", "weights", "verify", "tokenizer", "kv_alloc", "warmup", "graphs", "total")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


#: resident's metric -> vLLM's name for the same measure
VLLM_NAMES = {
    "resident_num_requests_running": "vllm:num_requests_running",
    "resident_num_requests_waiting": "vllm:num_requests_waiting",
    "resident_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "resident_prompt_tokens": "vllm:prompt_tokens",
    "resident_generation_tokens": "vllm:generation_tokens",
    "resident_request_success": "vllm:request_success",
    "resident_request_ttft_seconds": "vllm:time_to_first_token_seconds",
    "resident_request_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "resident_request_e2e_latency_seconds": "vllm:e2e_request_latency_seconds",
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}


class VllmNames:
    """A collector of `source`'s VLLM_NAMES metrics under vLLM's names, labelled model_name."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            new = VLLM_NAMES.get(family.name)
            if new is None:
                continue
            copy = Metric(new, family.documentation + " (vLLM's name)", family.type, family.unit)
            for sample in family.samples:
                labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                copy.add_sample(new + sample.name[len(family.name):], {**labels, "model_name": self.model_name},
                                sample.value, sample.timestamp, sample.exemplar)
            yield copy


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("resident_request_ttft_seconds", "Time from request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("resident_request_inter_token_latency_seconds",
                                     "Time between successive tokens of one request.",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("resident_request_e2e_latency_seconds", "Time from arrival to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.success = Counter("resident_request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        self.running = Gauge("resident_num_requests_running", "Requests running in the engine.", registry=r)
        self.waiting = Gauge("resident_num_requests_waiting", "Requests waiting for the engine.", registry=r)
        self.kv_usage = Gauge("resident_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).",
                              registry=r)
        self.prompt_tokens = Counter("resident_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("resident_generation_tokens", "Tokens generated.", registry=r)
        self.startup = Gauge("resident_worker_startup_phase_seconds",
                             "Worker start-up phases in seconds; total = process start to ready.",
                             ["phase"], registry=r)
        self.info = Gauge("resident_worker_info", "Constant 1, labelled with what this worker serves.",
                          ["model", "weights_source"], registry=r)
        self._model_name = model_name
        self.vllm_registry = CollectorRegistry()   # the vLLM-named copies (VllmNames)
        self.vllm_registry.register(VllmNames(r, model_name))
        self._spec: tuple[Counter, Counter, Counter, Gauge, Gauge] | None = None
        self._spec_totals = (0, 0, 0)

    def set_startup_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            if phase not in STARTUP_PHASES:
                raise ValueError(f"unknown start-up phase {phase!r}; known: {', '.join(STARTUP_PHASES)}")
            self.startup.labels(phase=phase).set(seconds)

    def set_weights_source(self, source: str) -> None:
        self.info.labels(model=self._model_name, weights_source=source).set(1)

    def observe_engine(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Called from the engine thread after each step (prometheus_client is thread-safe)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def observe_spec(self, num_drafts: int, num_proposed: int, num_accepted: int) -> None:
        """Speculative decoding totals so far (the engine's cumulative counts)."""
        if self._spec is None:
            r = self.registry
            self._spec = (
                Counter("resident_worker_spec_drafts", "Verification steps with draft tokens.", registry=r),
                Counter("resident_worker_spec_proposed_tokens", "Draft tokens proposed.", registry=r),
                Counter("resident_worker_spec_accepted_tokens", "Draft tokens accepted by the target.", registry=r),
                Gauge("resident_worker_spec_acceptance_rate", "Accepted / proposed draft tokens.", registry=r),
                Gauge("resident_worker_spec_mean_accepted_length",
                      "Draft tokens accepted per verification step (tokens per step = 1 + this).", registry=r),
            )
        drafts, proposed, accepted, rate, length = self._spec
        new = (num_drafts, num_proposed, num_accepted)
        for counter, now, before in zip((drafts, proposed, accepted), new, self._spec_totals):
            if now > before:
                counter.inc(now - before)
        self._spec_totals = new
        rate.set(num_accepted / num_proposed if num_proposed else 0.0)
        length.set(num_accepted / num_drafts if num_drafts else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)
