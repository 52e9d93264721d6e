"""Engine metrics as Triton custom metric families, on the server's /metrics endpoint.

The reporter reads the engine's totals from its own thread; the step loop only adds to them.
It is handed Triton's Python-backend utilities module, so this package never imports Triton.
"""

from __future__ import annotations

from tritone.engine.core import PHASES

_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0, 30.0]


class EngineMetrics:
    """The metrics of each engine, labelled engine="0", "1", ... (several under data
    parallelism). Read through the AsyncEngines, so that an engine rebuilt after a worker died is
    the one reported."""

    def __init__(self, pb_utils, engines: list, model_name: str = "llm"):
        family = pb_utils.MetricFamily
        # A family must outlive its metrics, or setting them fails.
        self.families = {}
        g, c, h = family.GAUGE, family.COUNTER, family.HISTOGRAM
        specs = {
            "running": ("tritone_num_requests_running", "Requests in the running batch", g),
            "waiting": ("tritone_num_requests_waiting", "Requests waiting for admission", g),
            "blocks_used": ("tritone_kv_blocks_used", "KV cache blocks in use", g),
            "blocks_free": ("tritone_kv_blocks_free", "KV cache blocks free (cached or empty)", g),
            "prefix_hit_rate": ("tritone_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache, fraction, over the last 1000 prompts", g),
            "forward_busy": ("tritone_forward_busy_fraction",
                             "Fraction of engine wall time in the model forward pass, since the last report", g),
            "prompt_tokens": ("tritone_prompt_tokens_total", "Prompt tokens computed", c),
            "generation_tokens": ("tritone_generation_tokens_total", "Tokens generated", c),
            "preemptions": ("tritone_preemptions_total", "Requests preempted for recompute", c),
            "forward_seconds": ("tritone_forward_seconds_total", "Seconds in the model forward pass", c),
            "phases": ("tritone_step_phase_seconds_total",
                       "Seconds of engine steps per phase: schedule, prepare (model inputs), forward, sample, update "
                       "(engine thread); send (sender thread)", c),
            "steps": ("tritone_steps_total", "Engine steps", c),
            "idle_seconds": ("tritone_engine_idle_seconds_total",
                             "Seconds the engine thread waited with no request to run", c),
            "restarts": ("tritone_engine_restarts_total", "Engine restarts after a model worker process died", c),
            "ttft": ("tritone_time_to_first_token_seconds", "Time from arrival to first token", h),
            "itl": ("tritone_inter_token_latency_seconds", "Time between tokens of a request", h),
        }
        for key, (name, description, kind) in specs.items():
            self.families[key] = family(name=name, description=description, kind=kind)
        self.reporters = [_EngineReporter(self.families, source, {"model": model_name, "engine": str(i)})
                          for i, source in enumerate(engines)]

    def report(self, now: float) -> None:
        for reporter in self.reporters:
            reporter.report(now)


class _EngineReporter:
    def __init__(self, families: dict, source, labels: dict[str, str]):
        self.source = source

        def metric(key, **kwargs):
            return families[key].Metric(labels=labels, **kwargs)

        self.running, self.waiting = metric("running"), metric("waiting")
        self.blocks_used, self.blocks_free = metric("blocks_used"), metric("blocks_free")
        self.prefix_hit_rate, self.forward_busy = metric("prefix_hit_rate"), metric("forward_busy")
        self.prompt_tokens, self.generation_tokens = metric("prompt_tokens"), metric("generation_tokens")
        self.preemptions, self.forward_seconds = metric("preemptions"), metric("forward_seconds")
        self.phases = {phase: families["phases"].Metric(labels={**labels, "phase": phase}) for phase in PHASES}
        self.steps, self.idle_seconds, self.restarts = metric("steps"), metric("idle_seconds"), metric("restarts")
        self.ttft = metric("ttft", buckets=_LATENCY_BUCKETS)
        self.itl = metric("itl", buckets=_LATENCY_BUCKETS)
        # Counters are reported as increments of the engine's running totals since the last report;
        # a rebuilt engine's totals start again from zero.
        self._engine = None
        self._last: list[float] | None = None
        self._last_wall = None
        self._restarts = 0

    def report(self, now: float) -> None:
        engine = self.source.engine
        if engine is not self._engine:
            self._engine, self._last = engine, None
        stats, bm = engine.stats, engine.block_manager
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.blocks_used.set(bm.num_used_blocks)
        self.blocks_free.set(bm.num_free_blocks)
        self.prefix_hit_rate.set(bm.prefix_stats.hit_rate)
        restarts = getattr(self.source, "num_restarts", 0)
        if restarts > self._restarts:
            self.restarts.increment(restarts - self._restarts)
            self._restarts = restarts
        counters = [(self.prompt_tokens, stats.num_prompt_tokens), (self.generation_tokens, stats.num_generation_tokens),
                    (self.preemptions, engine.scheduler.num_preemptions), (self.forward_seconds, stats.forward_seconds),
                    (self.steps, stats.num_steps), (self.idle_seconds, stats.idle_seconds)]
        counters += [(self.phases[phase], stats.phase_seconds[phase]) for phase in PHASES]
        totals = [total for _, total in counters]
        deltas = [total - last for total, last in zip(totals, self._last or [0] * len(totals))]
        for (metric, _), delta in zip(counters, deltas):
            if delta > 0:
                metric.increment(delta)
        if self._last_wall is not None and now > self._last_wall:
            self.forward_busy.set(min(1.0, deltas[3] / (now - self._last_wall)))
        self._last, self._last_wall = totals, now
        ttft, itl = stats.take_latencies()
        for value in ttft:
            self.ttft.observe(value)
        for value in itl:
            self.itl.observe(value)
